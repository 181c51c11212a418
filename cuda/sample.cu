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
//
// Large vocabularies (Gemma's 262,144, Llama 3's 128,256) split the per-token passes over many blocks: first
// sample_prep_f32, grid (nchunks, B), applies step 1 (penalty, mask) to its chunk of ids and writes the chunk's
// argmax and its smallest finite logit; sample_f32 then skips step 1 and takes the argmax (and top-k's lower
// bracket) from the nchunks results instead of a pass over V. Both reductions are order-independent (argmax
// with ties to the lowest id is a total order; min is exact), and step 1 touches each token once either way,
// so the sampled token is bit-for-bit the single-block path's. Greedy decoding then reads the logits once
// across the GPU instead of in one block; sampling with temperature > 0 still runs its bisections in one block.
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

// f(z[i], i) for i = first, first + stride, ... < end, SCAN_U loads in flight a thread: a plain loop waits for each
// load before using it and issues the next load after, one L2 round trip an element (cuda/PERF.md v35: SmolLM2's
// greedy pass, 48 logits a thread over 49,152, took 10.7 us). f sees the elements in their order within each trip.
#define SCAN_U 8
template <class F>
__device__ __forceinline__ void scan_strided(const float* z, int first, int end, int stride, F f) {
    int i = first;
    for (; i + (SCAN_U - 1) * stride < end; i += SCAN_U * stride) {
        float v[SCAN_U];
#pragma unroll
        for (int u = 0; u < SCAN_U; u++) v[u] = z[i + u * stride];
#pragma unroll
        for (int u = 0; u < SCAN_U; u++) f(v[u], i + u * stride);
    }
    for (; i < end; i += stride) f(z[i], i);
}

// The argmax (ties to the lowest id) of z[i] for i = first, first + stride, ... < end, and with ZMIN the smallest
// finite z[i] (+inf if none) into *zmin. The order of the compares does not change the result: argmax with ties to
// the lowest id and min are order-independent.
template <bool ZMIN>
__device__ __forceinline__ ArgMax scan_row(const float* z, int first, int end, int stride, float* zmin) {
    ArgMax best{-INFINITY, 0x7fffffff};
    float lo = INFINITY;
    scan_strided(z, first, end, stride, [&](float v, int i) {
        best = better(best, ArgMax{v, i});
        if (ZMIN && v > -INFINITY) lo = fminf(lo, v);
    });
    if (ZMIN) *zmin = lo;
    return best;
}

// Step 1 of one sequence's row, in place: the repetition penalty on the distinct history tokens in [lo, hi)
// (each token once: its first occurrence in the history), then the allowed-token mask on [lo, hi).
__device__ void penalize_and_mask(float* row, int lo, int hi, int b, const float* __restrict__ penalty,
                                  const int* __restrict__ hist, const int* __restrict__ hist_len, int hist_cap,
                                  const int* __restrict__ masked, const unsigned* __restrict__ mask, int mask_words) {
    const int tid = threadIdx.x;
    const float pen = penalty[b];
    if (pen != 1.0f) {
        const int* hb = hist + (size_t)b * hist_cap;
        const int n = min(hist_len[b], hist_cap);
        for (int i = tid; i < n; i += blockDim.x) {
            const int tok = hb[i];
            bool first = tok >= lo && tok < hi;
            for (int j = 0; j < i && first; j++) first = hb[j] != tok;
            if (first) { const float l = row[tok]; row[tok] = l > 0.0f ? l / pen : l * pen; }
        }
        __syncthreads();
    }
    // masked == nullptr: no sequence of this launch is constrained
    if (masked != nullptr && masked[b]) {
        const unsigned* mb = mask + (size_t)b * mask_words;
        for (int i = lo + tid; i < hi; i += blockDim.x)
            if (!((mb[i >> 5] >> (i & 31)) & 1u)) row[i] = -INFINITY;
        __syncthreads();
    }
}

