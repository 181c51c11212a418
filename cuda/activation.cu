// Gated FFN activations, elementwise: h = act(gate) * up, for the paths that do not fuse them into the gate/up
// matrix product (prefill and wide-batch decode after the gate/up GEMM; batch decode when gate and up are
// stored in different quant types, so the matrix-vector kernel cannot pair their rows).
//
// gu [n, 2F] fp32 = [gate | up] per token -> h [n, F] as fp16 (hh, the A operand of the down-projection GEMM)
// and/or fp32 (hf, for the down-projection matrix-vector product); either pointer may be null.
//   swiglu_f16: act = silu(g) = g / (1 + exp(-g))                              (Llama, Qwen)
//   geglu_f16:  act = gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))  (Gemma; PyTorch's
//               gelu(approximate="tanh"), ggml_gelu)
#include "common.cuh"

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

__device__ __forceinline__ float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

template <float (*ACT)(float)>
__device__ __forceinline__ void gated(const float* __restrict__ gu, __half* __restrict__ hh, float* __restrict__ hf,
                                      int F, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * F) return;
    const long long t = i / F, f = i % F;
    const float v = ACT(gu[t * 2 * F + f]) * gu[t * 2 * F + F + f];
    if (hh) hh[i] = __float2half(v);
    if (hf) hf[i] = v;
}

extern "C" __global__ void swiglu_f16(const float* __restrict__ gu, __half* __restrict__ hh, float* __restrict__ hf,
                                      int F, long long n) {
    INGOT_PDL_ENTRY();
    gated<silu>(gu, hh, hf, F, n);
}

extern "C" __global__ void geglu_f16(const float* __restrict__ gu, __half* __restrict__ hh, float* __restrict__ hf,
                                     int F, long long n) {
    INGOT_PDL_ENTRY();
    gated<gelu_tanh>(gu, hh, hf, F, n);
}
