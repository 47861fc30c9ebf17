//! Tier 2: every graph of a CBR layer plans deviceless for a table of shapes; a shape without
//! fused engines falls back to the unfused route, and one without BN engines at all (odd channel
//! counts) to the generic route, and says why.

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::graphs::{ApplyResidual, BackwardResidual};
use cudnn_cbr::fusion::cbr::{
    route_graphs, CbrConfig, CbrLayer, ConvShape, GraphRole, Route, RouteKind,
};
use cudnn_cbr::fusion::Target;
use std::time::Instant;

fn target(i: usize) -> Target {
    Target::deviceless_from_file(&common::devprops_fixtures()[i].1).unwrap()
}

/// 3×3 and 1×1, stride 1 and 2, C ≠ K, N 32 and 256, first layer and through-BN layers.
fn shape_table() -> Vec<(&'static str, CbrConfig)> {
    vec![
        (
            "3x3 s1",
            CbrConfig::new(ConvShape::square(32, 64, 56, 64, 3, 1, 1)),
        ),
        (
            "1x1 C<K",
            CbrConfig::new(ConvShape::square(32, 64, 56, 256, 1, 0, 1)),
        ),
        (
            "1x1 C>K",
            CbrConfig::new(ConvShape::square(32, 256, 56, 64, 1, 0, 1)),
        ),
        (
            "3x3 s2",
            CbrConfig::new(ConvShape::square(32, 128, 56, 128, 3, 1, 2)),
        ),
        (
            "1x1 N256",
            CbrConfig::new(ConvShape::square(256, 256, 14, 1024, 1, 0, 1)),
        ),
        (
            "first 3x3",
            CbrConfig::first(ConvShape::square(32, 64, 56, 64, 3, 1, 1)),
        ),
        (
            "block out",
            CbrConfig::new(ConvShape::square(32, 64, 56, 256, 1, 0, 1))
                .with_apply(ApplyResidual::Add),
        ),
        (
            "shortcut s1",
            CbrConfig::new(ConvShape::square(32, 64, 56, 64, 3, 1, 1))
                .with_backward_residual(BackwardResidual::FuseAdd),
        ),
    ]
}

#[test]
fn every_layer_of_the_shape_table_plans_fused_on_the_h200() {
    let Some(_) = common::cudnn_or_skip("every_layer_of_the_shape_table_plans_fused_on_the_h200")
    else {
        return;
    };
    let target = target(0);
    let cache = PlanCache::new();
    println!(
        "{:<12} {:<26} {:<8} {:<30} {:>7} {:>9} {:>10}",
        "layer", "shape", "route", "graph", "engine", "workspace", "cold ms"
    );
    for (label, config) in shape_table() {
        let start = Instant::now();
        let layer = CbrLayer::plan(config, &target, &cache).unwrap();
        assert_eq!(layer.route(), &Route::Fused, "{label}");
        for (role, plan) in layer.plans() {
            println!(
                "{label:<12} {:<26} {:<8} {:<30} {:>7} {:>9} {:>10.1}",
                config.shape.label(),
                layer.route().name(),
                format!("{role:?}"),
                plan.engine_tag(),
                plan.workspace_size(),
                start.elapsed().as_secs_f64() * 1e3
            );
        }
        let expected = route_graphs(&config, true).len();
        assert_eq!(planned(&layer), expected, "{label}");
        assert!(layer.buffers().iter().all(|b| b.elems > 0));
        assert_eq!(
            layer.prev_buffers().is_empty(),
            config.input == cudnn_cbr::fusion::cbr::InputKind::Raw
        );
    }
    println!("plans built: {:?}", cache.stats());
}

