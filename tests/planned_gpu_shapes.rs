//! Tier 2: every layer shape and network a GPU test or GPU bench runs (the table in
//! tests/common/gpu_shapes.rs, which those tests and benches read) plans deviceless on the
//! H200 fixture, the way the GPU code plans it, so no `unwrap` on a plan meets its first
//! failure on the device. A layer planned with fallbacks may fall back (reported); an error,
//! or a route asked for by name that does not plan, fails the test with the shape's label.

mod common;

use common::gpu_shapes::{self, CUSTOM_TRAINER};
use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::graphs::{self, ApplyResidual};
use cudnn_cbr::fusion::cbr::kernels::Pointwise;
use cudnn_cbr::fusion::cbr::{CbrConfig, CbrLayer, ConvShape, RouteKind};
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::{Error, Result, Target};
use cudnn_cbr::net::{compile, CompiledNet, NetSpec, RoutePolicy};

/// What planning found: one line per planned item, and the failures.
#[derive(Default)]
struct Outcome {
    lines: Vec<String>,
    fell_back: Vec<String>,
    failed: Vec<String>,
}

impl Outcome {
    /// Prints what planned and what fell back; fails naming every shape that did not plan.
    fn finish(&self, start: std::time::Instant) {
        for line in &self.lines {
            println!("planned  {line}");
        }
        for line in &self.fell_back {
            println!("fell back  {line}");
        }
        println!(
            "{} items planned, {} fell back, {} failed in {:.1} s",
            self.lines.len(),
            self.fell_back.len(),
            self.failed.len(),
            start.elapsed().as_secs_f64()
        );
        assert!(
            self.failed.is_empty(),
            "these shapes do not plan on the H200 fixture:\n{}",
            self.failed.join("\n")
        );
    }

    fn layer(&mut self, user: &str, how: &str, config: &CbrConfig, got: Result<CbrLayer>) {
        let label = format!("{user}: {} ({how})", config.shape.label());
        match got {
            Ok(layer) => {
                let route = layer.route();
                if how == "with fallbacks" && route.kind() != RouteKind::Fused {
                    self.fell_back.push(format!(
                        "{label} -> {}: {}",
                        route.name(),
                        route.reason().unwrap_or_default()
                    ));
                }
                self.lines.push(format!(
                    "{label}: {} ({} cuDNN plans, {} of our kernels)",
                    route.name(),
                    layer.plans().count(),
                    layer.kernels().count()
                ));
            }
            Err(e) => self.failed.push(format!("{label}: {e}")),
        }
    }

    fn graph(&mut self, user: &str, what: &str, shape: &ConvShape, got: Result<String>) {
        let label = format!("{user}: {what} {}", shape.label());
        match got {
            Ok(engine) => self.lines.push(format!("{label}: {engine}")),
            Err(e) => self.failed.push(format!("{label}: {e}")),
        }
    }

    fn net(&mut self, user: &str, how: &str, spec: &NetSpec, got: Result<CompiledNet>) {
        let label = format!("{user}: network `{}` ({how})", spec.name);
        match got {
            Ok(net) => {
                let fused = net
                    .layers
                    .iter()
                    .filter(|l| l.layer.route().kind() == RouteKind::Fused)
                    .count();
                for l in net.layers.iter().filter(|l| {
                    how == "with fallbacks" && l.layer.route().kind() != RouteKind::Fused
                }) {
                    self.fell_back.push(format!(
                        "{label} {} {} -> {}",
                        l.name,
                        l.layer.config().shape.label(),
                        l.layer.route().name()
                    ));
                }
                self.lines.push(format!(
                    "{label}: {} layers, {fused} fused",
                    net.layers.len()
                ));
            }
            Err(e) => self.failed.push(format!("{label}: {e}")),
        }
    }
}

fn conv_plan(shape: &ConvShape, genstats: bool, target: &Target) -> Result<String> {
    let (graph, _) = graphs::conv_fprop(shape, false, genstats);
    let plan = build_plan(&OperationGraph::for_target(&graph, target)?, target)?;
    Ok(plan.engine_tag())
}

