// Decode attention, v8: one new token per sequence over the paged fp16 KV cache (cache[page, kv_head, slot, hd],
// see rope.cu), whose cost follows the sequence's actual context length.
//
// One launch per layer, attn_decode_tile_f16 (head_dim 64/128) or attn_decode_tile_f16_hd256 (Gemma), fusing:
//   1. (qk_norm architectures) RMSNorm of each q head and of the k head, RoPE (the layer's table) on the G query
//      heads in shared memory and, in the block whose split holds the new position p, on k; that block writes
//      k and v (fp16) into the cache before it reads any key;
//   2. split-KV flash-decoding over the keys [lo, p] the token sees (lo = p - window + 1 on a sliding-window
//      layer, else 0): the pages holding them are cut into runs of per_split = ceil(npages / S) pages, so at
//      short context each block takes one 32-key page and at long context S blocks share it evenly (up to
//      ATT_ONE_SPLIT_PAGES pages run as one split: there a merge costs more than the pages' round trips). The number
//      of ACTIVE splits, ceil(npages / per_split), is derived in the kernel from pos[] (device memory: the CUDA
//      graph is replayed with new positions, nothing patched); blocks past it return before doing anything;
//   3. with one active split the block writes the output itself; otherwise each block writes an unnormalized
//      partial (m, l, acc[hd]) per query head and the last of the active blocks (an atomic counter per
//      (sequence, kv head), reset by it for the next step) merges them, all 128 threads over the G*hd outputs.
// A block serves one kv head and its G = H/Hkv query heads (GQA: each K/V row is read once), 128 threads.
// Per page the block stages K and V in shared memory (16-byte loads, rows padded by 16 bytes so the 32 lanes
// reading 32 different rows hit distinct banks), the next page's loads in flight in registers meanwhile:
//   scores: warp w takes query heads w, w+4, lane = key (a 32-key page is a warp): hd FMAs per lane, then the
//           tile's softmax update with warp reductions (running max m, sum l in shared memory);
//   P.V:    thread t owns the dim pair 2*(t % (hd/2)) of every query head, over the keys j = t / (hd/2) mod
//           256/hd (1, 2 or 4 key groups, summed once at the end).
// That is the FMA page (hd 256, and sm_75). hd 64 / 128 from sm_80 take the tensor-core page instead (DECODE_MMA,
// PERF.md v28: a page ~2x cheaper, the 8B's launch at 4,096 keys 15.9 -> 12.3 us on an H100): both products on
// mma.sync m16n8k16 with the G <= 8 query heads as the n8 columns, q and P rounded to fp16 as the prefill kernel's
// are, the softmax and every sum in fp32 (details at the page loop).
// Scores are scaled by `scale`, then soft-capped (cap * tanh(s / cap)) when softcap > 0; everything accumulates
// in fp32. Outputs: fp32 [B, H*hd], and when non-null its q8x2 (outq, outd) and fp16 (outh) forms.
// v7's kernels (attention.cu, attn_decode_f16*) stay reachable with INGOT_DECODE_ATTN=v7 until v8 is measured.
#include "attention.cuh"   // load8, rope_head, warp_rmsnorm, softcapped, GMAX, NEG_BIG
#include "mma.cuh"         // ldsm_x4, ldsm_x4_trans, mma16816 (sm_80+: the tensor-core page)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DECODE_MMA 1       // the tensor-core page is compiled (hd 64 / 128 take it); sm_75 and the host pass: not
#else
#define DECODE_MMA 0
#endif

