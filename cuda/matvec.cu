// Quantized matrix-vector products for decode: y[c, r] = sum_k W[r, k] * x[c, k] for a few columns c
// (one per sequence in the decode batch), W in the soa-v2 layout of common.cuh.
//
// Decode is memory-bound: every weight byte is read once per step. Each warp owns two weight rows; each lane
// takes whole 32-weight blocks (one 16-byte load of Q4 quants, two for Q8_0), so a warp reads 512
// contiguous bytes per row per step. Activations arrive quantized to q8x2 (common.cuh: two int8 levels per
// value) and the inner products are integer (dp4a), as in ggml's mmvq but with a second int8 level that
// carries the first level's rounding error: 32 weights cost ~20 integer instructions and the result matches
// fp32 activations to ~1e-5 (ggml's single int8 level costs ~0.5% per product, which compounds over layers).
// A block (4 warps) serves up to 4 columns at once; blockIdx.y picks the group of 4 columns. (Wider decode
// batches use the tensor-core GEMM of matmul.cu instead: there the weights are read once for all columns.)
//
// Types: Q4_0/Q4_1/Q8_0 below, the others through their weights.cuh structs (the same loop; K-quants also
// take one 32-weight sub-block per lane, with its scale from the super-block's d).
//
// Epilogue modes:
//   MODE_STORE   y[c*ldy + r]  = dot (+ bias[r])
//   MODE_ADD     y[c*ldy + r] += dot (+ bias[r])         (residual connections)
//   MODE_SWIGLU  y[c*ldy + r]  = silu(W[r]·x) * (W[r + rows]·x), r < rows: W is [gate; up] stacked
//   MODE_GEGLU   y[c*ldy + r]  = gelu_tanh(W[r]·x) * (W[r + rows]·x), likewise (Gemma)
//
// The next RMSNorm, fused (single-stream decode of pre-norm blocks, cuda/PERF.md v21). A residual projection
// x += W·a is always followed by h = rmsnorm(x) * w_next, which the next product reads as q8x2. Instead of a norm
// launch between them (65 a token on the 8B, 2.7 us each):
//   matvec_<type>_b1n  x += W·a at one column in blocks of MVN_WARPS warps, 32 rows: the block's new x values are
//                      one q8x2 block, so it writes q8x2(x * w_next) (unnormalized: q8x2 levels do not depend on
//                      a common factor) and ss[block] = the sum of their squares.
//   matvec_<type>_b1   given ss (else null), multiplies each product by rsqrt(sum(ss) / cols + eps): the norm's
//                      scale, a scalar per row, taken out of the dot. Each lane loads one float4 of the cols / 32
//                      partials before the main loop (so cols <= MV_NORM_MAX) and every warp sums them in the same
//                      order (warp_sum's butterfly), so all rows get the same bits.
#include "mma.cuh"       // mma_u8s8: the narrow kernel's integer tensor-core product
#include "weights.cuh"   // XBlock, dot helpers and the generic weight structs of the soa-v2 types
#include <type_traits>   // matvec_staged: the element type of each array pointer

struct Q4_0W {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 8;   // weights.cuh, next to MV_UNROLL_Q4
    static constexpr int STAGE_ARRAYS = 2;   // matvec_<type>_b1s: bytes per 256 weights of qs, d
    __device__ static constexpr int stage_b8(int a) { constexpr int b[STAGE_ARRAYS] = {128, 16}; return b[a]; }
    const uint8_t* qs; const __half* d; int nb;
    struct Block { uint4 q; float d; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        return {reinterpret_cast<const uint4*>(qs)[b], __half2float(d[b])};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b * 16, d + b);
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) { nibble_words(w.q, lo, hi); }
    __device__ __forceinline__ static float dot_words(const Block& w, const int4& lo, const int4& hi,
                                                      const XBlock& x) {
        return w.d * (full_dot(lo, hi, x) - 8.0f * x.d.z);   // w = d*(q-8); x.d.z = sum of x
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return dot_words(w, lo, hi, x);
    }
};

struct Q4_1W {
    static constexpr int UNROLL = MV_UNROLL_Q4;
    static constexpr int BLOCKS = 7, B1_BLOCKS = 7;   // weights.cuh, next to MV_UNROLL_Q4
    static constexpr int STAGE_ARRAYS = 3;   // matvec_<type>_b1s: bytes per 256 weights of qs, d, m
    __device__ static constexpr int stage_b8(int a) { constexpr int b[STAGE_ARRAYS] = {128, 16, 16}; return b[a]; }
    const uint8_t* qs; const __half* d; const __half* m; int nb;
    struct Block { uint4 q; float d, m; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        return {reinterpret_cast<const uint4*>(qs)[b], __half2float(d[b]), __half2float(m[b])};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b * 16, d + b, m + b);
    }
    __device__ __forceinline__ static void words(const Block& w, int4& lo, int4& hi) { nibble_words(w.q, lo, hi); }
    __device__ __forceinline__ static float dot_words(const Block& w, const int4& lo, const int4& hi,
                                                      const XBlock& x) {
        return w.d * full_dot(lo, hi, x) + w.m * x.d.z;    // w = d*q + m
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        int4 lo, hi; words(w, lo, hi);
        return dot_words(w, lo, hi, x);
    }
};

struct Q8_0W {
    static constexpr int UNROLL = (MV_UNROLL_Q4 + 1) / 2;   // 32-byte blocks: the bytes in flight of Q4's
    static constexpr int BLOCKS = 6, B1_BLOCKS = 7;   // 7 blocks (72 registers) spill 52 bytes
    const int8_t* qs; const __half* d; int nb;
    struct Block { int4 q0, q1; float d; };
    __device__ __forceinline__ Block load(long long r, int kb) const {
        const long long b = r * nb + kb;
        const int4* p = reinterpret_cast<const int4*>(qs) + 2 * b;
        return {p[0], p[1], __half2float(d[b])};
    }
    __device__ __forceinline__ void prefetch(long long r, int kb) const {   // load()'s bytes, into L2
        const long long b = r * nb + kb;
        prefetch_l2(qs + b * 32, d + b);
    }
    __device__ __forceinline__ static float dot(const Block& w, const XBlock& x) {
        return w.d * (x.d.x * i2f_exact(dot8(w.q0, w.q1, x.c0, x.c1)) + x.d.y * i2f_exact(dot8(w.q0, w.q1, x.f0, x.f1)));
    }
};

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }
// GELU, tanh approximation, as the CPU reference (runtime/model/reference.py gelu_tanh).
__device__ __forceinline__ float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}
__device__ __forceinline__ bool gated(int mode) { return mode == MODE_SWIGLU || mode == MODE_GEGLU; }

// Rows this warp owns: two adjacent rows, or for the gated modes the pair (gate r, up r + rows). Blocks are
// MV_WARPS warps (MVN_WARPS for matvec_<type>_b1n).
__device__ __forceinline__ void warp_rows(int mode, int rows, long long r[2], bool ok[2], long long* out_row) {
    const int warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    if (gated(mode)) {
        const long long o = (long long)blockIdx.x * warps + warp;
        r[0] = o; r[1] = o + rows; ok[0] = ok[1] = o < rows; *out_row = o;
    } else {
        const long long o = ((long long)blockIdx.x * warps + warp) * 2;
        r[0] = o; r[1] = o + 1; ok[0] = o < rows; ok[1] = o + 1 < rows; *out_row = o;
    }
}

// Under PDL (sm_90) a kernel's blocks are scheduled while its predecessor drains, and sit at the wait until it
// completes. Before waiting, each warp asks for the weights of its first MV_PREFETCH_STEPS steps (its two rows,
// 32 blocks a step: a 4096-wide Q4 row whole) to be brought into L2, so their DRAM round trip overlaps the
// predecessor's tail instead of following it. Weights only: no kernel of a step writes them (common.cuh).
// The kernels' `pdl` flags (block-uniform, kernels.py; zero unless the kernel is launched with PDL):
//   PDL_PREFETCH  this prefetch (INGOT_WEIGHT_PREFETCH=0: off); column groups past the first (blockIdx.y > 0)
//                 read the same rows and skip it
//   PDL_LATE      trigger the next kernel's launch after the main loop instead of at entry (common.cuh)
#define MV_PREFETCH_STEPS 4
template <typename W>
__device__ __forceinline__ void prefetch_pair(const W& w, const long long r[2], bool second) {   // this lane's part
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int u = 0; u < MV_PREFETCH_STEPS; u++) {
        const int kb = lane + u * WARP;
        if (kb >= w.nb) break;
        w.prefetch(r[0], kb);
        if (second) w.prefetch(r[1], kb);
    }
}
template <typename W>
__device__ __forceinline__ void prefetch_rows(const W& w, int rows, int mode) {
    long long r[2], out_row; bool ok[2];
    warp_rows(mode, rows, r, ok, &out_row);
    if (!ok[0]) return;
    prefetch_pair(w, r, ok[1]);
}

