// Weight types as the matvec, GEMM and embedding kernels see them: one struct per soa-v2 layout (common.cuh).
//
// Every type is read in 32-weight blocks (kb = block index along a row, nb = blocks per row). A struct holds
// the layout's array pointers and nb, and gives:
//   Block load(r, kb)                      the block's packed quants and its fp32 scale(s), from global memory
//   void prefetch(r, kb)                   the bytes load(r, kb) reads, into L2 (matvec.cu: before the PDL wait)
//   static float dot(Block, XBlock)        sum_j w[j] * x[j] against a q8x2 activation block (integer dp4a)
//   static void words(Block, lo, hi)       the unsigned quant codes as int8 bytes: lo = weights 0..15, hi 16..31
//   static float dot_words(Block, lo, hi, XBlock)   dot() from words() taken once (Q4_0, Q4_1, Q4_K, Q6_K: the
//                                          several-column matvec unpacks a block once, not once per column);
//                                          dot() is words() then dot_words(), so the two give the same bits
//   static float deq(Block, lo, hi, i)     weight i in fp32, bit-identical to gguf's dequantization (the same
//                                          fp32 products in the same order; __fmul_rn/__fadd_rn keep nvcc from
//                                          contracting them into an fma, which would round once instead of twice)
// The bits stay packed in memory (4-, 5-, 6-, 2- and 3-bit codes); the unpacking to int8 bytes happens in
// registers, a few shift/and/or per 4 weights.
#pragma once
#include "common.cuh"

// One q8x2 activation block: coarse and fine int8 levels (16 bytes each half) and (d1, d2, sum, sum of 0..15).
struct XBlock { int4 c0, c1, f0, f1; float4 d; };

__device__ __forceinline__ XBlock load_x(const int8_t* xq, const float4* xd, int cols, int c, int kb) {
    const int4* p = reinterpret_cast<const int4*>(xq + (size_t)c * 2 * cols + kb * 2 * QK);
    return {p[0], p[1], p[2], p[3], xd[(size_t)c * (cols / QK) + kb]};
}

__device__ __forceinline__ int dot4(const int4& a, const int4& b, int s = 0) {
    s = __dp4a(a.x, b.x, s); s = __dp4a(a.y, b.y, s); s = __dp4a(a.z, b.z, s); s = __dp4a(a.w, b.w, s);
    return s;
}

__device__ __forceinline__ int dot8(const int4& a0, const int4& a1, const int4& b0, const int4& b1) {
    return dot4(a1, b1, dot4(a0, b0));
}

// (float)i for |i| < 2^22, exactly: i added to the significand of 1.5 * 2^23 (whose ulp is 1), then that bias
// subtracted. An integer add and a float add at full rate instead of I2F, which sm_80..sm_90 run at 16 lanes per
// SM per clock (an eighth of the FMA rate): the dot products' sums (|i| <= 32 * 127 * 63) and the K-quants'
// 6-bit scales and mins go through here, bit-identical to the conversion.
__device__ __forceinline__ float i2f_exact(int i) { return __int_as_float(0x4B400000 + i) - 12582912.0f; }

// --- unpacking packed codes to int8 bytes (words lo = weights 0..15, hi = 16..31, byte b of word k = weight 4k+b)

// 4-bit codes, byte j = w[j] | w[j+16] << 4.
__device__ __forceinline__ void nibble_words(const uint4& q, int4& lo, int4& hi) {
    lo = make_int4(q.x & 0x0F0F0F0F, q.y & 0x0F0F0F0F, q.z & 0x0F0F0F0F, q.w & 0x0F0F0F0F);
    hi = make_int4((q.x >> 4) & 0x0F0F0F0F, (q.y >> 4) & 0x0F0F0F0F, (q.z >> 4) & 0x0F0F0F0F, (q.w >> 4) & 0x0F0F0F0F);
}

