// Matrix-matrix products for prefill: C[M, N] = A[M, K] · W[N, K]^T, A fp16 (token activations), W in the
// soa-v2 layout of common.cuh, C fp32. Prefill multiplies many tokens by each weight, so it is arithmetic-bound:
// weights are dequantized to fp16 in shared memory and multiplied on the tensor cores (WMMA 16x16x16, fp32
// accumulation; available on every arch we build, sm_75+).
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
