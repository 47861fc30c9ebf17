//! A CBR layer: its configuration, the graphs of each route ([`route_graphs`], each role's
//! graphs built in its family module under `cbr::role`), and the plans built for a target.
//!
//! Layer *i* owns conv *i* and the BN that follows it (statistics, finalize, optional apply).
//! When its input comes through the previous layer's BN ([`InputKind::ThroughBn`]), the fused
//! route applies that BN (and its ReLU) as the conv's prologue, and the backward pass produces
//! the previous BN's gradients (dγ, dβ) and dY of the previous conv.
//!
//! | step | fused route | unfused route | generic route |
//! |---|---|---|---|
//! | forward | [prologue] conv + GenStats → BN finalize → [apply] | [apply prev] → conv → BN forward → eq coefficients → [apply] | [apply prev] → conv + GenStats → BN finalize → [apply] |
//! | backward | dgrad + dReLU + dBN weights → wgrad with prologue → dBN apply | wgrad → dgrad [→ add] → ReLU backward → BN backward | wgrad → dgrad [→ add] → ReLU backward → dγ/dβ reductions → dBN coefficients → dBN apply |
//!
//! A materialized activation's own backward (ReLU backward, then BN backward) uses NormBackward
//! on the fused and unfused routes, and the reductions → coefficients → dBN apply chain on the
//! generic route.
//!
//! Every route reads and writes the same caller buffers (`y_prev`, `w`, `y`, statistics,
//! eq coefficients, running stats, dY, dW, dγ, dβ, dY_prev); the unfused and generic routes
//! need a few more (the materialized previous activation and its gradient). When a fused graph
//! has no engine for the shape or target, [`CbrLayer::plan`] falls back to the unfused route,
//! and when an unfused BN graph has none either (on sm_90: channel counts that are not a
//! multiple of 8), to the generic route, which uses no BN-specific engine at all;
//! [`CbrLayer::route`] says which and why.

use super::graphs::{ApplyResidual, BackwardResidual};
use super::kernels::{self, KernelStep, Pointwise};
use super::keys;
pub use super::role::route_graphs;
use super::ConvShape;
use crate::autotune::PlanOptions;
use crate::cache::PlanCache;
use crate::error::{Error, Result};
use crate::exec::Scalar;
use crate::graph::{DataType, Graph, TensorId};
use crate::plan::ExecutionPlan;
use crate::target::Target;
use std::sync::Arc;
use Src::{Prev, This};

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
    /// For a raw input: whether the backward pass computes the input's gradient (a stored
    /// activation inside a network needs it; the network's own input does not).
    pub input_grad: bool,
    /// This layer's BN output (no ReLU) is the residual of another layer's activation: a
    /// projection shortcut `bn_d(conv_d(x))` joining a block output. Its forward stops after
    /// the BN statistics (the other layer's apply reads `y` with `eq_scale`/`eq_bias`, or the
    /// unfused route's stored `y_bn`), and its backward starts with the BN backward from
    /// `dpre`, the gradient the block output's ReLU backward wrote (bind both layers' `dpre`
    /// to one buffer). Excludes [`CbrConfig::apply`].
    pub shortcut_bn: bool,
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
            input_grad: true,
            shortcut_bn: false,
        }
    }

    /// The network's first conv: a raw input whose gradient nobody needs (no dgrad).
    pub fn first(shape: ConvShape) -> Self {
        CbrConfig {
            input: InputKind::Raw,
            input_grad: false,
            ..Self::new(shape)
        }
    }

    /// A conv reading a stored activation (a block input): raw input, and the backward pass
    /// computes the activation's gradient `dx`.
    pub fn after_activation(shape: ConvShape) -> Self {
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

    /// Make this layer a projection shortcut's conv + BN (see [`CbrConfig::shortcut_bn`]).
    pub fn with_shortcut_bn(mut self) -> Self {
        self.shortcut_bn = true;
        self
    }

    /// Checks what the shape arithmetic and the graphs cannot: the shape itself, ε finite and
    /// positive, momentum in [0, 1], and that the output roles do not conflict.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, problem: String| {
            Err(Error::InvalidConfig {
                layer: self.shape.label(),
                field: field.into(),
                problem,
            })
        };
        self.shape.validate()?;
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return bad(
                "epsilon",
                format!("must be finite and > 0, got {}", self.epsilon),
            );
        }
        if !(0.0..=1.0).contains(&self.momentum) {
            return bad(
                "momentum",
                format!("must lie in [0, 1], got {}", self.momentum),
            );
        }
        if self.shortcut_bn && self.apply.is_some() {
            return bad(
                "shortcut_bn",
                "a shortcut BN's output joins another layer's activation; it cannot also \
                 materialize its own (apply)"
                    .into(),
            );
        }
        if self.input == InputKind::Raw && self.backward_residual != BackwardResidual::None {
            return bad(
                "backward_residual",
                "applies only to an input through the previous BN".into(),
            );
        }
        Ok(())
    }
}

