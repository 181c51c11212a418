// Prefill attention on tensor cores: flash-attention 2 over the paged fp16 KV cache (cache[page, kv_head, slot,
// hd], PAGE slots a page, see rope.cu), for compute capability 8.0 and newer (mma.sync m16n8k16, ldmatrix,
// cp.async). sm_75 has none of these: there the host launches the scalar attn_prefill_f16 of attention.cu, and
// so does INGOT_ATTN_PREFILL=scalar anywhere (an A/B switch, runtime/settings.py).
//
// The chunk: T new tokens of one sequence at positions start..start+T-1 (rope_kv_f32 has already normed and
// rotated q in the fp32 qkv rows and written k, v of the chunk into the cache); each query attends to every
// cached key at positions <= its own (earlier chunks and prefix-cache hits included), within the sliding
// window when window > 0 (the query at p sees p - window + 1 .. p), scores = softcap*tanh(scale q.k / softcap)
// (softcap 0: scale q.k).
//
// GQA packing: the G = H/Hkv query heads of one kv head share every key, so a block takes BQ = 64 "packed rows"
// R = t*G + g (token t, head kvh*G + g) of one kv head, and each K/V tile it loads serves all G heads at once
// (G times less K/V traffic, and a block spans BQ/G token positions, so the causal triangle wastes less).
// Block = 4 warps, each owning 16 packed rows (one m16 tile); grid (ceil(T*G / BQ), Hkv). The varlen entry
// point takes the chunks of several sequences of a prefill pass in one launch, grid (ceil(max T*G / BQ), Hkv,
// sequences): block z runs sequence z's rows exactly as a launch of its own would (same tiles, same order of
// work: the same bits), and the blocks past its last tile return at once. A pass of four 128-token prompts was
// four launches of 18 blocks (SmolLM2) on 132 SMs: 7 us each, one after the other.
//
// Per block: Q (fp32 rows * scale -> fp16) into shared memory; then the key tiles of one page each (PAGE = 32
// keys) from the first any of its queries can see (window) to the last (causal), double-buffered with cp.async
// (tile i+1 loads while tile i is multiplied). Keys past the chunk's last position in the last page are
// zero-filled (cp.async src-size 0): the slots may hold stale or uninitialized fp16, and a NaN there would
// survive p = 0 in P.V. Per warp and tile:
//   S[16, 32] = Q K^T     (hd/16 k-steps x 4 n-tiles of mma; Q fragments held in registers for hd <= 128,
//                          re-read from shared memory with ldmatrix for hd 256, where they would cost 64 regs)
//   mask (causal, window), softcap, online softmax in the log2 domain (row max over the 4 lanes of a quad)
//   O[16, hd] = O * corr + P V   (P rounded to fp16 straight from the S accumulators into A fragments)
// A warp skips the multiply of a tile that none of its 16 rows can see (their causal limit or window).
// Shared memory rows are padded by 8 halfs (16 bytes) so the 8 row addresses of an ldmatrix fall in 8
// different bank groups. Bytes: (BQ + 4*PAGE) * (hd + 8) * 2 = 24 / 51 / 99 KiB at hd 64 / 128 / 256 (the last
// is exactly the 99 KiB opt-in limit of sm_86/89/120).
// hd 256 is its own kernel (attn_prefill_mma_f16_hd256): its O accumulator is 16x256 fp32 per warp = 128
// registers a lane, and a kernel gets the registers of its hungriest path.
#include "attention.cuh"   // softcapped, NEG_BIG (the log2-domain running max starts there too)
#include "mma.cuh"         // smem_addr, cp_async*, ldsm_x4*, mma16816

#define BQ (ATT_WARPS * 16) // packed query rows per block, one m16 tile per warp (PREFILL_MMA_ROWS on the host)
#define SPAD 8              // halfs of padding per shared-memory row (PREFILL_MMA_PAD on the host)
#define LOG2E 1.4426950408889634f

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