// One extra bit per weight in a u32 H: bit k of byte b is weight 4k+b's, so word k's bits are (H >> k) & 0x01010101.
// OR-ed in at bit position `at` (4: Q5's fifth bit; 2: Q3_K's third).
__device__ __forceinline__ void add_bit_words(int4& lo, int4& hi, uint32_t H, int at) {
    lo.x |= ((H >> 0) & 0x01010101) << at; lo.y |= ((H >> 1) & 0x01010101) << at;
    lo.z |= ((H >> 2) & 0x01010101) << at; lo.w |= ((H >> 3) & 0x01010101) << at;
    hi.x |= ((H >> 4) & 0x01010101) << at; hi.y |= ((H >> 5) & 0x01010101) << at;
    hi.z |= ((H >> 6) & 0x01010101) << at; hi.w |= ((H >> 7) & 0x01010101) << at;
}

// Two bits per weight for 16 weights in a u32 P: bits 2k..2k+1 of byte b are weight 4k+b's.
__device__ __forceinline__ int4 crumb_words(uint32_t P, int at) {
    return make_int4((P & 0x03030303) << at, ((P >> 2) & 0x03030303) << at, ((P >> 4) & 0x03030303) << at,
                     ((P >> 6) & 0x03030303) << at);
}

// Byte i (0..31) of the words; i is a constant after unrolling, so this is a register shift.
__device__ __forceinline__ int code_at(const int4& lo, const int4& hi, int i) {
    const int w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    return (w[i >> 2] >> (8 * (i & 3))) & 0xFF;
}

// (d1*coarse + d2*fine) over all 32 weights, and over each half (the K-quants with 16-weight sub-blocks).
__device__ __forceinline__ float full_dot(const int4& lo, const int4& hi, const XBlock& x) {
    return x.d.x * i2f_exact(dot8(lo, hi, x.c0, x.c1)) + x.d.y * i2f_exact(dot8(lo, hi, x.f0, x.f1));
}
__device__ __forceinline__ float2 half_dots(const int4& lo, const int4& hi, const XBlock& x) {
    return make_float2(x.d.x * i2f_exact(dot4(lo, x.c0)) + x.d.y * i2f_exact(dot4(lo, x.f0)),
                       x.d.x * i2f_exact(dot4(hi, x.c1)) + x.d.y * i2f_exact(dot4(hi, x.f1)));
}

#ifndef MV_UNROLL_Q4
// 16-byte Q4 blocks loaded per row per lane before the first use. Measured on the H200 (cuda/PERF.md): 1 beats
// 2 and 4, the extra registers cost more occupancy than the deeper per-warp pipeline buys.
#define MV_UNROLL_Q4 1
#endif
// BLOCKS, B1_BLOCKS (every struct): blocks of 4 warps per SM that the matvec kernels ask the compiler to fit
// (__launch_bounds__ in matvec.cu, sm_90 only), which caps their registers. Chosen from ptxas -v and the SASS
// (cuobjdump -sass) on sm_90:
//   BLOCKS, the any-column kernel: 7 (72 registers) where it compiles without spilling (left alone, ptxas took
//     72-102 registers, 4-7 blocks).
//   B1_BLOCKS, the one-column kernel matvec_<type>_b1: the most blocks at which ptxas still issues all of a
//     step's weight loads before the first instruction that waits on one. Tighter, it saves registers by issuing
//     some (the scales' small loads, typically) only after the quants have arrived: a second DRAM round trip
//     per step, worth more than the extra warps. Q4_0, Q4_K, Q2_K 8 (64 registers); Q4_1, Q8_0, Q5_0, Q5_K,
//     Q3_K 7 (72); Q5_1, Q6_K, IQ4_NL, IQ4_XS 6 (80).
// --- Q5_0 / Q5_1: qs u8[16], qh u32, d f16 (, m f16) per 32 weights. w = d*(q-16) | d*q + m
#define Q5_0_PARAMS const uint4* qs, const uint32_t* qh, const __half* d
#define Q5_0_ARGS qs, qh, d
struct Q5_0W {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 7;
    const uint4* qs; const uint32_t* qh; const __half* d; int nb;
    struct Block { uint4 q; uint32_t h; float d; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        return {qs[b], qh[b], __half2float(d[b])};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, qh + b, d + b);
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) {
        nibble_words(w.q, lo, hi); add_bit_words(lo, hi, w.h, 4);
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return w.d * (full_dot(lo, hi, x) - 16.0f * x.d.z);
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fmul_rn((float)(code_at(lo, hi, i) - 16), w.d);
    }
};

