// Matrix-matrix products for prefill: C[M, N] = A[M, K] · W[N, K]^T, A fp16 (token activations), W in the
// soa-v2 layout of common.cuh, C fp32. Prefill multiplies many tokens by each weight, so it is arithmetic-bound:
// weights are dequantized to fp16 in shared memory and multiplied on the tensor cores (WMMA 16x16x16, fp32
// accumulation; available on every arch we build, sm_75+).
// Three kernel families: matmul_<type> (this header: v9's, every arch) and below, from compute capability 8.0, the
// pipelined matmul2_<type>_bm<TM> (mma.sync, ldmatrix, cp.async; its own header comment) and its twin for Q4_0,
// Q4_1 and Q4_K, matmul2r_<type>_bm<TM>, which dequantizes straight into the mma fragments (the same tiles and bits;
// its own header comment, after matmul2's kernels), with its wgmma siblings matmul2w and matmul2t on sm_90a.
// Kernels.matmul picks (runtime/gpu/kernels.py matmul_geometry; INGOT_MATMUL=wmma keeps matmul_<type> everywhere,
// =mma-tile matmul2_<type> for every type).
//
// Tiles: a block of 4 warps computes a 64x64 tile of C, each warp a 32x32 quarter (2x2 fragments); K advances
// by one quantization block (32) per step. Epilogue modes as in matvec.cu: MODE_STORE (C = AW^T + bias) and
// MODE_ADD (C += AW^T + bias, the residual). M, N arbitrary; K a multiple of 32.
// Split-K (gridDim.z > 1): for few rows of A (decode batches) there are too few tiles to fill the GPU, so each
// z-slice takes a range of K and stores its partial 64x64 tile into a workspace, ws[tile][z][64*64] fp32; the
// tile's last slice to finish (a counter per tile, left at zero again for the next launch) adds the S partials in
// slice order and applies the epilogue. Fixed order: the result is the same on every run (v9 added the partials
// into C with atomics, whose order made Gemma's logits differ by up to 1e-2 between identical runs), and no
// memset of C is needed (it broke the chain of programmatic launches). ws holds gridDim.x*gridDim.y*S tiles,
// counters gridDim.x*gridDim.y ints (kernels.py sizes both for the worst case: SplitK).
#include <mma.h>
#include "weights.cuh"
#include "matmul_tiles.cuh"
#include "mma.cuh"          // smem_addr, cp_async*, ldsm_x4, mma16816 (sm_80+)
#include <cooperative_groups.h>   // cluster split-K (sm_90+): this_cluster, map_shared_rank

using namespace nvcuda;

#define BM MATMUL_BM
#define BN MATMUL_BN
#define BK 32
#define LDS (BK + 8)       // smem row stride in halfs: a multiple of 8 (WMMA) that staggers banks
#define LDC (BN + 4)

// Each of the 128 threads dequantizes half a row of the 64x32 weight tile: row t/2, weights
// [h*8, h*8+8) and [16+h*8, 16+h*8+8) for Q4 (the two nibbles of bytes h*8..h*8+7), [h*16, h*16+16) otherwise.
struct TileQ4_0 {
    const uint8_t* qs; const __half* d;
    __device__ void load(__half (*sB)[LDS], long long n, int N, int nb, int kb, int row, int h) const {
        __half lo[8], hi[8];
        if (n < N) {
            const long long b = n * nb + kb;
            const uint2 q = reinterpret_cast<const uint2*>(qs + b * 16)[h];
            const float dd = __half2float(d[b]);
            const uint8_t* qb = reinterpret_cast<const uint8_t*>(&q);
#pragma unroll
            for (int i = 0; i < 8; i++) { lo[i] = __float2half(dd * ((qb[i] & 0xF) - 8)); hi[i] = __float2half(dd * ((qb[i] >> 4) - 8)); }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) lo[i] = hi[i] = __float2half(0.0f);
        }
        *reinterpret_cast<uint4*>(&sB[row][h * 8]) = *reinterpret_cast<uint4*>(lo);
        *reinterpret_cast<uint4*>(&sB[row][16 + h * 8]) = *reinterpret_cast<uint4*>(hi);
    }
};

struct TileQ4_1 {
    const uint8_t* qs; const __half* d; const __half* m;
    __device__ void load(__half (*sB)[LDS], long long n, int N, int nb, int kb, int row, int h) const {
        __half lo[8], hi[8];
        if (n < N) {
            const long long b = n * nb + kb;
            const uint2 q = reinterpret_cast<const uint2*>(qs + b * 16)[h];
            const float dd = __half2float(d[b]), mm = __half2float(m[b]);
            const uint8_t* qb = reinterpret_cast<const uint8_t*>(&q);
#pragma unroll
            for (int i = 0; i < 8; i++) { lo[i] = __float2half(dd * (qb[i] & 0xF) + mm); hi[i] = __float2half(dd * (qb[i] >> 4) + mm); }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) lo[i] = hi[i] = __float2half(0.0f);
        }
        *reinterpret_cast<uint4*>(&sB[row][h * 8]) = *reinterpret_cast<uint4*>(lo);
        *reinterpret_cast<uint4*>(&sB[row][16 + h * 8]) = *reinterpret_cast<uint4*>(hi);
    }
};

struct TileQ8_0 {
    const int8_t* qs; const __half* d;
    __device__ void load(__half (*sB)[LDS], long long n, int N, int nb, int kb, int row, int h) const {
        __half w[16];
        if (n < N) {
            const long long b = n * nb + kb;
            const int4 q = reinterpret_cast<const int4*>(qs + b * 32)[h];
            const float dd = __half2float(d[b]);
            const int8_t* qb = reinterpret_cast<const int8_t*>(&q);
#pragma unroll
            for (int i = 0; i < 16; i++) w[i] = __float2half(dd * qb[i]);
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++) w[i] = __float2half(0.0f);
        }
        *reinterpret_cast<uint4*>(&sB[row][h * 16]) = *reinterpret_cast<uint4*>(w);
        *reinterpret_cast<uint4*>(&sB[row][h * 16 + 8]) = *reinterpret_cast<uint4*>(w + 8);
    }
};

struct TileF16 {
    const __half* w; int K;
    __device__ void load(__half (*sB)[LDS], long long n, int N, int nb, int kb, int row, int h) const {
        uint4 a = make_uint4(0, 0, 0, 0), b = a;
        if (n < N) {
            const uint4* p = reinterpret_cast<const uint4*>(w + n * K + kb * BK + h * 16);
            a = p[0]; b = p[1];
        }
        *reinterpret_cast<uint4*>(&sB[row][h * 16]) = a;
        *reinterpret_cast<uint4*>(&sB[row][h * 16 + 8]) = b;
    }
};

// The weights.cuh types: each thread dequantizes weights [h*16, h*16+16) of its row's block (deq_half_row).
template <typename W>
struct TileW {
    W w;
    __device__ void load(__half (*sB)[LDS], long long n, int N, int nb, int kb, int row, int h) const {
        __half v[16];
        if (n < N) {
            deq_half_row(w, n, kb, h, v);
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++) v[i] = __float2half(0.0f);
        }
        *reinterpret_cast<uint4*>(&sB[row][h * 16]) = *reinterpret_cast<uint4*>(v);
        *reinterpret_cast<uint4*>(&sB[row][h * 16 + 8]) = *reinterpret_cast<uint4*>(v + 8);
    }
};

template <typename Tile>
__device__ void matmul(const Tile& tile, const __half* __restrict__ A, const float* __restrict__ bias,
                       float* __restrict__ C, int M, int N, int K, int ldc, int mode, float* __restrict__ ws,
                       int* __restrict__ counters) {
    __shared__ __align__(32) __half sA[BM][LDS];
    __shared__ __align__(32) __half sB[BN][LDS];
    __shared__ __align__(32) float sC[BM][LDC];
    const int tid = threadIdx.x, warp = tid / WARP, wm = warp / 2, wn = warp % 2;
    const long long m0 = (long long)blockIdx.y * BM, n0 = (long long)blockIdx.x * BN;
    const int nb = K / BK, per = (nb + gridDim.z - 1) / gridDim.z;
    const int kb_begin = blockIdx.z * per, kb_end = min(nb, kb_begin + per);

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);

    for (int kb = kb_begin; kb < kb_end; kb++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {                         // A tile: 64 rows x 4 chunks of 8 halfs
            const int idx = tid + r * 128, row = idx / 4, c = (idx % 4) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (m0 + row < M) v = *reinterpret_cast<const uint4*>(A + (m0 + row) * K + kb * BK + c);
            *reinterpret_cast<uint4*>(&sA[row][c]) = v;
        }
        tile.load(sB, n0 + tid / 2, N, nb, kb, tid / 2, tid % 2);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[2];
#pragma unroll
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(a[i], &sA[wm * 32 + i * 16][kk], LDS);
#pragma unroll
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(b[j], &sB[wn * 32 + j * 16][kk], LDS);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    INGOT_PDL_TRIGGER();   // the next kernel may launch while this one writes C (common.cuh: after the main loop)
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(&sC[wm * 32 + i * 16][wn * 32 + j * 16], acc[i][j], LDC, wmma::mem_row_major);
    __syncthreads();
    // The epilogue, and split-K's sum, in EPI float4 groups of the tile per thread (group f = tid + i * 128: row
    // f / 16, columns 4 (f % 16) ..+3), every load of a phase issued before its first use: a loop with a load-use
    // chain per element waits one L2/DRAM round trip per element (32 a thread). The sums stay in sC (registers
    // would cost the main loop occupancy: ptxas allocates the kernel's peak).
    constexpr int EPI = BM * BN / 4 / 128, EPI_HALF = EPI / 2;
    const int live = (int)min((long long)BM, M - m0);   // rows of A in this tile (16 of 64 at a batch of 16)
    if (gridDim.z > 1) {
        __shared__ bool is_last;
        const int tile = blockIdx.y * gridDim.x + blockIdx.x, S = gridDim.z;
        float4* slices = reinterpret_cast<float4*>(ws + (size_t)tile * S * (BM * BN));   // [S][BM * BN / 4]
#pragma unroll
        for (int i = 0; i < EPI; i++) {
            const int f = tid + i * 128, r = f / (BN / 4), c = f % (BN / 4) * 4;
            if (r < live) slices[(size_t)blockIdx.z * (BM * BN / 4) + f] = *reinterpret_cast<const float4*>(&sC[r][c]);
        }
        __threadfence();                              // this slice visible device-wide before the count says so
        __syncthreads();
        if (tid == 0) is_last = atomicAdd(counters + tile, 1) == S - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        if (tid == 0) counters[tile] = 0;             // zero again for the next launch (stream-ordered)
        // the slices in order 0..S-1 (this block's own included): the same sum on every run. A thread sums
        // the groups it wrote, so sC needs no barrier between slices.
        for (int z = 0; z < S; z++) {
#pragma unroll 1
            for (int h = 0; h < EPI; h += EPI_HALF) {
                float4 t[EPI_HALF];
#pragma unroll
                for (int i = 0; i < EPI_HALF; i++) {   // L2 (__ldcg): other SMs wrote them
                    const int f = tid + (h + i) * 128;
                    if (f / (BN / 4) < live) t[i] = __ldcg(slices + (size_t)z * (BM * BN / 4) + f);
                }
#pragma unroll
                for (int i = 0; i < EPI_HALF; i++) {
                    const int f = tid + (h + i) * 128, r = f / (BN / 4), c = f % (BN / 4) * 4;
                    if (r >= live) continue;
                    float4& acc = *reinterpret_cast<float4*>(&sC[r][c]);
                    if (z == 0) acc = t[i];
                    else { acc.x += t[i].x; acc.y += t[i].y; acc.z += t[i].z; acc.w += t[i].w; }
                }
            }
        }
    }
    // C (op)= sum + bias: the residual's loads first (MODE_ADD), then the stores; half the groups at a time
#pragma unroll 1
    for (int h = 0; h < EPI; h += EPI_HALF) {
        float old[EPI_HALF][4];
#pragma unroll
        for (int i = 0; i < EPI_HALF; i++) {
            const int f = tid + (h + i) * 128, r = f / (BN / 4), c = f % (BN / 4) * 4;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const long long gr = m0 + r, gc = n0 + c + j;
                old[i][j] = mode == MODE_ADD && r < live && gc < N ? C[gr * ldc + gc] : 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < EPI_HALF; i++) {
            const int f = tid + (h + i) * 128, r = f / (BN / 4), c = f % (BN / 4) * 4;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const long long gr = m0 + r, gc = n0 + c + j;
                if (r < live && gc < N) C[gr * ldc + gc] = old[i][j] + (sC[r][c + j] + (bias ? bias[gc] : 0.0f));
            }
        }
    }
}

