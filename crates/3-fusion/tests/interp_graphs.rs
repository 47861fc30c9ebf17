//! The graph interpreter (`fusion::interp`) against the CPU executor, step by step: every
//! graph of every route (fused, unfused, generic) of a stem + bottleneck-like layer chain,
//! two training steps, each step's graph run by the interpreter on the inputs the CPU
//! executor's step saw, every output compared with what the CPU executor wrote. A graph with
//! two tensors swapped is caught as a mismatch; bad bindings give typed errors.

use cudnn_cbr_fusion::cache::PlanCache;
use cudnn_cbr_fusion::cbr::graphs::{self, ApplyResidual, BackwardResidual};
use cudnn_cbr_fusion::cbr::{
    route_graphs, CbrConfig, CbrLayer, ConvShape, GraphRole, HostBuffer, HostBuffers, LayerGraph,
    Pass, RouteKind, Src, RUNNING_COPIES,
};
use cudnn_cbr_fusion::exec::Scalar;
use cudnn_cbr_fusion::graph::{Graph, TensorId};
use cudnn_cbr_fusion::interp::{execute_host, HostMemory, InterpError, Options, VariantPack};
use cudnn_cbr_fusion::lower::real_tensor_layout;
use cudnn_cbr_fusion::Target;
use cudnn_cbr_runtime::DataType;
use half::f16;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// splitmix64 mapped to `[-1, 1)`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The layer chain: a stem (3 input channels), a bottleneck-like 1×1 → 3×3/2 → 1×1 with a
/// dual scale-bias residual at its output, then a block reading a stored activation whose BN
/// is a projection shortcut, and a layer joining a shortcut gradient (FuseAdd) with an
/// identity-residual output. N = 2, 8×8 in.
fn chain() -> Vec<CbrConfig> {
    let sq = ConvShape::square;
    vec![
        CbrConfig::first(sq(2, 3, 8, 16, 3, 1, 1)),
        CbrConfig::new(sq(2, 16, 8, 8, 1, 0, 1)),
        CbrConfig::new(sq(2, 8, 8, 8, 3, 1, 2)),
        CbrConfig::new(sq(2, 8, 4, 32, 1, 0, 1)).with_apply(ApplyResidual::DualScaleBias),
        CbrConfig::after_activation(sq(2, 32, 4, 16, 1, 0, 1)).with_shortcut_bn(),
        CbrConfig::new(sq(2, 16, 4, 16, 3, 1, 1))
            .with_backward_residual(BackwardResidual::FuseAdd)
            .with_apply(ApplyResidual::Add),
    ]
}

