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
use crate::exec::Scalar;
use crate::graph::{DataType, Graph, TensorId};
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
    /// For a raw input: whether the backward pass computes the input's gradient (a stored
    /// activation inside a network needs it; the network's own input does not).
    pub input_grad: bool,
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
    /// Unfused: ReLU backward of the previous BN's activation.
    ReluBackward,
    /// Unfused: BN backward of the previous BN.
    BnBackward,
    /// The materialized activation's ReLU backward (dA → dpre).
    ApplyReluBackward,
    /// The materialized activation's BN backward (NormBackward: dpre → dY, dγ, dβ).
    ApplyBnBackward,
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
                | GraphRole::ApplyReluBackward
                | GraphRole::ApplyBnBackward
        )
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

fn lg(role: GraphRole, graph: Graph, bindings: Vec<(TensorId, Src)>) -> LayerGraph {
    LayerGraph {
        role,
        graph,
        bindings,
    }
}

use Src::{Prev, This};

/// The graphs of one route of a layer in execution order (forward, then backward), with the
/// buffer of every real tensor. Backward order: the apply's backward (when the activation is
/// materialized) first, since it produces this layer's `dy`.
pub fn route_graphs(config: &CbrConfig, fused: bool) -> Vec<LayerGraph> {
    let s = &config.shape;
    let through_bn = config.input == InputKind::ThroughBn;
    let conv_in = if through_bn { Prev("y") } else { This("x") };
    let mut out = Vec::new();
    if fused {
        let (g, t) = graphs::conv_fprop(s, through_bn, true);
        let mut b = vec![(t.x, conv_in), (t.w, This("w")), (t.y, This("y"))];
        if let Some((sc, bi)) = t.prologue {
            b.extend([(sc, Prev("eq_scale")), (bi, Prev("eq_bias"))]);
        }
        if let Some((sum, sq)) = t.stats {
            b.extend([(sum, This("sum")), (sq, This("sq_sum"))]);
        }
        out.push(lg(GraphRole::ConvStats, g, b));
        let (g, i, o) = graphs::bn_finalize(s.k);
        out.push(lg(
            GraphRole::Finalize,
            g,
            vec![
                (i.sum, This("sum")),
                (i.sq_sum, This("sq_sum")),
                (i.scale, This("gamma")),
                (i.bias, This("beta")),
                // Running statistics are updated in place: prev and updated share a buffer.
                (i.prev_running_mean, This("running_mean")),
                (i.prev_running_var, This("running_var")),
                (i.epsilon, Src::Scalar(Scalar::F64(config.epsilon))),
                (i.momentum, Src::Scalar(Scalar::F64(config.momentum))),
                (i.accum_count, Src::Scalar(Scalar::I64(s.count()))),
                (o.eq_scale, This("eq_scale")),
                (o.eq_bias, This("eq_bias")),
                (o.saved_mean, This("saved_mean")),
                (o.saved_inv_std, This("saved_inv_std")),
                (o.updated_running_mean, This("running_mean")),
                (o.updated_running_var, This("running_var")),
            ],
        ));
    } else {
        if through_bn {
            let residual = match config.backward_residual {
                BackwardResidual::Shortcut => ApplyResidual::Add,
                _ => ApplyResidual::None,
            };
            let (g, t) = graphs::apply(s.x_dims(), DataType::Half, residual);
            let mut b = vec![
                (t.y, Prev("y")),
                (t.scale, Prev("eq_scale")),
                (t.bias, Prev("eq_bias")),
                (t.a, This("a_prev")),
            ];
            b.extend(t.residual.map(|r| (r, This("shortcut"))));
            out.push(lg(GraphRole::ApplyPrev, g, b));
        }
        let conv_x = if through_bn {
            This("a_prev")
        } else {
            This("x")
        };
        let (g, t) = graphs::conv_fprop(s, false, false);
        out.push(lg(
            GraphRole::Conv,
            g,
            vec![(t.x, conv_x), (t.w, This("w")), (t.y, This("y"))],
        ));
        let (g, i, o) = graphs::batchnorm_forward(s.y_dims());
        let mut b = vec![
            (i.x, This("y")),
            (i.scale, This("gamma")),
            (i.bias, This("beta")),
            (i.epsilon, Src::Scalar(Scalar::F32(config.epsilon as f32))),
            (i.momentum, Src::Scalar(Scalar::F32(config.momentum as f32))),
            (o.y, This("y_bn")),
            (o.mean, This("saved_mean")),
            (o.inv_variance, This("saved_inv_std")),
        ];
        b.extend(i.prev_running_mean.map(|t| (t, This("running_mean"))));
        b.extend(i.prev_running_var.map(|t| (t, This("running_var"))));
        b.extend(o.next_running_mean.map(|t| (t, This("running_mean"))));
        b.extend(o.next_running_var.map(|t| (t, This("running_var"))));
        out.push(lg(GraphRole::BnForward, g, b));
        let (g, t) = graphs::eq_coefficients(s.k);
        out.push(lg(
            GraphRole::EqCoefficients,
            g,
            vec![
                (t.gamma, This("gamma")),
                (t.beta, This("beta")),
                (t.mean, This("saved_mean")),
                (t.inv_std, This("saved_inv_std")),
                (t.eq_scale, This("eq_scale")),
                (t.eq_bias, This("eq_bias")),
            ],
        ));
    }
    if let Some(residual) = config.apply {
        let (g, t) = graphs::apply(s.y_dims(), DataType::Half, residual);
        let mut b = vec![
            (t.y, This("y")),
            (t.scale, This("eq_scale")),
            (t.bias, This("eq_bias")),
            (t.a, This("a")),
        ];
        b.extend(t.residual.map(|r| (r, This("residual"))));
        if let Some((s2, b2)) = t.residual_scale_bias {
            b.extend([(s2, This("residual_scale")), (b2, This("residual_bias"))]);
        }
        out.push(lg(GraphRole::Apply, g, b));
        // The apply's backward: dA → dpre (through the ReLU, using the stored activation as
        // the mask) → dY, dγ, dβ through NormBackward (CUDNN_PATTERNS §8, step 5).
        let (g, [dy, x, dx]) = graphs::relu_backward(s.y_dims());
        out.push(lg(
            GraphRole::ApplyReluBackward,
            g,
            vec![(dy, This("da")), (x, This("a")), (dx, This("dpre"))],
        ));
        let (g, i, o) = graphs::batchnorm_backward(s.y_dims());
        out.push(lg(
            GraphRole::ApplyBnBackward,
            g,
            vec![
                (i.dy, This("dpre")),
                (i.x, This("y")),
                (i.scale, This("gamma")),
                (i.mean, This("saved_mean")),
                (i.inv_variance, This("saved_inv_std")),
                (o.dx, This("dy")),
                (o.dscale, This("dgamma")),
                (o.dbias, This("dbeta")),
            ],
        ));
    }
    match (fused, through_bn) {
        (true, true) => {
            let (g, t) = graphs::dgrad_drelu_dbn(s, config.backward_residual);
            let mut b = vec![
                (t.dy, This("dy")),
                (t.w, This("w")),
                (t.y_prev, Prev("y")),
                (t.mean, Prev("saved_mean")),
                (t.inv_std, Prev("saved_inv_std")),
                (t.gamma, Prev("gamma")),
                (t.beta, Prev("beta")),
                (t.dz, This("dz_prev")),
                (t.dbn.dscale, Prev("dgamma")),
                (t.dbn.dbias, Prev("dbeta")),
                (t.dbn.eq_dy_scale, This("dbn_a")),
                (t.dbn.eq_x_scale, This("dbn_b")),
                (t.dbn.eq_bias, This("dbn_c")),
            ];
            let res_name = match config.backward_residual {
                BackwardResidual::Shortcut => "shortcut",
                _ => "dy_branch",
            };
            b.extend(t.residual.map(|r| (r, This(res_name))));
            out.push(lg(GraphRole::DgradDreluDbn, g, b));
            let (g, t) = graphs::wgrad(s, true);
            let (sc, bi) = t.prologue.expect("wgrad built with the prologue");
            out.push(lg(
                GraphRole::Wgrad,
                g,
                vec![
                    (t.x, Prev("y")),
                    (sc, Prev("eq_scale")),
                    (bi, Prev("eq_bias")),
                    (t.dy, This("dy")),
                    (t.dw, This("dw")),
                ],
            ));
            let (g, t) = graphs::dbn_apply(s.x_dims());
            out.push(lg(
                GraphRole::DbnApply,
                g,
                vec![
                    (t.dz, This("dz_prev")),
                    (t.y_prev, Prev("y")),
                    (t.abc[0], This("dbn_a")),
                    (t.abc[1], This("dbn_b")),
                    (t.abc[2], This("dbn_c")),
                    (t.dy_prev, Prev("dy")),
                ],
            ));
        }
        (_, false) => {
            let (g, t) = graphs::wgrad(s, false);
            out.push(lg(
                GraphRole::Wgrad,
                g,
                vec![(t.x, This("x")), (t.dy, This("dy")), (t.dw, This("dw"))],
            ));
            if config.input_grad {
                let (g, [dy, w, dx]) = graphs::conv_dgrad(s);
                out.push(lg(
                    GraphRole::Dgrad,
                    g,
                    vec![(dy, This("dy")), (w, This("w")), (dx, This("dx"))],
                ));
            }
        }
        (false, true) => {
            let (g, t) = graphs::wgrad(s, false);
            out.push(lg(
                GraphRole::Wgrad,
                g,
                vec![
                    (t.x, This("a_prev")),
                    (t.dy, This("dy")),
                    (t.dw, This("dw")),
                ],
            ));
            let (g, [dy, w, dx]) = graphs::conv_dgrad(s);
            out.push(lg(
                GraphRole::Dgrad,
                g,
                vec![(dy, This("dy")), (w, This("w")), (dx, This("da_prev"))],
            ));
            let mut grad = This("da_prev");
            if config.backward_residual == BackwardResidual::FuseAdd {
                let (g, [x, b, y]) = graphs::add(s.x_dims());
                out.push(lg(
                    GraphRole::AddBranch,
                    g,
                    vec![
                        (x, This("da_prev")),
                        (b, This("dy_branch")),
                        (y, This("da_sum")),
                    ],
                ));
                grad = This("da_sum");
            }
            let (g, [dy, x, dx]) = graphs::relu_backward(s.x_dims());
            out.push(lg(
                GraphRole::ReluBackward,
                g,
                vec![(dy, grad), (x, This("a_prev")), (dx, This("dz_prev"))],
            ));
            let (g, i, o) = graphs::batchnorm_backward(s.x_dims());
            out.push(lg(
                GraphRole::BnBackward,
                g,
                vec![
                    (i.dy, This("dz_prev")),
                    (i.x, Prev("y")),
                    (i.scale, Prev("gamma")),
                    (i.mean, Prev("saved_mean")),
                    (i.inv_variance, Prev("saved_inv_std")),
                    (o.dx, Prev("dy")),
                    (o.dscale, Prev("dgamma")),
                    (o.dbias, Prev("dbeta")),
                ],
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
    if let Some(k) = this.iter().find(|b| b.name == "gamma").map(|b| b.elems) {
        for name in ["dgamma", "dbeta"] {
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

/// One step of a planned layer: a plan and its bindings.
#[derive(Debug, Clone)]
pub struct LayerStep {
    /// What the step does.
    pub role: GraphRole,
    /// The plan (None for a layer made for the CPU executor only).
    pub plan: Option<Arc<ExecutionPlan>>,
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
    /// its graphs has an engine, else the unfused route (see [`CbrLayer::route`]).
    pub fn plan(config: CbrConfig, target: &Target, cache: &PlanCache) -> Result<Self> {
        let (route, graphs, steps) = match build_route(&config, target, cache, true) {
            Ok((graphs, steps)) => (Route::Fused, graphs, steps),
            Err(e @ (Error::NoEngine { .. } | Error::NoPlan { .. })) => {
                // cuDNN 9.28 on sm_90 has no BN engine at all (fused or not) for channel
                // counts that are not a multiple of 8: say so with both reasons.
                let (graphs, steps) =
                    build_route(&config, target, cache, false).map_err(|u| Error::NoRoute {
                        layer: config.shape.label(),
                        fused: e.to_string(),
                        unfused: u.to_string(),
                    })?;
                (
                    Route::Unfused {
                        reason: e.to_string(),
                    },
                    graphs,
                    steps,
                )
            }
            Err(e) => return Err(e),
        };
        let (buffers, prev_buffers) = route_buffers(&graphs);
        Ok(CbrLayer {
            config,
            route,
            steps,
            buffers,
            prev_buffers,
        })
    }

    /// Builds one chosen route (no fallback): for parity tests and benchmarks that compare the
    /// routes on one target.
    pub fn plan_route(
        config: CbrConfig,
        target: &Target,
        cache: &PlanCache,
        fused: bool,
    ) -> Result<Self> {
        let (graphs, steps) = build_route(&config, target, cache, fused)?;
        let (buffers, prev_buffers) = route_buffers(&graphs);
        Ok(CbrLayer {
            config,
            route: if fused {
                Route::Fused
            } else {
                Route::Unfused {
                    reason: "requested".into(),
                }
            },
            steps,
            buffers,
            prev_buffers,
        })
    }

    /// A layer for the CPU reference executor only (no cuDNN needed): the chosen route's steps
    /// without plans. [`CbrLayer::run_gpu`](CbrLayer::run_gpu) refuses it.
    pub fn for_cpu(config: CbrConfig, fused: bool) -> Self {
        let graphs = route_graphs(&config, fused);
        let (buffers, prev_buffers) = route_buffers(&graphs);
        let steps = graphs
            .into_iter()
            .map(|lg| LayerStep {
                role: lg.role,
                plan: None,
                bindings: lg.bindings,
            })
            .collect();
        CbrLayer {
            config,
            route: if fused {
                Route::Fused
            } else {
                Route::Unfused {
                    reason: "chosen for the CPU executor".into(),
                }
            },
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

    /// Plans in execution order.
    pub fn plans(&self) -> impl Iterator<Item = (GraphRole, &Arc<ExecutionPlan>)> {
        self.steps
            .iter()
            .filter_map(|s| s.plan.as_ref().map(|p| (s.role, p)))
    }

    /// The plan of one role, if the route has it.
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
}

type Built = (Vec<LayerGraph>, Vec<LayerStep>);

fn build_route(
    config: &CbrConfig,
    target: &Target,
    cache: &PlanCache,
    fused: bool,
) -> Result<Built> {
    let graphs = route_graphs(config, fused);
    let steps = graphs
        .iter()
        .map(|lg| {
            Ok(LayerStep {
                role: lg.role,
                plan: Some(cache.get_or_build(&lg.graph, target)?),
                bindings: lg.bindings.clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((graphs, steps))
}