// All of them: grid (ceil(N/64), ceil(M/64), split-K slices), 128 threads; ws/counters unused without split-K.
// On sm_90, 7 blocks per SM (72 registers, no spill), as the kernels ran before the epilogue's batched loads
// (uncapped they take 74-80: 6 blocks); shared memory (27 KiB a block) would allow 8. Other archs: ptxas's
// choice (sm_80's count did not change; capped, sm_75/sm_80 spill).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define MATMUL_BOUNDS __launch_bounds__(128, 7)
#else
#define MATMUL_BOUNDS __launch_bounds__(128)
#endif
extern "C" __global__ void MATMUL_BOUNDS
matmul_q4_0(const uint8_t* qs, const __half* d, const __half* A, const float* bias, float* C, int M, int N, int K,
            int ldc, int mode, float* ws, int* counters) {
    INGOT_PDL_WAIT();
    matmul(TileQ4_0{qs, d}, A, bias, C, M, N, K, ldc, mode, ws, counters);
}

extern "C" __global__ void MATMUL_BOUNDS
matmul_q4_1(const uint8_t* qs, const __half* d, const __half* m, const __half* A, const float* bias, float* C,
            int M, int N, int K, int ldc, int mode, float* ws, int* counters) {
    INGOT_PDL_WAIT();
    matmul(TileQ4_1{qs, d, m}, A, bias, C, M, N, K, ldc, mode, ws, counters);
}

extern "C" __global__ void MATMUL_BOUNDS
matmul_q8_0(const int8_t* qs, const __half* d, const __half* A, const float* bias, float* C, int M, int N, int K,
            int ldc, int mode, float* ws, int* counters) {
    INGOT_PDL_WAIT();
    matmul(TileQ8_0{qs, d}, A, bias, C, M, N, K, ldc, mode, ws, counters);
}

extern "C" __global__ void MATMUL_BOUNDS
matmul_f16(const __half* w, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc, int mode,
           float* ws, int* counters) {
    INGOT_PDL_WAIT();
    matmul(TileF16{w, K}, A, bias, C, M, N, K, ldc, mode, ws, counters);
}

#define MATMUL_KERNEL(NAME, WT, PARAMS, ARGS)                                                                    \
    extern "C" __global__ void MATMUL_BOUNDS                                                            \
    matmul_##NAME(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc, int mode, \
                  float* ws, int* counters) {                                                                    \
        INGOT_PDL_WAIT();                                                                                        \
        matmul(TileW<WT>{WT{ARGS, K / QK}}, A, bias, C, M, N, K, ldc, mode, ws, counters);                    \
    }
FOR_EACH_GENERIC_TYPE(MATMUL_KERNEL)
#undef MATMUL_KERNEL

// =====================================================================================================================
// matmul2_<type>_bm<TM>: the pipelined tensor-core GEMM, compute capability >= 8.0 (mma.sync m16n8k16, ldmatrix,
// cp.async; sm_75 has none of them and keeps the WMMA kernels above: there these kernels are empty and never
// launched). Same product, epilogues, split-K contract and arguments as matmul_<type>; INGOT_MATMUL=wmma picks the
// old kernels anywhere (runtime/settings.py, the A/B switch). Kernels.matmul (runtime/gpu/kernels.py) owns the
// geometry: grid (ceil(M/TM), ceil(N/MM2_BN), split-K slices), MM2_THREADS threads, Kernels.matmul2_smem bytes of
// dynamic shared memory.
//
// Tile: a block computes TM tokens x MM2_BN = 128 output features of C. TM is 16, 32, 64 or 128 (one kernel each,
// so the skinny decode tiles get the registers and occupancy of their own size): the host takes the smallest that
// covers M, and for prefill (no split-K) a smaller one, down to 32, when the larger leaves SMs without a tile.
// 8 warps as WM (M) x WN (N) = 4 x 2 (TM 128), 2 x 4 (TM 64, 32) or 1 x 8 (TM 16); a warp owns TM/WM rows x 128/WN
// columns: MT m16 tiles x NT n8 tiles of fp32 accumulators (MT x NT x 4 registers a lane: 64 at TM 128).
// K step: 32 = one quantization block, so a stage holds block kb of every row and K needs no tail (K % 32 == 0).
//
// Pipeline, MM2_STAGES = 4 stages in shared memory, each: the A tile [TM][32] fp16 and the weights' RAW bytes of
// the step (Q4_0: 16 quant bytes + the 4-byte word holding d, per row; Q4_1: + m's word; Q8_0: 32 + 4; F16 the
// fp16 row itself), copied by cp.async, one commit group per stage. The weights are dequantized from shared memory
// into an fp16 tile sB [2][128][32+8] one step AHEAD of the multiply, so one barrier per step separates everything:
//   step i:  wait until stage i+1 has landed; __syncthreads
//            issue the copies of stage i+3 (into the buffers step i-1 finished reading)
//            dequantize stage i+1 -> sB[(i+1)%2]     (sB[(i+1)%2] was last read by step i-1's multiply)
//            multiply sA[i%4] x sB[i%2]              (written before this step's barrier)
// F16 has nothing to convert: its raw stage is laid out as the fp16 tile and multiplied in place (no sB).
// The weights.cuh types (K-quants, Q5_x, IQ4) have byte-sized scales that cp.async (4, 8, 16 bytes) cannot copy
// one per row; they keep loading from global memory with their struct's load(), into registers one step before
// they are dequantized (the same pipeline, the same sB double buffer, no raw stage).
// Rows past M (A) and past N (weights) are zero-filled by cp.async's src-size 0 (from a clamped, valid address);
// the generic types load the clamped row and store zeros.
//
// Fragments (g = lane/4, c = lane%4; mma16816 in attention_prefill.cu's notation): A row-major from sA with
// ldmatrix.x4 (lane l addresses row l%16, k +8 for l >= 16); B = W^T "col-major" = sB rows (one per output
// feature, k contiguous) with non-transposed ldmatrix.x4: matrices (n+0, k+0), (n+0, k+8), (n+8, k+0), (n+8, k+8)
// = b0, b1 of n8 tile 2p and of 2p+1. Rows are 32 + 8 halfs = 80 bytes apart: the 8 row addresses of one 8x8
// matrix fall in 8 different 16-byte bank groups (80/16 = 5, odd), so ldmatrix is conflict-free.
//
// Epilogue straight from the accumulators: lane (g, c) of a warp holds rows g, g+8 and columns 2c, 2c+1 of each
// 16x8 tile. Split-K (gridDim.z > 1): each slice stores its accumulators into ws[tile][z] in REGISTER order
// (element e of thread t at e * MM2_THREADS + t: coalesced), the tile's last slice (counters, as matmul() above)
// reads the S partials back in that same order and adds them in slice order z = 0..S-1 (its own too, from ws),
// so the sum does not depend on which slice finished last. ws holds gridDim.x*gridDim.y*S*TM*MM2_BN floats
// (Kernels.matmul fits the slices to SplitK's size), counters gridDim.x*gridDim.y ints.
// Cluster split-K (sm_90+, ws == null, launched as clusters of (1, 1, S) blocks: a tile's S slices, at most 8):
// the same sum without the global round trip, counters or a last block. Each slice writes its partial tile into
// its own shared memory (the pipeline's, free after the main loop: Kernels.matmul gives at least TM*128*4 bytes),
// in the same register order; after a cluster barrier, slice r finalizes the r-th S-th of the tile in float4
// groups, reading each group's S partials from the cluster's shared memory (DSMEM, all S loads in flight) and
// adding them in slice order 0..S-1 from 0, as the last block above does: the same bits as the global path, and
// the tile's ordered sum spread over its S blocks instead of one. A second barrier keeps every block's shared
// memory alive until its peers have read it. Only for grids of at most ~1.5 blocks per SM (kernels.py
// CLUSTER_GRID_PER_SM: a cluster waits for its slowest block at the barrier).
// =====================================================================================================================
#define MM2_BN MATMUL2_BN
#define MM2_THREADS MATMUL2_THREADS
#define MM2_STAGES MATMUL2_STAGES
#define MM2_LDS (QK + 8)   // halfs per shared row of sA, sB and F16's raw stage (80 bytes)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// The weights' side of a step, one struct per kind (the kernel calls all four; the unused ones are empty):
//   RAW_ROW            bytes of one weight row in a raw stage (0: no raw stage)
//   DIRECT             the raw stage is the fp16 tile (F16)
//   issue(raw, ...)    this thread's cp.async copies of block kb of rows n0..n0+127 into a raw stage
//   fetch(reg, ...)    register-staged load of this thread's block (generic types)
//   dequant(sB, raw, reg, ...) this thread's 16 weights of the step -> sB: row tid/2, weights 16*(tid%2).. (Q8_0,
//                      generic) or 8*(tid%2).. and 16+8*(tid%2).. (Q4: the two nibbles of bytes 8*(tid%2)..)
// Raw stage of the quantized kinds: regions [BN][QBYTES] quant bytes, [BN] words holding d, ([BN] words holding
// m), each 16-byte aligned (RAW_ROW = their bytes per row); consecutive rows are contiguous, so the 16-byte
// reads of a warp below are conflict-free.
template <bool MIN>
struct Mm2Q4 {   // Q4_0 (MIN false, m unused) and Q4_1: 16 quant bytes, d's word, [m's word] per row
    static constexpr int RAW_ROW = MIN ? 24 : 20;
    static constexpr bool DIRECT = false;
    const uint8_t* qs; const __half* d; const __half* m; int nb;
    struct Reg {};
    __device__ __forceinline__ void issue(uint8_t* raw, int n0, int N, int kb, int tid) const {
        const int row = tid % MM2_BN;
        const int n = n0 + row;
        const long long b = (long long)(n < N ? n : N - 1) * nb + kb;
        if (tid < MM2_BN) {
            cp_async16(raw + row * 16, qs + b * 16, n < N);
            if (MIN) cp_async4(raw + MM2_BN * 20 + row * 4, m + (b & ~1LL), n < N);
        } else {
            cp_async4(raw + MM2_BN * 16 + row * 4, d + (b & ~1LL), n < N);   // the aligned word holding d[b]
        }
    }
    __device__ __forceinline__ void fetch(Reg&, int, int, int, int) const {}
    __device__ __forceinline__ void dequant(__half* sB, const uint8_t* raw, const Reg&, int n0, int, int kb,
                                            int tid) const {
        const int row = tid / 2, h = tid % 2;
        const unsigned b = (unsigned)(n0 + row) * nb + kb;   // parity picks d's half (rows past N: zeros, either)
        const uint2 q8 = *reinterpret_cast<const uint2*>(raw + row * 16 + 8 * h);
        const __half dd = scale_of(reinterpret_cast<const uint32_t*>(raw + MM2_BN * 16)[row], b);
        const __half mm = MIN ? scale_of(reinterpret_cast<const uint32_t*>(raw + MM2_BN * 20)[row], b) : dd;
        uint32_t lo[4], hi[4];
        deq_q4_half<MIN>(q8, dd, mm, lo, hi);
        __half* out = sB + row * MM2_LDS;
        *reinterpret_cast<uint4*>(out + 8 * h) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *reinterpret_cast<uint4*>(out + 16 + 8 * h) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    }
};
using Mm2Q4_0 = Mm2Q4<false>;
using Mm2Q4_1 = Mm2Q4<true>;

