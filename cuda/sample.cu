// Token sampling on the GPU, one block (1024 threads) per sequence, so the logits never leave the device.
//
// Per sequence b, from logits [B, V] fp32 and per-sequence parameters:
//   1. repetition penalty over the distinct tokens in hist[b, :hist_len[b]] (llama.cpp's rule: divide positive
//      logits by the penalty, multiply negative ones); then, for a constrained sequence (masked[b] != 0;
//      runtime/structured.py), every token whose bit is clear in its allowed-token bitmask
//      mask[b, :mask_words] (uint32 words, bit t % 32 of word t / 32) gets logit -inf, in place, so it is out of
//      the argmax and of every filter below (the CPU sampler masks at the same point);
//   2. temperature <= 0: argmax (ties -> lowest id). Otherwise a candidate threshold t (logit >= t) on the
//      untempered logits, in llama.cpp's order (runtime/sampling.py is the reference): top-k (the k-th largest
//      logit, by bisection on t), then top-p over the top-k candidates (the largest t whose candidates still hold
//      top_p of their untempered probability mass, by bisection), then min-p (logit >= max + log(min_p));
//   3. temperature applies to the survivors only: draw u ~ U[0,1) from a counter-based hash of (seed[b],
//      counter[b]) — the same seed and position give the same token — and pick the first token, in id order,
//      whose cumulative weight exp((logit - max) / temperature) passes u * total.
// When V*4 bytes fit in shared memory the logits are staged there, since each bisection step re-reads them.
#include "common.cuh"

#define BISECT_STEPS 24

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

