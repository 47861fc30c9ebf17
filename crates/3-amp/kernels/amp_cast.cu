// amp_cast.cu: casts between an FP32 region and its FP16 twin (W->A, E->E16, G16->G).
// Twins: cudnn_cbr_amp::range::{cast_f32_to_f16, cast_f16_to_f32}.

// dst[i] = f16(src[i]) for i < n: round to nearest even, canonical NaN.
extern "C" __global__ void amp_cast_f32_to_f16(const float* __restrict__ src,
                                               __half* __restrict__ dst, size_t n) {
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const size_t groups = (amp_aligned16(src) && amp_aligned16(dst)) ? n / 8 : 0;
    for (size_t i = tid; i < groups; i += stride) {
        float x[8];
        __half h[8];
        amp_load8(src, i, x);
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = amp_f2h(x[k]);
        amp_store8h(dst, i, h);
    }
    for (size_t i = groups * 8 + tid; i < n; i += stride) dst[i] = amp_f2h(src[i]);
}

// dst[i] = f32(src[i]) for i < n: exact, canonical NaN.
extern "C" __global__ void amp_cast_f16_to_f32(const __half* __restrict__ src,
                                               float* __restrict__ dst, size_t n) {
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const size_t groups = (amp_aligned16(src) && amp_aligned16(dst)) ? n / 8 : 0;
    for (size_t i = tid; i < groups; i += stride) {
        __half h[8];
        float x[8];
        amp_load8h(src, i, h);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = amp_h2f(h[k]);
        amp_store8(dst, i, x);
    }
    for (size_t i = groups * 8 + tid; i < n; i += stride) dst[i] = amp_h2f(src[i]);
}

// Gradient accumulation over micro-batches, one pass per micro-batch. For i < n:
//   x = g[i] + (i < n16 ? f32(g16[i]) : 0)     this micro-batch's FP32 gradient: G holds the
//                                               FP32 parts (BN, FC), G16 the conv wgrads, and
//                                               each element is zero in the one not written
//   sum = acc[i] + x
//   drain == 0: acc[i] = sum                    (a micro-batch before the last)
//   drain != 0: g[i] = sum, acc[i] = 0          (the last: G holds the step's sum, GA is
//                                               clear for the next step, even a skipped one)
// A NaN result is the canonical 0x7FFFFFFF. Twin: cudnn_cbr_amp::range::accum_grads.
extern "C" __global__ void amp_accum_grads(const __half* __restrict__ g16, float* __restrict__ g,
                                           float* __restrict__ acc, size_t n, size_t n16,
                                           unsigned int drain) {
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    for (size_t i = tid; i < n; i += stride) {
        float x = g[i];
        if (i < n16) x = __fadd_rn(x, amp_h2f(g16[i]));
        float sum = __fadd_rn(acc[i], x);
        if (amp_isnan(sum)) sum = __uint_as_float(0x7fffffffu);
        if (drain != 0u) {
            g[i] = sum;
            acc[i] = 0.0f;
        } else {
            acc[i] = sum;
        }
    }
}
