//! Random graphs, layer configs, network specs (with per-layer routes and heads of other class
//! counts) and mutated device-properties documents (valid and invalid, extreme values included)
//! thrown at the public API. Shared by `tests/fuzz_graphs.rs` (a few thousand cases in CI) and
//! `examples/fuzz_graphs.rs` (any number of cases).
//!
//! The property, per case: no panic; an invalid input is a typed error; a valid graph or layer
//! either plans deviceless or fails with a typed error that says why (no engine / no plan, or a
//! layer's fallback route with its reason); a valid network compiles.
//!
//! Dims are drawn from small palettes (besides the extreme values) so that valid graphs repeat
//! and the shared plan cache bounds how many cuDNN must compile: the cost of a run is the
//! number of distinct valid graphs, not the number of cases.

#![allow(dead_code)]

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::{CbrConfig, CbrLayer, ConvShape, InputKind};
use cudnn_cbr::fusion::graph::{
    ConvAttrs, Graph, PointwiseAttrs, PointwiseMode, ReductionAttrs, ReductionMode, TensorAttrs,
    TensorId,
};
use cudnn_cbr::fusion::{DeviceProps, Error, Target};
use cudnn_cbr::net::{compile, BlockKind, BlockSpec, NetSpec, PoolSpec, RoutePolicy, StemSpec};
use cudnn_cbr::runtime::DataType;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A small deterministic generator (SplitMix64): the same seed gives the same cases.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Values that break arithmetic: zero, negatives, and sizes that overflow.
const EXTREME: [i64; 7] = [0, -1, -7, 1 << 31, 1 << 40, i64::MAX, i64::MIN];

/// How one case ended.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Rejected before any cuDNN call, with a typed error (its variant name).
    Rejected(String),
    /// Valid, and planned deviceless (a graph), or planned on a route (a layer: the route's
    /// name; a fallback route carries its reason), or compiled (a network).
    Planned(String),
    /// Valid, and cuDNN has no engine or plan for it: a typed error that says why.
    NoEngine(String),
    /// A panic escaped the public API: the property fails.
    Panicked(String),
    /// A valid input failed in a way the property does not allow (e.g. an untyped failure).
    Unexpected(String),
}

/// Totals of a run.
#[derive(Debug, Default, Clone)]
pub struct Totals {
    /// Cases run.
    pub cases: usize,
    /// Count per outcome class and detail.
    pub by_outcome: BTreeMap<Outcome, usize>,
    /// Up to 20 failing cases, described.
    pub failures: Vec<String>,
}

impl Totals {
    /// Cases that break the property.
    pub fn failures(&self) -> usize {
        self.by_outcome
            .iter()
            .filter(|(o, _)| matches!(o, Outcome::Panicked(_) | Outcome::Unexpected(_)))
            .map(|(_, n)| n)
            .sum()
    }

    /// Count of one class (`"rejected"`, `"planned"`, `"no engine"`, `"panicked"`,
    /// `"unexpected"`).
    pub fn class(&self, class: &str) -> usize {
        self.by_outcome
            .iter()
            .filter(|(o, _)| class_of(o) == class)
            .map(|(_, n)| n)
            .sum()
    }

    /// A printable table: one row per outcome.
    pub fn table(&self) -> String {
        let mut out = format!("{:<12} {:>8}  detail\n", "outcome", "cases");
        for (o, n) in &self.by_outcome {
            let detail = match o {
                Outcome::Rejected(d)
                | Outcome::Planned(d)
                | Outcome::NoEngine(d)
                | Outcome::Panicked(d)
                | Outcome::Unexpected(d) => d,
            };
            out += &format!("{:<12} {:>8}  {}\n", class_of(o), n, detail);
        }
        out
    }
}

fn class_of(o: &Outcome) -> &'static str {
    match o {
        Outcome::Rejected(_) => "rejected",
        Outcome::Planned(_) => "planned",
        Outcome::NoEngine(_) => "no engine",
        Outcome::Panicked(_) => "panicked",
        Outcome::Unexpected(_) => "unexpected",
    }
}

/// What a case exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A graph built node by node.
    Graph,
    /// One CBR layer's config, planned with fallback.
    Layer,
    /// A network spec, compiled for the CPU executor (with per-layer routes and a head of
    /// another class count sometimes).
    Network,
    /// A device-properties fixture, mutated, through the strict and the live parser.
    DeviceProps,
}

