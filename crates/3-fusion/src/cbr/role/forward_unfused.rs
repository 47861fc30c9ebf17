//! The forward roles of the unfused route (and the generic route's materialized input):
//! the previous BN's activation ([`GraphRole::ApplyPrev`]), the plain conv
//! ([`GraphRole::Conv`], also the fused route's split form) and NormForward
//! ([`GraphRole::BnForward`]).

use super::common::{lg, plain_in, residual_bindings, residual_of, Cx};
use super::forward_fused::{eval_finalized, finalize_running};
use super::{no_kernel, EvalStep, RoleDef, RolePass};
use crate::cbr::bn_sync::{all_reduce_pair, BnSync, SyncAction};
use crate::cbr::graphs::{self, ApplyResidual};
use crate::cbr::kernels::OwnKernel;
use crate::cbr::keys as k;
use crate::cbr::layer::{CbrConfig, GraphRole, InputKind, LayerGraph, RouteKind, Src};
use crate::cbr::run::LayerIo;
use crate::error::Result;
use crate::exec::Scalar;
use crate::graph::DataType;
use crate::reference::bn::bn_recompute;
use crate::reference::params::check_len;
use crate::reference::{self as r, Activation, Element, Nhwc, Real, Residual, RunningStats};

/// The previous BN's activation: our apply kernel on the generic route (the unfused route's
/// ReLU has none).
pub(super) const APPLY_PREV: RoleDef = RoleDef {
    pass: RolePass::Forward(EvalStep::AsTraining),
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: |_, kind| (kind != RouteKind::Unfused).then_some(OwnKernel::Apply(ApplyResidual::None)),
};

/// The plain conv.
pub(super) const CONV: RoleDef = RoleDef {
    pass: RolePass::Forward(EvalStep::AsTraining),
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: no_kernel,
};

/// NormForward sums its statistics inside the graph: synchronized BN splits it on the CPU.
pub(super) const BN_FORWARD: RoleDef = RoleDef {
    pass: RolePass::Forward(EvalStep::BnFromRunning),
    sync: SyncAction::Split,
    accumulates: &[],
    kernel: no_kernel,
};

/// Unfused and generic routes, input through the previous BN: the previous BN's activation
/// materialized as `a_prev`: the ReLU of its stored BN output `y_bn` on the unfused route (what
/// an unfused framework runs), its apply from the eq coefficients on the generic route.
pub(super) fn apply_prev_graph(config: &CbrConfig, kind: RouteKind) -> Option<LayerGraph> {
    if config.input != InputKind::ThroughBn {
        return None;
    }
    if kind == RouteKind::Unfused {
        let (g, [x, a]) = graphs::relu_forward(config.shape.x_dims());
        return Some(lg(
            GraphRole::ApplyPrev,
            g,
            vec![(x, k::Y_BN.prev()), (a, k::A_PREV.this())],
        ));
    }
    let (g, t) = graphs::apply(config.shape.x_dims(), DataType::Half, ApplyResidual::None);
    Some(lg(
        GraphRole::ApplyPrev,
        g,
        vec![
            (t.y, k::Y.prev()),
            (t.scale, k::EQ_SCALE.prev()),
            (t.bias, k::EQ_BIAS.prev()),
            (t.a, k::A_PREV.this()),
        ],
    ))
}

/// A plain conv from `conv_in` storing `y`.
pub(super) fn conv_graph(config: &CbrConfig, conv_in: Src) -> LayerGraph {
    let (g, t) = graphs::conv_fprop(&config.shape, false, false);
    lg(
        GraphRole::Conv,
        g,
        vec![(t.x, conv_in), (t.w, k::W.this()), (t.y, k::Y.this())],
    )
}

/// The unfused route's conv and BN forward.
pub(super) fn graphs(config: &CbrConfig) -> Vec<LayerGraph> {
    vec![
        conv_graph(config, plain_in(config)),
        bn_forward_graph(config),
    ]
}

