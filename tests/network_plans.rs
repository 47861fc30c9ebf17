//! Tier 2: real networks compiled with every graph planned deviceless. ResNet-50 at batch 256
//! on the H200, A100 and B200 fixtures, on the fused route (with its fallbacks) and on the
//! unfused route: every layer of every block (stem, first, inner, last with its residual
//! apply and backward, projection) gets a route whose graphs all have engines. On the H200 the
//! report is one row per distinct layer with its route, graphs, engines and workspace.

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::check_bn_sync;
use cudnn_cbr::net::{compile, CompiledNet, LayerRole, NetLayer, Preset, RoutePolicy, Step};
use std::time::Instant;

/// Every fixture, both routes: the whole of ResNet-50 at batch 256 plans on the fused route
/// (with its per-layer and per-pair fallbacks) and on the unfused route. Measured with cuDNN
/// 9.28.1: sm_80 and sm_90 take the prologue on all 32 conv pairs; sm_100 has no engine for
/// the prologue forms, so every pair stores its activation there (0/32) while each conv still
/// runs conv + GenStats. One test per fixture and route, so the harness plans them side by
/// side (planning is single-threaded).
const EXPECTED_PAIRS: [usize; 3] = [32, 32, 0];

#[test]
fn resnet50_plans_on_the_h200_fused() {
    resnet50_plans(0, None);
}
#[test]
fn resnet50_plans_on_the_h200_unfused() {
    resnet50_plans(0, Some(RouteKind::Unfused));
}
#[test]
fn resnet50_plans_on_the_a100_fused() {
    resnet50_plans(1, None);
}
#[test]
fn resnet50_plans_on_the_a100_unfused() {
    resnet50_plans(1, Some(RouteKind::Unfused));
}
#[test]
fn resnet50_plans_on_the_b200_fused() {
    resnet50_plans(2, None);
}
#[test]
fn resnet50_plans_on_the_b200_unfused() {
    resnet50_plans(2, Some(RouteKind::Unfused));
}

/// ResNet-50 at batch 256 compiled for fixture `fixture` on `route` (None: fused with
/// fallbacks), every layer planned.
fn resnet50_plans(fixture: usize, route: Option<RouteKind>) {
    let Some(_) = common::cudnn_or_skip("resnet50_plans_on_every_fixture_and_route") else {
        return;
    };
    let fixtures = common::devprops_fixtures();
    assert_eq!(
        fixtures.len(),
        EXPECTED_PAIRS.len(),
        "a new fixture needs its tests here"
    );
    let (label, path) = &fixtures[fixture];
    let expected_pairs = EXPECTED_PAIRS[fixture];
    let spec = Preset::ResNet50.spec(3, 1000, 0);
    let target = Target::deviceless_from_file(path).unwrap();
    let cache = PlanCache::new();
    let start = Instant::now();
    let policy = match route {
        None => RoutePolicy::Planned {
            target: &target,
            cache: &cache,
        },
        Some(route) => RoutePolicy::PlannedRoute {
            target: &target,
            cache: &cache,
            route,
        },
    };
    let net =
        compile(&spec, 256, 224, &policy).unwrap_or_else(|e| panic!("{label} {route:?}: {e}"));
    let pairs = net.layers.iter().filter(|l| l.prev.is_some()).count();
    let fused = net
        .layers
        .iter()
        .filter(|l| l.layer.route().kind() == RouteKind::Fused)
        .count();
    println!(
        "{label} {}: {} layers, {fused} fused, {pairs}/32 prologue pairs, {:.1} s",
        route.map_or("fused with fallbacks", |r| r.name()),
        net.layers.len(),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(net.layers.len(), 53);
    for l in &net.layers {
        assert_eq!(
            l.layer.plans().count() + l.layer.kernels().count(),
            l.layer.steps().len(),
            "{}",
            l.name
        );
    }
    // Synchronized BN on GPUs needs every layer on a route that sums between steps:
    // the fused route and its fallbacks give one here; the unfused route does not.
    let sync = check_bn_sync(&net);
    assert_eq!(sync.is_ok(), route.is_none(), "{label} {route:?}: {sync:?}");
    match route {
        None if label.starts_with("H200") => {
            assert_eq!(pairs, expected_pairs, "{label}");
            h200_report_and_dataflow(&net);
        }
        None => assert_eq!(pairs, expected_pairs, "{label}"),
        Some(_) => assert_eq!((pairs, fused), (0, 0), "{label}: unfused means no pair"),
    }
}

/// The H200's fused ResNet-50: one row per distinct layer (role, shape, route, graphs with
/// their engines, workspace), and the real block dataflow: every layer fused, conv1 and the
/// projection read the stored block input, conv2/conv3 take the prologue; every layer runs
/// once forward and once backward, with one gradient join per block.
fn h200_report_and_dataflow(net: &CompiledNet) {
    assert_eq!((net.features, net.out_hw), (2048, 7));
    println!("{}", NetLayer::report_header());
    let distinct = net.distinct_layers();
    for l in &distinct {
        println!("{}", l.report_row());
    }
    println!("{} layers, {} distinct", net.layers.len(), distinct.len());
    assert_eq!(distinct.len(), 28);
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
    let count = |steps: &[Step]| {
        steps
            .iter()
            .filter(|s| matches!(s, Step::Layer { .. }))
            .count()
    };
    assert_eq!((count(&net.forward), count(&net.backward)), (53, 53));
    let adds = net
        .backward
        .iter()
        .filter(|s| matches!(s, Step::Add { .. }))
        .count();
    assert_eq!(adds, 16);
    let pools = net
        .forward
        .iter()
        .filter(|s| matches!(s, Step::MaxPool { .. }))
        .count();
    assert_eq!(pools, 1);
}