/// Runs `cases` cases from `seed`; planning (when `target` is given) goes through `cache`.
/// `progress` is called every 1000 cases with the totals so far.
pub fn run(
    seed: u64,
    cases: usize,
    target: Option<&Target>,
    cache: &PlanCache,
    mut progress: impl FnMut(&Totals),
) -> Totals {
    let mut totals = Totals::default();
    let mut rng = Rng::new(seed);
    for i in 0..cases {
        let case_seed = rng.next();
        let kind = kind_of(case_seed);
        let outcome = catch_unwind(AssertUnwindSafe(|| run_case(case_seed, target, cache)))
            .unwrap_or_else(|panic| {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                Outcome::Panicked(msg)
            });
        if matches!(outcome, Outcome::Panicked(_) | Outcome::Unexpected(_))
            && totals.failures.len() < 20
        {
            totals.failures.push(format!(
                "case {i} ({kind:?}, case seed {case_seed:#x}): {outcome:?}"
            ));
        }
        *totals.by_outcome.entry(outcome).or_default() += 1;
        totals.cases += 1;
        if (i + 1) % 1000 == 0 {
            progress(&totals);
        }
    }
    totals
}

fn kind_of(case_seed: u64) -> Kind {
    match Rng::new(case_seed).below(20) {
        0..=10 => Kind::Graph,
        11..=16 => Kind::Layer,
        17..=18 => Kind::Network,
        _ => Kind::DeviceProps,
    }
}

/// One case, from its own seed (printed with every failure), without catching a panic: the
/// example's `--case SEED` reruns a failure this way, with its backtrace.
pub fn run_case(case_seed: u64, target: Option<&Target>, cache: &PlanCache) -> Outcome {
    let mut rng = Rng::new(case_seed);
    rng.below(20); // the kind, drawn by kind_of
    match kind_of(case_seed) {
        Kind::Graph => graph_case(&mut rng, target, cache),
        Kind::Layer => layer_case(&mut rng, target, cache),
        Kind::Network => network_case(&mut rng),
        Kind::DeviceProps => devprops_case(&mut rng),
    }
}

/// The variant name of an error's debug form (`ChannelMismatch { .. }` → `ChannelMismatch`).
fn variant(e: &impl std::fmt::Debug) -> String {
    let text = format!("{e:?}");
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    text[..end].to_string()
}

/// The innermost variant, looking through wrappers such as `Graph(..)` and `InLayer { .. }`.
fn error_name(e: &Error) -> String {
    let text = format!("{e:?}");
    let outer = variant(e);
    match outer.as_str() {
        "Graph" => format!(
            "Graph::{}",
            variant(&text.trim_start_matches("Graph(").to_string())
        ),
        _ => outer,
    }
}

fn dim(rng: &mut Rng, palette: &[i64]) -> i64 {
    if rng.chance(3) {
        rng.pick(&EXTREME)
    } else {
        rng.pick(palette)
    }
}

const N: [i64; 2] = [1, 4];
const C: [i64; 3] = [8, 16, 3];
const HW: [i64; 2] = [4, 8];

