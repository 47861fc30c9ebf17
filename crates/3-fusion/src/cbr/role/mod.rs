//! Each graph role of a CBR layer ([`GraphRole`]) defined once: its graph(s) and tensor
//! bindings, its CPU-executor step, what synchronized BN does with it, and the own kernel its
//! graph is written for, side by side in the module of its family:
//!
//! | module | roles |
//! |---|---|
//! | `forward_fused` | ConvStats, Stats, Finalize |
//! | `forward_unfused` | ApplyPrev, Conv, BnForward |
//! | `backward_fused` | DgradDreluDbn, Wgrad, Dgrad, DbnApply |
//! | `backward_unfused` | AddBranch, ReluBackward, BnBackward, DbnReduce, DbnCoefficients |
//! | `apply` | Apply, ApplyReluBackward, ApplyBnBackward, ApplyDbnReduce, ApplyDbnCoefficients, ApplyDbnApply |
//!
//! (`bn_backward` holds what a BN's backward shares between the previous BN's roles and this
//! BN's own `Apply*` roles; `route` puts each route's graphs in execution order.) Everything
//! else dispatches over roles here: [`GraphRole::def`] (the per-role table: its pass and, forward,
//! its evaluation-mode step, its sync action, accumulated outputs, own kernel) and
//! [`cpu_step`]; [`cpu_eval_step`] and the GPU's evaluation pass dispatch on the table's
//! evaluation step. Adding a role means adding it to [`GraphRole`], to one family module, and
//! to the two matches here.
//! Buffers are named by their typed keys ([`crate::cbr::keys`]); the strings appear only where
//! the public edge (bindings' [`Src`](crate::cbr::Src), buffer tables) spells them.

mod apply;
mod backward_fused;
mod backward_unfused;
pub(crate) mod bn_backward;
mod common;
mod forward_fused;
mod forward_unfused;
mod route;
#[cfg(test)]
mod tests;

pub(crate) use common::Cx;
pub use route::route_graphs;

use super::bn_sync::{BnSide, BnSync, SyncAction};
use super::kernels::OwnKernel;
use super::layer::{CbrConfig, CbrLayer, GraphRole, RouteKind};
use super::run::LayerIo;
use crate::error::{Error, Result};
use crate::reference::Element;

/// What a forward role does in evaluation mode ([`super::Pass::Eval`]), on every executor:
/// the CPU ([`cpu_eval_step`]) and the GPU (`CbrLayer::run_gpu_eval`) dispatch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EvalStep {
    /// As in training (a conv, an apply: they read `eq_scale` / `eq_bias` either way).
    AsTraining,
    /// The conv as in training; its statistics are not computed on the CPU (the GPU graph
    /// still writes the `sum` / `sq_sum` scratch, which nothing reads).
    ConvWithoutStats,
    /// Nothing: the statistics of the batch are not needed.
    Skip,
    /// BN finalize replaced by [`crate::reference::bn_eval_finalize`]: `eq_scale` and
    /// `eq_bias` from the running statistics, nothing else written.
    FinalizeFromRunning,
    /// The unfused BN forward normalizing with the running statistics (on the GPU our
    /// `cbr_bn_eval` kernel in place of training-mode NormForward).
    BnFromRunning,
}

/// Which pass a role runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RolePass {
    /// The forward pass, and what the role does in evaluation mode.
    Forward(EvalStep),
    /// The backward pass (not part of evaluation).
    Backward,
}

/// What one role is, apart from its graphs and its CPU step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RoleDef {
    /// The pass it belongs to (and, forward, its evaluation-mode step).
    pub(crate) pass: RolePass,
    /// What synchronized BN does with its step.
    pub(crate) sync: SyncAction,
    /// The buffers (by name) its step adds into instead of overwriting (zeroed before it runs
    /// on a GPU: [`GraphRole::accumulated_outputs`]).
    pub(crate) accumulates: &'static [&'static str],
    /// The own kernel its graph is written for on a route of a layer (`None`: cuDNN plans
    /// it). [`super::kernels::KernelStep::for_role`] prepares the step from it; whether the
    /// kernel then takes the step is the graph's to say (element types, sizes).
    pub(crate) kernel: fn(&CbrConfig, RouteKind) -> Option<OwnKernel>,
}

/// The `kernel` of a role that no own kernel computes.
fn no_kernel(_: &CbrConfig, _: RouteKind) -> Option<OwnKernel> {
    None
}

