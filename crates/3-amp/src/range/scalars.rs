//! [`Scalars`]: the S region, on the host.
//!
//! S is one 256-byte slot, little-endian like every CUDA device. The CUDA side declares the
//! same layout as `struct AmpScalars` in `kernels/amp_common.cuh`, with `static_assert`s on
//! each offset, so a drift between the two fails the NVRTC compile test.
//!
//! | offset | type | field            | written by                           |
//! |-------:|------|------------------|--------------------------------------|
//! |      0 | f32  | `loss_scale`     | loss-scale update                    |
//! |      4 | u32  | `overflow`       | check (sets to 1), update (clears)   |
//! |      8 | u32  | `growth_tracker` | loss-scale update                    |
//! |     12 | u32  | `step`           | loss-scale update (applied steps)    |
//! |     16 | u32  | `skipped`        | loss-scale update (skipped steps)    |
//! |     20 | f32  | `lr`             | the host, between steps (SGD reads)  |
//! |     24 | f32  | `momentum`       | the host, between steps (SGD reads)  |
//! |     28 | f32  | `weight_decay`   | the host, between steps (SGD reads)  |
//! |     32 | u32  | `ranks`          | the host, at start (SGD reads)       |
//! |     36 | f32  | `clip_norm`      | the host (SGD reads; 0: no clipping) |
//! |     40 | f32  | `grad_norm`      | gradient-norm op (SGD reads)         |
//! |     44 | u32  | `accum`          | the host, at start (SGD reads)       |
//! |  48–63 | —    | reserved, zero   | nobody                               |
//! | 64–191 | f32×32 | `norm_partials` | gradient-norm op (its block sums)   |
//! |192–255 | —    | reserved, zero   | nobody                               |
//!
//! The SGD hyper-parameters live here rather than in the kernel's launch arguments so that a
//! step captured once as a CUDA graph follows a learning-rate schedule: the host writes the
//! new values into S between replays (`AmpStep::set_lr`).

use crate::error::RangeOpError;
use crate::range::optim::SgdConfig;
use crate::range::scale::LossScalePolicy;

/// Size of the S region in bytes (one slot).
pub const S_REGION_BYTES: usize = 256;

/// Byte offsets of the fields of the S region.
pub mod s_layout {
    /// `f32` current loss scale.
    pub const LOSS_SCALE: usize = 0;
    /// `u32` overflow flag of the current step: 0 clear, nonzero found NaN/Inf.
    pub const OVERFLOW: usize = 4;
    /// `u32` applied steps since the scale last changed (drives growth).
    pub const GROWTH_TRACKER: usize = 8;
    /// `u32` applied (not skipped) optimizer steps, wrapping.
    pub const STEP: usize = 12;
    /// `u32` skipped steps (overflow), wrapping.
    pub const SKIPPED: usize = 16;
    /// `f32` SGD learning rate.
    pub const LR: usize = 20;
    /// `f32` SGD momentum.
    pub const MOMENTUM: usize = 24;
    /// `f32` SGD weight decay.
    pub const WEIGHT_DECAY: usize = 28;
    /// `u32` data-parallel ranks whose gradient sums G holds (0 and 1: one rank).
    pub const RANKS: usize = 32;
    /// `f32` the global-norm clipping bound (`max_norm`); 0: no clipping.
    pub const CLIP_NORM: usize = 36;
    /// `f32` the global L2 norm of the unscaled gradients, written by the gradient-norm op.
    pub const GRAD_NORM: usize = 40;
    /// `u32` micro-batches whose gradients G sums (gradient accumulation; 0 and 1: one).
    pub const ACCUM: usize = 44;
    /// Bytes of the scalar fields before [`ACCUM`]; [`super::Scalars::from_bytes`] needs at
    /// least these (an image that ends before `ACCUM`, as images written before it existed
    /// do, reads `accum` as 0: one micro-batch).
    pub const USED: usize = 44;
    /// `[f32; NORM_BLOCKS]` the gradient-norm op's per-block sums of squares.
    pub const NORM_PARTIALS: usize = 64;
    /// Blocks (and partial sums) of the gradient-norm reduction.
    pub const NORM_BLOCKS: usize = 32;
}

