// Elementwise activations for prefill. (Decode fuses SwiGLU into the gate/up matrix-vector product.)
//
// swiglu_f16: gu [n, 2F] fp32 = [gate | up] per token -> h [n, F] fp16 = silu(gate) * up, the A operand of the
// down-projection GEMM.
#include "common.cuh"

extern "C" __global__ void swiglu_f16(const float* __restrict__ gu, __half* __restrict__ h, int F, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * F) return;
    const long long t = i / F, f = i % F;
    const float g = gu[t * 2 * F + f], u = gu[t * 2 * F + F + f];
    h[i] = __float2half(g / (1.0f + __expf(-g)) * u);
}
