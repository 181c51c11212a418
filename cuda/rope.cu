// Rotary position embedding of q and k (after their per-head RMSNorm, for qk_norm architectures), and the write
// of k and v into the paged KV cache.
//
// qkv [n, (H + 2*Hkv) * hd] fp32 holds each token's q heads, then k heads, then v heads. When q_norm/k_norm
// ([hd] fp32 each) are given, every q and k head is first RMS-normalized (x * w / sqrt(mean(x^2) + eps), Qwen 3
// and Gemma 3). RoPE then rotates the first rope_dim dims of every q and k head in place: pairs (2i, 2i+1) for
// llama/mistral ("normal"), (i, i + rope_dim/2) for the NEOX architectures. The angles come from a host-computed
// table rope[pos, i] = (cos, sin) of pos * theta_i (float64 on the host, the same numbers the CPU reference uses;
// the layer's own table when local and global layers have different bases), so long contexts keep full
// precision even though the kernels are built with --use_fast_math.
// Then k (normed, rotated) and v go to the cache as fp16: cache[page, kv_head, slot, hd], page =
// block_table[seq, pos/PAGE]. One block per token, one warp per head (norm and rotation stay inside the warp);
// tok_seq[i] is the token's batch slot (its row of block_table), tok_pos[i] its position.
#include "common.cuh"

extern "C" __global__ void rope_kv_f32(float* __restrict__ qkv, const float2* __restrict__ rope,
                                       const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                                       const int* __restrict__ block_table, int max_pages,
                                       __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                                       int H, int Hkv, int hd, int rope_dim, int neox,
                                       const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                       float eps) {
    INGOT_PDL_ENTRY();
    const int t = blockIdx.x, pos = tok_pos[t], half_dim = rope_dim / 2;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP;
    float* row = qkv + (size_t)t * (H + 2 * Hkv) * hd;
    const float2* cs = rope + (size_t)pos * half_dim;
    for (int head = warp; head < H + Hkv; head += nwarps) {
        float* x = row + (size_t)head * hd;
        if (q_norm) {
            const float* w = head < H ? q_norm : k_norm;
            float ss = 0.0f;
            for (int d = lane; d < hd; d += WARP) ss += x[d] * x[d];
            const float r = rsqrtf(warp_sum(ss) / hd + eps);
            for (int d = lane; d < hd; d += WARP) x[d] *= r * w[d];
            __syncwarp();                             // the rotation below reads other lanes' values
        }
        for (int i = lane; i < half_dim; i += WARP) {
            const int i0 = neox ? i : 2 * i, i1 = neox ? i + half_dim : 2 * i + 1;
            const float x0 = x[i0], x1 = x[i1], c = cs[i].x, s = cs[i].y;
            x[i0] = x0 * c - x1 * s;
            x[i1] = x0 * s + x1 * c;
        }
    }
    __syncthreads();
    const int page = block_table[(size_t)tok_seq[t] * max_pages + pos / PAGE], slot = pos % PAGE;
    const float* k = row + H * hd;
    const float* v = row + (H + Hkv) * hd;
    for (int e = threadIdx.x; e < Hkv * hd; e += blockDim.x) {
        const int kvh = e / hd, d = e % hd;
        const size_t o = (((size_t)page * Hkv + kvh) * PAGE + slot) * hd + d;
        k_cache[o] = __float2half(k[e]);
        v_cache[o] = __float2half(v[e]);
    }
}
