// amp_norm.cu: the global L2 norm of G for clipping by norm, summed in one fixed order so
// that it is deterministic and the CPU twin is bit-exact.
// Twin: cudnn_cbr_amp::range::grad_norm.
//
// Two launches: amp_grad_sumsq with exactly AMP_NORM_BLOCKS blocks of AMP_NORM_THREADS
// threads (the order below depends on that geometry), then amp_grad_norm with one thread.

#define AMP_NORM_THREADS 256

// Block b, thread t sums g[i]^2 for i = b*256 + t, then every 32*256 elements on, in order;
// the block then adds its 256 sums pairwise (t += t + half, half = 128, 64, ..., 1) and
// writes its sum to s->norm_partials[b].
extern "C" __global__ void amp_grad_sumsq(const float* __restrict__ g, size_t n,
                                          AmpScalars* __restrict__ s) {
    __shared__ float sums[AMP_NORM_THREADS];
    const unsigned int t = threadIdx.x;
    const size_t stride = (size_t)AMP_NORM_BLOCKS * AMP_NORM_THREADS;
    float acc = 0.0f;
    for (size_t i = (size_t)blockIdx.x * AMP_NORM_THREADS + t; i < n; i += stride) {
        const float x = g[i];
        acc = __fadd_rn(acc, __fmul_rn(x, x));
    }
    sums[t] = acc;
    __syncthreads();
    for (unsigned int half = AMP_NORM_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) sums[t] = __fadd_rn(sums[t], sums[t + half]);
        __syncthreads();
    }
    if (t == 0) s->norm_partials[blockIdx.x] = sums[0];
}

// grad_norm = sqrt(partials[0] + ... + partials[31], added in order) / (scale * ranks * accum):
// the norm of the unscaled (and, over several ranks or micro-batches, averaged) gradients SGD
// applies.
extern "C" __global__ void amp_grad_norm(AmpScalars* __restrict__ s) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float sum = 0.0f;
    for (int b = 0; b < AMP_NORM_BLOCKS; ++b) sum = __fadd_rn(sum, s->norm_partials[b]);
    const float denom = amp_unscale_denominator(s);
    s->grad_norm = __fdiv_rn(__fsqrt_rn(sum), denom);
}
