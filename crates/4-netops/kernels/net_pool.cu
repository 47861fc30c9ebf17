// Max-pool over NHWC FP16 (the ResNet stem's 3x3/2 pad-1 pool). CPU twins: cudnn_cbr_netops::pool.
//
// Window order is rows, then columns; padding never wins; the first maximum (strict `>`)
// is the window's choice, in the forward and for the gradient. The backward gathers: one
// thread per input element sums, in ascending (i, j) order, the output gradients of the
// windows that chose it, in FP32, rounded to FP16 once (no atomics, deterministic).

// The flat input index of window (n, i, j, ch)'s first maximum; every window holds at least
// one real pixel (pad < kernel).
__device__ size_t net_pool_argmax(const __half* __restrict__ x, size_t n, size_t i, size_t j,
                                  size_t ch, size_t h, size_t w, size_t c, size_t kernel,
                                  size_t stride, size_t pad) {
    size_t best = (size_t)-1;
    float best_v = 0.0f;
    for (size_t di = 0; di < kernel; ++di) {
        const size_t hp = i * stride + di;
        if (hp < pad || hp - pad >= h) continue;
        for (size_t dj = 0; dj < kernel; ++dj) {
            const size_t wp = j * stride + dj;
            if (wp < pad || wp - pad >= w) continue;
            const size_t at = ((n * h + (hp - pad)) * w + (wp - pad)) * c + ch;
            const float v = __half2float(x[at]);
            if (best == (size_t)-1 || v > best_v) {
                best = at;
                best_v = v;
            }
        }
    }
    return best;
}

extern "C" __global__ void net_max_pool_forward(const __half* __restrict__ x,
                                                __half* __restrict__ y, size_t batch, size_t h,
                                                size_t w, size_t c, size_t oh, size_t ow,
                                                size_t kernel, size_t stride, size_t pad) {
    const size_t total = batch * oh * ow * c;
    for (size_t o = amp_tid(); o < total; o += amp_stride()) {
        const size_t ch = o % c;
        const size_t j = (o / c) % ow;
        const size_t i = (o / (c * ow)) % oh;
        const size_t n = o / (c * ow * oh);
        y[o] = x[net_pool_argmax(x, n, i, j, ch, h, w, c, kernel, stride, pad)];
    }
}

extern "C" __global__ void net_max_pool_backward(const __half* __restrict__ x,
                                                 const __half* __restrict__ dy,
                                                 __half* __restrict__ dx, size_t batch, size_t h,
                                                 size_t w, size_t c, size_t oh, size_t ow,
                                                 size_t kernel, size_t stride, size_t pad) {
    const size_t total = batch * h * w * c;
    for (size_t at = amp_tid(); at < total; at += amp_stride()) {
        const size_t ch = at % c;
        const size_t col = (at / c) % w;
        const size_t row = (at / (c * w)) % h;
        const size_t n = at / (c * w * h);
        // Windows i with i*stride <= row+pad <= i*stride+kernel-1 (the same for columns).
        const size_t hp = row + pad, wp = col + pad;
        const size_t i0 = hp + 1 > kernel ? (hp + 1 - kernel + stride - 1) / stride : 0;
        const size_t j0 = wp + 1 > kernel ? (wp + 1 - kernel + stride - 1) / stride : 0;
        float acc = 0.0f;
        for (size_t i = i0; i < oh && i * stride <= hp; ++i) {
            for (size_t j = j0; j < ow && j * stride <= wp; ++j) {
                if (net_pool_argmax(x, n, i, j, ch, h, w, c, kernel, stride, pad) == at) {
                    acc += __half2float(dy[((n * oh + i) * ow + j) * c + ch]);
                }
            }
        }
        dx[at] = amp_f2h(acc);
    }
}
