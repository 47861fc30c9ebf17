// net_head.cu: the network head of a training step and the residual gradient join.
// Twins: cudnn_cbr_netops::head::{gap_forward, gap_backward, fc_forward, fc_backward, add_f16,
// head_metrics, metrics_log_append}.
//
// Shapes: activations NHWC FP16 [batch, pixels, features] (pixels = H*W); pooled features and
// their gradient FP32 [batch, features]; logits and their gradient FP16 [batch, classes]; the FC
// weight FP32 [classes, features] and bias FP32 [classes], read from region W (the master
// weights, not the FP16 copies in A); its gradients FP32, written (not accumulated) into G.
//
// Every sum runs in ascending index order in one thread, with __fadd_rn/__fmul_rn (never an
// FMA), so the CPU twins reproduce each output bit for bit. The head is tiny (features <= 64,
// classes <= 16 in the main job): one thread per output is plenty, and it is what makes the
// order fixed.

// pooled[r, c] = (sum over p ascending of f32(a[r, p, c])) / pixels.
// One thread per (r, c); consecutive threads read consecutive channels (coalesced).
extern "C" __global__ void net_gap_forward(const __half* __restrict__ a,
                                           float* __restrict__ pooled, size_t batch,
                                           size_t pixels, size_t features) {
    const size_t total = batch * features;
    const float div = (float)pixels;
    for (size_t i = amp_tid(); i < total; i += amp_stride()) {
        const size_t r = i / features;
        const size_t c = i - r * features;
        const __half* src = a + r * pixels * features + c;
        float s = 0.0f;
        for (size_t p = 0; p < pixels; ++p) s = __fadd_rn(s, amp_h2f(src[p * features]));
        pooled[i] = __fdiv_rn(s, div);
    }
}

// da[r, p, c] = f16(dpooled[r, c] / pixels): the pooling's gradient, spread evenly.
extern "C" __global__ void net_gap_backward(const float* __restrict__ dpooled,
                                            __half* __restrict__ da, size_t batch,
                                            size_t pixels, size_t features) {
    const size_t per_image = pixels * features;
    const size_t total = batch * per_image;
    const float div = (float)pixels;
    for (size_t i = amp_tid(); i < total; i += amp_stride()) {
        const size_t r = i / per_image;
        const size_t c = i % features;
        da[i] = amp_f2h(__fdiv_rn(dpooled[r * features + c], div));
    }
}

// logits[r, k] = f16((sum over j ascending of w[k, j] * x[r, j]) + b[k]).
// One thread per (r, k).
extern "C" __global__ void net_fc_forward(const float* __restrict__ x,
                                          const float* __restrict__ w,
                                          const float* __restrict__ b,
                                          __half* __restrict__ logits, size_t batch,
                                          size_t features, size_t classes) {
    const size_t total = batch * classes;
    for (size_t i = amp_tid(); i < total; i += amp_stride()) {
        const size_t r = i / classes;
        const size_t k = i - r * classes;
        const float* xr = x + r * features;
        const float* wk = w + k * features;
        float s = 0.0f;
        for (size_t j = 0; j < features; ++j) s = __fadd_rn(s, __fmul_rn(wk[j], xr[j]));
        logits[i] = amp_f2h(__fadd_rn(s, b[k]));
    }
}

// With g = f32(dlogits), each sum ascending from 0:
//   db[k]    = sum over r of g[r, k]
//   dw[k, j] = sum over r of g[r, k] * x[r, j]
//   dx[r, j] = sum over k of g[r, k] * w[k, j]
// One thread per output; the index space is db, then dw, then dx. dw and db overwrite (they
// are the FC's whole gradient); dx is the pooled features' gradient.
extern "C" __global__ void net_fc_backward(const __half* __restrict__ dlogits,
                                           const float* __restrict__ x,
                                           const float* __restrict__ w,
                                           float* __restrict__ dw, float* __restrict__ db,
                                           float* __restrict__ dx, size_t batch,
                                           size_t features, size_t classes) {
    const size_t nb = classes;
    const size_t nw = classes * features;
    const size_t total = nb + nw + batch * features;
    for (size_t i = amp_tid(); i < total; i += amp_stride()) {
        float s = 0.0f;
        if (i < nb) {
            for (size_t r = 0; r < batch; ++r) s = __fadd_rn(s, amp_h2f(dlogits[r * classes + i]));
            db[i] = s;
        } else if (i < nb + nw) {
            const size_t t = i - nb;
            const size_t k = t / features;
            const size_t j = t - k * features;
            for (size_t r = 0; r < batch; ++r)
                s = __fadd_rn(s, __fmul_rn(amp_h2f(dlogits[r * classes + k]), x[r * features + j]));
            dw[t] = s;
        } else {
            const size_t t = i - nb - nw;
            const size_t r = t / features;
            const size_t j = t - r * features;
            for (size_t k = 0; k < classes; ++k)
                s = __fadd_rn(s, __fmul_rn(amp_h2f(dlogits[r * classes + k]), w[k * features + j]));
            dx[t] = s;
        }
    }
}

