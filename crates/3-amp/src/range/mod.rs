//! Range ops: one kernel launch over a byte range of the memory plan, and their CPU twins.
//!
//! Each op here is the CPU twin of a CUDA kernel in `crates/3-amp/kernels/` (see [`crate::kernels`]):
//! same inputs, same element-by-element results, same flag-skip and clip semantics. The twins
//! take host slices; a slice is what the kernel sees between `base + range.start` and
//! `base + range.end` of a region.
//!
//! One training step, in launch order (every op is sync-free; S is read on the device):
//! 1. [`zero_f32`] over G (the whole region; padding must stay zero for the check).
//! 2. Backward writes conv wgrads FP16 into G16 and FC/BN grads FP32 into G; the loss seed
//!    is [`softmax_xent_backward`], which multiplies by the loss scale from S.
//! 3. [`cast_f16_to_f32`] over each of [`crate::plan::MemoryPlan::g16_cast_ranges`] (G16→G).
//!    With gradient accumulation over N micro-batches, [`accum_grads`] instead: the first
//!    N − 1 micro-batches add G16 and G into the accumulator GA, the last adds and drains
//!    GA into G.
//! 4. [`check_grads`] over G or per bucket, by [`OverflowPolicy`]: sets the flag in S.
//!    With clipping by norm, then [`grad_norm`] over G: the global norm into S.
//! 5. [`sgd_step`] over W/M/G/A: unscales by 1/scale (times the clipping factor), skips
//!    when the flag is set, writes A.
//! 6. [`ema_update`] over E/E16 from W (optional): skips when the flag is set.
//! 7. [`update_loss_scale`]: backs off or grows the scale, counts, clears the flag.
//!
//! The network's own ops around that step (pooling, the FC layer, the residual gradient join,
//! the per-step metrics log) and their twins are crate `cudnn-cbr-netops`'s.
//!
//! [`cast_f32_to_f16`] (W→A, E→E16) is for initialisation and checkpoint loading; in the
//! loop SGD and EMA write the FP16 copies themselves.
//!
//! Padding bytes of every slot are zero at allocation and stay zero: every op maps zeros to
//! zeros, so a whole-region launch never raises the flag on padding.

#![forbid(unsafe_code)]

mod accum;
mod blocks;
mod cast;
mod check;
mod norm;
mod optim;
mod scalars;
mod scale;
mod seed;
#[cfg(test)]
mod tests;

pub use accum::accum_grads;
pub use cast::{
    cast_f16_to_f32, cast_f32_to_f16, check_len, f16_to_f32, f32_to_f16, F16_CANONICAL_NAN,
    F32_CANONICAL_NAN,
};
pub use check::{check_and_clip, check_grads, check_nonfinite, CheckOutcome, OverflowPolicy};
pub use norm::{grad_norm, NORM_THREADS};
pub use optim::{ema_update, sgd_step, zero_bytes, zero_f16, zero_f32, SgdConfig, StepOutcome};
pub use scalars::{s_layout, Scalars, S_REGION_BYTES};
pub use scale::{
    update_loss_scale, LossScalePolicy, ScaleGrowth, ScaleUpdate, BACKOFF_FACTOR,
    DEFAULT_INIT_SCALE, DEFAULT_MAX_SCALE, MIN_LOSS_SCALE,
};
pub use seed::softmax_xent_backward;
