//! The network compiler: from a [`NetSpec`] to layers, buffers and steps.
//!
//! # What it derives
//! - **Layers** in forward order, each a [`CbrLayer`] with its config: input kind (a stored
//!   activation, or the previous conv's output through its BN as a prologue), output role
//!   (the BN feeds the next conv's prologue, materializes an activation with an optional
//!   residual, or is a projection shortcut's BN joining a block output), and route.
//! - **Pairings**: inside a block, conv2 (and a bottleneck's conv3) take the previous BN+ReLU as
//!   their prologue when the consumer runs fused and the producer's BN has eq coefficients
//!   (fused or generic route). Otherwise the pair is *materialized*: the producer stores its
//!   activation, the consumer reads it, and the consumer's input gradient is the producer's
//!   activation gradient. This is the per-pair fallback of the fused route.
//! - **Buffers**: every buffer every layer binds, each once: a layer's own buffers are named
//!   `{layer}.{buffer}`; shared ones (block inputs and outputs, their gradients, the shortcut's
//!   operands, the joined gradient `dpre` of a block output) are one buffer bound by several
//!   layers. [`CompiledNet::buffers`] lists them with dtype, size and role.
//! - **Steps**: the forward and backward order, written once for every executor, with the
//!   gradient joins at block inputs (main branch + shortcut) as explicit [`Step::Add`]s.
//!
//! Route choice is the caller's [`RoutePolicy`]: [`RoutePolicy::Uniform`] (the CPU executor,
//! one route everywhere), [`RoutePolicy::PerLayer`] (tests), or [`RoutePolicy::Planned`]
//! (plan every graph for a target; a layer takes the first route whose graphs all have
//! engines, [`CbrLayer::plan`]).

mod compiler;
mod validate;

pub use compiler::compile;
pub use validate::{validate, validate_pool};

use validate::in_layer;

use super::spec::{NetSpec, PoolSpec};
use crate::runtime::DataType;
use cudnn_cbr_fusion::cache::PlanCache;
use cudnn_cbr_fusion::cbr::{CbrConfig, CbrLayer, ConvShape, Pass, RouteKind};
use cudnn_cbr_fusion::reference::Nhwc;
use cudnn_cbr_fusion::{Result, Target};
use std::collections::BTreeMap;

/// A buffer of a compiled network, by index into [`CompiledNet::buffers`].
pub type BufId = usize;

/// What a network buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferRole {
    /// The network input (images).
    Input,
    /// A stored activation or conv output.
    Activation,
    /// The gradient of an activation or conv output.
    Gradient,
    /// A learned parameter (conv weight, BN γ/β): a slot of the amp plan's W/A regions.
    Param,
    /// A parameter gradient: a slot of the amp plan's G16 (conv weights) or G region.
    ParamGrad,
    /// BN running statistics (current and updated).
    Running,
    /// Per-channel statistics, coefficients and other per-step scratch.
    Scratch,
}

/// One buffer of a compiled network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetBuffer {
    /// `{layer}.{buffer}`, or the activation's name (`stem.out`, `s1.b0.out`, `d:s1.b0.out`…).
    pub name: String,
    /// Element type (`Half` = FP16 storage, `Float` = FP32).
    pub dtype: DataType,
    /// Element count.
    pub elems: usize,
    /// What it holds.
    pub role: BufferRole,
}

/// One conv layer of a compiled network.
#[derive(Debug)]
pub struct NetLayer {
    /// `stem`, `s{i}.b{j}.conv{1,2,3}` or `s{i}.b{j}.down`.
    pub name: String,
    /// Its role in its block.
    pub role: LayerRole,
    /// The layer (its config, route, steps; plans when planned for a target).
    pub layer: CbrLayer,
    /// The layer whose BN is this layer's prologue.
    pub prev: Option<usize>,
    /// Every buffer name the layer binds → the network buffer.
    pub table: BTreeMap<&'static str, BufId>,
    /// Why this conv reads the previous conv's stored activation instead of taking its BN as
    /// a prologue (the pair's fallback); `None` where it takes the prologue or has no conv
    /// before it in its block.
    pub stored_input_why: Option<String>,
}

impl NetLayer {
    /// The column titles of [`NetLayer::report_row`].
    pub fn report_header() -> String {
        format!(
            "{:<14} {:<5} {:<30} {:<7} {:<8} {:>10}  graphs (role:graph:engine)",
            "layer", "role", "shape", "route", "input", "workspace"
        )
    }