/// The unfused route's BN forward (NormForward, training): with the activation fused in and
/// stored as `a` when the layer materializes it, else the BN output stored as `y_bn` (read by
/// the next layer's ReLU, or by a block output's residual add for a shortcut BN).
fn bn_forward_graph(config: &CbrConfig) -> LayerGraph {
    let dims = config.shape.y_dims();
    let (g, i, o, act) = match config.apply {
        Some(residual) => {
            let (g, i, o, t) = graphs::batchnorm_activation(dims, residual);
            (g, i, o, Some(t))
        }
        None => {
            let (g, i, o) = graphs::batchnorm_forward(dims);
            (g, i, o, None)
        }
    };
    let mut b = vec![
        (i.x, k::Y.this()),
        (i.scale, k::GAMMA.this()),
        (i.bias, k::BETA.this()),
        (i.epsilon, Src::Scalar(Scalar::F32(config.epsilon as f32))),
        (i.momentum, Src::Scalar(Scalar::F32(config.momentum as f32))),
        (o.mean, k::SAVED_MEAN.this()),
        (o.inv_variance, k::SAVED_INV_STD.this()),
    ];
    b.extend(i.prev_running_mean.map(|t| (t, k::RUNNING_MEAN.this())));
    b.extend(i.prev_running_var.map(|t| (t, k::RUNNING_VAR.this())));
    b.extend(
        o.next_running_mean
            .map(|t| (t, k::RUNNING_MEAN_NEXT.this())),
    );
    b.extend(o.next_running_var.map(|t| (t, k::RUNNING_VAR_NEXT.this())));
    match act {
        Some(t) => {
            b.push((t.a, k::A.this()));
            b.extend(residual_bindings(t.residual, t.residual_scale_bias));
        }
        None => b.push((o.y, k::Y_BN.this())),
    }
    lg(GraphRole::BnForward, g, b)
}

/// [`GraphRole::ApplyPrev`] on the CPU.
pub(super) fn apply_prev<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let xs = cx.xs();
    let a = if cx.kind == RouteKind::Unfused {
        r::relu_fwd(&xs, io.half(k::Y_BN.prev())?)?
    } else {
        r::bn_apply(
            &xs,
            io.half(k::Y.prev())?,
            io.half(k::EQ_SCALE.prev())?,
            io.half(k::EQ_BIAS.prev())?,
            Residual::None,
            Activation::Relu,
        )?
    };
    io.set_half(k::A_PREV.this(), a)
}

/// [`GraphRole::Conv`] on the CPU.
pub(super) fn conv<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    let y = r::conv_fprop(&cx.p(), io.half(cx.plain_in())?, io.half(k::W.this())?)?;
    io.set_half(k::Y.this(), y)
}

/// [`GraphRole::BnForward`] on the CPU.
pub(super) fn bn_forward<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let ys = cx.ys();
    let cfg = cx.cfg;
    let mut mean = io.float(k::RUNNING_MEAN.this())?.to_vec();
    let mut var = io.float(k::RUNNING_VAR.this())?.to_vec();
    let y = io.half(k::Y.this())?;
    let (gamma, beta) = (io.float(k::GAMMA.this())?, io.float(k::BETA.this())?);
    let out = r::bn_fwd_train(
        &ys,
        y,
        gamma,
        beta,
        RunningStats {
            mean: &mut mean,
            var: &mut var,
        },
        &cx.bn(),
    )?;
    let activation = match cfg.apply {
        // The graph keeps the normalized value virtual (FP32) through the residual
        // add and the ReLU, and stores only the activation: round once, at the end.
        Some(_) => Some(bn_activation(
            &ys,
            y,
            &out.saved_mean,
            &out.saved_inv_std,
            gamma,
            beta,
            residual_of(io, cfg.apply)?,
        )?),
        None => None,
    };
    io.set_float(k::RUNNING_MEAN_NEXT.this(), mean)?;
    io.set_float(k::RUNNING_VAR_NEXT.this(), var)?;
    io.set_float(k::SAVED_MEAN.this(), out.saved_mean)?;
    io.set_float(k::SAVED_INV_STD.this(), out.saved_inv_std)?;
    match activation {
        Some(a) => io.set_half(k::A.this(), a),
        None => io.set_half(k::Y_BN.this(), out.out),
    }
}

