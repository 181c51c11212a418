// Causal grouped-query attention over the paged fp16 KV cache (cache[page, kv_head, slot, hd], see rope.cu).
//
// Both kernels come in two entry points: head_dim 64/128, and 256 (Gemma) in its own (*_hd256), so that the
// 64/128 kernels keep their register counts.
//
// Decode (one new token per sequence) is one kernel per layer, attn_decode_f16, fusing what would otherwise
// be three launches (decode is bound by launch count, not bytes, on small models):
//   1. (qk_norm architectures) RMSNorm over each q head and the k head, then RoPE on the token's q heads (in
//      shared memory) and, in the block whose split holds the new position, on its k head, and the fp16 write
//      of k and v into the cache;
//   2. split-KV flash-decoding: each of S splits takes a contiguous run of pages and computes an unnormalized
//      partial (running max m, sum l, acc[hd]) so that a long context spreads over the whole GPU;
//   3. the last block to finish for a (sequence, kv head) — found with an atomic counter — merges the S
//      partials, writes the fp32 output [B, H*hd] and its q8x2 quantization for the output projection, and
//      resets the counter for the next step.
// A block serves one kv head and all G = H/Hkv query heads that share it, so each K/V row is read once.
// Inside a block, LPK = hd/8 lanes share one key (16 bytes each), so a warp scores 32/LPK keys at a time.
//
// Prefill (T new tokens of one sequence at positions start..start+T-1) uses attn_prefill_f16 (after
// rope_kv_f32 has rotated q, k and filled the cache): flash-attention with an online softmax; a block holds 16
// queries of one head and walks 32-key tiles (one page each) up to the causal limit; lanes own keys for the
// scores and head dims for the output.
// Scores are scaled by `scale` (the architecture's 1/sqrt(query_pre_attn_scalar), usually 1/sqrt(hd)), then
// soft-capped (cap * tanh(s / cap)) when softcap > 0; everything accumulates in fp32.
// Sliding window (window > 0, a local layer of Gemma 3 and the like): the query at position p sees the keys at
// p - window + 1 .. p, itself included (Config.layer_window, the CPU reference's mask); window 0 sees 0 .. p.
// Decode spreads its splits over the pages that hold the window only; prefill starts at the first tile any of
// its queries can see and masks per query.
#include "attention.cuh"   // load8, rope_head, warp_rmsnorm, softcapped, GMAX, NEG_BIG

