// amp_optim.cu: zeroing, SGD and EMA over a range.
// Twins: cudnn_cbr_amp::range::{zero_bytes, sgd_step, ema_update}.
//
// SGD and EMA read the overflow flag from S in every thread and return at once when it is
// set, so a skipped step leaves W, M, A, E and E16 untouched without any host sync.

// dst[0..nbytes) = 0.
extern "C" __global__ void amp_zero_bytes(unsigned char* __restrict__ dst, size_t nbytes) {
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const size_t groups = amp_aligned16(dst) ? nbytes / 16 : 0;
    uint4* d16 = reinterpret_cast<uint4*>(dst);
    for (size_t i = tid; i < groups; i += stride) d16[i] = make_uint4(0u, 0u, 0u, 0u);
    for (size_t i = groups * 16 + tid; i < nbytes; i += stride) dst[i] = 0;
}

// One SGD element; returns the new weight, updates *m when momentum != 0.
__device__ __forceinline__ float amp_sgd1(float w, float g, float* m, float inv, float lr,
                                          float mu, float wd, bool nesterov) {
    float gs = __fmul_rn(g, inv);
    if (wd != 0.0f) gs = __fadd_rn(gs, __fmul_rn(wd, w));
    float d = gs;
    if (mu != 0.0f) {
        const float mn = __fadd_rn(__fmul_rn(mu, *m), gs);
        *m = mn;
        d = nesterov ? __fadd_rn(gs, __fmul_rn(mu, mn)) : mn;
    }
    return __fsub_rn(w, __fmul_rn(lr, d));
}

// SGD (momentum, weight decay, optional Nesterov) with the 1/(scale·ranks·accum) unscale (times the
// global-norm clipping factor when S's clip_norm is set) folded in, then
// a[i] = f16(w[i]). The hyper-parameters are read from S, so a captured step follows a
// schedule the host writes there between replays. m is null when the plan has no M region
// (the host then keeps momentum at 0); M is untouched while momentum is 0.
extern "C" __global__ void amp_sgd_step(float* __restrict__ w, float* __restrict__ m,
                                        const float* __restrict__ g, __half* __restrict__ a,
                                        const AmpScalars* __restrict__ s, int nesterov,
                                        int decay, size_t n) {
    if (s->overflow != 0u) return;
    // Over several ranks or micro-batches G holds sums: averaging them is part of the unscale.
    const float denom = amp_unscale_denominator(s);
    float inv = __fdiv_rn(1.0f, denom);
    // Clipping by global norm (amp_grad_norm wrote grad_norm): PyTorch's clip_grad_norm_
    // factor, folded into the unscale so that G is not read twice.
    if (s->clip_norm != 0.0f) {
        const float f = __fdiv_rn(s->clip_norm, __fadd_rn(s->grad_norm, 1e-6f));
        if (f < 1.0f) inv = __fmul_rn(inv, f);
    }
    const float lr = s->lr;
    const float momentum = s->momentum;
    const float weight_decay = decay != 0 ? s->weight_decay : 0.0f;  // per-range: BN, biases 0
    const bool use_m = m != nullptr && momentum != 0.0f;
    const bool nest = nesterov != 0;
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const bool aligned = amp_aligned16(w) && amp_aligned16(g) && amp_aligned16(a) &&
                         (!use_m || amp_aligned16(m));
    const size_t groups = aligned ? n / 8 : 0;
    for (size_t i = tid; i < groups; i += stride) {
        float wv[8], gv[8];
        float mv[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // untouched if !use_m
        __half av[8];
        amp_load8(w, i, wv);
        amp_load8(g, i, gv);
        if (use_m) amp_load8(m, i, mv);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            wv[k] = amp_sgd1(wv[k], gv[k], &mv[k], inv, lr, momentum, weight_decay, nest);
            av[k] = amp_f2h(wv[k]);
        }
        amp_store8(w, i, wv);
        if (use_m) amp_store8(m, i, mv);
        amp_store8h(a, i, av);
    }
    for (size_t i = groups * 8 + tid; i < n; i += stride) {
        float mi = use_m ? m[i] : 0.0f;
        const float wn = amp_sgd1(w[i], g[i], &mi, inv, lr, momentum, weight_decay, nest);
        w[i] = wn;
        if (use_m) m[i] = mi;
        a[i] = amp_f2h(wn);
    }
}

// e = decay * e + (1 - decay) * w; e16 = f16(e).
extern "C" __global__ void amp_ema_update(float* __restrict__ e, __half* __restrict__ e16,
                                          const float* __restrict__ w,
                                          const AmpScalars* __restrict__ s, float decay,
                                          size_t n) {
    if (s->overflow != 0u) return;
    const float take = __fsub_rn(1.0f, decay);
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const bool aligned = amp_aligned16(e) && amp_aligned16(e16) && amp_aligned16(w);
    const size_t groups = aligned ? n / 8 : 0;
    for (size_t i = tid; i < groups; i += stride) {
        float ev[8], wv[8];
        __half hv[8];
        amp_load8(e, i, ev);
        amp_load8(w, i, wv);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            ev[k] = __fadd_rn(__fmul_rn(decay, ev[k]), __fmul_rn(take, wv[k]));
            hv[k] = amp_f2h(ev[k]);
        }
        amp_store8(e, i, ev);
        amp_store8h(e16, i, hv);
    }
    for (size_t i = groups * 8 + tid; i < n; i += stride) {
        const float en = __fadd_rn(__fmul_rn(decay, e[i]), __fmul_rn(take, w[i]));
        e[i] = en;
        e16[i] = amp_f2h(en);
    }
}