/// Every buffer of a layer filled: FP16 data in [-1, 1) (filters scaled by 1/√fan-in), FP32
/// statistics and parameters in ranges they can take (positive variances and inverse stds).
fn fill(layer: &CbrLayer, rng: &mut Rng) -> HostBuffers {
    let mut b = HostBuffers::zeros(layer.buffers());
    let s = layer.config().shape;
    let fan_in = (s.c * s.r * s.s) as f32;
    let names: Vec<(&'static str, usize, DataType)> = layer
        .buffers()
        .iter()
        .map(|spec| (spec.name, spec.elems, spec.dtype))
        .collect();
    for (name, n, dtype) in names {
        let (base, spread) = match name {
            "gamma" | "running_var" | "saved_inv_std" | "residual_scale" => (1.0, 0.3),
            "w" => (0.0, 1.0 / fan_in.sqrt()),
            _ => (0.0, 1.0),
        };
        let v: Vec<f32> = (0..n).map(|_| base + spread * rng.next()).collect();
        b.set(
            name,
            match dtype {
                DataType::Half => HostBuffer::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
                _ => HostBuffer::F32(v),
            },
        );
    }
    b
}

fn bytes_of(b: &HostBuffer) -> Vec<u8> {
    match b {
        HostBuffer::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostBuffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn values_of(dtype: DataType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DataType::Half => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// The real tensors a graph's nodes write.
fn outputs(graph: &Graph) -> HashSet<TensorId> {
    let ids: HashSet<TensorId> = graph.nodes().iter().flat_map(|n| n.outputs()).collect();
    ids.into_iter()
        .filter(|t| graph.get(*t).is_some_and(|a| !a.is_virtual))
        .collect()
}

/// Runs one graph in the interpreter with each input binding's buffer from `input`; returns
/// each output binding with its values (and checks that no input's bytes changed).
fn interpret<'a>(
    lg: &LayerGraph,
    bindings: &[(TensorId, Src)],
    input: impl Fn(Src) -> &'a HostBuffer,
) -> Result<Vec<(Src, DataType, Vec<f32>)>, InterpError> {
    let layout = real_tensor_layout(&lg.graph);
    let outs = outputs(&lg.graph);
    let mut mem = HostMemory::new();
    let (mut pointers, mut scalars, mut placed) = (vec![], vec![], vec![]);
    for (t, src) in bindings {
        let r = layout
            .iter()
            .find(|r| r.id == *t)
            .expect("bound tensors are real");
        if let Src::Scalar(s) = src {
            scalars.push((r.uid, *s));
            continue;
        }
        let addr = if outs.contains(t) {
            // NaN bytes: an element the interpreter fails to write shows up.
            mem.alloc_from(&vec![0xff; r.bytes])
        } else {
            let bytes = bytes_of(input(*src));
            assert_eq!(
                bytes.len(),
                r.bytes,
                "{}: `{}` size",
                lg.graph.name(),
                r.name
            );
            mem.alloc_from(&bytes)
        };
        pointers.push((r.uid, addr));
        placed.push((*t, *src, r.dtype, r.bytes, addr));
    }
    let before: Vec<_> = placed
        .iter()
        .map(|p| mem.read_bytes(p.4, p.3).unwrap())
        .collect();
    let pack = VariantPack {
        pointers: &pointers,
        scalars: &scalars,
    };
    execute_host(&lg.graph, &pack, &mut mem, &Options::default())?;
    let mut out = vec![];
    for (p, was) in placed.iter().zip(before) {
        let now = mem.read_bytes(p.4, p.3).unwrap();
        if outs.contains(&p.0) {
            out.push((p.1, p.2, values_of(p.2, &now)));
        } else {
            assert_eq!(now, was, "{}: an input changed", lg.graph.name());
        }
    }
    Ok(out)
}

/// The worst mismatch of `got` (interpreter) against `want` (CPU executor), as a multiple of
/// the tolerance (≤ 1 passes), and how many elements exceed it.
///
/// Tolerances: the two compute the same function with different rounding. The CPU
/// executor's convs accumulate in FP32 (GEMM order) and its BN arithmetic runs in f64; the
/// interpreter sums exactly (f64) and does per-element and per-channel arithmetic in FP32. So
/// an FP16 output may land one FP16 ulp apart where the two FP32 values straddle a rounding
/// boundary; an FP32 output may differ by a few FP32 roundings (1e-5 relative). Where an FP16
/// output feeds a later node of the same graph (conv → GenStats, dz → dBN weights), such a
/// one-ulp difference (2^-11 relative) in a few of the summed elements moves a sum by up to
/// ~1e-3 of one element: hence the absolute term, 1e-3 of the output's largest magnitude
/// (FP32) and 1e-4 (FP16: near-zero values where FP32 cancellation errors exceed an FP16
/// ulp). A wiring error changes values by O(1) of their magnitude.
fn mismatch(dtype: DataType, got: &[f32], want: &[f32]) -> (f64, usize) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let (mut worst, mut bad) = (0f64, 0);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w) = (g as f64, w as f64);
        let tol = match dtype {
            DataType::Half => {
                let m = g.abs().max(w.abs()) as f32;
                let ulp = f16::from_f32(m).to_f32().max(6.1e-5) as f64 * 2f64.powi(-10);
                ulp + 1e-4 * scale
            }
            _ => 1e-5 * w.abs() + 1e-3 * scale,
        };
        let r = if g.is_nan() {
            f64::INFINITY
        } else {
            (g - w).abs() / tol.max(1e-30)
        };
        if r > 1.0 {
            bad += 1;
        }
        worst = worst.max(r);
    }
    (worst, bad)
}