template <int HD>
__device__ void attn_decode(const float* __restrict__ qkv, const float2* __restrict__ rope, int rope_dim, int neox,
                            __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                            const int* __restrict__ block_table, int max_pages, const int* __restrict__ pos,
                            float* __restrict__ part_acc, float2* __restrict__ part_ml, int* __restrict__ counters,
                            float* __restrict__ out, int8_t* __restrict__ outq, float4* __restrict__ outd,
                            __half* __restrict__ outh, int H, int Hkv, int S, float scale,
                            const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                            int window, float softcap) {
    constexpr int LPK = HD / 8, KPW = WARP / LPK, KPB = ATT_WARPS * KPW;
    // Shared memory is the launch's dynamic allocation (Kernels.decode_smem(hd) bytes: static arrays of all
    // three head sizes would add up past 48 KiB), carved as sq [GMAX][HD], sk [HD], sm_m, sm_l
    // [ATT_WARPS][GMAX], sm_acc [ATT_WARPS][GMAX][HD].
    extern __shared__ float smem[];
    float (*sq)[HD] = reinterpret_cast<float (*)[HD]>(smem);
    float* sk = smem + GMAX * HD;
    float (*sm_m)[GMAX] = reinterpret_cast<float (*)[GMAX]>(sk + HD);
    float (*sm_l)[GMAX] = reinterpret_cast<float (*)[GMAX]>(sk + HD + ATT_WARPS * GMAX);
    float (*sm_acc)[GMAX][HD] = reinterpret_cast<float (*)[GMAX][HD]>(sk + HD + 2 * ATT_WARPS * GMAX);
    __shared__ int is_last;

    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, G = H / Hkv, tid = threadIdx.x;
    // The keys this token sees are [lo, p]: the splits share the pages first_page .. npages-1 that hold them.
    const int p = pos[b], len = p + 1, lo = window > 0 ? max(0, p - window + 1) : 0, first_page = lo / PAGE;
    const int npages = (len + PAGE - 1) / PAGE - first_page, per_split = (npages + S - 1) / S;
    const int k_begin = max(lo, (first_page + split * per_split) * PAGE);
    const int k_end = min((first_page + (split + 1) * per_split) * PAGE, len);
    const size_t part = ((size_t)b * H + (size_t)kvh * G) * S + split;    // + g*S for query head kvh*G + g
    const float* row = qkv + (size_t)b * (H + 2 * Hkv) * HD;
    const float2* cs = rope + (size_t)p * (rope_dim / 2);

    const bool owns_new = k_begin <= p && p < k_end;
    if (k_begin >= k_end) {                       // an empty split (short context): nothing to read or write
        if (tid < G) part_ml[part + (size_t)tid * S] = make_float2(NEG_BIG, 0.0f);
    } else {                                      // (block-uniform branch: the barriers inside are safe)
        // 1. q heads (rotated, scaled) into shared memory; the split holding position p writes its k, v to the cache.
        for (int i = tid; i < G * HD; i += blockDim.x) sq[i / HD][i % HD] = row[(size_t)kvh * G * HD + i];
        if (owns_new) for (int d = tid; d < HD; d += blockDim.x) sk[d] = row[(size_t)(H + kvh) * HD + d];
        __syncthreads();
        if (q_norm) {                             // one warp per head: the G q heads, then k (if written here)
            for (int g = tid / WARP; g < G + (owns_new ? 1 : 0); g += blockDim.x / WARP)
                if (g < G) warp_rmsnorm(sq[g], q_norm, HD, eps);
                else warp_rmsnorm(sk, k_norm, HD, eps);
            __syncthreads();
        }
        for (int g = 0; g < G; g++) rope_head(sq[g], cs, rope_dim, neox, tid, blockDim.x);
        if (owns_new) rope_head(sk, cs, rope_dim, neox, tid, blockDim.x);
        __syncthreads();
        for (int i = tid; i < G * HD; i += blockDim.x) sq[i / HD][i % HD] *= scale;
        if (owns_new) {
            const int page = block_table[(size_t)b * max_pages + p / PAGE];
            const size_t o = (((size_t)page * Hkv + kvh) * PAGE + p % PAGE) * HD;
            for (int d = tid; d < HD; d += blockDim.x) {
                k_cache[o + d] = __float2half(sk[d]);
                v_cache[o + d] = __float2half(row[(size_t)(H + Hkv + kvh) * HD + d]);
            }
        }
        __syncthreads();

        // 2. this split's partial over keys [k_begin, k_end)
        const int lane = tid % WARP, warp = tid / WARP, grp = lane / LPK, sub = lane % LPK;
        float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
        for (int g = 0; g < GMAX; g++) { m[g] = NEG_BIG; l[g] = 0.0f; for (int i = 0; i < 8; i++) acc[g][i] = 0.0f; }

        for (int kw = k_begin + warp * KPW; kw < k_end; kw += KPB) {     // uniform per warp: shuffles stay legal
            const int j = kw + grp;
            const bool valid = j < k_end;
            float k8[8] = {}, v8[8] = {};
            if (valid) {
                const int page = block_table[(size_t)b * max_pages + j / PAGE];
                const size_t o = (((size_t)page * Hkv + kvh) * PAGE + j % PAGE) * HD + sub * 8;
                load8(k_cache + o, k8);
                load8(v_cache + o, v8);
            }
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                if (g >= G) break;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) s += k8[i] * sq[g][sub * 8 + i];
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
                s = valid ? softcapped(s, softcap) : -INFINITY;
                const float m_new = fmaxf(m[g], s), corr = __expf(m[g] - m_new), pr = __expf(s - m_new);
                l[g] = l[g] * corr + pr;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] = acc[g][i] * corr + pr * v8[i];
                m[g] = m_new;
            }
        }
        // Merge the KPW key groups of the warp (lanes with the same `sub` hold the same dims), then the warps.
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
            for (int o = LPK; o < WARP; o <<= 1) {
                const float mo = __shfl_xor_sync(0xffffffff, m[g], o), lo = __shfl_xor_sync(0xffffffff, l[g], o);
                const float M = fmaxf(m[g], mo), a = __expf(m[g] - M), c = __expf(mo - M);
                l[g] = l[g] * a + lo * c;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] = acc[g][i] * a + __shfl_xor_sync(0xffffffff, acc[g][i], o) * c;
                m[g] = M;
            }
            if (grp == 0) {
#pragma unroll
                for (int i = 0; i < 8; i++) sm_acc[warp][g][sub * 8 + i] = acc[g][i];
                if (sub == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
            }
        }
        __syncthreads();
        for (int i = tid; i < G * HD; i += blockDim.x) {
            const int g = i / HD, d = i % HD;
            float M = NEG_BIG;
            for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w][g]);
            float L = 0.0f, A = 0.0f;
            for (int w = 0; w < ATT_WARPS; w++) {
                const float e = __expf(sm_m[w][g] - M);
                L += sm_l[w][g] * e;
                A += sm_acc[w][g][d] * e;
            }
            part_acc[(part + (size_t)g * S) * HD + d] = A;
            if (d == 0) part_ml[part + (size_t)g * S] = make_float2(M, L);
        }
    }

    // 3. the last of the S blocks of this (sequence, kv head) merges the partials of the non-empty splits
    __threadfence();                              // partials visible device-wide before the count says so
    __syncthreads();
    int* counter = counters + (size_t)b * Hkv + kvh;
    if (tid == 0) is_last = atomicAdd(counter, 1) == S - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int lane = tid % WARP, active = (npages + per_split - 1) / per_split;   // splits that hold keys
    for (int chunk = tid / WARP; chunk < G * HD / WARP; chunk += blockDim.x / WARP) {   // 32 dims per warp
        const int g = chunk * WARP / HD, d = chunk * WARP % HD + lane;
        const size_t ph = ((size_t)b * H + (size_t)kvh * G + g) * S;
        // lane s holds split s's (m, l) (splits are at most MAX 32 = WARP); the warp agrees on M and L
        const float2 ml = lane < active ? __ldcg(part_ml + ph + lane) : make_float2(NEG_BIG, 0.0f);
        const float M = warp_max(ml.x), e = __expf(ml.x - M), L = warp_sum(ml.y * e);
        float A = 0.0f;
#pragma unroll 8
        for (int s = 0; s < active; s++) A += __ldcg(part_acc + (ph + s) * HD + d) * __shfl_sync(0xffffffff, e, s);
        const float o = A / L;
        const size_t i = (size_t)b * H * HD + ((size_t)kvh * G + g) * HD + d;
        out[i] = o;
        if (outh) outh[i] = __float2half(o);
        if (outq) warp_quantize_q8x2(o, outq + 2 * (i - lane), outd + i / QK);
    }
    if (tid == 0) *counter = 0;                   // ready for the next step (stream order separates steps)
}

