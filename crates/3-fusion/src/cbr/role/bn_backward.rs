//! A BN's backward, for either BN a layer differentiates: the previous layer's (read through
//! the prologue or the materialized activation: [`GraphRole::BnBackward`],
//! [`GraphRole::DbnReduce`], [`GraphRole::DbnCoefficients`], [`GraphRole::DbnApply`]) or this
//! layer's own behind its materialized activation (the `Apply*` roles). One set of buffer
//! names per BN ([`names`]) serves the graphs' bindings and the CPU steps alike.

use super::common::lg;
use crate::cbr::bn_sync::{self, BnSide, BnSync};
use crate::cbr::graphs;
use crate::cbr::keys as k;
use crate::cbr::layer::{GraphRole, LayerGraph, RouteKind, Src};
use crate::cbr::run::LayerIo;
use crate::error::Result;
use crate::exec::Scalar;
use crate::reference::parallel::channel_sums;
use crate::reference::params::check_len;
use crate::reference::sums::{self, Terms};
use crate::reference::{self as r, Element, Nhwc, Real};

/// The previous BN's dBN-apply coefficients A, B, C (this layer's buffers).
pub(crate) const DBN: [&str; 3] = [k::DBN_A.name(), k::DBN_B.name(), k::DBN_C.name()];

/// This layer's own BN's dBN-apply coefficients (behind its materialized activation).
pub(crate) const APPLY_DBN: [&str; 3] = [
    k::APPLY_DBN_A.name(),
    k::APPLY_DBN_B.name(),
    k::APPLY_DBN_C.name(),
];

/// The buffers a BN backward reads and writes (`abc` only where the reduction chain runs).
pub(crate) struct Names {
    /// Gradient w.r.t. the BN output.
    pub(crate) dz: Src,
    /// The BN input.
    pub(crate) y: Src,
    /// The saved batch mean.
    pub(crate) mean: Src,
    /// The saved batch inverse standard deviation.
    pub(crate) inv_std: Src,
    /// γ.
    pub(crate) gamma: Src,
    /// dγ.
    pub(crate) dgamma: Src,
    /// dβ.
    pub(crate) dbeta: Src,
    /// The dBN-apply coefficients A, B, C.
    pub(crate) abc: [Src; 3],
    /// Gradient w.r.t. the BN input.
    pub(crate) dy: Src,
}

/// The buffers of `side`'s BN backward: the previous BN's statistics and gradients with this
/// layer's `dz_prev` and `dbn_*`, or this layer's own with its `dpre` and `apply_dbn_*`.
pub(crate) fn names(side: BnSide) -> Names {
    let (bn, dz, abc) = match side {
        BnSide::Prev => (BnSide::Prev, k::DZ_PREV.this(), DBN),
        BnSide::This => (BnSide::This, k::DPRE.this(), APPLY_DBN),
    };
    Names {
        dz,
        y: bn.src(k::Y.name()),
        mean: bn.src(k::SAVED_MEAN.name()),
        inv_std: bn.src(k::SAVED_INV_STD.name()),
        gamma: bn.src(k::GAMMA.name()),
        dgamma: bn.src(k::DGAMMA.name()),
        dbeta: bn.src(k::DBETA.name()),
        abc: abc.map(Src::This),
        dy: bn.src(k::DY.name()),
    }
}

/// The roles of `side`'s BN backward: NormBackward's, then the reduction chain's three.
fn roles(side: BnSide) -> (GraphRole, [GraphRole; 3]) {
    match side {
        BnSide::Prev => (
            GraphRole::BnBackward,
            [
                GraphRole::DbnReduce,
                GraphRole::DbnCoefficients,
                GraphRole::DbnApply,
            ],
        ),
        BnSide::This => (
            GraphRole::ApplyBnBackward,
            [
                GraphRole::ApplyDbnReduce,
                GraphRole::ApplyDbnCoefficients,
                GraphRole::ApplyDbnApply,
            ],
        ),
    }
}

/// `side`'s BN backward over `dims`: NormBackward on the unfused route, the reduction chain
/// (reductions → coefficients → dBN apply) on the fused and generic routes.
pub(super) fn graphs(kind: RouteKind, dims: [i64; 4], side: BnSide) -> Vec<LayerGraph> {
    let (norm_role, chain) = roles(side);
    let n = names(side);
    // Only the unfused route (the baseline on cuDNN's BN ops) keeps NormBackward: it is
    // runtime-compiled per shape (about 1.2 s of NVRTC each), while the reduction form runs on
    // our kernels, compiled once per architecture.
    if kind != RouteKind::Unfused {
        return reduction_graphs(dims, chain, &n);
    }
    let (g, i, o) = graphs::batchnorm_backward(dims);
    vec![lg(
        norm_role,
        g,
        vec![
            (i.dy, n.dz),
            (i.x, n.y),
            (i.scale, n.gamma),
            (i.mean, n.mean),
            (i.inv_variance, n.inv_std),
            (o.dx, n.dy),
            (o.dscale, n.dgamma),
            (o.dbias, n.dbeta),
        ],
    )]
}