// out[i] = f16(f32(a[i]) + f32(b[i])): the gradient of an activation that feeds two branches.
// `out` may not overlap `a` or `b`.
extern "C" __global__ void net_add_f16(const __half* __restrict__ a,
                                       const __half* __restrict__ b,
                                       __half* __restrict__ out, size_t n) {
    const size_t tid = amp_tid();
    const size_t stride = amp_stride();
    const size_t groups = (amp_aligned16(a) && amp_aligned16(b) && amp_aligned16(out)) ? n / 8 : 0;
    for (size_t i = tid; i < groups; i += stride) {
        __half x[8];
        __half y[8];
        __half z[8];
        amp_load8h(a, i, x);
        amp_load8h(b, i, y);
#pragma unroll
        for (int k = 0; k < 8; ++k) z[k] = amp_f2h(__fadd_rn(amp_h2f(x[k]), amp_h2f(y[k])));
        amp_store8h(out, i, z);
    }
    for (size_t i = groups * 8 + tid; i < n; i += stride)
        out[i] = amp_f2h(__fadd_rn(amp_h2f(a[i]), amp_h2f(b[i])));
}

// The IEEE total order as a signed key (Rust's f32::total_cmp): negative values get their
// magnitude bits flipped, so a signed integer comparison orders every float, NaNs included.
__device__ __forceinline__ int net_total_key(float x) {
    const int k = __float_as_int(x);
    return k ^ (int)((unsigned int)(k >> 31) >> 1);
}

// One step's metrics, appended to a log. Single thread (launch <<<1, 1>>>): batch*classes is
// a few hundred values, and one thread fixes the summation order.
//   loss     = (sum over r ascending of loss[r]) / batch, or 0 when `loss` is null
//   accuracy = (rows whose argmax equals the label) / batch; the argmax is the LAST index of
//              the largest f32(logit) under the total order (Rust's Iterator::max_by), and a
//              label outside [0, classes) never matches.
// The log: bytes 0..4 a u32 counter of appended entries, bytes 4..16 reserved (zero), then
// `capacity` entries of two floats (loss, accuracy). Entry `counter % capacity` is written,
// then the counter incremented (wrapping), so a replayed graph appends where it should.
extern "C" __global__ void net_head_metrics(const __half* __restrict__ logits,
                                            const int* __restrict__ labels,
                                            const float* __restrict__ loss,
                                            unsigned int* __restrict__ log, size_t batch,
                                            size_t classes, size_t capacity) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float loss_sum = 0.0f;
    unsigned int correct = 0;
    for (size_t r = 0; r < batch; ++r) {
        if (loss != nullptr) loss_sum = __fadd_rn(loss_sum, loss[r]);
        const __half* row = logits + r * classes;
        size_t best = 0;
        int best_key = net_total_key(amp_h2f(row[0]));
        for (size_t k = 1; k < classes; ++k) {
            const int key = net_total_key(amp_h2f(row[k]));
            if (key >= best_key) {
                best_key = key;
                best = k;
            }
        }
        const int label = labels[r];
        if (label >= 0 && (size_t)label == best) ++correct;
    }
    const float n = (float)batch;
    const unsigned int count = log[0];
    float* entry = reinterpret_cast<float*>(log + 4) + 2 * ((size_t)count % capacity);
    entry[0] = __fdiv_rn(loss_sum, n);
    entry[1] = __fdiv_rn((float)correct, n);
    log[0] = count + 1u;
}
