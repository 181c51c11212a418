// Shared device helpers for Ingot's kernels: weight layouts, warp/block reductions, q8x2 activations.
//
// Weight layout on the GPU ("soa-v1"): GGUF stores quantized rows as arrays of blocks (scale, quants)
// whose 18- or 20-byte size defeats 16-byte loads. At load time every quantized matrix [rows, cols] is
// repacked into separate arrays, each row contiguous:
//   Q4_0: qs  u8  [rows, cols/2]   (GGUF nibble order kept: byte j of a block = w[j] | w[j+16] << 4)
//         d   f16 [rows, cols/32]
//   Q4_1: qs as Q4_0, d f16 [rows, cols/32], m f16 [rows, cols/32]
//   Q8_0: qs  i8  [rows, cols], d f16 [rows, cols/32]
//   F16:  w   f16 [rows, cols]
// Activations that feed quantized matrices are quantized per 32 values to "q8x2" (see warp_quantize_q8x2):
//   xq i8 [n, 2*cols] (per block: 32 coarse then 32 fine int8), xd float4 [n, cols/32] = (d1, d2, s, 0)
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include "constants.cuh"   // QK, PAGE, epilogue modes, block shapes: shared with the host (runtime/gpu/constants.py)

#define WARP 32

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

// Quantize 32 consecutive values held one per lane of a warp to q8x2: two int8 levels per value,
// v ~= d1*q1 + d2*q2 with d1 = amax/127, d2 = d1/254 (the second level quantizes the first level's rounding
// error, so the pair carries ~15 bits: integer dot products stay exact and the result matches float
// activations to ~1e-5). Block layout: xq[0..31] = q1, xq[32..63] = q2; xd = (d1, d2, d1*sum(q1) + d2*sum(q2)).
// The reciprocals are correctly rounded (__frcp_rn): q1 may differ from round(v/d1) only at an exact .5 tie,
// which leaves |v - q1*d1| <= d1/2 (plus one rounding), still inside the fine level's +-127 range.
__device__ __forceinline__ void warp_quantize_q8x2(float v, int8_t* xq, float4* xd) {
    const int lane = threadIdx.x % WARP;
    const float amax = warp_max(fabsf(v));
    const float d1 = amax / 127.0f, d2 = d1 / 254.0f;
    float q1 = 0.0f, q2 = 0.0f;
    if (amax > 0.0f) {
        q1 = rintf(v * __frcp_rn(d1));
        q2 = fminf(fmaxf(rintf(fmaf(-q1, d1, v) * __frcp_rn(d2)), -127.0f), 127.0f);
    }
    const float s = d1 * warp_sum(q1) + d2 * warp_sum(q2);
    xq[lane] = (int8_t)q1;
    xq[WARP + lane] = (int8_t)q2;
    if (lane == 0) *xd = make_float4(d1, d2, s, 0.0f);
}
