//! The fused graphs of one CBR layer (docs/cudnn-graphs.md §2, §5.1, §5.2), each as one call with the
//! same inputs, outputs and rounding points as the cuDNN graph.
//!
//! | fn | cuDNN pattern | stored (rounded) outputs |
//! |---|---|---|
//! | [`fprop_genstats`] | 1: [scale→bias→relu→] conv_fprop + GenStats | `y` FP16; `sum`, `sqsum` FP32 |
//! | [`wgrad_with_prologue`] | 4: [scale→bias→relu→] conv_wgrad | `dw` FP16 |
//! | [`dgrad_drelu_dbn`] | 5: dgrad → BN recompute → relu_bwd + BN_BWD_WEIGHTS | `dz` FP16; `dγ`, `dβ`, `a`, `b`, `c` FP32 |
//!
//! Assumption to confirm on the GPU: the prologue's virtual `relu(y_prev·scale + bias)` is
//! computed in FP32 and rounded to FP16 before the conv, because the tensor-core conv consumes
//! FP16 operands (docs/cudnn-graphs.md §9: a virtual feeding a conv must be HALF for the generic
//! engines; the specialised engine's internal precision is not documented).

use super::bn::{add_genstats_rows, bn_recompute, BnBwdCoefficients, ChannelStats};
use super::conv::{
    dgrad_acc, dgrad_chunks, dgrad_store, fprop_chunks, pad_fprop_input, wgrad_src_in, widen_fill,
    widen_weights, with_store, PadBuf, Src,
};
use super::element::{Element, Real};
use super::error::Result;
use super::parallel::{add_partials, map_blocks_slice, ROWS_PER_CHUNK};
use super::params::{check_len, filled_vec, ConvParams};

/// What a conv consumes.
#[derive(Debug, Clone, Copy)]
pub enum ConvInput<'a, T> {
    /// A materialized activation `x` (the network input, or an applied BN output), NHWC.
    Plain(&'a [T]),
    /// The previous layer's raw conv output with its BN-apply as the prologue:
    /// `x = relu(y_prev·scale + bias)`, never stored in memory.
    Prologue {
        /// The previous conv's raw output, NHWC `[n, h, w, c]`.
        y_prev: &'a [T],
        /// The previous BN's `eq_scale`, FP16 `[c]`.
        scale: &'a [T],
        /// The previous BN's `eq_bias`, FP16 `[c]`.
        bias: &'a [T],
    },
}

impl<T: Element> ConvInput<'_, T> {
    /// Checks the lengths and hands `run` the conv's input `x` in `T::Acc` as a [`Src`] that
    /// computes it on the way into the gather: `x` widened, or the prologue rounded to `T`
    /// and widened (the values [`super::bn_apply`] stores, widened).
    fn with_src<R>(
        &self,
        p: &ConvParams,
        run: impl FnOnce(Src<'_, T::Acc>) -> Result<R>,
    ) -> Result<R> {
        let c = p.c;
        match *self {
            ConvInput::Plain(x) => {
                check_len("x", x, p.x_elems())?;
                let fill = |first: usize, dst: &mut [T::Acc]| {
                    T::widen_into(&x[first * c..first * c + dst.len()], dst);
                };
                run(Src::Fill {
                    pixels: p.n * p.h * p.w,
                    fill: &fill,
                })
            }
            ConvInput::Prologue {
                y_prev,
                scale,
                bias,
            } => {
                check_len("y_prev", y_prev, p.x_elems())?;
                check_len("scale", scale, p.c)?;
                check_len("bias", bias, p.c)?;
                let (s, b) = (T::widen_slice(scale), T::widen_slice(bias));
                let fill = |first: usize, dst: &mut [T::Acc]| {
                    prologue_into(c, &y_prev[first * c..first * c + dst.len()], &s, &b, dst);
                };
                run(Src::Fill {
                    pixels: p.n * p.h * p.w,
                    fill: &fill,
                })
            }
        }
    }
}

