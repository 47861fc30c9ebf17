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
