// cuda_on_cpu.h: the CUDA C++ device dialect our kernels use, for the host C++ compiler.
//
// The simulated driver (tools/sim/driver/modules.cc) compiles the exact program text NVRTC compiled with
// `g++ -std=c++17 -ffp-contract=off -include cuda_on_cpu.h` into a shared library and runs
// each kernel's threads as fibers of libcudasim_rt.so (tools/sim/runtime.cc): the built-in
// variables are per simulated thread, __syncthreads and the warp collectives are real
// rendezvous among the block's threads, __shared__ memory is per block, atomics are atomic,
// and __half rounds to nearest even exactly like the GPU. See docs/simulator.md.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// ------------------------------------------------------------------ vector types
struct uint3 { unsigned int x, y, z; };
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return uint4{x, y, z, w};
}
static inline int2 make_int2(int x, int y) { return int2{x, y}; }
static inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }

// ------------------------------------------------------------------ the runtime's interface
extern "C" {
// The calling simulated thread's indices; set by the runtime before each fiber runs.
extern thread_local uint3 cudasim_thread_idx;
extern thread_local uint3 cudasim_block_idx;
extern thread_local dim3 cudasim_block_dim;
extern thread_local dim3 cudasim_grid_dim;
void cudasim_syncthreads(void);
// A warp collective: op (see CUDASIM_WARP_*), the lane mask, this lane's value and argument;
// returns the lane's result once every lane of `mask` has arrived with the same mask.
uint64_t cudasim_warp(int op, unsigned mask, uint64_t value, int arg, int width);
void* cudasim_dynamic_shared(void);
void cudasim_trap(const char* what);
}

#define threadIdx cudasim_thread_idx
#define blockIdx cudasim_block_idx
#define blockDim cudasim_block_dim
#define gridDim cudasim_grid_dim
constexpr int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Per-block shared memory: a block's fibers all run on one OS thread, one block at a time.
#define __shared__ static thread_local
#define __constant__ static

static inline void __syncthreads() { cudasim_syncthreads(); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ------------------------------------------------------------------ warp collectives
enum {
  CUDASIM_WARP_SYNC = 0,
  CUDASIM_WARP_SHFL = 1,
  CUDASIM_WARP_UP = 2,
  CUDASIM_WARP_DOWN = 3,
  CUDASIM_WARP_XOR = 4,
  CUDASIM_WARP_BALLOT = 5,
};

template <class T>
static inline uint64_t cudasim_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp collectives move at most 8 bytes");
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
static inline T cudasim_from_bits(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}
template <class T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = warpSize) {
  return cudasim_from_bits<T>(cudasim_warp(CUDASIM_WARP_SHFL, mask, cudasim_bits(v), src, width));
}
template <class T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = warpSize) {
  return cudasim_from_bits<T>(cudasim_warp(CUDASIM_WARP_UP, mask, cudasim_bits(v), (int)d, width));
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = warpSize) {
  return cudasim_from_bits<T>(
      cudasim_warp(CUDASIM_WARP_DOWN, mask, cudasim_bits(v), (int)d, width));
}
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
  return cudasim_from_bits<T>(
      cudasim_warp(CUDASIM_WARP_XOR, mask, cudasim_bits(v), lane_mask, width));
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)cudasim_warp(CUDASIM_WARP_BALLOT, mask, pred != 0, 0, warpSize);
}
static inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static inline int __all_sync(unsigned mask, int pred) {
  return __ballot_sync(mask, pred) == mask;
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  (void)cudasim_warp(CUDASIM_WARP_SYNC, mask, 0, 0, warpSize);
}

// ------------------------------------------------------------------ atomics (device-wide)
template <class T>
static inline T cudasim_atomic_fetch_add(T* p, T v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline int atomicAdd(int* p, int v) { return cudasim_atomic_fetch_add(p, v); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return cudasim_atomic_fetch_add(p, v); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return cudasim_atomic_fetch_add(p, v);
}
// Float atomics: a compare-and-swap loop, each addition rounded once like the GPU's.
static inline float atomicAdd(float* p, float v) {
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    float f;
    memcpy(&f, &old, 4);
    const float n = f + v;
    uint32_t nb;
    memcpy(&nb, &n, 4);
    if (__atomic_compare_exchange_n(u, &old, nb, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      return f;
  }
}
static inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
static inline unsigned atomicOr(unsigned* p, unsigned v) {
  return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}
static inline unsigned atomicAnd(unsigned* p, unsigned v) {
  return __atomic_fetch_and(p, v, __ATOMIC_RELAXED);
}
static inline int atomicMax(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
  }
  return old;
}
static inline unsigned atomicMax(unsigned* p, unsigned v) {
  unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
  }
  return old;
}
static inline int atomicCAS(int* p, int cmp, int v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;
}
static inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;
}
static inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
static inline unsigned atomicExch(unsigned* p, unsigned v) {
  return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}