/// One output compared: layer index, role, buffer, elements outside the tolerance, worst
/// mismatch as a multiple of the tolerance.
type Compared = (usize, GraphRole, Src, usize, f64);

/// A test-only change to one graph's bindings (layer index, graph, its bindings).
type Plant = fn(usize, &LayerGraph) -> Vec<(TensorId, Src)>;

/// Runs the chain on `route` for two training steps; every graph of every pass is run in the
/// interpreter on the inputs its CPU step saw (with the bindings `plant` gives) and compared.
/// Returns (graphs run, every output compared).
fn compare_route(route: RouteKind, plant: Plant) -> (usize, Vec<Compared>) {
    let configs = chain();
    let layers: Vec<CbrLayer> = configs
        .iter()
        .map(|c| CbrLayer::for_cpu(*c, route).expect("a valid chain layer"))
        .collect();
    let mut rng = Rng(2024 + route as u64);
    let mut bufs: Vec<HostBuffers> = layers.iter().map(|l| fill(l, &mut rng)).collect();
    for (i, l) in layers.iter().enumerate().skip(1) {
        for spec in l.prev_buffers() {
            assert!(
                bufs[i - 1].get(spec.name).is_some(),
                "layer {i} prev lacks {}",
                spec.name
            );
        }
    }
    let (mut graphs_seen, mut compared) = (0, Vec::new());
    for _step in 0..2 {
        let order: Vec<(Pass, usize)> = (0..layers.len())
            .map(|i| (Pass::Forward, i))
            .chain((0..layers.len()).rev().map(|i| (Pass::Backward, i)))
            .collect();
        for (pass, i) in order {
            let layer = &layers[i];
            let has_prev = layer.prev_buffers().iter().next().is_some();
            let (head, tail) = bufs.split_at_mut(i);
            let this = &mut tail[0];
            let mut prev = if has_prev { head.last_mut() } else { None };
            let (this0, prev0) = (this.clone(), prev.as_deref().cloned());
            layer.run_cpu(pass, this, prev.as_deref_mut()).unwrap();
            let (this1, prev1) = (&*this, prev.as_deref());
            let backward = pass == Pass::Backward;
            let pass_graphs: Vec<LayerGraph> = route_graphs(&configs[i], route)
                .into_iter()
                .filter(|g| g.role.is_backward() == backward)
                .collect();
            let roles: Vec<GraphRole> = layer
                .steps()
                .iter()
                .filter(|s| s.role.is_backward() == backward)
                .map(|s| s.role)
                .collect();
            assert_eq!(
                roles,
                pass_graphs.iter().map(|g| g.role).collect::<Vec<_>>()
            );
            let mut written: HashSet<String> = HashSet::new();
            let key = |s: Src| format!("{s:?}");
            for lg in &pass_graphs {
                let input = |src: Src| -> &HostBuffer {
                    // Written by an earlier step of this pass: the CPU executor's value; else
                    // the value before the pass.
                    let after = written.contains(&key(src));
                    let (table, name) = match (src, after) {
                        (Src::This(n), true) => (this1, n),
                        (Src::This(n), false) => (&this0, n),
                        (Src::Prev(n), true) => (prev1.unwrap(), n),
                        (Src::Prev(n), false) => (prev0.as_ref().unwrap(), n),
                        (Src::Scalar(_), _) => unreachable!("scalars are passed by value"),
                    };
                    table
                        .get(name)
                        .unwrap_or_else(|| panic!("no buffer {src:?}"))
                };
                let outs = interpret(lg, &plant(i, lg), input)
                    .unwrap_or_else(|e| panic!("{route:?} layer {i} {:?}: {e}", lg.role));
                for (src, dtype, got) in outs {
                    let want = match src {
                        Src::This(n) => this1.get(n),
                        Src::Prev(n) => prev1.and_then(|p| p.get(n)),
                        Src::Scalar(_) => None,
                    }
                    .unwrap()
                    .to_f32();
                    let (w, bad) = mismatch(dtype, &got, &want);
                    compared.push((i, lg.role, src, bad, w));
                    assert!(
                        written.insert(key(src)),
                        "{src:?} written twice in one pass"
                    );
                }
                graphs_seen += 1;
            }
        }
    }
    (graphs_seen, compared)
}