// Dynamic shared memory of the block, in this order (Kernels.decode_smem computes the same total):
//   sK, sV    fp16 [PAGE][HD + 8]     the staged page
//   sq        fp32 [GMAX * 256]       q heads [G][HD]; after the key loop the P.V key groups [KG][GMAX][HD]
//   sk, sv    fp32 [HD] each          the new key (normed, rotated) and value
//   snq, snk  fp32 [HD] each          the q and k norm weights
//   scs       float2 [HD / 2]         the position's RoPE (cos, sin)
//   sp        fp32 [GMAX][PAGE]       the page's probabilities
//   scorr, sl, sm  fp32 [GMAX] each   per page: rescale factor; running sum and max
// (47.1 KiB at hd 256: under the 48 KiB every arch gives without an opt-in.)
// Latency, not bandwidth, bounds a short context, so everything the prologue reads (q, k, v, norm weights, RoPE
// row) is loaded in one round, and the first page's K/V loads are issued before it: the new key's row in the
// staged page is taken from shared memory (the fp16 values the cache gets), not read back from the cache.
template <int HD>
__device__ void attn_decode_tile(const float* __restrict__ qkv, const float2* __restrict__ rope, int rope_dim,
                                 int neox, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                                 const int* __restrict__ block_table, int max_pages, const int* __restrict__ pos,
                                 float* __restrict__ part_acc, float2* __restrict__ part_ml, int* __restrict__ counters,
                                 float* __restrict__ out, int8_t* __restrict__ outq, float4* __restrict__ outd,
                                 __half* __restrict__ outh, int H, int Hkv, int S, float scale,
                                 const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                                 int window, float softcap) {
    constexpr int NT = ATT_WARPS * WARP;          // 128 threads
    constexpr int ROW = HD + 8;                   // halves per staged row: +16 bytes, conflict-free row reads
    constexpr int CPR = HD / 8;                   // 16-byte chunks per row
    constexpr int LOADS = PAGE * CPR / NT;        // chunks of K (and of V) per thread per page: 2, 4, 8
    constexpr int HP = HD / 2;                    // dim pairs
    constexpr int KG = NT / HP;                   // P.V key groups: 4, 2, 1 (KG * HD == 256)
    constexpr bool MMA = DECODE_MMA && HD <= 128; // the tensor-core page (below); hd 256 and sm_75 the FMA one
    static_assert(PAGE == WARP && PAGE * CPR % NT == 0 && NT % HP == 0 && KG * HD == 256, "decode geometry");
    static_assert(GMAX * HD * 4 <= PAGE * ROW * 2, "the merged outputs fit over sK");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __half* sK = reinterpret_cast<__half*>(smem_raw);
    __half* sV = sK + PAGE * ROW;
    float* sq = reinterpret_cast<float*>(sV + PAGE * ROW);
    float* sk = sq + GMAX * 256;
    float* sv = sk + HD;
    float* snq = sv + HD;
    float* snk = snq + HD;
    float2* scs = reinterpret_cast<float2*>(snk + HD);
    float* sp = reinterpret_cast<float*>(scs + HD / 2);
    float* scorr = sp + GMAX * PAGE;
    float* sl = scorr + GMAX;
    float* sm = sl + GMAX;
    __shared__ int is_last;

    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, G = H / Hkv, tid = threadIdx.x;
    const int lane = tid % WARP, warp = tid / WARP;
    // The keys this token sees are [lo, p], on pages first_page .. first_page + npages - 1; split s takes pages
    // [first_page + s*per_split, +per_split). Every page of a split holds at least one visible key.
    // Before the PDL wait (INGOT_PDL_READ_AHEAD, common.cuh) the block reads only what no kernel of the step
    // writes: the position and block table (uploaded by the host), the split's first page of earlier steps' keys
    // and values, the RoPE row and the norm weights. The qkv product's output waits for it.
    const int p = pos[b], len = p + 1, lo = window > 0 ? max(0, p - window + 1) : 0;
    const int first_page = lo / PAGE, npages = p / PAGE - first_page + 1;
    const int per_split = npages <= ATT_ONE_SPLIT_PAGES ? npages : (npages + S - 1) / S;
    const int active = (npages + per_split - 1) / per_split;
    if (split >= active) {                        // (block-uniform: before any barrier)
        INGOT_PDL_ENTRY();                        // the chain stays transitive: every block waits (common.cuh)
        return;
    }
    const int page_begin = first_page + split * per_split;
    const int page_end = min(page_begin + per_split, first_page + npages);
    const int k_begin = max(lo, page_begin * PAGE), k_end = min(page_end * PAGE, len);
    const bool owns_new = split == active - 1;    // the last split holds p's page
    const float* row = qkv + (size_t)b * (H + 2 * Hkv) * HD;
    const float2* cs = rope + (size_t)p * (rope_dim / 2);

    // The split's first page is fetched into registers now; its loads overlap the prologue.
    const int* bt = block_table + (size_t)b * max_pages;
    uint4 rk[LOADS], rv[LOADS];
    auto fetch = [&](int pg) {                    // page pg's K, V rows of this kv head into registers
        const size_t base = ((size_t)bt[pg] * Hkv + kvh) * PAGE * HD;
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const int e = tid + i * NT, key = pg * PAGE + e / CPR;
            if (key >= k_begin && key < k_end) {  // keys outside [k_begin, k_end) may be stale or never written
                rk[i] = *reinterpret_cast<const uint4*>(k_cache + base + (size_t)e * 8);
                rv[i] = *reinterpret_cast<const uint4*>(v_cache + base + (size_t)e * 8);
            } else {
                rk[i] = rv[i] = make_uint4(0, 0, 0, 0);   // zero V: p = 0 must not meet a NaN
            }
        }
    };
    fetch(page_begin);                            // the row at p, not written yet, is replaced from sk, sv below
    const int new_page = owns_new ? bt[p / PAGE] : 0;   // where k, v go (read now: off the chain after the wait)
    for (int i = tid; i < rope_dim / 2; i += NT) scs[i] = cs[i];
    if (q_norm) for (int d = tid; d < HD; d += NT) { snq[d] = q_norm[d]; snk[d] = k_norm[d]; }
    if (tid < GMAX) { sm[tid] = NEG_BIG; sl[tid] = 0.0f; }
    INGOT_PDL_ENTRY();

    // 1. q heads (normed, rotated, scaled) into shared memory; the last split writes k, v to the cache. Every
    // float4 of q, k and v is loaded before the first is stored: one round trip, not one per loop trip (a store
    // waits for its load; at short context this phase was three L2 round trips, PERF.md v34).
    constexpr int QV = GMAX * HD / 4 / NT;        // float4s of q per thread at most: 1, 2, 4
    static_assert(QV * NT * 4 == GMAX * HD && HD / 4 <= NT, "whole float4 rounds of q; k and v one round");
    {
        const float4* q4 = reinterpret_cast<const float4*>(row + (size_t)kvh * G * HD);
        const float4* k4 = reinterpret_cast<const float4*>(row + (size_t)(H + kvh) * HD);
        const float4* v4 = reinterpret_cast<const float4*>(row + (size_t)(H + Hkv + kvh) * HD);
        float4 rq[QV], rkn = make_float4(0.0f, 0.0f, 0.0f, 0.0f), rvn = rkn;
#pragma unroll
        for (int j = 0; j < QV; j++)
            if (tid + j * NT < G * HD / 4) rq[j] = q4[tid + j * NT];
        const bool kv_here = owns_new && tid < HD / 4;
        if (kv_here) { rkn = k4[tid]; rvn = v4[tid]; }
#pragma unroll
        for (int j = 0; j < QV; j++)
            if (tid + j * NT < G * HD / 4) reinterpret_cast<float4*>(sq)[tid + j * NT] = rq[j];
        if (kv_here) { reinterpret_cast<float4*>(sk)[tid] = rkn; reinterpret_cast<float4*>(sv)[tid] = rvn; }
    }
    __syncthreads();
    if (q_norm) {                                 // one warp per head: the G q heads, then k (if written here)
        for (int g = warp; g < G + (owns_new ? 1 : 0); g += ATT_WARPS)
            warp_rmsnorm(g < G ? sq + g * HD : sk, g < G ? snq : snk, HD, eps);
        __syncthreads();
    }
    rope_heads(sq, G, owns_new ? sk : nullptr, HD, scs, rope_dim, neox, tid, NT);   // one pass over G (+1) heads
    __syncthreads();
    if (owns_new) {                               // (read by later steps; this one stages the row from sk, sv)
        const size_t o = (((size_t)new_page * Hkv + kvh) * PAGE + p % PAGE) * HD;
        for (int d = tid; d < HD; d += NT) {
            k_cache[o + d] = __float2half(sk[d]);
            v_cache[o + d] = __float2half(sv[d]);
        }
    }
    if (!MMA) {                                   // (the tensor-core page scales q as it rounds it to fp16)
        for (int i = tid; i < G * HD; i += NT) sq[i] *= scale;
        __syncthreads();                          // q ready
    }

    // 2. the split's pages: stage one, fetch the next, score, softmax update, P.V
    const int dp = tid % HP, kg = tid / HP;
    float acc[GMAX][2];
