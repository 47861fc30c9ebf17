//! cudnn-cbr-netops: the network's own kernels, beside the cuDNN graphs of its layers.
//!
//! | op | what it does | CPU twin | CUDA |
//! |----|--------------|----------|------|
//! | residual join | `out = f16(f32(a) + f32(b))`, the gradient of an activation that feeds two branches | [`head::add_f16`] | [`cuda::NetKernels::add_f16`] |
//! | max-pool | the stem's pool over NHWC FP16, forward and backward | [`pool::max_pool_forward`], [`pool::max_pool_backward`] | [`cuda::NetKernels::max_pool_forward`], [`cuda::NetKernels::max_pool_backward`] |
//! | global average pool | `[batch, pixels, features]` FP16 → `[batch, features]` FP32, and back | [`head::gap_forward`], [`head::gap_backward`] | [`cuda::NetKernels::gap_forward`], [`cuda::NetKernels::gap_backward`] |
//! | FC | FP32 weights from amp's region W, gradients straight into G | [`head::fc_forward`], [`head::fc_backward`] | [`cuda::NetKernels::fc_forward`], [`cuda::RegionsFc`] |
//! | metrics log | one step's loss and accuracy appended on the device | [`head::head_metrics`], [`head::metrics_log_append`] | [`cuda::NetKernels::head_metrics`] |
//!
//! Every twin gives the kernel's result bit for bit (each function's docs give its exact
//! definition and summation order). The kernel sources are [`kernels::ALL`].
//!
//! The loss seed between the FC forward and its backward (softmax cross-entropy, scaled by
//! the loss scale in S) is amp's: `cudnn_cbr_amp::range::softmax_xent_backward` and its kernel.
//!
//! The crate builds on `cudnn_cbr_amp`: the FC reads and writes amp's regions, and the kernels
//! are an amp `KernelSet` (NVRTC, the kernel cache, launches checked against their
//! signatures) over amp's checked device ranges (`DevRange`), with amp's typed errors
//! (`AmpError`, `RangeOpError`). It does not depend on the cuDNN frontend (fusion).
//!
//! Unsafe code lives only in [`cuda`], the kernel-launch module; everything else forbids it.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cuda;
pub mod head;
pub mod kernels;
pub mod pool;