#define Q5_1_PARAMS const uint4* qs, const uint32_t* qh, const __half* d, const __half* m
#define Q5_1_ARGS qs, qh, d, m
struct Q5_1W {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 6;
    const uint4* qs; const uint32_t* qh; const __half* d; const __half* m; int nb;
    struct Block { uint4 q; uint32_t h; float d, m; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        return {qs[b], qh[b], __half2float(d[b]), __half2float(m[b])};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, qh + b, d + b, m + b);
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) {
        nibble_words(w.q, lo, hi); add_bit_words(lo, hi, w.h, 4);
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return w.d * full_dot(lo, hi, x) + w.m * x.d.z;
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fadd_rn(__fmul_rn((float)code_at(lo, hi, i), w.d), w.m);
    }
};

// --- Q4_K / Q5_K: per 32 weights qs u8[16] (, qh u32); per 256 a 16-byte header kept as GGUF has it: f16 d,
// f16 dmin, 12 bytes of 6-bit scales and mins (get_scale_min_k4). One 16-byte load gives a lane its sub-block's
// scale and min; the 8 lanes of a super-block read the same header (one L1 line). w = (d*sc)*q - (dmin*m): the
// two products are rounded to fp32 first, as gguf does.
struct KHeader { float dl, ml; };
__device__ __forceinline__ KHeader k_header(const uint4& h, int s) {
    // scales[j], scales[j+4], scales[j+8] (j = s % 4) are byte j of h.y, h.z, h.w: two byte permutes gather
    // them into V = by | bz << 8 | bw << 16. Then s < 4: sc = by & 63, m = bz & 63; s >= 4: sc = bw & 15 |
    // (by >> 6) << 4, m = bw >> 4 | (bz >> 6) << 4. Both cases are ((V >> a) & ka) | ((V >> 2 or 10) & kb) with
    // the sub-block's shifts and masks (kb = 0 for s < 4): four integer ops each, no select between two decodes.
    // (s is kb % 8 = the lane's index % 8 in the matvec: the same every iteration.)
    const int j = s & 3;
    const uint32_t V = __byte_perm(__byte_perm(h.y, h.z, j | (j + 4) << 4), h.w, 0x10 | (j + 4) << 8);
    const bool upper = s >= 4;
    const uint32_t ka = upper ? 0x0F : 0x3F, kb = upper ? 0x30 : 0;
    const uint32_t sc = ((V >> (upper ? 16 : 0)) & ka) | ((V >> 2) & kb);
    const uint32_t m = ((V >> (upper ? 20 : 8)) & ka) | ((V >> 10) & kb);
    const float d = __half2float(__ushort_as_half((unsigned short)(h.x & 0xFFFF)));
    const float dmin = __half2float(__ushort_as_half((unsigned short)(h.x >> 16)));
    return {__fmul_rn(d, i2f_exact((int)sc)), __fmul_rn(dmin, i2f_exact((int)m))};
}

// The types the tensor-core kernels dequantize from raw shared-memory stages (matmul.cu's fragment and wgmma GEMMs,
// matvec.cu's matvec_<type>_mma): Q4_0 (d), Q4_1 (d, m) and Q4_K (the headers above, read as 16-byte chunks); Q6_K
// (below: low bits, high bits, sub-block scales, d) in the fragment GEMM (matmul2r) only.
enum class Fq { Q4_0, Q4_1, Q4_K, Q6_K };

#define Q4_K_PARAMS const uint4* qs, const uint4* sc
#define Q4_K_ARGS qs, sc
struct Q4_KW {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 8;
    static constexpr int STAGE_ARRAYS = 2;   // matvec_<type>_b1s: bytes per 256 weights of qs, sc
    __device__ static constexpr int stage_b8(int a) { constexpr int b[STAGE_ARRAYS] = {128, 16}; return b[a]; }
    const uint4* qs; const uint4* sc; int nb;
    struct Block { uint4 q; float dl, ml; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        const KHeader k = k_header(sc[b >> 3], kb & 7);   // nb % 8 == 0: sub-block kb % 8 of super-block b / 8
        return {qs[b], k.dl, k.ml};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, sc + (b >> 3));
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) { nibble_words(w.q, lo, hi); }
    __device__ __forceinline__ static float dot_words(const Block& w, const int4& lo, const int4& hi,
                                                      const XBlock& x) {
        return w.dl * full_dot(lo, hi, x) - w.ml * x.d.z;
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return dot_words(w, lo, hi, x);
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fsub_rn(__fmul_rn(w.dl, (float)code_at(lo, hi, i)), w.ml);
    }
};

