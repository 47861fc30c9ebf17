//! Our element-wise kernels (`fusion::cbr::kernels`) without a GPU: NVRTC compiles them for
//! every architecture we plan for, the disk cache gives the machine code back unchanged,
//! planned layers run their element-wise steps on them (and on cuDNN's graphs when asked), and
//! bad choices are typed errors. Their arithmetic is checked against the CPU reference on a GPU
//! (`gpu_own_kernels.rs`).

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::graphs::{self, ApplyResidual, BackwardResidual};
use cudnn_cbr::fusion::cbr::kernels::{self, KernelStep, OwnKernel, Pointwise};
use cudnn_cbr::fusion::cbr::Side;
use cudnn_cbr::fusion::cbr::Src::{self, This};
use cudnn_cbr::fusion::cbr::{
    route_graphs, CbrConfig, CbrLayer, ConvShape, GraphRole, LayerGraph, RouteKind,
};
use cudnn_cbr::fusion::exec::Scalar;
use cudnn_cbr::fusion::{DeviceProps, Error, Target};
use cudnn_cbr::runtime::kernel_cache::{CacheOutcome, KernelCache};
use cudnn_cbr::runtime::rtc;
use cudnn_cbr::runtime::DataType;

fn h200() -> Target {
    let path = common::repo_root().join("tests/fixtures/devprops/h200-sm90.json");
    Target::deviceless_from_file(path).expect("the H200 fixture loads")
}

/// NVRTC is part of the test dependencies (`.deps/`): its absence is a failure here, not a skip.
fn require_nvrtc() {
    assert!(
        rtc::nvrtc_library_present(),
        "NVRTC cannot be loaded: run scripts/setup-test-deps.sh and `source .deps/env.sh`"
    );
}

#[test]
fn the_module_compiles_for_every_architecture_we_plan_for() {
    require_nvrtc();
    for arch in ["sm_80", "sm_90", "sm_100"] {
        let c = kernels::compile_uncached(arch, None).expect("our kernels compile");
        assert_eq!(c.outcome, CacheOutcome::Off);
        assert_eq!(&c.cubin[..4], b"\x7fELF", "{arch}: a cubin is an ELF image");
        // Every entry point is in the image's symbol table.
        for k in OwnKernel::ALL {
            let name = k.entry().as_bytes();
            assert!(
                c.cubin.windows(name.len()).any(|w| w == name),
                "{arch}: {} missing",
                k.entry()
            );
        }
        println!("{arch}: {} bytes in {:.2} s", c.cubin.len(), c.seconds);
    }
}

