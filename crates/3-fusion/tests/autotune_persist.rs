//! Autotune in planning, deviceless (tier 2): a tuned choice persists with its timings and is
//! restored and used by a later cache; a tuned file whose record does not fit its engine is
//! rejected and rebuilt; autotuning without a device is a typed error; a recorded "no engine"
//! failure is only a reason to plan again, keyed with the target identity (and so the cuDNN
//! version).

use cudnn_cbr_fusion::autotune::{self, AutotuneOptions, CandidateTiming, PlanOptions, TuneRecord};
use cudnn_cbr_fusion::cache::{PlanCache, PlanKey};
use cudnn_cbr_fusion::cbr::{graphs, route_graphs, CbrConfig, CbrLayer, ConvShape, GraphRole};
use cudnn_cbr_fusion::graph::Graph;
use cudnn_cbr_fusion::lower::OperationGraph;
use cudnn_cbr_fusion::plan::{build_plans, ExecutionPlan, PlanPolicy};
use cudnn_cbr_fusion::{DeviceProps, Error, Target};
use std::path::{Path, PathBuf};

/// The H200 fixture: from the repository root (a bundled binary on the GPU machine runs in a
/// copy of the repository at another path), from this crate's folder (cargo runs tests
/// there), else where the test was built.
fn h200_path() -> PathBuf {
    const REL: &str = "tests/fixtures/devprops/h200-sm90.json";
    [PathBuf::from(REL), Path::new("../..").join(REL)]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(REL)
        })
}

/// cuDNN for a deviceless test: required under CI, else one SKIP line.
fn cudnn_or_skip(test: &str) -> bool {
    match cudnn_fe_sys::library() {
        Ok(_) => true,
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{test}: cuDNN is required when CI is set: {e}")
        }
        Err(e) => {
            let e = e.to_string();
            println!(
                "SKIP {test}: cuDNN not loadable ({})",
                e.lines().next().unwrap_or("")
            );
            false
        }
    }
}

fn h200() -> Target {
    Target::deviceless_from_file(h200_path()).unwrap()
}

/// The H200 document with edits: a target cuDNN has no engine for (sm_50), or another identity.
fn edited_target(edits: &[(&str, &str)]) -> Target {
    let mut text = std::fs::read_to_string(h200_path()).unwrap();
    for (from, to) in edits {
        assert!(text.contains(from), "the fixture has no {from}");
        text = text.replace(from, to);
    }
    Target::deviceless(DeviceProps::from_json(&text).unwrap()).unwrap()
}

fn fresh_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cudnn-cbr-autotune-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn file_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn config() -> CbrConfig {
    CbrConfig::new(ConvShape::square(8, 32, 16, 32, 3, 1, 1))
}

/// The layer's fused conv + statistics graph (heuristics offer it several configs).
fn conv_stats_graph() -> Graph {
    route_graphs(&config(), true)
        .into_iter()
        .find(|lg| lg.role == GraphRole::ConvStats)
        .unwrap()
        .graph
}

/// A candidate that is not the heuristics' default, recorded with made-up timings: the
/// candidates' plans (the chosen one removed), the chosen plan and its record.
struct Choice {
    first_json: String,
    chosen: ExecutionPlan,
    record: TuneRecord,
}

fn non_first_choice(graph: &Graph, target: &Target) -> Choice {
    let op = OperationGraph::new(graph).unwrap();
    let mut plans = build_plans(&op, target, &PlanPolicy::autotune(8)).unwrap();
    assert!(plans.len() >= 2, "{} candidate(s)", plans.len());
    let jsons: Vec<String> = plans.iter().map(|p| p.json().unwrap()).collect();
    // The last candidate that differs from the first: a restore of the default cannot pass.
    let k = (1..plans.len())
        .rev()
        .find(|&i| jsons[i] != jsons[0])
        .expect("a candidate other than the first");
    let winner_ms = 0.031_25_f32 * 7.0;
    let candidates = plans
        .iter()
        .enumerate()
        .map(|(i, p)| CandidateTiming {
            engine: p.engine_tag(),
            config_index: p.config_index(),
            time_ms: match i {
                _ if i == k => Some(winner_ms),
                1 if k != 1 => None, // one candidate "could not run"
                _ => Some(1.0 + i as f32 / 3.0),
            },
        })
        .collect();
    let chosen = plans.remove(k);
    let record = TuneRecord::for_plan(&chosen, winner_ms, candidates);
    Choice {
        first_json: jsons[0].clone(),
        chosen,
        record,
    }
}