// grid (nchunks, B), PREP_THREADS threads: block (c, b) owns ids [c*chunk, min(V, (c+1)*chunk)) of row b:
// step 1 on them, then chunks[b * nchunks + c] = (max logit, its id (lowest on ties) as int bits, smallest
// finite logit (+inf if none), 0). Parameters as sample_f32's.
extern "C" __global__ void __launch_bounds__(PREP_THREADS)
sample_prep_f32(float* __restrict__ logits, int V, int ld, int chunk, const float* __restrict__ penalty,
                const int* __restrict__ hist, const int* __restrict__ hist_len, int hist_cap,
                const int* __restrict__ masked, const unsigned* __restrict__ mask, int mask_words,
                float4* __restrict__ chunks) {
    INGOT_PDL_ENTRY();
    __shared__ float red[WARP];
    __shared__ ArgMax red_arg[WARP];
    const int c = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    const int lo = c * chunk, hi = min(V, lo + chunk);
    float* row = logits + (size_t)b * ld;
    penalize_and_mask(row, lo, hi, b, penalty, hist, hist_len, hist_cap, masked, mask, mask_words);
    float zmin;
    ArgMax best = scan_row<true>(row, lo + tid, hi, blockDim.x, &zmin);
    best = block_argmax(best, red_arg);
    zmin = -block_max(-zmin, red);
    if (tid == 0) chunks[(size_t)b * gridDim.x + c] = make_float4(best.v, __int_as_float(best.i), zmin, 0.0f);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_f32(float* __restrict__ logits, int V, int ld, const float* __restrict__ temperature,
           const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
           const float* __restrict__ penalty, const int* __restrict__ hist, const int* __restrict__ hist_len,
           int hist_cap, const unsigned long long* __restrict__ seed, const int* __restrict__ counter,
           const int* __restrict__ masked, const unsigned* __restrict__ mask, int mask_words,
           int* __restrict__ out_token, int use_smem, const float4* __restrict__ chunks, int nchunks) {
    INGOT_PDL_ENTRY();
    extern __shared__ float staged[];
    __shared__ float red[WARP];
    __shared__ ArgMax red_arg[WARP];
    __shared__ float chunk_sums[SAMPLE_THREADS];
    __shared__ float s_t0;
    const int b = blockIdx.x, tid = threadIdx.x;
    float* row = logits + (size_t)b * ld;
    const float4* cb = chunks ? chunks + (size_t)b * nchunks : nullptr;   // sample_prep_f32's results, or none

    // 1. repetition penalty, once per distinct token; the allowed-token mask (done by sample_prep_f32 if chunks)
    if (!cb) penalize_and_mask(row, 0, V, b, penalty, hist, hist_len, hist_cap, masked, mask, mask_words);
    // 2. greedy: one pass over the logits (staging them in shared memory would only pay off for sampling)
    const float temp = temperature[b];
    const float* z = row;
    if (use_smem && temp > 0.0f) {
        scan_strided(row, tid, V, blockDim.x, [&](float v, int i) { staged[i] = v; });
        __syncthreads();
        z = staged;
    }
    ArgMax best{-INFINITY, 0x7fffffff};
    if (cb) for (int c = tid; c < nchunks; c += blockDim.x) best = better(best, ArgMax{cb[c].x, __float_as_int(cb[c].y)});
    else best = scan_row<false>(z, tid, V, blockDim.x, nullptr);
    best = block_argmax(best, red_arg);
    if (temp <= 0.0f) {
        if (tid == 0) out_token[b] = best.i;
        return;
    }
    const float inv_t = 1.0f / temp, zmax = best.v;            // the filters read the untempered logits z

    // Candidate lists (prep path with 0 < top_k <= nchunks): every rule below sums over "z >= threshold" for
    // thresholds >= t (top-k's cut), so the ids with z < T1 <= t never add a term. The row is read once, each
    // thread keeping its own ids (tid, tid + blockDim, ... ascending: the order its sums add in) with z >= T1 in
    // shared memory; the passes then read those, adding the same terms in the same order as the full row would.
    // T1 is a lower bound of the k-th largest logit: the k-th largest chunk maximum (k chunks hold a logit >= it)
    // less a margin wider than the bisection's last interval. Any overflow (more than CAND_SLOTS ids for a thread,
    // t < T1, more than DRAW_MAX drawable tokens) falls back to the row, so the token is always the row's.
    float* cz = staged;                                        // [CAND_SLOTS][blockDim]: logits
    int* ci = reinterpret_cast<int*>(staged + CAND_SLOTS * blockDim.x);   // [CAND_SLOTS][blockDim]: their ids
    bool cand = false;
    int nc = 0;
    float t1 = -INFINITY;
    auto each = [&](auto&& f) {                                // this thread's terms, in id order
        if (cand) for (int s = 0; s < nc; s++) f(cz[s * blockDim.x + tid]);
        else for (int i = tid; i < V; i += blockDim.x) f(z[i]);
    };

    float t = -INFINITY;                                       // candidates: z >= t
    const int k = top_k[b];
    if (k > 0 && k < V) {                                      // largest t with count(z >= t) >= k
        float zmin = INFINITY;                                 // over the allowed (finite) logits
        if (cb) for (int c = tid; c < nchunks; c += blockDim.x) zmin = fminf(zmin, cb[c].z);
        else for (int i = tid; i < V; i += blockDim.x) if (z[i] > -INFINITY) zmin = fminf(zmin, z[i]);
        float lo = -block_max(-zmin, red), hi = zmax;
        if (cb && k <= nchunks && nchunks <= (int)blockDim.x) {
            if (tid < nchunks) chunk_sums[tid] = cb[tid].x;   // (chunk_sums: free until the draw)
            __syncthreads();
            if (tid < nchunks) {                               // the chunk maximum of rank k - 1 (ties by chunk)
                const float v = chunk_sums[tid];
                int rank = 0;
                for (int c = 0; c < nchunks; c++) rank += chunk_sums[c] > v || (chunk_sums[c] == v && c < tid);
                if (rank == k - 1) s_t0 = v;
            }
            __syncthreads();
            const float t0 = s_t0;
            t1 = t0 - ((hi - lo) * 0x1p-12f + fabsf(t0) * 0x1p-20f);
            if (isfinite(t1) && isfinite(lo)) {                // (block-uniform)
                for (int i = tid; i < V; i += blockDim.x) {
                    const float zi = z[i];
                    if (zi >= t1) {
                        if (nc < CAND_SLOTS) { cz[nc * blockDim.x + tid] = zi; ci[nc * blockDim.x + tid] = i; }
                        nc++;
                    }
                }
                cand = !__syncthreads_or(nc > CAND_SLOTS);
            }
        }
        for (int step = 0; step < BISECT_STEPS; step++) {
            const float mid = 0.5f * (lo + hi);
            float cnt = 0.0f;
            each([&](float zi) { cnt += zi >= mid ? 1.0f : 0.0f; });
            if (block_sum(cnt, red) >= k) lo = mid; else hi = mid;
        }
        t = lo;
        cand = cand && t >= t1;                                // every z >= t is a candidate (block-uniform)
    }
    const float p = top_p[b];
    if (p < 1.0f) {                                            // largest t' >= t keeping mass >= p * mass(z >= t)
        float total = 0.0f;
        each([&](float zi) { if (zi >= t) total += __expf(zi - zmax); });
        total = block_sum(total, red);
        float lo = t == -INFINITY ? zmax - 80.0f : t, hi = zmax;
        for (int step = 0; step < BISECT_STEPS; step++) {
            const float mid = 0.5f * (lo + hi);
            float mass = 0.0f;
            each([&](float zi) { if (zi >= mid) mass += __expf(zi - zmax); });
            if (block_sum(mass, red) >= p * total) lo = mid; else hi = mid;
        }
        t = fmaxf(t, lo);
    }
    if (min_p[b] > 0.0f) t = fmaxf(t, zmax + __logf(min_p[b]));
    float total = 0.0f;                                        // the tempered mass of the candidates
    each([&](float zi) { if (zi >= t) total += __expf((zi - zmax) * inv_t); });
    total = block_sum(total, red);

    // 3. inverse-CDF draw in id order: each thread owns a contiguous chunk of ids
    const unsigned long long r = splitmix64(seed[b] ^ splitmix64((unsigned long long)counter[b]));
    const float target = (float)((r >> 11) * (1.0 / 9007199254740992.0)) * total;
    const int per = (V + blockDim.x - 1) / blockDim.x;
    if (cand) {                                                // few enough drawable candidates to sort?
        float q = 0.0f;
        for (int s = 0; s < nc; s++) q += cz[s * blockDim.x + tid] >= t ? 1.0f : 0.0f;
        cand = block_sum(q, red) <= DRAW_MAX;
    }
    if (cand) {
        // The same draw from the candidates: thread 0 sorts the drawable ones by id (insertion), forms each
        // chunk's sum over them in id order as the owning thread would, and scans and walks as below.
        int* ncs = reinterpret_cast<int*>(chunk_sums);
        ncs[tid] = nc;
        __syncthreads();
        if (tid == 0) {
            int* di = ci + CAND_SLOTS * blockDim.x;            // [DRAW_MAX] ids, ascending
            float* dw = reinterpret_cast<float*>(di + DRAW_MAX);   // [DRAW_MAX] their tempered weights
            int n = 0;
            for (int u = 0; u < (int)blockDim.x; u++)
                for (int s = 0; s < ncs[u]; s++) {
                    const float zi = cz[s * blockDim.x + u];
                    if (!(zi >= t)) continue;
                    const int id = ci[s * blockDim.x + u];
                    int j = n++;
                    for (; j > 0 && di[j - 1] > id; j--) { di[j] = di[j - 1]; dw[j] = dw[j - 1]; }
                    di[j] = id;
                    dw[j] = __expf((zi - zmax) * inv_t);
                }
            float run = 0.0f;
            int tok = best.i;                                  // rounding fallback: the most likely token
            for (int j = 0; j < n;) {
                const int owner = di[j] / per;
                float cs = 0.0f;
                int e = j;
                for (; e < n && di[e] / per == owner; e++) cs += dw[e];
                if (run + cs > target && cs > 0.0f) {
                    for (int x = j; x < e; x++) { run += dw[x]; tok = di[x]; if (run > target) break; }
                    break;
                }
                run += cs;
                j = e;
            }
            out_token[b] = tok;
        }
        return;
    }
    const int lo_i = tid * per, hi_i = min(V, lo_i + per);
    float mine = 0.0f;
    for (int i = lo_i; i < hi_i; i++) if (z[i] >= t) mine += __expf((z[i] - zmax) * inv_t);
    __syncthreads();                                           // (chunk_sums may have held chunk maxima)
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