template <int HD>
__device__ __forceinline__ void attn_prefill_mma(const float* __restrict__ qkv, int ldqkv,
                                                 const __half* __restrict__ k_cache,
                                                 const __half* __restrict__ v_cache, const int* __restrict__ block_row,
                                                 int start, int T, __half* __restrict__ out, int H, int Hkv,
                                                 float scale, int window, float softcap, int tile) {
    constexpr int LD = HD + SPAD;      // shared row stride in halfs ((HD + 8) * 2 bytes: a multiple of 16)
    constexpr int NT = PAGE / 8;       // 8-key n-tiles of S per key tile
    constexpr int DT = HD / 8;         // 8-dim n-tiles of O
    constexpr int KS = HD / 16;        // 16-dim k-steps of Q K^T
    constexpr int NTHREADS = ATT_WARPS * WARP;
    constexpr bool Q_IN_REGS = HD <= 128;
    static_assert(PAGE % 16 == 0, "key tiles are whole k-steps of P V");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __half* sQ = reinterpret_cast<__half*>(smem_raw);   // [BQ][LD]
    __half* sK = sQ + BQ * LD;                          // [2][PAGE][LD]
    __half* sV = sK + 2 * PAGE * LD;                    // [2][PAGE][LD]

    // The block's tile of BQ packed rows; the callers give blocks in launch order the last rows first: they see
    // the most keys (causal), and starting the longest blocks first keeps the last wave short.
    const int kvh = blockIdx.y, G = H / Hkv, rows = T * G, R0 = tile * BQ;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;

    // Keys this block needs: tiles tile0..tile1 (one page each). Packed rows past T*G (the last block's
    // padding) are clamped to the last token: they compute what it computes and are never stored.
    const int t_lo = min(R0 / G, T - 1), t_hi = min((R0 + BQ - 1) / G, T - 1);
    const int last_key = start + t_hi;
    const int tile0 = (window > 0 ? max(0, start + t_lo - window + 1) : 0) / PAGE, tile1 = last_key / PAGE;

    auto load_tile = [&](int tile, int buf) {
        const size_t base = ((size_t)block_row[tile] * Hkv + kvh) * PAGE * HD;
        __half* dk = sK + buf * PAGE * LD;
        __half* dv = sV + buf * PAGE * LD;
#pragma unroll
        for (int e = tid; e < PAGE * HD / 8; e += NTHREADS) {   // 16-byte chunks: HD/8 per key
            const int key = e / (HD / 8), c = (e % (HD / 8)) * 8;
            const bool real = tile * PAGE + key <= last_key;    // else zero-filled (the address stays in the page)
            cp_async16(dk + key * LD + c, k_cache + base + key * HD + c, real);
            cp_async16(dv + key * LD + c, v_cache + base + key * HD + c, real);
        }
    };
    load_tile(tile0, 0);
    cp_async_commit();

    // Q: packed row r of the block = token (R0 + r) / G, head kvh*G + (R0 + r) % G; fp32 * scale -> fp16.
    for (int e = tid; e < BQ * HD / 4; e += NTHREADS) {
        const int r = e / (HD / 4), d = (e % (HD / 4)) * 4, R = R0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (R < rows)
            v = *reinterpret_cast<const float4*>(qkv + (size_t)(R / G) * ldqkv + (size_t)(kvh * G + R % G) * HD + d);
        __half2* dst = reinterpret_cast<__half2*>(sQ + r * LD + d);
        dst[0] = __floats2half2_rn(v.x * scale, v.y * scale);
        dst[1] = __floats2half2_rn(v.z * scale, v.w * scale);
    }
    __syncthreads();

    // This warp's rows: 16 packed rows from Rw; this lane holds rows Rw + lane/4 and Rw + lane/4 + 8.
    const int Rw = R0 + warp * 16;
    const bool warp_live = Rw < rows;                          // an all-padding warp multiplies nothing
    const int qpos0 = start + min((Rw + lane / 4) / G, T - 1), qpos1 = start + min((Rw + lane / 4 + 8) / G, T - 1);
    const int warp_lo = start + min(Rw / G, T - 1), warp_last = start + min((Rw + 15) / G, T - 1);  // its positions
    const int warp_first = window > 0 ? warp_lo - window + 1 : 0;   // the first key any of its rows sees

    // A fragments of Q (rows Rw.., dims 16ks..): lane l addresses row l%16, dims +8 for l >= 16.
    const __half* q_lane = sQ + (warp * 16 + lane % 16) * LD + (lane / 16) * 8;
    unsigned qf[Q_IN_REGS ? KS : 1][4];
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int ks = 0; ks < KS; ks++) ldsm_x4(qf[ks], q_lane + ks * 16);
    }
    // K as the B operand of Q K^T (non-transposed ldmatrix of key rows): matrices (keys +0, dims +0),
    // (keys +0, dims +8), (keys +8, dims +0), (keys +8, dims +8) = b0, b1 of n-tile 2np, then of 2np+1.
    const int k_lane = ((lane % 8) + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8;
    // V as the B operand of P V (transposed ldmatrix of key rows): matrices (keys +0, dims +0),
    // (keys +8, dims +0), (keys +0, dims +8), (keys +8, dims +8) = b0, b1 of dim tile 2dp, then of 2dp+1.
    const int v_lane = ((lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8;

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.0f, 0.0f};   // log2-domain running max; this lane's partial sums

    for (int tile = tile0; tile <= tile1; tile++) {
        const int buf = (tile - tile0) & 1;
        if (tile < tile1) load_tile(tile + 1, buf ^ 1);   // buf^1 was last read before the previous barrier
        cp_async_commit();                                 // (an empty group on the last tile keeps the count)
        cp_async_wait<1>();                                  // this tile's group has landed (this thread's part)
        __syncthreads();                                   // ... and every thread's
        const int k0 = tile * PAGE;
        if (warp_live && k0 <= warp_last && k0 + PAGE - 1 >= warp_first) {
            const __half* Kt = sK + buf * PAGE * LD + k_lane;
            const __half* Vt = sV + buf * PAGE * LD + v_lane;
            float s[NT][4];
#pragma unroll
            for (int j = 0; j < NT; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                unsigned a[4];
                if constexpr (Q_IN_REGS) {
                    a[0] = qf[ks][0], a[1] = qf[ks][1], a[2] = qf[ks][2], a[3] = qf[ks][3];
                } else {
                    ldsm_x4(a, q_lane + ks * 16);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    unsigned b[4];
                    ldsm_x4(b, Kt + np * 16 * LD + ks * 16);
                    mma16816(s[2 * np], a, b[0], b[1]);
                    mma16816(s[2 * np + 1], a, b[2], b[3]);
                }
            }
            // softcap, log2 scale, mask; element e of n-tile j: key k0 + 8j + 2(lane%4) + e%2, row e/2. A tile
            // every row of the warp sees whole (below the causal diagonal, inside the window) skips the mask.
            const bool whole = k0 + PAGE - 1 <= warp_lo && (window <= 0 || k0 > warp_last - window);
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int j = 0; j < NT; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int kp = k0 + j * 8 + 2 * (lane % 4) + (e & 1), qp = e < 2 ? qpos0 : qpos1;
                    float v = softcapped(s[j][e], softcap) * LOG2E;
                    if (!whole && !(kp <= qp && (window <= 0 || kp > qp - window))) v = -INFINITY;
                    s[j][e] = v;
                    mx[e / 2] = fmaxf(mx[e / 2], v);
                }
            }
            float corr[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int r = 0; r < 2; r++) {   // a row's 32 scores sit in the 4 lanes of a quad
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
                corr[r] = exp2f(m[r] - mx[r]);
                m[r] = mx[r];
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[j][e] = exp2f(s[j][e] - m[e / 2]);   // masked: exp2(-inf) = 0
                    sum[e / 2] += s[j][e];
                }
            }
            l[0] = l[0] * corr[0] + sum[0];
            l[1] = l[1] * corr[1] + sum[1];
#pragma unroll
            for (int d = 0; d < DT; d++) {
                o[d][0] *= corr[0], o[d][1] *= corr[0], o[d][2] *= corr[1], o[d][3] *= corr[1];
            }
            // O += P V: the S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of keys 16kk..16kk+15
#pragma unroll
            for (int kk = 0; kk < PAGE / 16; kk++) {
                const unsigned a[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                       pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                       pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    unsigned b[4];
                    ldsm_x4_trans(b, Vt + kk * 16 * LD + dp * 16);
                    mma16816(o[2 * dp], a, b[0], b[1]);
                    mma16816(o[2 * dp + 1], a, b[2], b[3]);
                }
            }
        }
        __syncthreads();   // every warp is done with buf before the next iteration's loads overwrite it
    }

    // O / l (the row sum over the quad), fp16, to out[t, (kvh*G + g)*HD + d] for the real rows.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
        const int R = Rw + lane / 4 + 8 * r;
        if (R < rows) {
            const float inv = 1.0f / l[r];
            __half* dst = out + (size_t)(R / G) * H * HD + (size_t)(kvh * G + R % G) * HD + 2 * (lane % 4);
#pragma unroll
            for (int d = 0; d < DT; d++)
                *reinterpret_cast<__half2*>(dst + d * 8) = __floats2half2_rn(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
        }
    }
}