struct Mm2Q8_0 {   // 32 quant bytes, d's word per row
    static constexpr int RAW_ROW = 36;
    static constexpr bool DIRECT = false;
    const int8_t* qs; const __half* d; int nb;
    struct Reg {};
    __device__ __forceinline__ void issue(uint8_t* raw, int n0, int N, int kb, int tid) const {
        const int row = tid / 2, h = tid % 2;
        const int n = n0 + row;
        const long long b = (long long)(n < N ? n : N - 1) * nb + kb;
        cp_async16(raw + row * 32 + 16 * h, qs + b * 32 + 16 * h, n < N);
        if (h == 0) cp_async4(raw + MM2_BN * 32 + row * 4, d + (b & ~1LL), n < N);
    }
    __device__ __forceinline__ void fetch(Reg&, int, int, int, int) const {}
    __device__ __forceinline__ void dequant(__half* sB, const uint8_t* raw, const Reg&, int n0, int, int kb,
                                            int tid) const {
        const int row = tid / 2, h = tid % 2;
        const unsigned b = (unsigned)(n0 + row) * nb + kb;   // parity only (a wrap keeps it)
        const uint4 q16 = *reinterpret_cast<const uint4*>(raw + row * 32 + 16 * h);
        uint32_t w[8];
        deq_q8_half(q16, scale_of(reinterpret_cast<const uint32_t*>(raw + MM2_BN * 32)[row], b), w);
        __half* out = sB + row * MM2_LDS + 16 * h;
        *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<uint4*>(out + 8) = make_uint4(w[4], w[5], w[6], w[7]);
    }
};

struct Mm2F16 {   // the raw stage is the fp16 tile [128][MM2_LDS]
    static constexpr int RAW_ROW = MM2_LDS * 2;
    static constexpr bool DIRECT = true;
    const __half* w; int nb;
    struct Reg {};
    __device__ __forceinline__ void issue(uint8_t* raw, int n0, int N, int kb, int tid) const {
        const int row = tid / 2, c = (tid % 2) * 16, n = n0 + row;   // 2 of the row's 4 chunks of 8 halfs
        const __half* from = w + (long long)(n < N ? n : N - 1) * nb * QK + kb * QK + c;
        __half* to = reinterpret_cast<__half*>(raw) + row * MM2_LDS + c;
        cp_async16(to, from, n < N);
        cp_async16(to + 8, from + 8, n < N);
    }
    __device__ __forceinline__ void fetch(Reg&, int, int, int, int) const {}
    __device__ __forceinline__ void dequant(__half*, const uint8_t*, const Reg&, int, int, int, int) const {}
};

template <typename W>
struct Mm2Generic {   // the weights.cuh structs: W::load from global one step ahead, then words/deq
    static constexpr int RAW_ROW = 0;
    static constexpr bool DIRECT = false;
    W w;
    using Reg = typename W::Block;
    __device__ __forceinline__ void issue(uint8_t*, int, int, int, int) const {}
    __device__ __forceinline__ void fetch(Reg& reg, int n0, int N, int kb, int tid) const {
        const int n = n0 + tid / 2;
        reg = w.load(n < N ? n : N - 1, kb);
    }
    __device__ __forceinline__ void dequant(__half* sB, const uint8_t*, const Reg& reg, int n0, int N, int,
                                            int tid) const {
        const int row = tid / 2, h = tid % 2;
        __half v[16];
        int4 lo, hi;
        W::words(reg, lo, hi);
        if (h == 0) {
#pragma unroll
            for (int i = 0; i < 16; i++) v[i] = __float2half(W::deq(reg, lo, hi, i));
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++) v[i] = __float2half(W::deq(reg, lo, hi, 16 + i));
        }
        uint4 a = *reinterpret_cast<uint4*>(v), c = *reinterpret_cast<uint4*>(v + 8);
        if (n0 + row >= N) a = c = make_uint4(0, 0, 0, 0);
        __half* out = sB + row * MM2_LDS + 16 * h;
        *reinterpret_cast<uint4*>(out) = a;
        *reinterpret_cast<uint4*>(out + 8) = c;
    }
};

// Bytes of dynamic shared memory (Kernels.matmul2_smem computes the same from kernels.py MATMUL2_RAW_ROW; the
// kernel traps if it was given less): sA [STAGES][TM][LDS] fp16, sB [2][BN][LDS] fp16 (not for DIRECT), raw
// [STAGES][BN][RAW_ROW] bytes.
template <int TM, typename T>
__host__ __device__ constexpr int mm2_smem_bytes() {
    return MM2_STAGES * TM * MM2_LDS * 2 + (T::DIRECT ? 0 : 2 * MM2_BN * MM2_LDS * 2) + MM2_STAGES * MM2_BN * T::RAW_ROW;
}

// Warps as WM (along M) x WN (along N); a warp owns TM/WM rows x 128/WN columns = MT m16 x NT n8 tiles.
// TM 128: 4 x 2, warp 32 x 64 (MT 2, NT 8): A and B fragments of a k16 step are 8 + 4 registers (a 64 x 32
// warp tile would hold 16 + 4 and spill at the 128 registers 2 blocks per SM allow). TM 64, 32: 2 x 4 (32 x 32,
// 16 x 32); TM 16: 1 x 8 (16 x 16: every weight row's fragments loaded by one warp, A by all eight). matmul2r
// passes WM_ = 1 at every height (its header says why). Warps are numbered along N first.
template <int TM, int WM_ = TM == 128 ? 4 : TM == 16 ? 1 : 2>
struct Mm2Warps {
    static constexpr int WM = WM_, WN = 8 / WM;
    static constexpr int MT = TM / WM / 16, NT = MM2_BN / WN / 8;
    __device__ static int wm(int warp) { return warp / WN; }
    __device__ static int wn(int warp) { return warp % WN; }
};

// Split-K through the scratch (the header's second way), for any kernel whose threads hold their share of a TM x
// MM2_BN tile as R groups of 4 accumulators: this slice's, in register order (group r, element e of thread t at
// (r*4 + e) * MM2_THREADS + t), to ws; the tile's last slice to arrive adds all S in slice order from 0 into acc
// (0 + s_0 + s_1 + ... as matmul() above) and returns true, the others false (their part is done).
template <int TM, int R>
__device__ __forceinline__ bool mm2_scratch_sum(float (&acc)[R][4], float* __restrict__ ws,
                                                int* __restrict__ counters) {
    __shared__ bool is_last;
    constexpr int TILE = TM * MM2_BN;
    const int tid = threadIdx.x, S = gridDim.z;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    float* mine = ws + ((size_t)tile * S + blockIdx.z) * TILE + tid;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int e = 0; e < 4; e++) mine[(r * 4 + e) * MM2_THREADS] = acc[r][e];
    __threadfence();              // this slice visible device-wide before the count says so
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(counters + tile, 1) == S - 1;
    __syncthreads();
    if (!is_last) return false;
    __threadfence();
    if (tid == 0) counters[tile] = 0;   // zero again for the next launch (stream-ordered)
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.0f;
    for (int z = 0; z < S; z++) {   // slice order, element by element
        const float* part = ws + ((size_t)tile * S + z) * TILE + tid;
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[r][e] += __ldcg(part + (r * 4 + e) * MM2_THREADS);   // L2: other SMs
    }
    return true;
}

// The GEMM's end, shared by matmul2, matmul2r and matmul2w: a block's accumulators (its TM x MM2_BN tile,
// Mm2Warps' fragments of the caller's warp layout WM_) to C, the split-K slices summed first (the header's two ways:
// cluster, or scratch + last block: mm2_scratch_sum, which matmul2t shares).
template <int TM, int WM_>
__device__ __forceinline__ void mm2_store(float (&acc)[Mm2Warps<TM, WM_>::MT][Mm2Warps<TM, WM_>::NT][4],
                                          const float* __restrict__ bias, float* __restrict__ C, int M, int N,
                                          int ldc, int mode, float* __restrict__ ws, int* __restrict__ counters) {
    using Warps = Mm2Warps<TM, WM_>;
    constexpr int WM = Warps::WM, MT = Warps::MT, NT = Warps::NT;
    extern __shared__ __align__(16) unsigned char mm2_raw_smem[];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, wm = Warps::wm(warp), wn = Warps::wn(warp);
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * MM2_BN;
    const int S = gridDim.z;
    if (S > 1 && ws == nullptr) {   // cluster split-K (see the header)
#if __CUDA_ARCH__ >= 900
        constexpr int TILE = TM * MM2_BN;
        require_dynamic_smem(TILE * 4);
        namespace cg = cooperative_groups;
        cg::cluster_group cluster = cg::this_cluster();
        float* part = reinterpret_cast<float*>(mm2_raw_smem) + tid;   // [MT*NT*4][MM2_THREADS], register order
        __syncthreads();   // every warp's last ldmatrix of sA/sB is done before the partial overwrites them
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) part[((mt * NT + nt) * 4 + e) * MM2_THREADS] = acc[mt][nt][e];
        cluster.sync();   // all S partials written, visible to the cluster
        // Slice r finalizes the r-th S-th of the tile, in float4 groups of the register-order layout (element
        // f = q * MM2_THREADS + t is register q of thread t): the S partials of a group are independent loads
        // (in flight together), added in slice order from 0, and each of the 4 elements is stored where thread
        // t's epilogue below would have stored its register q.
        const float4* part4 = reinterpret_cast<const float4*>(mm2_raw_smem);
        const int groups = TILE / 4, per = (groups + S - 1) / S;
        const int g_end = min(groups, ((int)blockIdx.z + 1) * per);
        for (int g = (int)blockIdx.z * per + tid; g < g_end; g += MM2_THREADS) {
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int z = 0; z < MATMUL2_SLICES; z++) {
                if (z >= S) break;
                const float4 v = cluster.map_shared_rank(part4, z)[g];
                sum.x += v.x;
                sum.y += v.y;
                sum.z += v.z;
                sum.w += v.w;
            }
            const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int f = 4 * g + j, q = f / MM2_THREADS, t = f % MM2_THREADS;
                const int l = t % WARP, w = t / WARP, mt = q / (NT * 4), nt = (q / 4) % NT, e = q % 4;
                const int gr = m0 + Warps::wm(w) * (TM / WM) + l / 4 + mt * 16 + 8 * (e / 2);
                const int gc = n0 + Warps::wn(w) * (NT * 8) + 2 * (l % 4) + nt * 8 + e % 2;
                if (gr >= M || gc >= N) continue;
                float* out = C + (long long)gr * ldc + gc;
                const float v = vals[j] + (bias ? bias[gc] : 0.0f);
                *out = mode == MODE_ADD ? *out + v : v;
            }
        }
        cluster.sync();   // the peers have read this block's partial: its shared memory may go
        return;
#else
        __trap();   // the host launches clusters only on compute capability 9.0+
#endif
    } else if (S > 1) {   // through the scratch: the tile's registers as MT*NT groups of 4
        if (!mm2_scratch_sum<TM>(reinterpret_cast<float (&)[MT * NT][4]>(acc), ws, counters)) return;
    }
    // Epilogue: element e of tile (mt, nt) is row g + 8*(e/2), column 2c + e%2 (scalar stores: C + offset of a
    // stacked part need not be 8-byte aligned).
    const int r0 = m0 + wm * (TM / WM) + lane / 4, c0 = n0 + wn * (NT * 8) + 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
            const int gc = c0 + nt * 8 + e2;
            if (gc >= N) continue;
            const float b = bias ? bias[gc] : 0.0f;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int gr = r0 + mt * 16 + 8 * h;
                    if (gr >= M) continue;
                    float* out = C + (long long)gr * ldc + gc;
                    const float v = acc[mt][nt][2 * h + e2] + b;
                    *out = mode == MODE_ADD ? *out + v : v;
                }
        }
}

