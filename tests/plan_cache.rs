//! The plan cache: hits share one plan, keys separate targets, persisted plans come back
//! without heuristics, rebuilt from our own graph (tier 2).

mod common;

use cudnn_cbr::fusion::cache::{PlanCache, PlanKey};
use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
use cudnn_cbr::fusion::Target;
use cudnn_cbr::runtime::DataType;
use std::sync::Arc;

fn h200() -> Target {
    Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap()
}

#[test]
fn hits_share_the_plan_and_targets_do_not_mix() {
    let Some(_) = common::cudnn_or_skip("hits_share_the_plan_and_targets_do_not_mix") else {
        return;
    };
    let cache = PlanCache::new();
    let shape = ConvShape::square(8, 32, 16, 32, 3, 1, 1);
    let h200 = h200();
    let a100 = Target::deviceless_from_file(&common::devprops_fixtures()[1].1).unwrap();
    let (g1, _) = graphs::conv_fprop(&shape, true, true);
    let (g2, _) = graphs::conv_fprop(&shape, true, true); // built again: same signature
    let p1 = cache.get_or_build(&g1, &h200).unwrap();
    let p2 = cache.get_or_build(&g2, &h200).unwrap();
    assert!(Arc::ptr_eq(&p1, &p2), "the second lookup must hit");
    let p3 = cache.get_or_build(&g1, &a100).unwrap();
    assert!(!Arc::ptr_eq(&p1, &p3), "another target is another key");
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.built, stats.restored), (1, 2, 0));
    assert_eq!(cache.len(), 2);
    let key = PlanKey::new(g1.signature().unwrap(), &h200);
    assert!(key.target().contains("NVIDIA H200"));
    assert!(key.target().contains("cudnn92801"), "{}", key.target());
}

fn plan_doc(plan: &cudnn_cbr::fusion::plan::ExecutionPlan) -> serde_json::Value {
    serde_json::from_str(&plan.json().unwrap()).unwrap()
}

#[test]
fn persisted_plans_are_restored_in_a_new_cache() {
    let Some(_) = common::cudnn_or_skip("persisted_plans_are_restored_in_a_new_cache") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("cudnn-cbr-plans-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let target = h200();
    let shape = ConvShape::square(8, 32, 16, 32, 3, 1, 1);
    // One precompiled-engine graph and one runtime-compiled (NVRTC) graph.
    let graphs = [
        graphs::conv_fprop(&shape, true, true).0,
        graphs::scale_bias_relu(shape.y_dims(), DataType::Half).0,
    ];
    let first = PlanCache::persistent(&dir).unwrap();
    let built: Vec<_> = graphs
        .iter()
        .map(|g| {
            let t = std::time::Instant::now();
            let plan = first.get_or_build(g, &target).unwrap();
            (plan, t.elapsed())
        })
        .collect();
    assert_eq!(first.stats().built, 2);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);

    let second = PlanCache::persistent(&dir).unwrap();
    for (g, (original, build_time)) in graphs.iter().zip(&built) {
        let t = std::time::Instant::now();
        let restored = second.get_or_build(g, &target).unwrap();
        println!(
            "{}: built in {:.2} ms, restored (engine {}, knobs {:?}) in {:.2} ms",
            g.name(),
            build_time.as_secs_f64() * 1e3,
            original.engine_tag(),
            original.engine_choice().map(|c| c.knobs.len()),
            t.elapsed().as_secs_f64() * 1e3
        );
        assert!(original.engine_choice().is_some());
        assert_eq!(restored.engine_choice(), original.engine_choice());
        assert_eq!(restored.engine_tag(), original.engine_tag());
        assert_eq!(restored.heuristics_mode(), original.heuristics_mode());
        assert_eq!(restored.workspace_size(), original.workspace_size());
        assert_eq!(restored.real_tensors(), original.real_tensors());
        assert_eq!(restored.pattern(), original.pattern());
        // The same operations and engine config; a runtime-compiled plan's JSON also carries
        // per-build kernel parameters, so the whole documents are not compared.
        let (a, b) = (plan_doc(&restored), plan_doc(original));
        for part in [
            &["operationGraph"][..],
            &["engine", "engineId"],
            &["engine", "knobChoices"],
        ] {
            let at = |d: &serde_json::Value| part.iter().fold(d.clone(), |v, k| v[*k].clone());
            assert!(
                !at(&a).is_null(),
                "{}: no {part:?} in the plan JSON",
                g.name()
            );
            assert!(
                at(&a) == at(&b),
                "{}: the plans differ in {part:?}",
                g.name()
            );
        }
        // Rebuilt from the graph looked up: the simulated device runs that graph.
        let source = restored
            .source_graph()
            .expect("a restored plan keeps its graph");
        assert_eq!(source.signature().unwrap(), g.signature().unwrap());
    }
    assert_eq!(second.stats().restored, 2);
    assert_eq!(second.stats().built, 0);

    // A file written for another key is ignored, not trusted.
    let key = PlanKey::new(graphs[0].signature().unwrap(), &target);
    let path = dir.join(key.file_name());
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("NVIDIA H200", "NVIDIA H100")).unwrap();
    let third = PlanCache::persistent(&dir).unwrap();
    third.get_or_build(&graphs[0], &target).unwrap();
    assert_eq!(third.stats().built, 1, "a mismatched file must not be used");
    let _ = std::fs::remove_dir_all(&dir);
}