// grid (S <= 32, Hkv, B), 128 threads, (GMAX*hd + hd + 2*ATT_WARPS*GMAX + ATT_WARPS*GMAX*hd) * 4 bytes of
// dynamic shared memory (Kernels.decode_smem; 42 KiB at hd 256, under the 48 KiB default). qkv [B, (H + 2 Hkv)
// hd] as the qkv product wrote it (q, k not yet normed or rotated); rope: the layer's table (local or global base); pos[b] = the new token's position;
// counters [B * Hkv] zero-initialized once, left zeroed after each launch. q_norm, k_norm [hd] or null (no
// qk-norm). Outputs: out fp32 [B, H*hd], and when non-null its q8x2 (outq, outd) and fp16 (outh) forms.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_decode_f16(const float* qkv, const float2* rope, int rope_dim, int neox, __half* k_cache, __half* v_cache,
                const int* block_table, int max_pages, const int* pos, float* part_acc, float2* part_ml,
                int* counters, float* out, int8_t* outq, float4* outd, __half* outh, int H, int Hkv, int hd, int S,
                float scale, const float* q_norm, const float* k_norm, float eps, int window, float softcap) {
    INGOT_PDL_ENTRY();
#define ATTN_DECODE(HD)                                                                                            \
    attn_decode<HD>(qkv, rope, rope_dim, neox, k_cache, v_cache, block_table, max_pages, pos, part_acc, part_ml,  \
                    counters, out, outq, outd, outh, H, Hkv, S, scale, q_norm, k_norm, eps, window, softcap)
    if (hd == 64) ATTN_DECODE(64);
    else ATTN_DECODE(128);
}

