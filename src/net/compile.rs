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

use super::spec::{BlockKind, BlockSpec, NetSpec, PoolSpec};
use crate::sys::DataType;
use cudnn_cbr_fusion::cache::PlanCache;
use cudnn_cbr_fusion::cbr::graphs::ApplyResidual;
use cudnn_cbr_fusion::cbr::{CbrConfig, CbrLayer, ConvShape, InputKind, Pass, RouteKind};
use cudnn_cbr_fusion::reference::Nhwc;
use cudnn_cbr_fusion::{Error, Result, Target};
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
    /// the network does not have is an [`Error::InvalidConfig`] on field `routes`.
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

fn invalid(layer: &str, field: &str, problem: String) -> Error {
    Error::InvalidConfig {
        layer: layer.into(),
        field: field.into(),
        problem,
    }
}

/// Checks a description before any arithmetic on it.
pub fn validate(spec: &NetSpec, batch: usize, hw: usize) -> Result<()> {
    let name = spec.name.as_str();
    for (field, v) in [
        ("batch", batch),
        ("hw", hw),
        ("in_channels", spec.in_channels),
        ("classes", spec.classes),
        ("stem.out", spec.stem.out),
        ("stem.kernel", spec.stem.kernel),
        ("stem.stride", spec.stem.stride),
    ] {
        if v == 0 {
            return Err(invalid(name, field, "must be >= 1, got 0".into()));
        }
    }
    // Every extent must fit the conv shape type (i64) with room for its arithmetic; the
    // products of extents are checked where they are formed (`elems`).
    let limit = 1usize << 31;
    for (field, v) in [
        ("batch", batch),
        ("hw", hw),
        ("in_channels", spec.in_channels),
        ("classes", spec.classes),
        ("stem.out", spec.stem.out),
        ("stem.kernel", spec.stem.kernel),
        ("stem.stride", spec.stem.stride),
        ("stem.pad", spec.stem.pad),
    ] {
        if v > limit {
            return Err(invalid(name, field, format!("{v} is beyond {limit}")));
        }
    }
    if let Some(p) = spec.stem.max_pool {
        validate_pool(name, &p)?;
    }
    // The input is the one buffer whose size follows from these extents alone.
    elems(name, "hw", [batch, hw, spec.in_channels])?;
    if spec.stages.iter().all(|s| s.is_empty()) {
        return Err(invalid(name, "stages", "hold no block".into()));
    }
    let mut ch = spec.stem.out;
    for (i, stage) in spec.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            let at = format!("{name} s{i}.b{j}");
            if b.in_ch != ch {
                return Err(invalid(
                    &at,
                    "in_ch",
                    format!("is {} but the previous output has {ch} channels", b.in_ch),
                ));
            }
            for (field, v) in [("width", b.width), ("out", b.out), ("stride", b.stride)] {
                if v == 0 {
                    return Err(invalid(&at, field, "must be >= 1, got 0".into()));
                }
                if v > limit {
                    return Err(invalid(&at, field, format!("{v} is beyond {limit}")));
                }
            }
            if !b.projection && (b.in_ch != b.out || b.stride != 1) {
                return Err(invalid(
                    &at,
                    "projection",
                    format!(
                        "an identity shortcut needs in_ch == out and stride 1, got {} -> {} stride {}",
                        b.in_ch, b.out, b.stride
                    ),
                ));
            }
            ch = b.out;
        }
    }
    Ok(())
}

/// Checks a max-pool window before any size is computed from it: kernel and stride ≥ 1 and at
/// most 2^31, padding at most half the kernel (PyTorch's rule: every window then holds a
/// real pixel, so padding never wins).
pub fn validate_pool(layer: &str, p: &PoolSpec) -> Result<()> {
    let limit = 1usize << 31;
    if p.kernel == 0
        || p.stride == 0
        || p.pad > p.kernel / 2
        || p.kernel > limit
        || p.stride > limit
    {
        return Err(invalid(
            layer,
            "stem.max_pool",
            format!(
                "needs 1 <= kernel <= {limit}, 1 <= stride <= {limit} and pad <= kernel / 2, \
                 got {}x{}/{} pad {}",
                p.kernel, p.kernel, p.stride, p.pad
            ),
        ));
    }
    Ok(())
}

/// Output size of a window op (`None` when the window does not fit or a size wraps).
fn out_size(input: usize, kernel: usize, stride: usize, pad: usize) -> Option<usize> {
    let padded = input.checked_add(pad.checked_mul(2)?)?;
    if stride == 0 || padded < kernel {
        return None;
    }
    Some((padded - kernel) / stride + 1)
}

