// The weights.cuh types' device code on the CPU: repack.cu's kernels and embed.cu's lookups run thread by
// thread; each weight struct's load/dot (the matvec inner product) and deq_half_row (the GEMM tile) per block.
// One entry point, host_run, called through ctypes by tests/test_kernel_host.py.
#include "weights.cuh"
#include "repack.cu"
#include "embed.cu"
#include "matmul_tiles.cuh"

static void one_thread(long long b) { blockDim.x = 1; threadIdx.x = 0; blockIdx.x = (unsigned)b; }

// y[c, r] = sum over blocks of W::dot (no epilogue), deq [rows, cols] fp16 = the GEMM's dequantized tiles.
template <typename W>
static void products(const W& w, int rows, int cols, const int8_t* xq, const float4* xd, int ncols, float* y,
                     __half* deq) {
    const int nb = cols / QK;
    for (int c = 0; c < ncols; c++)
        for (int r = 0; r < rows; r++) {
            float acc = 0;
            for (int kb = 0; kb < nb; kb++) acc += W::dot(w.load(r, kb), load_x(xq, xd, cols, c, kb));
            y[(size_t)c * rows + r] = acc;
        }
    for (int r = 0; r < rows; r++)
        for (int kb = 0; kb < nb; kb++)
            for (int h = 0; h < 2; h++) {
                __half v[16];
                deq_half_row(w, r, kb, h, v);
                memcpy(deq + (size_t)r * cols + kb * QK + h * 16, v, sizeof v);
            }
}

