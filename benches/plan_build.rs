//! Plan building on the CPU (deviceless, H200 fixture): cold build per graph (lowering +
//! heuristics + plan finalize), restore from persisted JSON, and the plan-cache hit cost.
//!
//! `cargo bench --bench plan_build` prints the table; under `cargo test` (no `--bench` flag)
//! it runs one quick pass as a smoke test.

use cudnn_cbr::fusion::cache::{PlanCache, PlanKey};
use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
use cudnn_cbr::fusion::graph::{DataType, Graph};
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::Target;
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
}