#pragma unroll
    for (int g = 0; g < GMAX; g++) acc[g][0] = acc[g][1] = 0.0f;
    // The tensor-core page (MMA: hd 64 / 128 from sm_80), both products with the roles turned around so the few
    // query heads are mma's n8 columns: scores^T [32 keys][8 heads] = K [keys][hd] . q^T (warps 0 and 1: one m16
    // tile of keys each, hd/16 k-steps; q's B fragments in registers for the whole split), and out^T [hd][8 heads]
    // += V^T [hd][32 keys] . P^T (each warp hd/64 m16 tiles of dims, V^T by transposing ldmatrix from sV, P as
    // fp16 rows [GMAX][PR]). Lane (lg, lc) of a warp's accumulators holds heads 2lc, 2lc+1 of rows lg, lg + 8. q and
    // P are rounded to fp16 (the prefill kernel's inputs too); scores, softmax and sums stay fp32. sQh, sPh: sq's
    // upper half (red below takes its lower half after the pages).
    constexpr int QR = HD + 8, PR = PAGE + 8, KS = HD / 16, MTW = HD / 16 / ATT_WARPS;
    static_assert(!MMA || (GMAX * HD * 4 + (GMAX * QR + GMAX * PR) * 2 <= GMAX * 256 * 4 && MTW >= 1 && GMAX == 8 &&
                           KS * 16 == HD),
                  "the tensor-core page: fp16 q and P within sq, whole m16 tiles per warp, n8 = GMAX heads");