template <int TM, typename T>
__device__ __forceinline__ void matmul2(const T& src, const __half* __restrict__ A, const float* __restrict__ bias,
                                        float* __restrict__ C, int M, int N, int K, int ldc, int mode,
                                        float* __restrict__ ws, int* __restrict__ counters) {
    constexpr int WM = Mm2Warps<TM>::WM, WN = Mm2Warps<TM>::WN, MT = Mm2Warps<TM>::MT, NT = Mm2Warps<TM>::NT;
    constexpr int A_STAGE = TM * MM2_LDS;       // halfs
    constexpr int B_TILE = MM2_BN * MM2_LDS;    // halfs
    constexpr int RAW_STAGE = MM2_BN * T::RAW_ROW;
    static_assert(MM2_THREADS == 256 && MM2_BN == 128 && QK == 32, "the thread mappings below assume these");
    static_assert(MT >= 1 && NT % 2 == 0, "ldmatrix.x4 loads B for two n8 tiles");
    extern __shared__ __align__(16) unsigned char mm2_raw_smem[];
    require_dynamic_smem(mm2_smem_bytes<TM, T>());
    __half* sA = reinterpret_cast<__half*>(mm2_raw_smem);                 // [STAGES][TM][LDS]
    __half* sB = sA + MM2_STAGES * A_STAGE;                               // [2][BN][LDS] (unused when DIRECT)
    uint8_t* raw = reinterpret_cast<uint8_t*>(sB + (T::DIRECT ? 0 : 2 * B_TILE));   // [STAGES][RAW_STAGE]

    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, wm = warp / WN, wn = warp % WN;
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * MM2_BN;
    const int nb = K / QK, per = (nb + gridDim.z - 1) / gridDim.z;
    const int kb0 = blockIdx.z * per, steps = max(0, min(nb, kb0 + per) - kb0);

    // This thread's A chunks (16 bytes: row e/4, halfs 8*(e%4).., e = tid + j*THREADS): source at step 0 and
    // shared offset in stage 0, computed once; rows past M read nothing (zero-fill) from row M-1.
    constexpr int AJ = (TM * 4 + MM2_THREADS - 1) / MM2_THREADS;
    const __half* a_src[AJ];
    int a_dst[AJ];
    bool a_ok[AJ];
#pragma unroll
    for (int j = 0; j < AJ; j++) {
        const int e = tid + j * MM2_THREADS, row = e / 4, c = (e % 4) * 8;
        const int mrow = m0 + row;
        a_ok[j] = e < TM * 4 && mrow < M;
        a_src[j] = A + (long long)(mrow < M ? mrow : M - 1) * K + kb0 * QK + c;
        a_dst[j] = e < TM * 4 ? row * MM2_LDS + c : -1;
    }
    auto load_stage = [&](int s) {   // A tile and raw weights of step s into stage s % STAGES
        __half* a = sA + (s % MM2_STAGES) * A_STAGE;
#pragma unroll
        for (int j = 0; j < AJ; j++)
            if (a_dst[j] >= 0) cp_async16(a + a_dst[j], a_src[j] + s * QK, a_ok[j]);
        src.issue(raw + (s % MM2_STAGES) * RAW_STAGE, n0, N, kb0 + s, tid);
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    // Prologue: stages 0..STAGES-2 in flight (one group each, empty past the range), stage 0 dequantized.
#pragma unroll
    for (int s = 0; s < MM2_STAGES - 1; s++) {
        if (s < steps) load_stage(s);
        cp_async_commit();
    }
    typename T::Reg reg;
    if (steps > 0) src.fetch(reg, n0, N, kb0, tid);
    cp_async_wait<MM2_STAGES - 2>();   // stage 0 landed (this thread's copies)
    __syncthreads();              // ... and everyone's
    if (steps > 0) {
        src.dequant(sB, raw, reg, n0, N, kb0, tid);
        if (steps > 1) src.fetch(reg, n0, N, kb0 + 1, tid);
    }

    // ldmatrix lane addresses (halfs): A rows wm*(TM/WM) + mt*16 + l%16, k +8 for l >= 16; B rows (features)
    // wn*(NT*8) + p*16 + l%8 + 8*(l/16), k +8 for (l/8) odd.
    const int a_lane = (wm * (TM / WM) + lane % 16) * MM2_LDS + (lane / 16) * 8;
    const int b_lane = (wn * (NT * 8) + lane % 8 + (lane / 16) * 8) * MM2_LDS + ((lane / 8) % 2) * 8;

    for (int i = 0; i < steps; i++) {
        cp_async_wait<MM2_STAGES - 3>();   // stage i+1 landed (groups committed: stages ..i+STAGES-2)
        __syncthreads();
        if (i + MM2_STAGES - 1 < steps) load_stage(i + MM2_STAGES - 1);
        cp_async_commit();                 // (empty near the end: keeps one group per step for the wait count)
        if (i + 1 < steps) {
            src.dequant(sB + ((i + 1) % 2) * B_TILE, raw + ((i + 1) % MM2_STAGES) * RAW_STAGE, reg, n0, N, kb0 + i + 1,
                        tid);
            if (i + 2 < steps) src.fetch(reg, n0, N, kb0 + i + 2, tid);
        }
        const __half* a_st = sA + (i % MM2_STAGES) * A_STAGE + a_lane;
        const __half* b_st = (T::DIRECT ? reinterpret_cast<const __half*>(raw + (i % MM2_STAGES) * RAW_STAGE)
                                        : sB + (i % 2) * B_TILE) + b_lane;
#pragma unroll
        for (int ks = 0; ks < QK / 16; ks++) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) ldsm_x4(a[mt], a_st + mt * 16 * MM2_LDS + ks * 16);
#pragma unroll
            for (int p = 0; p < NT / 2; p++) {
                unsigned b[4];
                ldsm_x4(b, b_st + p * 16 * MM2_LDS + ks * 16);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma16816(acc[mt][2 * p], a[mt], b[0], b[1]);
                    mma16816(acc[mt][2 * p + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();   // no copy may still target shared memory when the block exits (only empty groups remain)
    INGOT_PDL_TRIGGER();   // the next kernel may launch while this one writes C (common.cuh: after the main loop)

    mm2_store<TM, WM>(acc, bias, C, M, N, ldc, mode, ws, counters);
}

template <typename W>
__device__ __forceinline__ Mm2Generic<W> mm2_source(const W& w) { return {w}; }
template <bool MIN>
__device__ __forceinline__ Mm2Q4<MIN> mm2_source(const Mm2Q4<MIN>& w) { return w; }
__device__ __forceinline__ Mm2Q8_0 mm2_source(const Mm2Q8_0& w) { return w; }
__device__ __forceinline__ Mm2F16 mm2_source(const Mm2F16& w) { return w; }

#define MM2_RUN(TM, WT, ...) \
    matmul2<TM>(mm2_source(WT{__VA_ARGS__, K / QK}), A, bias, C, M, N, K, ldc, mode, ws, counters)
#else
#define MM2_RUN(TM, WT, ...) // sm_75: never launched (the host runs matmul_<type> there)
#endif

// Three tile heights per type, each its own kernel: registers and occupancy of its own size. __launch_bounds__
// minimum blocks per SM, from ptxas -v on sm_80..sm_120 (cuda/PERF.md, v10): 128 rows 2 (128 registers: 64 are the
// accumulators), 64 rows 3 (80), 32 rows 3 (ptxas takes 60-71 unasked: 4 blocks on sm_90 when the shared memory
// allows), 16 rows 4 (64). X(name, source struct, kernel parameters, struct initializers before nb).
#define Q4_0_PARAMS const uint8_t* qs, const __half* d
#define Q4_1_PARAMS const uint8_t* qs, const __half* d, const __half* m
#define Q8_0_PARAMS const int8_t* qs, const __half* d
#define F16_PARAMS const __half* w
#define FOR_EACH_MATMUL2_TYPE(X)                         \
    X(q4_0, Mm2Q4_0, Q4_0_PARAMS, qs, d, nullptr)        \
    X(q4_1, Mm2Q4_1, Q4_1_PARAMS, qs, d, m)              \
    X(q8_0, Mm2Q8_0, Q8_0_PARAMS, qs, d)                 \
    X(f16, Mm2F16, F16_PARAMS, w)                        \
    FOR_EACH_GENERIC_TYPE(X)

// Each: grid (ceil(M/TM), ceil(N/128), split-K slices), MM2_THREADS threads, Kernels.matmul2_smem(type, TM) bytes
// of dynamic shared memory; arguments as matmul_<type>.
#define MATMUL2_KERNELS(NAME, WT, PARAMS, ...)                                                                    \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, 2)                                                 \
    matmul2_##NAME##_bm128(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc,   \
                           int mode, float* ws, int* counters) {                                                 \
        INGOT_PDL_WAIT();                                                                                        \
        MM2_RUN(128, WT, __VA_ARGS__);                                                                           \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, 3)                                                 \
    matmul2_##NAME##_bm64(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc,    \
                          int mode, float* ws, int* counters) {                                                  \
        INGOT_PDL_WAIT();                                                                                        \
        MM2_RUN(64, WT, __VA_ARGS__);                                                                            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, 3)                                                 \
    matmul2_##NAME##_bm32(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc,    \
                          int mode, float* ws, int* counters) {                                                  \
        INGOT_PDL_WAIT();                                                                                        \
        MM2_RUN(32, WT, __VA_ARGS__);                                                                            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, 4)                                                 \
    matmul2_##NAME##_bm16(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc,    \
                          int mode, float* ws, int* counters) {                                                  \
        INGOT_PDL_WAIT();                                                                                        \
        MM2_RUN(16, WT, __VA_ARGS__);                                                                            \
    }
FOR_EACH_MATMUL2_TYPE(MATMUL2_KERNELS)
#undef MATMUL2_KERNELS
#undef MM2_RUN

// =====================================================================================================================
// matmul2r_<type>_bm<TM> (Q4_0, Q4_1, Q4_K, Q6_K: Fq below; compute capability >= 8.0): matmul2's product, tiles,
// warps, split-K and epilogue (mm2_store), with the weights dequantized straight into the B fragments' registers
// instead of an fp16 tile in shared memory, and KB quantization blocks a stage instead of one. Why (cuda/PERF.md v17,
// ncu on the 8B's gate+up at 16 rows): matmul2's L1/shared pipe was 81% busy for 13% of DRAM bandwidth. A stage of one
// block copies 16 quant bytes and one 2-byte scale per row, rows 2 KB apart: every copy touches its own sector for a
// part of it (the cp.async wavefronts 8-32x the ideal), and the fp16 tile costs a store and an ldmatrix per weight on
// top. Here a stage holds KB = 4 blocks (TM <= 32) or 2: 64 or 32 contiguous quant bytes a row, and the scales as the
// aligned 16-byte chunk(s) of d (and m) that hold the stage's blocks of the row; one barrier a stage.
//
// Stage layout (Mm2rShape), MATMUL2R_STAGES stages: quant bytes [128][QROW] (QROW = 16*KB, + 16 when KB is even: an odd
// number of 16-byte units, so the 8 rows a warp's lanes read at once fall in distinct banks); scale chunks
// [128][32 bytes] of d, then of m (Q4_1; Q6_K: its d words [128][8] and high bits [128][HROW], below); the A tile
// [TM][32*KB + 8] fp16 (rows 16*odd bytes apart: ldmatrix conflict-free). Block j of a stage of row n is element o + j
// of its scale window, o = the stage's first block's element offset in its 16-byte chunk (the second chunk is copied
// only when the blocks run into it). The lanes take o from d's address, for m's windows too: Kernels.matmul (kernels.py
// matmul2r_serves) launches Q4_1 here only when m lies at d's offset within 16 bytes (separate pool allocations always
// do), and only for 32-bit offsets. Fragments: lane (g, c) of the warp owning n8 tile nt dequantizes weight row
// wn*NT*8 + nt*8 + g: two 4-byte words of the block's quant bytes -> chunk 0's and chunk 1's b0, b1 (deq_frag_at:
// matmul_tiles.cuh deq_q4_frag or deq_q4k_frag; Q6_K deq_q6k_frag with its high-bit words), then the MT m16 tiles' mma
// for both chunks. Each accumulator takes the same mma in the same order as in matmul2 (block by block, chunk 0 then 1)
// from the same fp16 values: the two kernels give the same bits (tests/gpu test_gpu_kernels.py).
// A slice's last stage may hold fewer than KB blocks: the missing ones are neither copied nor multiplied.
// Warps 1 x 8 at every height (Mm2Warps<TM, 1>): a warp owns all TM rows x 16 columns (MT = TM/16 m16 tiles, NT = 2
// n8 tiles), so each weight fragment is dequantized by one warp, once a block. matmul2's 2 x 4 and 4 x 2 would
// dequantize every fragment in 2 or 4 warps: ALU that matmul2 shares through its fp16 tile and this kernel cannot.
// The price is A: each warp loads all MT A fragments (ldmatrix, conflict-free). At TM 128 a thread holds 64
// accumulators + 32 A + 8 B registers: 128 registers at 2 blocks per SM (ptxas -v at sm_90a, nvcc 13.0: Q4_0's
// bm128 spills 8 bytes and Q6_K's bm64 4 at their bounds, the rest none; sm_80 spills up to 32). cuda/PERF.md v18.
// =====================================================================================================================
#define MM2R_STAGES MATMUL2R_STAGES

