//! The conv's backward roles: the fused route's dgrad + dReLU + dBN weights
//! ([`GraphRole::DgradDreluDbn`]) and dBN apply ([`GraphRole::DbnApply`]), and on every route
//! wgrad ([`GraphRole::Wgrad`], with the previous BN's prologue on the fused route) and the
//! plain dgrad ([`GraphRole::Dgrad`]).

use super::bn_backward;
use super::common::{input_stamp, lg, prologue_input, unwritten, Cx};
use super::{no_kernel, RoleDef, RolePass};
use crate::cbr::bn_sync::{BnSide, SyncAction};
use crate::cbr::graphs::{self, BackwardResidual};
use crate::cbr::kernels::OwnKernel;
use crate::cbr::keys as k;
use crate::cbr::layer::{CbrConfig, GraphRole, LayerGraph, RouteKind, Src};
use crate::cbr::run::LayerIo;
use crate::error::Result;
use crate::reference::{self as r, ConvInput, Element, ReluJoin, SavedBn};

/// The fused dgrad + dReLU + dBN weights: its dBN coefficients come from the local sums, so
/// synchronized BN recomputes them after it from the summed dγ, dβ.
pub(super) const DGRAD_DRELU_DBN: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Coefficients {
        side: BnSide::Prev,
        outputs: bn_backward::DBN,
        after_step: true,
    },
    accumulates: &[k::DGAMMA.name(), k::DBETA.name()],
    kernel: no_kernel,
};

/// wgrad.
pub(super) const WGRAD: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: no_kernel,
};

/// Plain dgrad.
pub(super) const DGRAD: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: no_kernel,
};

/// The previous BN's dBN apply (fused route, and the generic route's reduction chain).
pub(super) const DBN_APPLY: RoleDef = RoleDef {
    pass: RolePass::Backward,
    sync: SyncAction::Local,
    accumulates: &[],
    kernel: |_, _| Some(OwnKernel::DbnApply),
};

/// The fused route's backward through the previous BN: dgrad + dReLU + dBN weights → wgrad
/// with the prologue → dBN apply.
pub(super) fn fused_graphs(config: &CbrConfig) -> Vec<LayerGraph> {
    let s = &config.shape;
    let (g, t) = graphs::dgrad_drelu_dbn(s, config.backward_residual);
    let mut b = vec![
        (t.dy, k::DY.this()),
        (t.w, k::W.this()),
        (t.y_prev, k::Y.prev()),
        (t.mean, k::SAVED_MEAN.prev()),
        (t.inv_std, k::SAVED_INV_STD.prev()),
        (t.gamma, k::GAMMA.prev()),
        (t.beta, k::BETA.prev()),
        (t.dz, k::DZ_PREV.this()),
        (t.dbn.dscale, k::DGAMMA.prev()),
        (t.dbn.dbias, k::DBETA.prev()),
        (t.dbn.eq_dy_scale, k::DBN_A.this()),
        (t.dbn.eq_x_scale, k::DBN_B.this()),
        (t.dbn.eq_bias, k::DBN_C.this()),
    ];
    b.extend(t.residual.map(|r| (r, k::DY_BRANCH.this())));
    let dgrad_drelu_dbn = lg(GraphRole::DgradDreluDbn, g, b);
    let (g, t) = graphs::wgrad(s, true);
    let mut b = vec![(t.x, k::Y.prev())];
    // `graphs::wgrad(_, true)` always builds the prologue; without it the step would read
    // the raw `y_prev`, which the bindings check then names.
    if let Some((sc, bi)) = t.prologue {
        b.extend([(sc, k::EQ_SCALE.prev()), (bi, k::EQ_BIAS.prev())]);
    }
    b.extend([(t.dy, k::DY.this()), (t.dw, k::DW.this())]);
    let wgrad = lg(GraphRole::Wgrad, g, b);
    let apply = bn_backward::apply_graph(
        s.x_dims(),
        GraphRole::DbnApply,
        &bn_backward::names(BnSide::Prev),
    );
    vec![dgrad_drelu_dbn, wgrad, apply]
}

/// wgrad from `x` (a raw input or the materialized previous activation).
pub(super) fn wgrad_graph(config: &CbrConfig, x: Src) -> LayerGraph {
    let (g, t) = graphs::wgrad(&config.shape, false);
    lg(
        GraphRole::Wgrad,
        g,
        vec![(t.x, x), (t.dy, k::DY.this()), (t.dw, k::DW.this())],
    )
}