#if DECODE_MMA
    __half* sQh = reinterpret_cast<__half*>(sq + GMAX * HD);
    __half* sPh = sQh + GMAX * QR;
    const int lg = lane / 4, lc = lane % 4;
    unsigned qf[MMA ? KS : 1][2];
    float o[MMA ? MTW : 1][4];
    if constexpr (MMA) {
        for (int i = tid; i < GMAX * QR; i += NT) {
            const int g = i / QR, d = i % QR;
            sQh[i] = __float2half(g < G && d < HD ? sq[g * HD + d] * scale : 0.0f);   // (as sq *= scale did)
        }
        for (int i = tid; i < GMAX * PR; i += NT) sPh[i] = __float2half(0.0f);   // heads past G: zero P rows
        if (tid < GMAX) scorr[tid] = 1.0f;
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            qf[ks][0] = *reinterpret_cast<const unsigned*>(sQh + lg * QR + ks * 16 + 2 * lc);
            qf[ks][1] = *reinterpret_cast<const unsigned*>(sQh + lg * QR + ks * 16 + 2 * lc + 8);
        }
#pragma unroll
        for (int mt = 0; mt < MTW; mt++) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    }
#endif

    // One head's online-softmax update over a page (a warp, lane = key; s = -inf for a key outside the split): the
    // running max sm[g] and sum sl[g], the rescale of what came before in scorr[g]; put(pr) stores the lane's
    // probability (fp32 for the FMA page, fp16 for the tensor cores').
    auto page_softmax = [&](int g, float s, auto put) {
        const float m_old = sm[g];                // read by every lane before the shuffles below
        const float m_new = fmaxf(m_old, warp_max(s));
        const float pr = __expf(s - m_new), corr = __expf(m_old - m_new);
        const float tile_l = warp_sum(pr);
        put(pr);
        if (lane == 0) { scorr[g] = corr; sm[g] = m_new; sl[g] = sl[g] * corr + tile_l; }
    };

    for (int pg = page_begin; pg < page_end; pg++) {
        const int new_row = owns_new && pg == p / PAGE ? p % PAGE : -1;   // the new token's row in this page
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const int e = tid + i * NT, r = e / CPR, c = e % CPR;
            if (r == new_row) {                   // the values just written to the cache, as fp16
                __half2 kh[4], vh[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    kh[j] = __floats2half2_rn(sk[c * 8 + 2 * j], sk[c * 8 + 2 * j + 1]);
                    vh[j] = __floats2half2_rn(sv[c * 8 + 2 * j], sv[c * 8 + 2 * j + 1]);
                }
                rk[i] = *reinterpret_cast<const uint4*>(kh);
                rv[i] = *reinterpret_cast<const uint4*>(vh);
            }
            *reinterpret_cast<uint4*>(sK + r * ROW + c * 8) = rk[i];
            *reinterpret_cast<uint4*>(sV + r * ROW + c * 8) = rv[i];
        }
        __syncthreads();
        if (pg + 1 < page_end) fetch(pg + 1);     // in flight while this page is computed