#define ATTN_PREFILL_MMA(HD)                                                                                     \
    attn_prefill_mma<HD>(qkv, ldqkv, k_cache, v_cache, block_row, tok_pos[0], T, out, H, Hkv, scale, window, \
                         softcap, gridDim.x - 1 - blockIdx.x)
// Sequence z = blockIdx.z of a varlen launch: its rows starts[z]..starts[z+1]-1 of the pass, its block-table row
// z; blocks past its tiles return (before any barrier, so the whole block leaves together).
#define ATTN_PREFILL_MMA_VARLEN(HD)                                                                              \
    do {                                                                                                         \
        const int z = blockIdx.z, r0 = starts[z], T = starts[z + 1] - r0;                                       \
        const int tiles = (T * (H / Hkv) + BQ - 1) / BQ;                                                         \
        if ((int)blockIdx.x >= tiles) return;                                                                    \
        attn_prefill_mma<HD>(qkv + (size_t)r0 * ldqkv, ldqkv, k_cache, v_cache, block_table + (size_t)z * max_pages, \
                             tok_pos[r0], T, out + (size_t)r0 * H * HD, H, Hkv, scale, window, softcap,          \
                             tiles - 1 - blockIdx.x);                                                            \
    } while (0)
#else
#define ATTN_PREFILL_MMA(HD) // sm_75: never launched (the host picks attention.cu's attn_prefill_f16 there)
#define ATTN_PREFILL_MMA_VARLEN(HD)
#endif

