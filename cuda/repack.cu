// Weight repacking at load time: GGUF block arrays -> the "soa-v2" layout described in common.cuh.
//
// GGUF blocks are 18 (Q4_0), 20 (Q4_1), 22 (Q5_0), 34 (Q8_0) ... 210 (Q6_K) bytes, so a row of them cannot be
// read with aligned 16-byte loads. These kernels split every row into contiguous quant, high-bit, scale and min
// arrays. One thread per block of 32 weights; `nblocks` = rows * cols / 32 over the whole matrix (for the
// K-quants, block b is sub-block b % 8 of GGUF super-block b / 8; the thread of sub-block 0 writes d/dmin).
// The thread first reads its 32 codes in GGUF's bit positions (quants.py documents them), then writes them in
// the soa-v2 orders; the reads follow runtime/model/quants.py line by line.
// convert_bf16_f16 / convert_f32_f16 turn unquantized matrices into the F16 layout the GEMMs read.
#include "common.cuh"

// Q4_0 and IQ4_NL: 18-byte blocks (f16 d, u8 qs[16]).
__device__ __forceinline__ void split_18(const uint8_t* __restrict__ src, uint8_t* __restrict__ qs,
                                         __half* __restrict__ d, long long nblocks) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const uint8_t* blk = src + b * 18;                       // f16 d, u8 qs[16]
    d[b] = *reinterpret_cast<const __half*>(blk);            // 2-byte aligned: 18 is even
    uint8_t* out = qs + b * 16;
#pragma unroll
    for (int i = 0; i < 16; i++) out[i] = blk[2 + i];
}

extern "C" __global__ void repack_q4_0(const uint8_t* __restrict__ src, uint8_t* __restrict__ qs,
                                       __half* __restrict__ d, long long nblocks) {
    INGOT_PDL_ENTRY();
    split_18(src, qs, d, nblocks);
}

extern "C" __global__ void repack_q4_1(const uint8_t* __restrict__ src, uint8_t* __restrict__ qs,
                                       __half* __restrict__ d, __half* __restrict__ m, long long nblocks) {
    INGOT_PDL_ENTRY();
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const uint8_t* blk = src + b * 20;                       // f16 d, f16 m, u8 qs[16]
    d[b] = *reinterpret_cast<const __half*>(blk);
    m[b] = *reinterpret_cast<const __half*>(blk + 2);
    uint8_t* out = qs + b * 16;
#pragma unroll
    for (int i = 0; i < 16; i++) out[i] = blk[4 + i];
}

extern "C" __global__ void repack_q8_0(const uint8_t* __restrict__ src, int8_t* __restrict__ qs,
                                       __half* __restrict__ d, long long nblocks) {
    INGOT_PDL_ENTRY();
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const uint8_t* blk = src + b * 34;                       // f16 d, i8 qs[32]
    d[b] = *reinterpret_cast<const __half*>(blk);
    int8_t* out = qs + b * 32;
#pragma unroll
    for (int i = 0; i < 32; i++) out[i] = (int8_t)blk[2 + i];
}

extern "C" __global__ void convert_bf16_f16(const uint16_t* __restrict__ src, __half* __restrict__ dst, long long n) {
    INGOT_PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2half(__uint_as_float((uint32_t)src[i] << 16));
}

extern "C" __global__ void convert_f32_f16(const float* __restrict__ src, __half* __restrict__ dst, long long n) {
    INGOT_PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2half(src[i]);
}

// --- soa-v2 writers: 32 codes u[i] (only the bits named are used) -> one block's arrays.

// Low 4 bits, nibble order: byte j = u[j] | u[j+16] << 4.
__device__ __forceinline__ void put_nibbles(const uint8_t (&u)[32], uint8_t* out) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        w[k] = 0;
#pragma unroll
        for (int b = 0; b < 4; b++) w[k] |= (uint32_t)((u[4 * k + b] & 0xF) | (u[16 + 4 * k + b] & 0xF) << 4) << (8 * b);
    }
    *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Bit `bit` of every code, bit order: weight 4k+b -> bit k of byte b.
__device__ __forceinline__ uint32_t bit_plane(const uint8_t (&u)[32], int bit) {
    uint32_t h = 0;
#pragma unroll
    for (int i = 0; i < 32; i++) h |= (uint32_t)((u[i] >> bit) & 1) << (8 * (i % 4) + i / 4);
    return h;
}

// Bits `bit`, `bit`+1 of codes 16*half .. 16*half+15, crumb order: weight 4k+b -> bits 2k..2k+1 of byte b.
__device__ __forceinline__ uint32_t crumb_plane(const uint8_t (&u)[32], int bit, int half) {
    uint32_t p = 0;
#pragma unroll
    for (int j = 0; j < 16; j++) p |= (uint32_t)((u[16 * half + j] >> bit) & 3) << (8 * (j % 4) + 2 * (j / 4));
    return p;
}

__device__ __forceinline__ __half ld_half(const uint8_t* p) {   // GGUF blocks are only 2-byte aligned
    return __ushort_as_half((uint16_t)(p[0] | p[1] << 8));
}