/// Host mirror of the S region: what the device scalars hold between kernels.
///
/// The CPU range ops read and write it exactly as the kernels read and write S.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scalars {
    /// Current loss scale (the loss gradient seed is multiplied by it).
    pub loss_scale: f32,
    /// Overflow flag of the current step: set by the check, cleared by the scale update.
    pub overflow: u32,
    /// Applied steps since the scale last changed.
    pub growth_tracker: u32,
    /// Applied optimizer steps (wrapping).
    pub step: u32,
    /// Skipped optimizer steps (wrapping).
    pub skipped: u32,
    /// SGD learning rate.
    pub lr: f32,
    /// SGD momentum (0: the momentum buffer is not touched).
    pub momentum: f32,
    /// SGD weight decay.
    pub weight_decay: f32,
    /// Data-parallel ranks whose summed gradients G holds: SGD unscales by
    /// `1 / (loss_scale · ranks)`, which averages them at no extra cost (0 and 1: one rank,
    /// `1 / loss_scale` exactly).
    pub ranks: u32,
    /// Global-norm clipping bound (PyTorch's `max_norm`); 0 turns clipping off. SGD scales
    /// every gradient by `min(1, clip_norm / (grad_norm + 1e-6))` ([`Scalars::clip_factor`]).
    pub clip_norm: f32,
    /// The global L2 norm of the unscaled gradients of the current step, written by the
    /// gradient-norm op ([`crate::range::grad_norm`]) before SGD reads it.
    pub grad_norm: f32,
    /// Micro-batches whose summed gradients G holds (gradient accumulation,
    /// [`crate::range::accum_grads`]): SGD unscales by `1 / (loss_scale · ranks · accum)`,
    /// which averages them at no extra cost (0 and 1: one micro-batch).
    pub accum: u32,
    /// The gradient-norm op's per-block sums of squares (its fixed summation order).
    pub norm_partials: [f32; s_layout::NORM_BLOCKS],
}

impl Scalars {
    /// Fresh scalars for `policy`: scale at its initial value, flag clear, counters zero,
    /// SGD hyper-parameters zero (set them with [`Scalars::with_sgd`]).
    pub fn new(policy: &LossScalePolicy) -> Self {
        Scalars {
            loss_scale: policy.init_scale,
            overflow: 0,
            growth_tracker: 0,
            step: 0,
            skipped: 0,
            lr: 0.0,
            momentum: 0.0,
            weight_decay: 0.0,
            ranks: 1,
            clip_norm: 0.0,
            grad_norm: 0.0,
            accum: 1,
            norm_partials: [0.0; s_layout::NORM_BLOCKS],
        }
    }

    /// These scalars with `sgd`'s learning rate, momentum and weight decay.
    pub fn with_sgd(mut self, sgd: &SgdConfig) -> Self {
        self.lr = sgd.lr;
        self.momentum = sgd.momentum;
        self.weight_decay = sgd.weight_decay;
        self
    }

    /// The SGD configuration these scalars hold, with `nesterov` (which is a property of the
    /// step, not of S).
    pub fn sgd(&self, nesterov: bool) -> SgdConfig {
        SgdConfig {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            nesterov,
        }
    }

    /// The unscale factor of SGD: `1 / loss_scale`, or `1 / (loss_scale · ranks · accum)`
    /// for a data-parallel step over more than one rank and a step that accumulates more than
    /// one micro-batch ([`Scalars::unscale_denominator`]).
    pub fn unscale(&self) -> f32 {
        1.0f32 / self.unscale_denominator()
    }

    /// What G is divided by to unscale and average it: `loss_scale`, times `ranks` when
    /// above 1, then times `accum` when above 1, each product rounded once, as the kernels
    /// (`amp_sgd_step`, `amp_grad_norm`). With one rank and one micro-batch it is exactly
    /// the loss scale.
    pub fn unscale_denominator(&self) -> f32 {
        let mut denom = self.loss_scale;
        if self.ranks > 1 {
            denom *= self.ranks as f32;
        }
        if self.accum > 1 {
            denom *= self.accum as f32;
        }
        denom
    }

    /// The factor SGD multiplies the unscale by: 1 without clipping (`clip_norm` 0), else
    /// `min(1, clip_norm / (grad_norm + 1e-6))`, as PyTorch's `clip_grad_norm_` (each
    /// operation rounded once, as the kernel).
    pub fn clip_factor(&self) -> f32 {
        if self.clip_norm == 0.0 {
            return 1.0;
        }
        let f = self.clip_norm / (self.grad_norm + 1e-6f32);
        if f < 1.0 {
            f
        } else {
            1.0
        }
    }

    /// Checks what a step cannot recover from: a loss scale that is NaN, infinite or ≤ 0.
    /// (0 makes the unscale factor infinite and every master weight NaN after one step; +Inf
    /// overflows every gradient, so every step is skipped and the scale never moves again.)
    ///
    /// # Errors
    /// [`RangeOpError::InvalidConfig`] naming `loss_scale` and its value.
    pub fn validate(&self) -> Result<(), RangeOpError> {
        if !(self.loss_scale.is_finite() && self.loss_scale > 0.0) {
            return Err(RangeOpError::InvalidConfig {
                op: "Scalars",
                field: "loss_scale",
                value: self.loss_scale.to_string(),
                why: "must be finite and > 0",
            });
        }
        if !(self.clip_norm.is_finite() && self.clip_norm >= 0.0) {
            return Err(RangeOpError::InvalidConfig {
                op: "Scalars",
                field: "clip_norm",
                value: self.clip_norm.to_string(),
                why: "must be finite and >= 0 (0: no clipping)",
            });
        }
        Ok(())
    }