#define Q5_K_PARAMS const uint4* qs, const uint32_t* qh, const uint4* sc
#define Q5_K_ARGS qs, qh, sc
struct Q5_KW {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 7;
    const uint4* qs; const uint32_t* qh; const uint4* sc; int nb;
    struct Block { uint4 q; uint32_t h; float dl, ml; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        const KHeader k = k_header(sc[b >> 3], kb & 7);
        return {qs[b], qh[b], k.dl, k.ml};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, qh + b, sc + (b >> 3));
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) {
        nibble_words(w.q, lo, hi); add_bit_words(lo, hi, w.h, 4);
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return w.dl * full_dot(lo, hi, x) - w.ml * x.d.z;
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fsub_rn(__fmul_rn(w.dl, (float)code_at(lo, hi, i)), w.ml);
    }
};

// --- Q6_K: per 32 weights ql u8[16], qh u32[2] (two high bits: weights 0..15, 16..31), sc i8[2] (one per 16);
// per 256 d f16. w = (d*sc)*(q-32).
#define Q6_K_PARAMS const uint4* qs, const uint2* qh, const char2* sc, const __half* d
#define Q6_K_ARGS qs, qh, sc, d
struct Q6_KW {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 6;
    static constexpr int STAGE_ARRAYS = 4;   // matvec_<type>_b1s: bytes per 256 weights of qs, qh, sc, d
    __device__ static constexpr int stage_b8(int a) { constexpr int b[STAGE_ARRAYS] = {128, 64, 16, 2}; return b[a]; }
    const uint4* qs; const uint2* qh; const char2* sc; const __half* d; int nb;
    // The scales stay raw in the block (char2 and f16: two registers, not two floats) and become d*sc in dot():
    // load() then does no arithmetic on its bytes, which lets the matvec issue all of a step's loads at once
    // (with the products in load(), ptxas issued the scale loads after the quants' DRAM round trip, sm_90 SASS).
    struct Block { uint4 q; uint2 h; char2 s; __half d; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        return {qs[b], qh[b], sc[b], d[b >> 3]};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, qh + b, sc + b, d + (b >> 3));
    }
    __device__ __forceinline__ static float2 scales(const Block& w) {   // (d*sc0, d*sc1), rounded as gguf does
        const float dd = __half2float(w.d);
        return make_float2(__fmul_rn(dd, i2f_exact(w.s.x)), __fmul_rn(dd, i2f_exact(w.s.y)));
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) {
        nibble_words(w.q, lo, hi);
        const int4 a = crumb_words(w.h.x, 4), b = crumb_words(w.h.y, 4);
        lo.x |= a.x; lo.y |= a.y; lo.z |= a.z; lo.w |= a.w;
        hi.x |= b.x; hi.y |= b.y; hi.z |= b.z; hi.w |= b.w;
    }
    __device__ __forceinline__ static float dot_words(const Block& w, const int4& lo, const int4& hi,
                                                      const XBlock& x) {
        const float2 s = half_dots(lo, hi, x);   // x.d.w: sum of x over weights 0..15
        const float2 dl = scales(w);
        return dl.x * (s.x - 32.0f * x.d.w) + dl.y * (s.y - 32.0f * (x.d.z - x.d.w));
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return dot_words(w, lo, hi, x);
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        const float2 dl = scales(w);
        return __fmul_rn(i < 16 ? dl.x : dl.y, (float)(code_at(lo, hi, i) - 32));
    }
};