/// Which set of graphs a layer runs, in [`CbrLayer::plan`]'s fallback order.
///
/// `true` and `false` convert to [`RouteKind::Fused`] and [`RouteKind::Unfused`], so callers
/// written before the generic route existed (`route_graphs(config, fused)`) keep working.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteKind {
    /// cuDNN's fused CBR graphs (ConvBNfprop, DgradDreluBNBwdWeight, ConvBNwgrad).
    Fused,
    /// Separate, materialized steps with cuDNN's NormForward / NormBackward.
    Unfused,
    /// Separate steps without any BN-specific engine: conv + GenStats, BN finalize, pointwise
    /// graphs and reductions. For shapes where neither the fused graphs nor Norm* have an engine
    /// (on sm_90 with cuDNN 9.28: channel counts that are not a multiple of 8).
    Generic,
}

impl RouteKind {
    /// Every kind, in the order [`CbrLayer::plan`] tries them.
    pub const ALL: [RouteKind; 3] = [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic];

    /// "fused", "unfused" or "generic".
    pub fn name(self) -> &'static str {
        match self {
            RouteKind::Fused => "fused",
            RouteKind::Unfused => "unfused",
            RouteKind::Generic => "generic",
        }
    }
}

impl From<bool> for RouteKind {
    /// `true` → [`RouteKind::Fused`], `false` → [`RouteKind::Unfused`].
    fn from(fused: bool) -> Self {
        if fused {
            RouteKind::Fused
        } else {
            RouteKind::Unfused
        }
    }
}

/// The route a layer runs, and why when it is not the fused one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// cuDNN's fused CBR graphs.
    Fused,
    /// Separate, materialized steps, because a fused graph has no engine here.
    Unfused {
        /// Which fused graph failed, and cuDNN's account of it.
        reason: String,
    },
    /// The generic steps (conv + GenStats, finalize, pointwise graphs, reductions), because a
    /// fused graph and an unfused BN graph have no engine here.
    Generic {
        /// Which fused and which unfused graph failed (`fused: …; unfused: …`).
        reason: String,
    },
}

impl Route {
    /// "fused", "unfused" or "generic".
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// The kind of route.
    pub fn kind(&self) -> RouteKind {
        match self {
            Route::Fused => RouteKind::Fused,
            Route::Unfused { .. } => RouteKind::Unfused,
            Route::Generic { .. } => RouteKind::Generic,
        }
    }

    /// Why the layer does not run the fused route (None when it does).
    pub fn reason(&self) -> Option<&str> {
        match self {
            Route::Fused => None,
            Route::Unfused { reason } | Route::Generic { reason } => Some(reason),
        }
    }

    fn chosen(kind: RouteKind, reason: &str) -> Self {
        match kind {
            RouteKind::Fused => Route::Fused,
            RouteKind::Unfused => Route::Unfused {
                reason: reason.into(),
            },
            RouteKind::Generic => Route::Generic {
                reason: reason.into(),
            },
        }
    }
}

