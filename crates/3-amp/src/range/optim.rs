//! Zeroing, SGD and EMA over a range.
//!
//! SGD and EMA read the overflow flag first and return at once when it is set: weights,
//! momentum, EMA and their FP16 copies are left exactly as they were. On the device every
//! thread reads the flag itself, so the host never waits for the check.
//!
//! The arithmetic is written one rounding at a time, in the same order as the kernels, which
//! are compiled with `--fmad=false`: no fused multiply-add on either side, so the CPU twin
//! is bit-exact with the device.

use half::f16;

use super::blocks;
use crate::error::RangeOpError;
use crate::range::cast::check_len;
use crate::range::scalars::Scalars;

/// CPU twin of `amp_zero_bytes`: every byte 0.
pub fn zero_bytes(dst: &mut [u8]) {
    dst.fill(0);
}

/// Zeroes an FP32 range (all bits 0, i.e. +0.0), like `amp_zero_bytes` over its bytes.
pub fn zero_f32(dst: &mut [f32]) {
    dst.fill(0.0);
}

/// Zeroes an FP16 range (all bits 0, i.e. +0.0), like `amp_zero_bytes` over its bytes.
pub fn zero_f16(dst: &mut [f16]) {
    dst.fill(f16::ZERO);
}

/// Whether an optimizer or EMA step ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// The flag was clear; the update was applied.
    Applied,
    /// The flag was set; nothing was written.
    Skipped,
}

/// SGD hyper-parameters (PyTorch's SGD without dampening).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (finite, ≥ 0). The step keeps it in S (read by the SGD kernel), so a
    /// schedule costs no sync and captured steps follow it.
    pub lr: f32,
    /// Momentum (finite, in [0, 1)); 0 needs no M region.
    pub momentum: f32,
    /// L2 weight decay added to the unscaled gradient (finite, ≥ 0).
    pub weight_decay: f32,
    /// Nesterov momentum (needs momentum > 0).
    pub nesterov: bool,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub const fn new(lr: f32) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Sets the momentum.
    pub const fn with_momentum(mut self, momentum: f32) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the weight decay.
    pub const fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Turns Nesterov momentum on or off.
    pub const fn with_nesterov(mut self, on: bool) -> Self {
        self.nesterov = on;
        self
    }

    /// This configuration's structure (Nesterov) with `other`'s values (learning rate,
    /// momentum, weight decay): equal to `other` exactly when only values differ.
    pub fn with_values_of(&self, other: &SgdConfig) -> SgdConfig {
        SgdConfig {
            lr: other.lr,
            momentum: other.momentum,
            weight_decay: other.weight_decay,
            nesterov: self.nesterov,
        }
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`RangeOpError::InvalidConfig`] naming the bad field.
    pub fn validate(&self) -> Result<(), RangeOpError> {
        let bad = |field, value: f32, why| {
            Err(RangeOpError::InvalidConfig {
                op: "SgdConfig",
                field,
                value: value.to_string(),
                why,
            })
        };
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", self.lr, "must be finite and >= 0");
        }
        if !(self.momentum.is_finite() && (0.0..1.0).contains(&self.momentum)) {
            return bad("momentum", self.momentum, "must be in [0, 1)");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", self.weight_decay, "must be finite and >= 0");
        }
        if self.nesterov && self.momentum == 0.0 {
            return bad("momentum", self.momentum, "Nesterov needs momentum > 0");
        }
        Ok(())
    }
}

/// CPU twin of `amp_sgd_step` over one range: the learning rate, momentum and weight decay
/// are read from `s` (the S region), as the kernel reads them.
///
/// Flag set: returns [`StepOutcome::Skipped`] with nothing written. Otherwise, per element,
/// with `inv = 1 / loss_scale` (`1 / (loss_scale · ranks)` over several ranks,
/// [`Scalars::unscale`]), times [`Scalars::clip_factor`] when S's `clip_norm` is set:
/// ```text
/// g' = g * inv
/// g' = g' + wd * w                       (only if wd != 0)
/// m  = mu * m + g'; d = nesterov ? g' + mu * m : m     (only if mu != 0; else d = g')
/// w  = w - lr * d
/// a  = f16(w)                            (round to nearest even, canonical NaN)
/// ```
/// `m` may be `None` only when momentum is 0 (as the kernel gets a null M pointer).
///
/// # Errors
/// [`RangeOpError::InvalidConfig`] for bad hyper-parameters in `s` or a missing momentum
/// buffer, [`RangeOpError::LengthMismatch`] when the slices differ in length.
pub fn sgd_step(
    w: &mut [f32],
    m: Option<&mut [f32]>,
    g: &[f32],
    a: &mut [f16],
    s: &Scalars,
    nesterov: bool,
) -> Result<StepOutcome, RangeOpError> {
    const OP: &str = "sgd_step";
    let cfg = s.sgd(nesterov);
    cfg.validate()?;
    let n = w.len();
    check_len(OP, "g", n, g.len())?;
    check_len(OP, "a", n, a.len())?;
    let m = match m {
        Some(m) => {
            check_len(OP, "m", n, m.len())?;
            Some(m)
        }
        None if cfg.momentum != 0.0 => {
            return Err(RangeOpError::InvalidConfig {
                op: OP,
                field: "m",
                value: "None".into(),
                why: "momentum != 0 needs a momentum buffer (region M)",
            })
        }
        None => None,
    };
    if s.overflow != 0 {
        return Ok(StepOutcome::Skipped);
    }
    // Times the global-norm clipping factor (1 without clipping, so `inv` is then unchanged).
    let rule = SgdRule {
        inv: s.unscale() * s.clip_factor(),
        wd: cfg.weight_decay,
        mu: cfg.momentum,
        lr: cfg.lr,
        nesterov: cfg.nesterov,
    };
    // Without momentum the buffer is not touched (the kernel's `d = g'`).
    let ms: Vec<Option<&mut [f32]>> = match m.filter(|_| cfg.momentum != 0.0) {
        Some(m) => blocks::tasks_mut(m).into_iter().map(Some).collect(),
        None => (0..n.div_ceil(blocks::PER_TASK)).map(|_| None).collect(),
    };
    let items: Vec<_> = blocks::tasks_mut(w)
        .into_iter()
        .zip(blocks::tasks_mut(a))
        .zip(blocks::tasks(g))
        .zip(ms)
        .collect();
    blocks::run(items, |(((w, a), g), m)| rule.apply(w, m, g, a));
    Ok(StepOutcome::Applied)
}