#[test]
fn every_shape_the_gpu_tests_and_benches_use_plans_on_the_h200() {
    let Some((target, cache)) = h200("every_shape_the_gpu_tests_and_benches_use_plans_on_the_h200")
    else {
        return;
    };
    let mut out = Outcome::default();
    let start = std::time::Instant::now();

    for (s1, s2) in gpu_shapes::own_kernels_pairs() {
        let configs = [
            CbrConfig::first(s1),
            CbrConfig::new(s2).with_apply(ApplyResidual::Add),
        ];
        for config in configs {
            for (pointwise, how) in [
                (Pointwise::Own, "fused route, our kernels"),
                (Pointwise::Cudnn, "fused route, cuDNN's graphs"),
            ] {
                let got =
                    CbrLayer::plan_route_with(config, &target, &cache, RouteKind::Fused, pointwise);
                out.layer("gpu_own_kernels", how, &config, got);
            }
        }
    }

    for (s1, s2) in gpu_shapes::parity_pairs() {
        let configs = [
            CbrConfig::first(s1),
            CbrConfig::new(s2).with_apply(ApplyResidual::None),
        ];
        for config in configs {
            let got = CbrLayer::plan(config, &target, &cache);
            out.layer("gpu_cbr_parity", "with fallbacks", &config, got);
            let got = CbrLayer::plan_route(config, &target, &cache, false);
            out.layer("gpu_cbr_parity", "unfused route", &config, got);
        }
    }

    let shape = gpu_shapes::conv_shape();
    for (genstats, what) in [(false, "conv fprop"), (true, "conv fprop + GenStats")] {
        let got = conv_plan(&shape, genstats, &target);
        out.graph("gpu_conv", what, &shape, got);
    }

    let planned = RoutePolicy::Planned {
        target: &target,
        cache: &cache,
    };
    let unfused = RoutePolicy::PlannedRoute {
        target: &target,
        cache: &cache,
        route: RouteKind::Unfused,
    };
    for (spec, (batch, hw)) in gpu_shapes::network_cases() {
        for (policy, how) in [(&planned, "with fallbacks"), (&unfused, "unfused route")] {
            let got = compile(&spec, batch, hw, policy);
            out.net("gpu_network", how, &spec, got);
        }
    }

    // No layer of this network is planned (a uniform route): it must still compile.
    let (spec, batch, hw) = gpu_shapes::allreduce_net();
    let got = compile(&spec, batch, hw, &RoutePolicy::Uniform(RouteKind::Fused));
    assert!(got
        .as_ref()
        .is_ok_and(|n| n.layers.iter().all(|l| l.layer.plans().count() == 0)));
    out.lines.push(format!(
        "allreduce: network `{}` compiled, nothing to plan",
        spec.name
    ));

    let spec = CUSTOM_TRAINER.spec();
    let got = compile(&spec, CUSTOM_TRAINER.batch, CUSTOM_TRAINER.hw, &planned);
    out.net("custom_trainer", "with fallbacks", &spec, got);
    out.finish(start);
}

/// The layer bench's shapes (tests/common/gpu_shapes.rs's `cbr_layers` and peak shapes), in a
/// test of their own so the harness plans them beside the rest.
#[test]
fn every_shape_the_layer_bench_uses_plans_on_the_h200() {
    let Some((target, cache)) = h200("every_shape_the_layer_bench_uses_plans_on_the_h200") else {
        return;
    };
    let mut out = Outcome::default();
    let start = std::time::Instant::now();
    // The quick run's layers at its batch, and every layer at the full run's.
    let mut unavailable = Vec::new();
    for (batch, count) in [
        (
            gpu_shapes::CBR_LAYERS_BATCH_QUICK,
            gpu_shapes::CBR_LAYERS_QUICK_LAYERS,
        ),
        (gpu_shapes::CBR_LAYERS_BATCH_FULL, usize::MAX),
    ] {
        for (name, config) in gpu_shapes::cbr_layers(batch).into_iter().take(count) {
            let user = format!("cbr_layers {name}");
            for (fused, pointwise, how) in [
                (true, Pointwise::Own, "fused route, our kernels"),
                (false, Pointwise::Own, "unfused route, our kernels"),
                (true, Pointwise::Cudnn, "fused route, cuDNN's graphs"),
            ] {
                let got = CbrLayer::plan_route_with(config, &target, &cache, fused, pointwise);
                let known = !fused && gpu_shapes::CBR_LAYERS_UNFUSED_NO_ENGINE.contains(&name);
                match got {
                    // The table says the bench's row is unavailable: it must be, and for
                    // want of an engine, not another error.
                    Err(e @ Error::NoEngine { .. }) if known => {
                        unavailable.push(name);
                        out.lines.push(format!(
                            "{user}: {} ({how}): unavailable: {e}",
                            config.shape.label()
                        ));
                    }
                    got if known => out.failed.push(format!(
                        "{user} ({how}) is in CBR_LAYERS_UNFUSED_NO_ENGINE but planned: {:?}",
                        got.map(|l| l.route().name())
                    )),
                    got => out.layer(&user, how, &config, got),
                }
            }
        }
    }
    unavailable.sort_unstable();
    unavailable.dedup();
    assert_eq!(
        unavailable,
        gpu_shapes::CBR_LAYERS_UNFUSED_NO_ENGINE
            .iter()
            .copied()
            .filter(
                |l| gpu_shapes::cbr_layers(gpu_shapes::CBR_LAYERS_BATCH_FULL)
                    .iter()
                    .any(|(n, _)| n == l)
            )
            .collect::<Vec<_>>(),
        "every layer the table lists was found without an unfused engine"
    );
    for shape in gpu_shapes::peak_shapes() {
        let got = conv_plan(&shape, false, &target);
        out.graph("cbr_layers peak", "conv fprop", &shape, got);
    }
    out.finish(start);
}

/// The H200 fixture's target and a fresh plan cache, or None (with a SKIP line) without cuDNN.
fn h200(test: &str) -> Option<(Target, PlanCache)> {
    common::cudnn_or_skip(test)?;
    let (label, path) = &common::devprops_fixtures()[0];
    assert!(label.starts_with("H200"));
    Some((
        Target::deviceless_from_file(path).unwrap(),
        PlanCache::new(),
    ))
}

/// The worked example keeps its own constants (it is what a third party copies); this keeps
/// them equal to the table's entry, so what is planned above is what it runs.
#[test]
fn the_custom_trainer_example_runs_the_tables_network() {
    let source = include_str!("../examples/custom_trainer.rs");
    let c = CUSTOM_TRAINER;
    for line in [
        format!("const BATCH: usize = {};", c.batch),
        format!("const HW: usize = {};", c.hw),
        format!("const CLASSES: usize = {};", c.classes),
        format!("Preset::Mini.spec({}, CLASSES, {})", c.channels, c.width),
    ] {
        assert!(
            source.contains(&line),
            "examples/custom_trainer.rs no longer has `{line}`: update tests/common/gpu_shapes.rs"
        );
    }
}