/// What a graph does within the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GraphRole {
    /// Conv + GenStats, with the previous BN as prologue on the fused route (without it on the
    /// generic route).
    ConvStats,
    /// Per-channel statistics of the stored conv output (after a plain [`GraphRole::Conv`]),
    /// where the fused conv + GenStats graph has only a runtime-compiled engine.
    Stats,
    /// BN finalize.
    Finalize,
    /// The layer's own apply (when materialized).
    Apply,
    /// dgrad + dReLU + dBN weights (of the previous BN).
    DgradDreluDbn,
    /// wgrad (with the prologue when the input comes through a BN, on the fused route).
    Wgrad,
    /// dBN apply: dY of the previous conv.
    DbnApply,
    /// Plain dgrad: the input gradient of a first layer, or the unfused/generic route's dgrad.
    Dgrad,
    /// Unfused/generic: the previous BN's activation, materialized (unfused: ReLU of its stored
    /// BN output; generic: its apply).
    ApplyPrev,
    /// Unfused: plain conv.
    Conv,
    /// Unfused: BN forward (training), with the activation fused in when materialized.
    BnForward,
    /// Unfused/generic: residual gradient join.
    AddBranch,
    /// Unfused/generic: ReLU backward of the previous BN's activation.
    ReluBackward,
    /// Unfused: BN backward of the previous BN.
    BnBackward,
    /// The materialized activation's ReLU backward (dA → dpre).
    ApplyReluBackward,
    /// Unfused: the materialized activation's BN backward (NormBackward: dpre → dY, dγ, dβ).
    ApplyBnBackward,
    /// Generic: the previous BN's dγ = Σ dz·x̂ and dβ = Σ dz, by reduction.
    DbnReduce,
    /// Generic: the previous BN's dBN-apply coefficients A, B, C from dγ and dβ.
    DbnCoefficients,
    /// Fused and generic: the materialized activation's dγ, dβ by reduction (from dpre).
    ApplyDbnReduce,
    /// Fused and generic: the materialized activation's dBN-apply coefficients.
    ApplyDbnCoefficients,
    /// Fused and generic: the materialized activation's dBN apply (dpre → this layer's dY).
    ApplyDbnApply,
}

impl GraphRole {
    /// Whether the role belongs to the backward pass.
    pub fn is_backward(self) -> bool {
        self.def().pass == super::role::RolePass::Backward
    }
}

/// Where a graph tensor's data comes from when the layer runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Src {
    /// A buffer of this layer, by name.
    This(&'static str),
    /// A buffer of the previous layer (its `y`, BN statistics and parameters, and the
    /// gradients this layer's backward writes for it), by name.
    Prev(&'static str),
    /// A host scalar passed by value.
    Scalar(Scalar),
}

/// One graph of a layer with the buffer each of its real tensors binds to.
#[derive(Debug, Clone)]
pub struct LayerGraph {
    /// What the graph does.
    pub role: GraphRole,
    /// The graph.
    pub graph: Graph,
    /// Real tensor → buffer.
    pub bindings: Vec<(TensorId, Src)>,
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
}

impl BufferSpec {
    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.elems * self.dtype.size()
    }
}

/// The buffers a route's graphs bind, by owner: this layer's and the previous layer's.
/// Derived from the graphs themselves, so the list cannot drift from what executes.
pub fn route_buffers(graphs: &[LayerGraph]) -> (Vec<BufferSpec>, Vec<BufferSpec>) {
    let mut this: Vec<BufferSpec> = Vec::new();
    let mut prev: Vec<BufferSpec> = Vec::new();
    for lg in graphs {
        for (t, src) in &lg.bindings {
            let (list, name) = match src {
                This(n) => (&mut this, *n),
                Prev(n) => (&mut prev, *n),
                Src::Scalar(_) => continue,
            };
            let Some(attrs) = lg.graph.get(*t) else {
                continue;
            };
            let elems = attrs.dims.iter().product::<i64>().max(0) as usize;
            let dtype = lg.graph.dtype(*t).unwrap_or(DataType::Half);
            if !list.iter().any(|b| b.name == name) {
                list.push(BufferSpec { name, dtype, elems });
            }
        }
    }
    // The layer's own BN-parameter gradients are written by the next layer's backward (or by
    // the apply's backward); they belong to this layer's table either way.
    if let Some(k) = this
        .iter()
        .find(|b| b.name == keys::GAMMA.name())
        .map(|b| b.elems)
    {
        for name in [keys::DGAMMA.name(), keys::DBETA.name()] {
            if !this.iter().any(|b| b.name == name) {
                this.push(BufferSpec {
                    name,
                    dtype: DataType::Float,
                    elems: k,
                });
            }
        }
    }
    (this, prev)
}

/// One step of a planned layer: a cuDNN plan or one of our kernels, and its bindings.
#[derive(Debug, Clone)]
pub struct LayerStep {
    /// What the step does.
    pub role: GraphRole,
    /// The cuDNN plan (None where our kernel runs the step, and in a layer made for the CPU
    /// executor only).
    pub plan: Option<Arc<ExecutionPlan>>,
    /// Our kernel for the step ([`super::kernels`]), where it replaces a cuDNN plan.
    pub kernel: Option<KernelStep>,
    /// Real tensor → buffer.
    pub bindings: Vec<(TensorId, Src)>,
}

/// A layer with its plans built for one target.
#[derive(Debug)]
pub struct CbrLayer {
    config: CbrConfig,
    route: Route,
    steps: Vec<LayerStep>,
    buffers: Vec<BufferSpec>,
    prev_buffers: Vec<BufferSpec>,
}