// GGUF's Q4_0-style nibbles of a 16-byte array: code j < 16 is the low nibble of byte j, j >= 16 the high of j-16.
__device__ __forceinline__ void get_nibbles(const uint8_t* qs, uint8_t (&u)[32]) {
#pragma unroll
    for (int j = 0; j < 16; j++) { u[j] = qs[j] & 0xF; u[j + 16] = qs[j] >> 4; }
}

// Q5_0 (22 bytes: d, qh u32, qs[16]) and Q5_1 (24 bytes: d, m, qh, qs): fifth bit j = bit j of qh.
template <bool HAS_MIN>
__device__ __forceinline__ void repack_q5(const uint8_t* src, uint4* qs, uint32_t* qh, __half* d, __half* m,
                                          long long nblocks) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const uint8_t* blk = src + b * (HAS_MIN ? 24 : 22);
    const uint8_t* h = blk + (HAS_MIN ? 4 : 2);
    const uint32_t bits = h[0] | h[1] << 8 | h[2] << 16 | (uint32_t)h[3] << 24;
    uint8_t u[32];
    get_nibbles(h + 4, u);
#pragma unroll
    for (int j = 0; j < 32; j++) u[j] |= ((bits >> j) & 1) << 4;
    put_nibbles(u, reinterpret_cast<uint8_t*>(qs + b));
    qh[b] = bit_plane(u, 4);
    d[b] = ld_half(blk);
    if (HAS_MIN) m[b] = ld_half(blk + 2);
}

extern "C" __global__ void repack_q5_0(const uint8_t* __restrict__ src, uint4* __restrict__ qs,
                                       uint32_t* __restrict__ qh, __half* __restrict__ d, long long nblocks) {
    INGOT_PDL_ENTRY();
    repack_q5<false>(src, qs, qh, d, nullptr, nblocks);
}

extern "C" __global__ void repack_q5_1(const uint8_t* __restrict__ src, uint4* __restrict__ qs,
                                       uint32_t* __restrict__ qh, __half* __restrict__ d, __half* __restrict__ m,
                                       long long nblocks) {
    INGOT_PDL_ENTRY();
    repack_q5<true>(src, qs, qh, d, m, nblocks);
}

// Q4_K (144 bytes: d, dmin, scales[12], qs[128]) and Q5_K (176: d, dmin, scales[12], qh[32], qs[128]).
// Sub-block s, weight l: nibble (s odd: high) of qs[32*(s/2) + l]; fifth bit = bit s of qh[l]. The 16-byte
// header (d, dmin, scales) is copied as it is, by the thread of sub-block 0.
template <bool FIVE>
__device__ __forceinline__ void repack_k45(const uint8_t* src, uint4* qs, uint32_t* qh, uint4* sc, long long nblocks) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const int s = b % 8;
    const uint8_t* blk = src + (b / 8) * (FIVE ? 176 : 144);
    const uint8_t* q = blk + (FIVE ? 48 : 16) + 32 * (s / 2);
    uint8_t u[32];
