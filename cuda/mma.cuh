// The sm_80 tensor-core and async-copy instructions as inline functions, for the kernels that stage tiles in
// shared memory and multiply them with mma.sync (attention_prefill.cu, matmul.cu's matmul2_*), and the integer mma
// of the narrow decode matvec (matvec.cu's matvec_<type>_mma). Compute
// capability 8.0 and newer only: outside that the file defines nothing (sm_75 keeps those kernels' other paths).
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 (.cg: L2 only, streamed operands) or 4 (.ca: the only sizes below 16 are .ca) bytes global -> shared,
// asynchronously; read false writes zeros (src-size 0: src is not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool read) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(read ? 16 : 0));
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
