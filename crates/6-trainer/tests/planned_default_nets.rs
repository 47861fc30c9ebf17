//! Tier 2: the networks the trainer's CUDA executor runs by default (`train_cbr --device
//! cuda`: `TrainConfig::default()`) and in crates/6-trainer/tests/gpu_train.rs (the same at
//! `GPU_TRAIN_BATCH`) compile with every layer planned deviceless on the H200 fixture, on the
//! policy the CUDA executor plans with (the fused route with fallbacks), so their first run on
//! a device does not meet a planning error. Fallbacks are reported.

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::RoutePolicy;
use cudnn_cbr_trainer::{compile_net, TrainConfig};

#[path = "../../../tests/common/gpu_shapes.rs"]
mod gpu_shapes;

#[test]
fn the_trainers_default_cuda_networks_plan_on_the_h200() {
    if let Err(e) = cudnn_cbr::sys::library() {
        if std::env::var_os("CI").is_some() {
            panic!("cuDNN is required when CI is set: {e}");
        }
        let e = e.to_string();
        println!(
            "SKIP the_trainers_default_cuda_networks_plan_on_the_h200: cuDNN not loadable ({})",
            e.lines().next().unwrap_or("")
        );
        return;
    }
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/devprops/h200-sm90.json"
    );
    let target = Target::deviceless_from_file(fixture).unwrap();
    let cache = PlanCache::new();
    let default = TrainConfig::default();
    assert!(
        default.fused,
        "the CUDA executor's default plans the fused route"
    );
    for (what, cfg) in [
        ("train_cbr --device cuda", default),
        (
            "gpu_train",
            TrainConfig {
                batch: gpu_shapes::GPU_TRAIN_BATCH,
                ..default
            },
        ),
    ] {
        let policy = RoutePolicy::Planned {
            target: &target,
            cache: &cache,
        };
        let net = compile_net(&cfg, &policy)
            .unwrap_or_else(|e| panic!("{what} ({:?} at batch {}): {e}", cfg.net, cfg.batch));
        assert!(!net.layers.is_empty());
        for l in &net.layers {
            assert!(
                l.layer.plans().count() > 0,
                "{what}: {} has no plan",
                l.name
            );
            if l.layer.route().kind() != RouteKind::Fused {
                println!(
                    "{what}: {} {} fell back to {}: {}",
                    l.name,
                    l.layer.config().shape.label(),
                    l.layer.route().name(),
                    l.layer.route().reason().unwrap_or_default()
                );
            }
        }
        println!(
            "{what}: {:?} batch {} hw {}: {} layers planned",
            cfg.net,
            cfg.batch,
            cfg.hw,
            net.layers.len()
        );
    }
}