#if DECODE_MMA
        if constexpr (MMA) {
            if (warp < 2) {                       // keys 16*warp .. +15 against the 8 head columns
                float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const __half* ka = sK + (16 * warp + lane % 16) * ROW + (lane / 16) * 8;
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    unsigned a[4];
                    ldsm_x4(a, ka + ks * 16);
                    mma16816(sc, a, qf[ks][0], qf[ks][1]);
                }
#pragma unroll
                for (int j = 0; j < 4; j++) {     // sc[j]: key 16*warp + lg (+8 for j >= 2), head 2lc + j % 2
                    const int kin = 16 * warp + lg + (j >> 1) * 8, h = 2 * lc + (j & 1), key = pg * PAGE + kin;
                    const float v = softcapped(sc[j], softcap);
                    if (h < G) sp[h * PAGE + kin] = key >= k_begin && key < k_end ? v : -INFINITY;
                }
            }
            __syncthreads();
            for (int g = warp; g < G; g += ATT_WARPS) {   // uniform per warp: the shuffles stay legal
                page_softmax(g, sp[g * PAGE + lane], [&](float pr) { sPh[g * PR + lane] = __float2half(pr); });
            }
            __syncthreads();
            const float c0 = scorr[2 * lc], c1 = scorr[2 * lc + 1];
#pragma unroll
            for (int mt = 0; mt < MTW; mt++) { o[mt][0] *= c0; o[mt][1] *= c1; o[mt][2] *= c0; o[mt][3] *= c1; }
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {      // keys 16kk .. +15
                const unsigned b0 = *reinterpret_cast<const unsigned*>(sPh + lg * PR + kk * 16 + 2 * lc);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(sPh + lg * PR + kk * 16 + 2 * lc + 8);
#pragma unroll
                for (int mt = 0; mt < MTW; mt++) {   // V^T's matrices: (dims +0, keys +0), (+8, +0), (+0, +8), (+8, +8)
                    unsigned a[4];
                    const int d0 = (warp * MTW + mt) * 16;
                    ldsm_x4_trans(a, sV + (kk * 16 + lane % 8 + (lane / 16) * 8) * ROW + d0 + ((lane / 8) & 1) * 8);
                    mma16816(o[mt], a, b0, b1);
                }
            }
            __syncthreads();                      // sK, sV, sp, sPh, scorr free for the next page
            continue;
        }
#endif

        const int key = pg * PAGE + lane;
        const bool valid = key >= k_begin && key < k_end;
        for (int g = warp; g < G; g += ATT_WARPS) {   // uniform per warp: the shuffles stay legal
            const float* qg = sq + g * HD;
            const __half* kr = sK + lane * ROW;
            float s = 0.0f;
#pragma unroll 8
            for (int c = 0; c < CPR; c++) {
                float k8[8];
                load8(kr + c * 8, k8);
                const float4 q0 = *reinterpret_cast<const float4*>(qg + c * 8);
                const float4 q1 = *reinterpret_cast<const float4*>(qg + c * 8 + 4);
                s += k8[0] * q0.x + k8[1] * q0.y + k8[2] * q0.z + k8[3] * q0.w;
                s += k8[4] * q1.x + k8[5] * q1.y + k8[6] * q1.z + k8[7] * q1.w;
            }
            s = softcapped(s, softcap);
            page_softmax(g, valid ? s : -INFINITY, [&](float pr) { sp[g * PAGE + lane] = pr; });
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
            const float c = scorr[g];
            acc[g][0] *= c;
            acc[g][1] *= c;
        }
#pragma unroll 4
        for (int j = kg; j < PAGE; j += KG) {
            const float2 v = __half22float2(*reinterpret_cast<const __half2*>(sV + j * ROW + 2 * dp));
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                if (g >= G) break;
                const float pj = sp[g * PAGE + j];
                acc[g][0] += pj * v.x;
                acc[g][1] += pj * v.y;
            }
        }
        __syncthreads();                          // sK, sV, sp, scorr free for the next page
    }

    // The key groups' sums into red [KGO][GMAX][HD] (over sq: q is no longer read), then per output i = g*HD + d.
    // (MMA: one group, the accumulators' rows as dims and columns as heads.)
    constexpr int KGO = MMA ? 1 : KG;
    float* red = sq;
#if DECODE_MMA
    if constexpr (MMA) {
#pragma unroll
        for (int mt = 0; mt < MTW; mt++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int h = 2 * lc + (j & 1), d = (warp * MTW + mt) * 16 + lg + (j >> 1) * 8;
                if (h < G) red[h * HD + d] = o[mt][j];
            }
    } else
