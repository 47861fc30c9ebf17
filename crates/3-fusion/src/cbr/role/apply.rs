//! The roles of a materialized activation `relu(BN(y) [+ r])`: its apply
//! ([`GraphRole::Apply`]) and its backward: the ReLU backward
//! ([`GraphRole::ApplyReluBackward`]), then this BN's backward: NormBackward
//! ([`GraphRole::ApplyBnBackward`]) or the reduction chain ([`GraphRole::ApplyDbnReduce`],
//! [`GraphRole::ApplyDbnCoefficients`], [`GraphRole::ApplyDbnApply`]).

use super::bn_backward;
use super::common::{lg, residual_bindings, residual_of, Cx};
use super::{no_kernel, EvalStep, RoleDef, RolePass};
use crate::cbr::bn_sync::{BnSide, SyncAction};
use crate::cbr::graphs;
use crate::cbr::kernels::OwnKernel;
use crate::cbr::keys as k;
use crate::cbr::layer::{CbrConfig, GraphRole, LayerGraph, RouteKind};
use crate::cbr::run::LayerIo;
use crate::error::Result;
use crate::graph::DataType;
use crate::reference::{self as r, Activation, Element};

/// The apply: our kernel of the layer's residual form.
pub(super) const APPLY: RoleDef = RoleDef {
    pass: RolePass::Forward(EvalStep::AsTraining),
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: |config, _| config.apply.map(OwnKernel::Apply),
};

/// The activation's ReLU backward.
pub(super) const APPLY_RELU_BACKWARD: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: |_, _| Some(OwnKernel::ReluBackward),
};

/// NormBackward of this BN: synchronized BN splits it on the CPU.
pub(super) const APPLY_BN_BACKWARD: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Split,
    accumulates: &[],
    kernel: no_kernel,
};

/// This BN's dγ, dβ by reduction.
pub(super) const APPLY_DBN_REDUCE: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[k::DGAMMA.name(), k::DBETA.name()],
    kernel: |_, _| Some(OwnKernel::DbnReduce),
};

/// This BN's dBN-apply coefficients: from the summed dγ, dβ under synchronized BN.
pub(super) const APPLY_DBN_COEFFICIENTS: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Coefficients {
        side: BnSide::This,
        outputs: bn_backward::APPLY_DBN,
        after_step: false,
    },
    accumulates: &[],
    kernel: |_, _| Some(OwnKernel::DbnCoefficients),
};

/// This BN's dBN apply (dpre → this layer's dY).
pub(super) const APPLY_DBN_APPLY: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: |_, _| Some(OwnKernel::DbnApply),
};

/// The apply on the fused and generic routes (the unfused route's BN forward already stored
/// the activation), from the BN's eq coefficients.
pub(super) fn apply_graph(config: &CbrConfig, kind: RouteKind) -> Option<LayerGraph> {
    let residual = config.apply.filter(|_| kind != RouteKind::Unfused)?;
    let (g, t) = graphs::apply(config.shape.y_dims(), DataType::Half, residual);
    let mut b = vec![
        (t.y, k::Y.this()),
        (t.scale, k::EQ_SCALE.this()),
        (t.bias, k::EQ_BIAS.this()),
        (t.a, k::A.this()),
    ];
    b.extend(residual_bindings(t.residual, t.residual_scale_bias));
    Some(lg(GraphRole::Apply, g, b))
}

/// The materialized activation's backward (and a shortcut BN's): dA → dpre through the ReLU
/// (using the stored activation as the mask), then dpre → dY, dγ, dβ through this BN's
/// backward. A shortcut BN's `dpre` is the block output's: the same ReLU backward fed both
/// BNs, so it runs only the BN backward.
pub(super) fn backward_graphs(config: &CbrConfig, kind: RouteKind) -> Vec<LayerGraph> {
    let mut out = Vec::new();
    let dims = config.shape.y_dims();
    if config.apply.is_some() {
        let (g, [dy, x, dx]) = graphs::relu_backward(dims);
        out.push(lg(
            GraphRole::ApplyReluBackward,
            g,
            vec![(dy, k::DA.this()), (x, k::A.this()), (dx, k::DPRE.this())],
        ));
    }
    if config.apply.is_some() || config.shortcut_bn {
        out.extend(bn_backward::graphs(kind, dims, BnSide::This));
    }
    out
}

/// [`GraphRole::Apply`] on the CPU.
pub(super) fn apply<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    let ys = cx.ys();
    ys.validate("y")?;
    io.write_half(k::A.this(), ys.elems(), &mut |a, rd| {
        Ok(r::bn_apply_into_slice(
            &ys,
            rd.half(k::Y.this())?,
            rd.half(k::EQ_SCALE.this())?,
            rd.half(k::EQ_BIAS.this())?,
            residual_of(rd, cx.cfg.apply)?,
            Activation::Relu,
            a,
        )?)
    })
}

/// [`GraphRole::ApplyReluBackward`] on the CPU.
pub(super) fn relu_backward<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let ys = cx.ys();
    ys.validate("dy")?;
    io.write_half(k::DPRE.this(), ys.elems(), &mut |d, rd| {
        let (da, a) = (rd.half(k::DA.this())?, rd.half(k::A.this())?);
        Ok(r::relu_bwd_into_slice(&ys, da, a, d)?)
    })
}

/// [`GraphRole::ApplyBnBackward`] on the CPU.
pub(super) fn bn_backward<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    bn_backward::norm(&cx.ys(), &bn_backward::names(BnSide::This), io)
}

/// [`GraphRole::ApplyDbnReduce`] on the CPU.
pub(super) fn dbn_reduce<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    bn_backward::reduce(&cx.ys(), &bn_backward::names(BnSide::This), io)
}

/// [`GraphRole::ApplyDbnCoefficients`] on the CPU.
pub(super) fn dbn_coefficients<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let n = bn_backward::names(BnSide::This);
    bn_backward::coefficients(cx.ys().pixels(), &n, io)
}

/// [`GraphRole::ApplyDbnApply`] on the CPU.
pub(super) fn dbn_apply<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    bn_backward::apply(&cx.ys(), &bn_backward::names(BnSide::This), io)
}
