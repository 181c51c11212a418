// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, a row of x [n, dim] (fp32) per blockIdx.x; and the post-norm
// residual add fused with the next RMSNorm (add_rmsnorm_f32, below).
//
// A decode row spreads over gridDim.y blocks (rmsnorm_f32 only): each sums the squares of the whole row, in the
// same order, and writes its share of the 32-value blocks. A 4096-wide row on one SM was one SM issuing 70% of
// its cycles, mostly the q8x2 quantization's shuffles (4.6 us per norm in the 8B's decode step, 65 per token:
// cuda/PERF.md v15); split four ways each warp quantizes one block instead of four. The bits do not depend on
// the split: the sum is the same sum and each value is normalized alone.
//
// The normalized row is written in whichever forms the next matrix product reads (any pointer may be
// null): fp32 y [n, dim] (F16 weights), q8x2 yq [n, 2*dim] / yd [n, dim/32] (quantized weights, decode;
// common.cuh) and fp16 yh [n, dim] (tensor-core GEMM, prefill). dim must be a multiple of 32.
#include "common.cuh"

// One normalized value v of row `row`, block b (this lane's value b * 32 + lane), into the requested forms. The
// whole warp calls it for the same b, so the q8x2 quantization stays inside one warp.
__device__ __forceinline__ void put_normed(float v, size_t row, int b, float* __restrict__ y, int8_t* __restrict__ yq,
                                           float4* __restrict__ yd, __half* __restrict__ yh, int dim) {
    const size_t o = row * dim + b * QK + threadIdx.x % WARP;
    if (y) y[o] = v;
    if (yh) yh[o] = __float2half(v);
    if (yq) warp_quantize_q8x2(v, yq + 2 * (row * dim + b * QK), yd + row * (dim / QK) + b);
}

// Row `row` of x (already summed: ss = sum of its squares) times scale(ss) * w, into the requested forms, each
// warp taking whole 32-value blocks: trip t of warp w is block w + t * nwarps, and this block of the row's
// gridDim.y takes the trips with t mod gridDim.y = blockIdx.y (add_rmsnorm_f32 launches one). xr is read through the
// coherent path (no __restrict__): add_rmsnorm_f32 reads values this block has just written. The loop form, for
// rows wider than the register form below holds.
__device__ __forceinline__ void write_normed(const float* xr, float ss, const float* __restrict__ w, size_t row,
                                             float* __restrict__ y, int8_t* __restrict__ yq, float4* __restrict__ yd,
                                             __half* __restrict__ yh, int dim, float eps) {
    const float scale = rsqrtf(ss / dim + eps);
    const int lane = threadIdx.x % WARP, nwarps = blockDim.x / WARP;
    for (int b = threadIdx.x / WARP + blockIdx.y * nwarps; b < dim / QK; b += nwarps * gridDim.y) {
        const int i = b * QK + lane;
        put_normed(xr[i] * scale * w[i], row, b, y, yq, yd, yh, dim);
    }
}

// The register form: a thread keeps its values of the row (and of w) in registers, blocks b = warp + k * nwarps
// for k < NORM_REGS (constants.cuh), all loaded before the first use. A decode row is one block of latency, not
// bandwidth: the loop form's runtime trip count keeps it from being unrolled, so each trip waited one DRAM round
// trip (x, then w again in write_normed: 4.9 us per 4096-wide norm on the H200, PERF.md v7). Rows up to
// NORM_REGS * blockDim values (8192 at 1024 threads) take it. Thread t holds values t + k * blockDim in both forms
// and sums them in that order, so the two forms give bit-identical results.

