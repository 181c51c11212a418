// Shared device helpers for Ingot's kernels: weight layouts, warp/block reductions, q8_1 activations.
//
// Weight layout on the GPU ("soa-v1"): GGUF stores quantized rows as arrays of blocks (scale, quants)
// whose 18- or 20-byte size defeats 16-byte loads. At load time every quantized matrix [rows, cols] is
// repacked into separate arrays, each row contiguous:
//   Q4_0: qs  u8  [rows, cols/2]   (GGUF nibble order kept: byte j of a block = w[j] | w[j+16] << 4)
//         d   f16 [rows, cols/32]
//   Q4_1: qs as Q4_0, d f16 [rows, cols/32], m f16 [rows, cols/32]
//   Q8_0: qs  i8  [rows, cols], d f16 [rows, cols/32]
//   F16:  w   f16 [rows, cols]
// Activations that feed quantized matrices are quantized to q8_1 per 32 values (as ggml does):
//   xq i8 [n, cols], xd float2 [n, cols/32] = (scale d, d * sum of the 32 int8 values)
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#define QK 32          // values per quantization block, for every quant type we support
#define WARP 32
#define PAGE 32        // tokens per KV-cache page (the host's engine uses the same constant)

// Nibble j of a Q4 block (GGUF order): byte j holds w[j] (low) and w[j + 16] (high).
__device__ __forceinline__ int q4_nibble(const uint8_t* qs, int j) {
    return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds blockDim.x/32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// Quantize 32 consecutive values held one per lane of a warp to q8_1. Lane i writes xq[i];
// lane 0 writes the block's (d, d*sum).
__device__ __forceinline__ void warp_quantize_q8_1(float v, int8_t* xq, float2* xd) {
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
    const float s = warp_sum((float)q);
    xq[threadIdx.x % WARP] = (int8_t)q;
    if (threadIdx.x % WARP == 0) *xd = make_float2(d, d * s);
}
