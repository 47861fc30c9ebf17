//! A CBR layer: its configuration, the graphs of each route, and the plans built for a target.
//!
//! Layer *i* owns conv *i* and the BN that follows it (statistics, finalize, optional apply).
//! When its input comes through the previous layer's BN ([`InputKind::ThroughBn`]), the fused
//! route applies that BN (and its ReLU) as the conv's prologue, and the backward pass produces
//! the previous BN's gradients (dγ, dβ) and dY of the previous conv.
//!
//! | step | fused route | unfused route |
//! |---|---|---|
//! | forward | [prologue] conv + GenStats → BN finalize → [apply] | [apply prev] → conv → BN forward → eq coefficients → [apply] |
//! | backward | dgrad + dReLU + dBN weights → wgrad with prologue → dBN apply | wgrad → dgrad [→ add] → ReLU backward → BN backward |
//!
//! Both routes read and write the same caller buffers (`y_prev`, `w`, `y`, statistics,
//! eq coefficients, running stats, dY, dW, dγ, dβ, dY_prev); the unfused route needs one more
//! (the materialized previous activation). When a fused graph has no engine for the shape or
//! target, [`CbrLayer::plan`] falls back to the unfused route and [`CbrLayer::route`] says why.

use super::graphs::{self, ApplyResidual, BackwardResidual};
use super::ConvShape;
use crate::cache::PlanCache;
use crate::error::{Error, Result};
use crate::graph::{DataType, Graph};
use crate::plan::ExecutionPlan;
use crate::target::Target;
use std::sync::Arc;

/// Where a layer's input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// A raw input (the network's first conv): no prologue, no BN before it.
    Raw,
    /// The previous conv's raw output, through the previous BN's apply + ReLU.
    ThroughBn,
}

/// Everything that defines a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CbrConfig {
    /// Conv geometry.
    pub shape: ConvShape,
    /// BN ε (cuDNN's minimum is 1e-5).
    pub epsilon: f64,
    /// Weight of the new batch statistic in the running update (PyTorch's 0.1).
    pub momentum: f64,
    /// Where the input comes from.
    pub input: InputKind,
    /// Materialize this layer's activation (`relu(BN(y) [+ r])`), e.g. at a block output.
    pub apply: Option<ApplyResidual>,
    /// How the previous BN's ReLU output was used (the backward pass must match the forward).
    pub backward_residual: BackwardResidual,
}

impl CbrConfig {
    /// A layer whose input comes through the previous BN, with ε = 1e-5, momentum 0.1 and no
    /// materialized output.
    pub fn new(shape: ConvShape) -> Self {
        CbrConfig {
            shape,
            epsilon: 1e-5,
            momentum: 0.1,
            input: InputKind::ThroughBn,
            apply: None,
            backward_residual: BackwardResidual::None,
        }
    }

    /// The network's first conv (raw input).
    pub fn first(shape: ConvShape) -> Self {
        CbrConfig {
            input: InputKind::Raw,
            ..Self::new(shape)
        }
    }

    /// Also materialize the activation.
    pub fn with_apply(mut self, residual: ApplyResidual) -> Self {
        self.apply = Some(residual);
        self
    }

    /// Set the backward residual form.
    pub fn with_backward_residual(mut self, residual: BackwardResidual) -> Self {
        self.backward_residual = residual;
        self
    }
}

/// The route a layer runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// cuDNN's fused CBR graphs.
    Fused,
    /// Separate, materialized steps, because a fused graph has no engine here.
    Unfused {
        /// Which fused graph failed, and cuDNN's account of it.
        reason: String,
    },
}

impl Route {
    /// "fused" or "unfused".
    pub fn name(&self) -> &'static str {
        match self {
            Route::Fused => "fused",
            Route::Unfused { .. } => "unfused",
        }
    }
}

/// What a graph does within the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GraphRole {
    /// [prologue] conv + GenStats.
    ConvStats,
    /// BN finalize.
    Finalize,
    /// The layer's own apply (when materialized).
    Apply,
    /// dgrad + dReLU + dBN weights (of the previous BN).
    DgradDreluDbn,
    /// wgrad (with the prologue when the input comes through a BN).
    Wgrad,
    /// dBN apply: dY of the previous conv.
    DbnApply,
    /// Plain dgrad: the input gradient of a first layer, or the unfused route's dgrad.
    Dgrad,
    /// Unfused: the previous BN's apply + ReLU, materialized.
    ApplyPrev,
    /// Unfused: plain conv.
    Conv,
    /// Unfused: BN forward (training).
    BnForward,
    /// Unfused: eq_scale / eq_bias from the batch statistics.
    EqCoefficients,
    /// Unfused: residual gradient join.
    AddBranch,
    /// ReLU backward (unfused route; and the apply's backward).
    ReluBackward,
    /// BN backward (unfused route; and the apply's backward: the NormBackward route).
    BnBackward,
}