/// Storage one conv layer's CPU steps keep from one training step to the next: the forward
/// conv's input in the arithmetic type, laid out (padded) for its gather, which the backward's
/// wgrad reads again instead of recomputing it from the same FP16 tensors, and the padded copy
/// of the backward's `dy` (the ops' weight-sized temporaries live in a store per thread instead:
/// `conv::with_store`). Reuse changes no value: the cached input is used only for the very
/// input it was computed from (see [`InputStamp`]), so the wgrad gathers exactly the column
/// matrix it would have made itself.
#[derive(Debug, Default)]
pub struct ConvScratch<T: Element> {
    /// The forward conv's input, padded ([`Src::Padded`]).
    input: PadBuf<T::Acc>,
    /// What `input` holds, if anything.
    key: Option<InputKey<T>>,
    /// Storage for the padded copy of the dgrad's `dy`.
    dy: PadBuf<T::Acc>,
}

/// How a [`ConvScratch`] tells that a wgrad's input is the one its forward conv read.
///
/// `Some(stamps)`: the caller's identity of the input's FP16 tensors (`x` or `y_prev`, then
/// `scale` and `bias` for a prologue, zeros for absent ones), such as write counters of the
/// buffers holding them; the caller guarantees that equal stamps mean equal contents. `None`:
/// the scratch keeps copies of the tensors and compares them bit for bit.
pub type InputStamp = Option<[u64; 3]>;

/// The conv shape and FP16 tensors a [`ConvScratch`] input was computed from.
#[derive(Debug)]
struct InputKey<T> {
    p: ConvParams,
    prologue: bool,
    /// The caller's stamps, or `None` with the tensors' copies below.
    stamp: InputStamp,
    x: Vec<T>,
    scale: Vec<T>,
    bias: Vec<T>,
}

impl<T: Element> InputKey<T> {
    /// The key refilled for `input` (reusing its copies' storage).
    fn set(
        key: &mut Option<InputKey<T>>,
        p: &ConvParams,
        input: &ConvInput<'_, T>,
        stamp: InputStamp,
    ) {
        let (x, scale, bias, prologue): (&[T], &[T], &[T], bool) = match *input {
            ConvInput::Plain(x) => (x, &[], &[], false),
            ConvInput::Prologue {
                y_prev,
                scale,
                bias,
            } => (y_prev, scale, bias, true),
        };
        let k = key.get_or_insert_with(|| InputKey {
            p: *p,
            prologue,
            stamp,
            x: Vec::new(),
            scale: Vec::new(),
            bias: Vec::new(),
        });
        k.p = *p;
        k.prologue = prologue;
        k.stamp = stamp;
        for (dst, src) in [(&mut k.x, x), (&mut k.scale, scale), (&mut k.bias, bias)] {
            dst.clear();
            if stamp.is_none() {
                dst.extend_from_slice(src);
            }
        }
    }

    /// Whether `input` to a conv of shape `p` is what the key was made from.
    fn matches(&self, p: &ConvParams, input: &ConvInput<'_, T>, stamp: InputStamp) -> bool {
        let prologue = matches!(input, ConvInput::Prologue { .. });
        if self.p != *p || self.prologue != prologue {
            return false;
        }
        match (self.stamp, stamp) {
            (Some(kept), Some(given)) => kept == given,
            (None, None) => match *input {
                ConvInput::Plain(x) => T::same_bits(&self.x, x),
                ConvInput::Prologue {
                    y_prev,
                    scale,
                    bias,
                } => {
                    T::same_bits(&self.scale, scale)
                        && T::same_bits(&self.bias, bias)
                        && T::same_bits(&self.x, y_prev)
                }
            },
            _ => false,
        }
    }
}

