//! Plan building on the CPU (deviceless, H200 fixture): cold build per graph (lowering +
//! heuristics + plan finalize), restore from persisted JSON, and the plan-cache hit cost.
//!
//! `cargo bench --bench plan_build` prints the table, then the time to plan every graph one
//! training step of a whole network needs (ResNet-50 at batch 256 by default; set
//! `PLAN_BUILD_NET` and `PLAN_BUILD_BATCH` for others): cold layer by layer, cold with the
//! parallel prewarm, and warm from the persisted cache, with ratios measured in the same run.
//! Under `cargo test` (no `--bench` flag) it runs one quick pass as a smoke test.

use cudnn_cbr::fusion::cache::{PlanCache, PlanKey};
use cudnn_cbr::fusion::cbr::kernels::{self, Pointwise};
use cudnn_cbr::fusion::cbr::{graphs, ConvShape, RouteKind};
use cudnn_cbr::fusion::graph::Graph;
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::{build_plan, forget_compiled_plans};
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::{compile, prewarm, Preset, RoutePolicy};
use cudnn_cbr::runtime::DataType;
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let start = Instant::now();
    let full = std::env::args().any(|a| a == "--bench");
    let child = std::env::var(CHILD_ENV).ok();
    if let Err(e) = cudnn_cbr::sys::library() {
        println!(
            "SKIP plan_build: cuDNN not loadable ({})",
            e.to_string().lines().next().unwrap_or("")
        );
        return;
    }
    // From the working directory (cargo's, or a bundled copy's elsewhere), else where built.
    let rel = std::path::Path::new("tests/fixtures/devprops/h200-sm90.json");
    let fixture = if rel.is_file() {
        rel.to_path_buf()
    } else {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
    };
    let target = match Target::deviceless_from_file(&fixture) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("plan_build: cannot use {}: {e}", fixture.display());
            std::process::exit(1);
        }
    };
    if let Some(how) = child {
        network_row(&how, &target, start);
        return;
    }
    let shape = if full {
        ConvShape::RESNET_3X3
    } else {
        ConvShape::square(8, 32, 16, 32, 3, 1, 1)
    };
    let list: Vec<Graph> = vec![
        graphs::conv_fprop(&shape, false, false).0,
        graphs::conv_dgrad(&shape).0,
        graphs::conv_wgrad(&shape, DataType::Half).0,
        graphs::conv_fprop(&shape, false, true).0,
        graphs::conv_fprop(&shape, true, true).0,
        graphs::bn_finalize(shape.k).0,
        graphs::scale_bias_relu(shape.y_dims(), DataType::Half).0,
    ];
    // Prime: the first heuristics call loads cuDNN's sub-libraries (100-250 ms once).
    let _ = build_plan(&OperationGraph::new(&list[0]).unwrap(), &target);

    let dir = std::env::temp_dir().join(format!("cudnn-cbr-bench-plans-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let persisted = PlanCache::persistent(&dir).expect("plan folder");
    let hit_iters: u32 = if full { 1_000_000 } else { 1_000 };
    println!(
        "plan building on {} ({}), {}",
        target.props().name(),
        target.identity(),
        shape.label()
    );
    println!(
        "{:<32} {:>10} {:>12} {:>10} {:>8} {:>12}",
        "graph", "cold ms", "restore ms", "hit ns", "rtc", "cold/restore"
    );
    for g in &list {
        // Cold and restored as in a new process: without the plans this one compiled before.
        forget_compiled_plans();
        let t = Instant::now();
        let plan = persisted.get_or_build(g, &target).expect("plan");
        let cold = t.elapsed().as_secs_f64() * 1e3;

        let fresh = PlanCache::persistent(&dir).expect("plan folder");
        forget_compiled_plans();
        let t = Instant::now();
        let _ = fresh.get_or_build(g, &target).expect("restored plan");
        let restore = t.elapsed().as_secs_f64() * 1e3;

        let key = PlanKey::new(g.signature().unwrap(), &target);
        let t = Instant::now();
        for _ in 0..hit_iters {
            black_box(persisted.get(black_box(&key)));
        }
        let hit_ns = t.elapsed().as_secs_f64() * 1e9 / f64::from(hit_iters);
        println!(
            "{:<32} {cold:>10.2} {restore:>12.2} {hit_ns:>10.1} {:>8} {:>11.0}x",
            g.name(),
            if plan.is_runtime_compiled() {
                "yes"
            } else {
                "no"
            },
            cold / restore
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    if full {
        network_table(&target);
    }
}

/// The variable that makes this binary a child measuring one row of the network table.
const CHILD_ENV: &str = "PLAN_BUILD_ROW";

fn net_and_batch() -> (Preset, usize) {
    let net: Preset = std::env::var("PLAN_BUILD_NET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(Preset::ResNet50);
    let batch: usize = std::env::var("PLAN_BUILD_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    (net, batch)
}

/// One row, in a child process: plans the whole network (through the plan folder
/// `PLAN_BUILD_PLANS`, layer by layer or after the parallel prewarm) and prints the seconds
/// since the process started (loading cuDNN included, as a user's first step pays it) and the
/// plans built.
fn network_row(how: &str, target: &Target, start: Instant) {
    let (net, batch) = net_and_batch();
    let spec = net.spec(3, 1000, 16);
    let planning = Instant::now();
    let cache = match std::env::var_os("PLAN_BUILD_PLANS") {
        Some(dir) => PlanCache::persistent(dir).expect("plan folder"),
        None => PlanCache::new(),
    };
    let mut threads = 1;
    if how == "prewarm" {
        threads = prewarm(&spec, batch, 224, &[RouteKind::Fused], target, &cache, 0)
            .expect("the network compiles")
            .threads;
    }
    let policy = RoutePolicy::Planned {
        target,
        cache: &cache,
    };
    let layers = compile(&spec, batch, 224, &policy)
        .expect("the network plans")
        .layers
        .len();
    println!(
        "{} {} {layers} {threads} {}",
        start.elapsed().as_secs_f64(),
        cache.stats().built,
        planning.elapsed().as_secs_f64()
    );
}

/// Whole-network planning: the fused route with its fallbacks, as a training step plans it.
/// Each row runs in a process of its own (so no row profits from another's in-process caches,
/// cuDNN's included), from an empty plan folder and an empty kernel cache folder, except the
/// warm row, which finds the prewarm row's. The last row plans cuDNN's runtime-compiled
/// element-wise graphs instead of our kernels: the time to first step before them.
fn network_table(target: &Target) {
    let (net, batch) = net_and_batch();
    let tmp = std::env::temp_dir().join(format!("cudnn-cbr-bench-net-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let exe = std::env::current_exe().expect("this bench's path");
    let row = |how: &str, pointwise: &str, plans: &str, kernels: &str| {
        let out = std::process::Command::new(&exe)
            .env(CHILD_ENV, how)
            .env(cudnn_cbr::fusion::cbr::kernels::POINTWISE_ENV, pointwise)
            .env("PLAN_BUILD_PLANS", tmp.join(plans))
            .env(
                cudnn_cbr::runtime::kernel_cache::KERNEL_CACHE_ENV,
                tmp.join(kernels),
            )
            .output()
            .expect("the bench runs itself");
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Vec<f64> = text
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        match (out.status.success(), v.as_slice()) {
            (true, [secs, built, layers, threads, planning]) => {
                (*secs, *built, *layers, *threads, *planning)
            }
            _ => panic!(
                "row {how} failed: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    };
    let mut rows = Vec::new();
    let (secs, built, layers, _, planning) = row("sequential", "own", "plans-a", "kernels-a");
    rows.push((
        format!("cold, layer by layer ({layers} layers)"),
        secs,
        planning,
        built,
    ));
    let (secs, built, _, threads, planning) = row("prewarm", "own", "plans-b", "kernels-b");
    rows.push((
        format!("cold, prewarm on {threads} threads first"),
        secs,
        planning,
        built,
    ));
    let (secs, built, _, _, planning) = row("sequential", "own", "plans-b", "kernels-b");
    rows.push((
        "warm: plans and kernels from their folders".into(),
        secs,
        planning,
        built,
    ));
    let (reference, built, _, threads, planning) = row("prewarm", "cudnn", "plans-c", "kernels-c");
    rows.push((
        format!("cold, prewarm on {threads} threads, cuDNN element-wise"),
        reference,
        planning,
        built,
    ));
    let _ = std::fs::remove_dir_all(&tmp);

    println!("\nwhole network: {net} at batch {batch}, 224x224, fused route with fallbacks");
    println!(
        "one process per row: seconds from its start (loading cuDNN and the device properties"
    );
    println!("included), and of those the planning; our element-wise kernels unless the row says");
    println!("cuDNN; ratio: the last row's seconds / this row's");
    println!(
        "{:<48} {:>9} {:>9} {:>8} {:>8}",
        "how", "seconds", "planning", "built", "ratio"
    );
    for (how, secs, planning, built) in rows {
        println!(
            "{how:<48} {secs:>9.2} {planning:>9.2} {built:>8} {:>7.2}x",
            reference / secs
        );
    }
    breakdown(&net.spec(3, 1000, 16), batch, target);
}

/// Where the cold time goes: every distinct graph of the routes the layers chose, built once
/// more from an empty cache, summed by graph name (one name covers every shape and variant),
/// and our element-wise kernels' compile (no kernel cache) where they replace graphs.
fn breakdown(spec: &cudnn_cbr::net::NetSpec, batch: usize, target: &Target) {
    let cache = PlanCache::new();
    let policy = RoutePolicy::Planned {
        target,
        cache: &cache,
    };
    let Ok(net) = compile(spec, batch, 224, &policy) else {
        return;
    };
    let mut seen = std::collections::HashSet::new();
    // name → (graphs, seconds, runtime-compiled graphs)
    let mut rows: std::collections::BTreeMap<String, (usize, f64, usize)> = Default::default();
    let fresh = PlanCache::new();
    let arch = kernels::arch_for(target, Pointwise::Own);
    if let Some(arch) = arch {
        let c = kernels::compile_uncached(arch, None).expect("our kernels compile");
        rows.insert(format!("our kernels ({arch} module)"), (1, c.seconds, 1));
    }
    for l in &net.layers {
        for g in cudnn_cbr::fusion::cbr::route_graphs(l.layer.config(), l.layer.route().kind()) {
            if arch.is_some_and(|a| kernels::KernelStep::for_graph(&g, a).is_some()) {
                continue;
            }
            let Ok(sig) = g.graph.signature() else {
                continue;
            };
            if !seen.insert(sig.text().to_string()) {
                continue;
            }
            // Cold: compiling the network above kept its plans in this process.
            forget_compiled_plans();
            let t = Instant::now();
            let rtc = fresh
                .get_or_build(&g.graph, target)
                .map(|p| p.is_runtime_compiled())
                .unwrap_or(false);
            let row = rows.entry(g.graph.name().to_string()).or_default();
            row.0 += 1;
            row.1 += t.elapsed().as_secs_f64();
            row.2 += usize::from(rtc);
        }
    }
    let total: f64 = rows.values().map(|r| r.1).sum();
    println!("\nper graph, cold, one thread (each distinct shape built once)");
    println!(
        "{:<40} {:>7} {:>9} {:>7} {:>7}",
        "graph", "shapes", "seconds", "share", "rtc"
    );
    let mut sorted: Vec<_> = rows.into_iter().collect();
    sorted.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    for (name, (n, secs, rtc)) in sorted {
        println!(
            "{name:<40} {n:>7} {secs:>9.2} {:>6.0}% {rtc:>7}",
            100.0 * secs / total
        );
    }
    println!("{:<40} {:>7} {total:>9.2}", "total", "");
}