/// A BN's backward over `dims` without BN-specific engines: reductions (dγ, dβ) →
/// coefficients A, B, C → dBN apply `dy = A·dz + B·y + C`, with `roles` for the three graphs.
fn reduction_graphs(dims: [i64; 4], roles: [GraphRole; 3], n: &Names) -> Vec<LayerGraph> {
    let count = dims[0] * dims[2] * dims[3];
    let (g, t) = graphs::dbn_reduce(dims);
    let reduce = lg(
        roles[0],
        g,
        vec![
            (t.y, n.y),
            (t.dz, n.dz),
            (t.mean, n.mean),
            (t.inv_std, n.inv_std),
            (t.dgamma, n.dgamma),
            (t.dbeta, n.dbeta),
        ],
    );
    let (g, t) = graphs::dbn_coefficients(dims[1]);
    let coefficients = lg(
        roles[1],
        g,
        vec![
            (t.gamma, n.gamma),
            (t.inv_std, n.inv_std),
            (t.mean, n.mean),
            (t.dgamma, n.dgamma),
            (t.dbeta, n.dbeta),
            (
                t.neg_inv_count,
                Src::Scalar(Scalar::F32(neg_inv_count(count))),
            ),
            (t.a, n.abc[0]),
            (t.b, n.abc[1]),
            (t.c, n.abc[2]),
        ],
    );
    vec![reduce, coefficients, apply_graph(dims, roles[2], n)]
}

/// The dBN apply `dy = A·dz + B·y + C` over `dims` as `role`.
pub(super) fn apply_graph(dims: [i64; 4], role: GraphRole, n: &Names) -> LayerGraph {
    let (g, t) = graphs::dbn_apply(dims);
    lg(
        role,
        g,
        vec![
            (t.dz, n.dz),
            (t.y_prev, n.y),
            (t.abc[0], n.abc[0]),
            (t.abc[1], n.abc[1]),
            (t.abc[2], n.abc[2]),
            (t.dy_prev, n.dy),
        ],
    )
}

/// `−1/M` rounded to FP32 (the by-value scalar of the dBN-coefficient graph).
pub(crate) fn neg_inv_count(count: i64) -> f32 {
    (-1.0 / count as f64) as f32
}

/// NormBackward on the CPU over `shape`: `dy`, `dγ`, `dβ` from `dz`.
pub(super) fn norm<T: Element, I: LayerIo<T> + ?Sized>(
    shape: &Nhwc,
    n: &Names,
    io: &mut I,
) -> Result<()> {
    let out = r::bn_bwd(
        shape,
        io.half(n.y)?,
        io.half(n.dz)?,
        io.float(n.mean)?,
        io.float(n.inv_std)?,
        io.float(n.gamma)?,
    )?;
    io.set_half(n.dy, out.dx)?;
    io.set_float(n.dgamma, out.dgamma)?;
    io.set_float(n.dbeta, out.dbeta)
}

/// The reductions `dγ`, `dβ` on the CPU over `shape`.
pub(super) fn reduce<T: Element, I: LayerIo<T> + ?Sized>(
    shape: &Nhwc,
    n: &Names,
    io: &mut I,
) -> Result<()> {
    let [dgamma, dbeta] = dbn_reduce(
        shape,
        io.half(n.y)?,
        io.half(n.dz)?,
        io.float(n.mean)?,
        io.float(n.inv_std)?,
    )?;
    io.set_float(n.dgamma, dgamma)?;
    io.set_float(n.dbeta, dbeta)
}

/// The dBN-apply coefficients on the CPU over `count` elements per channel.
pub(super) fn coefficients<T: Element, I: LayerIo<T> + ?Sized>(
    count: usize,
    n: &Names,
    io: &mut I,
) -> Result<()> {
    let [a, b, c] = dbn_coefficients(
        count,
        io.float(n.gamma)?,
        io.float(n.inv_std)?,
        io.float(n.mean)?,
        io.float(n.dgamma)?,
        io.float(n.dbeta)?,
    )?;
    io.set_float(n.abc[0], a)?;
    io.set_float(n.abc[1], b)?;
    io.set_float(n.abc[2], c)
}

/// The dBN apply on the CPU over `shape`, into `dy` where the table keeps it.
pub(super) fn apply<T: Element, I: LayerIo<T> + ?Sized>(
    shape: &Nhwc,
    n: &Names,
    io: &mut I,
) -> Result<()> {
    shape.validate("dz")?;
    io.write_half(n.dy, shape.elems(), &mut |d, rd| {
        Ok(r::dbn_apply_into_slice(
            shape,
            rd.half(n.dz)?,
            rd.half(n.y)?,
            rd.float(n.abc[0])?,
            rd.float(n.abc[1])?,
            rd.float(n.abc[2])?,
            d,
        )?)
    })
}

