//! Element-wise ops: BN apply (which is also the conv prologue), ReLU forward and backward,
//! add, and the BN-backward apply.
//!
//! Each reads FP16 tensors (`T`), computes in the arithmetic type (`T::Acc`, FP32 in FP16 mode)
//! in the order of the cuDNN pointwise graph it mirrors, and rounds its output to `T` once. Plain
//! multiply-then-add is used, not fused multiply-add; the difference is below FP32 rounding and
//! far below the FP16 rounding of the output.

use super::element::{Element, Real};
use super::error::Result;
use super::maps::PointwiseMap;
use super::parallel::{fill_blocks, map_blocks, map_blocks_lanes};
use super::params::{check_len, filled_vec, Nhwc};

/// Whether an apply ends with a ReLU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `max(v, 0)` (the usual CBR apply).
    Relu,
    /// No activation (cuDNN's `sb_only` / `sb_add_norelu` variants).
    Identity,
}

impl Activation {
    #[inline]
    fn apply<A: Real>(self, v: A) -> A {
        match self {
            Activation::Relu => v.relu(),
            Activation::Identity => v,
        }
    }
}

/// A block's map in vector lanes (`Element::map_lanes`) over elements `first..` of `u` (and
/// `v`), for `map_blocks_lanes`.
fn lanes_of<'a, T: Element>(
    m: PointwiseMap<'a, T::Acc>,
    c: usize,
    u: &'a [T],
    v: Option<&'a [T]>,
) -> impl Fn(usize, &mut [T]) -> bool + Sync + Send + 'a {
    move |first, dst| {
        let n = dst.len();
        let at = first..first + n;
        T::map_lanes(m, c, &u[at.clone()], v.map(|v| &v[at.clone()]), dst)
    }
}

/// What a BN apply adds before its activation (docs/cudnn-graphs.md §4 residual variants).
#[derive(Debug, Clone, Copy)]
pub enum Residual<'a, T> {
    /// Nothing: `act(y·s + b)`.
    None,
    /// A full tensor, NHWC like `y` (`sbr_add`): `act(y·s + b + r)`.
    Add(&'a [T]),
    /// A full tensor with its own per-channel scale and bias, the dual BN of a downsample
    /// shortcut (`dsbar`): `act(y·s + b + (r·scale + bias))`.
    ScaleBias {
        /// The shortcut's raw tensor, NHWC like `y`.
        r: &'a [T],
        /// Its per-channel scale `[C]` (FP16, from its BN finalize).
        scale: &'a [T],
        /// Its per-channel bias `[C]` (FP16, from its BN finalize).
        bias: &'a [T],
    },
}

/// BN apply: `out = act(y·scale + bias [+ residual])`, per channel of an NHWC tensor.
///
/// `y` and the output have `shape`; `scale` and `bias` are `[C]` in storage precision (FP16 on
/// the GPU: BN finalize emits `eq_scale`/`eq_bias` in FP16). With `Residual::None` and
/// [`Activation::Relu`] this is also the conv prologue `x = relu(y_prev·scale + bias)`.
///
/// Rounding: computed in `T::Acc`, rounded to `T` once.
pub fn bn_apply<T: Element>(
    shape: &Nhwc,
    y: &[T],
    scale: &[T],
    bias: &[T],
    residual: Residual<'_, T>,
    activation: Activation,
) -> Result<Vec<T>> {
    bn_apply_into(shape, y, scale, bias, residual, activation, Vec::new())
}

/// [`bn_apply`] into `out`'s storage (any length; its contents are overwritten), returned as
/// the activation: a caller that keeps that buffer from step to step allocates nothing.
pub fn bn_apply_into<T: Element>(
    shape: &Nhwc,
    y: &[T],
    scale: &[T],
    bias: &[T],
    residual: Residual<'_, T>,
    activation: Activation,
    out: Vec<T>,
) -> Result<Vec<T>> {
    shape.validate("y")?;
    filled_vec(out, shape.elems(), |out| {
        bn_apply_into_slice(shape, y, scale, bias, residual, activation, out)
    })
}