// scale: the fused norm's (1 without one), on the product before the bias and the activation.
template <int NC>
__device__ __forceinline__ void write_out(float (&acc)[2][NC], int mode, const bool ok[2], long long out_row,
                                          const float* bias, float* y, int c0, int ldy, float scale) {
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const float v0 = warp_sum(acc[0][c]) * scale, v1 = warp_sum(acc[1][c]) * scale;
        if (threadIdx.x % WARP != 0) continue;
        float* yc = y + (size_t)(c0 + c) * ldy;
        if (gated(mode)) {
            if (ok[0]) yc[out_row] = (mode == MODE_SWIGLU ? silu(v0) : gelu_tanh(v0)) * v1;
        } else {
            const float v[2] = {v0, v1};
#pragma unroll
            for (int s = 0; s < 2; s++) {
                if (!ok[s]) continue;
                const float o = v[s] + (bias ? bias[out_row + s] : 0.0f);
                if (mode == MODE_ADD) yc[out_row + s] += o; else yc[out_row + s] = o;
            }
        }
    }
}

// matvec_<type>_b1n's blocks per row and lane in flight. It runs one 16-warp block an SM under PDL
// (Kernels.norm_smem), so each lane's chain of nb / 32 dependent weight round trips sets its time (the 8B's down:
// 14). A row of at least MVN_WIDE_BLOCKS blocks (every lane has two or more) takes two blocks a step, which with a
// one-block register bound (111 registers at Q4_0, sm_90a) issues both blocks' loads before the first product;
// shorter rows keep one. Two blocks a step for every row (H100, cuda/PERF.md v33) made the 8B's b1n launches 9.1
// -> 8.6 us and tg128 +4%, and SmolLM2's (rows of 18 and 48 blocks) 2.6 -> 2.9 us, tg128 -3%; this split (wide
// rows only) on the H200 (v34): 8B tg128 +2.6%, @ d4096 +2.3%, the SmolLM2 shape within its noise.
// Only sm_90 takes it: measured there; at sm_75 / sm_80 / sm_120, without a register bound, the two-block
// path spills 4-20 bytes in some types, so those keep one block a step until a GPU of theirs measures it.
#define MVN_WIDE_BLOCKS (2 * WARP)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define MVN_WIDE 1
#else
#define MVN_WIDE 0
#endif

// NC columns' q8x2 activation in shared memory as separate arrays (matvec_<type>_b1s and _bxs, and b1n where its
// shared memory holds it), column c at c * 80 * nb bytes: xs[4][nb] (the four 16-byte chunks c0, c1, f0, f1 of
// block kb at xs[i * nb + kb], so a warp's 32 lanes read 512 contiguous bytes where from global memory each reads
// 64 bytes apart), then xds[nb]. Column c of the input at xq + c * 64 * nb bytes and xd + c * nb (load_x's). Each
// thread loads every piece of its block kb (5 x NC) before it stores one: one L2 round trip per blockDim.x blocks
// of the row (a loop of one load and one store per piece waited a round trip per trip: 4-5 at the 8B's
// 14,336-wide rows, 18 at four columns). Copied by the whole block after the PDL wait; the caller synchronizes.
template <int NC = 1>
__device__ __forceinline__ void stage_x(unsigned char* smem, const int8_t* __restrict__ xq,
                                        const float4* __restrict__ xd, int nb) {
    for (int kb = threadIdx.x; kb < nb; kb += blockDim.x) {
        int4 q[NC][4];
        float4 d[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const int4* p = reinterpret_cast<const int4*>(xq + ((size_t)c * nb + kb) * 2 * QK);
#pragma unroll
            for (int k = 0; k < 4; k++) q[c][k] = p[k];
            d[c] = xd[(size_t)c * nb + kb];
        }
#pragma unroll
        for (int c = 0; c < NC; c++) {
            int4* xs = reinterpret_cast<int4*>(smem + (size_t)c * 80 * nb);
#pragma unroll
            for (int k = 0; k < 4; k++) xs[k * nb + kb] = q[c][k];
            reinterpret_cast<float4*>(smem + (size_t)c * 80 * nb + 64 * nb)[kb] = d[c];
        }
    }
}
__device__ __forceinline__ XBlock staged_x(const unsigned char* smem, int nb, int kb) {
    const int4* xs = reinterpret_cast<const int4*>(smem);
    return {xs[kb], xs[nb + kb], xs[2 * nb + kb], xs[3 * nb + kb], reinterpret_cast<const float4*>(smem + 64 * nb)[kb]};
}

// The main loop: acc[s][c] = row rr[s] of W times column c0 + c of x, this lane's share of the blocks.
// XS: x from shared memory as stage_x left it (xsm; one column), else from global memory.
template <typename W, int NC, int UN = 0, bool XS = false>
__device__ __forceinline__ void dot_rows(const W& w, const int8_t* __restrict__ xq, const float4* __restrict__ xd,
                                         int cols, int c0, const long long r[2], const bool ok[2],
                                         float (&acc)[2][NC], const unsigned char* xsm = nullptr) {
    const int nb = cols / QK, lane = threadIdx.x % WARP;
    // One column (single-stream decode): every load is unconditional, so the compiler issues them all before
    // the first use. A second row past the end (an odd row count) re-reads row 0, and write_out drops its sum;
    // a block past the end of the row re-reads the last one. With a branch around each row's loads, the
    // K-quants' scale math (which needs its own row's bytes) kept the next row's loads from issuing: two DRAM
    // round trips per step instead of one (sm_90 SASS). Wider batches keep the branches: the unconditional
    // form costs their 4-column instance 9-12 registers (one block per SM), for a latency that four columns'
    // arithmetic mostly covers.
    constexpr bool FREE = NC == 1;
    const long long rr[2] = {r[0], FREE && !ok[1] ? r[0] : r[1]};
    // U blocks per row in flight per lane before the first use: decode is bound by how many bytes are in
    // flight to DRAM, not by arithmetic (fewer for wide batches, whose activation loads take the registers).
    constexpr int U = UN > 0 ? UN : NC <= 2 ? W::UNROLL : (W::UNROLL > 1 ? W::UNROLL / 2 : 1);
    for (int kb0 = lane; kb0 < nb; kb0 += U * WARP) {
        typename W::Block wb[U][2];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int s = 0; s < 2; s++) {
                if (FREE) wb[u][s] = w.load(rr[s], min(kb0 + u * WARP, nb - 1));
                else if (ok[s] && kb0 + u * WARP < nb) wb[u][s] = w.load(rr[s], kb0 + u * WARP);
            }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int kb = kb0 + u * WARP;
            if constexpr (FREE && U > 1) {
                // No branch: a block past the row's end (u > 0 only) re-reads the last one and adds 0. A `break`
                // here let ptxas sink block u's loads below it, to their use: one round trip a block, U or not.
                const XBlock x = XS ? staged_x(xsm, nb, min(kb, nb - 1)) : load_x(xq, xd, cols, c0, min(kb, nb - 1));
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const float d = W::dot(wb[u][s], x);
                    acc[s][0] += kb < nb ? d : 0.0f;
                }
                continue;
            }
            if (kb >= nb) break;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const XBlock x = XS ? staged_x(xsm, nb, kb) : load_x(xq, xd, cols, c0 + c, kb);
#pragma unroll
                for (int s = 0; s < 2; s++) if (FREE || ok[s]) acc[s][c] += W::dot(wb[u][s], x);
            }
        }
    }
}

// ss: the fused norm's partial sums (one column), or null.
template <typename W, int NC>
__device__ __forceinline__ void matvec_q(const W& w, const int8_t* __restrict__ xq, const float4* __restrict__ xd,
                                         const float* __restrict__ bias, float* __restrict__ y,
                                         int rows, int cols, int ldy, int mode, int pdl,
                                         const float4* __restrict__ ss = nullptr, float eps = 0.0f) {
    const int c0 = blockIdx.y * MV_COLS;
    long long r[2], out_row; bool ok[2];
    warp_rows(mode, rows, r, ok, &out_row);
    if (!ok[0]) return;   // the whole warp is past the last row (ok[1] implies ok[0]): nothing to write
    // The norm's partials: issued before the weights, summed after them (an L2 hit, not a second round trip).
    const int lane = threadIdx.x % WARP;
    float4 sv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (ss && lane * 4 < cols / QK) sv = ss[lane];
    float acc[2][NC] = {};
    dot_rows<W, NC>(w, xq, xd, cols, c0, r, ok, acc);
    if (pdl & PDL_LATE) INGOT_PDL_TRIGGER();
    const float scale = ss ? rsqrtf(warp_sum((sv.x + sv.y) + (sv.z + sv.w)) / cols + eps) : 1.0f;
    write_out<NC>(acc, mode, ok, out_row, bias, y, c0, ldy, scale);
}