#endif
    {
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
            red[(kg * GMAX + g) * HD + 2 * dp] = acc[g][0];
            red[(kg * GMAX + g) * HD + 2 * dp + 1] = acc[g][1];
        }
    }
    __syncthreads();
    const size_t ob0 = (size_t)b * H * HD + (size_t)kvh * G * HD;   // this kv head's first output
    // The outputs i = 0 .. G*HD-1 (value(i)), two per thread and trip (i and i + NT) so the two q8x2 quantizations'
    // shuffle chains interleave (one after the other, the emit was a fifth of the short-context launch, PERF.md v34).
    // G*HD is a multiple of 32, so `two` and each warp's trip count are uniform (the shuffles need all 32 lanes).
    auto emit_all = [&](auto value) {
        for (int i = tid; i < G * HD; i += 2 * NT) {
            const bool two = i + NT < G * HD;
            const float o1 = value(i), o2 = two ? value(i + NT) : 0.0f;
            const size_t ob1 = ob0 + i, ob2 = ob1 + NT;
            out[ob1] = o1;
            if (two) out[ob2] = o2;
            if (outh) {
                outh[ob1] = __float2half(o1);
                if (two) outh[ob2] = __float2half(o2);
            }
            if (outq) {
                const Q8x2 c1 = warp_q8x2(o1), c2 = warp_q8x2(o2);
                store_q8x2(c1, outq + 2 * (ob1 - lane), outd + ob1 / QK);
                if (two) store_q8x2(c2, outq + 2 * (ob2 - lane), outd + ob2 / QK);
            }
        }
    };
    if (active == 1) {                            // 3a. the only split: normalize and write
        emit_all([&](int i) {
            const int g = i / HD, d = i % HD;
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < KGO; k++) a += red[(k * GMAX + g) * HD + d];
            return a / sl[g];
        });
        return;
    }
    // 3b. partials [B, H, S, HD] and (m, l) [B, H, S]; the last active block merges them
    const size_t part = ((size_t)b * H + (size_t)kvh * G) * S + split;   // + g*S for query head kvh*G + g
    for (int i = tid; i < G * HD; i += NT) {
        const int g = i / HD, d = i % HD;
        float a = 0.0f;
#pragma unroll
        for (int k = 0; k < KGO; k++) a += red[(k * GMAX + g) * HD + d];
        part_acc[(part + (size_t)g * S) * HD + d] = a;
    }
    if (tid < G) part_ml[part + (size_t)tid * S] = make_float2(sm[tid], sl[tid]);
    __threadfence();                              // partials visible device-wide before the count says so
    __syncthreads();
    int* counter = counters + (size_t)b * Hkv + kvh;
    if (tid == 0) is_last = atomicAdd(counter, 1) == active - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // The merge: out[g][d] = sum_s e^(m_s - M) acc_s[g][d] / sum_s e^(m_s - M) l_s over the active splits (M: their
    // largest m). It is L2 round trips (the partials were just written by the other blocks) on one SM, so thread t
    // takes float4 columns f = t, t + NT, .. of the G*HD/4 and folds the splits in rounds of MERGE_U (16): the round's
    // partials and (m, l) are loaded first, then its max M' (with the running M), one rescale of the running sums by
    // e^(M - M'), and its MERGE_U terms e^(m_s - M'), independent of one another. 64 splits are 4 round trips, with
    // no pass over the (m, l) first (v8 took one, then 8 rounds of 8: 4.6 us of the 8B's 4,096-key launch, PERF.md
    // v29). No branch inside a round: the slots past the last split load the last split again and weigh 0, because a
    // `break` there let ptxas sink each load to its use (one round trip a split, 15 us: PERF.md v30).
    // Into smerge [G][HD] (over sK: the pages are done), then emitted in the warps' order the quantizer needs.
    float* smerge = reinterpret_cast<float*>(sK);
    const size_t ph0 = ((size_t)b * H + (size_t)kvh * G) * S;
    for (int f = tid; f < G * HD / 4; f += NT) {
        const int g = 4 * f / HD, d = 4 * f % HD;
        const float4* src = reinterpret_cast<const float4*>(part_acc + (ph0 + (size_t)g * S) * HD + d);
        const float2* mls = part_ml + ph0 + (size_t)g * S;
        float4 m = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float M = NEG_BIG, L = 0.0f;
        for (int s0 = 0; s0 < active; s0 += MERGE_U) {
            float4 v[MERGE_U];
            float2 ml[MERGE_U];
#pragma unroll
            for (int j = 0; j < MERGE_U; j++) {
                const int s = min(s0 + j, active - 1);
                v[j] = __ldcg(src + (size_t)s * (HD / 4));
                ml[j] = __ldcg(mls + s);
            }
            float Mr = M;
#pragma unroll
            for (int j = 0; j < MERGE_U; j++) Mr = fmaxf(Mr, ml[j].x);   // (a repeated last split: max unchanged)
            const float c = __expf(M - Mr);
            m = make_float4(m.x * c, m.y * c, m.z * c, m.w * c);
            L *= c;
#pragma unroll
            for (int j = 0; j < MERGE_U; j++) {
                const float e = s0 + j < active ? __expf(ml[j].x - Mr) : 0.0f;
                m = make_float4(m.x + e * v[j].x, m.y + e * v[j].y, m.z + e * v[j].z, m.w + e * v[j].w);
                L += e * ml[j].y;
            }
            M = Mr;
        }
        const float inv = 1.0f / L;
        *reinterpret_cast<float4*>(smerge + 4 * f) = make_float4(m.x * inv, m.y * inv, m.z * inv, m.w * inv);
    }
    __syncthreads();
    emit_all([&](int i) { return smerge[i]; });
    if (tid == 0) *counter = 0;                   // ready for the next step (stream order separates steps)
}

