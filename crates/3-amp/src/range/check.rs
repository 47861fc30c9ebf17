//! Overflow check over G (or one bucket of it), optionally clipping, by [`OverflowPolicy`].
//!
//! The check only ever SETS the flag in S (`overflow |= 1`), so several launches (one per
//! bucket) accumulate into one verdict; the loss-scale update clears it at the end of the
//! step.

use super::blocks;
use crate::error::RangeOpError;
use crate::range::scalars::Scalars;

/// What counts as an overflow in the gradients, and what happens to large values.
///
/// - [`OverflowPolicy::NanOrInf`] (default): any NaN or ±Inf sets the flag. The step is then
///   skipped (weights, momentum and EMA untouched) and the loss scale halves. Gradients that
///   are used are always exactly the computed ones; the price is a lost step whenever the
///   scale is too high, which the halving makes rare after the first few steps.
/// - [`OverflowPolicy::ClipInf`]: only NaN sets the flag; ±Inf and anything beyond `bound`
///   (in G's units, i.e. still multiplied by the loss scale) are clamped to ±`bound` in place.
///   No step is lost to an FP16 overflow, but the clamped elements are wrong in magnitude (a
///   biased update), and because Inf no longer lowers the scale, a scale that is too high
///   stays too high and keeps clipping. Use it when lost steps cost more than a little bias
///   (e.g. very short fine-tuning runs); prefer the default otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum OverflowPolicy {
    /// NaN and ±Inf both set the overflow flag.
    #[default]
    NanOrInf,
    /// Only NaN sets the flag; ±Inf and |x| > `bound` are clamped to ±`bound`.
    ClipInf {
        /// Clamp bound in G's (scaled) units; finite and > 0.
        bound: f32,
    },
}

impl OverflowPolicy {
    /// Largest finite FP16 value, the natural bound: a clamped gradient is then the largest
    /// value the FP16 wgrad could have held.
    pub const FP16_MAX: f32 = 65504.0;

    /// `ClipInf` with the bound at [`OverflowPolicy::FP16_MAX`].
    pub const fn clip_inf() -> Self {
        OverflowPolicy::ClipInf {
            bound: Self::FP16_MAX,
        }
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`RangeOpError::InvalidConfig`] when a `ClipInf` bound is not finite and > 0.
    pub fn validate(&self) -> Result<(), RangeOpError> {
        match *self {
            OverflowPolicy::NanOrInf => Ok(()),
            OverflowPolicy::ClipInf { bound } if bound.is_finite() && bound > 0.0 => Ok(()),
            OverflowPolicy::ClipInf { bound } => Err(RangeOpError::InvalidConfig {
                op: "OverflowPolicy::ClipInf",
                field: "bound",
                value: bound.to_string(),
                why: "must be finite and > 0",
            }),
        }
    }
}

/// What a CPU check found (the device only records the flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CheckOutcome {
    /// Whether this call set the overflow flag.
    pub overflow: bool,
    /// How many elements were clamped (always 0 under `NanOrInf`).
    pub clipped: usize,
}

/// CPU twin of `amp_check_nonfinite`: sets `s.overflow` if any element is NaN or ±Inf.
pub fn check_nonfinite(g: &[f32], s: &mut Scalars) -> CheckOutcome {
    // Every element is looked at (no early exit), so each task's loop is branch-free.
    let overflow = blocks::run(blocks::tasks(g), |g| {
        g.iter().fold(false, |bad, x| bad | !x.is_finite())
    })
    .contains(&true);
    if overflow {
        s.overflow |= 1;
    }
    CheckOutcome {
        overflow,
        clipped: 0,
    }
}

/// CPU twin of `amp_check_clip`: NaN sets the flag (and stays NaN); ±Inf and |x| > `bound`
/// become ±`bound`.
///
/// # Errors
/// [`RangeOpError::InvalidConfig`] when `bound` is not finite and > 0.
pub fn check_and_clip(
    g: &mut [f32],
    bound: f32,
    s: &mut Scalars,
) -> Result<CheckOutcome, RangeOpError> {
    OverflowPolicy::ClipInf { bound }.validate()?;
    let per_task = blocks::run(blocks::tasks_mut(g), |g| {
        let mut out = CheckOutcome::default();
        for x in g.iter_mut() {
            if x.is_nan() {
                out.overflow = true;
            } else if x.abs() > bound {
                *x = bound.copysign(*x);
                out.clipped += 1;
            }
        }
        out
    });
    let out = CheckOutcome {
        overflow: per_task.iter().any(|o| o.overflow),
        clipped: per_task.iter().map(|o| o.clipped).sum(),
    };
    if out.overflow {
        s.overflow |= 1;
    }
    Ok(out)
}

/// Runs the check `policy` asks for over `g`.
///
/// # Errors
/// As [`OverflowPolicy::validate`].
pub fn check_grads(
    g: &mut [f32],
    policy: OverflowPolicy,
    s: &mut Scalars,
) -> Result<CheckOutcome, RangeOpError> {
    match policy {
        OverflowPolicy::NanOrInf => Ok(check_nonfinite(g, s)),
        OverflowPolicy::ClipInf { bound } => check_and_clip(g, bound, s),
    }
}