/// Elements of a `batch`×`hw`×`hw`×`ch` activation, checked: the product must not wrap and its
/// FP32 copy must fit [`ConvShape::MAX_TENSOR_BYTES`].
fn elems(layer: &str, field: &str, [batch, hw, ch]: [usize; 3]) -> Result<usize> {
    let max = ConvShape::MAX_TENSOR_BYTES as usize / 4;
    batch
        .checked_mul(hw)
        .and_then(|e| e.checked_mul(hw))
        .and_then(|e| e.checked_mul(ch))
        .filter(|&e| e <= max)
        .ok_or_else(|| {
            invalid(
                layer,
                field,
                format!(
                    "{batch}x{hw}x{hw}x{ch} elements are beyond {max} (no buffer of more than \
                     {} bytes can be allocated)",
                    ConvShape::MAX_TENSOR_BYTES
                ),
            )
        })
}

/// Compiles `spec` for `batch` images of `hw`×`hw`, with each layer's route from `policy`.
pub fn compile(
    spec: &NetSpec,
    batch: usize,
    hw: usize,
    policy: &RoutePolicy<'_>,
) -> Result<CompiledNet> {
    validate(spec, batch, hw)?;
    let mut c = Compiler {
        policy,
        n: batch as i64,
        buffers: Vec::new(),
        layers: Vec::new(),
        forward: Vec::new(),
        backward: Vec::new(),
    };
    let input_elems = elems("input", "hw", [batch, hw, spec.in_channels])?;
    let input = c.alloc("input", DataType::Half, input_elems, BufferRole::Input);
    // Stem: conv + BN + ReLU, stored.
    let st = &spec.stem;
    let stem_shape = ConvShape::square(
        c.n,
        spec.in_channels as i64,
        hw as i64,
        st.out as i64,
        st.kernel as i64,
        st.pad as i64,
        st.stride as i64,
    );
    stem_shape.validate().map_err(|e| in_layer("stem", e))?;
    let stem_hw = stem_shape.p() as usize;
    let act = |c: &mut Compiler, name: &str, hw: usize, ch: usize| -> Result<(BufId, BufId)> {
        let elems = elems(name, "hw", [batch, hw, ch])?;
        let a = c.alloc(name, DataType::Half, elems, BufferRole::Activation);
        let d = c.alloc(
            &format!("d:{name}"),
            DataType::Half,
            elems,
            BufferRole::Gradient,
        );
        Ok((a, d))
    };
    let (stem_out, d_stem_out) = act(&mut c, "stem.out", stem_hw, st.out)?;
    let stem_cfg = CbrConfig::first(stem_shape).with_apply(ApplyResidual::None);
    let stem = c.add_layer(
        "stem",
        LayerRole::Stem,
        stem_cfg,
        None,
        [("x", input), ("a", stem_out), ("da", d_stem_out)],
    )?;
    c.forward.push(Step::Layer {
        layer: stem,
        pass: Pass::Forward,
    });
    let mut stem_bwd = vec![Step::Layer {
        layer: stem,
        pass: Pass::Backward,
    }];
    let (mut x, mut dx, mut x_hw) = (stem_out, d_stem_out, stem_hw);
    if let Some(pool) = st.max_pool {
        let p_hw = out_size(stem_hw, pool.kernel, pool.stride, pool.pad).ok_or_else(|| {
            invalid(
                "stem",
                "max_pool",
                format!(
                    "a {0}x{0} window does not fit the stem's {stem_hw}x{stem_hw} output padded \
                     by {1}",
                    pool.kernel, pool.pad
                ),
            )
        })?;
        let (pooled, d_pooled) = act(&mut c, "stem.pool", p_hw, st.out)?;
        let shape = Nhwc::new(batch, stem_hw, stem_hw, st.out);
        c.forward.push(Step::MaxPool {
            pool,
            shape,
            input: stem_out,
            output: pooled,
        });
        stem_bwd.insert(
            0,
            Step::MaxPoolBackward {
                pool,
                shape,
                input: stem_out,
                grad_output: d_pooled,
                grad_input: d_stem_out,
            },
        );
        (x, dx, x_hw) = (pooled, d_pooled, p_hw);
    }
    let mut block_bwd: Vec<Vec<Step>> = Vec::new();
    for (i, stage) in spec.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            let prefix = format!("s{i}.b{j}");
            let out_hw = out_size(x_hw, 3, b.stride, 1).ok_or_else(|| {
                invalid(
                    &prefix,
                    "stride",
                    format!("{} does not fit {x_hw}", b.stride),
                )
            })?;
            let (out, d_out) = act(&mut c, &format!("{prefix}.out"), out_hw, b.out)?;
            let mut bwd = Vec::new();
            c.block(&prefix, b, (x_hw, out_hw), (x, dx), (out, d_out), &mut bwd)?;
            block_bwd.push(bwd);
            (x, dx, x_hw) = (out, d_out, out_hw);
        }
    }
    for bwd in block_bwd.into_iter().rev() {
        c.backward.extend(bwd);
    }
    c.backward.extend(stem_bwd);
    // Every buffer fits on its own (checked above); all of them together must too, so that
    // `CompiledNet::bytes` cannot wrap and an executor can size its allocation up front.
    c.buffers
        .iter()
        .try_fold(0usize, |sum, b| {
            b.elems
                .checked_mul(b.dtype.size())
                .and_then(|n| sum.checked_add(n))
        })
        .filter(|&total| total <= ConvShape::MAX_TENSOR_BYTES as usize)
        .ok_or_else(|| {
            invalid(
                &spec.name,
                "batch",
                format!(
                    "{batch} images of {hw}x{hw} need buffers beyond {} bytes in all",
                    ConvShape::MAX_TENSOR_BYTES
                ),
            )
        })?;
    check_route_names(spec, policy, &c.layers)?;
    let features = spec
        .stages
        .iter()
        .flatten()
        .last()
        .map_or(st.out, |b| b.out);
    Ok(CompiledNet {
        spec: spec.clone(),
        batch,
        hw,
        layers: c.layers,
        buffers: c.buffers,
        forward: c.forward,
        backward: c.backward,
        input,
        output: x,
        output_grad: dx,
        features,
        out_hw: x_hw,
    })
}