    /// Whether the overflow flag is set (the optimizer and EMA will skip).
    pub fn overflowed(&self) -> bool {
        self.overflow != 0
    }

    /// The S region's byte image, to upload once at start (reserved bytes zero).
    pub fn to_bytes(&self) -> [u8; S_REGION_BYTES] {
        let mut out = [0u8; S_REGION_BYTES];
        let mut put = |at: usize, b: [u8; 4]| out[at..at + 4].copy_from_slice(&b);
        put(s_layout::LOSS_SCALE, self.loss_scale.to_le_bytes());
        put(s_layout::OVERFLOW, self.overflow.to_le_bytes());
        put(s_layout::GROWTH_TRACKER, self.growth_tracker.to_le_bytes());
        put(s_layout::STEP, self.step.to_le_bytes());
        put(s_layout::SKIPPED, self.skipped.to_le_bytes());
        put(s_layout::LR, self.lr.to_le_bytes());
        put(s_layout::MOMENTUM, self.momentum.to_le_bytes());
        put(s_layout::WEIGHT_DECAY, self.weight_decay.to_le_bytes());
        put(s_layout::RANKS, self.ranks.to_le_bytes());
        put(s_layout::CLIP_NORM, self.clip_norm.to_le_bytes());
        put(s_layout::GRAD_NORM, self.grad_norm.to_le_bytes());
        put(s_layout::ACCUM, self.accum.to_le_bytes());
        for (k, p) in self.norm_partials.iter().enumerate() {
            put(s_layout::NORM_PARTIALS + 4 * k, p.to_le_bytes());
        }
        out
    }

    /// Reads scalars back from an S region image (at least [`s_layout::USED`] bytes), checked
    /// with [`Scalars::validate`].
    ///
    /// # Errors
    /// [`RangeOpError::ScalarsTooShort`] when `bytes` is too short;
    /// [`RangeOpError::InvalidConfig`] for a NaN, infinite or non-positive loss scale.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, RangeOpError> {
        if bytes.len() < s_layout::USED {
            return Err(RangeOpError::ScalarsTooShort {
                got: bytes.len(),
                needed: s_layout::USED,
            });
        }
        let word = |at: usize| [bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]];
        let s = Scalars {
            loss_scale: f32::from_le_bytes(word(s_layout::LOSS_SCALE)),
            overflow: u32::from_le_bytes(word(s_layout::OVERFLOW)),
            growth_tracker: u32::from_le_bytes(word(s_layout::GROWTH_TRACKER)),
            step: u32::from_le_bytes(word(s_layout::STEP)),
            skipped: u32::from_le_bytes(word(s_layout::SKIPPED)),
            lr: f32::from_le_bytes(word(s_layout::LR)),
            momentum: f32::from_le_bytes(word(s_layout::MOMENTUM)),
            weight_decay: f32::from_le_bytes(word(s_layout::WEIGHT_DECAY)),
            ranks: u32::from_le_bytes(word(s_layout::RANKS)),
            clip_norm: f32::from_le_bytes(word(s_layout::CLIP_NORM)),
            grad_norm: f32::from_le_bytes(word(s_layout::GRAD_NORM)),
            accum: bytes
                .get(s_layout::ACCUM..s_layout::ACCUM + 4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            norm_partials: std::array::from_fn(|k| {
                let at = s_layout::NORM_PARTIALS + 4 * k;
                // A short image (USED bytes only) has no partials: they read as 0.
                bytes
                    .get(at..at + 4)
                    .map_or(0.0, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }),
        };
        s.validate()?;
        Ok(s)
    }
}

impl Default for Scalars {
    /// Scalars for the default (fixed, 8192) policy.
    fn default() -> Self {
        Scalars::new(&LossScalePolicy::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scale_that_no_step_recovers_from_is_refused_on_the_way_in_and_out() {
        for bad in [0.0, -0.0, -1.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let s = Scalars {
                loss_scale: bad,
                ..Scalars::default()
            };
            let e = s.validate().unwrap_err();
            assert!(
                matches!(
                    e,
                    RangeOpError::InvalidConfig {
                        field: "loss_scale",
                        ..
                    }
                ),
                "{bad}: {e:?}"
            );
            assert_eq!(Scalars::from_bytes(&s.to_bytes()).unwrap_err(), e);
        }
        // The smallest positive scale is odd but recoverable (the update raises it to 1).
        let tiny = Scalars {
            loss_scale: f32::MIN_POSITIVE,
            ..Scalars::default()
        };
        assert_eq!(Scalars::from_bytes(&tiny.to_bytes()).unwrap(), tiny);
    }
}