#[test]
fn the_unfused_route_plans_too() {
    let Some(_) = common::cudnn_or_skip("the_unfused_route_plans_too") else {
        return;
    };
    let target = target(0);
    let cache = PlanCache::new();
    // Two shapes: every unfused graph is runtime-compiled or a plain conv, so keep CI bounded.
    for (label, config) in shape_table().into_iter().take(2) {
        for lg in route_graphs(&config, false) {
            let (role, graph) = (lg.role, lg.graph);
            let t = Instant::now();
            let plan = cache
                .get_or_build(&graph, &target)
                .unwrap_or_else(|e| panic!("{label} {role:?}: {e}"));
            println!(
                "{label:<8} unfused {:<20} {:<20} {:>6} ws {:>9} {:>8.1} ms",
                format!("{role:?}"),
                graph.name(),
                plan.engine_tag(),
                plan.workspace_size(),
                t.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}

#[test]
fn shapes_without_fused_engines_fall_back_to_unfused() {
    let Some(_) = common::cudnn_or_skip("shapes_without_fused_engines_fall_back_to_unfused") else {
        return;
    };
    let h200 = target(0);
    let cache = PlanCache::new();
    // Measured: the shortcut-gradient form of the fused backward has no engine for a strided
    // 3×3 on sm_90, while every unfused graph does.
    let cases = [(
        "shortcut s2",
        CbrConfig::new(ConvShape::square(32, 128, 56, 128, 3, 1, 2))
            .with_backward_residual(BackwardResidual::FuseAdd),
        "dgrad_add_drelu_dbn",
    )];
    for (label, config, failing) in cases {
        let layer = CbrLayer::plan(config, &h200, &cache).unwrap();
        let Route::Unfused { reason } = layer.route() else {
            panic!("{label}: expected the unfused route");
        };
        println!("{label}: unfused because {reason}");
        assert!(reason.contains(failing), "{label}: {reason}");
        assert_eq!(planned(&layer), route_graphs(&config, false).len());
    }
}

#[test]
fn odd_channel_counts_fall_back_to_the_generic_route() {
    let Some(_) = common::cudnn_or_skip("odd_channel_counts_fall_back_to_the_generic_route") else {
        return;
    };
    let h200 = target(0);
    let cache = PlanCache::new();
    // Channel counts that are not a multiple of 8 (3, 12, 63, 100 measured) have no engine on
    // sm_90 for any fused BN graph nor for NormForward / NormBackward; the generic route needs
    // only conv + GenStats, BN finalize, convs, pointwise graphs and reductions. Two layers, so
    // CI stays bounded: every generic graph is runtime compiled (0.4–1.3 s each), and the plan
    // cache serves the graphs the two routes and the apply's backward share.
    let cases = [
        (
            "C=K=63 apply",
            CbrConfig::new(ConvShape::square(32, 63, 28, 63, 3, 1, 1))
                .with_apply(ApplyResidual::None),
            "scale_bias_relu_conv_genstats",
            "batchnorm_relu",
        ),
        (
            "C=12 K=24",
            CbrConfig::new(ConvShape::square(32, 12, 28, 24, 3, 1, 1)),
            "scale_bias_relu_conv_genstats",
            "batchnorm_backward",
        ),
    ];
    for (label, config, fused_fail, unfused_fail) in cases {
        let start = Instant::now();
        let layer = CbrLayer::plan(config, &h200, &cache)
            .unwrap_or_else(|e| panic!("{label}: no route: {e}"));
        let Route::Generic { reason } = layer.route() else {
            panic!(
                "{label}: expected the generic route, got {:?}",
                layer.route()
            );
        };
        println!(
            "{label}: generic ({:.1} s) because {reason}",
            start.elapsed().as_secs_f64()
        );
        assert_eq!(layer.route().kind(), RouteKind::Generic);
        assert_eq!(layer.route().name(), "generic");
        // The reason names the failing fused graph and the failing unfused graph.
        let (fused, unfused) = reason.split_once("; unfused: ").expect("both reasons");
        assert!(fused.contains(fused_fail), "{label}: {reason}");
        assert!(unfused.contains(unfused_fail), "{label}: {reason}");
        let expected = route_graphs(&config, RouteKind::Generic);
        assert_eq!(planned(&layer), expected.len(), "{label}");
        for (role, plan) in layer.plans() {
            println!(
                "  {:<22} {:<30} {:>6} {:<32} ws {:>8}",
                format!("{role:?}"),
                plan.graph_name(),
                plan.engine_tag(),
                plan.pattern().unwrap_or_default(),
                plan.workspace_size()
            );
        }
        for role in [
            GraphRole::ApplyPrev,
            GraphRole::ConvStats,
            GraphRole::Finalize,
            GraphRole::Wgrad,
            GraphRole::Dgrad,
            GraphRole::ReluBackward,
            GraphRole::DbnReduce,
            GraphRole::DbnCoefficients,
            GraphRole::DbnApply,
        ] {
            let step = layer.steps().iter().find(|s| s.role == role);
            assert!(
                step.is_some_and(|s| s.plan.is_some() || s.kernel.is_some()),
                "{label}: no {role:?} plan or kernel"
            );
        }
        assert_eq!(
            layer.has_role(GraphRole::ApplyDbnReduce),
            config.apply.is_some(),
            "{label}"
        );
        // No BN-specific engine: neither NormForward/Backward nor the fused BN graphs; the
        // reductions and coefficients run on the generic pointwise-fusion engine.
        for (role, plan) in layer.plans() {
            let name = plan.graph_name();
            assert!(
                !name.starts_with("batchnorm") && !name.contains("dgrad_drelu"),
                "{label}: {role:?} uses {name}"
            );
            if matches!(role, GraphRole::DbnReduce | GraphRole::DbnCoefficients) {
                assert!(plan.is_runtime_compiled(), "{label}: {role:?}");
                assert_eq!(
                    plan.pattern().as_deref(),
                    Some("GENERIC_POINTWISE_FUSION"),
                    "{label}: {role:?}"
                );
            }
        }
        // The same buffers as the other routes, plus the apply's dBN coefficients.
        let names: Vec<&str> = layer.buffers().iter().map(|b| b.name).collect();
        for name in [
            "y", "sum", "sq_sum", "eq_scale", "dw", "dbn_a", "dz_prev", "a_prev",
        ] {
            assert!(
                names.contains(&name),
                "{label}: no buffer `{name}` in {names:?}"
            );
        }
        let prev: Vec<&str> = layer.prev_buffers().iter().map(|b| b.name).collect();
        for name in [
            "y",
            "eq_scale",
            "eq_bias",
            "saved_mean",
            "saved_inv_std",
            "gamma",
            "dgamma",
            "dbeta",
            "dy",
        ] {
            assert!(
                prev.contains(&name),
                "{label}: no previous buffer `{name}` in {prev:?}"
            );
        }
    }
    println!("plans: {:?}", cache.stats());
}

/// What cuDNN accepts for the reduction node beyond the generic route's graphs (which the test
/// above plans): a bare per-channel sum of a stored FP16 tensor. Measured with cuDNN 9.28:
/// `GENERIC_POINTWISE_FUSION`, eng 1, runtime compiled, 4 usable configs of 5, workspace 0, for
/// odd and even channel counts; the same for a MAX reduction, an FP32 input, and a ReLU
/// backward feeding a reduction.
#[test]
fn a_bare_reduction_plans_on_the_h200() {
    use cudnn_cbr::fusion::graph::{Graph, ReductionAttrs, ReductionMode, TensorAttrs};
    let Some(_) = common::cudnn_or_skip("a_bare_reduction_plans_on_the_h200") else {
        return;
    };
    let mut g = Graph::new("dz_sum");
    let dz = g.tensor(TensorAttrs::new("dZ", [32, 63, 28, 28]));
    let sum = g.reduce(dz, ReductionAttrs::per_channel(ReductionMode::Add, 63));
    g.set_output(sum, None).unwrap();
    let t = Instant::now();
    let plan = PlanCache::new().get_or_build(&g, &target(0)).unwrap();
    println!(
        "{:<8} {:>6} {:<26} configs {:?} ws {} {:.0} ms",
        g.name(),
        plan.engine_tag(),
        plan.pattern().unwrap_or_default(),
        plan.config_counts(),
        plan.workspace_size(),
        t.elapsed().as_secs_f64() * 1e3
    );
    assert!(plan.is_runtime_compiled());
    assert_eq!(plan.pattern().as_deref(), Some("GENERIC_POINTWISE_FUSION"));
    assert_eq!(plan.workspace_size(), 0);
}

#[test]
fn routes_on_the_other_targets() {
    let Some(_) = common::cudnn_or_skip("routes_on_the_other_targets") else {
        return;
    };
    let config = CbrConfig::new(ConvShape::square(32, 64, 56, 64, 3, 1, 1));
    let cache = PlanCache::new();
    // Measured with cuDNN 9.28: the A100 has ConvBNfprop/wgrad engines for this shape; the B200
    // fixture gets none for the prologue forms, so it runs unfused.
    let a100 = CbrLayer::plan(config, &target(1), &cache).unwrap();
    assert_eq!(a100.route(), &Route::Fused);
    let b200 = CbrLayer::plan(config, &target(2), &cache).unwrap();
    println!("A100: {}; B200: {:?}", a100.route().name(), b200.route());
    assert!(matches!(b200.route(), Route::Unfused { .. }));
}

/// Steps with a cuDNN plan or one of our kernels: every step of a layer planned for a GPU.
fn planned(layer: &CbrLayer) -> usize {
    layer.plans().count() + layer.kernels().count()
}