fn graph_case(rng: &mut Rng, target: Option<&Target>, cache: &PlanCache) -> Outcome {
    let mut g = Graph::new("fuzz");
    let (n, c, h, k) = (dim(rng, &N), dim(rng, &C), dim(rng, &HW), dim(rng, &C));
    let w_ = if rng.chance(95) { h } else { dim(rng, &HW) };
    let x = g.tensor(TensorAttrs::new("x", [n, c, h, w_]));
    let template = rng.below(7);
    let r = rng.pick(&[1i64, 3]);
    let conv = |rng: &mut Rng| {
        let mut a = ConvAttrs::default().padding(r / 2);
        if rng.chance(5) {
            a.stride = [rng.pick(&EXTREME), 1];
        }
        if rng.chance(3) {
            a.pre_padding = [rng.pick(&EXTREME), 0];
        }
        if rng.chance(3) {
            a.dilation = [rng.pick(&EXTREME), 1];
        }
        if rng.chance(10) {
            a.stride = [2, 2];
        }
        a
    };
    let wc = if rng.chance(95) { c } else { dim(rng, &C) };
    let outputs: Vec<TensorId> = match template {
        // conv, optionally with GenStats, optionally with the scale+bias+ReLU prologue
        0..=2 => {
            let mut input = x;
            if template == 2 {
                let scale = g.tensor(TensorAttrs::vector("scale", wc));
                let bias = g.tensor(TensorAttrs::vector("bias", c));
                let t = g.mul(input, scale);
                let t = g.add(t, bias);
                input = g.relu(t);
            }
            let wt = g.tensor(TensorAttrs::new("w", [k, wc, r, r]));
            let y = g.conv_fprop(input, wt, conv(rng));
            if template >= 1 {
                let (s, q) = g.genstats(y);
                vec![y, s, q]
            } else {
                vec![y]
            }
        }
        3 => {
            // x is the output gradient here: dx = dgrad(x, w) has k channels
            let wt = g.tensor(TensorAttrs::new("w", [wc, k, r, r]));
            vec![g.conv_dgrad(x, wt, conv(rng), [n, k, h, w_])]
        }
        4 => {
            let dy = g.tensor(TensorAttrs::new("dy", [n, k, h, w_]));
            vec![g.conv_wgrad(x, dy, conv(rng), [k, wc, r, r])]
        }
        5 => {
            // a pointwise chain over x and a per-channel vector
            let v = g.tensor(TensorAttrs::vector("v", wc));
            let mut t = x;
            for _ in 0..=rng.below(3) {
                t = match rng.below(5) {
                    0 => g.add(t, v),
                    1 => g.mul(t, v),
                    2 => g.relu(t),
                    3 => g.sub(t, v),
                    _ => g.relu_backward(t, x),
                };
            }
            vec![t]
        }
        _ => {
            let mut attrs = ReductionAttrs::per_channel(ReductionMode::Add, wc);
            if rng.chance(10) {
                attrs.output_dims = vec![1, dim(rng, &C), 1];
            }
            vec![g.reduce(x, attrs)]
        }
    };
    // Faults the builder accepts and validation must name.
    match rng.below(25) {
        0 => {
            if let Some(a) = g.get_mut(x) {
                a.strides = vec![1, 2, 3];
            }
        }
        1 => {
            if let Some(a) = g.get_mut(x) {
                a.dtype = Some(DataType::Boolean);
            }
        }
        2 => {
            if let Some(a) = g.get_mut(x) {
                a.uid = Some(7);
            }
            if let Some(a) = g.get_mut(outputs[0]) {
                a.uid = Some(7);
            }
        }
        3 => {
            if let Some(a) = g.get_mut(x) {
                a.by_value = true;
            }
        }
        4 => {
            // an id from a bigger graph
            let mut other = Graph::new("other");
            let mut last = other.tensor(TensorAttrs::new("o", [1, 1, 1, 1]));
            for _ in 0..40 {
                last = other.relu(last);
            }
            let _ = g.set_output(last, None);
            let _ = g.pointwise(&[last], PointwiseAttrs::new(PointwiseMode::Identity));
        }
        5 => {
            if let Some(a) = g.get_mut(x) {
                a.strides = vec![rng.pick(&EXTREME), 1, 1, 1];
            }
        }
        _ => {}
    }
    for &t in &outputs {
        if rng.chance(97) {
            let _ = g.set_output(t, None);
        }
    }
    if let Err(e) = g.validate() {
        return Outcome::Rejected(format!("Graph::{}", variant(&e)));
    }
    let Some(target) = target else {
        return Outcome::Planned("valid (not planned: no cuDNN)".into());
    };
    match cache.get_or_build(&g, target) {
        Ok(_) => Outcome::Planned(format!("graph template {template}")),
        Err(e @ (Error::NoEngine { .. } | Error::NoPlan { .. })) => {
            Outcome::NoEngine(format!("graph template {template}: {}", error_name(&e)))
        }
        Err(e) => Outcome::Unexpected(format!("valid graph, planning failed: {e}")),
    }
}

