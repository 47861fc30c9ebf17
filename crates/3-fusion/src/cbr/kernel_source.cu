// The element-wise steps of a CBR layer: BN apply (+ residual forms), ReLU backward, dBN apply.
//
// FP16 NHWC tensors, FP32 arithmetic in the op order of the cuDNN graph each one replaces (and
// of the CPU reference ops), one rounding to FP16 per output; compiled with --fmad=false so no
// multiply-add is contracted. No headers: the FP16 conversions are single PTX instructions, so
// NVRTC compiles the whole module in a fraction of a second, once per architecture.

typedef unsigned short h16;
typedef unsigned long long u64;

__device__ __forceinline__ float h2f(h16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ h16 f2h(float f) {
    h16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// max(v, 0) with NaN -> 0, as cuDNN's RELU_FWD and the reference's relu.
__device__ __forceinline__ float relu(float v) { return v > 0.0f ? v : 0.0f; }

union Pack8 {
    uint4 u;
    h16 h[8];
};

// out[e] = op(a[e], b[e], channel of e) over n elements of an NHWC tensor with c channels.
// `vec`: the host checked that c % 8 == 0 and every pointer is 16-byte aligned, so eight
// elements (one channel run) move as one 16-byte access.
template <class Op>
__device__ void elementwise(const Op& op, const h16* a, const h16* b, h16* out, u64 n,
                            unsigned c, int vec) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        for (u64 v = t; v < n / 8; v += stride) {
            const u64 e = v * 8;
            const unsigned k = (unsigned)(e % c);
            Pack8 va, vb, vo;
            va.u = *(const uint4*)(a + e);
            vb.u = b ? *(const uint4*)(b + e) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int j = 0; j < 8; ++j) vo.h[j] = op(va.h[j], vb.h[j], k + j);
            *(uint4*)(out + e) = vo.u;
        }
    } else {
        for (u64 e = t; e < n; e += stride) {
            out[e] = op(a[e], b ? b[e] : (h16)0, (unsigned)(e % c));
        }
    }
}

struct ApplyRelu {
    const h16 *s, *bias;
    __device__ h16 operator()(h16 y, h16, unsigned k) const {
        return f2h(relu(h2f(y) * h2f(s[k]) + h2f(bias[k])));
    }
};

struct ApplyAddRelu {
    const h16 *s, *bias;
    __device__ h16 operator()(h16 y, h16 r, unsigned k) const {
        return f2h(relu(h2f(y) * h2f(s[k]) + h2f(bias[k]) + h2f(r)));
    }
};

struct ApplyDualRelu {
    const h16 *s, *bias, *s2, *bias2;
    __device__ h16 operator()(h16 y, h16 r, unsigned k) const {
        const float main = h2f(y) * h2f(s[k]) + h2f(bias[k]);
        const float shortcut = h2f(r) * h2f(s2[k]) + h2f(bias2[k]);
        return f2h(relu(main + shortcut));
    }
};

// dx = dy where x > 0, else +0; the gradient passes through as stored.
struct ReluBackward {
    __device__ h16 operator()(h16 dy, h16 x, unsigned) const {
        return h2f(x) > 0.0f ? dy : (h16)0;
    }
};

// dy_prev = (dz*A + y_prev*B) + C with FP32 per-channel coefficients.
struct DbnApply {
    const float *ca, *cb, *cc;
    __device__ h16 operator()(h16 dz, h16 y, unsigned k) const {
        return f2h(h2f(dz) * ca[k] + h2f(y) * cb[k] + cc[k]);
    }
};

// Evaluation-mode BN of the unfused route (its NormForward is training-mode BN): the running
// statistics' FP32 mean and 1/sqrt(var + eps) with the FP32 gamma and beta, in the order of the
// reference's bn_recompute (SUB, MUL, MUL, ADD), then by `mode`: 0 the BN output itself (no
// ReLU: `y_bn`), 1 ReLU, 2 + r then ReLU, 3 + (r*s2 + b2) then ReLU; one rounding to FP16.
struct BnEval {
    const float *mean, *inv_std, *gamma, *beta;
    const h16 *s2, *bias2;
    int mode;
    __device__ h16 operator()(h16 y, h16 r, unsigned k) const {
        float v = (h2f(y) - mean[k]) * inv_std[k] * gamma[k] + beta[k];
        if (mode == 0) return f2h(v);
        if (mode == 2) v = v + h2f(r);
        if (mode == 3) v = v + (h2f(r) * h2f(s2[k]) + h2f(bias2[k]));
        return f2h(relu(v));
    }
};

extern "C" __global__ void cbr_apply_relu(const h16* y, const h16* s, const h16* b, h16* out,
                                          u64 n, unsigned c, int vec) {
    elementwise(ApplyRelu{s, b}, y, nullptr, out, n, c, vec);
}

