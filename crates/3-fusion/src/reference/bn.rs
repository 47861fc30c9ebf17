//! Batch norm: statistics (GenStats), finalize, and the unfused forward and backward.
//!
//! # Semantics (pinned here; docs/cudnn-graphs.md §3 lists what the GPU must confirm)
//! Per channel, over the `M = count` elements (`N·H·W` of the normalized tensor):
//! - batch mean `μ = Σy / M`, batch variance **biased** `σ² = Σy²/M − μ²` (clamped at 0 against
//!   cancellation), used to normalize; `inv_std = 1/sqrt(σ² + ε)`;
//! - running stats, with `f = momentum` the weight of the new batch statistic:
//!   `running_mean = (1−f)·running_mean + f·μ`,
//!   `running_var = (1−f)·running_var + f·σ²·M/(M−1)` (the **unbiased** estimate, as PyTorch);
//! - `eq_scale = γ·inv_std`, `eq_bias = β − μ·γ·inv_std`, so that the apply
//!   `y·eq_scale + eq_bias = (y − μ)·inv_std·γ + β`.
//!
//! # Backward
//! With `x̂ = (y − μ)·inv_std` and `dz` the gradient w.r.t. the BN output `z = γ·x̂ + β`:
//! `dγ = Σ dz·x̂`, `dβ = Σ dz`, and the standard BN backward
//! ```text
//! dy = γ·inv_std/M · (M·dz − Σdz − x̂·Σ(dz·x̂))
//! ```
//! Expanding `x̂` makes it affine in `dz` and `y`, `dy = a·dz + b·y + c`, with per-channel
//! ```text
//! a = γ·inv_std
//! b = −γ·inv_std²·dγ / M
//! c = −γ·inv_std·dβ / M − b·μ
//! ```
//! (check: `b·y + c = −γ·inv_std²·dγ·(y − μ)/M − γ·inv_std·dβ/M`, which are the last two
//! terms above). These are cuDNN's `EQ_DY_SCALE`, `EQ_X_SCALE` and `EQ_BIAS` of
//! `BN_BWD_WEIGHTS`, consumed by [`super::dbn_apply`].
//!
//! # Precision
//! Reductions over pixels are summed in `f64` (see `parallel::channel_sums`), and the per-channel
//! formulas above run in `f64` too; results are rounded once to their storage type: FP32 (`Acc`)
//! for sums, saved statistics, running statistics, `dγ`, `dβ`, `a`, `b`, `c`, and FP16 (`T`)
//! for `eq_scale`, `eq_bias` (the fused prologue and wgrad require FP16 scale/bias).

use super::element::{Element, Real};
use super::error::{ReferenceError, Result};
use super::parallel::{channel_sums, map_blocks};
use super::params::{check_len, BnParams, Nhwc};
use super::pointwise::dbn_apply;
use super::sums::{self, Terms};

/// Per-channel sums of a tensor and of its squares (cuDNN GenStats `SUM`, `SQSUM`; FP32 `[C]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelStats<A> {
    /// `Σ y` over `N·H·W`, per channel.
    pub sum: Vec<A>,
    /// `Σ y²` over `N·H·W`, per channel.
    pub sqsum: Vec<A>,
}

/// A BN layer's running statistics (FP32 `[C]`), updated in place by a training step.
#[derive(Debug)]
pub struct RunningStats<'a, A> {
    /// Running mean.
    pub mean: &'a mut [A],
    /// Running variance (unbiased).
    pub var: &'a mut [A],
}

/// The outputs of BN finalize (docs/cudnn-graphs.md §3).
#[derive(Debug, Clone, PartialEq)]
pub struct BnFinalized<T: Element> {
    /// `γ·inv_std`, FP16 `[C]`.
    pub eq_scale: Vec<T>,
    /// `β − μ·γ·inv_std`, FP16 `[C]`.
    pub eq_bias: Vec<T>,
    /// Batch mean `μ`, FP32 `[C]`.
    pub saved_mean: Vec<T::Acc>,
    /// `1/sqrt(σ² + ε)` with the biased batch variance, FP32 `[C]`.
    pub saved_inv_std: Vec<T::Acc>,
}