// q: type name (q5_0, ...); src: GGUF bytes; p: the layout's arrays (kernels.py LAYOUTS order), written here;
// tokens[n] -> x [n, cols] * scale (embed); (xq, xd) q8x2 [ncols, cols] -> y [ncols, rows]; deq [rows, cols].
extern "C" int host_run(const char* q, const uint8_t* src, void** p, int rows, int cols, const int* tokens, int n,
                        float scale, float* x, const int8_t* xq, const float4* xd, int ncols, float* y,
                        __half* deq) {
    const long long nblocks = (long long)rows * cols / QK;
    const std::string t(q);
#define RUN(NAME, WT, REPACK, ...)                                                              \
    if (t == #NAME) {                                                                           \
        for (long long b = 0; b < nblocks; b++) { one_thread(b); REPACK; }                     \
        for (int i = 0; i < n; i++) { one_thread(i); embed_##NAME(tokens, __VA_ARGS__, x, cols, scale); } \
        products(WT{__VA_ARGS__, cols / QK}, rows, cols, xq, xd, ncols, y, deq);                \
        return 0;                                                                               \
    }
    RUN(q5_0, Q5_0W, repack_q5_0(src, (uint4*)p[0], (uint32_t*)p[1], (__half*)p[2], nblocks),
        (const uint4*)p[0], (const uint32_t*)p[1], (const __half*)p[2])
    RUN(q5_1, Q5_1W, repack_q5_1(src, (uint4*)p[0], (uint32_t*)p[1], (__half*)p[2], (__half*)p[3], nblocks),
        (const uint4*)p[0], (const uint32_t*)p[1], (const __half*)p[2], (const __half*)p[3])
    RUN(q4_k, Q4_KW, repack_q4_k(src, (uint4*)p[0], (uint4*)p[1], nblocks), (const uint4*)p[0], (const uint4*)p[1])
    RUN(q5_k, Q5_KW, repack_q5_k(src, (uint4*)p[0], (uint32_t*)p[1], (uint4*)p[2], nblocks), (const uint4*)p[0],
        (const uint32_t*)p[1], (const uint4*)p[2])
    RUN(q6_k, Q6_KW, repack_q6_k(src, (uint4*)p[0], (uint2*)p[1], (char2*)p[2], (__half*)p[3], nblocks),
        (const uint4*)p[0], (const uint2*)p[1], (const char2*)p[2], (const __half*)p[3])
    RUN(q3_k, Q3_KW, repack_q3_k(src, (uint2*)p[0], (uint32_t*)p[1], (char2*)p[2], (__half*)p[3], nblocks),
        (const uint2*)p[0], (const uint32_t*)p[1], (const char2*)p[2], (const __half*)p[3])
    RUN(q2_k, Q2_KW, repack_q2_k(src, (uint2*)p[0], (uchar2*)p[1], (__half*)p[2], (__half*)p[3], nblocks),
        (const uint2*)p[0], (const uchar2*)p[1], (const __half*)p[2], (const __half*)p[3])
    RUN(iq4_nl, IQ4_NLW, repack_iq4_nl(src, (uint8_t*)p[0], (__half*)p[1], nblocks), (const uint4*)p[0],
        (const __half*)p[1])
    RUN(iq4_xs, IQ4_XSW, repack_iq4_xs(src, (uint4*)p[0], (int8_t*)p[1], (__half*)p[2], nblocks),
        (const uint4*)p[0], (const int8_t*)p[1], (const __half*)p[2])
    return 1;
}

// The pipelined GEMM's dequantization of its raw shared-memory stage (cuda/matmul.cu Mm2Q4/Mm2Q8_0::dequant),
// per (row, block, half) as its threads do: the quant bytes of the half, the 4-byte word holding d[b] (and m[b]) at
// element b & ~1 (d, m need one spare element past the end), scale_of's half by b's parity. q: q4_0, q4_1 or q8_0;
// or q4_k, matmul2w's tile of it (deq_q4k_half; d: the super-block headers, m unused); out [rows, cols] fp16 in
// weight order.
extern "C" int host_mm2_deq(const char* q, const uint8_t* qs, const __half* d, const __half* m, int rows, int cols,
                            __half* out) {
    const std::string t(q);
    const int nb = cols / QK;
    for (int r = 0; r < rows; r++)
        for (int kb = 0; kb < nb; kb++)
            for (int h = 0; h < 2; h++) {
                const long long b = (long long)r * nb + kb;
                __half* o = out + (size_t)r * cols + kb * QK;
                if (t == "q4_k") {
                    uint2 q8;
                    memcpy(&q8, qs + b * 16 + 8 * h, 8);
                    const KHeader k = k_header(reinterpret_cast<const uint4*>(d)[b >> 3], (int)(b & 7));
                    uint32_t lo[4], hi[4];
                    deq_q4k_half(q8, k.dl, -k.ml, lo, hi);
                    memcpy(o + 8 * h, lo, 16);
                    memcpy(o + 16 + 8 * h, hi, 16);
                    continue;
                }
                uint32_t dw, mw;
                memcpy(&dw, d + (b & ~1LL), 4);
                if (t == "q8_0") {
                    uint4 q16;
                    memcpy(&q16, qs + b * 32 + 16 * h, 16);
                    uint32_t w[8];
                    deq_q8_half(q16, scale_of(dw, b), w);
                    memcpy(o + 16 * h, w, 32);
                    continue;
                }
                uint2 q8;
                memcpy(&q8, qs + b * 16 + 8 * h, 8);
                uint32_t lo[4], hi[4];
                if (t == "q4_1") {
                    memcpy(&mw, m + (b & ~1LL), 4);
                    deq_q4_half<true>(q8, scale_of(dw, b), scale_of(mw, b), lo, hi);
                } else if (t == "q4_0") {
                    deq_q4_half<false>(q8, scale_of(dw, b), scale_of(dw, b), lo, hi);
                } else {
                    return 1;
                }
                memcpy(o + 8 * h, lo, 16);
                memcpy(o + 16 + 8 * h, hi, 16);
            }
    return 0;
}

// matmul2r's lanes over a weight matrix: per (row r, block b, lane column c) the block's quant words c/2 and
// 2 + c/2 go to frag(b, c, w0, w1, regs), whose four registers are put back at the weights they hold (b0: 2c, 2c+1;
// b1: 2c+8, 2c+9; chunk 1 the same + 16).
template <typename Frag>
static void fragment_weights(const uint8_t* qs, int rows, int cols, __half* out, Frag frag) {
    const int nb = cols / QK;
    for (int r = 0; r < rows; r++)
        for (int kb = 0; kb < nb; kb++)
            for (int c = 0; c < 4; c++) {
                const long long b = (long long)r * nb + kb;
                uint32_t w0, w1, regs[4];
                memcpy(&w0, qs + b * 16 + 4 * (c >> 1), 4);
                memcpy(&w1, qs + b * 16 + 8 + 4 * (c >> 1), 4);
                frag(b, c, w0, w1, regs);
                __half* o = out + (size_t)r * cols + kb * QK;
                const int at[4] = {2 * c, 2 * c + 8, 16 + 2 * c, 24 + 2 * c};
                for (int i = 0; i < 4; i++) memcpy(o + at[i], &regs[i], 4);
            }
}

// matmul2r's dequantization into mma B fragments (matmul_tiles.cuh deq_q4_frag), as its lanes do
// (fragment_weights): the row's d (and m) of the block. Arguments as host_mm2_deq (q4_k: deq_q4k_frag, the block's
// scale and min from its super-block header in d).
extern "C" int host_mm2r_deq(const char* q, const uint8_t* qs, const __half* d, const __half* m, int rows, int cols,
                             __half* out) {
    const std::string t(q);
    if (t != "q4_0" && t != "q4_1" && t != "q4_k") return 1;
    fragment_weights(qs, rows, cols, out, [&](long long b, int c, uint32_t w0, uint32_t w1, uint32_t (&regs)[4]) {
        if (t == "q4_k") {
            const KHeader k = k_header(reinterpret_cast<const uint4*>(d)[b >> 3], (int)(b & 7));
            deq_q4k_frag(w0, w1, c, k.dl, -k.ml, regs);
        } else if (t == "q4_1")
            deq_q4_frag<true>(w0, w1, c, d[b], m[b], regs);
        else
            deq_q4_frag<false>(w0, w1, c, d[b], d[b], regs);
    });
    return 0;
}

// matmul2r's Q6_K fragments (matmul_tiles.cuh deq_q6k_frag), as its lanes do (fragment_weights): the block's
// high-bit words, its two sub-block scales times the super-block's d. Arrays as soa-v2 packs them (qs u8[16], qh
// u32[2], sc i8[2] per block; d f16 per 256); out as host_mm2_deq's.
extern "C" int host_mm2r_q6k_deq(const uint8_t* qs, const uint32_t* qh, const int8_t* sc, const __half* d, int rows,
                                 int cols, __half* out) {
    fragment_weights(qs, rows, cols, out, [&](long long b, int c, uint32_t w0, uint32_t w1, uint32_t (&regs)[4]) {
        const float dd = __half2float(d[b >> 3]);
        const float dl0 = __fmul_rn(dd, i2f_exact(sc[2 * b])), dl1 = __fmul_rn(dd, i2f_exact(sc[2 * b + 1]));
        deq_q6k_frag(w0, w1, qh[2 * b], qh[2 * b + 1], c, dl0, dl1, regs);
    });
    return 0;
}