/// dReLU of the recomputed BN output (plus the join) for elements `first..first + dxc.len()`
/// (whole pixels of `ch` channels): `res = (z > 0) ? dxc + dy_branch : 0` with
/// `z = bn_recompute(y_prev) + resid`, the graph's op order; `ins` is scratch of `3·len`
/// (its first third left holding `y_prev` widened).
#[allow(clippy::too_many_arguments)]
fn drelu_dbn_rows<T: Element>(
    ch: usize,
    first: usize,
    dxc: &[T::Acc],
    y_prev: &[T],
    bn: &SavedBn<'_, T::Acc>,
    join: &ReluJoin<'_, T>,
    ins: &mut [T::Acc],
    res: &mut [T::Acc],
) {
    let zero = T::Acc::ZERO;
    let n = dxc.len();
    let range = first..first + n;
    let (yv, rest) = ins.split_at_mut(n);
    let (bv, rv) = rest.split_at_mut(n);
    let rv = &mut rv[..n];
    T::widen_into(&y_prev[range.clone()], yv);
    // Absent joins add an FP32 zero, as the graph's virtual add would.
    match join.dy_branch {
        Some(d) => T::widen_into(&d[range.clone()], bv),
        None => bv.fill(zero),
    }
    match join.resid {
        Some(r) => T::widen_into(&r[range], rv),
        None => rv.fill(zero),
    }
    let rows = res[..n]
        .chunks_exact_mut(ch)
        .zip(dxc.chunks_exact(ch))
        .zip(yv.chunks_exact(ch))
        .zip(bv.chunks_exact(ch))
        .zip(rv.chunks_exact(ch));
    let (mean, inv_std, gamma, beta) = (
        &bn.mean[..ch],
        &bn.inv_std[..ch],
        &bn.gamma[..ch],
        &bn.beta[..ch],
    );
    for ((((o, gp), yp), bp), rp) in rows {
        let (o, gp, yp, bp, rp) = (&mut o[..ch], &gp[..ch], &yp[..ch], &bp[..ch], &rp[..ch]);
        for k in 0..ch {
            let grad = gp[k] + bp[k];
            let z = bn_recompute(yp[k], mean[k], inv_std[k], gamma[k], beta[k]) + rp[k];
            o[k] = if z > zero { grad } else { zero };
        }
    }
}

/// The prologue of `y` (whole pixels of `c` channels) into `x`: `relu(y·s + b)` rounded to `T`
/// and widened back (in vector lanes where `T` has them, else pass by pass).
fn prologue_into<T: Element>(c: usize, y: &[T], s: &[T::Acc], b: &[T::Acc], x: &mut [T::Acc]) {
    if T::prologue_lanes(c, y, s, b, x) {
        return;
    }
    let mut stored = vec![T::default(); x.len()];
    T::widen_into(y, x);
    let (s, b) = (&s[..c], &b[..c]);
    for px in x.chunks_exact_mut(c) {
        for ((v, &s), &b) in px.iter_mut().zip(s).zip(b) {
            *v = (*v * s + b).relu();
        }
    }
    T::store_into(x, &mut stored);
    T::widen_into(&stored, x);
}

/// The outputs of [`fprop_genstats`].
#[derive(Debug, Clone, PartialEq)]
pub struct FpropStats<T: Element> {
    /// The raw conv output, FP16 NHWC `[n, out_h, out_w, k]`.
    pub y: Vec<T>,
    /// Per-channel `Σy`, `Σy²` of the stored `y` (FP32 `[k]`), for [`super::bn_finalize`] with
    /// `count = n·out_h·out_w`.
    pub stats: ChannelStats<T::Acc>,
}