/// A per-layer route for a layer this network does not have is a caller's typo that would
/// otherwise silently leave the intended layer on the default route.
fn check_route_names(spec: &NetSpec, policy: &RoutePolicy<'_>, layers: &[NetLayer]) -> Result<()> {
    let RoutePolicy::PerLayer { routes, .. } = policy else {
        return Ok(());
    };
    let unknown: Vec<&str> = routes
        .keys()
        .filter(|k| !layers.iter().any(|l| &l.name == *k))
        .map(String::as_str)
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let real: Vec<&str> = layers.iter().map(|l| l.name.as_str()).collect();
    Err(invalid(
        &spec.name,
        "routes",
        format!(
            "names {} not in this network: {} (its layers: {})",
            if unknown.len() == 1 {
                "a layer"
            } else {
                "layers"
            },
            unknown.join(", "),
            real.join(", ")
        ),
    ))
}

fn in_layer(name: &str, e: Error) -> Error {
    match e {
        Error::InvalidConfig { field, problem, .. } => Error::InvalidConfig {
            layer: name.into(),
            field,
            problem,
        },
        other => other,
    }
}

struct Compiler<'p, 'a> {
    policy: &'p RoutePolicy<'a>,
    n: i64,
    buffers: Vec<NetBuffer>,
    layers: Vec<NetLayer>,
    forward: Vec<Step>,
    backward: Vec<Step>,
}

/// A conv of a block before its pairing is decided.
struct Draft {
    name: String,
    role: LayerRole,
    shape: ConvShape,
}

impl Compiler<'_, '_> {
    fn alloc(&mut self, name: &str, dtype: DataType, elems: usize, role: BufferRole) -> BufId {
        self.buffers.push(NetBuffer {
            name: name.into(),
            dtype,
            elems,
            role,
        });
        self.buffers.len() - 1
    }