/// [`bn_apply`] into `out` (its `shape.elems()` values are overwritten).
pub(crate) fn bn_apply_into_slice<T: Element>(
    shape: &Nhwc,
    y: &[T],
    scale: &[T],
    bias: &[T],
    residual: Residual<'_, T>,
    activation: Activation,
    out: &mut [T],
) -> Result<()> {
    shape.validate("y")?;
    check_len("y", y, shape.elems())?;
    check_len("out", out, shape.elems())?;
    check_len("scale", scale, shape.c)?;
    check_len("bias", bias, shape.c)?;
    let (s, b) = (T::widen_slice(scale), T::widen_slice(bias));
    let c = shape.c;
    let act = move |v: T::Acc| activation.apply(v);
    let relu = matches!(activation, Activation::Relu);
    match residual {
        Residual::None => map_blocks_lanes(
            out,
            c,
            lanes_of(PointwiseMap::Apply { s: &s, b: &b, relu }, c, y, None),
            |first, ins, out| {
                let yv = &mut ins[..out.len()];
                T::widen_into(&y[first..first + out.len()], yv);
                // (Every slice indexed below has exactly `c` values: no bounds checks, so the
                // channel loop vectorizes.)
                let (s, b) = (&s[..c], &b[..c]);
                for (o, yp) in out.chunks_exact_mut(c).zip(yv.chunks_exact(c)) {
                    let (o, yp) = (&mut o[..c], &yp[..c]);
                    for k in 0..c {
                        o[k] = act(yp[k] * s[k] + b[k]);
                    }
                }
            },
        ),
        Residual::Add(r) => {
            check_len("residual", r, shape.elems())?;
            let add = PointwiseMap::ApplyAdd { s: &s, b: &b, relu };
            map_blocks_lanes(out, c, lanes_of(add, c, y, Some(r)), |first, ins, out| {
                let n = out.len();
                let (yv, rv) = ins.split_at_mut(n);
                let rv = &mut rv[..n];
                T::widen_into(&y[first..first + n], yv);
                T::widen_into(&r[first..first + n], rv);
                let (s, b) = (&s[..c], &b[..c]);
                for ((o, yp), rp) in out
                    .chunks_exact_mut(c)
                    .zip(yv.chunks_exact(c))
                    .zip(rv.chunks_exact(c))
                {
                    let (o, yp, rp) = (&mut o[..c], &yp[..c], &rp[..c]);
                    for k in 0..c {
                        o[k] = act(yp[k] * s[k] + b[k] + rp[k]);
                    }
                }
            })
        }
        Residual::ScaleBias { r, scale, bias } => {
            check_len("residual", r, shape.elems())?;
            check_len("residual_scale", scale, shape.c)?;
            check_len("residual_bias", bias, shape.c)?;
            let (s2, b2) = (T::widen_slice(scale), T::widen_slice(bias));
            let dual = PointwiseMap::ApplyScaleBias {
                s: &s,
                b: &b,
                s2: &s2,
                b2: &b2,
                relu,
            };
            map_blocks_lanes(out, c, lanes_of(dual, c, y, Some(r)), |first, ins, out| {
                let n = out.len();
                let (yv, rv) = ins.split_at_mut(n);
                let rv = &mut rv[..n];
                T::widen_into(&y[first..first + n], yv);
                T::widen_into(&r[first..first + n], rv);
                let (s, b, s2, b2) = (&s[..c], &b[..c], &s2[..c], &b2[..c]);
                for ((o, yp), rp) in out
                    .chunks_exact_mut(c)
                    .zip(yv.chunks_exact(c))
                    .zip(rv.chunks_exact(c))
                {
                    let (o, yp, rp) = (&mut o[..c], &yp[..c], &rp[..c]);
                    for k in 0..c {
                        let main = yp[k] * s[k] + b[k];
                        let shortcut = rp[k] * s2[k] + b2[k];
                        o[k] = act(main + shortcut);
                    }
                }
            })
        }
    }
    Ok(())
}

/// ReLU forward: `out = max(x, 0)` (exact in any precision).
pub fn relu_fwd<T: Element>(shape: &Nhwc, x: &[T]) -> Result<Vec<T>> {
    shape.validate("x")?;
    check_len("x", x, shape.elems())?;
    Ok(map_blocks(x.len(), shape.c, |first, ins, out| {
        let xv = &mut ins[..out.len()];
        T::widen_into(&x[first..first + out.len()], xv);
        for (o, v) in out.iter_mut().zip(xv.iter()) {
            *o = v.relu();
        }
    }))
}

/// ReLU backward: `dx = dy` where `x > 0`, else 0 (cuDNN's `RELU_BWD`; the gradient at exactly
/// 0 is 0). `x` is the ReLU's input, or equally its output (both are positive at the same
/// places; the unfused route uses the stored output as cuDNN's boolean mask `A > 0`).
pub fn relu_bwd<T: Element>(shape: &Nhwc, dy: &[T], x: &[T]) -> Result<Vec<T>> {
    relu_bwd_into(shape, dy, x, Vec::new())
}

/// [`relu_bwd`] into `out`'s storage (any length; its contents are overwritten), returned as
/// `dx`: a caller that keeps that buffer from step to step allocates nothing.
pub fn relu_bwd_into<T: Element>(shape: &Nhwc, dy: &[T], x: &[T], out: Vec<T>) -> Result<Vec<T>> {
    shape.validate("dy")?;
    filled_vec(out, shape.elems(), |out| {
        relu_bwd_into_slice(shape, dy, x, out)
    })
}

/// [`relu_bwd`] into `out` (its `shape.elems()` values are overwritten).
pub(crate) fn relu_bwd_into_slice<T: Element>(
    shape: &Nhwc,
    dy: &[T],
    x: &[T],
    out: &mut [T],
) -> Result<()> {
    shape.validate("dy")?;
    check_len("dy", dy, shape.elems())?;
    check_len("x", x, shape.elems())?;
    check_len("out", out, shape.elems())?;
    // The gradient is passed through as stored (no round trip through the arithmetic type).
    fill_blocks(out, shape.c, |first, _, dst: &mut [T]| {
        let n = dst.len();
        // A select on the stored values (not a conditional store), so the loop vectorizes.
        T::relu_select(&dy[first..first + n], &x[first..first + n], dst);
    });
    Ok(())
}