/// Pattern 1 (forward NormConv): `y = conv(input, w)` stored FP16, plus GenStats of `y`.
///
/// `ConvInput::Plain` is the first layer's conv + GenStats; `ConvInput::Prologue` fuses the
/// previous BN's apply. Rounding: the prologue output to FP16 (assumption, see module docs),
/// `y` to FP16 once after FP32 accumulation; the statistics are of the stored FP16 `y`
/// (assumption: the GPU may reduce the FP32 accumulator instead, a relative difference of
/// about 2^-12/sqrt(count) in the mean).
pub fn fprop_genstats<T: Element>(
    p: &ConvParams,
    input: ConvInput<'_, T>,
    w: &[T],
) -> Result<FpropStats<T>> {
    fprop_genstats_with(p, input, w, &mut ConvScratch::default(), None, Vec::new())
}

/// [`fprop_genstats`] with storage kept across steps: the conv's input is left in `scratch`
/// (known by `stamp`, see [`InputStamp`]) for [`wgrad_with_prologue_with`], and `y` is written
/// into `y`'s storage (any length; its contents are overwritten). The same values as
/// [`fprop_genstats`].
pub fn fprop_genstats_with<T: Element>(
    p: &ConvParams,
    input: ConvInput<'_, T>,
    w: &[T],
    scratch: &mut ConvScratch<T>,
    stamp: InputStamp,
    mut y: Vec<T>,
) -> Result<FpropStats<T>> {
    p.validate()?;
    y.resize(p.y_elems(), T::default());
    let stats = fprop_genstats_into_slice(p, input, w, scratch, stamp, &mut y)?;
    Ok(FpropStats { y, stats })
}

/// [`fprop_genstats_with`] into `y` (its `y_elems` values are overwritten); returns the
/// statistics.
pub(crate) fn fprop_genstats_into_slice<T: Element>(
    p: &ConvParams,
    input: ConvInput<'_, T>,
    w: &[T],
    scratch: &mut ConvScratch<T>,
    stamp: InputStamp,
    y: &mut [T],
) -> Result<ChannelStats<T::Acc>> {
    p.validate()?;
    check_len("w", w, p.w_elems())?;
    check_len("y", y, p.y_elems())?;
    let k = p.k;
    with_store(|store| {
        let w = widen_weights(w, &mut store.w);
        // The input is computed once into the scratch's padded copy (the values the gather would
        // compute on its way in), and kept for the backward's wgrad.
        scratch.key = None;
        input.with_src(p, |x| {
            pad_fprop_input(p, x, &mut scratch.input);
            Ok(())
        })?;
        InputKey::set(&mut scratch.key, p, &input, stamp);
        // The conv's tiles are stored and summed while in cache, chunk by chunk as `genstats`
        // sums (the same values, added in the same order).
        let partials = fprop_chunks(
            p,
            Src::Padded(&scratch.input.data),
            w,
            &mut store.w_t,
            y,
            ROWS_PER_CHUNK,
            || vec![[0.0; 2]; k],
            |acc, tile, out| {
                T::store_into(tile, out);
                T::widen_into(out, tile);
                add_genstats_rows(tile, acc);
            },
        )?;
        Ok(ChannelStats::from_sums(&add_partials(k, &partials)))
    })
}

/// Pattern 4 (ConvBNwgrad): `dw = wgrad(input, dy)`, FP16 KRSC `[k, r, s, c]`.
///
/// `ConvInput::Prologue` recomputes the conv input from `y_prev` and the previous BN's FP16
/// `eq_scale`/`eq_bias` exactly as [`fprop_genstats`] did; `ConvInput::Plain` is the plain wgrad
/// of the first layer (or of a conv whose input was materialized). `dy` is NHWC
/// `[n, out_h, out_w, k]`. Rounding: `dw` to FP16 once after FP32 accumulation (the fused wgrad
/// writes FP16 `dw`, docs/cudnn-graphs.md §5.1).
pub fn wgrad_with_prologue<T: Element>(
    p: &ConvParams,
    input: ConvInput<'_, T>,
    dy: &[T],
) -> Result<Vec<T>> {
    wgrad_with_prologue_with(p, input, dy, &mut ConvScratch::default(), None, Vec::new())
}

