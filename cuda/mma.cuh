// The sm_80 tensor-core and async-copy instructions as inline functions, for the kernels that stage tiles in
// shared memory and multiply them with mma.sync (attention_prefill.cu, matmul.cu's matmul2_*), and the integer mma
// of the narrow decode matvec (matvec.cu's matvec_<type>_mma). Compute
// capability 8.0 and newer only: outside that the file defines nothing (sm_75 keeps those kernels' other paths).
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// A kernel whose shared-memory layout needs `bytes` of dynamic shared memory (the pipelined kernels that include
// this file) traps when launched with less: it would overrun it otherwise (the host computes the same sizes:
// kernels.py *_smem).
__device__ __forceinline__ void require_dynamic_smem(unsigned bytes) {
    unsigned have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < bytes) __trap();
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Bulk asynchronous copies into shared memory (sm_90+: cp.async.bulk, the TMA unit's one-dimensional form) and
// the mbarriers that count their bytes. A copy moves `bytes` (a multiple of 16, both addresses 16-byte aligned)
// and completes them on `bar`; the consumer waits for the barrier's phase to flip. One thread arms a barrier
// (mbar_expect: its arrival plus the bytes to come), so barriers are initialized with a count of 1.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
// After initializing barriers, before any thread or copy uses them.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned phase) {
    asm volatile(
        "{\n .reg .pred done;\n wait_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(phase)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
#endif

// 16 (.cg: L2 only, streamed operands), 8 or 4 (.ca: the only sizes below 16 are .ca) bytes global -> shared,
// asynchronously; read false writes zeros (src-size 0: src is not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool read) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(read ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool read) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(read ? 8 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool read) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(read ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8x8 b16 matrices; lane l gives the row address of matrix l/8, register i receives matrix i.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// d[16x8 fp32] += a[16x16 fp16, row] * b[16x8 fp16, col]. Fragments (g = lane/4, c = lane%4):
//   a0 (row g, k 2c..2c+1), a1 (row g+8, k 2c..), a2 (row g, k 2c+8..), a3 (row g+8, k 2c+8..);
//   b0 (k 2c..2c+1, col g), b1 (k 2c+8.., col g);  d0,d1 (row g, cols 2c, 2c+1), d2,d3 (row g+8, same cols).
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d[16x8 s32] = a[16x32 u8, row] * b[32x8 s8, col] (integer, exact). Fragments (g = lane/4, c = lane%4), 4 bytes a
// register, byte i of a register at k + i:
//   a0 (row g, k 4c..4c+3), a1 (row g+8, k 4c..), a2 (row g, k 16+4c..), a3 (row g+8, k 16+4c..);
//   b0 (k 4c..4c+3, col g), b1 (k 16+4c.., col g);  d0,d1 (row g, cols 2c, 2c+1), d2,d3 (row g+8, same cols).
__device__ __forceinline__ void mma_u8s8(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

#endif

// Hopper's warpgroup MMA (wgmma, sm_90a only: arch-specific, so these exist only in an sm_90a image; matmul.cu's
// matmul2w_* and matmul2t_* are their users). A warpgroup (4 consecutive warps, 128 threads) multiplies a 64 x 16 fp16
// tile of A by a 16 x N tile of B (N = 128: both read by the tensor cores straight from shared memory through 64-bit
// matrix descriptors; N = 32, 64: A from the threads' registers, below) into 64 x N fp32 accumulators, N/2 a thread:
// thread (warp w of the group, lane g*4 + c) holds rows 16w + g and 16w + g + 8 of columns 8j + 2c, 8j + 2c + 1 as
// d[j][0..3] (mma16816's d layout per n8 tile j).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The descriptor of a K-major tile in the 128-byte swizzle (rows of 64 fp16 = 128 bytes, 8-row groups 1024 bytes
// apart; 16-byte chunk j of row r stored at chunk j ^ (r % 8)), from a 1024-byte-aligned row 0: bits 0-13 the
// address / 16, 16-29 the leading byte offset / 16 (unused by swizzled K-major layouts: 1), 32-45 the stride byte
// offset / 16 (1024: the next 8 rows), 62-63 the swizzle (1: 128 bytes). The k-th 16-wide slice of the row is the
// same descriptor 32*k bytes further (+2k): the swizzle applies to the address bits, so the offset composes.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* tile) {
    const unsigned long long a = smem_addr(tile);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
// Every thread's prior register writes of d (and shared-memory writes made visible by a barrier) ordered before
// the warpgroup's next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// This thread's generic-proxy writes of shared memory (st.shared, landed cp.async) made visible to the async proxy
// that wgmma reads through: each writer runs it before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The accumulators pinned at this point of the program: the compiler sees wgmma write d only where it is issued,
// so reads after wgmma_wait (and writes before a wgmma) go through this empty asm, which it cannot move across.
template <int NJ>
__device__ __forceinline__ void wgmma_pin(float (&d)[NJ][4]) {
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[j][e])::"memory");
}
// d[64 x 128 fp32] += A[64 x 16 fp16, K-major] * B[16 x 128 fp16, K-major (B's rows are output columns)].
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[16][4], unsigned long long da, unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db));
}
// d[64 x N fp32] += A[64 x 16 fp16, from registers] * B[16 x N fp16, K-major in shared memory] (matmul2t_*): warp w
// of the group gives rows 16w.. of A as mma16816's A fragment (a0 row g, k 2c..; a1 row g+8; a2 row g, k 2c+8..;
// a3 row g+8, k 2c+8..). The registers must keep their values until the wgmma has completed (wgmma_wait): the
// caller pins them (wgmma_pin_regs) after the wait, so the compiler cannot reuse them while the tensor cores read.
template <int R>
__device__ __forceinline__ void wgmma_pin_regs(uint32_t (&a)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+r"(a[i])::"memory");
}
__device__ __forceinline__ void wgmma_rs_m64n32k16(float (&d)[4][4], const uint32_t (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, 1, 1, 1, 0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[8][4], const uint32_t (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#endif