/// `out = a + b`, computed in `T::Acc` and rounded to `T` once.
pub fn add<T: Element>(shape: &Nhwc, a: &[T], b: &[T]) -> Result<Vec<T>> {
    add_into(shape, a, b, Vec::new())
}

/// [`add`] into `out`'s storage (any length; its contents are overwritten), returned as
/// the sum: a caller that keeps that buffer from step to step allocates nothing.
pub fn add_into<T: Element>(shape: &Nhwc, a: &[T], b: &[T], out: Vec<T>) -> Result<Vec<T>> {
    shape.validate("a")?;
    filled_vec(out, shape.elems(), |out| add_into_slice(shape, a, b, out))
}

/// [`add`] into `out` (its `shape.elems()` values are overwritten; it aliases neither operand,
/// as the borrows say).
///
/// # Errors
/// As [`add`], and [`ReferenceError::ShapeMismatch`](super::ReferenceError::ShapeMismatch)
/// when `out` has another length.
pub fn add_into_slice<T: Element>(shape: &Nhwc, a: &[T], b: &[T], out: &mut [T]) -> Result<()> {
    shape.validate("a")?;
    check_len("a", a, shape.elems())?;
    check_len("b", b, shape.elems())?;
    check_len("out", out, shape.elems())?;
    let c = shape.c;
    map_blocks_lanes(
        out,
        c,
        lanes_of(PointwiseMap::Add, c, a, Some(b)),
        |first, ins, out| {
            let n = out.len();
            let (av, bv) = ins.split_at_mut(n);
            let bv = &mut bv[..n];
            T::widen_into(&a[first..first + n], av);
            T::widen_into(&b[first..first + n], bv);
            for ((o, x), y) in out.iter_mut().zip(av.iter()).zip(bv.iter()) {
                *o = *x + *y;
            }
        },
    );
    Ok(())
}

/// BN-backward apply (docs/cudnn-graphs.md §5.3): `d_y_prev = a·dz + b·y_prev + c` per channel, with
/// the coefficients from [`super::dgrad_drelu_dbn`] (FP32 `[C]`). `dz`, `y_prev` and the output
/// are NHWC with `shape`.
///
/// Rounding: `(a·dz + b·y_prev) + c` in `T::Acc`, in the graph's op order, rounded to `T` once.
pub fn dbn_apply<T: Element>(
    shape: &Nhwc,
    dz: &[T],
    y_prev: &[T],
    a: &[T::Acc],
    b: &[T::Acc],
    c: &[T::Acc],
) -> Result<Vec<T>> {
    dbn_apply_into(shape, dz, y_prev, a, b, c, Vec::new())
}

/// [`dbn_apply`] into `out`'s storage (any length; its contents are overwritten), returned as
/// `d_y_prev`: a caller that keeps that buffer from step to step allocates nothing.
pub fn dbn_apply_into<T: Element>(
    shape: &Nhwc,
    dz: &[T],
    y_prev: &[T],
    a: &[T::Acc],
    b: &[T::Acc],
    c: &[T::Acc],
    out: Vec<T>,
) -> Result<Vec<T>> {
    shape.validate("dz")?;
    filled_vec(out, shape.elems(), |out| {
        dbn_apply_into_slice(shape, dz, y_prev, a, b, c, out)
    })
}

/// [`dbn_apply`] into `out` (its `shape.elems()` values are overwritten).
pub(crate) fn dbn_apply_into_slice<T: Element>(
    shape: &Nhwc,
    dz: &[T],
    y_prev: &[T],
    a: &[T::Acc],
    b: &[T::Acc],
    c: &[T::Acc],
    out: &mut [T],
) -> Result<()> {
    shape.validate("dz")?;
    check_len("dz", dz, shape.elems())?;
    check_len("y_prev", y_prev, shape.elems())?;
    check_len("out", out, shape.elems())?;
    check_len("a", a, shape.c)?;
    check_len("b", b, shape.c)?;
    check_len("c", c, shape.c)?;
    let ch = shape.c;
    let m = PointwiseMap::DbnApply { a, b, c };
    map_blocks_lanes(
        out,
        ch,
        lanes_of(m, ch, dz, Some(y_prev)),
        |first, ins, out| {
            let n = out.len();
            let (dv, yv) = ins.split_at_mut(n);
            let yv = &mut yv[..n];
            T::widen_into(&dz[first..first + n], dv);
            T::widen_into(&y_prev[first..first + n], yv);
            let (a, b, c) = (&a[..ch], &b[..ch], &c[..ch]);
            for ((o, dp), yp) in out
                .chunks_exact_mut(ch)
                .zip(dv.chunks_exact(ch))
                .zip(yv.chunks_exact(ch))
            {
                let (o, dp, yp) = (&mut o[..ch], &dp[..ch], &yp[..ch]);
                for k in 0..ch {
                    o[k] = dp[k] * a[k] + yp[k] * b[k] + c[k];
                }
            }
        },
    );
    Ok(())
}