/// [`wgrad_with_prologue`] reading the conv's input from `scratch` where
/// [`fprop_genstats_with`] left it for this very input (same shape, and the same `stamp` or
/// the same FP16 tensors bit for bit: [`InputStamp`]), else computing it as
/// [`wgrad_with_prologue`] does: the same values either way. `dw` is written into `dw`'s
/// storage (any length; its contents are overwritten).
pub fn wgrad_with_prologue_with<T: Element>(
    p: &ConvParams,
    input: ConvInput<'_, T>,
    dy: &[T],
    scratch: &mut ConvScratch<T>,
    stamp: InputStamp,
    mut dw: Vec<T>,
) -> Result<Vec<T>> {
    p.validate()?;
    check_len("dy", dy, p.y_elems())?;
    // `dy` widened a tile's rows at a time, while in cache (the same values).
    let dy_fill = widen_fill(dy, p.k);
    let dy = Src::Fill {
        pixels: p.n * p.out_h() * p.out_w(),
        fill: &dy_fill,
    };
    let cached = scratch
        .key
        .as_ref()
        .is_some_and(|k| k.matches(p, &input, stamp));
    let done = with_store(|store| {
        if cached {
            wgrad_src_in(p, Src::Padded(&scratch.input.data), dy, store)?;
        } else {
            input.with_src(p, |x| wgrad_src_in(p, x, dy, store).map(|_| ()))?;
        }
        let dw_acc = store.dw();
        dw.resize(dw_acc.len(), T::default());
        T::store_into(dw_acc, &mut dw);
        Ok(())
    });
    done.map(|()| dw)
}

/// [`super::conv_dgrad_into`] with the padded copy of `dy` kept in `scratch` (storage reused
/// from step to step). The same values as [`super::conv_dgrad`].
pub fn conv_dgrad_with<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    scratch: &mut ConvScratch<T>,
    out: Vec<T>,
) -> Result<Vec<T>> {
    p.validate()?;
    filled_vec(out, p.x_elems(), |out| {
        conv_dgrad_into_slice(p, dy, w, scratch, out)
    })
}

/// [`conv_dgrad_with`] into `out` (its `x_elems` values are overwritten).
pub(crate) fn conv_dgrad_into_slice<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    scratch: &mut ConvScratch<T>,
    out: &mut [T],
) -> Result<()> {
    with_store(|store| dgrad_store(p, dy, w, Some(&mut scratch.dy), store, out))
}

/// The previous BN's saved statistics and learned parameters (FP32 `[c]`), as pattern 5 takes
/// them: `mean`/`inv_std` from its finalize, `gamma`/`beta` the FP32 parameters (not the FP16
/// `eq_scale`/`eq_bias`).
#[derive(Debug, Clone, Copy)]
pub struct SavedBn<'a, A> {
    /// Saved batch mean.
    pub mean: &'a [A],
    /// Saved inverse std.
    pub inv_std: &'a [A],
    /// γ.
    pub gamma: &'a [A],
    /// β.
    pub beta: &'a [A],
}

/// The residual-join variants of pattern 5 (both may be present at once in a ResNet block; the
/// GPU measurements cover each alone).
#[derive(Debug, Clone, Copy)]
pub struct ReluJoin<'a, T> {
    /// `shortcut` variant: the forward ReLU was `relu(BN(y_prev) + resid)`; `resid` (FP16 NHWC,
    /// like `y_prev`) is added to the recomputed BN output before the ReLU mask is taken. The
    /// output `dz` is then also the gradient w.r.t. `resid`.
    pub resid: Option<&'a [T]>,
    /// `fuse_add` variant: the ReLU's output also fed a shortcut whose gradient `dy_branch` (FP16
    /// NHWC, like `y_prev`) is added to the dgrad output before the ReLU backward.
    pub dy_branch: Option<&'a [T]>,
}