#[test]
fn a_tuned_choice_is_restored_and_used_by_a_later_cache() {
    if !cudnn_or_skip("a_tuned_choice_is_restored_and_used_by_a_later_cache") {
        return;
    }
    let target = h200();
    let dir = fresh_dir("roundtrip");
    let graph = conv_stats_graph();
    let key = PlanKey::new(graph.signature().unwrap(), &target);
    let Choice {
        first_json,
        chosen,
        record,
    } = non_first_choice(&graph, &target);
    let (chosen_json, chosen_tag, chosen_index, chosen_ws) = (
        chosen.json().unwrap(),
        chosen.engine_tag(),
        chosen.config_index(),
        chosen.workspace_size(),
    );
    assert_ne!(chosen_index, 0);
    {
        let cache = PlanCache::persistent(&dir).unwrap();
        // Heuristics-first: the default planning takes the first config.
        let layer = CbrLayer::plan(config(), &target, &cache).unwrap();
        let heuristic = layer.plan_for(GraphRole::ConvStats).unwrap();
        assert_eq!(heuristic.json().unwrap(), first_json);
        assert_eq!(cache.tuned(&key), None);
        // Every other graph of the route gets a tuned record too (its heuristics plan), so the
        // autotune option can plan the whole layer from records below.
        for lg in route_graphs(&config(), true) {
            if lg.role == GraphRole::ConvStats {
                continue;
            }
            let op = OperationGraph::new(&lg.graph).unwrap();
            let plan = build_plans(&op, &target, &PlanPolicy::default())
                .unwrap()
                .remove(0);
            let r = TuneRecord::for_plan(&plan, 0.5, Vec::new());
            let k = PlanKey::new(lg.graph.signature().unwrap(), &target);
            cache.insert_tuned(k, plan, r).unwrap();
        }
        cache
            .insert_tuned(key.clone(), chosen, record.clone())
            .unwrap();
        assert_eq!(cache.tuned(&key), Some(record.clone()));
        assert_eq!(cache.stats().write_failures, 0);
    }

    // A later process: a fresh cache on the same folder, default (heuristics) planning.
    let cache = PlanCache::persistent(&dir).unwrap();
    let layer = CbrLayer::plan(config(), &target, &cache).unwrap();
    let s = cache.stats();
    assert_eq!((s.built, s.rejected, s.tuned), (0, 0, 0), "{s:?}");
    let plan = layer.plan_for(GraphRole::ConvStats).unwrap();
    let restored_json = plan.json().unwrap();
    assert_ne!(restored_json, first_json, "the heuristics' plan came back");
    assert_eq!(restored_json, chosen_json);
    assert_eq!(plan.engine_tag(), chosen_tag, "the engine is read back");
    assert_eq!(plan.config_index(), chosen_index);
    assert_eq!(plan.workspace_size(), chosen_ws);
    // The timings come back exactly, the failed candidate's included.
    let back = cache.tuned(&key).expect("the tune record is restored");
    assert_eq!(back, record);
    assert!(back.candidates.iter().any(|c| c.time_ms.is_none()));

    // Autotune planning on a deviceless target uses the records: no device, nothing built.
    let cache = PlanCache::persistent(&dir).unwrap();
    let opts = PlanOptions::Autotune(AutotuneOptions::default());
    let layer = CbrLayer::plan_with(config(), &target, &cache, &opts).unwrap();
    assert_eq!(layer.route().name(), "fused");
    let plan = layer.plan_for(GraphRole::ConvStats).unwrap();
    assert_eq!(plan.json().unwrap(), chosen_json);
    let s = cache.stats();
    assert_eq!(
        (s.built, s.tuned, s.restored),
        (0, 0, layer.plans().count() as u64),
        "{s:?}"
    );
    // A second lookup is a memory hit on the same plan.
    let again = cache
        .get_or_autotune(&graph, &target, &AutotuneOptions::default())
        .unwrap();
    assert!(std::sync::Arc::ptr_eq(&again, plan));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rewrites the persisted document of `key` in `dir`.
fn edit_doc(dir: &Path, key: &PlanKey, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(key.file_name());
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let before = doc.clone();
    edit(&mut doc);
    assert_ne!(doc, before, "the edit changed nothing");
    std::fs::write(&path, doc.to_string()).unwrap();
}

#[test]
fn a_tampered_tuned_file_is_moved_aside_and_rebuilt() {
    if !cudnn_or_skip("a_tampered_tuned_file_is_moved_aside_and_rebuilt") {
        return;
    }
    let target = h200();
    let graph = conv_stats_graph();
    let key = PlanKey::new(graph.signature().unwrap(), &target);
    type Edit = Box<dyn Fn(&mut serde_json::Value, &serde_json::Value)>;
    let edits: Vec<(&str, Edit, &str)> = vec![
        // The tuned engine swapped for the heuristics' one, its record left: the record must
        // name the file's engine and config.
        (
            "engine swapped",
            Box::new(|doc, first| {
                doc["engine"] = first["engine"].clone();
                doc["knobs"] = first["knobs"].clone();
                doc["config_index"] = first["config_index"].clone();
            }),
            "the tune record names",
        ),
        (
            "record names another engine",
            Box::new(|doc, _| doc["tune"]["engine"] = "eng999".into()),
            "the tune record names",
        ),
        (
            "negative time",
            Box::new(|doc, _| doc["tune"]["time_ms"] = (-1.0).into()),
            "finite, non-negative",
        ),
        (
            "record not an object",
            Box::new(|doc, _| doc["tune"] = "{}".into()),
            "`tune` is not an object",
        ),
    ];
    for (what, edit, needle) in edits {
        let dir = fresh_dir("tampered");
        // The heuristics' plan file, as the edits' source of another engine.
        PlanCache::persistent(&dir)
            .unwrap()
            .get_or_build(&graph, &target)
            .unwrap();
        let first_doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(key.file_name())).unwrap())
                .unwrap();
        let Choice {
            first_json,
            chosen,
            record,
        } = non_first_choice(&graph, &target);
        let chosen_json = chosen.json().unwrap();
        PlanCache::persistent(&dir)
            .unwrap()
            .insert_tuned(key.clone(), chosen, record)
            .unwrap();
        edit_doc(&dir, &key, |doc| edit(doc, &first_doc));

        let cache = PlanCache::persistent(&dir).unwrap();
        let plan = cache.get_or_build(&graph, &target).unwrap();
        let s = cache.stats();
        assert_eq!(
            (s.rejected, s.built, s.restored),
            (1, 1, 0),
            "{what}: {s:?}"
        );
        let why = cache.rejections();
        assert!(why.iter().any(|w| w.contains(needle)), "{what}: {why:?}");
        assert_eq!(cache.tuned(&key), None, "{what}: the record was trusted");
        assert_ne!(plan.json().unwrap(), chosen_json, "{what}");
        assert_eq!(
            plan.json().unwrap(),
            first_json,
            "{what}: not the heuristics' plan"
        );
        let names = file_names(&dir);
        assert!(
            names.iter().any(|n| n.contains("rejected")),
            "{what}: {names:?}"
        );
        // The rebuilt file is an untuned plan: autotuning without a device cannot use it.
        let err = PlanCache::persistent(&dir)
            .unwrap()
            .get_or_autotune(&graph, &target, &AutotuneOptions::default())
            .unwrap_err();
        assert!(
            matches!(err, Error::AutotuneNeedsDevice { .. }),
            "{what}: {err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn autotuning_on_a_deviceless_target_is_a_typed_error() {
    if !cudnn_or_skip("autotuning_on_a_deviceless_target_is_a_typed_error") {
        return;
    }
    let target = h200();
    let graph = conv_stats_graph();
    let op = OperationGraph::new(&graph).unwrap();
    let err = autotune::tune(&op, &target, &AutotuneOptions::default()).unwrap_err();
    match &err {
        Error::AutotuneNeedsDevice {
            graph: g,
            target: t,
        } => {
            assert_eq!(g, graph.name());
            assert_eq!(t, "NVIDIA H200");
        }
        other => panic!("expected AutotuneNeedsDevice, got {other}"),
    }
    assert!(err.to_string().contains("deviceless"), "{err}");
    // Options with nothing to time are refused before anything else.
    let none = AutotuneOptions {
        iters: 0,
        ..Default::default()
    };
    assert!(matches!(
        autotune::tune(&op, &target, &none),
        Err(Error::InvalidConfig { .. })
    ));

    // Layer planning: the typed error, not a fallback to another route, and nothing planned.
    let cache = PlanCache::new();
    let opts = PlanOptions::Autotune(AutotuneOptions::default());
    let err = CbrLayer::plan_with(config(), &target, &cache, &opts).unwrap_err();
    assert!(matches!(err, Error::AutotuneNeedsDevice { .. }), "{err}");
    let s = cache.stats();
    assert_eq!((s.built, s.tuned), (0, 0), "{s:?}");
    assert!(cache.is_empty());
    // The default stays heuristics-first and works deviceless.
    assert_eq!(PlanOptions::default(), PlanOptions::Heuristics);
    CbrLayer::plan_with(config(), &target, &cache, &PlanOptions::default()).unwrap();
    assert!(cache.stats().built > 0);
}

#[test]
fn a_record_that_does_not_fit_is_refused() {
    if !cudnn_or_skip("a_record_that_does_not_fit_is_refused") {
        return;
    }
    let target = h200();
    let graph = conv_stats_graph();
    let key = PlanKey::new(graph.signature().unwrap(), &target);
    let cache = PlanCache::new();
    let Choice { chosen, record, .. } = non_first_choice(&graph, &target);
    let wrong_index = TuneRecord {
        config_index: record.config_index + 100,
        ..record.clone()
    };
    let err = cache
        .insert_tuned(key.clone(), chosen, wrong_index)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    let Choice { chosen, record, .. } = non_first_choice(&graph, &target);
    let nan = TuneRecord {
        time_ms: f32::NAN,
        ..record
    };
    assert!(cache.insert_tuned(key.clone(), chosen, nan).is_err());
    assert!(cache.is_empty() && cache.tuned(&key).is_none());
}

/// sm_50 passes the document checks, and cuDNN has no engine for its FP16 NHWC convs.
fn sm50(extra: &[(&str, &str)]) -> Target {
    let mut edits = vec![("\"deviceVer\": 900", "\"deviceVer\": 500")];
    edits.extend_from_slice(extra);
    edited_target(&edits)
}

fn failing_graph() -> Graph {
    graphs::conv_fprop(&ConvShape::square(8, 32, 16, 32, 3, 1, 1), true, true).0
}

fn no_engine(e: &Error) -> bool {
    matches!(e, Error::NoEngine { .. } | Error::NoPlan { .. })
}

#[test]
fn a_persisted_failure_is_only_a_reason_to_plan_again() {
    if !cudnn_or_skip("a_persisted_failure_is_only_a_reason_to_plan_again") {
        return;
    }
    let dir = fresh_dir("failed");
    let target = sm50(&[]);
    let g = failing_graph();
    let key = PlanKey::new(g.signature().unwrap(), &target);
    let cache = PlanCache::persistent(&dir).unwrap();
    let first = cache.get_or_build(&g, &target).unwrap_err();
    assert!(no_engine(&first), "{first}");
    assert_eq!(cache.stats().failures, 1);
    assert!(
        dir.join(key.failure_file_name()).is_file(),
        "{:?}",
        file_names(&dir)
    );

    // A fresh cache (a later process): the record makes it plan again, and the fresh
    // failure is the answer.
    let cache = PlanCache::persistent(&dir).unwrap();
    let again = cache.get_or_build(&g, &target).unwrap_err();
    assert_eq!(again.to_string(), first.to_string());
    let s = cache.stats();
    assert_eq!(
        (
            s.failure_hints,
            s.failures,
            s.failure_hits,
            s.built,
            s.rejected
        ),
        (1, 1, 0, 0, 0),
        "{s:?}"
    );
    // Then from memory, without planning.
    cache.get_or_build(&g, &target).unwrap_err();
    let s = cache.stats();
    assert_eq!((s.failure_hits, s.failures), (1, 1), "{s:?}");
    // Autotuning checks the record with the heuristics: the fresh failure, not a "needs a
    // device" error.
    let cache = PlanCache::persistent(&dir).unwrap();
    let tuned = cache
        .get_or_autotune(&g, &target, &AutotuneOptions::default())
        .unwrap_err();
    assert_eq!(tuned.to_string(), first.to_string());
    let s = cache.stats();
    assert_eq!((s.failure_hints, s.failures), (1, 1), "{s:?}");

    // Another target identity (another SM count) is another key: planned without a hint,
    // and recorded in a file of its own.
    let other = sm50(&[(
        "\"multiProcessorCount\": 132",
        "\"multiProcessorCount\": 114",
    )]);
    let other_key = PlanKey::new(g.signature().unwrap(), &other);
    assert_ne!(other_key.failure_file_name(), key.failure_file_name());
    let cache = PlanCache::persistent(&dir).unwrap();
    assert!(no_engine(&cache.get_or_build(&g, &other).unwrap_err()));
    let s = cache.stats();
    assert_eq!((s.failure_hints, s.failures), (0, 1), "{s:?}");
    assert!(dir.join(other_key.failure_file_name()).is_file());
    // And a target with engines plans the graph.
    let cache = PlanCache::persistent(&dir).unwrap();
    cache.get_or_build(&g, &h200()).unwrap();
    assert_eq!((cache.stats().failure_hints, cache.stats().built), (0, 1));

    // A record under another cuDNN version (its identity in the file) is another key's:
    // planned without a hint, and the file rewritten for this version.
    let version = format!("cudnn{}", target.cudnn_version());
    assert!(key.target().contains(&version), "{}", key.target());
    let path = dir.join(key.failure_file_name());
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace(&version, "cudnn90000")).unwrap();
    let cache = PlanCache::persistent(&dir).unwrap();
    assert!(no_engine(&cache.get_or_build(&g, &target).unwrap_err()));
    assert_eq!(
        cache.stats().failure_hints,
        0,
        "another cuDNN's record was used"
    );
    assert!(std::fs::read_to_string(&path).unwrap().contains(&version));

    // A malformed record is moved aside and the graph planned again.
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    doc["kind"] = "maybe".into();
    std::fs::write(&path, doc.to_string()).unwrap();
    let cache = PlanCache::persistent(&dir).unwrap();
    assert!(no_engine(&cache.get_or_build(&g, &target).unwrap_err()));
    let s = cache.stats();
    assert_eq!(
        (s.failure_hints, s.failures, s.rejected),
        (0, 1, 1),
        "{s:?}"
    );
    assert!(cache.rejections()[0].contains("no known kind"));
    assert!(file_names(&dir).iter().any(|n| n.contains("rejected")));
    let _ = std::fs::remove_dir_all(&dir);
}
