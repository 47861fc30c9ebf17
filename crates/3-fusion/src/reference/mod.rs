//! CPU reference executor for every CBR op: the numerical oracle for GPU parity tests and the
//! CPU executor for examples on machines without a GPU.
//!
//! Plain Rust over `f16` storage with `f32` arithmetic, rounding to FP16 exactly where the GPU
//! graphs store FP16; im2col + GEMM for the convolutions (FP32: tiles read straight from
//! the padded source with AVX2/AVX-512 FMA, `direct.rs`, with the bits of the `gemm` crate's
//! product, which runs the rest; f64: matrixmultiply through ndarray's safe API), rayon over
//! rows and channels. `unsafe` here: the bounds-checked `gemm` call (`element.rs`), and the
//! run-time-dispatched SIMD of `convert.rs`, `direct.rs` and `transpose.rs`. Every op is generic
//! over the [`Element`] type, so the same code also runs in `f64` (no rounding anywhere) for
//! finite-difference checks and exact comparisons.
//!
//! Layouts: activations NHWC `[N, H, W, C]`, filters KRSC `[K, R, S, C]`, per-channel vectors
//! `[C]`, all contiguous. Errors: every public op validates its inputs and returns a
//! [`ReferenceError`] naming the tensor at fault; none panics on bad input.
//!
//! # Recipe: one CBR training step (fused route, docs/cudnn-graphs.md §8)
//! Forward, per conv layer `i` (the first layer's input is the network input `x`):
//! 1. [`fprop_genstats`]`(p_i, input, w_i)` → `y_i` (FP16), `sum`, `sqsum`; with
//!    `input = ConvInput::Plain(x)` for the first layer, else
//!    `ConvInput::Prologue { y_prev: y_{i-1}, scale: eq_scale_{i-1}, bias: eq_bias_{i-1} }`.
//! 2. [`bn_finalize`]`(stats, γ_i, β_i, running_i, count = N·P·Q, params)` → `eq_scale_i`,
//!    `eq_bias_i` (FP16), saved mean / inverse std (FP32); running stats updated in place.
//! 3. Where an activation must be stored: [`bn_apply`]`(y_i, eq_scale_i, eq_bias_i, residual)`.
//!
//! Backward, per layer `i` from the last, given `dy_i = ∂L/∂y_i`:
//! 1. [`dgrad_drelu_dbn`]`(p_i, dy_i, w_i, y_{i-1}, saved BN_{i-1}, join)` → `dz_{i-1}` (FP16),
//!    `dγ_{i-1}`, `dβ_{i-1}`, coefficients `a`, `b`, `c`.
//! 2. [`wgrad_with_prologue`]`(p_i, input, dy_i)` → `dw_i` (FP16), with the forward's `input`.
//! 3. [`dbn_apply`]`(dz_{i-1}, y_{i-1}, a, b, c)` → `dy_{i-1}` (FP16).
//! 4. The first conv: [`conv_wgrad`], and [`conv_dgrad`] if `∂L/∂x` is needed. A BN whose output
//!    feeds no conv: [`relu_bwd`] + [`bn_bwd`].
//!
//! The unfused route uses [`conv_fprop`], [`bn_fwd_train`], [`relu_fwd`], [`add`] forward and
//! [`relu_bwd`], [`bn_bwd`], [`conv_dgrad`], [`conv_wgrad`] backward. This crate's unit tests
//! compose either route for a chain of layers (a private `chain` module) and check the two
//! against each other.
//!
//! # Where values are rounded to FP16 (FP16 mode)
//! | op | rounded to FP16 | stays FP32 (or summed in f64, then FP32) |
//! |---|---|---|
//! | conv fprop / dgrad / wgrad | `y`, `dx`, `dw`, once after FP32 accumulation | accumulation |
//! | prologue | `relu(y_prev·scale + bias)`, before the conv (**assumption**) | the arithmetic |
//! | GenStats | – | `sum`, `sqsum` (f64 sums of the stored FP16 `y`) |
//! | BN finalize | `eq_scale`, `eq_bias` | saved mean / inv std, running stats (f64 math) |
//! | apply, add, ReLU, dBN apply | the output | the arithmetic |
//! | dgrad_drelu_dbn | `dz` | dgrad output (virtual), recompute, `dγ`, `dβ`, `a`, `b`, `c` |
//! | unfused BN forward / backward | `out` / `dx` | statistics, `dγ`, `dβ` |
//!
//! # Semantics the GPU must confirm (docs/cudnn-graphs.md §10)
//! - BN finalize: biased batch variance for normalization, unbiased for the running variance,
//!   `momentum` = weight of the new statistic, `eq_bias = β − μ·γ·inv_std` (crates/3-fusion/src/reference/bn.rs).
//! - The prologue's output is rounded to FP16 before the conv (crates/3-fusion/src/reference/fused.rs).
//! - GenStats sums the stored FP16 `y`; BN_BWD_WEIGHTS reduces the stored FP16 `dz`.
//! - `a`, `b`, `c` of BN_BWD_WEIGHTS are the coefficients derived in crates/3-fusion/src/reference/bn.rs.
//! - ReLU backward passes no gradient at exactly 0.
#![warn(missing_docs)]

pub(crate) mod bn;
// A chain of layers on either route: the route-parity oracle of this crate's unit tests
// (module `tests`), not part of the API.
#[cfg(test)]
mod chain;
pub(crate) mod conv;
mod convert;
pub(crate) mod direct;
pub(crate) mod element;
pub(crate) mod error;
pub(crate) mod fused;
pub(crate) mod maps;
pub(crate) mod parallel;
pub(crate) mod params;
pub(crate) mod pointwise;
mod prologue;
pub(crate) mod simd;
pub(crate) mod sums;
pub(crate) mod transpose;

#[cfg(test)]
mod tests;

pub use bn::{
    bn_bwd, bn_eval_finalize, bn_finalize, bn_fwd_train, genstats, BnBackward, BnFinalized,
    BnForward, ChannelStats, RunningStats,
};
#[cfg(test)]
pub(crate) use chain::{weighted_sum_loss, CbrChain, CbrLayer, Route};
pub use conv::{conv_dgrad, conv_dgrad_into, conv_fprop, conv_wgrad};
pub use convert::cpu_paths;
pub use element::{Element, Real};
pub use error::ReferenceError;
pub(crate) use fused::{
    conv_dgrad_into_slice, dgrad_drelu_dbn_into_slice, fprop_genstats_into_slice,
};
pub use fused::{
    conv_dgrad_with, dgrad_drelu_dbn, dgrad_drelu_dbn_with, fprop_genstats, fprop_genstats_with,
    wgrad_with_prologue, wgrad_with_prologue_with, ConvInput, ConvScratch, DgradDreluDbn,
    FpropStats, InputStamp, ReluJoin, SavedBn,
};
pub use maps::PointwiseMap;
pub use params::{BnParams, ConvParams, Nhwc};
pub use pointwise::{
    add, add_into, add_into_slice, bn_apply, bn_apply_into, dbn_apply, dbn_apply_into, relu_bwd,
    relu_bwd_into, relu_fwd, Activation, Residual,
};
pub(crate) use pointwise::{bn_apply_into_slice, dbn_apply_into_slice, relu_bwd_into_slice};
pub use simd::{cpu_simd_from_env, CpuSimd, CPU_SIMD_ENV};
