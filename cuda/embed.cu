// Embedding lookup: x[i, :] = E[tokens[i], :] * scale as fp32, for n tokens, from the soa-v2 layout (common.cuh).
// One block per token; threads stride over the dim (a multiple of 32) columns, unrolled by 4 so a thread's loads
// are in flight together (a decode step embeds one row: its latency, not its bytes, is the cost), or over its
// 32-weight blocks for the weights.cuh types. Each value is gguf's dequantization in fp32, then times `scale` in
// fp32 (Gemma's sqrt(dim), 1 otherwise), the CPU reference's order (runtime/model/reference.py forward).
#include "weights.cuh"

extern "C" __global__ void embed_q8_0(const int* __restrict__ tokens, const int8_t* __restrict__ qs,
                                      const __half* __restrict__ d, float* __restrict__ x, int dim, float scale) {
    INGOT_PDL_ENTRY();
    const long long row = tokens[blockIdx.x];
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        x[(size_t)blockIdx.x * dim + i] = __fmul_rn(__fmul_rn(__half2float(d[row * (dim / QK) + i / QK]), qs[row * dim + i]), scale);
}

extern "C" __global__ void embed_q4_0(const int* __restrict__ tokens, const uint8_t* __restrict__ qs,
                                      const __half* __restrict__ d, float* __restrict__ x, int dim, float scale) {
    INGOT_PDL_ENTRY();
    const long long row = tokens[blockIdx.x];
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const long long b = row * (dim / QK) + i / QK;
        x[(size_t)blockIdx.x * dim + i] = __fmul_rn(__fmul_rn(__half2float(d[b]), q4_nibble(qs + b * 16, i % QK) - 8), scale);
    }
}

extern "C" __global__ void embed_q4_1(const int* __restrict__ tokens, const uint8_t* __restrict__ qs,
                                      const __half* __restrict__ d, const __half* __restrict__ m,
                                      float* __restrict__ x, int dim, float scale) {
    INGOT_PDL_ENTRY();
    const long long row = tokens[blockIdx.x];
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const long long b = row * (dim / QK) + i / QK;
        x[(size_t)blockIdx.x * dim + i] =
            __fmul_rn(__fadd_rn(__fmul_rn(__half2float(d[b]), q4_nibble(qs + b * 16, i % QK)), __half2float(m[b])), scale);
    }
}

extern "C" __global__ void embed_f16(const int* __restrict__ tokens, const __half* __restrict__ w,
                                     float* __restrict__ x, int dim, float scale) {
    INGOT_PDL_ENTRY();
    const long long row = tokens[blockIdx.x];
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        x[(size_t)blockIdx.x * dim + i] = __fmul_rn(__half2float(w[row * dim + i]), scale);
}

// The weights.cuh types: one thread per 32-weight block, written as 8 float4s.
template <typename W>
__device__ __forceinline__ void embed_w(const W& w, const int* __restrict__ tokens, float* __restrict__ x, int dim,
                                        float scale) {
    const long long row = tokens[blockIdx.x];
    for (int kb = threadIdx.x; kb < dim / QK; kb += blockDim.x) {
        const typename W::Block b = w.load(row, kb);
        int4 lo, hi;
        W::words(b, lo, hi);
        float4* out = reinterpret_cast<float4*>(x + (size_t)blockIdx.x * dim + kb * QK);
#pragma unroll
        for (int i = 0; i < QK; i += 4)
            out[i / 4] = make_float4(__fmul_rn(W::deq(b, lo, hi, i), scale), __fmul_rn(W::deq(b, lo, hi, i + 1), scale),
                                     __fmul_rn(W::deq(b, lo, hi, i + 2), scale), __fmul_rn(W::deq(b, lo, hi, i + 3), scale));
    }
}

#define EMBED_KERNEL(NAME, WT, PARAMS, ARGS)                                                                     \
    extern "C" __global__ void embed_##NAME(const int* tokens, PARAMS, float* x, int dim, float scale) {         \
        INGOT_PDL_ENTRY();                                                                                       \
        embed_w(WT{ARGS, dim / QK}, tokens, x, dim, scale);                                                      \
    }
FOR_EACH_GENERIC_TYPE(EMBED_KERNEL)
#undef EMBED_KERNEL