impl<T> Default for ReluJoin<'_, T> {
    /// No join: the plain pattern 5.
    fn default() -> Self {
        ReluJoin {
            resid: None,
            dy_branch: None,
        }
    }
}

/// The outputs of [`dgrad_drelu_dbn`].
#[derive(Debug, Clone, PartialEq)]
pub struct DgradDreluDbn<T: Element> {
    /// Gradient w.r.t. the previous BN's output (the ReLU input), FP16 NHWC `[n, h, w, c]`.
    pub dz: Vec<T>,
    /// `Σ dz·x̂`, FP32 `[c]`.
    pub dgamma: Vec<T::Acc>,
    /// `Σ dz`, FP32 `[c]`.
    pub dbeta: Vec<T::Acc>,
    /// BN-backward coefficient of `dz` (`γ·inv_std`), FP32 `[c]`.
    pub a: Vec<T::Acc>,
    /// BN-backward coefficient of `y_prev`, FP32 `[c]`.
    pub b: Vec<T::Acc>,
    /// BN-backward constant, FP32 `[c]`.
    pub c: Vec<T::Acc>,
}

/// Pattern 5 (DgradDreluBNBwdWeight), for layer `i` = `p` whose input was
/// `relu(BN_{i−1}(y_prev) [+ resid])`:
///
/// 1. `dxc = dgrad(dy, w)` in FP32 (a virtual tensor, not rounded) `[+ dy_branch]`;
/// 2. the ReLU input recomputed as `(y_prev − mean)·inv_std·γ + β [+ resid]` in FP32;
/// 3. `dz = relu_bwd(dxc, recomputed)`, stored FP16;
/// 4. `dγ = Σ dz·x̂`, `dβ = Σ dz` and the coefficients `a`, `b`, `c` such that
///    `d_y_prev = a·dz + b·y_prev + c` is the full BN backward (formulas in crates/3-fusion/src/reference/bn.rs),
///    applied by [`super::dbn_apply`]. `M = n·h·w` of `y_prev`.
///
/// The reductions use the stored FP16 `dz` (assumption: the GPU may reduce its FP32 value), so
/// that `Σ d_y_prev = 0` and `Σ d_y_prev·x̂ = 0` hold for the `dz` that [`super::dbn_apply`]
/// reads.
pub fn dgrad_drelu_dbn<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    y_prev: &[T],
    bn: &SavedBn<'_, T::Acc>,
    join: &ReluJoin<'_, T>,
) -> Result<DgradDreluDbn<T>> {
    dgrad_drelu_dbn_with(
        p,
        dy,
        w,
        y_prev,
        bn,
        join,
        &mut ConvScratch::default(),
        Vec::new(),
    )
}

/// [`dgrad_drelu_dbn`] with storage kept across steps: the padded copy of `dy` in `scratch`,
/// and `dz` written into `dz`'s storage (any length; its contents are overwritten). The same
/// values as [`dgrad_drelu_dbn`].
#[allow(clippy::too_many_arguments)]
pub fn dgrad_drelu_dbn_with<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    y_prev: &[T],
    bn: &SavedBn<'_, T::Acc>,
    join: &ReluJoin<'_, T>,
    scratch: &mut ConvScratch<T>,
    mut dz: Vec<T>,
) -> Result<DgradDreluDbn<T>> {
    p.validate()?;
    dz.resize(p.x_elems(), T::default());
    let co = dgrad_drelu_dbn_into_slice(p, dy, w, y_prev, bn, join, scratch, &mut dz)?;
    Ok(DgradDreluDbn {
        dz,
        dgamma: co.dgamma,
        dbeta: co.dbeta,
        a: co.a,
        b: co.b,
        c: co.c,
    })
}