/// NormBackward with synchronized BN over `shape`: local `dγ`, `dβ` into `side`'s buffers,
/// coefficients from the global sums, then `dy = A·dz + B·y + C` into `side`'s `dy`.
pub(super) fn norm_synced<T: Element, I: LayerIo<T> + ?Sized>(
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
    shape: &Nhwc,
    side: BnSide,
    replicas: usize,
) -> Result<()> {
    let n = names(side);
    reduce(shape, &n, io)?;
    let [a, b, c] = bn_sync::coefficients(io, sync, side, shape.pixels() * replicas)?;
    let dy = r::dbn_apply(shape, io.half(n.dz)?, io.half(n.y)?, &a, &b, &c)?;
    io.set_half(n.dy, dy)
}

/// The generic route's `dbn_reduce` graph on the CPU: per channel, `dγ = Σ dz·x̂` and
/// `dβ = Σ dz` with `x̂ = (y − mean)·inv_std`.
///
/// Rounding points mirror the graph: `y − mean`, `·inv_std` and `dz·x̂` are each rounded to
/// FP32 (the graph's FP32 virtual tensors); the sums run in `f64` and are rounded to FP32 once
/// (the GPU's reduction sums FP32 values in an unspecified order, so it may differ in the last
/// bits). The reductions read the stored FP16 `dz`, as the graph does.
pub(crate) fn dbn_reduce<T: Element>(
    shape: &Nhwc,
    y: &[T],
    dz: &[T],
    mean: &[T::Acc],
    inv_std: &[T::Acc],
) -> Result<[Vec<T::Acc>; 2]> {
    shape.validate("y")?;
    check_len("y", y, shape.elems())?;
    check_len("dz", dz, shape.elems())?;
    check_len("saved_mean", mean, shape.c)?;
    check_len("saved_inv_std", inv_std, shape.c)?;
    let c = shape.c;
    // Blocks of pixels in parallel, each widened a slice at a time; the FP32 products are the
    // graph's, summed in f64 (chunk by chunk, in row order within a chunk).
    let sums = channel_sums::<2, Vec<T::Acc>, _>(shape.pixels(), c, |rows, buf, acc| {
        let range = rows.start * c..rows.end * c;
        let n = range.len();
        buf.resize(2 * n, T::Acc::ZERO);
        let (yv, dv) = buf.split_at_mut(n);
        T::widen_into(&y[range.clone()], yv);
        T::widen_into(&dz[range], dv);
        let (mean, inv_std) = (&mean[..c], &inv_std[..c]);
        sums::add_rows(Terms::BwdArith { mean, inv_std }, yv, dv, &mut acc[..c]);
    });
    Ok([
        sums.iter().map(|s| T::Acc::from_f64(s[0])).collect(),
        sums.iter().map(|s| T::Acc::from_f64(s[1])).collect(),
    ])
}

/// The generic route's `dbn_coefficients` graph on the CPU: the coefficients of
/// `dy = A·dz + B·y + C` over `count` elements per channel, every step in FP32 in the graph's
/// order (`a = γ·inv_std`, `B = ((a·inv_std)·dγ)·(−1/M)`, `C = ((a·dβ)·(−1/M)) − B·mean`,
/// `A = a`, with `−1/M` rounded to FP32 as the graph's by-value scalar). The GPU may contract a
/// multiply and the final subtraction into one FMA: at most one FP32 rounding apart.
pub(crate) fn dbn_coefficients<A: Real>(
    count: usize,
    gamma: &[A],
    inv_std: &[A],
    mean: &[A],
    dgamma: &[A],
    dbeta: &[A],
) -> Result<[Vec<A>; 3]> {
    let c = gamma.len();
    check_len("saved_inv_std", inv_std, c)?;
    check_len("saved_mean", mean, c)?;
    check_len("dgamma", dgamma, c)?;
    check_len("dbeta", dbeta, c)?;
    // −1/M rounded once to the arithmetic type, as the graph's by-value FP32 scalar.
    let nm = A::from_f64(-1.0 / count as f64);
    let mut out = [
        Vec::with_capacity(c),
        Vec::with_capacity(c),
        Vec::with_capacity(c),
    ];
    for k in 0..c {
        let a = gamma[k] * inv_std[k];
        let b = a * inv_std[k] * dgamma[k] * nm;
        let cc = a * dbeta[k] * nm - b * mean[k];
        out[0].push(a);
        out[1].push(b);
        out[2].push(cc);
    }
    Ok(out)
}