#pragma unroll
    for (int l = 0; l < 32; l++) {
        u[l] = (q[l] >> (4 * (s & 1))) & 0xF;
        if (FIVE) u[l] |= ((blk[16 + l] >> s) & 1) << 4;
    }
    put_nibbles(u, reinterpret_cast<uint8_t*>(qs + b));
    if (FIVE) qh[b] = bit_plane(u, 4);
    if (s == 0) {
        uint32_t h[4];
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = blk[4 * i] | blk[4 * i + 1] << 8 | blk[4 * i + 2] << 16 | (uint32_t)blk[4 * i + 3] << 24;
        sc[b / 8] = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

extern "C" __global__ void repack_q4_k(const uint8_t* __restrict__ src, uint4* __restrict__ qs,
                                       uint4* __restrict__ sc, long long nblocks) {
    INGOT_PDL_ENTRY();
    repack_k45<false>(src, qs, nullptr, sc, nblocks);
}

extern "C" __global__ void repack_q5_k(const uint8_t* __restrict__ src, uint4* __restrict__ qs,
                                       uint32_t* __restrict__ qh, uint4* __restrict__ sc, long long nblocks) {
    INGOT_PDL_ENTRY();
    repack_k45<true>(src, qs, qh, sc, nblocks);
}

// Q6_K (210 bytes: ql[128], qh[64], i8 scales[16], d). Weight 128h + 32j + l of the super-block (sub-block
// s = 4h + j): low 4 bits from ql[64h + l + 32(j&1)] (high nibble for j >= 2), high 2 bits = bits 2j..2j+1 of
// qh[32h + l]; scale per 16 weights.
extern "C" __global__ void repack_q6_k(const uint8_t* __restrict__ src, uint4* __restrict__ qs,
                                       uint2* __restrict__ qh, char2* __restrict__ sc, __half* __restrict__ d,
                                       long long nblocks) {
    INGOT_PDL_ENTRY();
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const int s = b % 8, h = s / 4, j = s % 4;
    const uint8_t* blk = src + (b / 8) * 210;
    uint8_t u[32];
#pragma unroll
    for (int l = 0; l < 32; l++)
        u[l] = ((blk[64 * h + l + 32 * (j & 1)] >> (4 * (j / 2))) & 0xF) | ((blk[128 + 32 * h + l] >> (2 * j)) & 3) << 4;
    put_nibbles(u, reinterpret_cast<uint8_t*>(qs + b));
    qh[b] = make_uint2(crumb_plane(u, 4, 0), crumb_plane(u, 4, 1));
    sc[b] = make_char2((int8_t)blk[192 + 2 * s], (int8_t)blk[193 + 2 * s]);
    if (s == 0) d[b / 8] = ld_half(blk + 208);
}

// Q2_K (84 bytes: scales[16], qs[64], d, dmin) and Q3_K (110: hmask[32], qs[64], scales[12], d): weight
// 128h + 32j + l has its two low bits at bits 2j..2j+1 of qs[32h + l]; Q3_K's third bit is bit 4h + j of
// hmask[l] (set: q as is, clear: q - 4; stored as set = +4 so q - 4 is the code minus 4).
extern "C" __global__ void repack_q2_k(const uint8_t* __restrict__ src, uint2* __restrict__ qs,
                                       uchar2* __restrict__ sc, __half* __restrict__ d, __half* __restrict__ m,
                                       long long nblocks) {
    INGOT_PDL_ENTRY();
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const int s = b % 8, h = s / 4, j = s % 4;
    const uint8_t* blk = src + (b / 8) * 84;
    uint8_t u[32];
#pragma unroll
    for (int l = 0; l < 32; l++) u[l] = (blk[16 + 32 * h + l] >> (2 * j)) & 3;
    qs[b] = make_uint2(crumb_plane(u, 0, 0), crumb_plane(u, 0, 1));
    sc[b] = make_uchar2(blk[2 * s], blk[2 * s + 1]);
    if (s == 0) { d[b / 8] = ld_half(blk + 80); m[b / 8] = ld_half(blk + 82); }
}

extern "C" __global__ void repack_q3_k(const uint8_t* __restrict__ src, uint2* __restrict__ qs,
                                       uint32_t* __restrict__ qh, char2* __restrict__ sc, __half* __restrict__ d,
                                       long long nblocks) {
    INGOT_PDL_ENTRY();
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const int s = b % 8, h = s / 4, j = s % 4;
    const uint8_t* blk = src + (b / 8) * 110;
    uint8_t u[32];
#pragma unroll
    for (int l = 0; l < 32; l++) u[l] = ((blk[32 + 32 * h + l] >> (2 * j)) & 3) | ((blk[l] >> (4 * h + j)) & 1) << 2;
    qs[b] = make_uint2(crumb_plane(u, 0, 0), crumb_plane(u, 0, 1));
    qh[b] = bit_plane(u, 2);
    // 16 6-bit scales: sub-block k's low 4 bits in nibble k / 8 of scales[k % 8], high 2 bits at bits
    // 2 * (k / 4) of scales[8 + k % 4]; minus 32.
    const uint8_t* k6 = blk + 96;
    int8_t v[2];
#pragma unroll
    for (int t = 0; t < 2; t++) {
        const int k = 2 * s + t;
        const int low = (k6[k % 8] >> (4 * (k / 8))) & 0xF, high = (k6[8 + k % 4] >> (2 * (k / 4))) & 3;
        v[t] = (int8_t)((low | high << 4) - 32);
    }
    sc[b] = make_char2(v[0], v[1]);
    if (s == 0) d[b / 8] = ld_half(blk + 108);
}

// IQ4_NL (18 bytes: d, qs[16]) is Q4_0's block with other values: the same split.
extern "C" __global__ void repack_iq4_nl(const uint8_t* __restrict__ src, uint8_t* __restrict__ qs,
                                         __half* __restrict__ d, long long nblocks) {
    INGOT_PDL_ENTRY();
    split_18(src, qs, d, nblocks);
}

// IQ4_XS (136 bytes: d, u16 scales_h, u8 scales_l[4], qs[128]): sub-block s is qs[16s .. 16s+16] in nibble order;
// its 6-bit scale is nibble s % 2 of scales_l[s / 2] plus bits 2s..2s+1 of scales_h at bit 4, minus 32.
extern "C" __global__ void repack_iq4_xs(const uint8_t* __restrict__ src, uint4* __restrict__ qs,
                                         int8_t* __restrict__ sc, __half* __restrict__ d, long long nblocks) {
    INGOT_PDL_ENTRY();
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const int s = b % 8;
    const uint8_t* blk = src + (b / 8) * 136;
    uint8_t u[32];
    get_nibbles(blk + 8 + 16 * s, u);
    put_nibbles(u, reinterpret_cast<uint8_t*>(qs + b));
    const int scales_h = blk[2] | blk[3] << 8;
    const int ls = ((blk[4 + s / 2] >> (4 * (s % 2))) & 0xF) | ((scales_h >> (2 * s)) & 3) << 4;
    sc[b] = (int8_t)(ls - 32);
    if (s == 0) d[b / 8] = ld_half(blk);
}
