// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, one block per row of x [n, dim] (fp32); and the post-norm
// residual add (add_rmsnorm_f32, below).
//
// The normalized row is written in whichever forms the next matrix product reads (any pointer may be
// null): fp32 y [n, dim] (F16 weights), q8x2 yq [n, 2*dim] / yd [n, dim/32] (quantized weights, decode;
// common.cuh) and fp16 yh [n, dim] (tensor-core GEMM, prefill). dim must be a multiple of 32.
#include "common.cuh"

extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, int8_t* __restrict__ yq, float4* __restrict__ yd,
                                       __half* __restrict__ yh, int dim, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    const float scale = rsqrtf(block_sum(ss, scratch) / dim + eps);
    // Each warp handles whole 32-value blocks so the q8x2 quantization stays inside one warp.
    const int lane = threadIdx.x % WARP;
    for (int b = threadIdx.x / WARP; b < dim / QK; b += blockDim.x / WARP) {
        const int i = b * QK + lane;
        const float v = xr[i] * scale * w[i];
        const size_t o = (size_t)blockIdx.x * dim + i;
        if (y) y[o] = v;
        if (yh) yh[o] = __float2half(v);
        if (yq) warp_quantize_q8x2(v, yq + 2 * ((size_t)blockIdx.x * dim + b * QK), yd + (size_t)blockIdx.x * (dim / QK) + b);
    }
}

// Post-norm residual (Gemma's post_attention_norm / post_ffw_norm): x[r] += o[r] / sqrt(mean(o[r]^2) + eps) * w,
// one block per row of x, o [n, dim] fp32. The projection before it stores o instead of adding into x.
extern "C" __global__ void add_rmsnorm_f32(float* __restrict__ x, const float* __restrict__ o,
                                           const float* __restrict__ w, int dim, float eps) {
    __shared__ float scratch[32];
    const float* orow = o + (size_t)blockIdx.x * dim;
    float* xr = x + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += orow[i] * orow[i];
    const float scale = rsqrtf(block_sum(ss, scratch) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] += orow[i] * scale * w[i];
}