// grid (ceil(T*G / 64), Hkv), 128 threads, Kernels.prefill_mma_smem(hd) bytes of dynamic shared memory (past the
// 48 KiB default at hd 128 and 256: the host opts in). Arguments as attention.cu's attn_prefill_f16: qkv [T,
// ldqkv] fp32 (q of head h at columns h*hd.., rotated and normed); block_row: the sequence's row of the block
// table; tok_pos: the chunk's positions (contiguous; read on the device, so a plan depends only on T); out fp16
// [T, H*hd].
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_prefill_mma_f16(const float* qkv, int ldqkv, const __half* k_cache, const __half* v_cache, const int* block_row,
                     const int* tok_pos, int T, __half* out, int H, int Hkv, int hd, float scale, int window,
                     float softcap) {
    INGOT_PDL_ENTRY();
    if (hd == 64) ATTN_PREFILL_MMA(64);
    else ATTN_PREFILL_MMA(128);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_prefill_mma_f16_hd256(const float* qkv, int ldqkv, const __half* k_cache, const __half* v_cache,
                           const int* block_row, const int* tok_pos, int T, __half* out, int H, int Hkv, int hd,
                           float scale, int window, float softcap) {
    INGOT_PDL_ENTRY();
    ATTN_PREFILL_MMA(256);
}

// The chunks of S sequences in one launch, grid (ceil(max T*G / 64), Hkv, S): qkv [rows, ldqkv] and out [rows,
// H*hd] hold the pass's rows, sequence z's at starts[z]..starts[z+1]-1 (int32 [S+1]); block_table [S, max_pages]
// its pages (row z); tok_pos [rows] the rows' positions (each sequence's contiguous). Otherwise as above.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_prefill_mma_varlen_f16(const float* qkv, int ldqkv, const __half* k_cache, const __half* v_cache,
                            const int* block_table, int max_pages, const int* tok_pos, const int* starts,
                            __half* out, int H, int Hkv, int hd, float scale, int window, float softcap) {
    INGOT_PDL_ENTRY();
    if (hd == 64) ATTN_PREFILL_MMA_VARLEN(64);
    else ATTN_PREFILL_MMA_VARLEN(128);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP)
attn_prefill_mma_varlen_f16_hd256(const float* qkv, int ldqkv, const __half* k_cache, const __half* v_cache,
                                  const int* block_table, int max_pages, const int* tok_pos, const int* starts,
                                  __half* out, int H, int Hkv, int hd, float scale, int window, float softcap) {
    INGOT_PDL_ENTRY();
    ATTN_PREFILL_MMA_VARLEN(256);
}
#undef ATTN_PREFILL_MMA
#undef ATTN_PREFILL_MMA_VARLEN