/// The plain dgrad into `dx` (the input's gradient, or the materialized activation's).
pub(super) fn dgrad_graph(config: &CbrConfig, dx_dst: Src) -> LayerGraph {
    let (g, [dy, w, dx]) = graphs::conv_dgrad(&config.shape);
    lg(
        GraphRole::Dgrad,
        g,
        vec![(dy, k::DY.this()), (w, k::W.this()), (dx, dx_dst)],
    )
}

/// A raw input's backward: wgrad, and dgrad where the input's gradient is needed.
pub(super) fn raw_input_graphs(config: &CbrConfig) -> Vec<LayerGraph> {
    let mut out = vec![wgrad_graph(config, k::X.this())];
    if config.input_grad {
        out.push(dgrad_graph(config, k::DX.this()));
    }
    out
}

/// [`GraphRole::DgradDreluDbn`] on the CPU.
pub(super) fn dgrad_drelu_dbn<T: Element, I: LayerIo<T> + ?Sized>(
    cx: &Cx<'_>,
    io: &mut I,
) -> Result<()> {
    let p = cx.p();
    p.validate()?;
    let mut scratch = io.take_scratch();
    let fuse_add = cx.cfg.backward_residual == BackwardResidual::FuseAdd;
    let mut coefficients = None;
    // `dz` is written where the table keeps it (in a shared arena: in place).
    let done = io.write_half(k::DZ_PREV.this(), p.x_elems(), &mut |dz, rd| {
        let join = ReluJoin {
            resid: None,
            dy_branch: fuse_add.then(|| rd.half(k::DY_BRANCH.this())).transpose()?,
        };
        coefficients = Some(r::dgrad_drelu_dbn_into_slice(
            &p,
            rd.half(k::DY.this())?,
            rd.half(k::W.this())?,
            rd.half(k::Y.prev())?,
            &SavedBn {
                mean: rd.float(k::SAVED_MEAN.prev())?,
                inv_std: rd.float(k::SAVED_INV_STD.prev())?,
                gamma: rd.float(k::GAMMA.prev())?,
                beta: rd.float(k::BETA.prev())?,
            },
            &join,
            &mut scratch,
            dz,
        )?);
        Ok(())
    });
    io.put_scratch(scratch);
    done?;
    let out = coefficients.ok_or_else(|| unwritten(k::DZ_PREV.name()))?;
    io.set_float(k::DGAMMA.prev(), out.dgamma)?;
    io.set_float(k::DBETA.prev(), out.dbeta)?;
    io.set_float(k::DBN_A.this(), out.a)?;
    io.set_float(k::DBN_B.this(), out.b)?;
    io.set_float(k::DBN_C.this(), out.c)
}

/// [`GraphRole::Wgrad`] on the CPU: through the prologue on the fused route, else from the
/// plain input.
pub(super) fn wgrad<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    let plain_in = cx.plain_in();
    // `dw`'s own storage (every element is overwritten), lent before the inputs are read.
    let storage = io.take_half(k::DW.this())?;
    let mut scratch = io.take_scratch();
    let prologue = cx.through_bn() && cx.kind == RouteKind::Fused;
    let input = if prologue {
        prologue_input(io)?
    } else {
        ConvInput::Plain(io.half(plain_in)?)
    };
    // The forward's input where the scratch holds this very input, else recomputed:
    // `conv_wgrad`'s values either way.
    let stamp = input_stamp(io, prologue, plain_in);
    let dy = io.half(k::DY.this())?;
    let dw = r::wgrad_with_prologue_with(&cx.p(), input, dy, &mut scratch, stamp, storage);
    io.put_scratch(scratch);
    io.set_half(k::DW.this(), dw?)
}

/// [`GraphRole::Dgrad`] on the CPU: into the materialized activation's gradient, or the raw
/// input's.
pub(super) fn dgrad<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    let dst = if cx.through_bn() {
        k::DA_PREV.this()
    } else {
        k::DX.this()
    };
    let p = cx.p();
    p.validate()?;
    let mut scratch = io.take_scratch();
    let done = io.write_half(dst, p.x_elems(), &mut |dx, rd| {
        let (dy, w) = (rd.half(k::DY.this())?, rd.half(k::W.this())?);
        Ok(r::conv_dgrad_into_slice(&p, dy, w, &mut scratch, dx)?)
    });
    io.put_scratch(scratch);
    done
}

/// [`GraphRole::DbnApply`] on the CPU.
pub(super) fn dbn_apply<T: Element, I: LayerIo<T> + ?Sized>(cx: &Cx<'_>, io: &mut I) -> Result<()> {
    bn_backward::apply(&cx.xs(), &bn_backward::names(BnSide::Prev), io)
}
