// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, one block per row of x [n, dim] (fp32); and the post-norm
// residual add fused with the next RMSNorm (add_rmsnorm_f32, below).
//
// The normalized row is written in whichever forms the next matrix product reads (any pointer may be
// null): fp32 y [n, dim] (F16 weights), q8x2 yq [n, 2*dim] / yd [n, dim/32] (quantized weights, decode;
// common.cuh) and fp16 yh [n, dim] (tensor-core GEMM, prefill). dim must be a multiple of 32.
#include "common.cuh"

// Row `row` of x (already summed: ss = sum of its squares) times scale(ss) * w, into the requested forms. Each
// warp handles whole 32-value blocks so the q8x2 quantization stays inside one warp. xr is read through the
// coherent path (no __restrict__): add_rmsnorm_f32 reads values this block has just written.
__device__ __forceinline__ void write_normed(const float* xr, float ss, const float* __restrict__ w, size_t row,
                                             float* __restrict__ y, int8_t* __restrict__ yq, float4* __restrict__ yd,
                                             __half* __restrict__ yh, int dim, float eps) {
    const float scale = rsqrtf(ss / dim + eps);
    const int lane = threadIdx.x % WARP;
    for (int b = threadIdx.x / WARP; b < dim / QK; b += blockDim.x / WARP) {
        const int i = b * QK + lane;
        const float v = xr[i] * scale * w[i];
        const size_t o = row * dim + i;
        if (y) y[o] = v;
        if (yh) yh[o] = __float2half(v);
        if (yq) warp_quantize_q8x2(v, yq + 2 * (row * dim + b * QK), yd + row * (dim / QK) + b);
    }
}

extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, int8_t* __restrict__ yq, float4* __restrict__ yd,
                                       __half* __restrict__ yh, int dim, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    write_normed(xr, block_sum(ss, scratch), w, blockIdx.x, y, yq, yd, yh, dim, eps);
}

// Post-norm residual (Gemma's post_attention_norm / post_ffw_norm): x[r] += o[r] / sqrt(mean(o[r]^2) + eps) * w,
// one block per row of x, o [n, dim] fp32 (the projection before it stores o instead of adding into x). Then,
// when w_next is given, the next RMSNorm of the updated row, into y/yq/yd/yh as rmsnorm_f32 writes them: the
// residual add and the norm that always follows it in one launch.
extern "C" __global__ void add_rmsnorm_f32(float* x, const float* __restrict__ o, const float* __restrict__ w,
                                           const float* __restrict__ w_next, float* __restrict__ y,
                                           int8_t* __restrict__ yq, float4* __restrict__ yd, __half* __restrict__ yh,
                                           int dim, float eps) {
    __shared__ float scratch[32];
    const float* orow = o + (size_t)blockIdx.x * dim;
    float* xr = x + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += orow[i] * orow[i];
    const float scale = rsqrtf(block_sum(ss, scratch) / dim + eps);
    float ss_new = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + orow[i] * scale * w[i];
        xr[i] = v;
        ss_new += v * v;
    }
    if (!w_next) return;                          // (block-uniform)
    // block_sum's barrier also makes every thread's new x visible to the warps that normalize it below
    write_normed(xr, block_sum(ss_new, scratch), w_next, blockIdx.x, y, yq, yd, yh, dim, eps);
}