/// The bindings as the layer declares them.
fn as_declared(_: usize, lg: &LayerGraph) -> Vec<(TensorId, Src)> {
    lg.bindings.clone()
}

/// Every output of every graph within its tolerance: returns (graphs, outputs, worst
/// mismatch as a fraction of the tolerance).
fn check_route(route: RouteKind) -> (usize, usize, f64) {
    let (graphs, compared) = compare_route(route, as_declared);
    let mut worst = 0f64;
    for (i, role, src, bad, w) in &compared {
        assert!(
            *bad == 0,
            "{route:?} layer {i} {role:?} {src:?}: {bad} elements outside the tolerance \
             (worst {w:.2}x)"
        );
        worst = worst.max(*w);
    }
    (graphs, compared.len(), worst)
}

#[test]
fn every_graph_of_the_fused_route_matches_the_cpu_executor() {
    let (g, o, w) = check_route(RouteKind::Fused);
    println!("fused: {g} graphs, {o} outputs, worst {w:.3} of the tolerance");
    assert!(g >= 40 && o >= 100, "{g} graphs, {o} outputs");
}

#[test]
fn every_graph_of_the_unfused_route_matches_the_cpu_executor() {
    let (g, o, w) = check_route(RouteKind::Unfused);
    println!("unfused: {g} graphs, {o} outputs, worst {w:.3} of the tolerance");
    assert!(g >= 40 && o >= 100, "{g} graphs, {o} outputs");
}

#[test]
fn every_graph_of_the_generic_route_matches_the_cpu_executor() {
    let (g, o, w) = check_route(RouteKind::Generic);
    println!("generic: {g} graphs, {o} outputs, worst {w:.3} of the tolerance");
    assert!(g >= 40 && o >= 100, "{g} graphs, {o} outputs");
}

/// The bindings with the buffers of `a` and `b` exchanged in layer `layer`'s `role` graph.
fn swapped(
    lg: &LayerGraph,
    at: (usize, usize),
    role: GraphRole,
    (a, b): (Src, Src),
) -> Vec<(TensorId, Src)> {
    let mut v = lg.bindings.clone();
    if at.0 == at.1 && lg.role == role {
        for (_, src) in &mut v {
            if *src == a {
                *src = b;
            } else if *src == b {
                *src = a;
            }
        }
    }
    v
}

/// Asserts that the planted graph's outputs mismatch and nothing else does.
fn assert_caught(route: RouteKind, plant: Plant, layer: usize, role: GraphRole) {
    let (_, compared) = compare_route(route, plant);
    let planted: Vec<_> = compared
        .iter()
        .filter(|c| c.0 == layer && c.1 == role)
        .collect();
    assert!(!planted.is_empty(), "the planted graph ran");
    let caught: usize = planted.iter().map(|c| c.3).sum();
    for c in &planted {
        println!(
            "planted {route:?} layer {layer} {role:?} {:?}: {} bad, worst {:.1}x",
            c.2, c.3, c.4
        );
    }
    assert!(caught > 0, "a swap of two tensors went unnoticed");
    for c in compared.iter().filter(|c| !(c.0 == layer && c.1 == role)) {
        assert_eq!(c.3, 0, "an unplanted graph mismatched: {c:?}");
    }
}

#[test]
fn a_finalize_with_gamma_and_beta_swapped_is_caught() {
    fn plant(i: usize, lg: &LayerGraph) -> Vec<(TensorId, Src)> {
        let pair = (Src::This("gamma"), Src::This("beta"));
        swapped(lg, (i, 2), GraphRole::Finalize, pair)
    }
    assert_caught(RouteKind::Fused, plant, 2, GraphRole::Finalize);
}