// matvec_<type>_b1n's body: x[r] += W[r]·a for its 32 rows (rows % 32 == 0, so every warp has both of its rows),
// then q8x2(x[rows] * w_next[rows]) into block blockIdx.x of (yq, yd) and the sum of the new x's squares into
// ss[blockIdx.x]. The residual, bias and norm weights are loaded before the main loop: the epilogue then waits
// on nothing but the block's barrier.
template <typename W>
__device__ __forceinline__ void matvec_q_norm(const W& w, const int8_t* __restrict__ xq,
                                              const float4* __restrict__ xd, const float* __restrict__ bias,
                                              float* __restrict__ x, int rows, int cols,
                                              const float* __restrict__ w_next, int8_t* __restrict__ yq,
                                              float4* __restrict__ yd, float* __restrict__ ss, int pdl) {
    __shared__ float sx[2 * MVN_WARPS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = blockIdx.x;
    long long r[2], out_row; bool ok[2];
    warp_rows(MODE_ADD, rows, r, ok, &out_row);
    const float wn = warp == 0 ? w_next[g * QK + lane] : 0.0f;
    float x0 = 0.0f, x1 = 0.0f, b0 = 0.0f, b1 = 0.0f;
    if (lane == 0) {
        x0 = x[r[0]]; x1 = x[r[1]];
        if (bias) { b0 = bias[r[0]]; b1 = bias[r[1]]; }
    }
    float acc[2][1] = {};
    // sm_90, wide rows: the block's dynamic shared memory (Kernels.norm_smem: just over half an SM's, which keeps
    // one block an SM under PDL) holds x as separate arrays where it fits (80 bytes a block of the row; the 8B's
    // 14,336-wide down 35 KiB): the same products, without each lane's scattered activation loads (PERF.md v36:
    // the 8B's b1n 9.1 -> 6.7 us a launch). Narrow rows (SmolLM2's 18 and 48 blocks) keep their loads: there the
    // copy and its barrier before the first product cost what they save (graph +0.9%).
    extern __shared__ __align__(16) unsigned char mvn_x[];
    unsigned dyn = 0;
    if (MVN_WIDE) asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    const int nb = cols / QK;
    if (MVN_WIDE && nb >= MVN_WIDE_BLOCKS && dyn >= 80u * nb) {   // (block-uniform)
        stage_x(mvn_x, xq, xd, nb);
        __syncthreads();
        dot_rows<W, 1, 2, true>(w, xq, xd, cols, 0, r, ok, acc, mvn_x);
    } else if (MVN_WIDE && nb >= MVN_WIDE_BLOCKS) {
        dot_rows<W, 1, 2>(w, xq, xd, cols, 0, r, ok, acc);
    } else {
        dot_rows<W, 1>(w, xq, xd, cols, 0, r, ok, acc);
    }
    if (pdl & PDL_LATE) INGOT_PDL_TRIGGER();
    const float v0 = warp_sum(acc[0][0]), v1 = warp_sum(acc[1][0]);
    if (lane == 0) {
        const float n0 = x0 + (v0 + b0), n1 = x1 + (v1 + b1);   // write_out's MODE_ADD: y += dot + bias
        x[r[0]] = n0; x[r[1]] = n1;
        sx[2 * warp] = n0; sx[2 * warp + 1] = n1;
    }
    __syncthreads();
    if (warp == 0) {
        const float v = sx[lane], s2 = warp_sum(v * v);
        if (lane == 0) ss[g] = s2;
        warp_quantize_q8x2(v * wn, yq + (size_t)g * 2 * QK, yd + g);
    }
}

// matvec_<type>_b1s: matvec_<type>_b1's product, arguments and bits (the same lanes sum the same blocks in the
// same order), for sm_90, with the weights staged through shared memory by bulk asynchronous copies (TMA) instead
// of each lane's registers. Measured on an H100 (cuda/PERF.md v36): the one-column kernel is bound neither by its
// weight bytes in flight nor by its integer arithmetic but by its activation loads: each lane reads its q8x2
// block (64 + 16 bytes, 64 bytes apart from its neighbour's) from L1 every step, four times the wavefronts of a
// contiguous load. Here a block copies x once into shared memory as separate arrays (xs[c][kb]: chunk c of block
// kb, so a warp's 32 lanes read 512 contiguous bytes), and its warps are persistent: grid = one block an SM,
// MVS_WARPS warps, warp w of the grid (grid_warp) takes row pairs w, w + warps, ... (gated: (gate r, up r +
// rows)). Each warp keeps MVS_STAGES row pairs in flight, whole rows (2 x nb blocks of every array of the type:
// one bulk copy per row and array), in its own ring of stages; lane 0 refills a stage as soon as the warp has
// read it. The first stages are asked for before the PDL wait (weights: no kernel of a step writes them), so a
// kernel's first row pairs stream in while its predecessor finishes.
// Shared memory: x (80 bytes a block of the row), then MVS_WARPS x MVS_STAGES stages of stage_bytes, then one
// mbarrier a stage. Host conditions (kernels.py matvec_staged): cols % 256 == 0 and every array's row a multiple
// of 16 bytes (bulk copies), the whole at most the opt-in limit; ss as matvec_<type>_b1's (cols <= MV_NORM_MAX).
// W::stage_b8(a): bytes per 256 weights of the type's array a (of STAGE_ARRAYS), in argument order: LAYOUTS in
// kernels.py (tests/test_gpu_layouts.py compares them).
// One row of the type's array a (of STAGE_ARRAYS) at nb blocks of 32 weights, in bytes.
template <typename W>
__device__ __forceinline__ int stage_row_bytes(int nb, int a) { return (nb / 8) * W::stage_b8(a); }
template <typename W>
__device__ __forceinline__ int stage_bytes(int nb) {   // two rows of every array
    int b = 0;
#pragma unroll
    for (int a = 0; a < W::STAGE_ARRAYS; a++) b += W::stage_b8(a);
    return 2 * (nb / 8) * b;
}

// A persistent kernel's warp (b1s, bxs) as its grid numbers them: warp w of every block before warp w + 1 of any,
// so that tasks gw, gw + GW, ... handed out in this order spread over every SM when there are fewer than one a
// warp (the 8B's o and down projections at 4 columns: 1,024 tasks for 2,112 warps; numbered block by block, the
// warps of blocks 64-131 found none, half the SMs idle) and a last partial round spreads over all SMs too (the
// 8B's qkv in b1s: 3,072 row pairs, 32 on each of 60 SMs and 16 on the rest, block by block). H100, cuda/PERF.md
// v39: the 8B's bxs at 4 columns 28.7 -> 23.9 µs a launch, b1s 17.1 -> 16.1.
__device__ __forceinline__ long long grid_warp() {
    return (long long)(threadIdx.x / WARP) * gridDim.x + blockIdx.x;
}

// Row pair p of a persistent kernel (b1s, bxs): rows 2p and 2p + 1, the second clamped to the last row (an odd
// count re-reads it and drops its sum), or in the gated modes (gate p, up p + rows).
__device__ __forceinline__ void pair_rows(bool gate, int rows, long long p, long long r[2]) {
    if (gate) { r[0] = p; r[1] = p + rows; }
    else { r[0] = 2 * p; r[1] = min(2 * p + 1, (long long)rows - 1); }
}

// matvec_<type>_bxs (below): row pairs a warp takes at a time (the rows each staged x block serves: 2 x MVX_PAIRS),
// and blocks of each row in flight per lane. H100, the 8B at 2 / 3 / 4 columns (cuda/PERF.md v39): 1 x 2 834 /
// 1,109 / 1,265 tok/s, 1 x 4 789 / 1,095 / 1,285, 2 x 2 766 / 995 / 1,173, 2 x 1 746 / 975 / 1,160.
#define MVX_PAIRS 1
#define MVX_UNROLL 2

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The type's struct over one stage: each array's two rows back to back, arrays in argument order.
template <typename W, typename... P>
__device__ __forceinline__ W staged_rows(const unsigned char* stage, int nb, const P*... global) {
    int a = 0, off = 0;
    auto at = [&](const auto* g) {
        using T = typename std::remove_cv<typename std::remove_pointer<decltype(g)>::type>::type;
        const T* p = reinterpret_cast<const T*>(stage + off);
        off += 2 * stage_row_bytes<W>(nb, a++);
        return p;
    };
    return W{at(global)..., nb};
}

// Lane 0: rows r[0], r[1] of every array into `stage`, completing on `bar`.
template <typename W, typename... P>
__device__ __forceinline__ void stage_rows(unsigned char* stage, int nb, const long long r[2], uint64_t* bar,
                                           const P*... global) {
    mbar_expect(bar, stage_bytes<W>(nb));
    int a = 0, off = 0;
    auto copy = [&](const void* g) {
        const int row = stage_row_bytes<W>(nb, a++);
#pragma unroll
        for (int h = 0; h < 2; h++)
            bulk_copy(stage + off + h * row, static_cast<const unsigned char*>(g) + r[h] * row, row, bar);
        off += 2 * row;
    };
    (copy(global), ...);
}

template <typename W, typename... P>
__device__ __forceinline__ void matvec_staged(const int8_t* __restrict__ xq, const float4* __restrict__ xd,
                                              const float* __restrict__ bias, float* __restrict__ y, int rows,
                                              int cols, int ldy, int mode, int pdl, const float4* __restrict__ ss,
                                              float eps, const P*... global) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int nb = cols / QK, sb = stage_bytes<W>(nb);
    unsigned char* ring = smem + 80 * nb + warp * MVS_STAGES * sb;    // this warp's stages, after x (stage_x)
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 80 * nb + MVS_WARPS * MVS_STAGES * sb) + warp * MVS_STAGES;
    const bool gate = gated(mode);
    const long long pairs = gate ? rows : (rows + 1) / 2;
    const long long gw = grid_warp(), GW = (long long)gridDim.x * MVS_WARPS;
    const long long mine = gw < pairs ? (pairs - gw + GW - 1) / GW : 0;   // pairs gw, gw + GW, ...
    auto rows_of = [&](long long j, long long r[2]) { pair_rows(gate, rows, gw + j * GW, r); };
    long long next = 0;   // lane 0: the next pair to stage
    auto stage_next = [&]() {
        long long r[2];
        rows_of(next, r);
        const int s = (int)(next % MVS_STAGES);
        stage_rows<W>(ring + s * sb, nb, r, &bar[s], global...);
        next++;
    };
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < MVS_STAGES; s++) mbar_init(&bar[s]);
        mbar_init_fence();
        while (next < MVS_STAGES && next < mine) stage_next();
    }
    INGOT_PDL_WAIT();
    if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();
    stage_x(smem, xq, xd, nb);
    float4 sv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);   // the fused norm's partials, as matvec_q
    if (ss && lane * 4 < nb) sv = ss[lane];
    const float scale = ss ? rsqrtf(warp_sum((sv.x + sv.y) + (sv.z + sv.w)) / cols + eps) : 1.0f;
    __syncthreads();
    for (long long j = 0; j < mine; j++) {
        const int s = (int)(j % MVS_STAGES);
        const W w = staged_rows<W>(ring + s * sb, nb, global...);
        float acc[2][1] = {};
        mbar_wait(&bar[s], (unsigned)((j / MVS_STAGES) & 1));
        for (int kb = lane; kb < nb; kb += WARP) {
            const XBlock x = staged_x(smem, nb, kb);
#pragma unroll
            for (int h = 0; h < 2; h++) acc[h][0] += W::dot(w.load(h, kb), x);
        }
        __syncwarp();   // every lane has read stage s: lane 0 may refill it
        if (lane == 0 && next < mine) stage_next();
        long long r[2];
        rows_of(j, r);
        const bool ok[2] = {true, gate || r[1] != r[0]};
        write_out<1>(acc, mode, ok, r[0], bias, y, 0, ldy, scale);
    }
    if (pdl & PDL_LATE) INGOT_PDL_TRIGGER();
}