// The types of the fragment kernels (matmul2r, matmul2w, matmul2t) and where a block's scale comes from. The kernels
// take (qs, d, m) as kernels.py fragment_args gives them (matmul2r_q6_k: matmul2_q6_k's qs, qh, sc, d, below):
//   Q4_0  d: fp16 per block                                           w = d*(q - 8)
//   Q4_1  d, m: fp16 per block                                        w = d*q + m
//   Q4_K  d: the super-block headers (16 bytes per 8 blocks: f16 d, dmin, 6-bit scales and mins; weights.cuh),
//         m null                                                      w = dl*q - ml (dl = d*sc, ml = dmin*m)
// A header covers 8 blocks as a 16-byte chunk of d covers 8 fp16 scales, so Q4_K's windows, their copies and a
// block's offset o in its window are Q4_0's arithmetic on the header array read as fp16 (16-byte aligned, as every
// Q4_K kernel reads it: pool allocations are 256-byte aligned): block o of a window is sub-block o % 8 of its chunk
// o / 8. (Fq: weights.cuh.)

// Block o of a weight row's stage: q its 16 quant bytes + 4*(c/2), sw its scale window (Q4_1: mw, m's), into the
// lane's B fragments of the block's two k16 chunks (matmul_tiles.cuh deq_q4_frag / deq_q4k_frag).
template <Fq Q>
__device__ __forceinline__ void deq_frag_at(const unsigned char* q, const unsigned char* sw, const unsigned char* mw,
                                            int o, int c, uint32_t (&b)[4]) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(q);   // words 0 and 2 from q: bytes +0..3, +8..11
    if constexpr (Q == Fq::Q4_K) {
        const KHeader k = k_header(*reinterpret_cast<const uint4*>(sw + 16 * (o >> 3)), o & 7);
        deq_q4k_frag(w[0], w[2], c, k.dl, -k.ml, b);
    } else {
        const __half dd = reinterpret_cast<const __half*>(sw)[o];
        const __half mm = Q == Fq::Q4_1 ? reinterpret_cast<const __half*>(mw)[o] : dd;
        deq_q4_frag<Q == Fq::Q4_1>(w[0], w[2], c, dd, mm, b);
    }
}

// The same for a whole block as fp16 pairs (matmul2w's weight tile): lo[h], hi[h] = weights 8h.. and 16 + 8h..
template <Fq Q>
__device__ __forceinline__ void deq_block_at(const uint4& q, const unsigned char* sw, const unsigned char* mw, int o,
                                             uint32_t (&lo)[2][4], uint32_t (&hi)[2][4]) {
    if constexpr (Q == Fq::Q4_K) {
        const KHeader k = k_header(*reinterpret_cast<const uint4*>(sw + 16 * (o >> 3)), o & 7);
        deq_q4k_half(make_uint2(q.x, q.y), k.dl, -k.ml, lo[0], hi[0]);
        deq_q4k_half(make_uint2(q.z, q.w), k.dl, -k.ml, lo[1], hi[1]);
    } else {
        const __half dd = reinterpret_cast<const __half*>(sw)[o];
        const __half mm = Q == Fq::Q4_1 ? reinterpret_cast<const __half*>(mw)[o] : dd;
        deq_q4_half<Q == Fq::Q4_1>(make_uint2(q.x, q.y), dd, mm, lo[0], hi[0]);   // weights 0..7 and 16..23
        deq_q4_half<Q == Fq::Q4_1>(make_uint2(q.z, q.w), dd, mm, lo[1], hi[1]);   // weights 8..15 and 24..31
    }
}

// A weight row's scale window of one stage (matmul2r, matmul2w, matmul2t): chunk `chunk` of the 16-byte chunks of
// src (fp16 per block; Q4_K's headers) holding the stage's `valid` blocks from element `elem`, into the stage st at
// region + row_off + 16 * chunk. Chunk 0 always, chunk 1 only when the blocks run into it; ok false zero-fills (a row
// past N).
// This thread's quant-byte copies of a stage at stage 0 (matmul2r, matmul2t; a stage s adds s*KB blocks): chunk
// e = tid + j*THREADS -> row e/KB, block e%KB (a row's KB chunks in consecutive lanes: contiguous bytes), 32-bit
// offsets from the slice's first block, into q_off + row*QROW; blk KB: no copy; rows past N read a clamped row
// (their copies zero-fill).
template <int KB, int QROW, int QJ>
__device__ __forceinline__ void mm2_quant_copies(int tid, int n0, int N, int nb, int q_off, unsigned (&q_src)[QJ],
                                                 int (&q_dst)[QJ], int (&q_blk)[QJ], bool (&q_ok)[QJ]) {
#pragma unroll
    for (int j = 0; j < QJ; j++) {
        const int e = tid + j * MM2_THREADS, row = e / KB, n = n0 + row;
        q_blk[j] = e < MM2_BN * KB ? e % KB : KB;
        q_ok[j] = n < N;
        q_src[j] = ((unsigned)(n < N ? n : N - 1) * nb + e % KB) * 16;
        q_dst[j] = q_off + row * QROW + (e % KB) * 16;
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mm2_scale_window(unsigned char* st, int region, int row_off, const __half* src,
                                                 long long elem, int chunk, int valid, bool ok) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(src + elem);
    if (chunk == 0 || ((p & 15) >> 1) + valid > 8)
        cp_async16(st + region + row_off + 16 * chunk,
                   reinterpret_cast<const void*>((p & ~uintptr_t(15)) + 16 * chunk), ok);
}
#endif

template <int TM>
struct Mm2rShape {
    static constexpr int KB = TM <= 32 ? 4 : 2;                     // quantization blocks a stage
    static constexpr int QROW = 16 * KB + (KB % 2 == 0 ? 16 : 0);  // bytes a row in the quant region
    static constexpr int SROW = 32;                                 // bytes a row in a scale region (two chunks)
    static constexpr int HROW = 8 * KB + 8;                         // bytes a row of Q6_K's high bits (8 a block):
                                                                    // the 8 rows a warp reads in distinct banks
    static constexpr int DROW = 8;                                  // bytes a row of Q6_K's d (two 4-byte words)
    static constexpr int LDA = QK * KB + 8;                         // halfs a row of the A tile
};

// Bytes of dynamic shared memory (kernels.py matmul2r_smem computes the same; the kernel traps if given less): the
// weights' regions (quants, scale windows: d's, m's for Q4_1; Q6_K's d words and high bits), then the A tile.
template <int TM, Fq Q>
__host__ __device__ constexpr int mm2r_stage_bytes() {
    using Sh = Mm2rShape<TM>;
    constexpr int second = Q == Fq::Q4_1 ? Sh::SROW : Q == Fq::Q6_K ? Sh::DROW + Sh::HROW : 0;
    return MM2_BN * (Sh::QROW + Sh::SROW + second) + TM * Sh::LDA * 2;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <int TM, Fq Q>
__device__ __forceinline__ void matmul2r(const uint8_t* __restrict__ qs, const __half* __restrict__ d,
                                         const __half* __restrict__ mn, const uint2* __restrict__ qh,
                                         const __half* __restrict__ A, const float* __restrict__ bias,
                                         float* __restrict__ C, int M, int N, int K, int ldc, int mode,
                                         float* __restrict__ ws, int* __restrict__ counters) {
    using Warps = Mm2Warps<TM, 1>;
    constexpr int WM = Warps::WM, WN = Warps::WN, MT = Warps::MT, NT = Warps::NT;
    static_assert(WM == 1 && NT == 2, "the fragment loop below: one warp per 16 columns");
    constexpr int KB = Mm2rShape<TM>::KB, QROW = Mm2rShape<TM>::QROW, SROW = Mm2rShape<TM>::SROW;
    constexpr int LDA = Mm2rShape<TM>::LDA;
    constexpr bool MIN = Q == Fq::Q4_1, Q6 = Q == Fq::Q6_K;   // after d's windows: m's (Q4_1), d's words (Q6_K)
    constexpr int HROW = Mm2rShape<TM>::HROW, DROW = Mm2rShape<TM>::DROW;
    constexpr int S_OFF = MM2_BN * QROW, M_OFF = S_OFF + MM2_BN * SROW;
    constexpr int H_OFF = M_OFF + (MIN ? MM2_BN * SROW : Q6 ? MM2_BN * DROW : 0);
    constexpr int A_OFF = H_OFF + (Q6 ? MM2_BN * HROW : 0);
    constexpr int STAGE = mm2r_stage_bytes<TM, Q>();
    static_assert(A_OFF + TM * LDA * 2 == STAGE && STAGE % 16 == 0, "stage layout");
    static_assert(MM2_THREADS == 256 && MM2_BN == 128 && QK == 32, "the thread mappings below assume these");
    extern __shared__ __align__(16) unsigned char mm2_raw_smem[];
    require_dynamic_smem(MM2R_STAGES * STAGE);
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, wm = warp / WN, wn = warp % WN;
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * MM2_BN;
    const int nb = K / QK, per = (nb + gridDim.z - 1) / gridDim.z;
    const int kb0 = blockIdx.z * per, steps = max(0, min(nb, kb0 + per) - kb0);
    const int stages = (steps + KB - 1) / KB;

    // This thread's copies, addresses at stage 0 (a stage s adds s*KB blocks). Quant chunks: e = tid + j*THREADS
    // -> row e/KB, block e%KB (a row's KB chunks in consecutive lanes: contiguous bytes). Scale chunks: row tid/2,
    // chunk tid%2 of its window. A: row e/(4*KB), 16-byte chunk e%(4*KB) (block chunk/4). Rows past N or M:
    // zero-filled from a clamped, valid address.
    constexpr int QJ = (MM2_BN * KB + MM2_THREADS - 1) / MM2_THREADS, AJ = (TM * 4 * KB + MM2_THREADS - 1) / MM2_THREADS;
    // (32-bit offsets from the slice's first block: fewer registers than pointers; kernels.py matmul2r_serves
    // sends a matrix of 4 GiB of quant bytes or a pass of 2^32 A elements to matmul2.)
    const uint8_t* q_base = qs + (long long)kb0 * 16;
    unsigned q_src[QJ];
    int q_dst[QJ], q_blk[QJ];
    bool q_ok[QJ];
    mm2_quant_copies<KB, QROW>(tid, n0, N, nb, 0, q_src, q_dst, q_blk, q_ok);
    const int s_row = tid / 2, s_chunk = tid % 2, s_n = n0 + s_row;
    const long long s_elem = (long long)(s_n < N ? s_n : N - 1) * nb + kb0;
    const __half* a_base = A + kb0 * QK;
    unsigned a_src[AJ];
    int a_dst[AJ], a_blk[AJ];
    bool a_ok[AJ];
#pragma unroll
    for (int j = 0; j < AJ; j++) {
        const int e = tid + j * MM2_THREADS, row = e / (4 * KB), ch = e % (4 * KB), mrow = m0 + row;
        a_blk[j] = e < TM * 4 * KB ? ch / 4 : KB;
        a_ok[j] = mrow < M;
        a_src[j] = (unsigned)(mrow < M ? mrow : M - 1) * K + ch * 8;
        a_dst[j] = A_OFF + (row * LDA + ch * 8) * 2;
    }
    auto scale_copy = [&](unsigned char* st, int region, const __half* base, int s, int valid) {
        mm2_scale_window(st, region, s_row * SROW, base, s_elem + s * KB, s_chunk, valid, s_n < N);
    };
    // Q6_K's high bits: 8 bytes a block, copied as its quant chunks are (chunk e: row e/KB, block e%KB).
    const uint2* qh_base = Q6 ? qh + kb0 : nullptr;
    auto load_stage = [&](int s) {
        unsigned char* st = mm2_raw_smem + (s % MM2R_STAGES) * STAGE;
        const int valid = min(KB, steps - s * KB);   // blocks of this stage in the slice
#pragma unroll
        for (int j = 0; j < QJ; j++)
            if (q_blk[j] < valid) cp_async16(st + q_dst[j], q_base + q_src[j] + s * KB * 16, q_ok[j]);
        scale_copy(st, S_OFF, d, s, valid);   // Q6_K: its sub-block scales (a char2 a block) in d's place
        if (MIN) scale_copy(st, M_OFF, mn, s, valid);
        if constexpr (Q6) {
            // The super-blocks' d (an f16 per 8 blocks, in mn): elements e0..e1 hold the stage's blocks (at most
            // two: KB <= 4; nb % 8 == 0, so a super-block never spans two rows). Word 0: the aligned 4 bytes holding
            // e0; word 1 the next, copied only when e1 lies in it.
            const long long e0 = (s_elem + s * KB) >> 3, e1 = (s_elem + s * KB + valid - 1) >> 3;
            const uintptr_t p = reinterpret_cast<uintptr_t>(mn + e0);
            if (s_chunk == 0 || ((p >> 1) & 1) + (e1 - e0) > 1)
                cp_async4(st + M_OFF + s_row * DROW + 4 * s_chunk,
                          reinterpret_cast<const void*>((p & ~uintptr_t(3)) + 4 * s_chunk), s_n < N);
#pragma unroll
            for (int j = 0; j < QJ; j++)
                if (q_blk[j] < valid)
                    cp_async8(st + H_OFF + ((tid + j * MM2_THREADS) / KB) * HROW + q_blk[j] * 8,
                              qh_base + (q_src[j] >> 4) + s * KB, q_ok[j]);
        }
#pragma unroll
        for (int j = 0; j < AJ; j++)
            if (a_blk[j] < valid) cp_async16(st + a_dst[j], a_base + a_src[j] + s * KB * QK, a_ok[j]);
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

#pragma unroll
    for (int s = 0; s < MM2R_STAGES - 1; s++) {
        if (s < stages) load_stage(s);
        cp_async_commit();
    }

    // The lane's weight rows (one per n8 tile) and their scale windows' offsets at stage 0; ldmatrix addresses of A
    // as matmul2's (rows wm*(TM/WM) + mt*16 + l%16, k +8 for l >= 16), at block kk, chunk ks: + 32*kk + 16*ks.
    // The offset is the same for the lane's NT rows (8*nt rows further is 16*nt*nb bytes further); a row past N
    // reads zeros from a zero-filled window whatever its offset.
    const int g = lane / 4, c = lane % 4;
    const int o0 = (int)(((reinterpret_cast<uintptr_t>(d) >> 1) + (unsigned)(n0 + wn * (NT * 8) + g) * nb + kb0) & 7);
    const int a_lane = (wm * (TM / WM) + lane % 16) * LDA + (lane / 16) * 8;
    const int q_lane = (wn * (NT * 8) + g) * QROW + 4 * (c >> 1), s_lane = (wn * (NT * 8) + g) * SROW;
    // Q6_K: the lane's high bits and d words; at stage s block kk's super-block is element
    // ((od0 + kbs / 8) & 1) + (kbs % 8 + kk) / 8 of its two words (kbs = kb0 + s*KB; 8 rows further is nb elements
    // further, an even number, so the lane's NT rows share it).
    const int h_lane = (wn * (NT * 8) + g) * HROW, d_lane = (wn * (NT * 8) + g) * DROW;
    const int od0 = (int)(((reinterpret_cast<uintptr_t>(mn) >> 1) + (unsigned)(n0 + wn * (NT * 8) + g) * (nb / 8)) & 1);

    for (int s = 0; s < stages; s++) {
        cp_async_wait<MM2R_STAGES - 2>();   // stage s landed (this thread's copies) ...
        __syncthreads();                     // ... everyone's; and every warp is done with stage s-1's buffer
        if (s + MM2R_STAGES - 1 < stages) load_stage(s + MM2R_STAGES - 1);
        cp_async_commit();                   // (empty near the end: one group per stage for the wait count)
        const unsigned char* st = mm2_raw_smem + (s % MM2R_STAGES) * STAGE;
        const __half* sa = reinterpret_cast<const __half*>(st + A_OFF) + a_lane;
        const int valid = min(KB, steps - s * KB);
#pragma unroll
        for (int kk = 0; kk < KB; kk++) {
            if (kk >= valid) break;
            // The block's B fragments of the warp's NT n8 tiles (chunk 0: b[nt][0..1], chunk 1: b[nt][2..3]), then
            // per chunk the MT A fragments and MT x NT mma: each accumulator chunk 0 then 1, as in matmul2.
            const int o = ((o0 + s * KB) & 7) + kk;
            uint32_t b[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                if constexpr (Q6) {
                    const int kbs = kb0 + s * KB, od = ((od0 + (kbs >> 3)) & 1) + (((kbs & 7) + kk) >> 3);
                    const uint32_t* w = reinterpret_cast<const uint32_t*>(st + q_lane + nt * 8 * QROW + kk * 16);
                    const uint2 h = *reinterpret_cast<const uint2*>(st + H_OFF + h_lane + nt * 8 * HROW + kk * 8);
                    const char2 sc = reinterpret_cast<const char2*>(st + S_OFF + s_lane + nt * 8 * SROW)[o];
                    const __half* dw = reinterpret_cast<const __half*>(st + M_OFF + d_lane + nt * 8 * DROW);
                    const float dd = __half2float(dw[od]);
                    deq_q6k_frag(w[0], w[2], h.x, h.y, c, __fmul_rn(dd, i2f_exact(sc.x)),
                                 __fmul_rn(dd, i2f_exact(sc.y)), b[nt]);
                } else {
                    deq_frag_at<Q>(st + q_lane + nt * 8 * QROW + kk * 16, st + S_OFF + s_lane + nt * 8 * SROW,
                                   st + M_OFF + s_lane + nt * 8 * SROW, o, c, b[nt]);
                }
            }
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) ldsm_x4(a[mt], sa + mt * 16 * LDA + kk * QK + ks * 16);
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) mma16816(acc[mt][nt], a[mt], b[nt][2 * ks], b[nt][2 * ks + 1]);
            }
        }
    }
    cp_async_wait<0>();
    INGOT_PDL_TRIGGER();
    mm2_store<TM, WM>(acc, bias, C, M, N, ldc, mode, ws, counters);
}
#define MM2R_RUN(TM, Q, ...) matmul2r<TM, Q>(__VA_ARGS__, A, bias, C, M, N, K, ldc, mode, ws, counters)
#else
#define MM2R_RUN(TM, Q, ...)   // sm_75: never launched
#endif

