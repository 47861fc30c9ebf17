//! Data-parallel training's gradient collectives: the per-bucket gradient all-reduce and the
//! shared overflow verdict of a step, over the communicators of `cudnn_cbr_dist`.
//!
//! Between backward and the optimizer the ranks sum their gradients (per amp bucket, the
//! deepest bucket first, as backward produces them), and they share the overflow verdict (max
//! of the flags) so that every rank skips the same steps and keeps the same loss scale. The
//! averaging costs no pass of its own: S holds the number of ranks and the SGD kernel unscales
//! by `1 / (loss_scale · ranks)` ([`crate::range::Scalars::ranks`]).
//!
//! | piece | what it is | where |
//! |-------|------------|-------|
//! | [`grads`] | the gradient all-reduce and the shared overflow flag of a CPU step | [`grads`] |
//! | [`crate::cuda::dist_grads`] | the same over CUDA regions with NCCL, on the communicator's stream | [`crate::cuda::dist_grads`] |
//!
//! The communicators themselves (the CPU group, NCCL, the launcher bootstrap, the watchdog)
//! are the distribution crate's, `cudnn_cbr_dist` (re-exported by the root crate as
//! `cudnn_cbr::dist`).

pub mod grads;