/// [`GraphRole::BnForward`] in evaluation mode: normalizing with the running statistics in
/// [`bn_recompute`]'s order, rounded once.
pub(super) fn bn_forward_eval<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let ys = cx.ys();
    let cfg = cx.cfg;
    let out = eval_finalized(cx, io)?;
    let y = io.half(k::Y.this())?;
    let (gamma, beta) = (io.float(k::GAMMA.this())?, io.float(k::BETA.this())?);
    let (mean, inv_std) = (&out.saved_mean, &out.saved_inv_std);
    match cfg.apply {
        Some(_) => {
            let a = bn_activation(
                &ys,
                y,
                mean,
                inv_std,
                gamma,
                beta,
                residual_of(io, cfg.apply)?,
            )?;
            io.set_half(k::A.this(), a)
        }
        None => {
            let y_bn = bn_only(&ys, y, mean, inv_std, gamma, beta);
            io.set_half(k::Y_BN.this(), y_bn)
        }
    }
}

/// `BN(y)` per element in [`bn_recompute`]'s order, rounded once: the BN output `y_bn`.
fn bn_only<T: Element>(
    shape: &Nhwc,
    y: &[T],
    mean: &[T::Acc],
    inv_std: &[T::Acc],
    gamma: &[T::Acc],
    beta: &[T::Acc],
) -> Vec<T> {
    let c = shape.c;
    y.iter()
        .enumerate()
        .map(|(i, v)| {
            let ch = i % c;
            T::from_acc(bn_recompute(
                v.to_acc(),
                mean[ch],
                inv_std[ch],
                gamma[ch],
                beta[ch],
            ))
        })
        .collect()
}

/// [`GraphRole::BnForward`] with synchronized BN: the batch's GenStats sums reduced over the
/// replicas, finalized with the global count, then the normalization (and the fused
/// activation, when the layer materializes it) as the local graph does it.
pub(super) fn bn_forward_synced<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
) -> Result<()> {
    let ys = cx.ys();
    let cfg = cx.cfg;
    let mut stats = r::genstats(&ys, io.half(k::Y.this())?)?;
    (stats.sum, stats.sqsum) = all_reduce_pair(sync, &stats.sum, &stats.sqsum)?;
    let fin = finalize_running::<T, I>(cx, io, &stats, ys.pixels() * sync.replicas())?;
    let (y, gamma, beta) = (
        io.half(k::Y.this())?,
        io.float(k::GAMMA.this())?,
        io.float(k::BETA.this())?,
    );
    let out = match cfg.apply {
        Some(_) => bn_activation(
            &ys,
            y,
            &fin.saved_mean,
            &fin.saved_inv_std,
            gamma,
            beta,
            residual_of(io, cfg.apply)?,
        )?,
        None => bn_only(&ys, y, &fin.saved_mean, &fin.saved_inv_std, gamma, beta),
    };
    io.set_float(k::SAVED_MEAN.this(), fin.saved_mean)?;
    io.set_float(k::SAVED_INV_STD.this(), fin.saved_inv_std)?;
    match cfg.apply {
        Some(_) => io.set_half(k::A.this(), out),
        None => io.set_half(k::Y_BN.this(), out),
    }
}

/// The unfused route's BN forward with the activation fused in:
/// `relu(BN(y) [+ r | + r·s2 + b2])` with the normalized value, the residual sum and the ReLU
/// in `T::Acc` (the graph's FP32 virtuals), rounded to `T` once.
pub(crate) fn bn_activation<T: Element>(
    shape: &Nhwc,
    y: &[T],
    mean: &[T::Acc],
    inv_std: &[T::Acc],
    gamma: &[T::Acc],
    beta: &[T::Acc],
    residual: Residual<'_, T>,
) -> Result<Vec<T>> {
    let c = shape.c;
    let n = y.len();
    match residual {
        Residual::Add(r) => check_len("residual", r, n)?,
        Residual::ScaleBias { r, scale, bias } => {
            check_len("residual", r, n)?;
            check_len("residual_scale", scale, c)?;
            check_len("residual_bias", bias, c)?;
        }
        Residual::None => {}
    }
    Ok((0..n)
        .map(|i| {
            let ch = i % c;
            let v = bn_recompute(y[i].to_acc(), mean[ch], inv_std[ch], gamma[ch], beta[ch]);
            let v = match residual {
                Residual::None => v,
                Residual::Add(r) => v + r[i].to_acc(),
                Residual::ScaleBias { r, scale, bias } => {
                    v + (r[i].to_acc() * scale[ch].to_acc() + bias[ch].to_acc())
                }
            };
            T::from_acc(v.relu())
        })
        .collect())
}