// One step of matvec_cols_staged: blocks kb0 + u * WARP (u < MVX_UNROLL) of its MVX_PAIRS x 2 rows against the
// NC staged columns. Each block is unpacked once (words) for its NC columns. FULL: every block is inside the row;
// else a block past the end re-reads the last one and adds nothing, the select around the sum (matvec_q's
// `acc += dot` lets the compiler fuse the add into the dot's last multiply, Q4_0's `w.d * (...)`: one FFMA, one
// rounding; `acc += kb < nb ? dot : 0` would round the product first, other bits).
template <typename W, int NC, bool FULL>
__device__ __forceinline__ void cols_staged_step(const W& w, const unsigned char* smem,
                                                 const long long (&r)[MVX_PAIRS][2], int kb0, int nb,
                                                 float (&acc)[MVX_PAIRS][2][NC]) {
    typename W::Block wb[MVX_UNROLL][MVX_PAIRS][2];
#pragma unroll
    for (int u = 0; u < MVX_UNROLL; u++)
#pragma unroll
        for (int i = 0; i < MVX_PAIRS; i++)
#pragma unroll
            for (int s = 0; s < 2; s++)
                wb[u][i][s] = w.load(r[i][s], FULL ? kb0 + u * WARP : min(kb0 + u * WARP, nb - 1));
#pragma unroll
    for (int u = 0; u < MVX_UNROLL; u++) {
        const int kb = kb0 + u * WARP;
        int4 lo[MVX_PAIRS][2], hi[MVX_PAIRS][2];
#pragma unroll
        for (int i = 0; i < MVX_PAIRS; i++)
#pragma unroll
            for (int s = 0; s < 2; s++) W::words(wb[u][i][s], lo[i][s], hi[i][s]);
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const XBlock x = staged_x(smem + (size_t)c * 80 * nb, nb, FULL ? kb : min(kb, nb - 1));
#pragma unroll
            for (int i = 0; i < MVX_PAIRS; i++)
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    float& a = acc[i][s][c];
                    if (FULL) a += W::dot_words(wb[u][i][s], lo[i][s], hi[i][s], x);
                    else a = kb < nb ? a + W::dot_words(wb[u][i][s], lo[i][s], hi[i][s], x) : a;
                }
        }
    }
}

// matvec_<type>_bxs: 2..MV_COLS columns (narrow decode batches) with the activation staged. The any-column
// kernel (matvec_q, NC > 1) reads every column's q8x2 block from L1 for every block of every row pair: NC times
// the one-column kernel's scattered activation loads, which bound that kernel (v36). Here a persistent block an
// SM (MVS_WARPS warps) copies the NC columns into shared memory once (stage_x, column c at c * 80 * nb bytes),
// and each warp takes MVX_PAIRS row pairs at a time (pairs MVX_PAIRS * grid_warp() + i, then the grid's next), with
// MVX_UNROLL blocks of each row in flight per lane and every load unconditional (a block past the row's end
// re-reads the last one and adds nothing, a pair past the last re-reads the last pair and writes nothing), so
// each x block read from shared memory serves 2 x MVX_PAIRS rows. Each output is summed by the same lane, over
// the same blocks in the same order as matvec_q's: the same bits. Weights through registers, not bulk copies, so
// any row width whose x fits (the 8B's 14,336-wide down at 4 columns: 140 KiB). MVX_PAIRS, MVX_UNROLL: above.
template <typename W, int NC>
__device__ __forceinline__ void matvec_cols_staged(const W& w, const int8_t* __restrict__ xq,
                                                   const float4* __restrict__ xd, const float* __restrict__ bias,
                                                   float* __restrict__ y, int rows, int cols, int ldy, int mode) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x % WARP, nb = cols / QK;
    stage_x<NC>(smem, xq, xd, nb);
    __syncthreads();
    const bool gate = gated(mode);
    const long long pairs = gate ? rows : (rows + 1) / 2;
    const long long step = (long long)gridDim.x * MVS_WARPS * MVX_PAIRS;
    for (long long p0 = grid_warp() * MVX_PAIRS; p0 < pairs; p0 += step) {
        long long r[MVX_PAIRS][2];
#pragma unroll
        for (int i = 0; i < MVX_PAIRS; i++) pair_rows(gate, rows, min(p0 + i, pairs - 1), r[i]);
        float acc[MVX_PAIRS][2][NC] = {};
        // Whole steps (every lane's MVX_UNROLL blocks inside the row; warp-uniform, and every step of the 8B's
        // rows) take no clamps and no selects, so the loads' addresses advance by a constant; then at most one
        // part-filled step.
        int kb0 = lane;
        for (; kb0 - lane + MVX_UNROLL * WARP <= nb; kb0 += MVX_UNROLL * WARP)
            cols_staged_step<W, NC, true>(w, smem, r, kb0, nb, acc);
        if (kb0 < nb) cols_staged_step<W, NC, false>(w, smem, r, kb0, nb, acc);
#pragma unroll
        for (int i = 0; i < MVX_PAIRS; i++) {
            if (p0 + i >= pairs) break;
            const bool ok[2] = {true, gate || r[i][1] != r[i][0]};
            write_out<NC>(acc[i], mode, ok, r[i][0], bias, y, 0, ldy, 1.0f);
        }
    }
}