impl CbrLayer {
    /// Builds every plan of the layer for `target` through `cache`: the fused route when each of
    /// its graphs has an engine, else the unfused route, else the generic route (see
    /// [`CbrLayer::route`]). Only when all three fail is it an error ([`Error::NoRoute`], with
    /// each route's failure).
    pub fn plan(config: CbrConfig, target: &Target, cache: &PlanCache) -> Result<Self> {
        Self::plan_with(config, target, cache, &PlanOptions::Heuristics)
    }

    /// [`CbrLayer::plan`], with each graph's plan chosen as `options` say: heuristics (what
    /// `plan` does), or autotuned ([`PlanCache::get_or_autotune`]: a tuned plan on record, else
    /// timed now on the target's device). Autotuning on a deviceless target without tuned plans
    /// on record is [`Error::AutotuneNeedsDevice`], not a fallback to another route.
    pub fn plan_with(
        config: CbrConfig,
        target: &Target,
        cache: &PlanCache,
        options: &PlanOptions,
    ) -> Result<Self> {
        config.validate()?;
        let pointwise = Pointwise::from_env()?;
        let fused = match build_route(&config, target, cache, RouteKind::Fused, options, pointwise)
        {
            Ok(built) => return Ok(Self::from_built(config, Route::Fused, built)),
            Err(e @ (Error::NoEngine { .. } | Error::NoPlan { .. })) => e.to_string(),
            Err(e) => return Err(e),
        };
        // cuDNN 9.28 on sm_90 has no engine for NormForward / NormBackward either when the
        // channel count is not a multiple of 8; the generic route needs none of them.
        let unfused = match build_route(
            &config,
            target,
            cache,
            RouteKind::Unfused,
            options,
            pointwise,
        ) {
            Ok(built) => {
                let route = Route::Unfused { reason: fused };
                return Ok(Self::from_built(config, route, built));
            }
            Err(e @ Error::AutotuneNeedsDevice { .. }) => return Err(e),
            Err(e) => e.to_string(),
        };
        match build_route(
            &config,
            target,
            cache,
            RouteKind::Generic,
            options,
            pointwise,
        ) {
            Ok(built) => {
                let route = Route::Generic {
                    reason: format!("fused: {fused}; unfused: {unfused}"),
                };
                Ok(Self::from_built(config, route, built))
            }
            Err(e @ Error::AutotuneNeedsDevice { .. }) => Err(e),
            Err(generic) => Err(Error::NoRoute {
                layer: config.shape.label(),
                fused,
                unfused,
                generic: generic.to_string(),
            }),
        }
    }

    /// Builds one chosen route (no fallback): for parity tests and benchmarks that compare the
    /// routes on one target. `route` is a [`RouteKind`] or a `bool` (`true` = fused).
    pub fn plan_route(
        config: CbrConfig,
        target: &Target,
        cache: &PlanCache,
        route: impl Into<RouteKind>,
    ) -> Result<Self> {
        Self::plan_route_with(config, target, cache, route, Pointwise::from_env()?)
    }

    /// [`CbrLayer::plan_route`] with the element-wise steps run as `pointwise` says: our
    /// kernels or cuDNN's graphs (for parity tests and benchmarks that compare the two).
    pub fn plan_route_with(
        config: CbrConfig,
        target: &Target,
        cache: &PlanCache,
        route: impl Into<RouteKind>,
        pointwise: Pointwise,
    ) -> Result<Self> {
        let kind = route.into();
        config.validate()?;
        let built = build_route(
            &config,
            target,
            cache,
            kind,
            &PlanOptions::Heuristics,
            pointwise,
        )?;
        Ok(Self::from_built(
            config,
            Route::chosen(kind, "requested"),
            built,
        ))
    }

    /// A layer for the CPU reference executor only (no cuDNN needed): the chosen route's steps
    /// without plans. [`CbrLayer::run_gpu`](CbrLayer::run_gpu) refuses it. `route` is a
    /// [`RouteKind`] or a `bool` (`true` = fused).
    ///
    /// # Errors
    /// As [`CbrConfig::validate`] (checked before any size is computed from the shape).
    pub fn for_cpu(config: CbrConfig, route: impl Into<RouteKind>) -> Result<Self> {
        let kind = route.into();
        config.validate()?;
        let graphs = route_graphs(&config, kind);
        let steps = graphs
            .iter()
            .map(|lg| LayerStep {
                role: lg.role,
                plan: None,
                kernel: None,
                bindings: lg.bindings.clone(),
            })
            .collect();
        Ok(Self::from_built(
            config,
            Route::chosen(kind, "chosen for the CPU executor"),
            (graphs, steps),
        ))
    }