impl GraphRole {
    /// Whether the role belongs to the backward pass.
    pub fn is_backward(self) -> bool {
        matches!(
            self,
            GraphRole::DgradDreluDbn
                | GraphRole::Wgrad
                | GraphRole::DbnApply
                | GraphRole::Dgrad
                | GraphRole::AddBranch
                | GraphRole::ReluBackward
                | GraphRole::BnBackward
        )
    }
}

/// The graphs of one route of a layer, in execution order (forward, then backward).
pub fn route_graphs(config: &CbrConfig, fused: bool) -> Vec<(GraphRole, Graph)> {
    let s = &config.shape;
    let through_bn = config.input == InputKind::ThroughBn;
    let mut out = Vec::new();
    if fused {
        out.push((
            GraphRole::ConvStats,
            graphs::conv_fprop(s, through_bn, true).0,
        ));
        out.push((GraphRole::Finalize, graphs::bn_finalize(s.k).0));
    } else {
        if through_bn {
            let residual = match config.backward_residual {
                BackwardResidual::Shortcut => ApplyResidual::Add,
                _ => ApplyResidual::None,
            };
            out.push((
                GraphRole::ApplyPrev,
                graphs::apply(s.x_dims(), DataType::Half, residual).0,
            ));
        }
        out.push((GraphRole::Conv, graphs::conv_fprop(s, false, false).0));
        out.push((
            GraphRole::BnForward,
            graphs::batchnorm_forward(s.y_dims()).0,
        ));
        out.push((GraphRole::EqCoefficients, graphs::eq_coefficients(s.k).0));
    }
    if let Some(residual) = config.apply {
        out.push((
            GraphRole::Apply,
            graphs::apply(s.y_dims(), DataType::Half, residual).0,
        ));
    }
    match (fused, through_bn) {
        (true, true) => {
            out.push((
                GraphRole::DgradDreluDbn,
                graphs::dgrad_drelu_dbn(s, config.backward_residual).0,
            ));
            out.push((GraphRole::Wgrad, graphs::wgrad(s, true).0));
            out.push((GraphRole::DbnApply, graphs::dbn_apply(s.x_dims()).0));
        }
        (true, false) | (false, false) => {
            out.push((GraphRole::Wgrad, graphs::wgrad(s, false).0));
            out.push((GraphRole::Dgrad, graphs::conv_dgrad(s).0));
        }
        (false, true) => {
            out.push((GraphRole::Wgrad, graphs::wgrad(s, false).0));
            out.push((GraphRole::Dgrad, graphs::conv_dgrad(s).0));
            if config.backward_residual == BackwardResidual::FuseAdd {
                out.push((GraphRole::AddBranch, graphs::add(s.x_dims()).0));
            }
            out.push((GraphRole::ReluBackward, graphs::relu_backward(s.x_dims()).0));
            out.push((
                GraphRole::BnBackward,
                graphs::batchnorm_backward(s.x_dims()).0,
            ));
        }
    }
    out
}

/// One buffer a layer reads or writes; the caller (or amp's memory plan) allocates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferSpec {
    /// Name, e.g. `y`, `eq_scale`, `dw`.
    pub name: &'static str,
    /// Element type.
    pub dtype: DataType,
    /// Element count.
    pub elems: usize,
    /// Whether the backward pass needs it kept from the forward pass.
    pub saved: bool,
}

impl BufferSpec {
    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.elems * self.dtype.size()
    }
}

/// A layer with its plans built for one target.
#[derive(Debug)]
pub struct CbrLayer {
    config: CbrConfig,
    route: Route,
    plans: Vec<(GraphRole, Arc<ExecutionPlan>)>,
}