#endif

// The first MV_PREFETCH_STEPS steps of this warp's first rows of matvec_cols_staged into L2 (before the PDL wait).
// The rows are pair_rows' written out with selects: through pair_rows ptxas lays out every bxs kernel's prologue
// differently from the build measured in cuda/PERF.md v39 (checked with cuobjdump), so that form waits for a GPU run.
template <typename W>
__device__ __forceinline__ void prefetch_rows_cs(const W& w, int rows, int mode) {
    const long long pairs = gated(mode) ? rows : (rows + 1) / 2;
    const long long p0 = grid_warp() * MVX_PAIRS;
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int i = 0; i < MVX_PAIRS; i++) {
        const long long p = min(p0 + i, pairs - 1);
        const long long r0 = gated(mode) ? p : 2 * p;
        const long long r1 = gated(mode) ? p + rows : min(2 * p + 1, (long long)rows - 1);
#pragma unroll
        for (int u = 0; u < MV_PREFETCH_STEPS; u++) {
            const int kb = lane + u * WARP;
            if (kb >= w.nb || p0 >= pairs) break;
            w.prefetch(r0, kb);
            w.prefetch(r1, kb);
        }
    }
}

// Q4_0, Q4_1 and Q8_0 take the same loop as the weights.cuh types: X(name, struct, parameters, initializers).
#define Q4_0_PARAMS const uint8_t* qs, const __half* d
#define Q4_1_PARAMS const uint8_t* qs, const __half* d, const __half* m
#define Q8_0_PARAMS const int8_t* qs, const __half* d
#define FOR_EACH_MATVEC_TYPE(X)                          \
    X(q4_0, Q4_0W, Q4_0_PARAMS, qs, d)                   \
    X(q4_1, Q4_1W, Q4_1_PARAMS, qs, d, m)                \
    X(q8_0, Q8_0W, Q8_0_PARAMS, qs, d)                   \
    FOR_EACH_GENERIC_TYPE(X)

// Three kernels per type:
//   matvec_<type>     any number of columns; each block takes MV_COLS of them (blockIdx.y), the last group fewer.
//   matvec_<type>_b1n a residual projection at one column with the next norm fused (above), MVN_WARPS warps a
//                     block; it asks for one block's registers an SM (sm_90: what its grid gets under PDL).
//   matvec_<type>_b1  exactly one column: single-stream decode, the case tg128 measures. A kernel's register
//                     count is that of its widest path, so the 4-column loop's needs (72-102 registers on sm_90
//                     uncapped) would set the one-column case's occupancy too. Alone, one column runs at 6-8
//                     blocks of 4 warps per SM (64-80 registers) with every weight load of a step issued before
//                     the first wait: one DRAM round trip per step (v7's K-quants took two, see matvec_q).
// and for the types of FOR_EACH_STAGED_TYPE (below) a fourth, matvec_<type>_b1s: b1's product on sm_90 with its
// weights and activation staged in shared memory (matvec_staged), chosen by the host where it applies.
// The blocks per SM the others ask for are the type's BLOCKS and B1_BLOCKS (weights.cuh), chosen on sm_90. Other
// archs allocate registers differently (the same caps spill 50-450 bytes per thread on sm_75..sm_120), so there
// ptxas keeps its own choice; the one-column kernel still leaves out the wide loop's registers.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define MV_BOUNDS(N) __launch_bounds__(MV_WARPS * WARP, N)
#define MVN_BOUNDS(N) __launch_bounds__(MVN_WARPS * WARP, 1)   // (N unused: one block an SM, see above)
#else
#define MV_BOUNDS(N) __launch_bounds__(MV_WARPS * WARP)
#define MVN_BOUNDS(N) __launch_bounds__(MVN_WARPS * WARP)
#endif

#define MATVEC_KERNELS(NAME, WT, PARAMS, ...)                                                                   \
    extern "C" __global__ void MV_BOUNDS(WT::BLOCKS)                                                             \
    matvec_##NAME(PARAMS, const int8_t* xq, const float4* xd, const float* bias, float* y, int rows, int cols,  \
                  int ncols, int ldy, int mode, int pdl) {                                                       \
        INGOT_PDL_WAIT_AFTER((pdl & PDL_PREFETCH) && blockIdx.y == 0,                                            \
                             prefetch_rows(WT{__VA_ARGS__, cols / QK}, rows, mode));                             \
        if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();                                                              \
        const WT w{__VA_ARGS__, cols / QK};                                                                      \
        switch (min(MV_COLS, ncols - (int)blockIdx.y * MV_COLS)) {                                               \
            case 1: matvec_q<WT, 1>(w, xq, xd, bias, y, rows, cols, ldy, mode, pdl); break;                      \
            case 2: matvec_q<WT, 2>(w, xq, xd, bias, y, rows, cols, ldy, mode, pdl); break;                      \
            case 3: matvec_q<WT, 3>(w, xq, xd, bias, y, rows, cols, ldy, mode, pdl); break;                      \
            default: matvec_q<WT, 4>(w, xq, xd, bias, y, rows, cols, ldy, mode, pdl); break;                     \
        }                                                                                                        \
    }                                                                                                            \
    extern "C" __global__ void MV_BOUNDS(WT::B1_BLOCKS)                                                          \
    matvec_##NAME##_b1(PARAMS, const int8_t* xq, const float4* xd, const float* bias, float* y, int rows,       \
                       int cols, int ncols, int ldy, int mode, int pdl, const float4* ss, float eps) {           \
        INGOT_PDL_WAIT_AFTER(pdl & PDL_PREFETCH, prefetch_rows(WT{__VA_ARGS__, cols / QK}, rows, mode));         \
        if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();                                                              \
        matvec_q<WT, 1>(WT{__VA_ARGS__, cols / QK}, xq, xd, bias, y, rows, cols, ldy, mode, pdl, ss, eps);       \
    }                                                                                                            \
    extern "C" __global__ void MVN_BOUNDS(WT::B1_BLOCKS)                                                         \
    matvec_##NAME##_b1n(PARAMS, const int8_t* xq, const float4* xd, const float* bias, float* x, int rows,      \
                        int cols, const float* w_next, int8_t* yq, float4* yd, float* ss, int pdl) {             \
        INGOT_PDL_WAIT_AFTER(pdl & PDL_PREFETCH, prefetch_rows(WT{__VA_ARGS__, cols / QK}, rows, MODE_ADD));     \
        if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();                                                              \
        matvec_q_norm<WT>(WT{__VA_ARGS__, cols / QK}, xq, xd, bias, x, rows, cols, w_next, yq, yd, ss, pdl);     \
    }
FOR_EACH_MATVEC_TYPE(MATVEC_KERNELS)

// matvec_<type>_b1s (above), for the types in FOR_EACH_STAGED_TYPE; an empty body below sm_90 (the host never
// launches it there: no bulk copies).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MVS_BODY(WT, ...) matvec_staged<WT>(xq, xd, bias, y, rows, cols, ldy, mode, pdl, ss, eps, __VA_ARGS__)
#else
#define MVS_BODY(WT, ...) ((void)0)
#endif
#define MATVEC_STAGED_KERNEL(NAME, WT, PARAMS, ...)                                                            \
    extern "C" __global__ void __launch_bounds__(MVS_WARPS * WARP)                                              \
    matvec_##NAME##_b1s(PARAMS, const int8_t* xq, const float4* xd, const float* bias, float* y, int rows,      \
                        int cols, int ncols, int ldy, int mode, int pdl, const float4* ss, float eps) {          \
        INGOT_PDL_READ_AHEAD();                                                                                  \
        MVS_BODY(WT, __VA_ARGS__);                                                                               \
    }
#define FOR_EACH_STAGED_TYPE(X)                          \
    X(q4_0, Q4_0W, Q4_0_PARAMS, qs, d)                   \
    X(q4_1, Q4_1W, Q4_1_PARAMS, qs, d, m)                \
    X(q4_k, Q4_KW, Q4_K_PARAMS, Q4_K_ARGS)               \
    X(q6_k, Q6_KW, Q6_K_PARAMS, Q6_K_ARGS)
FOR_EACH_STAGED_TYPE(MATVEC_STAGED_KERNEL)

