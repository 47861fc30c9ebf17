//! Tier 2: the table of examples/deviceless_plans.rs for a small subset of ResNet-50's layers
//! (three layers, fused route only, so CI stays fast): every graph plans deviceless on the H200
//! fixture, and a persistent cache restores the same rows in a second process-like pass.

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::resnet50::{plan_layers, resnet50_layers, GraphRow, PlanSource};
use cudnn_cbr::fusion::cbr::route_graphs;
use cudnn_cbr::fusion::Target;

/// A 3×3 stride-2 conv, a block output (apply + residual) and a 1×1 of the last stage.
const SUBSET: [&str; 3] = ["l2.conv2", "l3.conv3", "l4.b1.conv1"];

#[test]
fn a_resnet50_subset_plans_fused_on_the_h200() {
    let Some(_) = common::cudnn_or_skip("a_resnet50_subset_plans_fused_on_the_h200") else {
        return;
    };
    let target = Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap();
    let layers: Vec<_> = resnet50_layers(32)
        .into_iter()
        .filter(|(label, _)| SUBSET.contains(label))
        .collect();
    assert_eq!(layers.len(), SUBSET.len());
    let expected_rows: usize = layers
        .iter()
        .map(|(_, config)| route_graphs(config, true).len())
        .sum();

    let dir = std::env::temp_dir().join(format!("cudnn-cbr-resnet50-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = PlanCache::persistent(&dir).unwrap();
    println!("{}", GraphRow::table_header());
    let mut calls = 0;
    let report = plan_layers(&layers, &[true], &target, &cache, |row, done, total| {
        calls += 1;
        assert_eq!((done, total), (calls, expected_rows));
        println!("{}", row.table_line());
    });
    println!("{}", report.summary);
    assert_eq!(report.rows.len(), expected_rows);
    assert_eq!(
        report.summary.to_string(),
        "supported 3/3 fused, 0/0 unfused"
    );
    for row in &report.rows {
        let plan = row.outcome.as_ref().unwrap();
        assert!(row.fused, "{}", row.layer);
        assert_ne!(plan.source, PlanSource::Restored, "{}", row.layer);
        if plan.source == PlanSource::Built {
            let (reported, usable) = plan.configs.unwrap();
            assert!(usable >= 1 && reported >= usable, "{}", row.table_line());
            assert!(plan.engine.starts_with("eng"), "{}", row.table_line());
        }
        let json: serde_json::Value = serde_json::from_str(&row.json_line()).unwrap();
        assert_eq!(json["supported"], true);
        assert_eq!(json["layer"], row.layer);
    }

    // A fresh cache on the same folder restores every plan instead of building it.
    let again = PlanCache::persistent(&dir).unwrap();
    let second = plan_layers(&layers, &[true], &target, &again, |_, _, _| {});
    assert_eq!(second.summary, report.summary);
    assert_eq!(again.stats().built, 0);
    assert_eq!(again.stats().restored, cache.stats().built);
    for (a, b) in report.rows.iter().zip(&second.rows) {
        let (pa, pb) = (a.outcome.as_ref().unwrap(), b.outcome.as_ref().unwrap());
        assert_eq!((a.layer, a.role), (b.layer, b.role));
        assert_eq!(pa.workspace, pb.workspace, "{}", a.table_line());
        assert!(pb.configs.is_none());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