#[test]
fn a_fused_backward_with_the_previous_gamma_and_beta_swapped_is_caught() {
    fn plant(i: usize, lg: &LayerGraph) -> Vec<(TensorId, Src)> {
        let pair = (Src::Prev("gamma"), Src::Prev("beta"));
        swapped(lg, (i, 1), GraphRole::DgradDreluDbn, pair)
    }
    assert_caught(RouteKind::Fused, plant, 1, GraphRole::DgradDreluDbn);
}

#[test]
fn a_dbn_apply_with_dz_and_y_swapped_is_caught() {
    fn plant(i: usize, lg: &LayerGraph) -> Vec<(TensorId, Src)> {
        let pair = (Src::This("dz_prev"), Src::Prev("y"));
        swapped(lg, (i, 2), GraphRole::DbnApply, pair)
    }
    assert_caught(RouteKind::Generic, plant, 2, GraphRole::DbnApply);
}

/// The add graph over `[2, 8, 4, 4]` with its uids: (graph, uid of X, B, Y).
fn add_graph() -> (Graph, i64, i64, i64) {
    let (g, [x, b, y]) = graphs::add([2, 8, 4, 4]);
    let layout = real_tensor_layout(&g);
    let uid = |t: TensorId| layout.iter().find(|r| r.id == t).unwrap().uid;
    let (ux, ub, uy) = (uid(x), uid(b), uid(y));
    (g, ux, ub, uy)
}

const ADD_BYTES: usize = 2 * 8 * 4 * 4 * 2;

fn run_add(mem: &mut HostMemory, g: &Graph, pointers: &[(i64, u64)]) -> Result<(), InterpError> {
    let pack = VariantPack {
        pointers,
        scalars: &[],
    };
    execute_host(g, &pack, mem, &Options::default())
}

#[test]
fn an_extent_past_its_allocation_is_a_typed_error_naming_the_tensor() {
    let (g, ux, ub, uy) = add_graph();
    let mut mem = HostMemory::new();
    let x = mem.alloc(ADD_BYTES - 2);
    let (b, y) = (mem.alloc(ADD_BYTES), mem.alloc(ADD_BYTES));
    let e = run_add(&mut mem, &g, &[(ux, x), (ub, b), (uy, y)]).unwrap_err();
    match &e {
        InterpError::OutOfBounds {
            uid,
            name,
            span,
            len,
            ..
        } => {
            assert_eq!(
                (*uid, name.as_str(), *span, *len),
                (ux, "X", ADD_BYTES as u64, ADD_BYTES as u64 - 2)
            );
        }
        other => panic!("expected OutOfBounds, got {other}"),
    }
    assert!(e.to_string().contains("`X`"), "{e}");
    // Nothing was written: the output still holds its zeros.
    assert!(mem
        .read_bytes(y, ADD_BYTES)
        .unwrap()
        .iter()
        .all(|&v| v == 0));
    // An output that runs past its allocation is refused the same way.
    let y_short = mem.alloc(ADD_BYTES - 16);
    let x = mem.alloc(ADD_BYTES);
    let e = run_add(&mut mem, &g, &[(ux, x), (ub, b), (uy, y_short)]).unwrap_err();
    assert!(
        matches!(e, InterpError::OutOfBounds { uid, .. } if uid == uy),
        "{e}"
    );
}

#[test]
fn a_misaligned_pointer_is_a_typed_error() {
    let (g, ux, ub, uy) = add_graph();
    let mut mem = HostMemory::new();
    let x = mem.alloc(ADD_BYTES + 16);
    let (b, y) = (mem.alloc(ADD_BYTES), mem.alloc(ADD_BYTES));
    let e = run_add(&mut mem, &g, &[(ux, x + 2), (ub, b), (uy, y)]).unwrap_err();
    assert!(
        matches!(&e, InterpError::Misaligned { uid, name, addr, align: 16 } if *uid == ux && name == "X" && *addr == x + 2),
        "{e}"
    );
    // 16 bytes in is aligned and in bounds: it runs.
    run_add(&mut mem, &g, &[(ux, x + 16), (ub, b), (uy, y)]).unwrap();
}