/// The outputs of the unfused BN forward in training mode.
#[derive(Debug, Clone, PartialEq)]
pub struct BnForward<T: Element> {
    /// `(y − μ)·inv_std·γ + β`, FP16, shaped like the input.
    pub out: Vec<T>,
    /// Batch mean `μ`, FP32 `[C]`.
    pub saved_mean: Vec<T::Acc>,
    /// `1/sqrt(σ² + ε)`, FP32 `[C]`.
    pub saved_inv_std: Vec<T::Acc>,
}

/// The outputs of the unfused BN backward (cuDNN NormBackward).
#[derive(Debug, Clone, PartialEq)]
pub struct BnBackward<T: Element> {
    /// Gradient w.r.t. the BN input, FP16, shaped like it.
    pub dx: Vec<T>,
    /// `Σ dz·x̂`, FP32 `[C]`.
    pub dgamma: Vec<T::Acc>,
    /// `Σ dz`, FP32 `[C]`.
    pub dbeta: Vec<T::Acc>,
}

/// GenStats: per-channel `Σy` and `Σy²` of an NHWC tensor, summed in `f64` and rounded to FP32.
///
/// The sums are of the stored (FP16) `y`, the values BN later normalizes.
pub fn genstats<T: Element>(shape: &Nhwc, y: &[T]) -> Result<ChannelStats<T::Acc>> {
    shape.validate("y")?;
    check_len("y", y, shape.elems())?;
    let c = shape.c;
    let sums = channel_sums::<2, Vec<T::Acc>, _>(shape.pixels(), c, |rows, yv, acc| {
        let chunk = &y[rows.start * c..rows.end * c];
        yv.resize(chunk.len(), T::Acc::ZERO);
        T::widen_into(chunk, yv);
        add_genstats_rows(yv, acc);
    });
    Ok(ChannelStats::from_sums(&sums))
}

/// Adds the pixels of `rows` (NHWC, `acc.len()` channels), in row order, to GenStats' `f64`
/// sums `acc[channel] = [Σy, Σy²]`.
pub(crate) fn add_genstats_rows<A: Real>(rows: &[A], acc: &mut [[f64; 2]]) {
    sums::add_rows(Terms::Genstats, rows, &[], acc);
}

impl<A: Real> ChannelStats<A> {
    /// GenStats' outputs from its `f64` sums `[Σy, Σy²]` per channel (rounded once).
    pub(crate) fn from_sums(sums: &[[f64; 2]]) -> Self {
        ChannelStats {
            sum: sums.iter().map(|s| A::from_f64(s[0])).collect(),
            sqsum: sums.iter().map(|s| A::from_f64(s[1])).collect(),
        }
    }
}

/// BN finalize: from GenStats sums over `count` elements per channel, `γ`, `β` (FP32 `[C]`) and
/// the running statistics (updated in place) → `eq_scale`, `eq_bias` (FP16), saved mean and
/// inverse std (FP32). See the module docs for the formulas.
///
/// `count` is cuDNN's `accum_count`: `N·P·Q` of the conv output the sums ran over; it must be
/// at least 2 (the unbiased running variance divides by `count − 1`).
pub fn bn_finalize<A: Real>(
    stats: &ChannelStats<A>,
    gamma: &[A],
    beta: &[A],
    running: RunningStats<'_, A>,
    count: usize,
    params: &BnParams,
) -> Result<BnFinalized<A::Storage>> {
    let c = stats.sum.len();
    if c == 0 {
        return Err(ReferenceError::ZeroDimension {
            tensor: "sum",
            dim: "c",
        });
    }
    check_len("sqsum", &stats.sqsum, c)?;
    check_len("gamma", gamma, c)?;
    check_len("beta", beta, c)?;
    let moments = batch_moments(stats, running, count, params)?;
    let mut out = BnFinalized {
        eq_scale: Vec::with_capacity(c),
        eq_bias: Vec::with_capacity(c),
        saved_mean: Vec::with_capacity(c),
        saved_inv_std: Vec::with_capacity(c),
    };
    for ((m, g), b) in moments.iter().zip(gamma).zip(beta) {
        let scale = g.to_f64() * m.inv_std;
        out.eq_scale.push(A::Storage::from_f64(scale));
        out.eq_bias
            .push(A::Storage::from_f64(b.to_f64() - m.mean * scale));
        out.saved_mean.push(A::from_f64(m.mean));
        out.saved_inv_std.push(A::from_f64(m.inv_std));
    }
    Ok(out)
}

