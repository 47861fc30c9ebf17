// amp_seed.cu: the loss-gradient seed, softmax cross-entropy backward with the loss scale.
// Twin: cudnn_cbr_amp::range::softmax_xent_backward.

// Block-wide max (IsMax) or sum of v. blockDim.x must be a multiple of 32 (full-warp
// shuffles), at most 1024. sh must hold 33 floats. Every thread gets the result.
template <bool IsMax>
__device__ __forceinline__ float amp_block_reduce(float v, float* sh) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = IsMax ? fmaxf(v, u) : __fadd_rn(v, u);
    }
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const unsigned int warps = (blockDim.x + 31u) >> 5;
        v = lane < warps ? sh[lane] : (IsMax ? amp_neg_inf() : 0.0f);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float u = __shfl_xor_sync(0xffffffffu, v, o);
            v = IsMax ? fmaxf(v, u) : __fadd_rn(v, u);
        }
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    const float r = sh[32];
    __syncthreads();  // all threads have read sh before the next reduction reuses it
    return r;
}

// logits, dlogits: [batch, classes] row-major FP16; labels: [batch]; loss: [batch] or null.
// One block per row (grid-stride over rows); blockDim.x a multiple of 32.
// dlogits[r, j] = f16((scale / batch) * (softmax(x_r)_j - [j == label_r])), scale from S.
// loss[r] = ln(sum_j exp(x_rj - max)) - (x_r,label - max).
// A label outside [0, classes) gives a zero row and a zero loss (ignored), like the twin.
extern "C" __global__ void amp_softmax_xent_backward(const __half* __restrict__ logits,
                                                     const int* __restrict__ labels,
                                                     __half* __restrict__ dlogits,
                                                     float* __restrict__ loss,
                                                     const AmpScalars* __restrict__ s,
                                                     size_t batch, size_t classes) {
    __shared__ float sh[33];
    const float coef = __fdiv_rn(s->loss_scale, (float)batch);
    for (size_t row = blockIdx.x; row < batch; row += gridDim.x) {
        const __half* x = logits + row * classes;
        __half* d = dlogits + row * classes;
        const int label = labels[row];
        // label is the same for the whole block, so the branch keeps the block together.
        if (label < 0 || (size_t)label >= classes) {
            for (size_t j = threadIdx.x; j < classes; j += blockDim.x) d[j] = __ushort_as_half(0);
            if (loss != nullptr && threadIdx.x == 0) loss[row] = 0.0f;
            continue;
        }
        float m = amp_neg_inf();
        for (size_t j = threadIdx.x; j < classes; j += blockDim.x) m = fmaxf(m, __half2float(x[j]));
        m = amp_block_reduce<true>(m, sh);
        float sum = 0.0f;
        for (size_t j = threadIdx.x; j < classes; j += blockDim.x)
            sum = __fadd_rn(sum, expf(__fsub_rn(__half2float(x[j]), m)));
        sum = amp_block_reduce<false>(sum, sh);
        const float inv_sum = __fdiv_rn(1.0f, sum);
        for (size_t j = threadIdx.x; j < classes; j += blockDim.x) {
            const float p = __fmul_rn(expf(__fsub_rn(__half2float(x[j]), m)), inv_sum);
            const float y = (j == (size_t)label) ? 1.0f : 0.0f;
            d[j] = amp_f2h(__fmul_rn(coef, __fsub_rn(p, y)));
        }
        if (loss != nullptr && threadIdx.x == 0)
            loss[row] = __fsub_rn(logf(sum), __fsub_rn(__half2float(x[label]), m));
    }
}