// ------------------------------------------------------------------ float intrinsics
// Built with -ffp-contract=off and SSE arithmetic: each operation is one IEEE binary32
// operation rounded to nearest even, no flush to zero (NVRTC's --ftz=false --prec-div=true
// --prec-sqrt=true --fmad=false).
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
// __expf and __logf: glibc's own (the same functions as expf, logf).
static inline float __saturatef(float a) { return a > 1.0f ? 1.0f : (a > 0.0f ? a : 0.0f); }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline void __trap() { cudasim_trap("__trap()"); }

// ------------------------------------------------------------------ __half
// IEEE binary16 in a struct (so no implicit conversion hides a rounding), as cuda_fp16.h.
struct __half {
  unsigned short __x;
};
struct alignas(4) __half2 {
  __half x, y;
};
typedef __half half;
typedef __half2 half2;

// Round |value| = m * 2^e2 (m > 0, at most 64 bits) to binary16 bits, nearest even: the
// result counts quanta of 2^q, where q = max(E - 10, -24) for E = floor(log2 value); the
// encoding ((q + 24) << 10) + r is exact for subnormals (q = -24) and normals alike, and a
// carry out of the significand moves into the exponent by itself.
static inline unsigned short cudasim_round_to_half(uint64_t m, int e2) {
  const int e_top = 63 - __builtin_clzll(m) + e2;
  int q = e_top - 10;
  if (q < -24) q = -24;
  const int shift = q - e2;
  uint64_t r;
  if (shift <= 0) {
    r = m << (-shift);  // exact (only small values of m reach here)
  } else if (shift >= 64) {
    r = 0;  // far below half the smallest subnormal
    if (shift == 64 && (m >> 63)) r = (m << 1) != 0 ? 1 : 0;  // (never reached for f32)
  } else {
    r = m >> shift;
    const uint64_t rem = m & ((1ull << shift) - 1);
    const uint64_t half_q = 1ull << (shift - 1);
    if (rem > half_q || (rem == half_q && (r & 1))) ++r;
  }
  const uint64_t bits = ((uint64_t)(q + 24) << 10) + r;
  return bits >= 0x7c00 ? (unsigned short)0x7c00 : (unsigned short)bits;
}

// cvt.rn.f16.f32: nearest even, overflow to infinity, NaN to the canonical 0x7FFF.
static inline unsigned short cudasim_f32_to_f16_bits(float f) {
  const uint32_t x = __float_as_uint(f);
  const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
  const uint32_t exp = (x >> 23) & 0xffu;
  const uint32_t man = x & 0x7fffffu;
  if (exp == 0xffu) return man ? (unsigned short)0x7fffu : (unsigned short)(sign | 0x7c00u);
  if (exp == 0 && man == 0) return sign;
  const uint64_t m = exp ? (man | 0x800000u) : man;
  const int e2 = exp ? (int)exp - 150 : -149;
  return (unsigned short)(sign | cudasim_round_to_half(m, e2));
}

// The same from binary64 (the exact result of a binary16 addition or product fits in it).
static inline unsigned short cudasim_f64_to_f16_bits(double d) {
  uint64_t x;
  memcpy(&x, &d, 8);
  const unsigned short sign = (unsigned short)((x >> 48) & 0x8000u);
  const uint64_t exp = (x >> 52) & 0x7ffu;
  const uint64_t man = x & 0xfffffffffffffull;
  if (exp == 0x7ffu) return man ? (unsigned short)0x7fffu : (unsigned short)(sign | 0x7c00u);
  if (exp == 0 && man == 0) return sign;
  const uint64_t m = exp ? (man | (1ull << 52)) : man;
  const int e2 = exp ? (int)exp - 1075 : -1074;
  return (unsigned short)(sign | cudasim_round_to_half(m, e2));
}