/// BN in evaluation mode: the per-channel coefficients from the **running** statistics, no
/// batch statistics and nothing updated. In `f64`, from the stored (FP32) values:
/// ```text
/// inv_std  = 1 / sqrt(running_var + ε)
/// eq_scale = γ·inv_std                      (rounded once to the storage type: FP16)
/// eq_bias  = β − running_mean·γ·inv_std     (from the unrounded eq_scale; rounded once)
/// ```
/// the formula and rounding points of [`bn_finalize`] with the batch moments replaced by the
/// running ones (same `ε`), so `y·eq_scale + eq_bias = (y − running_mean)·inv_std·γ + β`.
/// `saved_mean` and `saved_inv_std` of the result carry `running_mean` and that `inv_std`
/// (rounded to FP32), for the unfused route's normalization (`bn_recompute`'s order).
///
/// # Errors
/// Lengths that differ from `gamma`'s, an invalid `ε`, and a running variance that is not
/// finite or below `−ε` (the square root of a negative number).
pub fn bn_eval_finalize<A: Real>(
    gamma: &[A],
    beta: &[A],
    running_mean: &[A],
    running_var: &[A],
    params: &BnParams,
) -> Result<BnFinalized<A::Storage>> {
    let c = gamma.len();
    if c == 0 {
        return Err(ReferenceError::ZeroDimension {
            tensor: "gamma",
            dim: "c",
        });
    }
    check_len("beta", beta, c)?;
    check_len("running_mean", running_mean, c)?;
    check_len("running_var", running_var, c)?;
    params.validate()?;
    let mut out = BnFinalized {
        eq_scale: Vec::with_capacity(c),
        eq_bias: Vec::with_capacity(c),
        saved_mean: Vec::with_capacity(c),
        saved_inv_std: Vec::with_capacity(c),
    };
    for k in 0..c {
        let var = running_var[k].to_f64() + params.epsilon;
        if !(var.is_finite() && var > 0.0) {
            return Err(ReferenceError::InvalidBnParam {
                param: "running_var",
                value: running_var[k].to_f64(),
                expected: "finite and greater than -epsilon",
            });
        }
        let inv_std = 1.0 / var.sqrt();
        let mean = running_mean[k].to_f64();
        let scale = gamma[k].to_f64() * inv_std;
        out.eq_scale.push(A::Storage::from_f64(scale));
        out.eq_bias
            .push(A::Storage::from_f64(beta[k].to_f64() - mean * scale));
        out.saved_mean.push(running_mean[k]);
        out.saved_inv_std.push(A::from_f64(inv_std));
    }
    Ok(out)
}

