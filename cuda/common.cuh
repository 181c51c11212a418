// Shared device helpers for Ingot's kernels: weight layouts, warp/block reductions, q8x2 activations.
//
// Weight layout on the GPU ("soa-v2"): GGUF stores quantized rows as arrays of blocks (scales, quants)
// whose 18-, 22-, 144- or 210-byte sizes defeat 16-byte loads. At load time every quantized matrix [rows, cols]
// is repacked (repack.cu) into separate arrays, each row contiguous, every array indexed by the 32-weight block
// b = row * cols/32 + kb (or its super-block b/8 for the K-quants' 256-weight d/dmin). The bits stay packed
// (bytes per weight as in the GGUF, within 4%); the kernels unpack them in registers (weights.cuh).
//   F16:  w   f16 [rows, cols]
//   Q8_0: qs  i8  [rows, cols], d f16 [rows, cols/32]
//   Q4_0: qs  u8  [rows, cols/2]   ("nibble order": byte j of a block = w[j] | w[j+16] << 4, as GGUF's Q4_0)
//         d   f16 [rows, cols/32]                                                       w = d*(q-8)
//   Q4_1: qs as Q4_0, d f16 [rows, cols/32], m f16 [rows, cols/32]                     w = d*q + m
//   Q5_0: qs as Q4_0 (low 4 bits), qh u32 [rows, cols/32] (the fifth bits, "bit order" below), d f16 [.., cols/32]
//                                                                                       w = d*(q-16)
//   Q5_1: as Q5_0 plus m f16 [rows, cols/32]                                            w = d*q + m
//   Q4_K: qs as Q4_0 (each 32-weight sub-block on its own), sc u8 [rows, cols/256, 16] = GGUF's super-block
//         header as it is: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (get_scale_min_k4)
//                                                                                       w = (d*sc)*q - (dmin*m)
//   Q5_K: as Q4_K plus qh u32 [rows, cols/32] (bit order)
//   Q6_K: qs as Q4_0 (low 4 bits), qh u32 [rows, cols/32, 2] (two high bits, "crumb order": word 0 for weights
//         0..15, word 1 for 16..31), sc i8 [rows, cols/16] (one per 16 weights), d f16 [rows, cols/256]
//                                                                                       w = (d*sc)*(q-32)
//   Q3_K: qs u32 [rows, cols/32, 2] (two low bits, crumb order), qh u32 [rows, cols/32] (third bit, bit order:
//         set = GGUF's hmask bit), sc i8 [rows, cols/16] (the 6-bit scale minus 32), d f16 [rows, cols/256]
//                                                                                       w = (d*sc)*(q-4)
//   Q2_K: qs u32 [rows, cols/32, 2] (crumb order), sc u8 [rows, cols/16] (scale | min << 4, as GGUF),
//         d f16 [rows, cols/256], m f16 [rows, cols/256] (dmin)                         w = (d*sc)*q - (dmin*m)
//   IQ4_NL: qs as Q4_0 (4-bit codebook indices), d f16 [rows, cols/32]                w = d*kv[q]
//   IQ4_XS: qs as Q4_0, sc i8 [rows, cols/32] (the 6-bit scale minus 32), d f16 [rows, cols/256]
//                                                                                       w = (d*sc)*kv[q]
// Bit order (one bit per weight, u32 H per 32 weights): bit k of byte b of H belongs to weight 4k+b, so the
// bits of weights 4k..4k+3 are (H >> k) & 0x01010101, one per byte. Crumb order (two bits per weight, u32 P
// per 16 weights): bits 2k..2k+1 of byte b belong to weight 4k+b. Both put a 4-weight word's bits one shift
// and mask away, next to the nibble word they extend.
// The K-quants keep d/dmin in f16 and the sub-block scales as small integers: every product is formed in fp32
// as gguf forms it ((d*sc) rounded to fp32, then *q), so each weight's fp32 value equals gguf's dequantization.
// K-quant and IQ4_XS matrices need cols % 256 == 0 (GGUF's super-block), the others cols % 32 == 0.
// Activations that feed quantized matrices are quantized per 32 values to "q8x2" (see warp_quantize_q8x2):
//   xq i8 [n, 2*cols] (per block: 32 coarse then 32 fine int8), xd float4 [n, cols/32] = (d1, d2, s, s_lo)
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include "constants.cuh"   // QK, PAGE, epilogue modes, block shapes: shared with the host (runtime/gpu/constants.py)

#define WARP 32