// matvec_<type>_bxs (above) for the same types: 2..MV_COLS columns; an empty body but on sm_90 (the host launches
// it on compute capability 9.0 only; at sm_100 / sm_120 its 128-register instances spill 8-36 bytes).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define MVX_BODY(WT, ...)                                                                                        \
    do {                                                                                                         \
        const WT w{__VA_ARGS__, cols / QK};                                                                      \
        switch (ncols) {                                                                                         \
            case 2: matvec_cols_staged<WT, 2>(w, xq, xd, bias, y, rows, cols, ldy, mode); break;                 \
            case 3: matvec_cols_staged<WT, 3>(w, xq, xd, bias, y, rows, cols, ldy, mode); break;                 \
            default: matvec_cols_staged<WT, MV_COLS>(w, xq, xd, bias, y, rows, cols, ldy, mode); break;          \
        }                                                                                                        \
    } while (0)
#else
#define MVX_BODY(WT, ...) ((void)0)
#endif
#define MATVEC_COLS_STAGED_KERNEL(NAME, WT, PARAMS, ...)                                                       \
    extern "C" __global__ void __launch_bounds__(MVS_WARPS * WARP, 1)                                           \
    matvec_##NAME##_bxs(PARAMS, const int8_t* xq, const float4* xd, const float* bias, float* y, int rows,      \
                        int cols, int ncols, int ldy, int mode, int pdl) {                                       \
        INGOT_PDL_WAIT_AFTER(pdl & PDL_PREFETCH, prefetch_rows_cs(WT{__VA_ARGS__, cols / QK}, rows, mode));     \
        if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();                                                              \
        MVX_BODY(WT, __VA_ARGS__);                                                                               \
        if (pdl & PDL_LATE) INGOT_PDL_TRIGGER();                                                                 \
    }
FOR_EACH_STAGED_TYPE(MATVEC_COLS_STAGED_KERNEL)
#undef MATVEC_KERNELS

// --- Narrow decode batches on the integer tensor cores: matvec_<type>_mma (Q4_0, Q4_1, Q4_K; compute capability 8.0+)
//
// 2..MVM_COLS columns (a decode batch of 2-8 sequences; the host runs it from 3 sequences of small models only, where
// it measured faster: kernels.py narrow_mma_model, cuda/PERF.md v22). The any-column kernel above reads a column's
// whole q8x2 block (80 bytes) per 16 bytes of weights and pays 2 x 16 dp4a per 32 weights and column: its 4-column
// step is 2.3x the one-column one on the 8B, and the 16-row GEMM tile that replaced it from 3 sequences pads 12 of
// its 16 rows (cuda/PERF.md v18, v19). Here one mma.sync m16n8k32 (u8 x s8 -> s32, exact) takes one 32-weight
// block of 16 rows against 4 sequences at both q8x2 levels:
//   A (16 x 32 u8)  lane (g = lane/4, t = lane%4) takes word t of the block in rows g and g+8: bytes 4t..4t+3 hold
//                   weights 4t.. (low nibbles) and 16+4t.. (high), which is the fragment's k order (mma.cuh), so a
//                   word becomes two fragment registers with three integer ops.
//   B (32 x 8 s8)   column n = sequence n%4 at level n/4 (coarse, fine); lane (g, t) loads words t and 4+t of its
//                   32 bytes, which every block of the grid reads (L1 / L2 hits after the first).
//   C (16 x 8 s32)  lane (g, t) holds rows g, g+8 x columns 2t, 2t+1: sequences 2t%4 and 2t%4+1 at level t/2. Each is
//                   scaled in fp32 by its block's scales as the dp4a kernel does, the coarse lane taking the sum
//                   term (Q4_0: dw * (d1*C1 + d2*C2 - 8*s); Q4_1: dw * (d1*C1 + d2*C2) + m*s; Q4_K as Q4_1 with
//                   dw = dl, m = -ml from its super-block header), and the two levels' sums meet once at the end
//                   (lanes t and t^2).
// A block of MVM_WARPS warps owns 16 rows (in the gated modes 8 outputs: rows g gate, g+8 up, so act(gate) * up is
// in one lane) and splits K between its warps in chunks of MVM_CHUNK blocks (warp w takes chunks w, w + MVM_WARPS,
// ...). Nothing the products read comes through registers from global memory: each warp runs its own
// MVM_STAGES-deep cp.async pipeline of chunks into its part of the dynamic shared memory, a stage holding the
// chunk's 16 rows of quants (128 bytes a row, coalesced) and scales, and the activations' q8x2 words and block
// scales of its 4 or 8 sequences. (Measured on an H100, 8B at 4 sequences, cuda/PERF.md v22: loading each lane's
// words straight from global memory held 16 KiB in flight an SM, 754 tok/s; staging the weights but not the
// activations, 943, its warps stalled 41-76% on the activations' L1/L2 loads.) Shared-memory rows are padded so
// that a fragment load hits 32 distinct banks: quant rows by 16 bytes (the 8 rows g of a load), activation rows
// (a sequence's 8 blocks at one level, 256 bytes) by 16, and the fine level 4 rows on (bank = 16 * level + 4 * seq
// + 8 * block + t). The warps' partial sums meet in the same shared memory at the end.
#define MVM_QROW (MVM_CHUNK * 16 + 16)   // bytes of one row's quants in a stage, padded
#define MVM_XROW (MVM_CHUNK * QK + 16)   // bytes of one sequence's q8x2 level in a stage, padded

// A stage: quants [16][MVM_QROW], d (and m) f16 [16][MVM_CHUNK] (Q4_K: each row's header there), per group of 4
// sequences the q8x2 words
// [2 levels][4][MVM_XROW] and block scales float4 [4][MVM_CHUNK]. kernels.py matvec_mma_smem computes the same.
template <Fq Q, int NG>
__host__ __device__ constexpr int mvm_stage_bytes() {
    return MVM_ROWS * MVM_QROW + MVM_ROWS * MVM_CHUNK * 2 * (Q == Fq::Q4_1 ? 2 : 1) +
           NG * (2 * 4 * MVM_XROW + 4 * MVM_CHUNK * 16);
}

// Q4_0, Q4_1 and Q4_K as the narrow kernel reads them. Q4_K's d is its super-block headers read as fp16: a chunk
// of MVM_CHUNK = 8 blocks is one super-block (nb % 8 == 0, so chunks start at one), whose 16-byte header lies at
// d + (the chunk's first block index): the stage copies it where Q4_0 copies the chunk's 8 fp16 scales.
template <Fq Q>
struct Q4M {
    static constexpr bool MIN = Q != Fq::Q4_0;   // w = d*q + m (Q4_K: dl*q - ml), else d*(q - 8)
    const uint8_t* qs; const __half* d; const __half* m; int nb;
    __device__ __forceinline__ void prefetch(long long r, int line) const {   // 128 bytes of quants, the scales
        const long long b = r * nb;
        if (line * 8 < nb) prefetch_l2(qs + 16 * b + line * 128);
        if (line == 0) { prefetch_l2(d + b); if (Q == Fq::Q4_1) prefetch_l2(m + b); }
    }
    // acc += a block's share of one (row, sequence) at one level: c the level's integer sum, dl its scale, s the
    // sequence's block sum on the coarse level's lane (0 on the fine one's)
    __device__ __forceinline__ static void add(float& acc, float dw, float mw, int c, float dl, float s) {
        const float v = dl * i2f_exact(c);
        if (MIN) acc = fmaf(dw, v, fmaf(mw, s, acc));
        else acc = fmaf(dw, fmaf(-8.0f, s, v), acc);
    }
};