/// Unfused BN forward, training mode (cuDNN NormForward): normalizes `y` (NHWC, `shape`) with its
/// own batch statistics, `out = (y − μ)·inv_std·γ + β`, and updates the running statistics.
///
/// Statistics as [`genstats`] + [`bn_finalize`] (count `N·H·W` of `shape`). The normalization
/// runs in `T::Acc` with the saved (FP32) `μ` and `inv_std` and the FP32 `γ`, `β`, in the
/// order of the fused backward's recompute, and is rounded to `T` once.
pub fn bn_fwd_train<T: Element>(
    shape: &Nhwc,
    y: &[T],
    gamma: &[T::Acc],
    beta: &[T::Acc],
    running: RunningStats<'_, T::Acc>,
    params: &BnParams,
) -> Result<BnForward<T>> {
    let stats = genstats(shape, y)?;
    check_len("gamma", gamma, shape.c)?;
    check_len("beta", beta, shape.c)?;
    let moments = batch_moments(&stats, running, shape.pixels(), params)?;
    let mean: Vec<T::Acc> = moments.iter().map(|m| T::Acc::from_f64(m.mean)).collect();
    let inv_std: Vec<T::Acc> = moments
        .iter()
        .map(|m| T::Acc::from_f64(m.inv_std))
        .collect();
    let c = shape.c;
    let out = map_blocks(y.len(), c, |first, ins, out| {
        let yv = &mut ins[..out.len()];
        T::widen_into(&y[first..first + out.len()], yv);
        let (mean, inv_std, gamma, beta) = (&mean[..c], &inv_std[..c], &gamma[..c], &beta[..c]);
        for (o, yp) in out.chunks_exact_mut(c).zip(yv.chunks_exact(c)) {
            let (o, yp) = (&mut o[..c], &yp[..c]);
            for k in 0..c {
                o[k] = bn_recompute(yp[k], mean[k], inv_std[k], gamma[k], beta[k]);
            }
        }
    });
    Ok(BnForward {
        out,
        saved_mean: mean,
        saved_inv_std: inv_std,
    })
}

/// Unfused BN backward (cuDNN NormBackward): from the forward input `y`, the gradient `dz`
/// w.r.t. the BN output (both NHWC, `shape`), the saved statistics and `γ` (FP32 `[C]`) →
/// `dx`, `dγ`, `dβ`. Count `M = N·H·W` of `shape`.
///
/// Computed as `dx = a·dz + b·y + c` with the coefficients of the module docs, the same
/// arithmetic as the fused route's [`super::dgrad_drelu_dbn`] + [`dbn_apply`].
pub fn bn_bwd<T: Element>(
    shape: &Nhwc,
    y: &[T],
    dz: &[T],
    saved_mean: &[T::Acc],
    saved_inv_std: &[T::Acc],
    gamma: &[T::Acc],
) -> Result<BnBackward<T>> {
    shape.validate("y")?;
    check_len("y", y, shape.elems())?;
    check_len("dz", dz, shape.elems())?;
    check_len("saved_mean", saved_mean, shape.c)?;
    check_len("saved_inv_std", saved_inv_std, shape.c)?;
    check_len("gamma", gamma, shape.c)?;
    let co = BnBwdCoefficients::compute(shape, y, dz, saved_mean, saved_inv_std, gamma);
    let dx = dbn_apply(shape, dz, y, &co.a, &co.b, &co.c)?;
    Ok(BnBackward {
        dx,
        dgamma: co.dgamma,
        dbeta: co.dbeta,
    })
}

/// The recomputed BN output `((y − μ)·inv_std)·γ + β`, in the op order of cuDNN's
/// DgradDreluBNBwdWeight recompute (SUB, MUL, MUL, ADD).
pub(crate) fn bn_recompute<A: Real>(y: A, mean: A, inv_std: A, gamma: A, beta: A) -> A {
    (y - mean) * inv_std * gamma + beta
}

/// `dγ`, `dβ` and the BN-backward apply coefficients `a`, `b`, `c` (FP32 `[C]`).
pub(crate) struct BnBwdCoefficients<A> {
    pub dgamma: Vec<A>,
    pub dbeta: Vec<A>,
    pub a: Vec<A>,
    pub b: Vec<A>,
    pub c: Vec<A>,
}

