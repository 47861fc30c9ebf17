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
use cudnn_cbr::fusion::graph::{DataType, Graph};
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::{compile, prewarm, Preset, RoutePolicy};
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
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
        let t = Instant::now();
        let plan = persisted.get_or_build(g, &target).expect("plan");
        let cold = t.elapsed().as_secs_f64() * 1e3;

        let fresh = PlanCache::persistent(&dir).expect("plan folder");
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

/// Whole-network planning: the fused route with its fallbacks, as a training step plans it.
/// Each cold row starts from an empty plan cache and an empty kernel cache folder; the warm
/// row restores plans from the folder the prewarm row filled and our kernels from a copy of
/// its kernel cache (as a new process would). The last row plans cuDNN's runtime-compiled
/// element-wise graphs instead of our kernels: the time to first step before them.
fn network_table(target: &Target) {
    let net: Preset = std::env::var("PLAN_BUILD_NET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(Preset::ResNet50);
    let batch: usize = std::env::var("PLAN_BUILD_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let spec = net.spec(3, 1000, 16);
    let plan_all = |cache: &PlanCache| {
        let policy = RoutePolicy::Planned { target, cache };
        compile(&spec, batch, 224, &policy).map(|n| n.layers.len())
    };
    let tmp = std::env::temp_dir().join(format!("cudnn-cbr-bench-net-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let dir = |name: &str| tmp.join(name);
    // Set before any thread of ours runs; read by the planner on this thread and the prewarm
    // threads it starts later.
    let set = |var: &str, value: &std::path::Path| std::env::set_var(var, value);
    let kernel_cache = cudnn_cbr::fusion::kernel_cache::KERNEL_CACHE_ENV;
    let pointwise = cudnn_cbr::fusion::cbr::kernels::POINTWISE_ENV;
    let mut rows: Vec<(String, f64, u64)> = Vec::new();

    set(pointwise, "own".as_ref());
    set(kernel_cache, &dir("kernels-a"));
    let t = Instant::now();
    let sequential = PlanCache::new();
    let layers = plan_all(&sequential).expect("the network plans");
    rows.push((
        format!("cold, layer by layer ({layers} layers)"),
        t.elapsed().as_secs_f64(),
        sequential.stats().built,
    ));

    set(kernel_cache, &dir("kernels-b"));
    let t = Instant::now();
    let parallel = PlanCache::persistent(dir("plans")).expect("plan folder");
    let warm = prewarm(&spec, batch, 224, &[RouteKind::Fused], target, &parallel, 0)
        .expect("the network compiles");
    plan_all(&parallel).expect("the network plans");
    rows.push((
        format!("cold, prewarm on {} threads first", warm.threads),
        t.elapsed().as_secs_f64(),
        parallel.stats().built,
    ));

    let copy = dir("kernels-c");
    std::fs::create_dir_all(&copy).expect("kernel cache copy");
    for entry in std::fs::read_dir(dir("kernels-b"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::copy(entry.path(), copy.join(entry.file_name()));
    }
    set(kernel_cache, &copy);
    let t = Instant::now();
    let restored = PlanCache::persistent(dir("plans")).expect("plan folder");
    plan_all(&restored).expect("the network plans");
    rows.push((
        "warm: plans and kernels from their folders".into(),
        t.elapsed().as_secs_f64(),
        restored.stats().built,
    ));

    set(pointwise, "cudnn".as_ref());
    let t = Instant::now();
    let before = PlanCache::new();
    let warm = prewarm(&spec, batch, 224, &[RouteKind::Fused], target, &before, 0)
        .expect("the network compiles");
    plan_all(&before).expect("the network plans");
    let reference = t.elapsed().as_secs_f64();
    rows.push((
        format!(
            "cold, prewarm on {} threads, cuDNN element-wise",
            warm.threads
        ),
        reference,
        before.stats().built,
    ));
    set(pointwise, "own".as_ref());
    let _ = std::fs::remove_dir_all(&tmp);

    println!("\nwhole network: {net} at batch {batch}, 224x224, fused route with fallbacks");
    println!("our element-wise kernels unless the row says cuDNN; ratio: the last row / this row");
    println!(
        "{:<48} {:>9} {:>8} {:>8}",
        "how", "seconds", "built", "ratio"
    );
    for (how, secs, built) in rows {
        println!(
            "{how:<48} {secs:>9.2} {built:>8} {:>7.2}x",
            reference / secs
        );
    }
    breakdown(&spec, batch, target);
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
            if arch.is_some() && kernels::OwnKernel::for_graph(&g.graph).is_some() {
                continue;
            }
            let Ok(sig) = g.graph.signature() else {
                continue;
            };
            if !seen.insert(sig.text().to_string()) {
                continue;
            }
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
