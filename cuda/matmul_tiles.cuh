// Dequantization of one row's half block (16 weights) of Q4_0, Q4_1 and Q8_0 to fp16, from the raw soa-v2 bytes
// that cuda/matmul.cu's pipelined GEMM (matmul2_*) copies into shared memory with cp.async, and of Q4_0, Q4_1 and
// Q4_K into the fragment kernels' registers (matmul2r, matmul2w, matmul2t). Plain per-thread
// code (no shared-memory or warp built-ins), so tests/test_kernel_host.py also runs it on the CPU against gguf.
//
// The arithmetic is fp16 on pairs (half2): a code q (0..255) placed in the low mantissa bits of 1024.0
// (0x6400 | q) is the fp16 value 1024 + q exactly; subtracting 1024 + offset gives q - offset exactly (integers
// below 2048 are exact in fp16), and one multiply (Q4_0, Q8_0) or one fma (Q4_1) by the fp16 scale rounds once.
// That is the value the WMMA kernel (matmul.cu, TileQ4_0/TileQ8_0) writes, __float2half(d * (q - offset)), whose
// fp32 product is exact (an 11-bit scale times a code of at most 8 bits): both are the exact product rounded to
// fp16 once. Q4_1's d*q + m rounds once here and twice there (fp32, then fp16): at most one fp16 ulp apart.
// No int->float conversions (I2F runs at a quarter of the FMA rate on sm_80..sm_90), 2 weights per instruction.
#pragma once
#include "common.cuh"

// half2 from its raw 32 bits (low half = the first weight)
__device__ __forceinline__ __half2 u32_as_half2(uint32_t u) {
    __half2 h;
    memcpy(&h, &u, 4);
    return h;
}
__device__ __forceinline__ uint32_t half2_as_u32(__half2 h) {
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}

// The scale of block b from the 4-byte word holding fp16 elements b & ~1 and b | 1 (the GEMM copies that aligned
// word, cp.async has no 2-byte size): element b is its low half when b is even.
__device__ __forceinline__ __half scale_of(uint32_t word, long long b) {
    const unsigned short s = (unsigned short)((b & 1) ? word >> 16 : word & 0xFFFF);
    return __ushort_as_half(s);
}

// Q4_0 / Q4_1, nibble order (byte j = w[j] | w[j+16] << 4): the 8 bytes q8 = bytes 8h..8h+7 of the block give
// weights 8h..8h+7 (low nibbles) -> lo[0..7] and 16+8h..16+8h+7 (high nibbles) -> hi[0..7]. q8 as two words
// (little-endian: byte 0 = bits 0..7 of x).
// Q4_1: w = d*q + m (min != nullptr path), Q4_0: w = d*(q - 8).
template <bool MIN>
__device__ __forceinline__ void deq_q4_half(uint2 q8, __half d, __half m, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
    const __half2 d2 = __half2half2(d), m2 = __half2half2(m);
    const __half2 bias = __half2half2(__ushort_as_half(MIN ? 0x6400 : 0x6408));   // 1024 (+ 8 for Q4_0)
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t u = ((j < 2 ? q8.x : q8.y) >> (16 * (j & 1))) & 0xFFFF;   // bytes 2j, 2j+1
        // low nibbles of the two bytes at bits 0..3 and 16..19; high nibbles likewise
        const uint32_t l = (u & 0x000F) | ((u & 0x0F00) << 8) | 0x64006400;
        const uint32_t h = ((u >> 4) & 0x000F) | ((u & 0xF000) << 4) | 0x64006400;
        const __half2 ql = __hsub2(u32_as_half2(l), bias), qh = __hsub2(u32_as_half2(h), bias);
        lo[j] = half2_as_u32(MIN ? __hfma2(ql, d2, m2) : __hmul2(ql, d2));
        hi[j] = half2_as_u32(MIN ? __hfma2(qh, d2, m2) : __hmul2(qh, d2));
    }
}