    /// One report row: name, role, shape, route, whether the conv reads the previous BN
    /// through its prologue or a stored activation, the largest workspace, and every plan as
    /// `role:graph:engine` (the steps' roles only, for a layer made for the CPU).
    pub fn report_row(&self) -> String {
        let input = if self.prev.is_some() {
            "prologue"
        } else {
            "stored"
        };
        let graphs: Vec<String> = self
            .layer
            .steps()
            .iter()
            .map(|s| match (&s.plan, &s.kernel) {
                (Some(p), _) => format!("{:?}:{}:{}", s.role, p.graph_name(), p.engine_tag()),
                (None, Some(k)) => format!("{:?}:own:{}", s.role, k.kernel().entry()),
                (None, None) => format!("{:?}", s.role),
            })
            .collect();
        format!(
            "{:<14} {:<5} {:<30} {:<7} {:<8} {:>10}  {}",
            self.name,
            self.role.name(),
            self.layer.config().shape.label(),
            self.layer.route().name(),
            input,
            self.layer.workspace_size(),
            graphs.join(" ")
        )
    }
}

/// A conv's role in the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerRole {
    /// The stem conv (raw image input, activation stored).
    Stem,
    /// A block's first conv (reads the stored block input).
    First,
    /// A bottleneck's 3×3 conv (between first and last).
    Inner,
    /// A block's last conv (its BN output, plus the shortcut, through a ReLU, is stored as the
    /// block output).
    Last,
    /// A projection shortcut's conv (reads the stored block input; its BN joins the block
    /// output).
    Down,
}

impl LayerRole {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            LayerRole::Stem => "stem",
            LayerRole::First => "first",
            LayerRole::Inner => "inner",
            LayerRole::Last => "last",
            LayerRole::Down => "down",
        }
    }
}

/// One step of a compiled network's forward or backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A layer's forward or backward graphs.
    Layer {
        /// Index into [`CompiledNet::layers`].
        layer: usize,
        /// Which pass.
        pass: Pass,
    },
    /// Max-pool forward: `output = maxpool(input)`.
    MaxPool {
        /// The window.
        pool: PoolSpec,
        /// The input's shape.
        shape: Nhwc,
        /// Input activation.
        input: BufId,
        /// Output activation.
        output: BufId,
    },
    /// Max-pool backward: the output gradient goes to the first maximum of each window.
    MaxPoolBackward {
        /// The window.
        pool: PoolSpec,
        /// The forward input's shape.
        shape: Nhwc,
        /// The forward input.
        input: BufId,
        /// The output's gradient.
        grad_output: BufId,
        /// The input's gradient (written).
        grad_input: BufId,
    },
    /// `out = a + b` elementwise (FP16: rounded once): a gradient join at a block input.
    Add {
        /// First operand.
        a: BufId,
        /// Second operand.
        b: BufId,
        /// Result.
        out: BufId,
    },
}

/// How the compiler picks each layer's route.
#[derive(Debug)]
pub enum RoutePolicy<'a> {
    /// One route for every layer (CPU executor; no cuDNN needed).
    Uniform(RouteKind),
    /// A route per layer name (`stem`, `s0.b1.conv2`, …); unnamed layers take `default`. A name
    /// the network does not have is an
    /// [`Error::InvalidConfig`](cudnn_cbr_fusion::Error::InvalidConfig) on field `routes`.
    PerLayer {
        /// Layer name → route.
        routes: BTreeMap<String, RouteKind>,
        /// For layers not named.
        default: RouteKind,
    },
    /// Plan every graph for `target` through `cache`; each layer takes the first route whose
    /// graphs all have engines.
    Planned {
        /// The GPU (live or deviceless).
        target: &'a Target,
        /// Where plans are looked up and filed.
        cache: &'a PlanCache,
    },
    /// Plan one route for every layer on `target` (no fallback): for comparing routes.
    PlannedRoute {
        /// The GPU (live or deviceless).
        target: &'a Target,
        /// Where plans are looked up and filed.
        cache: &'a PlanCache,
        /// The route.
        route: RouteKind,
    },
}