    /// Adds a planned layer: its buffers are the `shared` ones where named, else its own.
    fn add_layer<const N: usize>(
        &mut self,
        name: &str,
        role: LayerRole,
        config: CbrConfig,
        prev: Option<usize>,
        shared: [(&'static str, BufId); N],
    ) -> Result<usize> {
        let layer = self.policy.layer(name, config)?;
        self.push_layer(name, role, layer, prev, &shared, None)
    }

    fn push_layer(
        &mut self,
        name: &str,
        role: LayerRole,
        layer: CbrLayer,
        prev: Option<usize>,
        shared: &[(&'static str, BufId)],
        stored_input_why: Option<String>,
    ) -> Result<usize> {
        let mut table = BTreeMap::new();
        for spec in layer.buffers() {
            let id = match shared.iter().find(|(n, _)| *n == spec.name) {
                Some(&(_, id)) => {
                    let b = &self.buffers[id];
                    if b.dtype != spec.dtype || b.elems != spec.elems {
                        return Err(invalid(
                            name,
                            spec.name,
                            format!(
                                "binds `{}` ({} x{}) but needs {} x{}",
                                b.name, b.dtype, b.elems, spec.dtype, spec.elems
                            ),
                        ));
                    }
                    id
                }
                None => self.alloc(
                    &format!("{name}.{}", spec.name),
                    spec.dtype,
                    spec.elems,
                    own_role(spec.name, spec.dtype),
                ),
            };
            table.insert(spec.name, id);
        }
        // Names bound through the prologue must exist on the previous layer.
        if let Some(p) = prev {
            for spec in layer.prev_buffers() {
                if !self.layers[p].table.contains_key(spec.name) {
                    return Err(invalid(
                        name,
                        spec.name,
                        format!(
                            "is read from `{}`, which has no such buffer",
                            self.layers[p].name
                        ),
                    ));
                }
            }
        }
        self.layers.push(NetLayer {
            name: name.into(),
            role,
            layer,
            prev,
            table,
            stored_input_why,
        });
        Ok(self.layers.len() - 1)
    }

    /// One residual block from input `(x, dx)` to output `(out, d_out)`; pushes its forward
    /// steps and writes its backward steps into `bwd`.
    fn block(
        &mut self,
        prefix: &str,
        b: &BlockSpec,
        (x_hw, out_hw): (usize, usize),
        (x, dx): (BufId, BufId),
        (out, d_out): (BufId, BufId),
        bwd: &mut Vec<Step>,
    ) -> Result<()> {
        // The block's output size (its stride sits on a 3×3 pad-1 conv; the 1×1 projection at
        // that stride gives the same).
        let (n, hw, out_hw) = (self.n, x_hw as i64, out_hw as i64);
        let (cin, width, cout, stride) = (
            b.in_ch as i64,
            b.width as i64,
            b.out as i64,
            b.stride as i64,
        );
        let draft = |conv: &str, role, shape| Draft {
            name: format!("{prefix}.{conv}"),
            role,
            shape,
        };
        let drafts: Vec<Draft> = match b.kind {
            BlockKind::Basic => vec![
                draft(
                    "conv1",
                    LayerRole::First,
                    ConvShape::square(n, cin, hw, width, 3, 1, stride),
                ),
                draft(
                    "conv2",
                    LayerRole::Last,
                    ConvShape::square(n, width, out_hw, cout, 3, 1, 1),
                ),
            ],
            BlockKind::Bottleneck => vec![
                draft(
                    "conv1",
                    LayerRole::First,
                    ConvShape::square(n, cin, hw, width, 1, 0, 1),
                ),
                draft(
                    "conv2",
                    LayerRole::Inner,
                    ConvShape::square(n, width, hw, width, 3, 1, stride),
                ),
                draft(
                    "conv3",
                    LayerRole::Last,
                    ConvShape::square(n, width, out_hw, cout, 1, 0, 1),
                ),
            ],
        };
        for d in &drafts {
            d.shape.validate().map_err(|e| in_layer(&d.name, e))?;
        }
        // The block output's joined gradient (after its ReLU backward): the last conv's and
        // the projection BN's `dpre`.
        let out_elems = self.buffers[out].elems;
        let dpre = self.alloc(
            &format!("{prefix}.dpre"),
            DataType::Half,
            out_elems,
            BufferRole::Gradient,
        );
        // The projection first: the block output's apply reads its BN.
        let down = if b.projection {
            let shape = ConvShape::square(n, cin, hw, cout, 1, 0, stride);
            let name = format!("{prefix}.down");
            shape.validate().map_err(|e| in_layer(&name, e))?;
            let cfg = CbrConfig::after_activation(shape).with_shortcut_bn();
            let id = self.add_layer(
                &name,
                LayerRole::Down,
                cfg,
                None,
                [("x", x), ("dpre", dpre)],
            )?;
            self.forward.push(Step::Layer {
                layer: id,
                pass: Pass::Forward,
            });
            Some(id)
        } else {
            None
        };
        // The last conv's residual: the identity, the projection's BN (dual scale-bias) or
        // its stored BN output (unfused route).
        let residual: (ApplyResidual, Vec<(&'static str, BufId)>) = match down {
            None => (ApplyResidual::Add, vec![("residual", x)]),
            Some(d) => {
                let t = &self.layers[d].table;
                match t.get("y_bn") {
                    Some(&y_bn) => (ApplyResidual::Add, vec![("residual", y_bn)]),
                    None => (
                        ApplyResidual::DualScaleBias,
                        vec![
                            ("residual", t["y"]),
                            ("residual_scale", t["eq_scale"]),
                            ("residual_bias", t["eq_bias"]),
                        ],
                    ),
                }
            }
        };
        // Decide the chain's pairings: conv k+1 takes conv k's BN as its prologue when it runs
        // fused and conv k's BN has eq coefficients; else conv k stores its activation.
        let count = drafts.len();
        let mut configs: Vec<CbrConfig> = Vec::with_capacity(count);
        let mut planned: Vec<CbrLayer> = Vec::with_capacity(count);
        let mut whys: Vec<Option<String>> = Vec::with_capacity(count);
        for (k, d) in drafts.iter().enumerate() {
            let mut cfg = if k == 0 {
                CbrConfig::after_activation(d.shape)
            } else {
                CbrConfig::new(d.shape)
            };
            if d.role == LayerRole::Last {
                cfg = cfg.with_apply(residual.0);
            }
            let mut layer = self.policy.layer(&d.name, cfg)?;
            let mut why = None;
            if k > 0 {
                let prev_kind = planned[k - 1].route().kind();
                if layer.route().kind() != RouteKind::Fused || prev_kind == RouteKind::Unfused {
                    why = Some(match layer.route().reason() {
                        Some(reason) if layer.route().kind() != RouteKind::Fused => format!(
                            "with the prologue it runs {}: {}",
                            layer.route().name(),
                            reason.lines().next().unwrap_or("")
                        ),
                        _ => format!(
                            "{} runs {} (no eq coefficients for a prologue)",
                            drafts[k - 1].name,
                            prev_kind.name()
                        ),
                    });
                    // Materialize the pair: the producer stores its activation, the consumer
                    // reads it like a block input.
                    let pcfg = configs[k - 1].with_apply(ApplyResidual::None);
                    planned[k - 1] = self.policy.layer(&drafts[k - 1].name, pcfg)?;
                    configs[k - 1] = pcfg;
                    cfg = CbrConfig {
                        input: InputKind::Raw,
                        ..cfg
                    };
                    layer = self.policy.layer(&d.name, cfg)?;
                }
            }
            configs.push(cfg);
            planned.push(layer);
            whys.push(why);
        }
        // Tables: a materialized pair shares the producer's activation (`a`) and its gradient
        // (`da` = the consumer's `dx`); the first conv reads the block input; the last writes
        // the block output.
        let mut ids = Vec::with_capacity(count);
        let mut pending: Vec<(&'static str, BufId)> = vec![("x", x)];
        for (k, ((d, layer), why)) in drafts.iter().zip(planned).zip(whys).enumerate() {
            let mut shared = std::mem::take(&mut pending);
            let materialized = layer.config().apply.is_some() && d.role != LayerRole::Last;
            if d.role == LayerRole::Last {
                shared.extend([("a", out), ("da", d_out), ("dpre", dpre)]);
                shared.extend(residual.1.iter().copied());
            }
            let prev = (k > 0 && layer.config().input == InputKind::ThroughBn).then(|| ids[k - 1]);
            let id = self.push_layer(&d.name, d.role, layer, prev, &shared, why)?;
            if materialized {
                let t = &self.layers[id].table;
                pending = vec![("x", t["a"]), ("dx", t["da"])];
            }
            self.forward.push(Step::Layer {
                layer: id,
                pass: Pass::Forward,
            });
            ids.push(id);
        }
        // Backward: the chain in reverse, then the projection (it needs the joined `dpre`),
        // then the gradient join at the block input.
        for &id in ids.iter().rev() {
            bwd.push(Step::Layer {
                layer: id,
                pass: Pass::Backward,
            });
        }
        let first_dx = self.layers[ids[0]].table["dx"];
        let shortcut_grad = match down {
            Some(d) => {
                bwd.push(Step::Layer {
                    layer: d,
                    pass: Pass::Backward,
                });
                self.layers[d].table["dx"]
            }
            None => dpre,
        };
        bwd.push(Step::Add {
            a: first_dx,
            b: shortcut_grad,
            out: dx,
        });
        Ok(())
    }
}

/// The role of a layer's own buffer, by its name and type.
fn own_role(name: &str, dtype: DataType) -> BufferRole {
    match name {
        "w" | "gamma" | "beta" => BufferRole::Param,
        "dw" | "dgamma" | "dbeta" => BufferRole::ParamGrad,
        "running_mean" | "running_var" | "running_mean_next" | "running_var_next" => {
            BufferRole::Running
        }
        "y" | "a" | "y_bn" | "a_prev" => BufferRole::Activation,
        // Full-tensor gradients (dy, dz_prev, dpre, …) are FP16; the per-channel `d…` vectors
        // (the dBN coefficients) are scratch.
        n if n.starts_with('d') && dtype == DataType::Half => BufferRole::Gradient,
        _ => BufferRole::Scratch,
    }
}