// Each: grid, threads and epilogue arguments as matmul2_<type>_bm<TM>; Kernels.matmul2r_smem(type, TM) bytes of
// dynamic shared memory (MATMUL2R_STAGES stages of mm2r_stage_bytes). Tile heights 16, 32, 64, 128 (kernels.py
// MATMUL2R_TILE_ROWS). The weight arguments as fragment_args gives them: the 4-bit types (qs, d, m), Q4_0 and Q4_K
// with m = nullptr and Q4_K its headers as d; Q6_K matmul2_q6_k's (qs, qh, sc, d), its sub-block scales (a char2 a
// block) taking d's windows, the super-blocks' d (an f16 per 256 weights) two 4-byte words a row (Mm2rShape::DROW),
// the high bits (8 bytes a block) a region of their own (HROW). X(name, type, weight parameters, matmul2r's weight
// arguments: qs, d's windows, the second windows' array, qh).
#define MM2R_Q4_PARAMS const uint8_t* qs, const __half* d, const __half* m
#define MM2R_Q4_ARGS qs, d, m, nullptr
#define MM2R_Q6_K_PARAMS const uint8_t* qs, const uint2* qh, const char2* sc, const __half* d
#define MM2R_Q6_K_ARGS qs, reinterpret_cast<const __half*>(sc), d, qh
#define FOR_EACH_FRAGMENT_Q4_TYPE(X)                \
    X(q4_0, Fq::Q4_0, MM2R_Q4_PARAMS, MM2R_Q4_ARGS) \
    X(q4_1, Fq::Q4_1, MM2R_Q4_PARAMS, MM2R_Q4_ARGS) \
    X(q4_k, Fq::Q4_K, MM2R_Q4_PARAMS, MM2R_Q4_ARGS)

#define FOR_EACH_MATMUL2R_TYPE(X) \
    FOR_EACH_FRAGMENT_Q4_TYPE(X)  \
    X(q6_k, Fq::Q6_K, MM2R_Q6_K_PARAMS, MM2R_Q6_K_ARGS)

// Blocks an SM each asks for (__launch_bounds__; the 4-bit types' as matmul2's). Q6_K's stages take 69-96 KiB (at
// most Q4_1's bm128, under sm_86/89/120's 99): a Hopper SM fits three at 16 and 64 rows, two at 32 and 128.
template <Fq Q, int TM>
constexpr int MM2R_BLOCKS = Q == Fq::Q6_K ? (TM == 16 || TM == 64 ? 3 : 2) : TM == 128 ? 2 : TM == 16 ? 4 : 3;

#define MATMUL2R_KERNELS(NAME, Q, PARAMS, WARGS)                                                                \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, MM2R_BLOCKS<Q, 128>)                              \
    matmul2r_##NAME##_bm128(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc, \
                            int mode, float* ws, int* counters) {                                               \
        INGOT_PDL_WAIT();                                                                                       \
        MM2R_RUN(128, Q, WARGS);                                                                                \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, MM2R_BLOCKS<Q, 64>)                               \
    matmul2r_##NAME##_bm64(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc,  \
                           int mode, float* ws, int* counters) {                                                \
        INGOT_PDL_WAIT();                                                                                       \
        MM2R_RUN(64, Q, WARGS);                                                                                 \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, MM2R_BLOCKS<Q, 32>)                               \
    matmul2r_##NAME##_bm32(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc,  \
                           int mode, float* ws, int* counters) {                                                \
        INGOT_PDL_WAIT();                                                                                       \
        MM2R_RUN(32, Q, WARGS);                                                                                 \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, MM2R_BLOCKS<Q, 16>)                               \
    matmul2r_##NAME##_bm16(PARAMS, const __half* A, const float* bias, float* C, int M, int N, int K, int ldc,  \
                           int mode, float* ws, int* counters) {                                                \
        INGOT_PDL_WAIT();                                                                                       \
        MM2R_RUN(16, Q, WARGS);                                                                                 \
    }
FOR_EACH_MATMUL2R_TYPE(MATMUL2R_KERNELS)
#undef MATMUL2R_KERNELS
#undef MM2R_RUN