#[test]
fn the_kernel_cache_gives_the_machine_code_back_unchanged() {
    require_nvrtc();
    let dir = std::env::temp_dir().join(format!("cbr-own-kernels-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = KernelCache::at(&dir);
    let first = kernels::compile_uncached("sm_90", Some(&cache)).unwrap();
    let again = kernels::compile_uncached("sm_90", Some(&cache)).unwrap();
    assert_eq!(first.outcome, CacheOutcome::Stored);
    assert_eq!(again.outcome, CacheOutcome::Hit);
    assert_eq!(first.cubin, again.cubin);
    println!(
        "compiled in {:.3} s, from the cache in {:.4} s",
        first.seconds, again.seconds
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn roles(layer: &CbrLayer) -> Vec<(GraphRole, Option<&'static str>, bool)> {
    layer
        .steps()
        .iter()
        .map(|s| {
            (
                s.role,
                s.kernel.as_ref().map(|k| k.kernel().entry()),
                s.plan.is_some(),
            )
        })
        .collect()
}

#[test]
fn planned_layers_run_their_element_wise_steps_on_our_kernels() {
    if common::cudnn_or_skip("planned_layers_run_their_element_wise_steps_on_our_kernels").is_none()
    {
        return;
    }
    require_nvrtc();
    let target = h200();
    let cache = PlanCache::new();
    // A block's last conv: prologue from conv2, BN apply with the shortcut added.
    let config = CbrConfig::new(ConvShape::square(8, 64, 14, 256, 1, 0, 1))
        .with_apply(ApplyResidual::Add)
        .with_backward_residual(BackwardResidual::None);
    let own = CbrLayer::plan_route_with(config, &target, &cache, RouteKind::Fused, Pointwise::Own)
        .unwrap();
    let ours: Vec<_> = roles(&own)
        .into_iter()
        .filter_map(|(role, k, plan)| k.map(|k| (role, k, plan)))
        .collect();
    assert_eq!(
        ours,
        vec![
            (GraphRole::Apply, "cbr_apply_add_relu", false),
            (GraphRole::ApplyReluBackward, "cbr_relu_backward", false),
            (GraphRole::ApplyDbnReduce, "cbr_dbn_reduce", false),
            (
                GraphRole::ApplyDbnCoefficients,
                "cbr_dbn_coefficients",
                false
            ),
            (GraphRole::ApplyDbnApply, "cbr_dbn_apply", false),
            (GraphRole::DbnApply, "cbr_dbn_apply", false),
        ]
    );
    // Each argument comes from the buffer the layer binds to the graph tensor it stands for.
    let sources = |role| {
        own.steps()
            .iter()
            .find(|s| s.role == role)
            .and_then(|s| s.kernel.as_ref())
            .unwrap()
            .sources()
    };
    assert_eq!(
        sources(GraphRole::ApplyDbnReduce),
        [
            This("y"),
            This("dpre"),
            This("saved_mean"),
            This("saved_inv_std")
        ]
        .into_iter()
        .chain([This("dgamma"), This("dbeta")])
        .collect::<Vec<_>>()
    );
    let coefficients = sources(GraphRole::ApplyDbnCoefficients);
    assert_eq!(
        coefficients[..5],
        [
            This("gamma"),
            This("saved_inv_std"),
            This("saved_mean"),
            This("dgamma"),
            This("dbeta")
        ]
    );
    // −1/M with M = N·P·Q = 8·14·14.
    assert_eq!(
        coefficients[5],
        Src::Scalar(Scalar::F32((-1.0f64 / (8.0 * 14.0 * 14.0)) as f32))
    );
    assert_eq!(
        coefficients[6..],
        [
            This("apply_dbn_a"),
            This("apply_dbn_b"),
            This("apply_dbn_c")
        ]
    );
    // Every other step has its cuDNN plan.
    assert!(roles(&own).iter().all(|(_, k, plan)| k.is_some() != *plan));
    for step in own.steps().iter().filter_map(|s| s.kernel.as_ref()) {
        assert_eq!(step.arch(), "sm_90");
    }

    let reference =
        CbrLayer::plan_route_with(config, &target, &cache, RouteKind::Fused, Pointwise::Cudnn)
            .unwrap();
    assert!(roles(&reference)
        .iter()
        .all(|(_, k, plan)| k.is_none() && *plan));
    // The same steps and buffers either way: only who runs them differs.
    assert_eq!(
        roles(&own).iter().map(|r| r.0).collect::<Vec<_>>(),
        roles(&reference).iter().map(|r| r.0).collect::<Vec<_>>()
    );
    assert_eq!(own.buffers(), reference.buffers());
    assert_eq!(kernels::arch_for(&target, Pointwise::Own), Some("sm_90"));
    assert_eq!(kernels::arch_for(&target, Pointwise::Cudnn), None);

    // A compute capability with no machine-code target here (7.5): nothing of ours is
    // compiled and cuDNN plans every step.
    let json =
        std::fs::read_to_string(common::repo_root().join("tests/fixtures/devprops/h200-sm90.json"))
            .unwrap();
    let mut props: serde_json::Value = serde_json::from_str(&json).unwrap();
    props["deviceVer"] = 750.into();
    let turing = Target::deviceless(DeviceProps::from_json(&props.to_string()).unwrap()).unwrap();
    assert_eq!(kernels::arch_for(&turing, Pointwise::Own), None);
}

#[test]
fn a_stem_computes_its_statistics_in_a_step_of_its_own() {
    if common::cudnn_or_skip("a_stem_computes_its_statistics_in_a_step_of_its_own").is_none() {
        return;
    }
    require_nvrtc();
    let target = h200();
    let cache = PlanCache::new();
    // ResNet's stem: 3 input channels, where conv + GenStats has only a runtime-compiled
    // engine. The fused route runs a plain conv, then the statistics on our kernel.
    let stem =
        CbrConfig::first(ConvShape::square(8, 3, 32, 64, 7, 3, 2)).with_apply(ApplyResidual::None);
    let plan = |pointwise| {
        CbrLayer::plan_route_with(stem, &target, &cache, RouteKind::Fused, pointwise).unwrap()
    };
    let own = plan(Pointwise::Own);
    let forward: Vec<_> = roles(&own).into_iter().take(4).collect();
    assert_eq!(
        forward,
        vec![
            (GraphRole::Conv, None, true),
            (GraphRole::Stats, Some("cbr_channel_stats"), false),
            (GraphRole::Finalize, None, true),
            (GraphRole::Apply, Some("cbr_apply_relu"), false),
        ]
    );
    let conv = own.plan_for(GraphRole::Conv).unwrap();
    assert!(!conv.is_runtime_compiled(), "{}", conv.engine_tag());
    // Our statistics kernel adds into Σy and Σy²: the GPU path zeroes them before it runs,
    // as it does for the backward's reductions into dγ and dβ (every planned route and
    // configuration: the zeroing test in crates/3-fusion/src/cbr/run.rs).
    let zeroed = |role| {
        own.steps()
            .iter()
            .find(|s| s.role == role)
            .map(|s| s.outputs_to_zero())
            .unwrap()
    };
    assert_eq!(
        zeroed(GraphRole::Stats),
        [(Side::This, "sum"), (Side::This, "sq_sum")]
    );
    assert_eq!(
        zeroed(GraphRole::ApplyDbnReduce),
        [(Side::This, "dgamma"), (Side::This, "dbeta")]
    );
    // cuDNN's reduction graph plans too (the parity reference), runtime-compiled.
    let reference = plan(Pointwise::Cudnn);
    let stats = reference
        .plan_for(GraphRole::Stats)
        .expect("cuDNN plans channel_stats");
    assert_eq!(stats.graph_name(), "channel_stats");
    // A first conv with 8k input channels keeps conv + GenStats in one graph.
    let first = CbrConfig::first(ConvShape::square(8, 16, 32, 64, 3, 1, 1));
    assert!(route_graphs(&first, RouteKind::Fused)
        .iter()
        .any(|g| g.role == GraphRole::ConvStats));
    assert!(!route_graphs(&first, RouteKind::Fused)
        .iter()
        .any(|g| g.role == GraphRole::Stats));
}

fn graph_named(config: &CbrConfig, kind: RouteKind, role: GraphRole) -> LayerGraph {
    route_graphs(config, kind)
        .into_iter()
        .find(|g| g.role == role)
        .expect("the route has the role")
}

#[test]
fn each_apply_form_and_backward_graph_maps_to_its_kernel() {
    let shape = ConvShape::square(4, 32, 8, 64, 3, 1, 1);
    for (residual, entry) in [
        (ApplyResidual::None, "cbr_apply_relu"),
        (ApplyResidual::Add, "cbr_apply_add_relu"),
        (ApplyResidual::DualScaleBias, "cbr_apply_dual_relu"),
    ] {
        let config = CbrConfig::new(shape).with_apply(residual);
        for kind in [RouteKind::Fused, RouteKind::Generic] {
            let lg = graph_named(&config, kind, GraphRole::Apply);
            let step = KernelStep::for_graph(&lg, "sm_90").expect("a kernel step");
            assert_eq!(step.kernel().entry(), entry);
        }
    }
    let config = CbrConfig::new(shape);
    let lg = graph_named(&config, RouteKind::Fused, GraphRole::DbnApply);
    assert_eq!(
        KernelStep::for_graph(&lg, "sm_90").unwrap().kernel(),
        OwnKernel::DbnApply
    );
    let stem = CbrConfig::first(ConvShape::square(4, 3, 16, 64, 7, 3, 2));
    let lg = graph_named(&stem, RouteKind::Fused, GraphRole::Stats);
    assert_eq!(
        KernelStep::for_graph(&lg, "sm_90").unwrap().kernel(),
        OwnKernel::ChannelStats
    );
    // More channels than a block's shared memory holds accumulators for: cuDNN's graph.
    let wide = CbrConfig::first(ConvShape::square(1, 3, 4, 8192, 1, 0, 1));
    let lg = graph_named(&wide, RouteKind::Fused, GraphRole::Stats);
    assert!(KernelStep::for_graph(&lg, "sm_90").is_none());
    // Graphs no kernel of ours computes stay with cuDNN.
    for role in [GraphRole::ConvStats, GraphRole::Finalize, GraphRole::Wgrad] {
        let lg = graph_named(&config, RouteKind::Fused, role);
        assert!(KernelStep::for_graph(&lg, "sm_90").is_none(), "{role:?}");
    }
}

#[test]
fn a_graph_with_other_element_types_stays_with_cudnn() {
    // The apply with FP32 scale and bias (a form cuDNN also accepts): our kernel reads FP16
    // coefficients, so it must not claim the graph.
    let (graph, t) = graphs::apply([2, 16, 4, 4], DataType::Float, ApplyResidual::None);
    let lg = LayerGraph {
        role: GraphRole::Apply,
        graph,
        bindings: vec![
            (t.y, This("y")),
            (t.scale, This("eq_scale")),
            (t.bias, This("eq_bias")),
            (t.a, This("a")),
        ],
    };
    assert!(KernelStep::for_graph(&lg, "sm_90").is_none());
    let (graph, t) = graphs::apply([2, 16, 4, 4], DataType::Half, ApplyResidual::None);
    let lg = LayerGraph {
        graph,
        bindings: vec![
            (t.y, This("y")),
            (t.scale, This("eq_scale")),
            (t.bias, This("eq_bias")),
            (t.a, This("a")),
        ],
        ..lg
    };
    assert!(KernelStep::for_graph(&lg, "sm_90").is_some());
    // A binding left out: no kernel step (cuDNN's binding checks then name it).
    let lg = LayerGraph {
        bindings: lg.bindings[..3].to_vec(),
        ..lg
    };
    assert!(KernelStep::for_graph(&lg, "sm_90").is_none());
}

#[test]
fn the_pointwise_choice_is_parsed_and_a_bad_one_is_named() {
    assert_eq!(Pointwise::parse(None).unwrap(), Pointwise::Own);
    assert_eq!(Pointwise::parse(Some("")).unwrap(), Pointwise::Own);
    assert_eq!(Pointwise::parse(Some("own")).unwrap(), Pointwise::Own);
    assert_eq!(Pointwise::parse(Some(" cudnn ")).unwrap(), Pointwise::Cudnn);
    let e = Pointwise::parse(Some("fast")).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains(kernels::POINTWISE_ENV) && msg.contains("fast"),
        "{msg}"
    );
}
