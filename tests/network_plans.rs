//! Tier 2: real networks compiled with every graph planned deviceless. ResNet-50 at batch 256
//! on the H200 fixture: every layer of every block (stem, first, inner, last with its residual
//! apply and backward, projection) gets a route whose graphs all have engines; the report is
//! one row per distinct layer with its route, graphs, engines and workspace.

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::{compile, LayerRole, Preset, RoutePolicy, Step};
use std::collections::HashSet;
use std::time::Instant;

#[test]
fn resnet50_at_batch_256_plans_on_the_h200() {
    let Some(_) = common::cudnn_or_skip("resnet50_at_batch_256_plans_on_the_h200") else {
        return;
    };
    let target = Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap();
    let cache = PlanCache::new();
    let spec = Preset::ResNet50.spec(3, 1000, 0);
    let start = Instant::now();
    let net = compile(
        &spec,
        256,
        224,
        &RoutePolicy::Planned {
            target: &target,
            cache: &cache,
        },
    )
    .unwrap_or_else(|e| panic!("ResNet-50 does not plan on the H200: {e}"));
    let secs = start.elapsed().as_secs_f64();
    // 1 stem + 16 blocks × 3 convs + 4 projections.
    assert_eq!(net.layers.len(), 53);
    assert_eq!((net.features, net.out_hw), (2048, 7));
    let mut seen = HashSet::new();
    println!(
        "{:<14} {:<5} {:<28} {:<7} {:>5} {:>10}  graphs (role graph engine)",
        "layer", "role", "shape", "route", "plans", "max ws"
    );
    for l in &net.layers {
        let cfg = l.layer.config();
        let key = (
            l.role.name(),
            cfg.shape,
            l.layer.route().name(),
            cfg.apply,
            cfg.input,
        );
        // Every layer has plans for every step of its route.
        assert_eq!(l.layer.plans().count(), l.layer.steps().len(), "{}", l.name);
        if !seen.insert(key) {
            continue;
        }
        let graphs: Vec<String> = l
            .layer
            .plans()
            .map(|(role, p)| format!("{role:?}:{}:{}", p.graph_name(), p.engine_tag()))
            .collect();
        println!(
            "{:<14} {:<5} {:<28} {:<7} {:>5} {:>10}  {}",
            l.name,
            l.role.name(),
            cfg.shape.label(),
            l.layer.route().name(),
            l.layer.plans().count(),
            l.layer.workspace_size(),
            graphs.join(" ")
        );
    }
    let stats = cache.stats();
    println!(
        "ResNet-50 batch 256 on the H200 fixture: {} layers ({} distinct), planned in {secs:.1} s; cache {stats:?}",
        net.layers.len(),
        seen.len()
    );
    // The fused route covers the whole network on sm_90 (measured), with the real dataflow:
    // conv1 and the projection read the stored block input, conv2/conv3 take the prologue.
    for l in &net.layers {
        assert_eq!(
            l.layer.route().kind(),
            RouteKind::Fused,
            "{}: {:?}",
            l.name,
            l.layer.route()
        );
        let through = l.prev.is_some();
        match l.role {
            LayerRole::Stem | LayerRole::First | LayerRole::Down => assert!(!through, "{}", l.name),
            LayerRole::Inner | LayerRole::Last => assert!(through, "{}", l.name),
        }
    }
    // Every layer runs once forward and once backward.
    let count = |steps: &[Step]| {
        steps
            .iter()
            .filter(|s| matches!(s, Step::Layer { .. }))
            .count()
    };
    assert_eq!((count(&net.forward), count(&net.backward)), (53, 53));
    // 16 gradient joins (one per block) and the stem's max-pool.
    let adds = net
        .backward
        .iter()
        .filter(|s| matches!(s, Step::Add { .. }))
        .count();
    assert_eq!(adds, 16);
}