impl<A: Real> BnBwdCoefficients<A> {
    /// From the BN input `y` and the stored gradient `dz` (lengths checked by the caller).
    pub fn compute<T: Element<Acc = A>>(
        shape: &Nhwc,
        y: &[T],
        dz: &[T],
        mean: &[A],
        inv_std: &[A],
        gamma: &[A],
    ) -> Self {
        let ch = shape.c;
        let mean64: Vec<f64> = mean.iter().map(|v| v.to_f64()).collect();
        let inv_std64: Vec<f64> = inv_std.iter().map(|v| v.to_f64()).collect();
        let sums = channel_sums::<2, Vec<A>, _>(shape.pixels(), ch, |rows, buf, acc| {
            let range = rows.start * ch..rows.end * ch;
            let n = range.len();
            buf.resize(2 * n, A::ZERO);
            let (yv, dv) = buf.split_at_mut(n);
            T::widen_into(&y[range.clone()], yv);
            T::widen_into(&dz[range], dv);
            Self::add_rows(yv, dv, &mean64, &inv_std64, acc);
        });
        Self::from_sums(&sums, shape.pixels(), mean, inv_std, gamma)
    }

    /// Adds the pixels of `yv` (the BN input) and `dv` (the stored gradient), in row order, to
    /// the `f64` sums `acc[channel] = [Σ dz·x̂, Σ dz]` (`acc.len()` channels; `mean64`,
    /// `inv_std64` the saved statistics widened to `f64`).
    pub(crate) fn add_rows(
        yv: &[A],
        dv: &[A],
        mean64: &[f64],
        inv_std64: &[f64],
        acc: &mut [[f64; 2]],
    ) {
        let ch = acc.len();
        let (mean, inv_std) = (&mean64[..ch], &inv_std64[..ch]);
        sums::add_rows(Terms::Bwd64 { mean, inv_std }, yv, dv, acc);
    }

    /// The coefficients from the sums [`Self::add_rows`] made over all `pixels` pixels.
    pub(crate) fn from_sums(
        sums: &[[f64; 2]],
        pixels: usize,
        mean: &[A],
        inv_std: &[A],
        gamma: &[A],
    ) -> Self {
        let ch = sums.len();
        let m = pixels as f64;
        let mut out = BnBwdCoefficients {
            dgamma: Vec::with_capacity(ch),
            dbeta: Vec::with_capacity(ch),
            a: Vec::with_capacity(ch),
            b: Vec::with_capacity(ch),
            c: Vec::with_capacity(ch),
        };
        for (k, &[dgamma, dbeta]) in sums.iter().enumerate() {
            let (g, is, mu) = (gamma[k].to_f64(), inv_std[k].to_f64(), mean[k].to_f64());
            let a = g * is;
            let b = -g * is * is * dgamma / m;
            let c = -g * is * dbeta / m - b * mu;
            out.dgamma.push(A::from_f64(dgamma));
            out.dbeta.push(A::from_f64(dbeta));
            out.a.push(A::from_f64(a));
            out.b.push(A::from_f64(b));
            out.c.push(A::from_f64(c));
        }
        out
    }
}

/// Batch mean and inverse std of one channel.
struct Moments {
    mean: f64,
    inv_std: f64,
}

/// Validates the BN inputs shared by finalize and the unfused forward, computes each channel's
/// batch moments and updates the running statistics.
fn batch_moments<A: Real>(
    stats: &ChannelStats<A>,
    running: RunningStats<'_, A>,
    count: usize,
    params: &BnParams,
) -> Result<Vec<Moments>> {
    let c = stats.sum.len();
    check_len("running_mean", running.mean, c)?;
    check_len("running_var", running.var, c)?;
    params.validate()?;
    if count < 2 {
        return Err(ReferenceError::CountTooSmall { count });
    }
    let m = count as f64;
    let f = params.momentum;
    let mut moments = Vec::with_capacity(c);
    for (k, (rm, rv)) in running
        .mean
        .iter_mut()
        .zip(running.var.iter_mut())
        .enumerate()
    {
        let mean = stats.sum[k].to_f64() / m;
        let var = (stats.sqsum[k].to_f64() / m - mean * mean).max(0.0);
        *rm = A::from_f64((1.0 - f) * rm.to_f64() + f * mean);
        *rv = A::from_f64((1.0 - f) * rv.to_f64() + f * var * m / (m - 1.0));
        moments.push(Moments {
            mean,
            inv_std: 1.0 / (var + params.epsilon).sqrt(),
        });
    }
    Ok(moments)
}
