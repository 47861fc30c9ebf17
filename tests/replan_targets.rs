//! Tier 2: a network planned for one target and run on another is planned again for the
//! device it runs on (`CudaNet::new` does it through `replan_for`, src/net/cuda/replan.rs).
//! Here the "live" device is a second deviceless fixture: plan on the A100 fixture, re-plan
//! for the H200 fixture.

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::{compile, CompiledNet, Preset, RoutePolicy};
use cudnn_cbr::net::{layers_to_replan, replan_for};

fn fixture(name: &str) -> Target {
    Target::deviceless_from_file(
        common::repo_root().join(format!("tests/fixtures/devprops/{name}.json")),
    )
    .unwrap()
}

fn mini_on(target: &Target, cache: &PlanCache) -> CompiledNet {
    let policy = RoutePolicy::Planned { target, cache };
    compile(&Preset::Mini.spec(3, 10, 16), 8, 32, &policy).unwrap()
}

#[test]
fn plans_for_a_fixture_are_planned_again_for_the_live_target_and_said_once() {
    let Some(_) = common::cudnn_or_skip(
        "plans_for_a_fixture_are_planned_again_for_the_live_target_and_said_once",
    ) else {
        return;
    };
    let a100 = fixture("a100-sm80");
    let h200 = fixture("h200-sm90");
    assert_ne!(a100.identity(), h200.identity());
    let cache = PlanCache::new();
    let mut net = mini_on(&a100, &cache);
    let all: Vec<usize> = (0..net.layers.len()).collect();
    assert!(!all.is_empty());

    // Same identity: nothing to do.
    assert!(layers_to_replan(&net, a100.identity()).is_empty());
    assert_eq!(replan_for(&mut net, &a100, &cache).unwrap(), None);
    // Another identity: every layer (each has cuDNN plans for the A100).
    assert_eq!(layers_to_replan(&net, h200.identity()), all);

    let routes: Vec<_> = net.layers.iter().map(|l| l.layer.route().clone()).collect();
    let buffers: Vec<_> = net
        .layers
        .iter()
        .map(|l| l.layer.buffers().to_vec())
        .collect();
    let report = replan_for(&mut net, &h200, &cache)
        .unwrap()
        .expect("re-planned");
    println!("{}", report.note);
    assert_eq!(report.layers.len(), net.layers.len());
    assert_eq!(report.planned_for, vec![a100.identity().to_string()]);
    assert_eq!(report.live, h200.identity());
    assert!(report.note.contains(a100.identity()) && report.note.contains(h200.identity()));
    assert!(
        report.printed,
        "the first re-plan for these targets says so"
    );
    // Every plan is now the H200's, on the same route with the same buffers.
    for (i, l) in net.layers.iter().enumerate() {
        assert_eq!(l.layer.plan_targets(), vec![h200.identity()], "{}", l.name);
        assert_eq!(l.layer.route(), &routes[i], "{}", l.name);
        assert_eq!(l.layer.buffers(), &buffers[i][..], "{}", l.name);
    }
    assert!(layers_to_replan(&net, h200.identity()).is_empty());
    assert_eq!(replan_for(&mut net, &h200, &cache).unwrap(), None);

    // A second network planned for the A100 is re-planned too, but the note is not said again.
    let mut again = mini_on(&a100, &cache);
    let second = replan_for(&mut again, &h200, &cache)
        .unwrap()
        .expect("re-planned");
    assert_eq!(second.layers.len(), again.layers.len());
    assert!(
        !second.printed,
        "said once per pair of targets, not per network"
    );
}