// --- Q3_K: per 32 weights ql u32[2] (two low bits), qh u32 (third bit), sc i8[2] (sc - 32, one per 16);
// per 256 d f16. w = (d*sc)*(q - 4), q = low | hbit << 2 in 0..7 (gguf: low - 4 when the hmask bit is clear).
#define Q3_K_PARAMS const uint2* qs, const uint32_t* qh, const char2* sc, const __half* d
#define Q3_K_ARGS qs, qh, sc, d
struct Q3_KW {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 7;
    const uint2* qs; const uint32_t* qh; const char2* sc; const __half* d; int nb;
    struct Block { uint2 q; uint32_t h; float d0, d1; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        const char2 s = sc[b];
        const float dd = __half2float(d[b >> 3]);
        return {qs[b], qh[b], __fmul_rn(dd, i2f_exact(s.x)), __fmul_rn(dd, i2f_exact(s.y))};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, qh + b, sc + b, d + (b >> 3));
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) {
        lo = crumb_words(w.q.x, 0); hi = crumb_words(w.q.y, 0); add_bit_words(lo, hi, w.h, 2);
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        const float2 s = half_dots(lo, hi, x);
        return w.d0 * (s.x - 4.0f * x.d.w) + w.d1 * (s.y - 4.0f * (x.d.z - x.d.w));
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fmul_rn(i < 16 ? w.d0 : w.d1, (float)(code_at(lo, hi, i) - 4));
    }
};

// --- Q2_K: per 32 weights qs u32[2] (two bits), sc u8[2] (scale | min << 4, one per 16); per 256 d, dmin f16.
// w = (d*sc)*q - (dmin*m).
#define Q2_K_PARAMS const uint2* qs, const uchar2* sc, const __half* d, const __half* m
#define Q2_K_ARGS qs, sc, d, m
struct Q2_KW {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 8;
    const uint2* qs; const uchar2* sc; const __half* d; const __half* m; int nb;
    struct Block { uint2 q; float d0, d1, m0, m1; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        const uchar2 s = sc[b];
        const float dd = __half2float(d[b >> 3]), mm = __half2float(m[b >> 3]);
        return {qs[b], __fmul_rn(dd, i2f_exact(s.x & 0xF)), __fmul_rn(dd, i2f_exact(s.y & 0xF)),
                __fmul_rn(mm, i2f_exact(s.x >> 4)), __fmul_rn(mm, i2f_exact(s.y >> 4))};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, sc + b, d + (b >> 3), m + (b >> 3));
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) {
        lo = crumb_words(w.q.x, 0); hi = crumb_words(w.q.y, 0);
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        const float2 s = half_dots(lo, hi, x);
        return w.d0 * s.x + w.d1 * s.y - (w.m0 * x.d.w + w.m1 * (x.d.z - x.d.w));
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fsub_rn(__fmul_rn(i < 16 ? w.d0 : w.d1, (float)code_at(lo, hi, i)), i < 16 ? w.m0 : w.m1);
    }
};

// --- IQ4_NL / IQ4_XS: 4-bit indices into a 16-entry int8 codebook (ggml's kvalues_iq4nl), nibble order.
// IQ4_NL: per 32 weights qs u8[16], d f16; w = d * kv[q]. IQ4_XS: per 32 weights qs u8[16], sc i8 (the 6-bit
// scale minus 32); per 256 d f16; w = (d*sc) * kv[q]. words() gives the codebook values (signed bytes), which
// dp4a multiplies directly.
// The codebook as 4 little-endian words of 4 int8 (kvalues_iq4nl in ggml-common.h, quants.py KVALUES_IQ4NL).
#define IQ4_PACK(a, b, c, d) \
    ((uint32_t)(uint8_t)(a) | (uint32_t)(uint8_t)(b) << 8 | (uint32_t)(uint8_t)(c) << 16 | (uint32_t)(uint8_t)(d) << 24)
#define IQ4_T0 IQ4_PACK(-127, -104, -83, -65)
#define IQ4_T1 IQ4_PACK(-49, -35, -22, -10)
#define IQ4_T2 IQ4_PACK(1, 13, 25, 38)
#define IQ4_T3 IQ4_PACK(53, 69, 89, 113)

// 4 indices (one per byte, 0..15) -> their 4 codebook bytes: a byte permute within each half of the table, then
// one between the halves by each index's bit 3 (ggml's get_int_from_table_16, per word).
__device__ __forceinline__ int iq4_lookup(int idx) {
    const uint32_t sel = (idx & 0x7) | ((idx >> 4) & 0x70) | ((idx >> 8) & 0x700) | ((idx >> 12) & 0x7000);
    const uint32_t hb = (idx & 0x8) | ((idx >> 4) & 0x80) | ((idx >> 8) & 0x800) | ((idx >> 12) & 0x8000);
    const uint32_t lo = __byte_perm(IQ4_T0, IQ4_T1, sel), hi = __byte_perm(IQ4_T2, IQ4_T3, sel);
    return (int)__byte_perm(lo, hi, 0x3210 | (hb >> 1));
}