// Q8_0: 16 signed bytes q16 (weights 16h..16h+15 of the block) -> w[0..7] as 8 half2 words, w = d*q.
__device__ __forceinline__ void deq_q8_half(uint4 q16, __half d, uint32_t (&w)[8]) {
    const __half2 d2 = __half2half2(d);
    const __half2 bias = __half2half2(__ushort_as_half(0x6480));   // 1024 + 128: q ^ 0x80 = q + 128 as unsigned
    const uint32_t words[4] = {q16.x, q16.y, q16.z, q16.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t v = words[k] ^ 0x80808080;
        // bytes (v0, 0x64, v1, 0x64) and (v2, 0x64, v3, 0x64): halfs 1024 + v
        const uint32_t p0 = __byte_perm(v, 0x64646464, 0x4140), p1 = __byte_perm(v, 0x64646464, 0x4342);
        w[2 * k] = half2_as_u32(__hmul2(__hsub2(u32_as_half2(p0), bias), d2));
        w[2 * k + 1] = half2_as_u32(__hmul2(__hsub2(u32_as_half2(p1), bias), d2));
    }
}

// Q4_K in the fragment kernels (matmul2r, matmul2w, matmul2t): Q4_1's nibble bytes, with the block's scale and min
// as fp32 from its super-block header (weights.cuh k_header: dl = d*sc, ml = dmin*m; nml = -ml). w = dl*q - ml: the
// product is exact in fp32 (an 11-bit fp16 d times a 6-bit sc times a 4-bit code: at most 21 bits), so one fma
// rounds where gguf's product and subtraction round once; the fp16 conversion then rounds as matmul2's tile does
// (__float2half of Q4_KW::deq): the same fp16 weights, bit for bit. x: two codes at bits 0..3 and 16..19.
__device__ __forceinline__ uint32_t deq_q4k_pair(uint32_t x, float dl, float nml) {
    const __half2 q = __hsub2(u32_as_half2(x | 0x64006400), __half2half2(__ushort_as_half(0x6400)));   // exact
    const float2 f = __half22float2(q);
    return half2_as_u32(__floats2half2_rn(fmaf(dl, f.x, nml), fmaf(dl, f.y, nml)));
}

// Q4_K's deq_q4_half (matmul2w's fp16 weight tile): weights 8h.. and 16+8h.. of the block from its bytes 8h..8h+7.
__device__ __forceinline__ void deq_q4k_half(uint2 q8, float dl, float nml, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t u = ((j < 2 ? q8.x : q8.y) >> (16 * (j & 1))) & 0xFFFF;   // bytes 2j, 2j+1
        lo[j] = deq_q4k_pair((u & 0x000F) | ((u & 0x0F00) << 8), dl, nml);
        hi[j] = deq_q4k_pair(((u >> 4) & 0x000F) | ((u & 0xF000) << 4), dl, nml);
    }
}

// Q4_0 / Q4_1 straight into mma.m16n8k16 B fragments (matmul2r: no fp16 tile). Lane (g, c) holds, for weight row
// g of an n8 tile, b0 = weights 2c, 2c+1 and b1 = 2c+8, 2c+9 of a k16 chunk: of a 32-weight block's chunk 0 the
// low nibbles of bytes 2c, 2c+1, 2c+8, 2c+9, of chunk 1 their high nibbles. w0, w1: the block's words 2c/4 and
// 2 + 2c/4 (bytes 4*(c/2).. and 8 + 4*(c/2)..), which hold those bytes at half c%2. Out: b[0], b[1] chunk 0's b0,
// b1; b[2], b[3] chunk 1's. The same fp16 operations as deq_q4_half (the same bits: 1024 + q exact, one rounding).
template <bool MIN>
__device__ __forceinline__ void deq_q4_frag(uint32_t w0, uint32_t w1, int c, __half d, __half m, uint32_t (&b)[4]) {
    const __half2 d2 = __half2half2(d), m2 = __half2half2(m);
    const __half2 bias = __half2half2(__ushort_as_half(MIN ? 0x6400 : 0x6408));   // 1024 (+ 8 for Q4_0)
    const uint32_t sel = (c & 1) ? 0x4342 : 0x4140;   // the half's two bytes to bytes 0 and 2, zeros between
    const uint32_t u0 = __byte_perm(w0, 0, sel), u1 = __byte_perm(w1, 0, sel);
    const uint32_t x[4] = {u0, u1, u0 >> 4, u1 >> 4};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const __half2 q = __hsub2(u32_as_half2((x[j] & 0x000F000F) | 0x64006400), bias);
        b[j] = half2_as_u32(MIN ? __hfma2(q, d2, m2) : __hmul2(q, d2));
    }
}