#[test]
fn unbound_unmapped_overlapping_and_mistyped_bindings_are_typed_errors() {
    let (g, ux, ub, uy) = add_graph();
    let mut mem = HostMemory::new();
    let (x, b, y) = (
        mem.alloc(ADD_BYTES),
        mem.alloc(ADD_BYTES),
        mem.alloc(ADD_BYTES),
    );
    let e = run_add(&mut mem, &g, &[(ux, x), (uy, y)]).unwrap_err();
    assert!(
        matches!(&e, InterpError::Unbound { uid, name } if *uid == ub && name == "B"),
        "{e}"
    );
    let e = run_add(&mut mem, &g, &[(ux, x), (ub, b), (uy, 0x10)]).unwrap_err();
    assert!(
        matches!(e, InterpError::Unmapped { uid, .. } if uid == uy),
        "{e}"
    );
    let e = run_add(&mut mem, &g, &[(ux, x), (ub, b), (uy, 0)]).unwrap_err();
    assert!(
        matches!(e, InterpError::Null { uid, .. } if uid == uy),
        "{e}"
    );
    // In place: the output over an input.
    let e = run_add(&mut mem, &g, &[(ux, x), (ub, b), (uy, x)]).unwrap_err();
    assert!(
        matches!(e, InterpError::Overlap { uid, other_uid, .. } if uid == uy && other_uid == ux),
        "{e}"
    );
    // A by-value ε given as FP32 where the graph declares FP64.
    let (g, i, _) = graphs::bn_finalize(8);
    let layout = real_tensor_layout(&g);
    let mut pointers = vec![];
    let mut scalars = vec![];
    for r in &layout {
        if !r.by_value {
            pointers.push((r.uid, mem.alloc(r.bytes)));
        } else if r.id == i.epsilon {
            scalars.push((r.uid, Scalar::F32(1e-5)));
        } else if r.id == i.momentum {
            scalars.push((r.uid, Scalar::F64(0.1)));
        } else {
            scalars.push((r.uid, Scalar::I64(128)));
        }
    }
    let pack = VariantPack {
        pointers: &pointers,
        scalars: &scalars,
    };
    let e = execute_host(&g, &pack, &mut mem, &Options::default()).unwrap_err();
    assert!(
        matches!(&e, InterpError::ScalarType { name, got: DataType::Float, expected: DataType::Double, .. } if name == "epsilon"),
        "{e}"
    );
}

/// The H200 fixture, from the repository root or this crate's folder.
fn h200_path() -> PathBuf {
    const REL: &str = "tests/fixtures/devprops/h200-sm90.json";
    [PathBuf::from(REL), Path::new("../..").join(REL)]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(REL)
        })
}

