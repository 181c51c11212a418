// Host shim: compiles the per-thread device code of cuda/*.cu as plain C++ (nvcc -x c++), one "thread" at a
// time, for tests/test_kernel_host.py. Only what that code uses: the built-in indices as globals, the
// intrinsics as their IEEE meaning (volatile keeps the host compiler from contracting a product into an fma,
// as the _rn intrinsics keep nvcc), a warp of one lane.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> 8 * i) * (int)(int8_t)(b >> 8 * i);
    return c;
}
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
static inline void __syncthreads() {}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // byte n = byte (s >> 4n) & 7 of (y:x)
    const uint64_t v = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int n = 0; n < 4; n++) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
#undef __global__
#define __global__
#define __launch_bounds__(x)
// fma.rn.f16x2: one rounding. In double the product of two fp16 values is exact and so is the sum for the ranges
// the tests use (fp16 exponents), so this is the device's result.
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
    const float2 fa = __half22float2(a), fb = __half22float2(b), fc = __half22float2(c);
    return __halves2half2(__double2half((double)fa.x * fb.x + fc.x), __double2half((double)fa.y * fb.y + fc.y));
}
