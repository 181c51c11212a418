// Weight repacking at load time: GGUF block arrays -> the "soa-v1" layout described in common.cuh.
//
// GGUF blocks are 18 (Q4_0), 20 (Q4_1) or 34 (Q8_0) bytes, so a row of them cannot be read with aligned
// 16-byte loads. These kernels split every row into a contiguous quant array and a scale array (and a min
// array for Q4_1). One thread per block of 32 weights; `nblocks` = rows * cols / 32 over the whole matrix.
// convert_bf16_f16 / convert_f32_f16 turn unquantized matrices into the F16 layout the GEMMs read.
#include "common.cuh"

extern "C" __global__ void repack_q4_0(const uint8_t* __restrict__ src, uint8_t* __restrict__ qs,
                                       __half* __restrict__ d, long long nblocks) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const uint8_t* blk = src + b * 18;                       // f16 d, u8 qs[16]
    d[b] = *reinterpret_cast<const __half*>(blk);            // 2-byte aligned: 18 is even
    uint8_t* out = qs + b * 16;
#pragma unroll
    for (int i = 0; i < 16; i++) out[i] = blk[2 + i];
}

extern "C" __global__ void repack_q4_1(const uint8_t* __restrict__ src, uint8_t* __restrict__ qs,
                                       __half* __restrict__ d, __half* __restrict__ m, long long nblocks) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const uint8_t* blk = src + b * 20;                       // f16 d, f16 m, u8 qs[16]
    d[b] = *reinterpret_cast<const __half*>(blk);
    m[b] = *reinterpret_cast<const __half*>(blk + 2);
    uint8_t* out = qs + b * 16;
#pragma unroll
    for (int i = 0; i < 16; i++) out[i] = blk[4 + i];
}

extern "C" __global__ void repack_q8_0(const uint8_t* __restrict__ src, int8_t* __restrict__ qs,
                                       __half* __restrict__ d, long long nblocks) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const uint8_t* blk = src + b * 34;                       // f16 d, i8 qs[32]
    d[b] = *reinterpret_cast<const __half*>(blk);
    int8_t* out = qs + b * 32;
#pragma unroll
    for (int i = 0; i < 32; i++) out[i] = (int8_t)blk[2 + i];
}

extern "C" __global__ void convert_bf16_f16(const uint16_t* __restrict__ src, __half* __restrict__ dst, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2half(__uint_as_float((uint32_t)src[i] << 16));
}

extern "C" __global__ void convert_f32_f16(const float* __restrict__ src, __half* __restrict__ dst, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2half(src[i]);
}