extern "C" __global__ void cbr_apply_add_relu(const h16* y, const h16* r, const h16* s,
                                              const h16* b, h16* out, u64 n, unsigned c,
                                              int vec) {
    elementwise(ApplyAddRelu{s, b}, y, r, out, n, c, vec);
}

extern "C" __global__ void cbr_apply_dual_relu(const h16* y, const h16* r, const h16* s,
                                               const h16* b, const h16* s2, const h16* b2,
                                               h16* out, u64 n, unsigned c, int vec) {
    elementwise(ApplyDualRelu{s, b, s2, b2}, y, r, out, n, c, vec);
}

extern "C" __global__ void cbr_relu_backward(const h16* dy, const h16* x, h16* out, u64 n,
                                             unsigned c, int vec) {
    elementwise(ReluBackward{}, dy, x, out, n, c, vec);
}

extern "C" __global__ void cbr_dbn_apply(const h16* dz, const h16* y_prev, const float* a,
                                         const float* b, const float* cc, h16* out, u64 n,
                                         unsigned c, int vec) {
    elementwise(DbnApply{a, b, cc}, dz, y_prev, out, n, c, vec);
}

// `r`, `s2` and `b2` are read only in the modes that use them (the host passes `y` for the
// others, so every pointer is a live FP16 buffer).
extern "C" __global__ void cbr_bn_eval(const h16* y, const h16* r, const float* mean,
                                       const float* inv_std, const float* gamma,
                                       const float* beta, const h16* s2, const h16* b2, int mode,
                                       h16* out, u64 n, unsigned c, int vec) {
    elementwise(BnEval{mean, inv_std, gamma, beta, s2, b2, mode}, y, mode >= 2 ? r : nullptr,
                out, n, c, vec);
}

// Per-channel sum and sum of squares of y (FP32) into `sum` and `sq` (zeroed by the caller):
// each block accumulates in shared memory (2·c floats, sized at launch), then adds its
// partial sums to the outputs. Consecutive threads take consecutive channels, so the shared
// atomics rarely collide. `vec` is unused (the element-wise kernels' argument list).
extern "C" __global__ void cbr_channel_stats(const h16* y, float* sum, float* sq, u64 n,
                                             unsigned c, int vec) {
    extern __shared__ float acc[];
    for (unsigned i = threadIdx.x; i < 2 * c; i += blockDim.x) acc[i] = 0.0f;
    __syncthreads();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const float v = h2f(y[e]);
        const unsigned k = (unsigned)(e % c);
        atomicAdd(&acc[k], v);
        atomicAdd(&acc[c + k], v * v);
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < c; i += blockDim.x) {
        atomicAdd(&sum[i], acc[i]);
        atomicAdd(&sq[i], acc[c + i]);
    }
}

// A BN's weight gradients by reduction: dgamma = sum dz*((y - mean)*inv_std), dbeta = sum dz
// per channel (FP32; zeroed by the caller), accumulated like cbr_channel_stats.
extern "C" __global__ void cbr_dbn_reduce(const h16* y, const h16* dz, const float* mean,
                                          const float* inv_std, float* dgamma, float* dbeta,
                                          u64 n, unsigned c, int vec) {
    extern __shared__ float acc[];
    for (unsigned i = threadIdx.x; i < 2 * c; i += blockDim.x) acc[i] = 0.0f;
    __syncthreads();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const unsigned k = (unsigned)(e % c);
        const float d = h2f(dz[e]);
        const float x_hat = (h2f(y[e]) - mean[k]) * inv_std[k];
        atomicAdd(&acc[k], d * x_hat);
        atomicAdd(&acc[c + k], d);
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < c; i += blockDim.x) {
        atomicAdd(&dgamma[i], acc[i]);
        atomicAdd(&dbeta[i], acc[c + i]);
    }
}

// The coefficients of dy = A*dz + B*y + C from the reduced weight gradients, in the op order of
// the dbn_coefficients graph: a = gamma*inv_std; B = ((a*inv_std)*dgamma)*(-1/M);
// C = ((a*dbeta)*(-1/M)) - B*mean; A = a. One thread per channel (n = c).
extern "C" __global__ void cbr_dbn_coefficients(const float* gamma, const float* inv_std,
                                                const float* mean, const float* dgamma,
                                                const float* dbeta, float neg_inv_count,
                                                float* A, float* B, float* C, u64 n,
                                                unsigned c, int vec) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < c; k += stride) {
        const float a = gamma[k] * inv_std[k];
        const float b = ((a * inv_std[k]) * dgamma[k]) * neg_inv_count;
        C[k] = ((a * dbeta[k]) * neg_inv_count) - b * mean[k];
        A[k] = a;
        B[k] = b;
    }
}
