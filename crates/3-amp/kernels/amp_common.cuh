// amp_common.cuh: shared prelude of the AMP range kernels.
//
// kernels.rs prepends this file to every .cu file of crates/3-amp/kernels before handing the text to
// NVRTC (NVRTC has no file system to resolve our own #include from), so the scalar layout
// and the conversion rules below exist exactly once.
//
// Conventions of every range kernel:
// - Pointers are region base + range start, computed on the host; `n` counts elements.
// - Grid-stride loops: any grid size is correct, the launcher picks one for occupancy.
// - A 16-byte vector path runs when every pointer is 16-byte aligned (always true for plan
//   ranges: slots start on 256 bytes), then a scalar tail; unaligned pointers go all scalar.
// - Arithmetic that a CPU twin must reproduce bit for bit uses __fmul_rn/__fadd_rn/...:
//   those are never contracted into an FMA, whatever --fmad says.
// - Nothing is ever read back to the host: the overflow flag and the loss scale are read
//   from S by the kernels themselves.

#include <cuda_fp16.h>

// The S region (256 bytes; the first 192 in use). Mirrors cudnn_cbr_amp::range::Scalars.
#define AMP_NORM_BLOCKS 32
struct AmpScalars {
    float loss_scale;             // byte 0
    unsigned int overflow;        // byte 4: 0 clear, nonzero = NaN/Inf seen this step
    unsigned int growth_tracker;  // byte 8: applied steps since the scale last changed
    unsigned int step;            // byte 12: applied steps (wrapping)
    unsigned int skipped;         // byte 16: skipped steps (wrapping)
    float lr;                     // byte 20: SGD learning rate (host writes, between steps)
    float momentum;               // byte 24: SGD momentum (0: M untouched)
    float weight_decay;           // byte 28: SGD weight decay
    unsigned int ranks;           // byte 32: data-parallel ranks summed into G (0, 1: one)
    float clip_norm;              // byte 36: global-norm clipping bound (0: off; SGD reads)
    float grad_norm;              // byte 40: unscaled global L2 norm of G (amp_grad_norm)
    unsigned int accum;           // byte 44: micro-batches accumulated into G (0, 1: one)
    unsigned int reserved0[4];    // bytes 48..63: zero
    float norm_partials[AMP_NORM_BLOCKS];  // bytes 64..191: amp_grad_sumsq's block sums
};
static_assert(__builtin_offsetof(AmpScalars, loss_scale) == 0, "S layout: loss_scale");
static_assert(__builtin_offsetof(AmpScalars, overflow) == 4, "S layout: overflow");
static_assert(__builtin_offsetof(AmpScalars, growth_tracker) == 8, "S layout: growth_tracker");
static_assert(__builtin_offsetof(AmpScalars, step) == 12, "S layout: step");
static_assert(__builtin_offsetof(AmpScalars, skipped) == 16, "S layout: skipped");
static_assert(__builtin_offsetof(AmpScalars, lr) == 20, "S layout: lr");
static_assert(__builtin_offsetof(AmpScalars, momentum) == 24, "S layout: momentum");
static_assert(__builtin_offsetof(AmpScalars, weight_decay) == 28, "S layout: weight_decay");
static_assert(__builtin_offsetof(AmpScalars, ranks) == 32, "S layout: ranks");
static_assert(__builtin_offsetof(AmpScalars, clip_norm) == 36, "S layout: clip_norm");
static_assert(__builtin_offsetof(AmpScalars, grad_norm) == 40, "S layout: grad_norm");
static_assert(__builtin_offsetof(AmpScalars, accum) == 44, "S layout: accum");
static_assert(__builtin_offsetof(AmpScalars, norm_partials) == 64, "S layout: norm_partials");
static_assert(sizeof(AmpScalars) == 192, "S layout: size");

#define AMP_MIN_LOSS_SCALE 1.0f
#define AMP_BACKOFF_FACTOR 0.5f

__device__ __forceinline__ size_t amp_tid() {
    return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ size_t amp_stride() {
    return (size_t)gridDim.x * blockDim.x;
}

__device__ __forceinline__ bool amp_aligned16(const void* p) {
    return ((size_t)p & 15u) == 0;
}

__device__ __forceinline__ bool amp_isnan(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
}

__device__ __forceinline__ bool amp_isfinite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ float amp_neg_inf() {
    return __uint_as_float(0xff800000u);
}

// FP32 -> FP16, round to nearest even, NaN -> canonical 0x7FFF. The hardware's NaN payload
// handling is not specified tightly enough for a bit-exact CPU twin, so we pick the NaN.
__device__ __forceinline__ __half amp_f2h(float x) {
    return amp_isnan(x) ? __ushort_as_half((unsigned short)0x7fffu) : __float2half_rn(x);
}

// What G is divided by to unscale and average it: loss_scale, times ranks when above 1, then
// times accum when above 1, each product rounded once. Twin: Scalars::unscale_denominator.
__device__ __forceinline__ float amp_unscale_denominator(const AmpScalars* s) {
    float denom = s->loss_scale;
    if (s->ranks > 1u) denom = __fmul_rn(denom, (float)s->ranks);
    if (s->accum > 1u) denom = __fmul_rn(denom, (float)s->accum);
    return denom;
}

// FP16 -> FP32, exact, NaN -> canonical 0x7FFFFFFF.
__device__ __forceinline__ float amp_h2f(__half h) {
    const unsigned short b = __half_as_ushort(h);
    return ((b & 0x7fffu) > 0x7c00u) ? __uint_as_float(0x7fffffffu) : __half2float(h);
}

// Eight consecutive floats as two 16-byte loads/stores (element group i).
__device__ __forceinline__ void amp_load8(const float* p, size_t i, float (&v)[8]) {
    const float4* q = reinterpret_cast<const float4*>(p) + 2 * i;
    const float4 a = q[0];
    const float4 b = q[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void amp_store8(float* p, size_t i, const float (&v)[8]) {
    float4* q = reinterpret_cast<float4*>(p) + 2 * i;
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Eight consecutive halves as one 16-byte load/store (element group i).
__device__ __forceinline__ void amp_load8h(const __half* p, size_t i, __half (&v)[8]) {
    const uint4 u = reinterpret_cast<const uint4*>(p)[i];
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __ushort_as_half((unsigned short)(w[k] & 0xffffu));
        v[2 * k + 1] = __ushort_as_half((unsigned short)(w[k] >> 16));
    }
}

__device__ __forceinline__ unsigned int amp_pack2h(__half lo, __half hi) {
    return (unsigned int)__half_as_ushort(lo) | ((unsigned int)__half_as_ushort(hi) << 16);
}

__device__ __forceinline__ void amp_store8h(__half* p, size_t i, const __half (&v)[8]) {
    reinterpret_cast<uint4*>(p)[i] = make_uint4(amp_pack2h(v[0], v[1]), amp_pack2h(v[2], v[3]),
                                                amp_pack2h(v[4], v[5]), amp_pack2h(v[6], v[7]));
}