// Programmatic dependent launch (PDL, sm_90+). The host may launch a kernel that starts with this macro with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (runtime/gpu/kernels.py PDL_KERNELS; a CUDA graph
// captures it as a programmatic edge): its blocks are then scheduled while the previous kernel in the stream
// is still running, so launch latency and block ramp-up overlap the predecessor's tail instead of following it.
//   griddepcontrol.wait              blocks until the previous grid has completed and its writes are visible;
//                                    a no-op when the kernel was launched without the attribute.
//   griddepcontrol.launch_dependents lets the next kernel's blocks be scheduled (they wait in turn, so at most
//                                    one kernel runs ahead; until every block of this grid has issued it, or
//                                    exited, the next grid does not start).
// It must be the kernel's FIRST statement, executed by every thread of every block, before any early return
// and any global memory access: a block that exited without waiting would let the next grid complete, and so
// its successors start, before this grid's predecessor has finished (the chain is only transitive if every
// kernel waits), and a write before the wait could race with the predecessor still reading that buffer. The
// "memory" clobber keeps the compiler from hoisting loads above it. Below sm_90 it is empty (the host never
// sets the attribute there).
//
// Two refinements for the weight-streaming kernels (matvec.cu, matmul.cu):
//   INGOT_PDL_WAIT_AFTER(cond, prefetch)  the first statement instead: `if (cond) prefetch;` then the wait, where
//                                         prefetch only issues prefetch_l2 of weights. Weights are written once at
//                                         load time, never by a kernel of a step, so nothing races, and a
//                                         prefetch neither returns data nor can fault the block out early.
//   INGOT_PDL_WAIT() ... INGOT_PDL_TRIGGER()  the wait first, the trigger later (after the main loop). A trigger
//                                         at entry lets the next grid launch as soon as this one's blocks have
//                                         all started; its blocks then take the SM slots that free up first, and
//                                         may sit several to an SM while others stay empty: a grid that fills
//                                         one partial wave (an 8B down matvec: 512 blocks for 1,056 slots) would
//                                         run on part of the GPU (cuda/PERF.md v10: why PDL measured slower on
//                                         the 8B). Triggered after the main loop, the next grid launches while
//                                         this one writes its results, when most slots are free.
//                                         A block that exits without triggering counts as triggered.
//   INGOT_PDL_READ_AHEAD()                the first statement instead, declaring that the kernel READS (loads
//                                         only: no store, atomic or return) before its INGOT_PDL_ENTRY what no
//                                         kernel of a step writes: weights, the step's host-uploaded inputs
//                                         (positions, block tables) and KV-cache rows of earlier steps. Their
//                                         round trips then overlap the previous kernel's tail (norm.cu,
//                                         attention_decode.cu; matvec.cu's b1s asks for its first weights by bulk
//                                         copies into shared memory, then waits with INGOT_PDL_WAIT). It expands to
//                                         nothing; tests/test_pdl.py lets these kernels' PTX load, and only load,
//                                         before the wait.
#define INGOT_PDL_READ_AHEAD() ((void)0)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define INGOT_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define INGOT_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define INGOT_PDL_WAIT() ((void)0)
#define INGOT_PDL_TRIGGER() ((void)0)
#endif
#define INGOT_PDL_ENTRY() \
    do {                  \
        INGOT_PDL_WAIT(); \
        INGOT_PDL_TRIGGER(); \
    } while (0)
#define INGOT_PDL_WAIT_AFTER(cond, prefetch) \
    do {                                     \
        if (cond) prefetch;                  \
        INGOT_PDL_WAIT();                    \
    } while (0)

// Bring the line holding p into L2 without waiting for it (prefetch.global.L2: no register, no fault).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
template <typename... P>
__device__ __forceinline__ void prefetch_l2(const P*... p) {
    (prefetch_l2(static_cast<const void*>(p)), ...);
}

// Nibble j of a Q4 block (GGUF order): byte j holds w[j] (low) and w[j + 16] (high).
__device__ __forceinline__ int q4_nibble(const uint8_t* qs, int j) {
    return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds blockDim.x/32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nwarps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// Quantize 32 consecutive values held one per lane of a warp to q8x2: two int8 levels per value,
// v ~= d1*q1 + d2*q2 with d1 = amax/127, d2 = d1/254 (the second level quantizes the first level's rounding
// error, so the pair carries ~15 bits: integer dot products stay exact and the result matches float
// activations to ~1e-5). Block layout: xq[0..31] = q1, xq[32..63] = q2; xd = (d1, d2, s, s_lo) with
// s = d1*sum(q1) + d2*sum(q2) over the block and s_lo the same over values 0..15 (the K-quants with 16-weight
// sub-blocks subtract an offset or min per half).
// The reciprocals are correctly rounded (__frcp_rn): q1 may differ from round(v/d1) only at an exact .5 tie,
// which leaves |v - q1*d1| <= d1/2 (plus one rounding), still inside the fine level's +-127 range.
struct Q8x2 {                                     // one lane's share of a q8x2 block: its two levels, the block's scales
    float q1, q2, d1, d2, s, s_lo;
};
__device__ __forceinline__ Q8x2 warp_q8x2(float v) {
    const float amax = warp_max(fabsf(v));
    const float d1 = amax / 127.0f, d2 = d1 / 254.0f;
    float q1 = 0.0f, q2 = 0.0f;
    if (amax > 0.0f) {
        q1 = rintf(v * __frcp_rn(d1));
        q2 = fminf(fmaxf(rintf(fmaf(-q1, d1, v) * __frcp_rn(d2)), -127.0f), 127.0f);
    }
    // Sums of small integers: exact in fp32 in any order. Half sums first (lanes 0..15 and 16..31), then the total.
    float a = q1, b = q2;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) { a += __shfl_xor_sync(0xffffffff, a, o); b += __shfl_xor_sync(0xffffffff, b, o); }
    const float s_lo = d1 * a + d2 * b;
    a += __shfl_xor_sync(0xffffffff, a, 16);
    b += __shfl_xor_sync(0xffffffff, b, 16);
    return {q1, q2, d1, d2, d1 * a + d2 * b, s_lo};
}
__device__ __forceinline__ void store_q8x2(const Q8x2& c, int8_t* xq, float4* xd) {
    const int lane = threadIdx.x % WARP;
    xq[lane] = (int8_t)c.q1;
    xq[WARP + lane] = (int8_t)c.q2;
    if (lane == 0) *xd = make_float4(c.d1, c.d2, c.s, c.s_lo);
}
// (Split in two so a caller can quantize two warps' worth at once: the second's shuffles fill the first's waits.)
__device__ __forceinline__ void warp_quantize_q8x2(float v, int8_t* xq, float4* xd) {
    store_q8x2(warp_q8x2(v), xq, xd);
}