// hd 256 (Gemma) in a kernel of its own: a kernel gets the registers of its hungriest path, and the 64/128 one
// keeps the count it had before 256 existed. Same arguments and launch geometry as attn_decode_f16.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_decode_f16_hd256(const float* qkv, const float2* rope, int rope_dim, int neox, __half* k_cache,
                      __half* v_cache, const int* block_table, int max_pages, const int* pos, float* part_acc,
                      float2* part_ml, int* counters, float* out, int8_t* outq, float4* outd, __half* outh, int H,
                      int Hkv, int hd, int S, float scale, const float* q_norm, const float* k_norm, float eps,
                      int window, float softcap) {
    INGOT_PDL_ENTRY();
    ATTN_DECODE(256);
#undef ATTN_DECODE
}

template <int HD>
__device__ void attn_prefill(const float* __restrict__ qkv, int ldqkv, const __half* __restrict__ k_cache,
                             const __half* __restrict__ v_cache, const int* __restrict__ block_row, int start, int T,
                             __half* __restrict__ out, int H, int Hkv, float scale, int window, float softcap) {
    constexpr int QPW = ATT_QPW, QB = ATT_WARPS * QPW, DPL = HD / WARP;   // queries per warp/block, dims per lane
    // Dynamic shared memory (all head sizes share one kernel): sQ [QB][HD], sK [PAGE][HD+1], sV [PAGE][HD].
    // The +1 on sK rows: lanes read different rows of the same column, which would hit one bank.
    extern __shared__ float smem[];
    float (*sQ)[HD] = reinterpret_cast<float (*)[HD]>(smem);
    float (*sK)[HD + 1] = reinterpret_cast<float (*)[HD + 1]>(smem + QB * HD);
    float (*sV)[HD] = reinterpret_cast<float (*)[HD]>(smem + QB * HD + PAGE * (HD + 1));
    const int h = blockIdx.y, kvh = h / (H / Hkv), t0 = blockIdx.x * QB;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;

    for (int i = threadIdx.x; i < QB * HD; i += blockDim.x) {
        const int q = i / HD, d = i % HD;
        sQ[q][d] = t0 + q < T ? qkv[(size_t)(t0 + q) * ldqkv + (size_t)h * HD + d] * scale : 0.0f;
    }
    float m[QPW], l[QPW], acc[QPW][DPL];
#pragma unroll
    for (int q = 0; q < QPW; q++) { m[q] = NEG_BIG; l[q] = 0.0f; for (int i = 0; i < DPL; i++) acc[q][i] = 0.0f; }

    const int last_key = start + min(T, t0 + QB) - 1;                 // causal limit of this block's queries
    const int first_key = window > 0 ? max(0, start + t0 - window + 1) : 0;   // the first query's window start
    for (int tile = first_key / PAGE; tile * PAGE <= last_key; tile++) {
        __syncthreads();
        const int page = block_row[tile];
        for (int e = threadIdx.x; e < PAGE * HD / 8; e += blockDim.x) {
            const int key = e / (HD / 8), c = (e % (HD / 8)) * 8;
            float k8[8] = {}, v8[8] = {};
            if (tile * PAGE + key <= last_key) {
                const size_t o = (((size_t)page * Hkv + kvh) * PAGE + key) * HD + c;
                load8(k_cache + o, k8);
                load8(v_cache + o, v8);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) { sK[key][c + i] = k8[i]; sV[key][c + i] = v8[i]; }
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < QPW; q++) {
            const int t = t0 + warp * QPW + q;
            if (t >= T) break;                                        // uniform across the warp
            const int kpos = tile * PAGE + lane;
            float s = -INFINITY;
            if (kpos <= start + t && (window <= 0 || kpos > start + t - window)) {
                s = 0.0f;
#pragma unroll 16
                for (int d = 0; d < HD; d++) s += sQ[warp * QPW + q][d] * sK[lane][d];
                s = softcapped(s, softcap);
            }
            const float m_new = fmaxf(m[q], warp_max(s)), corr = __expf(m[q] - m_new), p = __expf(s - m_new);
            l[q] = l[q] * corr + warp_sum(p);
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                float a = acc[q][i] * corr;
                for (int j = 0; j < PAGE; j++) a += __shfl_sync(0xffffffff, p, j) * sV[j][lane + i * WARP];
                acc[q][i] = a;
            }
            m[q] = m_new;
        }
    }