/// One SGD update's values, applied block by block ([`sgd_step`]'s formula, one rounding at a
/// time in its order).
#[derive(Clone, Copy)]
struct SgdRule {
    inv: f32,
    wd: f32,
    mu: f32,
    lr: f32,
    nesterov: bool,
}

impl SgdRule {
    /// `w`, `m` (momentum on) and `a` of one task from its gradients `g`.
    fn apply(&self, w: &mut [f32], mut m: Option<&mut [f32]>, g: &[f32], a: &mut [f16]) {
        for r in blocks::block_ranges(w.len()) {
            let (w, g) = (&mut w[r.clone()], &g[r.clone()]);
            match m.as_deref_mut() {
                Some(m) => self.with_momentum(w, &mut m[r.clone()], g),
                None => self.plain(w, g),
            }
            blocks::narrow(w, &mut a[r]);
        }
    }

    /// The unscaled, decayed gradient of one element.
    #[inline(always)]
    fn grad(&self, g: f32, w: f32) -> f32 {
        let g = g * self.inv;
        if self.wd != 0.0 {
            g + self.wd * w
        } else {
            g
        }
    }

    fn plain(&self, w: &mut [f32], g: &[f32]) {
        for (w, &g) in w.iter_mut().zip(g) {
            let d = self.grad(g, *w);
            *w -= self.lr * d;
        }
    }

    fn with_momentum(&self, w: &mut [f32], m: &mut [f32], g: &[f32]) {
        for ((w, m), &g) in w.iter_mut().zip(m.iter_mut()).zip(g) {
            let gi = self.grad(g, *w);
            let mi = self.mu * *m + gi;
            *m = mi;
            let d = if self.nesterov { gi + self.mu * mi } else { mi };
            *w -= self.lr * d;
        }
    }
}

/// CPU twin of `amp_ema_update` over one range.
///
/// Flag set: [`StepOutcome::Skipped`], nothing written. Otherwise per element:
/// `e = decay * e + (1 - decay) * w` (the `1 - decay` rounded once to f32), `e16 = f16(e)`.
///
/// # Errors
/// [`RangeOpError::InvalidConfig`] when `decay` is not in [0, 1],
/// [`RangeOpError::LengthMismatch`] when the slices differ in length.
pub fn ema_update(
    e: &mut [f32],
    e16: &mut [f16],
    w: &[f32],
    s: &Scalars,
    decay: f32,
) -> Result<StepOutcome, RangeOpError> {
    const OP: &str = "ema_update";
    if !(0.0..=1.0).contains(&decay) {
        return Err(RangeOpError::InvalidConfig {
            op: OP,
            field: "decay",
            value: decay.to_string(),
            why: "must be in [0, 1]",
        });
    }
    check_len(OP, "e16", e.len(), e16.len())?;
    check_len(OP, "w", e.len(), w.len())?;
    if s.overflow != 0 {
        return Ok(StepOutcome::Skipped);
    }
    let keep = decay;
    let take = 1.0f32 - decay;
    let items: Vec<_> = blocks::tasks_mut(e)
        .into_iter()
        .zip(blocks::tasks_mut(e16))
        .zip(blocks::tasks(w))
        .collect();
    blocks::run(items, |((e, e16), w)| {
        for r in blocks::block_ranges(e.len()) {
            let e = &mut e[r.clone()];
            for (ei, &wi) in e.iter_mut().zip(&w[r.clone()]) {
                *ei = keep * *ei + take * wi;
            }
            blocks::narrow(e, &mut e16[r]);
        }
    });
    Ok(StepOutcome::Applied)
}