__device__ __forceinline__ void iq4_words(const uint4& q, int4& lo, int4& hi) {
    nibble_words(q, lo, hi);
    lo = make_int4(iq4_lookup(lo.x), iq4_lookup(lo.y), iq4_lookup(lo.z), iq4_lookup(lo.w));
    hi = make_int4(iq4_lookup(hi.x), iq4_lookup(hi.y), iq4_lookup(hi.z), iq4_lookup(hi.w));
}

// Codebook value i (0..31) of the words: the signed byte.
__device__ __forceinline__ float kv_at(const int4& lo, const int4& hi, int i) {
    return (float)(int8_t)code_at(lo, hi, i);
}

#define IQ4_NL_PARAMS const uint4* qs, const __half* d
#define IQ4_NL_ARGS qs, d
struct IQ4_NLW {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 6;
    const uint4* qs; const __half* d; int nb;
    struct Block { uint4 q; float d; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        return {qs[b], __half2float(d[b])};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, d + b);
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) { iq4_words(w.q, lo, hi); }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return w.d * full_dot(lo, hi, x);
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fmul_rn(kv_at(lo, hi, i), w.d);
    }
};

#define IQ4_XS_PARAMS const uint4* qs, const int8_t* sc, const __half* d
#define IQ4_XS_ARGS qs, sc, d
struct IQ4_XSW {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 6;
    const uint4* qs; const int8_t* sc; const __half* d; int nb;
    struct Block { uint4 q; float dl; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        return {qs[b], __fmul_rn(__half2float(d[b >> 3]), i2f_exact(sc[b]))};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b, sc + b, d + (b >> 3));
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) { iq4_words(w.q, lo, hi); }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return w.dl * full_dot(lo, hi, x);
    }
    __device__ __forceinline__ static float deq(const Block& w, const int4& lo, const int4& hi, int i) {
        return __fmul_rn(w.dl, kv_at(lo, hi, i));
    }
};

// Weights [h*16, h*16+16) of block kb of row r as fp16 (the GEMM's tile, matmul.cu): gguf's exact fp32 value,
// rounded once. h is 0 or 1; each branch unrolls with constant indices, so the codes stay in registers.
template <typename W>
__device__ __forceinline__ void deq_half_row(const W& w, long long r, int kb, int h, __half (&v)[16]) {
    const typename W::Block b = w.load(r, kb);
    int4 lo, hi;
    W::words(b, lo, hi);
    if (h == 0) {
#pragma unroll
        for (int i = 0; i < 16; i++) v[i] = __float2half(W::deq(b, lo, hi, i));
    } else {
#pragma unroll
        for (int i = 0; i < 16; i++) v[i] = __float2half(W::deq(b, lo, hi, 16 + i));
    }
}

// Every soa-v2 type with a generic struct: X(name, struct, kernel parameters, struct initializers).
#define FOR_EACH_GENERIC_TYPE(X)                         \
    X(q5_0, Q5_0W, Q5_0_PARAMS, Q5_0_ARGS)               \
    X(q5_1, Q5_1W, Q5_1_PARAMS, Q5_1_ARGS)               \
    X(q4_k, Q4_KW, Q4_K_PARAMS, Q4_K_ARGS)               \
    X(q5_k, Q5_KW, Q5_K_PARAMS, Q5_K_ARGS)               \
    X(q6_k, Q6_KW, Q6_K_PARAMS, Q6_K_ARGS)               \
    X(q3_k, Q3_KW, Q3_K_PARAMS, Q3_K_ARGS)               \
    X(q2_k, Q2_KW, Q2_K_PARAMS, Q2_K_ARGS)               \
    X(iq4_nl, IQ4_NLW, IQ4_NL_PARAMS, IQ4_NL_ARGS)       \
    X(iq4_xs, IQ4_XSW, IQ4_XS_PARAMS, IQ4_XS_ARGS)