// 1024 threads at most (kernels.py: min(1024, dim)): the bound keeps the register form within 64 per thread.
// Grid (n, S): block (r, s) writes the 32-value blocks of row r held in the registers k with k mod S = s (the
// loop form: the trips t with t mod S = s), so it loads only those weights; S is at most the number of
// registers in use (kernels.py norm_splits).
// The norm weights are read before the PDL wait (INGOT_PDL_READ_AHEAD, common.cuh): no kernel of a step writes
// them, so their round trip to DRAM (a decode step streams the whole model through L2) overlaps the previous
// kernel's tail instead of following it; only x waits.
extern "C" __global__ void __launch_bounds__(1024)
rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int8_t* __restrict__ yq,
            float4* __restrict__ yd, __half* __restrict__ yh, int dim, float eps) {
    INGOT_PDL_READ_AHEAD();
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP, nb = dim / QK;
    if (nb > NORM_REGS * nwarps) {                // (block-uniform) a row too wide for the registers
        INGOT_PDL_ENTRY();
        float ss = 0.0f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
        write_normed(xr, block_sum(ss, scratch), w, blockIdx.x, y, yq, yd, yh, dim, eps);
        return;
    }
    float xv[NORM_REGS] = {}, wv[NORM_REGS] = {}, ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++) {
        const int b = warp + k * nwarps;
        if (b < nb && k % gridDim.y == blockIdx.y) wv[k] = w[b * QK + lane];
    }
    INGOT_PDL_ENTRY();
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++) {
        const int b = warp + k * nwarps;
        if (b < nb) xv[k] = xr[b * QK + lane];
    }
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++)
        if (warp + k * nwarps < nb) ss += xv[k] * xv[k];
    const float scale = rsqrtf(block_sum(ss, scratch) / dim + eps);
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++) {
        const int b = warp + k * nwarps;
        if (b < nb && k % gridDim.y == blockIdx.y) put_normed(xv[k] * scale * wv[k], blockIdx.x, b, y, yq, yd, yh, dim);
    }
}

// Post-norm residual (Gemma's post_attention_norm / post_ffw_norm): x[r] += o[r] / sqrt(mean(o[r]^2) + eps) * w,
// one block per row of x, o [n, dim] fp32 (the projection before it stores o instead of adding into x). Then,
// when w_next is given, the next RMSNorm of the updated row, into y/yq/yd/yh as rmsnorm_f32 writes them: the
// residual add and the norm that always follows it in one launch. Register and loop forms as rmsnorm_f32.
extern "C" __global__ void __launch_bounds__(1024)
add_rmsnorm_f32(float* x, const float* __restrict__ o, const float* __restrict__ w, const float* __restrict__ w_next,
                float* __restrict__ y, int8_t* __restrict__ yq, float4* __restrict__ yd, __half* __restrict__ yh,
                int dim, float eps) {
    INGOT_PDL_READ_AHEAD();
    __shared__ float scratch[32];
    const float* orow = o + (size_t)blockIdx.x * dim;
    float* xr = x + (size_t)blockIdx.x * dim;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP, nb = dim / QK;
    if (nb > NORM_REGS * nwarps) {                // (block-uniform) a row too wide for the registers
        INGOT_PDL_ENTRY();
        float ss = 0.0f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += orow[i] * orow[i];
        const float scale = rsqrtf(block_sum(ss, scratch) / dim + eps);
        float ss_new = 0.0f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float v = xr[i] + orow[i] * scale * w[i];
            xr[i] = v;
            ss_new += v * v;
        }
        if (!w_next) return;                      // (block-uniform)
        // block_sum's barrier also makes every thread's new x visible to the warps that normalize it below
        write_normed(xr, block_sum(ss_new, scratch), w_next, blockIdx.x, y, yq, yd, yh, dim, eps);
        return;
    }
    float ov[NORM_REGS] = {}, xv[NORM_REGS] = {}, wv[NORM_REGS] = {}, wn[NORM_REGS] = {}, ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++) {         // the weights before the PDL wait, as rmsnorm_f32
        const int b = warp + k * nwarps, i = b * QK + lane;
        if (b < nb) {
            wv[k] = w[i];
            if (w_next) wn[k] = w_next[i];
        }
    }
    INGOT_PDL_ENTRY();
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++) {
        const int b = warp + k * nwarps, i = b * QK + lane;
        if (b < nb) {
            ov[k] = orow[i];
            xv[k] = xr[i];
        }
    }
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++)
        if (warp + k * nwarps < nb) ss += ov[k] * ov[k];
    const float scale = rsqrtf(block_sum(ss, scratch) / dim + eps);
    float ss_new = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++) {
        const int b = warp + k * nwarps;
        if (b < nb) {
            xv[k] = xv[k] + ov[k] * scale * wv[k];
            xr[b * QK + lane] = xv[k];
            ss_new += xv[k] * xv[k];
        }
    }
    if (!w_next) return;                          // (block-uniform)
    const float scale_next = rsqrtf(block_sum(ss_new, scratch) / dim + eps);
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++) {
        const int b = warp + k * nwarps;
        if (b < nb) put_normed(xv[k] * scale_next * wn[k], blockIdx.x, b, y, yq, yd, yh, dim);
    }
}