// =====================================================================================================================
// matmul2w_<type>_bm128 (Q4_0, Q4_1, Q4_K; sm_90a only: Hopper's warpgroup MMA): matmul2r's product,
// tiling (TM tokens x 128 features a block, 256 threads), split-K and epilogue (mm2_store), with the multiply on
// wgmma instead of mma.sync. Why (cuda/PERF.md v23, ncu on the 8B's gate+up at 512 rows): matmul2r's warps each
// ldmatrix the whole A tile for 16 columns, so shared memory (L1 69% busy, 28% of its wavefronts excess) and not
// the tensor cores bound it at ~255 TFLOP/s; wgmma reads both operands from shared memory in the tensor cores' own
// access pattern, nothing through registers.
// Per stage (KB = 2 quantization blocks = 64 weights along K = one 128-byte row of fp16):
//   copies (cp.async, MATMUL2W_STAGES stages ahead): the A tile [TM][64] fp16 in the 128-byte swizzle (chunk j of
//   row r at chunk j ^ r%8: mma.cuh wgmma_desc_sw128), the quant bytes [128][48] and the scale windows [128][32] of
//   d (and m) as matmul2r copies them (Mm2rShape<128>: the same KB and window arithmetic);
//   dequantize: thread t makes block t%2 of weight row t/2 (deq_block_at: matmul2's fp16 values, bit for bit) into
//   the swizzled fp16 tile sB [128][64]; each thread then fences its shared-memory writes (and its landed copies)
//   to the async proxy, and a barrier passes them to the tensor cores;
//   multiply: four k16 wgmma a warpgroup (warps 4w..4w+3), then it waits: warpgroup w takes tokens 64w..64w+63 x
//   all 128 features (m64n128k16).
// One fp16 tile and two barriers a stage: the wgmma of one block overlaps the dequantization of another block
// sharing its SM (two an SM, 95 KiB of shared memory for Q4_0 and Q4_K, 107 KiB for Q4_1, 128 registers).
// Accumulators: warp w holds its 16 tokens (rows 16w + lane/4, + 8) x the 16 n8 tiles j as acc[0][j] = mma16816's
// layout, so mm2_store takes them as Mm2Warps<128, 8> (8 x 1 warps). 64-row tiles (warpgroups along N) were measured
// slower than matmul2t's at decode widths and removed (PERF.md v24). The sums inside a wgmma are not mma.sync's in
// order: results match matmul2r's to fp32 rounding, not bit for bit (tests/gpu test_gpu_kernels.py).
// Rows past M (A) and N (weights) and a slice's missing last block are zero-filled (cp.async src-size 0; the
// dequantization writes zeros for a missing block, whose stale scale bytes could be anything).
// =====================================================================================================================
template <int TM, Fq Q>
struct Mm2wShape {
    static constexpr int KB = Mm2rShape<128>::KB, QROW = Mm2rShape<128>::QROW, SROW = Mm2rShape<128>::SROW;
    static constexpr int A_BYTES = TM * 64 * 2;                        // [TM tokens][64] fp16
    static constexpr int Q_OFF = A_BYTES, S_OFF = Q_OFF + MM2_BN * QROW, M_OFF = S_OFF + MM2_BN * SROW;
    static constexpr int STAGE = M_OFF + (Q == Fq::Q4_1 ? MM2_BN * SROW : 0);   // a multiple of 1024: A tiles aligned
    static constexpr int B_BYTES = MM2_BN * 64 * 2;                    // [128 features][64] fp16
    static constexpr int SMEM = MATMUL2W_STAGES * STAGE + B_BYTES + 1024;   // + aligning the dynamic base
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int TM, Fq Q>
__device__ __forceinline__ void matmul2w(const uint8_t* __restrict__ qs, const __half* __restrict__ d,
                                         const __half* __restrict__ mn, const __half* __restrict__ A,
                                         const float* __restrict__ bias, float* __restrict__ C, int M, int N, int K,
                                         int ldc, int mode, float* __restrict__ ws, int* __restrict__ counters) {
    using Sh = Mm2wShape<TM, Q>;
    constexpr bool MIN = Q == Fq::Q4_1;
    constexpr int KB = Sh::KB, QROW = Sh::QROW, SROW = Sh::SROW, STAGE = Sh::STAGE;
    constexpr int STAGES = MATMUL2W_STAGES, AJ = TM * 8 / MM2_THREADS;
    static_assert(TM == 128, "a warpgroup's m is 64: two of them along M");
    static_assert(KB == 2 && STAGE % 1024 == 0 && MM2_THREADS == 256 && MM2_BN == 128 && QK == 32, "the layout");
    extern __shared__ __align__(16) unsigned char mm2_raw_smem[];
    require_dynamic_smem(Sh::SMEM);
    unsigned char* const base = mm2_raw_smem + ((1024 - (smem_addr(mm2_raw_smem) & 1023)) & 1023);
    unsigned char* const sB = base + STAGES * STAGE;
    const int tid = threadIdx.x, wg = tid / 128;
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * MM2_BN;
    const int nb = K / QK, per = (nb + gridDim.z - 1) / gridDim.z;
    const int kb0 = blockIdx.z * per, steps = max(0, min(nb, kb0 + per) - kb0);
    const int stages = (steps + KB - 1) / KB;

    // This thread's copies at stage 0 (a stage s adds s*KB blocks): quant block tid%2 of row tid/2, the scale
    // windows of that row (chunk tid%2), A chunks e = tid + 256 j: row e/8, chunk e%8 (block chunk/4) into the
    // swizzled chunk (e%8) ^ (row%8). 32-bit offsets as matmul2r (kernels.py matmul2r_serves).
    const int r = tid / 2, blk = tid % 2, n = n0 + r;
    const bool n_ok = n < N;
    const unsigned q_src = ((unsigned)(n_ok ? n : N - 1) * nb + blk) * 16;
    const uint8_t* q_base = qs + (long long)kb0 * 16;
    const long long s_elem = (long long)(n_ok ? n : N - 1) * nb + kb0;
    const __half* a_base = A + kb0 * QK;
    unsigned a_src[AJ];
    int a_dst[AJ], a_blk[AJ];
    bool a_ok[AJ];
#pragma unroll
    for (int j = 0; j < AJ; j++) {
        const int e = tid + j * MM2_THREADS, row = e / 8, ch = e % 8, mrow = m0 + row;
        a_ok[j] = mrow < M;
        a_blk[j] = ch / 4;
        a_src[j] = (unsigned)(a_ok[j] ? mrow : M - 1) * K + ch * 8;
        a_dst[j] = row * 128 + ((ch ^ (row & 7)) << 4);
    }
    auto scale_copy = [&](unsigned char* st, int region, const __half* src, int s, int valid) {
        mm2_scale_window(st, region, r * SROW, src, s_elem + s * KB, blk, valid, n_ok);
    };
    auto load_stage = [&](int s) {
        unsigned char* st = base + (s % STAGES) * STAGE;
        const int valid = min(KB, steps - s * KB);
        cp_async16(st + Sh::Q_OFF + r * QROW + blk * 16, q_base + q_src + s * KB * 16, n_ok && blk < valid);
        scale_copy(st, Sh::S_OFF, d, s, valid);
        if (MIN) scale_copy(st, Sh::M_OFF, mn, s, valid);
#pragma unroll
        for (int j = 0; j < AJ; j++)
            cp_async16(st + a_dst[j], a_base + a_src[j] + s * KB * QK, a_ok[j] && a_blk[j] < valid);
    };
    // The row's scale window offset at stage 0 (matmul2r's o0, for this thread's row).
    const int o0 = (int)(((reinterpret_cast<uintptr_t>(d) >> 1) + (unsigned)n * nb + kb0) & 7);
    auto dequant = [&](int s) {
        const unsigned char* st = base + (s % STAGES) * STAGE;
        uint32_t lo[2][4], hi[2][4];
        if (blk < min(KB, steps - s * KB)) {
            const uint4 q = *reinterpret_cast<const uint4*>(st + Sh::Q_OFF + r * QROW + blk * 16);
            const int o = ((o0 + s * KB) & 7) + blk;
            deq_block_at<Q>(q, st + Sh::S_OFF + r * SROW, st + Sh::M_OFF + r * SROW, o, lo, hi);
        } else {
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int i = 0; i < 4; i++) lo[h][i] = hi[h][i] = 0;
        }
        unsigned char* row = sB + r * 128;
#pragma unroll
        for (int h = 0; h < 2; h++) {   // weights 32 blk + 8h.. = chunk 4 blk + h; + 16 = chunk 4 blk + 2 + h
            *reinterpret_cast<uint4*>(row + (((4 * blk + h) ^ (r & 7)) << 4)) =
                make_uint4(lo[h][0], lo[h][1], lo[h][2], lo[h][3]);
            *reinterpret_cast<uint4*>(row + (((4 * blk + 2 + h) ^ (r & 7)) << 4)) =
                make_uint4(hi[h][0], hi[h][1], hi[h][2], hi[h][3]);
        }
    };