/// [`dgrad_drelu_dbn_with`] into `dz` (its `x_elems` values are overwritten); returns the
/// reductions and coefficients.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dgrad_drelu_dbn_into_slice<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    y_prev: &[T],
    bn: &SavedBn<'_, T::Acc>,
    join: &ReluJoin<'_, T>,
    scratch: &mut ConvScratch<T>,
    dz: &mut [T],
) -> Result<BnBwdCoefficients<T::Acc>> {
    p.validate()?;
    check_len("dz", dz, p.x_elems())?;
    check_len("dy", dy, p.y_elems())?;
    check_len("w", w, p.w_elems())?;
    check_len("y_prev", y_prev, p.x_elems())?;
    for (tensor, v) in [
        ("mean", bn.mean),
        ("inv_std", bn.inv_std),
        ("gamma", bn.gamma),
        ("beta", bn.beta),
    ] {
        check_len(tensor, v, p.c)?;
    }
    if let Some(resid) = join.resid {
        check_len("resid", resid, p.x_elems())?;
    }
    if let Some(dy_branch) = join.dy_branch {
        check_len("dy_branch", dy_branch, p.x_elems())?;
    }
    with_store(|store| {
        let w = widen_weights(w, &mut store.w);
        let ch = p.c;
        let mean64: Vec<f64> = bn.mean.iter().map(|v| v.to_f64()).collect();
        let inv_std64: Vec<f64> = bn.inv_std.iter().map(|v| v.to_f64()).collect();
        // `dy` widened straight into the gather's padded copy (the same values).
        let fill = widen_fill(dy, p.k);
        let dy_src = Src::Fill {
            pixels: p.n * p.out_h() * p.out_w(),
            fill: &fill,
        };
        // Stride 1: each dgrad tile becomes dz and is summed (BN_BWD_WEIGHTS) while in cache, in
        // the chunks and order of `BnBwdCoefficients::compute` (the same values and sums).
        let chunked = dgrad_chunks(
            p,
            dy_src,
            w,
            dz,
            ROWS_PER_CHUNK,
            Some(&mut scratch.dy),
            &mut store.w_r,
            || (vec![[0.0; 2]; ch], Vec::new()),
            |(acc, scratch): &mut (Vec<[f64; 2]>, Vec<T::Acc>), first, tile, out| {
                let n = tile.len();
                scratch.resize(4 * n, T::Acc::ZERO);
                let (ins, res) = scratch.split_at_mut(3 * n);
                // In vector lanes where the element type has them, else pass by pass (the
                // same values either way).
                let at = first * ch..first * ch + n;
                let y = &y_prev[at.clone()];
                let d = join.dy_branch.map(|d| &d[at.clone()]);
                let r = join.resid.map(|r| &r[at.clone()]);
                if !T::drelu_lanes(ch, tile, y, d, r, bn, &mut ins[..n], out, res) {
                    drelu_dbn_rows(ch, first * ch, tile, y_prev, bn, join, ins, res);
                    T::store_into(res, out);
                    T::widen_into(out, res);
                }
                BnBwdCoefficients::add_rows(&ins[..n], res, &mean64, &inv_std64, acc);
            },
        )?;
        let co = match chunked {
            Some(partials) => {
                let partials: Vec<Vec<[f64; 2]>> =
                    partials.into_iter().map(|(acc, _)| acc).collect();
                BnBwdCoefficients::from_sums(
                    &add_partials(ch, &partials),
                    p.n * p.h * p.w,
                    bn.mean,
                    bn.inv_std,
                    bn.gamma,
                )
            }
            None => {
                let dxc = dgrad_acc(p, &T::widen_slice(dy), w)?;
                map_blocks_slice(dz, ch, |first, ins, out| {
                    let n = out.len();
                    drelu_dbn_rows(
                        ch,
                        first,
                        &dxc[first..first + n],
                        y_prev,
                        bn,
                        join,
                        ins,
                        out,
                    );
                });
                BnBwdCoefficients::compute(
                    &p.input_shape(),
                    y_prev,
                    dz,
                    bn.mean,
                    bn.inv_std,
                    bn.gamma,
                )
            }
        };
        Ok(co)
    })
}
