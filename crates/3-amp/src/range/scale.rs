//! Loss-scale policy and its on-device update.
//!
//! The update runs as one single-thread kernel at the end of each step: it reads the
//! overflow flag, moves the scale and the counters, and clears the flag. Nothing is read
//! back to the host.

use crate::error::RangeOpError;
use crate::range::scalars::Scalars;

/// Initial loss scale of the default policy, 2^13.
pub const DEFAULT_INIT_SCALE: f32 = 8192.0;
/// The scale never goes below this (a scale < 1 would shrink small gradients further).
pub const MIN_LOSS_SCALE: f32 = 1.0;
/// Factor applied to the scale on overflow ("halves").
pub const BACKOFF_FACTOR: f32 = 0.5;
/// Default ceiling of a growing scale, 2^24: far above what FP16 gradients tolerate, but
/// finite, so a long run of good steps can never grow the scale to Inf (an Inf scale would
/// stay Inf: Inf × 0.5 = Inf).
pub const DEFAULT_MAX_SCALE: f32 = 16_777_216.0;

/// Optional growth of the loss scale, done on the device with the counter in S.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleGrowth {
    /// Grow after this many consecutive applied steps (≥ 1).
    pub interval: u32,
    /// Multiply by this when growing (finite, > 1).
    pub factor: f32,
    /// Never grow above this (finite, ≥ the initial scale).
    pub max_scale: f32,
}

/// How the loss scale moves.
///
/// Default: fixed policy, start at 8192, halve on overflow, never below 1, never grow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalePolicy {
    /// Starting scale (finite, ≥ 1).
    pub init_scale: f32,
    /// `None` (default): never grow.
    pub growth: Option<ScaleGrowth>,
}

impl Default for LossScalePolicy {
    fn default() -> Self {
        LossScalePolicy {
            init_scale: DEFAULT_INIT_SCALE,
            growth: None,
        }
    }
}

impl LossScalePolicy {
    /// Fixed policy starting at `init_scale`.
    pub const fn fixed(init_scale: f32) -> Self {
        LossScalePolicy {
            init_scale,
            growth: None,
        }
    }

    /// Adds growth: ×`factor` after `interval` good steps, capped at [`DEFAULT_MAX_SCALE`]
    /// (change `growth.max_scale` for another cap).
    pub const fn with_growth(mut self, interval: u32, factor: f32) -> Self {
        self.growth = Some(ScaleGrowth {
            interval,
            factor,
            max_scale: DEFAULT_MAX_SCALE,
        });
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`RangeOpError::InvalidConfig`] naming the bad field.
    pub fn validate(&self) -> Result<(), RangeOpError> {
        let bad = |field, value: String, why| {
            Err(RangeOpError::InvalidConfig {
                op: "LossScalePolicy",
                field,
                value,
                why,
            })
        };
        if !(self.init_scale.is_finite() && self.init_scale >= MIN_LOSS_SCALE) {
            return bad(
                "init_scale",
                self.init_scale.to_string(),
                "must be finite and >= 1",
            );
        }
        if let Some(g) = self.growth {
            if g.interval == 0 {
                return bad("growth.interval", "0".into(), "must be >= 1");
            }
            if !(g.factor.is_finite() && g.factor > 1.0) {
                return bad(
                    "growth.factor",
                    g.factor.to_string(),
                    "must be finite and > 1",
                );
            }
            if !(g.max_scale.is_finite() && g.max_scale >= self.init_scale) {
                return bad(
                    "growth.max_scale",
                    g.max_scale.to_string(),
                    "must be finite and >= init_scale",
                );
            }
        }
        Ok(())
    }

    /// The kernel's arguments `(growth_interval, growth_factor, max_scale)`; interval 0 is
    /// the fixed policy.
    pub fn kernel_args(&self) -> (u32, f32, f32) {
        match self.growth {
            None => (0, 1.0, self.init_scale),
            Some(g) => (g.interval, g.factor, g.max_scale),
        }
    }
}

/// What one update did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleUpdate {
    /// The step overflowed: scale backed off (or stayed at the minimum).
    BackedOff,
    /// The step was good and the scale grew.
    Grew,
    /// The step was good and the scale stayed.
    Kept,
}

/// CPU twin of `amp_loss_scale_update`.
///
/// Overflow: `scale = max(scale * 0.5, 1)`, tracker = 0, `skipped += 1`.
/// Otherwise: `step += 1`, `tracker += 1`, and with growth, when `tracker >= interval`:
/// `scale = min(scale * factor, max_scale)`, tracker = 0. Always: flag cleared. Counters wrap.
///
/// # Errors
/// As [`LossScalePolicy::validate`].
pub fn update_loss_scale(
    s: &mut Scalars,
    policy: &LossScalePolicy,
) -> Result<ScaleUpdate, RangeOpError> {
    policy.validate()?;
    let (interval, factor, max_scale) = policy.kernel_args();
    let outcome = if s.overflow != 0 {
        s.loss_scale = (s.loss_scale * BACKOFF_FACTOR).max(MIN_LOSS_SCALE);
        s.growth_tracker = 0;
        s.skipped = s.skipped.wrapping_add(1);
        ScaleUpdate::BackedOff
    } else {
        s.step = s.step.wrapping_add(1);
        s.growth_tracker = s.growth_tracker.wrapping_add(1);
        if interval != 0 && s.growth_tracker >= interval {
            s.loss_scale = (s.loss_scale * factor).min(max_scale);
            s.growth_tracker = 0;
            ScaleUpdate::Grew
        } else {
            ScaleUpdate::Kept
        }
    };
    s.overflow = 0;
    Ok(outcome)
}