// Row i (0..15) of the block's A tile: rows base + i (clamped to the last row: a block past the end re-reads it and
// drops the sums), or in the gated modes gate (i < 8) and up (i >= 8) of output blockIdx.x * 8 + i % 8.
__device__ __forceinline__ long long mvm_row(int mode, int rows, int i) {
    if (gated(mode)) return min((long long)blockIdx.x * 8 + i % 8, (long long)rows - 1) + (i >= 8 ? rows : 0);
    return min((long long)blockIdx.x * MVM_ROWS + i, (long long)rows - 1);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <Fq Q, int NG>
__device__ __forceinline__ void matvec_mma(const Q4M<Q>& w, const int8_t* __restrict__ xq,
                                           const float4* __restrict__ xd, const float* __restrict__ bias,
                                           float* __restrict__ y, int rows, int cols, int ncols, int ldy, int mode,
                                           int pdl) {
    constexpr bool M_REGION = Q == Fq::Q4_1;   // Q4_1's m after d
    constexpr int STAGE = mvm_stage_bytes<Q, NG>(), D_OFF = MVM_ROWS * MVM_QROW;
    constexpr int M_OFF = D_OFF + MVM_ROWS * MVM_CHUNK * 2, X_OFF = M_OFF + (M_REGION ? MVM_ROWS * MVM_CHUNK * 2 : 0);
    constexpr int XG = 2 * 4 * MVM_XROW + 4 * MVM_CHUNK * 16, XD_OFF = 2 * 4 * MVM_XROW;   // a group's bytes
    static_assert(MVM_ROWS == 16 && MVM_CHUNK == 8 && STAGE % 16 == 0 && X_OFF % 16 == 0, "the mappings below");
    extern __shared__ __align__(16) unsigned char mvm_smem[];
    require_dynamic_smem(MVM_WARPS * MVM_STAGES * STAGE);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4, nb = cols / QK;
    unsigned char* mine = mvm_smem + warp * MVM_STAGES * STAGE;
    // This lane's copies of a chunk: quant pieces (16 bytes) e = lane + 32i -> row e/8, piece e%8 (a row's 128
    // bytes in 8 consecutive lanes); scale words (2 blocks) e = lane + 32j -> row e/4, word e%4; per group, q8x2
    // pieces e = lane + 32i -> sequence i, block (e%32)/4, quarter e%4 (coarse, coarse, fine, fine), and block
    // scales e = lane -> sequence lane/8, block lane%8. A sequence past ncols copies zeros.
    // 32-bit offsets from the arrays' starts (fewer registers than pointers; kernels.py narrow_mma_kernel keeps
    // matrices of 4 GiB of quants off this kernel). Copies past the row's end are zero-filled without a read, so
    // the products of a part-filled last chunk are zero.
    unsigned qo[4], so[2], xo[NG][4], xdo[NG];
    bool xok[NG][4], xdok[NG];
#pragma unroll
    for (int i = 0; i < 4; i++) qo[i] = (unsigned)(mvm_row(mode, rows, lane / 8 + 4 * i) * nb + lane % 8) * 16;
#pragma unroll
    for (int j = 0; j < 2; j++) so[j] = (unsigned)(mvm_row(mode, rows, lane / 4 + 8 * j) * nb + 2 * (lane % 4));
#pragma unroll
    for (int ng = 0; ng < NG; ng++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int seq = ng * 4 + i;
            xok[ng][i] = seq < ncols;
            xo[ng][i] = (unsigned)((min(seq, ncols - 1) * nb + lane / 4) * 2 * QK + (lane % 4) * 16);
        }
        const int seq = ng * 4 + lane / 8;
        xdok[ng] = seq < ncols;
        xdo[ng] = (unsigned)(min(seq, ncols - 1) * nb + lane % 8);
    }
    auto copy = [&](int chunk, int stage) {
        unsigned char* S = mine + stage * STAGE;
        const int kb0 = chunk * MVM_CHUNK;
        const bool q_in = kb0 + lane % 8 < nb, s_in = kb0 + 2 * (lane % 4) < nb, x_in = kb0 + lane / 4 < nb;
#pragma unroll
        for (int i = 0; i < 4; i++)
            cp_async16(S + (lane / 8 + 4 * i) * MVM_QROW + (lane % 8) * 16, w.qs + qo[i] + kb0 * 16, q_in);
#pragma unroll
        for (int j = 0; j < 2; j++) {   // nb is even (kernels.py): a word is two blocks of one row
            const int off = (lane / 4 + 8 * j) * MVM_CHUNK * 2 + (lane % 4) * 4;
            cp_async4(S + D_OFF + off, w.d + so[j] + kb0, s_in);
            if (M_REGION) cp_async4(S + M_OFF + off, w.m + so[j] + kb0, s_in);
        }
#pragma unroll
        for (int ng = 0; ng < NG; ng++) {
            unsigned char* X = S + X_OFF + ng * XG;
#pragma unroll
            for (int i = 0; i < 4; i++)   // quarter lane%4: coarse, coarse, fine, fine
                cp_async16(X + ((lane % 4) / 2 * 4 + i) * MVM_XROW + (lane / 4) * QK + (lane % 2) * 16,
                           xq + xo[ng][i] + kb0 * 2 * QK, xok[ng][i] && x_in);
            cp_async16(X + XD_OFF + lane * 16, xd + xdo[ng] + kb0, xdok[ng] && q_in);
        }
    };
    const bool fine = t >= 2;
    float acc[NG][4] = {};
    const int chunks = (nb + MVM_CHUNK - 1) / MVM_CHUNK;
    const int n = warp < chunks ? (chunks - warp + MVM_WARPS - 1) / MVM_WARPS : 0;   // this warp's chunks
#pragma unroll
    for (int s = 0; s < MVM_STAGES - 1; s++) {
        if (s < n) copy(warp + s * MVM_WARPS, s);
        cp_async_commit();
    }
    for (int i = 0; i < n; i++) {
        if (i + MVM_STAGES - 1 < n) copy(warp + (i + MVM_STAGES - 1) * MVM_WARPS, (i + MVM_STAGES - 1) % MVM_STAGES);
        cp_async_commit();
        cp_async_wait<MVM_STAGES - 1>();   // chunk i has landed (this lane's copies) ...
        __syncwarp();                      // ... and every lane's
        const unsigned char* S = mine + (i % MVM_STAGES) * STAGE;
#pragma unroll
        for (int k = 0; k < MVM_CHUNK; k++) {   // every block: a part-filled last chunk's tail is zeros
            const unsigned q0 = *reinterpret_cast<const unsigned*>(S + g * MVM_QROW + k * 16 + t * 4);
            const unsigned q1 = *reinterpret_cast<const unsigned*>(S + (g + 8) * MVM_QROW + k * 16 + t * 4);
            float d0, d1, m0 = 0.0f, m1 = 0.0f;
            if constexpr (Q == Fq::Q4_K) {   // rows g and g+8: their headers' sub-block k (w = dl*q - ml)
                const KHeader h0 = k_header(*reinterpret_cast<const uint4*>(S + D_OFF + g * 16), k);
                const KHeader h1 = k_header(*reinterpret_cast<const uint4*>(S + D_OFF + (g + 8) * 16), k);
                d0 = h0.dl; m0 = -h0.ml; d1 = h1.dl; m1 = -h1.ml;
            } else {
                const __half* sd = reinterpret_cast<const __half*>(S + D_OFF);
                d0 = __half2float(sd[g * MVM_CHUNK + k]); d1 = __half2float(sd[(g + 8) * MVM_CHUNK + k]);
                if (M_REGION) {
                    const __half* sm = reinterpret_cast<const __half*>(S + M_OFF);
                    m0 = __half2float(sm[g * MVM_CHUNK + k]); m1 = __half2float(sm[(g + 8) * MVM_CHUNK + k]);
                }
            }
            const unsigned a[4] = {q0 & 0x0F0F0F0Fu, q1 & 0x0F0F0F0Fu, (q0 >> 4) & 0x0F0F0F0Fu,
                                   (q1 >> 4) & 0x0F0F0F0Fu};
#pragma unroll
            for (int ng = 0; ng < NG; ng++) {
                // B: sequence g%4 at level g/4, words t and 4+t; C: sequences 2t%4 + j at level t/2
                const unsigned char* X = S + X_OFF + ng * XG;
                const unsigned char* xb = X + ((g / 4) * 4 + g % 4) * MVM_XROW + k * QK + t * 4;
                const unsigned b0 = *reinterpret_cast<const unsigned*>(xb);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(xb + 16);
                const float4* xs = reinterpret_cast<const float4*>(X + XD_OFF);
                const float4 x0 = xs[((2 * t) % 4) * MVM_CHUNK + k], x1 = xs[((2 * t) % 4 + 1) * MVM_CHUNK + k];
                const float dl0 = fine ? x0.y : x0.x, s0 = fine ? 0.0f : x0.z;
                const float dl1 = fine ? x1.y : x1.x, s1 = fine ? 0.0f : x1.z;
                int c[4];
                mma_u8s8(c, a, b0, b1);
                Q4M<Q>::add(acc[ng][0], d0, m0, c[0], dl0, s0);
                Q4M<Q>::add(acc[ng][1], d0, m0, c[1], dl1, s1);
                Q4M<Q>::add(acc[ng][2], d1, m1, c[2], dl0, s0);
                Q4M<Q>::add(acc[ng][3], d1, m1, c[3], dl1, s1);
            }
        }
        __syncwarp();   // every lane is done with this stage before a later copy refills it
    }
    cp_async_wait<0>();
    if (pdl & PDL_LATE) INGOT_PDL_TRIGGER();
    __syncthreads();   // the stages become the warps' partial sums: red[warp][value][lane]
    float* red = reinterpret_cast<float*>(mvm_smem);
#pragma unroll
    for (int ng = 0; ng < NG; ng++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[(warp * NG * 4 + ng * 4 + i) * WARP + lane] = acc[ng][i];
    __syncthreads();
    // Warp q sums pair q (group q/2, the lane's column j = q%2 in rows g and g+8) over the warps, then the levels.
    for (int q = warp; q < 2 * NG; q += MVM_WARPS) {
        const int ng = q / 2, j = q % 2;
        float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
        for (int k = 0; k < MVM_WARPS; k++) {
            v0 += red[(k * NG * 4 + ng * 4 + j) * WARP + lane];
            v1 += red[(k * NG * 4 + ng * 4 + 2 + j) * WARP + lane];
        }
        v0 += __shfl_xor_sync(0xffffffff, v0, 2);
        v1 += __shfl_xor_sync(0xffffffff, v1, 2);
        const int seq = ng * 4 + 2 * t + j;
        if (fine || seq >= ncols) continue;
        float* yc = y + (size_t)seq * ldy;
        if (gated(mode)) {
            const long long o = (long long)blockIdx.x * 8 + g;
            if (o < rows) yc[o] = (mode == MODE_SWIGLU ? silu(v0) : gelu_tanh(v0)) * v1;
        } else {
            const long long base = (long long)blockIdx.x * MVM_ROWS + g;
            const float v[2] = {v0, v1};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const long long row = base + 8 * h;
                if (row >= rows) continue;
                const float o = v[h] + (bias ? bias[row] : 0.0f);
                if (mode == MODE_ADD) yc[row] += o; else yc[row] = o;
            }
        }
    }
}
#define MVM_RUN(Q, NG) matvec_mma<Q, NG>(w, xq, xd, bias, y, rows, cols, ncols, ldy, mode, pdl)
#else
#define MVM_RUN(Q, NG) (void)w   // sm_75: never launched (kernels.py narrow_mma_kernel)
#endif