impl GraphRole {
    /// The role's entry in the per-role table, from its family's module.
    pub(crate) fn def(self) -> &'static RoleDef {
        match self {
            GraphRole::ConvStats => &forward_fused::CONV_STATS,
            GraphRole::Stats => &forward_fused::STATS,
            GraphRole::Finalize => &forward_fused::FINALIZE,
            GraphRole::ApplyPrev => &forward_unfused::APPLY_PREV,
            GraphRole::Conv => &forward_unfused::CONV,
            GraphRole::BnForward => &forward_unfused::BN_FORWARD,
            GraphRole::DgradDreluDbn => &backward_fused::DGRAD_DRELU_DBN,
            GraphRole::Wgrad => &backward_fused::WGRAD,
            GraphRole::Dgrad => &backward_fused::DGRAD,
            GraphRole::DbnApply => &backward_fused::DBN_APPLY,
            GraphRole::AddBranch => &backward_unfused::ADD_BRANCH,
            GraphRole::ReluBackward => &backward_unfused::RELU_BACKWARD,
            GraphRole::BnBackward => &backward_unfused::BN_BACKWARD,
            GraphRole::DbnReduce => &backward_unfused::DBN_REDUCE,
            GraphRole::DbnCoefficients => &backward_unfused::DBN_COEFFICIENTS,
            GraphRole::Apply => &apply::APPLY,
            GraphRole::ApplyReluBackward => &apply::APPLY_RELU_BACKWARD,
            GraphRole::ApplyBnBackward => &apply::APPLY_BN_BACKWARD,
            GraphRole::ApplyDbnReduce => &apply::APPLY_DBN_REDUCE,
            GraphRole::ApplyDbnCoefficients => &apply::APPLY_DBN_COEFFICIENTS,
            GraphRole::ApplyDbnApply => &apply::APPLY_DBN_APPLY,
        }
    }
}

/// One step on the CPU; `replicas` multiplies the BN finalize's element count (synchronized
/// BN, whose sums the caller has reduced). Runs what the role's graph computes, buffer for
/// buffer, from the same family module that builds the graph.
pub(crate) fn cpu_step<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    role: GraphRole,
    io: &mut I,
    replicas: usize,
) -> Result<()> {
    let cx = &Cx::new(layer, replicas);
    match role {
        GraphRole::ConvStats => forward_fused::conv_stats(cx, io),
        GraphRole::Stats => forward_fused::stats(cx, io),
        GraphRole::Finalize => forward_fused::finalize(cx, io),
        GraphRole::ApplyPrev => forward_unfused::apply_prev(cx, io),
        GraphRole::Conv => forward_unfused::conv(cx, io),
        GraphRole::BnForward => forward_unfused::bn_forward(cx, io),
        GraphRole::DgradDreluDbn => backward_fused::dgrad_drelu_dbn(cx, io),
        GraphRole::Wgrad => backward_fused::wgrad(cx, io),
        GraphRole::Dgrad => backward_fused::dgrad(cx, io),
        GraphRole::DbnApply => backward_fused::dbn_apply(cx, io),
        GraphRole::AddBranch => backward_unfused::add_branch(cx, io),
        GraphRole::ReluBackward => backward_unfused::relu_backward(cx, io),
        GraphRole::BnBackward => backward_unfused::bn_backward(cx, io),
        GraphRole::DbnReduce => backward_unfused::dbn_reduce(cx, io),
        GraphRole::DbnCoefficients => backward_unfused::dbn_coefficients(cx, io),
        GraphRole::Apply => apply::apply(cx, io),
        GraphRole::ApplyReluBackward => apply::relu_backward(cx, io),
        GraphRole::ApplyBnBackward => apply::bn_backward(cx, io),
        GraphRole::ApplyDbnReduce => apply::dbn_reduce(cx, io),
        GraphRole::ApplyDbnCoefficients => apply::dbn_coefficients(cx, io),
        GraphRole::ApplyDbnApply => apply::dbn_apply(cx, io),
    }
}

/// One forward role in evaluation mode (`Pass::Eval`): the conv steps as in training, minus
/// the statistics; BN finalize replaced by [`crate::reference::bn_eval_finalize`] (eq_scale
/// and eq_bias from the running statistics, nothing else written); the unfused route's BN
/// forward normalizing with the running statistics. The applies (the next conv's prologue,
/// the materialized activation, the dual residual) read the same `eq_scale` / `eq_bias`
/// buffers as in training.
pub(crate) fn cpu_eval_step<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    role: GraphRole,
    io: &mut I,
) -> Result<()> {
    let cx = &Cx::new(layer, 1);
    match role.def().pass {
        RolePass::Forward(EvalStep::AsTraining) => cpu_step(layer, role, io, 1),
        RolePass::Forward(EvalStep::ConvWithoutStats) => forward_fused::conv_stats_eval(cx, io),
        RolePass::Forward(EvalStep::Skip) => Ok(()),
        RolePass::Forward(EvalStep::FinalizeFromRunning) => forward_fused::finalize_eval(cx, io),
        RolePass::Forward(EvalStep::BnFromRunning) => forward_unfused::bn_forward_eval(cx, io),
        RolePass::Backward => Err(Error::CudnnMessage(format!(
            "layer {}: {role:?} is a backward step, not part of evaluation",
            layer.config().shape.label()
        ))),
    }
}

/// A whole-BN graph's step ([`SyncAction::Split`]) with synchronized BN on the CPU: reduce,
/// synchronize, apply.
pub(crate) fn split_synced_step<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    role: GraphRole,
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
) -> Result<()> {
    let replicas = sync.replicas();
    let cx = &Cx::new(layer, replicas);
    match role {
        GraphRole::BnForward => forward_unfused::bn_forward_synced(cx, io, sync),
        GraphRole::BnBackward => {
            bn_backward::norm_synced(io, sync, &cx.xs(), BnSide::Prev, replicas)
        }
        GraphRole::ApplyBnBackward => {
            bn_backward::norm_synced(io, sync, &cx.ys(), BnSide::This, replicas)
        }
        other => Err(Error::BnSync(format!(
            "{other:?} is not a whole-BN graph: synchronized BN does not split it"
        ))),
    }
}
