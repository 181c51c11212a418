// Embedding lookup: x[i, :] = E[tokens[i], :] * scale as fp32, for n tokens, from the soa-v1 layout (common.cuh).
// One block per token; threads stride over the dim (a multiple of 32) columns.
#include "common.cuh"

extern "C" __global__ void embed_q8_0(const int* __restrict__ tokens, const int8_t* __restrict__ qs,
                                      const __half* __restrict__ d, float* __restrict__ x, int dim, float scale) {
    const long long row = tokens[blockIdx.x];
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        x[(size_t)blockIdx.x * dim + i] = __half2float(d[row * (dim / QK) + i / QK]) * qs[row * dim + i] * scale;
}

extern "C" __global__ void embed_q4_0(const int* __restrict__ tokens, const uint8_t* __restrict__ qs,
                                      const __half* __restrict__ d, float* __restrict__ x, int dim, float scale) {
    const long long row = tokens[blockIdx.x];
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const long long b = row * (dim / QK) + i / QK;
        x[(size_t)blockIdx.x * dim + i] = __half2float(d[b]) * (q4_nibble(qs + b * 16, i % QK) - 8) * scale;
    }
}

extern "C" __global__ void embed_q4_1(const int* __restrict__ tokens, const uint8_t* __restrict__ qs,
                                      const __half* __restrict__ d, const __half* __restrict__ m,
                                      float* __restrict__ x, int dim, float scale) {
    const long long row = tokens[blockIdx.x];
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const long long b = row * (dim / QK) + i / QK;
        x[(size_t)blockIdx.x * dim + i] =
            (__half2float(d[b]) * q4_nibble(qs + b * 16, i % QK) + __half2float(m[b])) * scale;
    }
}

extern "C" __global__ void embed_f16(const int* __restrict__ tokens, const __half* __restrict__ w,
                                     float* __restrict__ x, int dim, float scale) {
    const long long row = tokens[blockIdx.x];
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        x[(size_t)blockIdx.x * dim + i] = __half2float(w[row * dim + i]) * scale;
}
