// Helpers shared by the attention kernels (attention.cu: v7 decode and the scalar prefill; attention_decode.cu: v8
// decode; attention_prefill.cu: the tensor-core prefill): fp16 row loads, RoPE and RMSNorm of one head in shared
// memory, the score soft-cap, the running-max start and the decode block's GQA bound.
#pragma once
#include "common.cuh"

#define GMAX 8           // query heads per kv head one decode block serves (GQA group size; kernels.GQA_MAX)
#define NEG_BIG -1e30f   // running-max start: exp(NEG_BIG - m) == 0 without inf - inf

// A score soft-capped (Gemma 2's cap * tanh(s / cap)) when softcap > 0, else as it is.
__device__ __forceinline__ float softcapped(float s, float softcap) {
    return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

__device__ __forceinline__ void load8(const __half* p, float (&out)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; i++) { const float2 f = __half22float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}

// Rotate pair i of a head's first rope_dim dims in place (normal: dims (2i, 2i+1); neox: (i, i + rope_dim/2)) by
// the angle whose (cos, sin) is cs[i]: the one place both rope loops below take their arithmetic from.
__device__ __forceinline__ void rope_pair(float* x, const float2* cs, int i, int half_dim, int neox) {
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half_dim : 2 * i + 1;
    const float x0 = x[i0], x1 = x[i1];
    x[i0] = x0 * cs[i].x - x1 * cs[i].y;
    x[i1] = x0 * cs[i].y + x1 * cs[i].x;
}

// Rotate the first rope_dim dims of one head in place. Called by all threads of the block; pairs are split among
// them.
__device__ __forceinline__ void rope_head(float* x, const float2* cs, int rope_dim, int neox, int t, int nt) {
    const int half_dim = rope_dim / 2;
    for (int i = t; i < half_dim; i += nt) rope_pair(x, cs, i, half_dim, neox);
}

// The same over G heads of hd floats at q [G][hd] and, when k is not null, the head at k, in one pass: the
// (G + 1) * rope_dim/2 pairs split among the block's threads (rope_head per head left all but rope_dim/2 threads
// idle, G + 1 times in a row).
__device__ __forceinline__ void rope_heads(float* q, int G, float* k, int hd, const float2* cs, int rope_dim,
                                           int neox, int t, int nt) {
    const int half_dim = rope_dim / 2, pairs = (G + (k ? 1 : 0)) * half_dim;
    for (int n = t; n < pairs; n += nt) {
        const int h = n / half_dim, i = n - h * half_dim;
        rope_pair(h < G ? q + h * hd : k, cs, i, half_dim, neox);
    }
}

// RMSNorm of one head in place, x * w / sqrt(mean(x^2) + eps) over hd values: one warp per head.
__device__ __forceinline__ void warp_rmsnorm(float* x, const float* __restrict__ w, int hd, float eps) {
    const int lane = threadIdx.x % WARP;
    float ss = 0.0f;
    for (int d = lane; d < hd; d += WARP) ss += x[d] * x[d];
    const float r = rsqrtf(warp_sum(ss) / hd + eps);
    for (int d = lane; d < hd; d += WARP) x[d] *= r * w[d];
}