fn layer_case(rng: &mut Rng, target: Option<&Target>, cache: &PlanCache) -> Outcome {
    // Valid layers come from a palette of a few shapes, so planning stays bounded.
    let r = rng.pick(&[1i64, 3]);
    let mut shape = ConvShape {
        n: rng.pick(&[2i64, 4]),
        c: rng.pick(&[8i64, 16]),
        h: 8,
        w: 8,
        k: rng.pick(&[8i64, 16]),
        r,
        s: r,
        pad: r / 2,
        stride: 1,
    };
    let mut eps = 1e-5;
    let mut momentum = 0.1;
    match rng.below(12) {
        0 => shape.n = rng.pick(&EXTREME),
        1 => shape.c = rng.pick(&EXTREME),
        2 => shape.h = rng.pick(&EXTREME),
        3 => shape.k = rng.pick(&EXTREME),
        4 => shape.stride = rng.pick(&EXTREME),
        5 => shape.pad = rng.pick(&EXTREME),
        6 => {
            shape.r = rng.pick(&EXTREME);
            shape.s = shape.r;
        }
        7 => eps = rng.pick(&[0.0, -1e-5, f64::NAN, f64::INFINITY]),
        8 => momentum = rng.pick(&[-0.1, 1.5, f64::NAN]),
        _ => {}
    }
    let mut config = if rng.chance(50) {
        CbrConfig::new(shape)
    } else {
        CbrConfig::after_activation(shape)
    };
    config.epsilon = eps;
    config.momentum = momentum;
    if rng.chance(10) {
        config = config.with_shortcut_bn();
    }
    if rng.chance(5) {
        config.input = InputKind::Raw;
        config.backward_residual = cudnn_cbr::fusion::cbr::graphs::BackwardResidual::FuseAdd;
    }
    // The CPU-only constructor must refuse invalid configs without panicking too.
    let _ = route_graph_count(&config);
    if let Err(e) = config.validate() {
        return Outcome::Rejected(format!("layer {}", error_name(&e)));
    }
    let Some(target) = target else {
        return Outcome::Planned("valid layer (not planned: no cuDNN)".into());
    };
    match CbrLayer::plan(config, target, cache) {
        Ok(layer) => Outcome::Planned(format!(
            "layer on the {} route{}",
            layer.route().name(),
            if layer.route().reason().is_some() {
                " (fallback, with its reason)"
            } else {
                ""
            }
        )),
        Err(e @ Error::NoRoute { .. }) => {
            if std::env::var_os("FUZZ_VERBOSE").is_some() {
                eprintln!("{config:?}: {e}");
            }
            Outcome::NoEngine(format!("layer {}", error_name(&e)))
        }
        Err(e) => Outcome::Unexpected(format!("valid layer, planning failed: {e}")),
    }
}

fn route_graph_count(config: &CbrConfig) -> usize {
    if config.validate().is_err() {
        return 0;
    }
    cudnn_cbr::fusion::cbr::route_graphs(config, true).len()
}

fn usize_dim(rng: &mut Rng, palette: &[usize]) -> usize {
    if rng.chance(4) {
        rng.pick(&[0usize, usize::MAX, 1 << 40, 1 << 62])
    } else {
        rng.pick(palette)
    }
}

fn network_case(rng: &mut Rng) -> Outcome {
    let w = usize_dim(rng, &[4, 8]);
    let mut stages = Vec::new();
    let mut ch = w;
    for s in 0..=rng.below(2) {
        let mut blocks = Vec::new();
        for b in 0..=rng.below(2) {
            let kind = if rng.chance(50) {
                BlockKind::Basic
            } else {
                BlockKind::Bottleneck
            };
            let out = if b == 0 && s > 0 {
                ch.saturating_mul(2)
            } else {
                ch
            };
            let stride = if b == 0 && s > 0 {
                usize_dim(rng, &[2])
            } else {
                1
            };
            let mut block = BlockSpec::new(kind, ch, usize_dim(rng, &[4, 8]), out, stride);
            if rng.chance(5) {
                block.projection = !block.projection;
            }
            blocks.push(block);
            ch = out;
        }
        stages.push(blocks);
    }
    let spec = NetSpec {
        name: "fuzz".into(),
        in_channels: usize_dim(rng, &[3, 8]),
        stem: StemSpec {
            out: w,
            kernel: usize_dim(rng, &[3, 7]),
            stride: usize_dim(rng, &[1, 2]),
            pad: usize_dim(rng, &[1, 3]),
            max_pool: rng.chance(50).then(|| PoolSpec {
                kernel: usize_dim(rng, &[3]),
                stride: usize_dim(rng, &[2]),
                pad: usize_dim(rng, &[1]),
            }),
        },
        stages,
        classes: usize_dim(rng, &[4, 10]),
    };
    let batch = usize_dim(rng, &[2, 4]);
    let hw = usize_dim(rng, &[16, 32]);
    let policy = RoutePolicy::Uniform(cudnn_cbr::fusion::cbr::RouteKind::Fused);
    let net = match compile(&spec, batch, hw, &policy) {
        Ok(net) => net,
        Err(e) => return Outcome::Rejected(format!("network {}", error_name(&e))),
    };
    // Every rank of a group hashes its network: no panic on any that compiles.
    let _ = net.fingerprint();
    if rng.chance(30) {
        // A per-layer route for a real layer is taken; one for a layer the network lacks is
        // refused by name.
        let real = rng.chance(50);
        let name = if real {
            net.layers[rng.below(net.layers.len() as u64) as usize]
                .name
                .clone()
        } else {
            rng.pick(&["s9.b0.conv1", "stem.out", "", "fc"]).to_string()
        };
        let policy = RoutePolicy::PerLayer {
            routes: [(name.clone(), cudnn_cbr::fusion::cbr::RouteKind::Unfused)].into(),
            default: cudnn_cbr::fusion::cbr::RouteKind::Fused,
        };
        return match (real, compile(&spec, batch, hw, &policy)) {
            (true, Ok(_)) => Outcome::Planned("network with a per-layer route".into()),
            (false, Err(Error::InvalidConfig { field, problem, .. }))
                if field == "routes" && problem.contains(&name) =>
            {
                Outcome::Rejected("network: route for an unknown layer".into())
            }
            (_, other) => Outcome::Unexpected(format!("per-layer route `{name}`: {other:?}")),
        };
    }
    if rng.chance(30) {
        // A head of another class count than the spec's is refused, naming both.
        let head = rng.pick(&[
            spec.classes.wrapping_sub(1),
            spec.classes.wrapping_add(1),
            0,
            usize::MAX,
        ]);
        return match cudnn_cbr::net::memory_plan(&net, head) {
            Err(cudnn_cbr::amp::PlanError::HeadClasses {
                spec: s, head: h, ..
            }) if s == spec.classes && h == head => {
                Outcome::Rejected("network: head of other classes".into())
            }
            Ok(_) if head == spec.classes => Outcome::Planned("network memory plan".into()),
            other => Outcome::Unexpected(format!("head of {head} classes: {other:?}")),
        };
    }
    Outcome::Planned("network compiled".into())
}