#pragma unroll
    for (int q = 0; q < QPW; q++) {
        const int t = t0 + warp * QPW + q;
        if (t >= T) break;
#pragma unroll
        for (int i = 0; i < DPL; i++)
            out[(size_t)t * H * HD + (size_t)h * HD + lane + i * WARP] = __float2half(acc[q][i] / l[q]);
    }
}

// grid (ceil(T/16), H), 128 threads, (16*hd + 32*(hd+1) + 32*hd) * 4 bytes of dynamic shared memory (80 KiB
// at hd 256: past the 48 KiB default, so the host opts in, Kernels.__init__; past sm_75's 64 KiB maximum, so
// the engine refuses hd 256 there).
// block_row: this sequence's row of the block table; tok_pos: the chunk's positions (contiguous).
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_prefill_f16(const float* qkv, int ldqkv, const __half* k_cache, const __half* v_cache, const int* block_row,
                 const int* tok_pos, int T, __half* out, int H, int Hkv, int hd, float scale, int window,
                 float softcap) {
    INGOT_PDL_ENTRY();
    const int start = tok_pos[0];      // positions are start..start+T-1; kept on the device so a prefill plan
                                       // (and its launches) depends only on T
#define ATTN_PREFILL(HD) \
    attn_prefill<HD>(qkv, ldqkv, k_cache, v_cache, block_row, start, T, out, H, Hkv, scale, window, softcap)
    if (hd == 64) ATTN_PREFILL(64);
    else ATTN_PREFILL(128);
}

// hd 256 in a kernel of its own, as attn_decode_f16_hd256 (registers), with its 80 KiB of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_prefill_f16_hd256(const float* qkv, int ldqkv, const __half* k_cache, const __half* v_cache,
                       const int* block_row, const int* tok_pos, int T, __half* out, int H, int Hkv, int hd,
                       float scale, int window, float softcap) {
    INGOT_PDL_ENTRY();
    const int start = tok_pos[0];
    ATTN_PREFILL(256);
#undef ATTN_PREFILL
}