    float acc[1][MM2_BN / 8][4];
#pragma unroll
    for (int j = 0; j < MM2_BN / 8; j++) acc[0][j][0] = acc[0][j][1] = acc[0][j][2] = acc[0][j][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < stages) load_stage(s);
        cp_async_commit();
    }
    const unsigned long long db = wgmma_desc_sw128(sB);
    for (int s = 0; s < stages; s++) {
        cp_async_wait<STAGES - 2>();   // stage s landed (this thread's copies) ...
        __syncthreads();               // ... everyone's; every warpgroup's wgmma of stage s-1 is done (sB, buffers)
        if (s + STAGES - 1 < stages) load_stage(s + STAGES - 1);
        cp_async_commit();
        dequant(s);
        fence_proxy_async();   // this thread's sB stores and landed copies, to the tensor cores' proxy
        __syncthreads();
        const unsigned long long da = wgmma_desc_sw128(base + (s % STAGES) * STAGE + wg * 64 * 128);
        wgmma_pin(acc[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_m64n128k16(acc[0], da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_pin(acc[0]);
    }
    cp_async_wait<0>();
    INGOT_PDL_TRIGGER();
    mm2_store<TM, 8>(acc, bias, C, M, N, ldc, mode, ws, counters);   // warp w: tokens 16w.. x 128 features
}
#define MM2W_RUN(TM, Q) matmul2w<TM, Q>(qs, d, m, A, bias, C, M, N, K, ldc, mode, ws, counters)
#else
#define MM2W_RUN(TM, Q) __trap()   // not an sm_90a image: the host never launches it here (Kernels.matmul_wgmma)
#endif

// Each: grid (ceil(M/TM), ceil(N/128), split-K slices), MM2_THREADS threads, Kernels.matmul2w_smem(type, TM) bytes
// of dynamic shared memory (Mm2wShape::SMEM); arguments as matmul2r_<type>_bm<TM> (fragment_args).
#define MATMUL2W_KERNELS(NAME, Q, ...)                                                                            \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, 2)                                                 \
    matmul2w_##NAME##_bm128(const uint8_t* qs, const __half* d, const __half* m, const __half* A,               \
                            const float* bias, float* C, int M, int N, int K, int ldc, int mode, float* ws,      \
                            int* counters) {                                                                     \
        INGOT_PDL_WAIT();                                                                                        \
        MM2W_RUN(128, Q);                                                                                        \
    }
FOR_EACH_FRAGMENT_Q4_TYPE(MATMUL2W_KERNELS)
#undef MATMUL2W_KERNELS
#undef MM2W_RUN

// =====================================================================================================================
// matmul2t_<type>_bm<TM> (TM 32 and 64; Q4_0, Q4_1, Q4_K; sm_90a only): decode batches on wgmma with the roles turned
// around: the WEIGHTS are wgmma's A operand, dequantized straight into registers (matmul2r's deq_frag_at per weight
// row, two rows making mma16816's A fragment), and the tokens are its B operand, read by the tensor cores from
// shared memory: m64 x n<TM> x k16, so no fp16 weight tile is written and no barrier separates dequantization from
// the multiply. Same grid, tiles (TM tokens x 128 features a block), stages of KB blocks and split-K contract as
// matmul2r_<type>_bm<TM> (the scratch path only: no cluster sum here). Measured (cuda/PERF.md v24): a layer of the
// 8B's decode GEMMs at 64 rows 150 us (matmul2w's 64-row tile 175, matmul2r 200), at 32 rows 119 (matmul2r 129);
// at 16 rows and fewer it was slower than matmul2r, which keeps those.
// Warpgroup w (warps 4w..4w+3) owns features 64w..64w+63 of the block, warp 4w+i the 16 from 64w + 16i; lane (g, c)
// dequantizes rows 16i + g and + 8 of each block into the A fragments of its two k16 chunks.
// Per stage: copies (cp.async, MATMUL2T_STAGES stages ahead) of the quant bytes and scale windows (Mm2rShape<TM>'s
// layout) and of the tokens' [TM][32 KB] fp16 in 128-byte-swizzled regions of 64 along K; each thread fences its
// landed copies to the async proxy before the stage's barrier; then it dequantizes the stage's KB blocks into
// registers, its warpgroup issues 2 KB wgmma and waits for them before the registers are reused.
// Accumulators: thread (warp i of group w, lane g*4 + c) holds features 64w + 16i + g (+8) x tokens 8j + 2c (+1) as
// d[j][0..3]. Sums differ from matmul2r's in order only (fp32 rounding; tests/gpu test_gpu_kernels.py).
// =====================================================================================================================
template <int TM, Fq Q>
struct Mm2tShape {
    static constexpr int KB = Mm2rShape<TM>::KB, QROW = Mm2rShape<TM>::QROW, SROW = Mm2rShape<TM>::SROW;
    static constexpr int REGION = TM * 128;                            // tokens [TM][64] fp16, one 64-wide K slice
    static constexpr int B_BYTES = REGION * KB / 2;                   // the tokens' regions first, then matmul2r's
    static constexpr int Q_OFF = B_BYTES, S_OFF = Q_OFF + MM2_BN * QROW, M_OFF = S_OFF + MM2_BN * SROW;
    static constexpr int STAGE = M_OFF + (Q == Fq::Q4_1 ? MM2_BN * SROW : 0);   // a multiple of 1024: aligned
    static constexpr int SMEM = MATMUL2T_STAGES * STAGE + 1024;       // + aligning the dynamic base
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int TM>
__device__ __forceinline__ void wgmma_rs(float (&d)[TM / 8][4], const uint32_t (&a)[4], unsigned long long db) {
    static_assert(TM == 32 || TM == 64, "matmul2t's heights");
    if constexpr (TM == 32) wgmma_rs_m64n32k16(d, a, db);
    else wgmma_rs_m64n64k16(d, a, db);
}

template <int TM, Fq Q>
__device__ __forceinline__ void matmul2t(const uint8_t* __restrict__ qs, const __half* __restrict__ d,
                                         const __half* __restrict__ mn, const __half* __restrict__ A,
                                         const float* __restrict__ bias, float* __restrict__ C, int M, int N, int K,
                                         int ldc, int mode, float* __restrict__ ws, int* __restrict__ counters) {
    using Sh = Mm2tShape<TM, Q>;
    constexpr bool MIN = Q == Fq::Q4_1;
    constexpr int KB = Sh::KB, QROW = Sh::QROW, SROW = Sh::SROW, STAGE = Sh::STAGE, STAGES = MATMUL2T_STAGES;
    constexpr int NJ = TM / 8;   // n8 column groups of the accumulators
    static_assert(STAGE % 1024 == 0 && Sh::REGION % 1024 == 0 && MM2_THREADS == 256 && MM2_BN == 128, "layout");
    extern __shared__ __align__(16) unsigned char mm2_raw_smem[];
    require_dynamic_smem(Sh::SMEM);
    unsigned char* const base = mm2_raw_smem + ((1024 - (smem_addr(mm2_raw_smem) & 1023)) & 1023);
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, g = lane / 4, c = lane % 4;
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * MM2_BN;
    const int nb = K / QK, per = (nb + gridDim.z - 1) / gridDim.z;
    const int kb0 = blockIdx.z * per, steps = max(0, min(nb, kb0 + per) - kb0);
    const int stages = (steps + KB - 1) / KB;

    // Copies, as matmul2r's: quant chunks e = tid + j*THREADS -> row e/KB, block e%KB; scale windows of row tid/2
    // (chunk tid%2); token chunks e -> row e/(4 KB), 16-byte chunk ch = e%(4 KB) (block ch/4) into region ch/8 at
    // the swizzled chunk (ch%8) ^ (row%8). Rows past N or M: zero-filled from a clamped, valid address; token blocks
    // past a slice's last one zero-filled too (src-size 0: their address is never read), though their wgmma is skipped.
    constexpr int QJ = (MM2_BN * KB + MM2_THREADS - 1) / MM2_THREADS;
    constexpr int AJ = (TM * 4 * KB + MM2_THREADS - 1) / MM2_THREADS;
    const uint8_t* q_base = qs + (long long)kb0 * 16;
    unsigned q_src[QJ];
    int q_dst[QJ], q_blk[QJ];
    bool q_ok[QJ];
    mm2_quant_copies<KB, QROW>(tid, n0, N, nb, Sh::Q_OFF, q_src, q_dst, q_blk, q_ok);
    const int s_row = tid / 2, s_chunk = tid % 2, s_n = n0 + s_row;
    const long long s_elem = (long long)(s_n < N ? s_n : N - 1) * nb + kb0;
    const __half* a_base = A + kb0 * QK;
    unsigned a_src[AJ];
    int a_dst[AJ], a_blk[AJ];
    bool a_ok[AJ];
#pragma unroll
    for (int j = 0; j < AJ; j++) {
        const int e = tid + j * MM2_THREADS, row = e / (4 * KB), ch = e % (4 * KB), mrow = m0 + row;
        a_blk[j] = e < TM * 4 * KB ? ch / 4 : KB;
        a_ok[j] = mrow < M;
        a_src[j] = (unsigned)(mrow < M ? mrow : M - 1) * K + ch * 8;
        a_dst[j] = (ch / 8) * Sh::REGION + (row % TM) * 128 + (((ch % 8) ^ (row & 7)) << 4);
    }
    auto scale_copy = [&](unsigned char* st, int region, const __half* src, int s, int valid) {
        mm2_scale_window(st, region, s_row * SROW, src, s_elem + s * KB, s_chunk, valid, s_n < N);
    };
    auto load_stage = [&](int s) {
        unsigned char* st = base + (s % STAGES) * STAGE;
        const int valid = min(KB, steps - s * KB);
#pragma unroll
        for (int j = 0; j < QJ; j++)
            if (q_blk[j] < valid) cp_async16(st + q_dst[j], q_base + q_src[j] + s * KB * 16, q_ok[j]);
        scale_copy(st, Sh::S_OFF, d, s, valid);
        if (MIN) scale_copy(st, Sh::M_OFF, mn, s, valid);
#pragma unroll
        for (int j = 0; j < AJ; j++)
            if (a_blk[j] < KB) cp_async16(st + a_dst[j], a_base + a_src[j] + s * KB * QK, a_ok[j] && a_blk[j] < valid);
    };

    // The lane's weight rows f = 16 warp + g and f + 8 (warp = 4w + i: features 64w + 16i..), their scale windows'
    // offset at stage 0 (the same for both rows: 8 rows further is 8 nb elements further).
    const int f = warp * 16 + g;
    const int o0 = (int)(((reinterpret_cast<uintptr_t>(d) >> 1) + (unsigned)(n0 + f) * nb + kb0) & 7);
    const int q_lane = f * QROW + 4 * (c >> 1), s_lane = f * SROW;

    float acc[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < stages) load_stage(s);
        cp_async_commit();
    }
    for (int s = 0; s < stages; s++) {
        cp_async_wait<STAGES - 2>();   // stage s landed (this thread's copies) ...
        fence_proxy_async();           // ... visible to the tensor cores' proxy once the barrier has passed
        __syncthreads();               // everyone's; every warpgroup's wgmma of stage s-1 done (buffer free)
        if (s + STAGES - 1 < stages) load_stage(s + STAGES - 1);
        cp_async_commit();
        const unsigned char* st = base + (s % STAGES) * STAGE;
        const int valid = min(KB, steps - s * KB);
        uint32_t a[KB][2][4];   // block kk, chunk ks: the A fragment of rows f, f + 8
#pragma unroll
        for (int kk = 0; kk < KB; kk++) {
            const int o = ((o0 + s * KB) & 7) + kk;
            uint32_t b[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++) {   // row f + 8h
                deq_frag_at<Q>(st + Sh::Q_OFF + q_lane + h * 8 * QROW + kk * 16, st + Sh::S_OFF + s_lane + h * 8 * SROW,
                               st + Sh::M_OFF + s_lane + h * 8 * SROW, o, c, b[h]);
            }
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                a[kk][ks][0] = b[0][2 * ks];       // row g, k 2c..
                a[kk][ks][1] = b[1][2 * ks];       // row g + 8
                a[kk][ks][2] = b[0][2 * ks + 1];   // row g, k 2c + 8..
                a[kk][ks][3] = b[1][2 * ks + 1];
            }
        }
        wgmma_pin(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KB; kk++) {
            if (kk >= valid) break;
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                const int k = kk * 32 + ks * 16;   // along the stage's K: region k/64, 32 bytes a k16 slice
                const unsigned long long db = wgmma_desc_sw128(st + (k / 64) * Sh::REGION) + ((k % 64) * 2 >> 4);
                wgmma_rs<TM>(acc, a[kk][ks], db);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_pin(acc);
#pragma unroll
        for (int kk = 0; kk < KB; kk++)
#pragma unroll
            for (int ks = 0; ks < 2; ks++) wgmma_pin_regs(a[kk][ks]);
    }
    cp_async_wait<0>();
    INGOT_PDL_TRIGGER();

    // Split-K: the slices summed through ws by the tile's last block (mm2_store's scratch path).
    if (gridDim.z > 1 && !mm2_scratch_sum<TM>(acc, ws, counters)) return;
    // Epilogue: element e of group j is feature n0 + f + 8*(e/2), token m0 + 8j + 2c + e%2.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int gc = n0 + f + 8 * h;
        if (gc >= N) continue;
        const float bv = bias ? bias[gc] : 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                const int gr = m0 + 8 * j + 2 * c + e2;
                if (gr >= M) continue;
                float* out = C + (long long)gr * ldc + gc;
                const float v = acc[j][2 * h + e2] + bv;
                *out = mode == MODE_ADD ? *out + v : v;
            }
    }
}
#define MM2T_RUN(TM, Q) matmul2t<TM, Q>(qs, d, m, A, bias, C, M, N, K, ldc, mode, ws, counters)
#else
#define MM2T_RUN(TM, Q) __trap()   // not an sm_90a image: the host never launches it here (Kernels.matmul_wgmma)
#endif

// Each: grid (ceil(M/TM), ceil(N/128), split-K slices), MM2_THREADS threads, Kernels.matmul2t_smem(type, TM) bytes of
// dynamic shared memory (Mm2tShape::SMEM); arguments as matmul2r_<type>_bm<TM> (ws and counters needed when split).
// __launch_bounds__(256, 3) caps registers for three blocks an SM (76-80 used); shared memory admits three for the
// 64-row tiles of Q4_0 and Q4_K (73 KiB) and two for the others (81-97 KiB). Q4_K's 32-row tile asks for two: its
// header decoding spilled 40 bytes at three's 80 registers, and its shared memory holds it to two anyway. Its 64-row
// tile spills 12 bytes at three (kept: measured in cuda/PERF.md v25 as it is).
template <Fq Q>
constexpr int MM2T_BLOCKS_BM32 = Q == Fq::Q4_K ? 2 : 3;
#define MATMUL2T_KERNELS(NAME, Q, ...)                                                                            \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, 3)                                                \
    matmul2t_##NAME##_bm64(const uint8_t* qs, const __half* d, const __half* m, const __half* A,                \
                           const float* bias, float* C, int M, int N, int K, int ldc, int mode, float* ws,      \
                           int* counters) {                                                                     \
        INGOT_PDL_WAIT();                                                                                       \
        MM2T_RUN(64, Q);                                                                                        \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MM2_THREADS, MM2T_BLOCKS_BM32<Q>)                              \
    matmul2t_##NAME##_bm32(const uint8_t* qs, const __half* d, const __half* m, const __half* A,                \
                           const float* bias, float* C, int M, int N, int K, int ldc, int mode, float* ws,      \
                           int* counters) {                                                                     \
        INGOT_PDL_WAIT();                                                                                       \
        MM2T_RUN(32, Q);                                                                                        \
    }
FOR_EACH_FRAGMENT_Q4_TYPE(MATMUL2T_KERNELS)
#undef MATMUL2T_KERNELS
#undef MM2T_RUN