impl RoutePolicy<'_> {
    /// The layer `name` with `config`, on the route this policy gives it. Planning errors
    /// pass through unchanged (they name the layer's shape and each route's failure).
    fn layer(&self, name: &str, config: CbrConfig) -> Result<CbrLayer> {
        let cpu = |kind| CbrLayer::for_cpu(config, kind).map_err(|e| in_layer(name, e));
        match self {
            RoutePolicy::Uniform(kind) => cpu(*kind),
            RoutePolicy::PerLayer { routes, default } => {
                cpu(routes.get(name).copied().unwrap_or(*default))
            }
            RoutePolicy::Planned { target, cache } => CbrLayer::plan(config, target, cache),
            RoutePolicy::PlannedRoute {
                target,
                cache,
                route,
            } => CbrLayer::plan_route(config, target, cache, *route),
        }
    }
}

/// A network compiled for one batch size and input size.
#[derive(Debug)]
pub struct CompiledNet {
    /// The description it came from.
    pub spec: NetSpec,
    /// Images per step.
    pub batch: usize,
    /// Input height = width.
    pub hw: usize,
    /// Conv layers in forward order.
    pub layers: Vec<NetLayer>,
    /// Every buffer.
    pub buffers: Vec<NetBuffer>,
    /// The forward pass.
    pub forward: Vec<Step>,
    /// The backward pass (after the head's backward has written [`CompiledNet::output_grad`]).
    pub backward: Vec<Step>,
    /// The input images (FP16 NHWC).
    pub input: BufId,
    /// The last block's output (the head's input).
    pub output: BufId,
    /// Its gradient.
    pub output_grad: BufId,
    /// Channels of the last block's output (the head's features).
    pub features: usize,
    /// Spatial size of the last block's output.
    pub out_hw: usize,
}

impl CompiledNet {
    /// The buffer with this name.
    pub fn buffer_id(&self, name: &str) -> Option<BufId> {
        self.buffers.iter().position(|b| b.name == name)
    }

    /// The layer with this name.
    pub fn layer(&self, name: &str) -> Option<&NetLayer> {
        self.layers.iter().find(|l| l.name == name)
    }

    /// The first layer of each distinct (role, config, route, pairing), in forward order: the
    /// rows of a report (ResNet-50's 53 convs are 28 distinct layers).
    pub fn distinct_layers(&self) -> Vec<&NetLayer> {
        let mut seen = std::collections::HashSet::new();
        self.layers
            .iter()
            .filter(|l| {
                seen.insert(format!(
                    "{} {:?} {} {}",
                    l.role.name(),
                    l.layer.config(),
                    l.layer.route().name(),
                    l.prev.is_some()
                ))
            })
            .collect()
    }

    /// Bytes of every buffer of one role.
    pub fn bytes(&self, role: BufferRole) -> usize {
        self.buffers
            .iter()
            .filter(|b| b.role == role)
            .map(|b| b.elems * b.dtype.size())
            .sum()
    }

    /// What every rank of a data-parallel group must agree on
    /// ([`crate::dist::same`]): the spec, the batch, the image size and each layer's
    /// route, hashed; the summary names the spec, its classes, batch, size and the routes in
    /// forward order (`f*3,u,f*4`: fused, unfused, generic).
    pub fn fingerprint(&self) -> crate::dist::same::Fingerprint {
        let routes: Vec<&str> = self.layers.iter().map(|l| l.layer.route().name()).collect();
        let full = format!(
            "{:?}|batch {}|hw {}|routes {}",
            self.spec,
            self.batch,
            self.hw,
            routes.join(",")
        );
        let mut runs: Vec<(char, usize)> = Vec::new();
        for r in &routes {
            let c = r.chars().next().unwrap_or('?');
            match runs.last_mut() {
                Some((last, n)) if *last == c => *n += 1,
                _ => runs.push((c, 1)),
            }
        }
        let runs: Vec<String> = runs
            .iter()
            .map(|&(c, n)| {
                if n == 1 {
                    c.to_string()
                } else {
                    format!("{c}*{n}")
                }
            })
            .collect();
        let summary = format!(
            "{} classes {} batch {} hw {} routes {}",
            self.spec.name,
            self.spec.classes,
            self.batch,
            self.hw,
            runs.join(",")
        );
        crate::dist::same::Fingerprint::of(&full, summary)
    }

    /// (name, shape) of every conv layer, in forward order.
    pub fn conv_shapes(&self) -> Vec<(String, ConvShape)> {
        self.layers
            .iter()
            .map(|l| (l.name.clone(), l.layer.config().shape))
            .collect()
    }
}