struct ArgMax { float v; int i; };

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax x, ArgMax* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax y{__shfl_xor_sync(0xffffffff, x.v, o), __shfl_xor_sync(0xffffffff, x.i, o)};
        x = better(x, y);
    }
    __syncthreads();
    if (threadIdx.x % WARP == 0) scratch[threadIdx.x / WARP] = x;
    __syncthreads();
    const int lane = threadIdx.x % WARP;
    x = lane < (int)(blockDim.x / WARP) ? scratch[lane] : ArgMax{-INFINITY, 0x7fffffff};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax y{__shfl_xor_sync(0xffffffff, x.v, o), __shfl_xor_sync(0xffffffff, x.i, o)};
        x = better(x, y);
    }
    return x;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_f32(float* __restrict__ logits, int V, int ld, const float* __restrict__ temperature,
           const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
           const float* __restrict__ penalty, const int* __restrict__ hist, const int* __restrict__ hist_len,
           int hist_cap, const unsigned long long* __restrict__ seed, const int* __restrict__ counter,
           const int* __restrict__ masked, const unsigned* __restrict__ mask, int mask_words,
           int* __restrict__ out_token, int use_smem) {
    INGOT_PDL_ENTRY();
    extern __shared__ float staged[];
    __shared__ float red[WARP];
    __shared__ ArgMax red_arg[WARP];
    __shared__ float chunk_sums[SAMPLE_THREADS];
    const int b = blockIdx.x, tid = threadIdx.x;
    float* row = logits + (size_t)b * ld;

    // 1. repetition penalty, once per distinct token
    const float pen = penalty[b];
    if (pen != 1.0f) {
        const int* hb = hist + (size_t)b * hist_cap;
        const int n = min(hist_len[b], hist_cap);
        for (int i = tid; i < n; i += blockDim.x) {
            const int tok = hb[i];
            bool first = tok >= 0 && tok < V;
            for (int j = 0; j < i && first; j++) first = hb[j] != tok;
            if (first) { const float l = row[tok]; row[tok] = l > 0.0f ? l / pen : l * pen; }
        }
        __syncthreads();
    }
    // 1b. the allowed-token mask (masked == nullptr: no sequence of this launch is constrained)
    if (masked != nullptr && masked[b]) {
        const unsigned* mb = mask + (size_t)b * mask_words;
        for (int i = tid; i < V; i += blockDim.x)
            if (!((mb[i >> 5] >> (i & 31)) & 1u)) row[i] = -INFINITY;
        __syncthreads();
    }
    // 2. greedy: one pass over the logits (staging them in shared memory would only pay off for sampling)
    const float temp = temperature[b];
    const float* z = row;
    if (use_smem && temp > 0.0f) {
        for (int i = tid; i < V; i += blockDim.x) staged[i] = row[i];
        __syncthreads();
        z = staged;
    }
    ArgMax best{-INFINITY, 0x7fffffff};
    for (int i = tid; i < V; i += blockDim.x) best = better(best, ArgMax{z[i], i});
    best = block_argmax(best, red_arg);
    if (temp <= 0.0f) {
        if (tid == 0) out_token[b] = best.i;
        return;
    }
    const float inv_t = 1.0f / temp, zmax = best.v;            // the filters read the untempered logits z

    float t = -INFINITY;                                       // candidates: z >= t
    const int k = top_k[b];
    if (k > 0 && k < V) {                                      // largest t with count(z >= t) >= k
        float zmin = INFINITY;                                 // over the allowed (finite) logits
        for (int i = tid; i < V; i += blockDim.x) if (z[i] > -INFINITY) zmin = fminf(zmin, z[i]);
        float lo = -block_max(-zmin, red), hi = zmax;
        for (int step = 0; step < BISECT_STEPS; step++) {
            const float mid = 0.5f * (lo + hi);
            float cnt = 0.0f;
            for (int i = tid; i < V; i += blockDim.x) cnt += z[i] >= mid ? 1.0f : 0.0f;
            if (block_sum(cnt, red) >= k) lo = mid; else hi = mid;
        }
        t = lo;
    }
    const float p = top_p[b];
    if (p < 1.0f) {                                            // largest t' >= t keeping mass >= p * mass(z >= t)
        float total = 0.0f;
        for (int i = tid; i < V; i += blockDim.x) if (z[i] >= t) total += __expf(z[i] - zmax);
        total = block_sum(total, red);
        float lo = t == -INFINITY ? zmax - 80.0f : t, hi = zmax;
        for (int step = 0; step < BISECT_STEPS; step++) {
            const float mid = 0.5f * (lo + hi);
            float mass = 0.0f;
            for (int i = tid; i < V; i += blockDim.x) if (z[i] >= mid) mass += __expf(z[i] - zmax);
            if (block_sum(mass, red) >= p * total) lo = mid; else hi = mid;
        }
        t = fmaxf(t, lo);
    }
    if (min_p[b] > 0.0f) t = fmaxf(t, zmax + __logf(min_p[b]));
    float total = 0.0f;                                        // the tempered mass of the candidates
    for (int i = tid; i < V; i += blockDim.x) if (z[i] >= t) total += __expf((z[i] - zmax) * inv_t);
    total = block_sum(total, red);

    // 3. inverse-CDF draw in id order: each thread owns a contiguous chunk of ids
    const unsigned long long r = splitmix64(seed[b] ^ splitmix64((unsigned long long)counter[b]));
    const float target = (float)((r >> 11) * (1.0 / 9007199254740992.0)) * total;
    const int per = (V + blockDim.x - 1) / blockDim.x, lo_i = tid * per, hi_i = min(V, lo_i + per);
    float mine = 0.0f;
    for (int i = lo_i; i < hi_i; i++) if (z[i] >= t) mine += __expf((z[i] - zmax) * inv_t);
    chunk_sums[tid] = mine;
    __syncthreads();
    if (tid == 0) {                                            // 1024 partial sums: a serial scan is cheap
        float run = 0.0f;
        int owner = -1;
        for (int i = 0; i < (int)blockDim.x; i++) {
            if (run + chunk_sums[i] > target && chunk_sums[i] > 0.0f) { owner = i; break; }
            run += chunk_sums[i];
        }
        int tok = best.i;                                      // rounding fallback: the most likely token
        if (owner >= 0) {
            const int a = owner * per, e = min(V, a + per);
            for (int i = a; i < e; i++) {
                if (z[i] < t || z[i] == -INFINITY) continue;   // a masked token has no weight
                run += __expf((z[i] - zmax) * inv_t);
                tok = i;
                if (run > target) break;
            }
        }
        out_token[b] = tok;
    }
}