// grid (S <= MAX_SPLITS, Hkv, B), 128 threads, Kernels.decode_smem(hd) bytes of dynamic shared memory (47 KiB at
// hd 256, under the 48 KiB default). Arguments as attention.cu's attn_decode_f16 (v7), so the host switches
// between them by name: qkv [B, (H + 2 Hkv) hd] as the qkv product wrote it (q, k not yet normed or rotated);
// rope: the layer's table [positions, rope_dim/2] (cos, sin); pos[b] = the new token's position; part_acc
// [B, H, S, hd], part_ml [B, H, S]; counters [B * Hkv] zero-initialized once, left zeroed after each launch;
// q_norm, k_norm [hd] or null (no qk-norm). Launch bound: 4 blocks per SM on sm_90 (127 registers with the
// tensor-core page, no spill there), so a long context's grid (Kernels.attn_decode_splits, decode_splits) runs
// twice the warps an SM that 2 blocks did; 3 elsewhere (170 registers at most: at 128 sm_100/sm_120 spilled
// 12-20 bytes, sm_75 at 96).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define DECODE_TILE_BLOCKS 4
#else
#define DECODE_TILE_BLOCKS 3
#endif
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP, DECODE_TILE_BLOCKS)
attn_decode_tile_f16(const float* qkv, const float2* rope, int rope_dim, int neox, __half* k_cache,
                     __half* v_cache, const int* block_table, int max_pages, const int* pos, float* part_acc,
                     float2* part_ml, int* counters, float* out, int8_t* outq, float4* outd, __half* outh, int H,
                     int Hkv, int hd, int S, float scale, const float* q_norm, const float* k_norm, float eps,
                     int window, float softcap) {
    INGOT_PDL_READ_AHEAD();                       // the wait is in attn_decode_tile, after its reads ahead
#define ATTN_DECODE_TILE(HD)                                                                                     \
    attn_decode_tile<HD>(qkv, rope, rope_dim, neox, k_cache, v_cache, block_table, max_pages, pos, part_acc,    \
                         part_ml, counters, out, outq, outd, outh, H, Hkv, S, scale, q_norm, k_norm, eps, window, \
                         softcap)
    if (hd == 64) ATTN_DECODE_TILE(64);
    else ATTN_DECODE_TILE(128);
}

// hd 256 (Gemma) in a kernel of its own, so the 64/128 kernel keeps its register count. Same arguments. 164
// registers under the bound (128 spilled), and 3 blocks of 47 KiB shared memory per SM is what Gemma's few blocks
// per layer can use anyway.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP, 3)
attn_decode_tile_f16_hd256(const float* qkv, const float2* rope, int rope_dim, int neox, __half* k_cache,
                           __half* v_cache, const int* block_table, int max_pages, const int* pos,
                           float* part_acc, float2* part_ml, int* counters, float* out, int8_t* outq,
                           float4* outd, __half* outh, int H, int Hkv, int hd, int S, float scale,
                           const float* q_norm, const float* k_norm, float eps, int window, float softcap) {
    INGOT_PDL_READ_AHEAD();
    ATTN_DECODE_TILE(256);
#undef ATTN_DECODE_TILE
}