// Under PDL, the first KiB of the block's 16 rows and their scales into L2 before the wait.
template <Fq Q>
__device__ __forceinline__ void prefetch_rows_mma(const Q4M<Q>& w, int rows, int mode) {
    const int i = threadIdx.x;   // MVM_WARPS * WARP = 128 lanes: 8 lines of 16 rows
    w.prefetch(mvm_row(mode, rows, i % MVM_ROWS), i / MVM_ROWS);
}

// Grid: ceil(rows / 16) blocks (ceil(outputs / 8) in the gated modes) of MVM_WARPS warps, kernels.py matvec_mma_smem
// bytes of dynamic shared memory; arguments as matvec_<type> (2 <= ncols <= MVM_COLS, cols % 64 == 0). Q4_0 and Q4_K
// pass no m. X(name, type, parameters, d, m).
#define FOR_EACH_MATVEC_MMA_TYPE(X)                                                     \
    X(q4_0, Fq::Q4_0, Q4_0_PARAMS, d, nullptr)                                          \
    X(q4_1, Fq::Q4_1, Q4_1_PARAMS, d, m)                                                \
    X(q4_k, Fq::Q4_K, Q4_K_PARAMS, reinterpret_cast<const __half*>(sc), nullptr)

#define MVM_W(DARG, MARG) reinterpret_cast<const uint8_t*>(qs), DARG, MARG, cols / QK
#define MATVEC_MMA_KERNEL(NAME, Q, PARAMS, DARG, MARG)                                                          \
    extern "C" __global__ void __launch_bounds__(MVM_WARPS * WARP)                                              \
    matvec_##NAME##_mma(PARAMS, const int8_t* xq, const float4* xd, const float* bias, float* y, int rows,      \
                        int cols, int ncols, int ldy, int mode, int pdl) {                                       \
        INGOT_PDL_WAIT_AFTER(pdl & PDL_PREFETCH, prefetch_rows_mma(Q4M<Q>{MVM_W(DARG, MARG)}, rows, mode));      \
        if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();                                                              \
        const Q4M<Q> w{MVM_W(DARG, MARG)};                                                                       \
        if (ncols > 4) MVM_RUN(Q, 2); else MVM_RUN(Q, 1);                                                        \
    }
FOR_EACH_MATVEC_MMA_TYPE(MATVEC_MMA_KERNEL)
#undef MATVEC_MMA_KERNEL
#undef MVM_W
#undef MVM_RUN

// F16 weights take fp32 activations: each lane reads 8 weights (16 bytes) and 8 floats per step.
template <int NC>
__device__ __forceinline__ void matvec_h(const __half* __restrict__ w, const float* __restrict__ x,
                                         const float* __restrict__ bias, float* __restrict__ y,
                                         int rows, int cols, int ldy, int mode, int pdl) {
    const int lane = threadIdx.x % WARP, c0 = blockIdx.y * MV_COLS;
    long long r[2], out_row; bool ok[2];
    warp_rows(mode, rows, r, ok, &out_row);
    float acc[2][NC] = {};
#pragma unroll 2
    for (int k = lane * 8; k < cols; k += WARP * 8) {
        uint4 wv[2];
#pragma unroll
        for (int s = 0; s < 2; s++) if (ok[s]) wv[s] = *reinterpret_cast<const uint4*>(w + r[s] * cols + k);
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const float4* xp = reinterpret_cast<const float4*>(x + (size_t)(c0 + c) * cols + k);
            const float4 a = xp[0], b = xp[1];
            const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int s = 0; s < 2; s++) {
                if (!ok[s]) continue;
                const __half2* h = reinterpret_cast<const __half2*>(&wv[s]);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float2 f = __half22float2(h[i]);
                    acc[s][c] += f.x * xv[2 * i] + f.y * xv[2 * i + 1];
                }
            }
        }
    }
    if (pdl & PDL_LATE) INGOT_PDL_TRIGGER();
    write_out<NC>(acc, mode, ok, out_row, bias, y, c0, ldy, 1.0f);
}

// F16 rows: the same prefetch as prefetch_rows, 16 bytes a lane a step.
__device__ __forceinline__ void prefetch_rows_h(const __half* w, int rows, int cols, int mode) {
    long long r[2], out_row; bool ok[2];
    warp_rows(mode, rows, r, ok, &out_row);
#pragma unroll
    for (int u = 0; u < MV_PREFETCH_STEPS; u++) {
        const int k = (threadIdx.x % WARP + u * WARP) * 8;
#pragma unroll
        for (int s = 0; s < 2; s++) if (ok[s] && k < cols) prefetch_l2(w + r[s] * cols + k);
    }
}

extern "C" __global__ void __launch_bounds__(MV_WARPS * WARP)
matvec_f16(const __half* w, const float* x, const float* bias, float* y, int rows, int cols, int ncols, int ldy,
           int mode, int pdl) {
    INGOT_PDL_WAIT_AFTER((pdl & PDL_PREFETCH) && blockIdx.y == 0, prefetch_rows_h(w, rows, cols, mode));
    if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();
    switch (min(MV_COLS, ncols - (int)blockIdx.y * MV_COLS)) {
        case 1: matvec_h<1>(w, x, bias, y, rows, cols, ldy, mode, pdl); break;
        case 2: matvec_h<2>(w, x, bias, y, rows, cols, ldy, mode, pdl); break;
        case 3: matvec_h<3>(w, x, bias, y, rows, cols, ldy, mode, pdl); break;
        default: matvec_h<4>(w, x, bias, y, rows, cols, ldy, mode, pdl); break;
    }
}

extern "C" __global__ void MV_BOUNDS(9)
matvec_f16_b1(const __half* w, const float* x, const float* bias, float* y, int rows, int cols, int ncols, int ldy,
              int mode, int pdl) {
    INGOT_PDL_WAIT_AFTER(pdl & PDL_PREFETCH, prefetch_rows_h(w, rows, cols, mode));
    if (!(pdl & PDL_LATE)) INGOT_PDL_TRIGGER();
    matvec_h<1>(w, x, bias, y, rows, cols, ldy, mode, pdl);
}

// x fp32 [n/32 blocks of 32] -> q8x2 (xq [2n], xd [n/32]). One warp per block of 32 values.
extern "C" __global__ void quantize_q8x2(const float* __restrict__ x, int8_t* __restrict__ xq, float4* __restrict__ xd,
                                         long long nblocks) {
    INGOT_PDL_ENTRY();
    const long long b = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (b >= nblocks) return;
    warp_quantize_q8x2(x[b * QK + threadIdx.x % WARP], xq + b * 2 * QK, xd + b);
}