/// Every cuDNN plan of the chain planned on the H200 fixture (deviceless) keeps the graph it
/// was built for, with the plan's own variant-pack uids: what the interpreter runs in place
/// of the plan under the simulated device, and the very graph the tests above interpret.
#[test]
fn planned_steps_keep_the_graph_the_interpreter_runs() {
    if let Err(e) = cudnn_fe_sys::library() {
        assert!(
            std::env::var_os("CI").is_none(),
            "cuDNN is required when CI is set: {e}"
        );
        println!("SKIP planned_steps_keep_the_graph_the_interpreter_runs: cuDNN not loadable");
        return;
    }
    let target = Target::deviceless_from_file(h200_path()).unwrap();
    let cache = PlanCache::new();
    let mut plans = 0;
    for config in chain().into_iter().take(3) {
        let layer = CbrLayer::plan(config, &target, &cache).unwrap();
        let graphs = route_graphs(&config, layer.route().kind());
        assert_eq!(graphs.len(), layer.steps().len());
        for (step, lg) in layer.steps().iter().zip(&graphs) {
            assert_eq!(step.role, lg.role);
            let Some(plan) = &step.plan else { continue };
            let source = plan.source_graph().expect("a cached plan keeps its graph");
            assert_eq!(source.signature().unwrap(), lg.graph.signature().unwrap());
            assert_eq!(real_tensor_layout(source), plan.real_tensors());
            assert_eq!(real_tensor_layout(&lg.graph), plan.real_tensors());
            plans += 1;
        }
    }
    println!("{plans} plans keep their graph");
    assert!(plans >= 6, "only {plans} plans");
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The interpreter alone runs the whole chain (every graph of both passes, two training
/// steps, its own outputs feeding the next steps, the running statistics copied after each
/// forward pass as the executors do), and ends where the CPU executor ends.
///
/// Tolerance: each step's outputs agree to an FP16 ulp (the step-by-step tests), but here
/// differences compound through six layers and two steps, and a pre-activation within an
/// ulp of zero may flip a ReLU mask. 1e-3 relative L2 per buffer (about two FP16 ulps,
/// 2^-10) bounds that with margin: measured at most 8.1e-5 (generic route). A swapped tensor
/// moves a buffer by O(1).
fn chained(route: RouteKind) -> (usize, f64) {
    let configs = chain();
    let layers: Vec<CbrLayer> = configs
        .iter()
        .map(|c| CbrLayer::for_cpu(*c, route).expect("a valid chain layer"))
        .collect();
    let mut rng = Rng(77 + route as u64);
    let mut cpu: Vec<HostBuffers> = layers.iter().map(|l| fill(l, &mut rng)).collect();
    let mut int = cpu.clone();
    for _step in 0..2 {
        let order: Vec<(Pass, usize)> = (0..layers.len())
            .map(|i| (Pass::Forward, i))
            .chain((0..layers.len()).rev().map(|i| (Pass::Backward, i)))
            .collect();
        for (pass, i) in order {
            let has_prev = layers[i].prev_buffers().iter().next().is_some();
            let (head, tail) = cpu.split_at_mut(i);
            let prev = if has_prev { head.last_mut() } else { None };
            layers[i].run_cpu(pass, &mut tail[0], prev).unwrap();
            let backward = pass == Pass::Backward;
            for lg in route_graphs(&configs[i], route)
                .into_iter()
                .filter(|g| g.role.is_backward() == backward)
            {
                let outs = {
                    let (this, prev) = (&int[i], i.checked_sub(1).map(|p| &int[p]));
                    interpret(&lg, &lg.bindings, |src| match src {
                        Src::This(n) => this.get(n).unwrap(),
                        Src::Prev(n) => prev.unwrap().get(n).unwrap(),
                        Src::Scalar(_) => unreachable!(),
                    })
                    .unwrap()
                };
                for (src, dtype, v) in outs {
                    let (table, name) = match src {
                        Src::This(n) => (&mut int[i], n),
                        Src::Prev(n) => (&mut int[i - 1], n),
                        Src::Scalar(_) => unreachable!(),
                    };
                    table.set(
                        name,
                        match dtype {
                            DataType::Half => {
                                HostBuffer::F16(v.iter().map(|&x| f16::from_f32(x)).collect())
                            }
                            _ => HostBuffer::F32(v),
                        },
                    );
                }
            }
            if pass == Pass::Forward {
                for (next, cur) in RUNNING_COPIES {
                    let v = int[i].get(next).unwrap().clone();
                    int[i].set(cur, v);
                }
            }
        }
    }
    let (mut compared, mut worst) = (0, 0f64);
    for (i, (c, b)) in cpu.iter().zip(&int).enumerate() {
        for (name, want) in c.iter() {
            let got = b.get(name).unwrap().to_f32();
            let want = want.to_f32();
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{route:?} layer {i} {name}"
            );
            let err = rel_l2(&got, &want);
            assert!(
                err <= 1e-3,
                "{route:?} layer {i} {name}: relative L2 {err:.2e}"
            );
            worst = worst.max(err);
            compared += 1;
        }
    }
    (compared, worst)
}

#[test]
fn the_interpreter_alone_runs_two_training_steps_of_every_route_like_the_cpu_executor() {
    for route in RouteKind::ALL {
        let (n, worst) = chained(route);
        println!("{route:?}: {n} buffers, worst relative L2 {worst:.2e}");
        assert!(n >= 100, "{route:?}: only {n} buffers");
    }
}