// cvt.f32.f16: exact, NaN to the canonical 0x7FFFFFFF.
static inline float cudasim_f16_bits_to_f32(unsigned short h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return __uint_as_float(man ? 0x7fffffffu : (sign | 0x7f800000u));
  if (exp == 0) {
    // ±man · 2^-24, exact in binary32.
    const float v = (float)man * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __short_as_half(short s) { return __half{(unsigned short)s}; }
static inline short __half_as_short(__half h) { return (short)h.__x; }
static inline __half __float2half_rn(float f) { return __half{cudasim_f32_to_f16_bits(f)}; }
static inline __half __float2half(float f) { return __float2half_rn(f); }
static inline float __half2float(__half h) { return cudasim_f16_bits_to_f32(h.__x); }
static inline double cudasim_h2d(__half h) { return (double)__half2float(h); }
static inline __half __hadd(__half a, __half b) {
  return __half{cudasim_f64_to_f16_bits(cudasim_h2d(a) + cudasim_h2d(b))};
}
static inline __half __hsub(__half a, __half b) {
  return __half{cudasim_f64_to_f16_bits(cudasim_h2d(a) - cudasim_h2d(b))};
}
static inline __half __hmul(__half a, __half b) {
  return __half{cudasim_f64_to_f16_bits(cudasim_h2d(a) * cudasim_h2d(b))};
}
static inline __half __hneg(__half a) { return __half{(unsigned short)(a.__x ^ 0x8000u)}; }
static inline __half __habs(__half a) { return __half{(unsigned short)(a.__x & 0x7fffu)}; }
static inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
static inline bool __heq(__half a, __half b) { return __half2float(a) == __half2float(b); }
static inline bool __hlt(__half a, __half b) { return __half2float(a) < __half2float(b); }
static inline bool __hgt(__half a, __half b) { return __half2float(a) > __half2float(b); }
static inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
static inline __half __low2half(__half2 v) { return v.x; }
static inline __half __high2half(__half2 v) { return v.y; }
static inline __half2 __floats2half2_rn(float a, float b) {
  return __half2{__float2half_rn(a), __float2half_rn(b)};
}
static inline float2 __half22float2(__half2 v) {
  return float2{__half2float(v.x), __half2float(v.y)};
}
static inline __half2 __hadd2(__half2 a, __half2 b) {
  return __half2{__hadd(a.x, b.x), __hadd(a.y, b.y)};
}
static inline __half2 __hmul2(__half2 a, __half2 b) {
  return __half2{__hmul(a.x, b.x), __hmul(a.y, b.y)};
}

// ------------------------------------------------------------------ inline PTX
// The driver rewrites `asm("<instr> %0, %1;" : "=x"(out) : "x"(in))` statements into calls
// `cudasim_ptx_<instr with dots as underscores>(out, in)` (the one textual change it makes
// besides `extern __shared__`, docs/simulator.md); an instruction missing here fails to
// compile with its name in the message.
static inline void cudasim_ptx_cvt_f32_f16(float& out, unsigned short in) {
  out = cudasim_f16_bits_to_f32(in);
}
static inline void cudasim_ptx_cvt_rn_f16_f32(unsigned short& out, float in) {
  out = cudasim_f32_to_f16_bits(in);
}

// ------------------------------------------------------------------ kernel export
// One entry point's parameter list, for the driver: sizes (to copy kernelParams when work is
// deferred or captured) and, per pointer, the pointee's alignment (to check each address).
struct cudasim_param {
  unsigned size;
  unsigned align;
  unsigned pointee_align;  // 0: not a pointer
};
struct cudasim_signature {
  unsigned count;
  const cudasim_param* params;
};
struct cudasim_launch {
  dim3 grid, block;
  unsigned dynamic_shared;
  void** params;
  char* error;  // filled (NUL-terminated) on failure
  size_t error_len;
};
extern "C" int cudasim_run_grid(const cudasim_launch* l, void (*thread_body)(void*), void* ctx);

template <class T>
struct cudasim_pointee_align {
  static constexpr unsigned value = 0;
};
template <class T>
struct cudasim_pointee_align<T*> {
  static constexpr unsigned value = alignof(T);
};
template <>
struct cudasim_pointee_align<void*> {
  static constexpr unsigned value = 1;
};
template <>
struct cudasim_pointee_align<const void*> {
  static constexpr unsigned value = 1;
};

template <class... A>
struct cudasim_kernel_info {
  static constexpr cudasim_param params[sizeof...(A) + 1] = {
      {(unsigned)sizeof(A), (unsigned)alignof(A), cudasim_pointee_align<A>::value}..., {0, 0, 0}};
  static constexpr cudasim_signature sig = {(unsigned)sizeof...(A), params};
};

template <class... A>
constexpr const cudasim_signature* cudasim_signature_of(void (*)(A...)) {
  return &cudasim_kernel_info<A...>::sig;
}

template <size_t... I>
struct cudasim_indices {};
template <size_t N, size_t... I>
struct cudasim_make_indices : cudasim_make_indices<N - 1, N - 1, I...> {};
template <size_t... I>
struct cudasim_make_indices<0, I...> {
  typedef cudasim_indices<I...> type;
};

template <class... A>
struct cudasim_call {
  void (*kernel)(A...);
  void** params;
  template <size_t... I>
  void run(cudasim_indices<I...>) const {
    kernel(*static_cast<A*>(params[I])...);
  }
  static void body(void* self) {
    const cudasim_call* c = static_cast<const cudasim_call*>(self);
    c->run(typename cudasim_make_indices<sizeof...(A)>::type());
  }
};

template <class... A>
int cudasim_launch_kernel(void (*kernel)(A...), const cudasim_launch* l) {
  cudasim_call<A...> c{kernel, l->params};
  return cudasim_run_grid(l, &cudasim_call<A...>::body, &c);
}

// Appended by the driver after the program text, once per `extern "C" __global__` function.
#define CUDASIM_EXPORT_KERNEL(name)                                                       \
  extern "C" __attribute__((visibility("default"))) int cudasim_launch_##name(            \
      const cudasim_launch* l) {                                                          \
    return cudasim_launch_kernel(&name, l);                                               \
  }                                                                                       \
  extern "C" __attribute__((visibility("default"))) const cudasim_signature*              \
      cudasim_signature_##name() {                                                        \
    return cudasim_signature_of(&name);                                                   \
  }
