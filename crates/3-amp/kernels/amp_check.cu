// amp_check.cu: overflow check over G (or one bucket of it), by OverflowPolicy.
// Twins: cudnn_cbr_amp::range::{check_nonfinite, check_and_clip}.
//
// Both kernels only ever SET s->overflow (atomicOr), so per-bucket launches accumulate into
// one verdict; amp_loss_scale_update clears it at the end of the step.

// OverflowPolicy::NanOrInf: any NaN or +-Inf in g[0..n) sets the flag.
extern "C" __global__ void amp_check_nonfinite(const float* __restrict__ g, size_t n,
                                               AmpScalars* __restrict__ s) {
    // An earlier bucket already overflowed: the verdict cannot change, save the bandwidth.
    if (*(volatile const unsigned int*)&s->overflow != 0u) return;
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const size_t groups = amp_aligned16(g) ? n / 8 : 0;
    bool bad = false;
    for (size_t i = tid; i < groups; i += stride) {
        float x[8];
        amp_load8(g, i, x);
#pragma unroll
        for (int k = 0; k < 8; ++k) bad |= !amp_isfinite(x[k]);
    }
    for (size_t i = groups * 8 + tid; i < n; i += stride) bad |= !amp_isfinite(g[i]);
    if (bad) atomicOr(&s->overflow, 1u);
}

// One element under ClipInf: NaN is reported (and kept), +-Inf and |x| > bound clamp.
__device__ __forceinline__ float amp_clip1(float x, float bound, bool& nan_seen, bool& changed) {
    if (amp_isnan(x)) {
        nan_seen = true;
        return x;
    }
    if (fabsf(x) > bound) {
        changed = true;
        return copysignf(bound, x);
    }
    return x;
}

// OverflowPolicy::ClipInf: only NaN sets the flag; +-Inf and |x| > bound become +-bound in
// place. Stores happen only for groups that changed, so a clean G is read-only traffic.
extern "C" __global__ void amp_check_clip(float* __restrict__ g, size_t n, float bound,
                                          AmpScalars* __restrict__ s) {
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const size_t groups = amp_aligned16(g) ? n / 8 : 0;
    bool nan_seen = false;
    for (size_t i = tid; i < groups; i += stride) {
        float x[8];
        bool changed = false;
        amp_load8(g, i, x);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = amp_clip1(x[k], bound, nan_seen, changed);
        if (changed) amp_store8(g, i, x);
    }
    for (size_t i = groups * 8 + tid; i < n; i += stride) {
        bool changed = false;
        const float x = amp_clip1(g[i], bound, nan_seen, changed);
        if (changed) g[i] = x;
    }
    if (nan_seen) atomicOr(&s->overflow, 1u);
}