    fn from_built(config: CbrConfig, route: Route, (graphs, steps): Built) -> Self {
        let (buffers, prev_buffers) = route_buffers(&graphs);
        CbrLayer {
            config,
            route,
            steps,
            buffers,
            prev_buffers,
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

    /// Steps (plans with bindings) in execution order.
    pub fn steps(&self) -> &[LayerStep] {
        &self.steps
    }

    /// The steps our kernels run instead of a cuDNN plan, in execution order.
    pub fn kernels(&self) -> impl Iterator<Item = (GraphRole, &KernelStep)> {
        self.steps
            .iter()
            .filter_map(|s| s.kernel.as_ref().map(|k| (s.role, k)))
    }

    /// cuDNN plans in execution order (the steps our kernels run have none:
    /// [`CbrLayer::kernels`]).
    pub fn plans(&self) -> impl Iterator<Item = (GraphRole, &Arc<ExecutionPlan>)> {
        self.steps
            .iter()
            .filter_map(|s| s.plan.as_ref().map(|p| (s.role, p)))
    }

    /// The cuDNN plan of one role, if the route has it and cuDNN runs it.
    pub fn plan_for(&self, role: GraphRole) -> Option<&Arc<ExecutionPlan>> {
        self.steps
            .iter()
            .find(|s| s.role == role)
            .and_then(|s| s.plan.as_ref())
    }

    /// Whether the route has a step of this role.
    pub fn has_role(&self, role: GraphRole) -> bool {
        self.steps.iter().any(|s| s.role == role)
    }

    /// The largest workspace any of its plans needs (one buffer serves them all in turn).
    pub fn workspace_size(&self) -> usize {
        self.plans()
            .map(|(_, p)| p.workspace_size())
            .max()
            .unwrap_or(0)
    }

    /// The buffers of this layer its route reads or writes.
    pub fn buffers(&self) -> &[BufferSpec] {
        &self.buffers
    }

    /// The previous layer's buffers its route reads or writes (empty for a first layer).
    pub fn prev_buffers(&self) -> &[BufferSpec] {
        &self.prev_buffers
    }

    /// The target identities ([`Target::identity`]) its plans were built for, each once.
    pub fn plan_targets(&self) -> Vec<&str> {
        let mut ids: Vec<&str> = self.plans().map(|(_, p)| p.target_identity()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// This layer planned again for `target` through `cache` (a layer planned for one device
    /// that is to run on another): the same configuration and route, with our kernels where
    /// this layer runs them, so its buffers and bindings stay as they are.
    ///
    /// # Errors
    /// What planning the route on `target` returns, e.g. [`Error::NoEngine`] where the route
    /// has no engine there (the layer must then be planned for that target from scratch).
    pub fn replan(&self, target: &Target, cache: &PlanCache) -> Result<Self> {
        // A layer built with `Pointwise::Cudnn`, or where our kernels were unavailable, has
        // no kernel step; asking for cuDNN's graphs again gives it the same steps.
        let pointwise = if self.kernels().next().is_some() {
            Pointwise::Own
        } else {
            Pointwise::Cudnn
        };
        let built = build_route(
            &self.config,
            target,
            cache,
            self.route.kind(),
            &PlanOptions::Heuristics,
            pointwise,
        )?;
        Ok(Self::from_built(self.config, self.route.clone(), built))
    }
}

type Built = (Vec<LayerGraph>, Vec<LayerStep>);

fn build_route(
    config: &CbrConfig,
    target: &Target,
    cache: &PlanCache,
    kind: RouteKind,
    options: &PlanOptions,
    pointwise: Pointwise,
) -> Result<Built> {
    let graphs = route_graphs(config, kind);
    let arch = kernels::prepare(target, pointwise)?;
    let steps = graphs
        .iter()
        .map(|lg| {
            let kernel = arch.and_then(|a| KernelStep::for_role(lg, config, kind, a));
            let plan = match kernel {
                Some(_) => None,
                None => Some(cache.get_with(&lg.graph, target, options)?),
            };
            Ok(LayerStep {
                role: lg.role,
                plan,
                kernel,
                bindings: lg.bindings.clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((graphs, steps))
}