/// The device-properties fixtures the mutations start from.
const DEVPROPS: [&str; 3] = [
    include_str!("../fixtures/devprops/h200-sm90.json"),
    include_str!("../fixtures/devprops/a100-sm80.json"),
    include_str!("../fixtures/devprops/b200-sm100.json"),
];

/// One fixture with one mutation (a key removed, retyped or set to an extreme value, an
/// unknown or repeated key, the text cut short or one character replaced), through the
/// strict parser and the live one: each accepts it or says why with a typed error.
fn devprops_case(rng: &mut Rng) -> Outcome {
    use serde_json::{json, Value};
    let text = rng.pick(&DEVPROPS);
    let mut v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Outcome::Unexpected(format!("fixture: {e}")),
    };
    let Some(obj) = v.as_object_mut() else {
        return Outcome::Unexpected("fixture is not an object".into());
    };
    let keys: Vec<String> = obj.keys().cloned().collect();
    let key = keys[rng.below(keys.len() as u64) as usize].clone();
    let values = [
        json!(0),
        json!(-1),
        json!(1u64 << 31),
        json!(1u64 << 53),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(0.5),
        json!(1e308),
        json!("x"),
        json!(""),
        json!(null),
        json!(true),
        json!([1, 2, 3]),
        json!([0, 0, 0]),
        json!({}),
    ];
    let value = values[rng.below(values.len() as u64) as usize].clone();
    let doc = match rng.below(6) {
        0 => {
            obj.remove(&key);
            v.to_string()
        }
        1 => {
            obj.insert(key, value);
            v.to_string()
        }
        2 => {
            obj.insert("fuzzKey".into(), value);
            v.to_string()
        }
        3 => text.replacen('{', &format!("{{\"{key}\": 1, "), 1),
        4 => {
            let mut cut = rng.below(text.len() as u64 + 1) as usize;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text[..cut].to_string()
        }
        _ => {
            let mut chars: Vec<char> = text.chars().collect();
            let at = rng.below(chars.len() as u64) as usize;
            chars[at] = rng.pick(&['\0', '"', '}', ',', '-', '9', 'é', '\u{ffff}']);
            chars.into_iter().collect()
        }
    };
    let strict = DeviceProps::from_json(&doc);
    let live = DeviceProps::from_live_json(&doc);
    for r in [&strict, &live] {
        if let Err(e) = r {
            if !matches!(e, Error::DeviceProps { .. }) {
                return Outcome::Unexpected(format!("device properties: {e:?}"));
            }
        }
    }
    match strict {
        Ok(_) => Outcome::Planned("device properties accepted".into()),
        Err(_) => Outcome::Rejected("device properties".into()),
    }
}
