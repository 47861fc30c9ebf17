//! Every backend descriptor the frontend creates is destroyed (tier 2). One test per binary so
//! no other test's descriptors are counted.

mod common;

use cudnn_cbr::fusion::backend::descriptor_counts;
use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::{build_plans, PlanPolicy};
use cudnn_cbr::fusion::Target;

#[test]
fn every_created_descriptor_is_destroyed() {
    let Some(_) = common::cudnn_or_skip("every_created_descriptor_is_destroyed") else {
        return;
    };
    let before = descriptor_counts();
    assert_eq!(before.created, before.destroyed);
    {
        let target = Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap();
        let shape = ConvShape::square(8, 32, 16, 32, 3, 1, 1);
        for (g, _) in [
            graphs::conv_fprop(&shape, true, true),
            graphs::conv_fprop(&shape, false, true),
        ] {
            let op = OperationGraph::new(&g).unwrap();
            // Several plans, plus every engine config heuristics handed out.
            let plans = build_plans(&op, &target, &PlanPolicy::autotune(3)).unwrap();
            assert!(!plans.is_empty());
            for p in &plans {
                let _ = p.json().unwrap();
            }
        }
        // A failing build path must not leak either (sm_50: no engine for FP16 NHWC convs).
        let bad = cudnn_cbr::fusion::DeviceProps::from_json(
            &std::fs::read_to_string(&common::devprops_fixtures()[0].1)
                .unwrap()
                .replace("\"deviceVer\": 900", "\"deviceVer\": 500"),
        )
        .unwrap();
        let _ = Target::deviceless(bad).and_then(|t| {
            let (g, _) = graphs::conv_fprop(&shape, false, true);
            cudnn_cbr::fusion::plan::build_plan(&OperationGraph::new(&g)?, &t)
        });
        let mid = descriptor_counts();
        assert!(mid.created > before.created + 20, "{mid:?}");
    }
    let after = descriptor_counts();
    println!(
        "descriptors created {} destroyed {}",
        after.created, after.destroyed
    );
    assert_eq!(after.created, after.destroyed, "leaked descriptors");
}
