//! The backward roles of the unfused and generic routes through the previous BN: the shortcut
//! gradient join ([`GraphRole::AddBranch`]), the ReLU backward of the materialized previous
//! activation ([`GraphRole::ReluBackward`]), and the previous BN's backward: NormBackward
//! ([`GraphRole::BnBackward`]) or the reductions ([`GraphRole::DbnReduce`]) and coefficients
//! ([`GraphRole::DbnCoefficients`]) before the dBN apply.

use super::backward_fused::{dgrad_graph, wgrad_graph};
use super::bn_backward;
use super::common::{lg, Cx};
use super::{no_kernel, RoleDef, RolePass};
use crate::cbr::bn_sync::{BnSide, SyncAction};
use crate::cbr::graphs::{self, BackwardResidual};
use crate::cbr::kernels::OwnKernel;
use crate::cbr::keys as k;
use crate::cbr::layer::{CbrConfig, GraphRole, LayerGraph, RouteKind};
use crate::cbr::run::LayerIo;
use crate::error::Result;
use crate::reference::{self as r, Element};

/// The residual gradient join.
pub(super) const ADD_BRANCH: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: no_kernel,
};

/// The ReLU backward of the previous BN's activation.
pub(super) const RELU_BACKWARD: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: |_, _| Some(OwnKernel::ReluBackward),
};

/// NormBackward sums inside the graph: synchronized BN splits it on the CPU.
pub(super) const BN_BACKWARD: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Split,
    accumulates: &[],
    kernel: no_kernel,
};

/// The previous BN's dγ, dβ by reduction.
pub(super) const DBN_REDUCE: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[k::DGAMMA.name(), k::DBETA.name()],
    kernel: |_, _| Some(OwnKernel::DbnReduce),
};

/// The previous BN's dBN-apply coefficients: from the summed dγ, dβ under synchronized BN.
pub(super) const DBN_COEFFICIENTS: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Coefficients {
        side: BnSide::Prev,
        outputs: bn_backward::DBN,
        after_step: false,
    },
    accumulates: &[],
    kernel: |_, _| Some(OwnKernel::DbnCoefficients),
};

/// Unfused and generic routes, input through the previous BN: wgrad and dgrad on the
/// materialized `a_prev`, the shortcut gradient join, the ReLU backward → `dz_prev`, then the
/// previous BN's backward.
pub(super) fn graphs(config: &CbrConfig, kind: RouteKind) -> Vec<LayerGraph> {
    let s = &config.shape;
    let mut out = vec![
        wgrad_graph(config, k::A_PREV.this()),
        dgrad_graph(config, k::DA_PREV.this()),
    ];
    let mut grad = k::DA_PREV.this();
    if config.backward_residual == BackwardResidual::FuseAdd {
        let (g, [x, b, y]) = graphs::add(s.x_dims());
        out.push(lg(
            GraphRole::AddBranch,
            g,
            vec![
                (x, k::DA_PREV.this()),
                (b, k::DY_BRANCH.this()),
                (y, k::DA_SUM.this()),
            ],
        ));
        grad = k::DA_SUM.this();
    }
    let (g, [dy, x, dx]) = graphs::relu_backward(s.x_dims());
    out.push(lg(
        GraphRole::ReluBackward,
        g,
        vec![(dy, grad), (x, k::A_PREV.this()), (dx, k::DZ_PREV.this())],
    ));
    out.extend(bn_backward::graphs(kind, s.x_dims(), BnSide::Prev));
    out
}

/// [`GraphRole::AddBranch`] on the CPU.
pub(super) fn add_branch<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let d = r::add(
        &cx.xs(),
        io.half(k::DA_PREV.this())?,
        io.half(k::DY_BRANCH.this())?,
    )?;
    io.set_half(k::DA_SUM.this(), d)
}

/// [`GraphRole::ReluBackward`] on the CPU.
pub(super) fn relu_backward<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let grad = if cx.cfg.backward_residual == BackwardResidual::FuseAdd {
        k::DA_SUM.this()
    } else {
        k::DA_PREV.this()
    };
    let d = r::relu_bwd(&cx.xs(), io.half(grad)?, io.half(k::A_PREV.this())?)?;
    io.set_half(k::DZ_PREV.this(), d)
}

/// [`GraphRole::BnBackward`] on the CPU.
pub(super) fn bn_backward<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    bn_backward::norm(&cx.xs(), &bn_backward::names(BnSide::Prev), io)
}

/// [`GraphRole::DbnReduce`] on the CPU.
pub(super) fn dbn_reduce<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    bn_backward::reduce(&cx.xs(), &bn_backward::names(BnSide::Prev), io)
}

/// [`GraphRole::DbnCoefficients`] on the CPU.
pub(super) fn dbn_coefficients<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let n = bn_backward::names(BnSide::Prev);
    bn_backward::coefficients(cx.xs().pixels(), &n, io)
}
