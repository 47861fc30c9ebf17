//! The data-parallel step's overlap schedule and synchronized BN's route check (tier 1: no
//! GPU, no cuDNN): when each amp bucket's gradients are final in a network's backward pass
//! ([`grad_schedule`]), and which routes can synchronize BN on the GPU ([`check_bn_sync`]).
//!
//! That a released bucket is really final is checked by running: the CPU data-parallel step
//! sums each bucket at its release (tests/data_parallel.rs, where a schedule one step early
//! fails the local-BN, overflow and synchronized-BN tests).

use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::{check_bn_sync, layer_bindings};
use cudnn_cbr::net::{grad_schedule, BufferRole, CompiledNet, Step};
use cudnn_cbr::{net::compile, net::memory_plan, net::Preset, net::RoutePolicy};
use std::collections::HashSet;

/// The network buffers a backward step binds.
fn bound(net: &CompiledNet, step: &Step) -> HashSet<usize> {
    match *step {
        Step::Layer { layer, .. } => layer_bindings(net, layer)
            .unwrap()
            .into_iter()
            .map(|(_, _, id)| id)
            .collect(),
        Step::Add { a, b, out } => [a, b, out].into(),
        Step::MaxPool { input, output, .. } => [input, output].into(),
        Step::MaxPoolBackward {
            input,
            grad_output,
            grad_input,
            ..
        } => [input, grad_output, grad_input].into(),
    }
}

#[test]
fn each_bucket_is_released_once_when_final_and_the_deep_one_overlaps_the_shallow_backward() {
    for preset in [Preset::Mini, Preset::ResNet18, Preset::ResNet50] {
        for route in [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic] {
            let net = compile(&preset.spec(3, 10, 8), 2, 32, &RoutePolicy::Uniform(route)).unwrap();
            let plan = memory_plan(&net, 10).unwrap();
            let what = format!("{} {route:?}", preset.name());
            let s = grad_schedule(&net, &plan).unwrap();
            assert_eq!(s.after.len(), net.backward.len(), "{what}");
            // Every bucket exactly once.
            let mut order: Vec<usize> = s.order().map(|b| b.index()).collect();
            order.sort_unstable();
            let all: Vec<usize> = (0..plan.buckets().len()).collect();
            assert_eq!(order, all, "{what}");
            // The FC gradients are in the deep bucket with conv layers: nothing before.
            assert!(s.before.is_empty(), "{what}: {:?}", s.before);

            for (i, released) in s.after.iter().enumerate() {
                for b in released {
                    let info = &plan.buckets()[b.index()];
                    // The bucket's gradient buffers in the network.
                    let grads: HashSet<usize> = net
                        .buffers
                        .iter()
                        .enumerate()
                        .filter(|(_, buf)| buf.role == BufferRole::ParamGrad)
                        .filter(|(_, buf)| {
                            let layer = buf.name.rsplit_once('.').unwrap().0;
                            plan.params()[info.params()]
                                .iter()
                                .any(|p| p.name().rsplit_once('.').unwrap().0 == layer)
                        })
                        .map(|(id, _)| id)
                        .collect();
                    assert!(!grads.is_empty(), "{what}: bucket {}", info.name());
                    // Released at the last step touching them: none after, one at it.
                    for (j, step) in net.backward.iter().enumerate().skip(i + 1) {
                        let late = bound(&net, step).intersection(&grads).count();
                        assert_eq!(
                            late,
                            0,
                            "{what}: bucket {} released at {i}, step {j} binds it",
                            info.name()
                        );
                    }
                    assert!(
                        bound(&net, &net.backward[i]).intersection(&grads).count() > 0,
                        "{what}: bucket {} released at {i}, later than needed",
                        info.name()
                    );
                }
            }
            // The deep bucket's sum is released before the first stage's backward starts, so
            // it overlaps all of it; the first bucket ends the pass.
            let released_at = |name: &str| {
                s.after
                    .iter()
                    .position(|r| r.iter().any(|b| plan.buckets()[b.index()].name() == name))
                    .unwrap()
            };
            let first_stage = net
                .backward
                .iter()
                .position(|st| {
                    matches!(st, Step::Layer { layer, .. } if net.layers[*layer].name.starts_with("s0."))
                })
                .unwrap();
            assert!(released_at("deep") < first_stage, "{what}");
            assert_eq!(released_at("first"), net.backward.len() - 1, "{what}");
        }
    }
}

#[test]
fn synchronized_bn_on_the_gpu_needs_routes_that_sum_between_steps() {
    for preset in [Preset::Mini, Preset::ResNet50] {
        for route in [RouteKind::Fused, RouteKind::Generic] {
            let net = compile(&preset.spec(3, 10, 8), 2, 32, &RoutePolicy::Uniform(route)).unwrap();
            check_bn_sync(&net).unwrap();
        }
        let net = compile(
            &preset.spec(3, 10, 8),
            2,
            32,
            &RoutePolicy::Uniform(RouteKind::Unfused),
        )
        .unwrap();
        let e = check_bn_sync(&net).unwrap_err().to_string();
        assert!(
            e.contains(&format!("`{}`", net.layers[0].name)) && e.contains("unfused"),
            "{e}"
        );
    }
}