impl CbrLayer {
    /// Builds every plan of the layer for `target` through `cache`: the fused route when each of
    /// its graphs has an engine, else the unfused route (see [`CbrLayer::route`]).
    pub fn plan(config: CbrConfig, target: &Target, cache: &PlanCache) -> Result<Self> {
        match build_route(&config, target, cache, true) {
            Ok(plans) => Ok(CbrLayer {
                config,
                route: Route::Fused,
                plans,
            }),
            Err(e @ (Error::NoEngine { .. } | Error::NoPlan { .. })) => {
                // cuDNN 9.28 on sm_90 has no BN engine at all (fused or not) for channel
                // counts that are not a multiple of 8: say so with both reasons.
                let plans =
                    build_route(&config, target, cache, false).map_err(|u| Error::NoRoute {
                        layer: config.shape.label(),
                        fused: e.to_string(),
                        unfused: u.to_string(),
                    })?;
                Ok(CbrLayer {
                    config,
                    route: Route::Unfused {
                        reason: e.to_string(),
                    },
                    plans,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &CbrConfig {
        &self.config
    }

    /// The route it runs, and why when it is not the fused one.
    pub fn route(&self) -> &Route {
        &self.route
    }

    /// Plans in execution order.
    pub fn plans(&self) -> &[(GraphRole, Arc<ExecutionPlan>)] {
        &self.plans
    }

    /// The plan of one role, if the route has it.
    pub fn plan_for(&self, role: GraphRole) -> Option<&Arc<ExecutionPlan>> {
        self.plans.iter().find(|(r, _)| *r == role).map(|(_, p)| p)
    }

    /// The largest workspace any of its plans needs (one buffer serves them all in turn).
    pub fn workspace_size(&self) -> usize {
        self.plans
            .iter()
            .map(|(_, p)| p.workspace_size())
            .max()
            .unwrap_or(0)
    }

    /// The buffers the layer reads and writes on its route.
    pub fn buffers(&self) -> Vec<BufferSpec> {
        layer_buffers(&self.config, matches!(self.route, Route::Fused))
    }
}

fn build_route(
    config: &CbrConfig,
    target: &Target,
    cache: &PlanCache,
    fused: bool,
) -> Result<Vec<(GraphRole, Arc<ExecutionPlan>)>> {
    route_graphs(config, fused)
        .into_iter()
        .map(|(role, graph)| Ok((role, cache.get_or_build(&graph, target)?)))
        .collect()
}

/// The buffers of a layer on one route.
pub fn layer_buffers(config: &CbrConfig, fused: bool) -> Vec<BufferSpec> {
    let s = &config.shape;
    let x = (s.n * s.c * s.h * s.w) as usize;
    let y = (s.n * s.k * s.p() * s.q()) as usize;
    let w = (s.k * s.c * s.r * s.s) as usize;
    let k = s.k as usize;
    let c = s.c as usize;
    let through_bn = config.input == InputKind::ThroughBn;
    let spec = |name, dtype, elems, saved| BufferSpec {
        name,
        dtype,
        elems,
        saved,
    };
    let mut v = vec![
        spec("x", DataType::Half, x, true),
        spec("w", DataType::Half, w, true),
        spec("y", DataType::Half, y, true),
        spec("gamma", DataType::Float, k, true),
        spec("beta", DataType::Float, k, true),
        spec("running_mean", DataType::Float, k, false),
        spec("running_var", DataType::Float, k, false),
        spec("saved_mean", DataType::Float, k, true),
        spec("saved_inv_std", DataType::Float, k, true),
        spec("eq_scale", DataType::Half, k, true),
        spec("eq_bias", DataType::Half, k, true),
        spec("dy", DataType::Half, y, false),
        spec("dw", DataType::Half, w, false),
    ];
    if fused {
        v.push(spec("sum", DataType::Float, k, false));
        v.push(spec("sq_sum", DataType::Float, k, false));
    } else {
        v.push(spec("y_bn", DataType::Half, y, false));
    }
    if config.apply.is_some() {
        v.push(spec("a", DataType::Half, y, true));
    }
    if through_bn {
        v.push(spec("dz_prev", DataType::Half, x, false));
        v.push(spec("dgamma_prev", DataType::Float, c, false));
        v.push(spec("dbeta_prev", DataType::Float, c, false));
        v.push(spec("dy_prev", DataType::Half, x, false));
        if fused {
            v.push(spec("dbn_coefficients", DataType::Float, 3 * c, false));
        } else {
            v.push(spec("a_prev", DataType::Half, x, true));
        }
    } else {
        v.push(spec("dx", DataType::Half, x, false));
    }
    v
}