// Q4_K's deq_q4_frag: the same lanes, words and fragment order, each weight as deq_q4k_pair makes it.
__device__ __forceinline__ void deq_q4k_frag(uint32_t w0, uint32_t w1, int c, float dl, float nml, uint32_t (&b)[4]) {
    const uint32_t sel = (c & 1) ? 0x4342 : 0x4140;
    const uint32_t u0 = __byte_perm(w0, 0, sel), u1 = __byte_perm(w1, 0, sel);
    const uint32_t x[4] = {u0, u1, u0 >> 4, u1 >> 4};
#pragma unroll
    for (int j = 0; j < 4; j++) b[j] = deq_q4k_pair(x[j] & 0x000F000F, dl, nml);
}

// Q6_K into the same fragments (matmul2r_q6_k): its low 4 bits are Q4's nibble bytes (the same words w0, w1 and
// byte selection), its two high bits per weight come from hx (weights 0..15) and hy (16..31), bits 2k..2k+1 of byte
// b holding weight 4k+b's: the lane's weights 2c, 2c+1 sit in bytes 2(c%2), 2(c%2)+1 at bit 2(c/2), and 2c+8, 2c+9
// in the same bytes 4 bits higher. A 6-bit code q in the low mantissa of 1024.0 is exactly 1024 + q in fp16, so
// q - 32 is exact; dl = d*sc is exact in fp32 (an 11-bit d times a 7-bit sc) and so is dl*(q - 32) (at most 23
// bits): one rounding to fp16, gguf's value rounded as matmul2's tile rounds it (Q6_KW::deq). dl0 scales chunk 0
// (weights 0..15), dl1 chunk 1.
__device__ __forceinline__ void deq_q6k_frag(uint32_t w0, uint32_t w1, uint32_t hx, uint32_t hy, int c, float dl0,
                                             float dl1, uint32_t (&b)[4]) {
    const uint32_t sel = (c & 1) ? 0x4342 : 0x4140;
    const uint32_t u0 = __byte_perm(w0, 0, sel), u1 = __byte_perm(w1, 0, sel);
    const int k = 2 * (c >> 1);
    const uint32_t h0 = __byte_perm(hx, 0, sel) >> k, h1 = __byte_perm(hy, 0, sel) >> k;
    constexpr uint32_t NIB = 0x000F000F, LOW2 = 0x00030003, HIGH2 = 0x00300030;   // codes at bits 0..5, 16..21
    const uint32_t x[4] = {(u0 & NIB) | (h0 & LOW2) << 4, (u1 & NIB) | (h0 & HIGH2),
                           (u0 >> 4 & NIB) | (h1 & LOW2) << 4, (u1 >> 4 & NIB) | (h1 & HIGH2)};
    const __half2 bias = __half2half2(__ushort_as_half(0x6420));   // 1024 + 32
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 f = __half22float2(__hsub2(u32_as_half2(x[j] | 0x64006400), bias));
        const float dl = j < 2 ? dl0 : dl1;
        b[j] = half2_as_u32(__floats2half2_rn(f.x * dl, f.y * dl));
    }
}
