//! A plan cache that cannot be poisoned (tier 2): a file holds only an engine choice, so an
//! edited one can at most pick another engine for our own graph; truncated, empty, garbage,
//! out-of-range and earlier-format files are moved aside and rebuilt; a failure record is only
//! a reason to plan again; a folder or file another user could write is not used; many
//! threads planning one graph into one folder lose nothing and fail nothing; a folder that
//! cannot be written or created degrades to memory with a warning.

mod common;

use cudnn_cbr::fusion::cache::{PlanCache, PlanKey};
use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
use cudnn_cbr::fusion::graph::Graph;
use cudnn_cbr::fusion::Target;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn h200() -> Target {
    Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap()
}

fn fresh_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cudnn-cbr-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A precompiled-engine graph (fast to build).
fn graph() -> Graph {
    graphs::conv_fprop(&ConvShape::square(8, 32, 16, 32, 3, 1, 1), true, true).0
}

/// The persisted file of `graph` on `target` in `dir`, after one build.
fn persisted(dir: &PathBuf, g: &Graph, target: &Target) -> PathBuf {
    PlanCache::persistent(dir)
        .unwrap()
        .get_or_build(g, target)
        .unwrap();
    dir.join(PlanKey::new(g.signature().unwrap(), target).file_name())
}

/// Rewrites the persisted document at `file`.
fn edit_doc(file: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let before = doc.clone();
    edit(&mut doc);
    assert_ne!(doc, before, "the edit changed nothing");
    std::fs::write(file, doc.to_string()).unwrap();
}

fn names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// A fresh cache on `dir` plans `g` after a bad file: the file was rejected with a reason
/// containing `needle`, moved aside, and the plan rebuilt (and restorable again).
fn assert_rejected_and_rebuilt(dir: &Path, g: &Graph, target: &Target, what: &str, needle: &str) {
    let cache = PlanCache::persistent(dir).unwrap();
    let plan = cache
        .get_or_build(g, target)
        .unwrap_or_else(|e| panic!("{what}: planning failed: {e}"));
    let s = cache.stats();
    assert_eq!(
        (s.rejected, s.built, s.restored),
        (1, 1, 0),
        "{what}: {s:?}"
    );
    let why = cache.rejections();
    assert!(
        why.len() == 1 && why[0].contains(needle),
        "{what}: expected `{needle}` in {why:?}"
    );
    // The rebuilt plan is the heuristics' plan of our graph.
    let heuristics = PlanCache::new().get_or_build(g, target).unwrap();
    assert_eq!(plan.engine_choice(), heuristics.engine_choice(), "{what}");
    assert!(
        names(dir).iter().any(|n| n.contains("rejected")),
        "{what}: {:?}",
        names(dir)
    );
    let again = PlanCache::persistent(dir).unwrap();
    again.get_or_build(g, target).unwrap();
    assert_eq!(
        again.stats().restored,
        1,
        "{what}: the rebuilt file restores"
    );
}

#[test]
fn bad_files_are_moved_aside_and_rebuilt() {
    let Some(_) = common::cudnn_or_skip("bad_files_are_moved_aside_and_rebuilt") else {
        return;
    };
    let target = h200();
    let g = graph();
    type Edit = fn(String) -> String;
    let edits: [(&str, Edit, &str); 12] = [
        (
            "truncated",
            |t| t[..t.len() / 2].to_string(),
            "not valid JSON",
        ),
        ("empty", |_| String::new(), "not valid JSON"),
        ("garbage", |_| "\u{0}\u{1}not json".into(), "not valid JSON"),
        ("not an object", |_| "[1, 2]".into(), "not a JSON object"),
        (
            "a key twice",
            |t| t.replacen('{', "{\"engine\":0,", 1),
            "duplicate key `engine`",
        ),
        (
            "no engine",
            |t| t.replacen("\"engine\"", "\"enigne\"", 1),
            "unknown field `enigne`",
        ),
        (
            "engine out of range",
            |t| edit_engine(t, "1000000"),
            "is not an engine of this graph",
        ),
        (
            "negative engine",
            |t| edit_engine(t, "-1"),
            "`engine` is not an engine index",
        ),
        (
            "engine not a number",
            |t| edit_engine(t, "\"2\""),
            "`engine` is not an engine index",
        ),
        (
            "unknown knob",
            |t| add_knob(t, 4_000_000, 1),
            "has no knob 4000000",
        ),
        (
            "knob twice",
            |t| {
                let doc: serde_json::Value = serde_json::from_str(&t).unwrap();
                let k = &doc["knobs"][0];
                add_knob(t, k["knob"].as_u64().unwrap(), k["value"].as_i64().unwrap())
            },
            "is given twice",
        ),
        (
            "knob value out of range",
            |t| {
                let mut doc: serde_json::Value = serde_json::from_str(&t).unwrap();
                doc["knobs"][0]["value"] = (1i64 << 40).into();
                doc.to_string()
            },
            "in steps of",
        ),
    ];
    for (what, edit, needle) in edits {
        let dir = fresh_dir("poison");
        let file = persisted(&dir, &g, &target);
        let text = std::fs::read_to_string(&file).unwrap();
        let bad = edit(text.clone());
        assert_ne!(bad, text, "{what}: the edit changed nothing");
        std::fs::write(&file, bad).unwrap();
        assert_rejected_and_rebuilt(&dir, &g, &target, what, needle);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn edit_engine(text: String, engine: &str) -> String {
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let from = format!("\"engine\":{}", doc["engine"]);
    assert!(text.contains(&from), "{from}");
    text.replacen(&from, &format!("\"engine\":{engine}"), 1)
}

fn add_knob(text: String, knob: u64, value: i64) -> String {
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let knobs = doc["knobs"].as_array_mut().unwrap();
    assert!(!knobs.is_empty(), "the conv's engine has knobs");
    knobs.push(serde_json::json!({"knob": knob, "value": value}));
    doc.to_string()
}

/// A file as an earlier version wrote it: cuDNN's plan JSON under a checksum. Whatever it
/// says (an edited alpha, math precision, virtual flag or dims, with the checksum recomputed
/// or not), it is an unknown format: nothing in it is run.
#[test]
fn an_earlier_versions_plan_file_is_rejected_whatever_it_says() {
    let Some(_) = common::cudnn_or_skip("an_earlier_versions_plan_file_is_rejected") else {
        return;
    };
    let target = h200();
    let g = graph();
    let honest = PlanCache::new()
        .get_or_build(&g, &target)
        .unwrap()
        .json()
        .unwrap();
    let key = PlanKey::new(g.signature().unwrap(), &target);
    let fnv = |b: &[u8]| {
        b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
            (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    for (what, from, to) in [
        ("unedited", "", ""),
        ("alpha", "\"alpha\":1.0", "\"alpha\":2.0"),
        (
            "math precision",
            "\"mathPrec\":\"CUDNN_DATA_FLOAT\"",
            "\"mathPrec\":\"CUDNN_DATA_HALF\"",
        ),
        (
            "virtual tensor",
            "\"isVirtual\":true",
            "\"isVirtual\":false",
        ),
        ("dims", "[8,32,16,16]", "[8,64,16,16]"),
    ] {
        assert!(honest.contains(from), "{what}: the plan JSON has no {from}");
        let plan = honest.replacen(from, to, 1);
        let dir = fresh_dir("old-format");
        std::fs::create_dir_all(&dir).unwrap();
        let doc = serde_json::json!({
            "signature": key.signature().text(),
            "target": key.target(),
            "graph": g.name(),
            "checksum": format!("{:016x}", fnv(plan.as_bytes())),
            "plan": plan,
        });
        std::fs::write(dir.join(key.file_name()), doc.to_string()).unwrap();
        assert_rejected_and_rebuilt(&dir, &g, &target, what, "unknown format");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The most an edited file can do: name another engine. One cuDNN refuses for the graph is
/// a rejected file; one it accepts gives a plan of our graph (our tensors, our operations),
/// run by that engine.
#[test]
fn an_edited_engine_index_can_only_pick_another_engine_for_our_graph() {
    use cudnn_cbr::fusion::backend::HeurMode;
    use cudnn_cbr::fusion::lower::OperationGraph;
    use cudnn_cbr::fusion::plan::{build_plans, plan_from_choice, EngineChoice, PlanPolicy};
    let Some(_) = common::cudnn_or_skip("an_edited_engine_index") else {
        return;
    };
    let target = h200();
    let g = graph();
    let built = PlanCache::new().get_or_build(&g, &target).unwrap();
    let op = OperationGraph::new(&g).unwrap();
    let count = cudnn_cbr::fusion::backend::engine_count(op.descriptor()).unwrap();
    let ours = built.engine_choice().unwrap().engine;
    let refused = (0..count)
        .find(|&engine| {
            let choice = EngineChoice {
                engine,
                knobs: Vec::new(),
            };
            plan_from_choice(&op, &target, &choice).is_err()
        })
        .expect("an engine cuDNN refuses for the conv");
    // What cuDNN accepts: any config the heuristics offer (another engine where there is
    // one, else the same engine with other knob values).
    let policy = PlanPolicy {
        modes: vec![HeurMode::A, HeurMode::B, HeurMode::Fallback],
        build_all: true,
        max_plans: None,
    };
    let others: Vec<EngineChoice> = build_plans(&op, &target, &policy)
        .unwrap()
        .iter()
        .filter_map(|p| p.engine_choice().cloned())
        .filter(|c| Some(c) != built.engine_choice())
        .collect();
    let accepted = others
        .iter()
        .find(|c| c.engine != ours)
        .or(others.first())
        .expect("another config cuDNN accepts for the conv")
        .clone();
    println!(
        "{count} engines; ours {ours}, refused {refused}, accepted {accepted:?} ({} other configs)",
        others.len()
    );

    let dir = fresh_dir("engine-refused");
    let file = persisted(&dir, &g, &target);
    edit_doc(&file, |d| {
        d["engine"] = refused.into();
        d["knobs"] = serde_json::json!([]);
    });
    assert_rejected_and_rebuilt(
        &dir,
        &g,
        &target,
        "refused engine",
        "does not plan the graph",
    );
    let _ = std::fs::remove_dir_all(&dir);

    let dir = fresh_dir("engine-accepted");
    let file = persisted(&dir, &g, &target);
    edit_doc(&file, |d| {
        d["engine"] = accepted.engine.into();
        d["knobs"] = accepted
            .knobs
            .iter()
            .map(|k| serde_json::json!({"knob": k.knob, "value": k.value}))
            .collect();
    });
    let cache = PlanCache::persistent(&dir).unwrap();
    let plan = cache.get_or_build(&g, &target).unwrap();
    let s = cache.stats();
    assert_eq!((s.restored, s.built, s.rejected), (1, 0, 0), "{s:?}");
    assert_eq!(plan.engine_choice(), Some(&accepted));
    assert_eq!(plan.engine_tag(), format!("eng{}", accepted.engine));
    // Our graph: the same real tensors, the same operation graph in cuDNN's own words.
    assert_eq!(plan.real_tensors(), built.real_tensors());
    let source = plan
        .source_graph()
        .expect("the restored plan keeps our graph");
    assert_eq!(source.signature().unwrap(), g.signature().unwrap());
    let ops = |p: &cudnn_cbr::fusion::plan::ExecutionPlan| {
        let v: serde_json::Value = serde_json::from_str(&p.json().unwrap()).unwrap();
        v["operationGraph"].clone()
    };
    assert!(!ops(&plan).is_null());
    assert!(
        ops(&plan) == ops(&built),
        "the restored plan runs other operations"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A failure record only makes the graph be planned again: a forged "no engine" for a graph
/// that plans is moved aside, and the plan is built.
#[test]
fn a_forged_failure_record_only_makes_the_graph_planned_again() {
    let Some(_) = common::cudnn_or_skip("a_forged_failure_record") else {
        return;
    };
    let target = h200();
    let g = graph();
    let key = PlanKey::new(g.signature().unwrap(), &target);
    for (what, doc, needle) in [
        (
            "forged",
            serde_json::json!({
                "format": "cudnn-cbr failure 2", "signature": key.signature().text(),
                "target": key.target(), "kind": "no_engine", "error": "forged",
            }),
            "records that the graph has no engine or plan, but it planned",
        ),
        (
            "earlier format",
            serde_json::json!({
                "signature": key.signature().text(), "target": key.target(),
                "checksum": "0", "error": "{}",
            }),
            "unknown format",
        ),
    ] {
        let dir = fresh_dir("forged-failure");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(key.failure_file_name()), doc.to_string()).unwrap();
        let cache = PlanCache::persistent(&dir).unwrap();
        cache
            .get_or_build(&g, &target)
            .unwrap_or_else(|e| panic!("{what}: the record was taken as the answer: {e}"));
        let s = cache.stats();
        assert_eq!(
            (s.built, s.rejected, s.failures, s.failure_hits),
            (1, 1, 0, 0),
            "{what}: {s:?}"
        );
        assert_eq!(
            s.failure_hints,
            u64::from(what == "forged"),
            "{what}: {s:?}"
        );
        let why = cache.rejections();
        assert!(why.iter().any(|w| w.contains(needle)), "{what}: {why:?}");
        assert!(!dir.join(key.failure_file_name()).exists(), "{what}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// As ssh with `~/.ssh`: a folder or file another user could write is not used.
#[test]
fn a_folder_or_file_others_can_write_is_not_used() {
    use std::os::unix::fs::PermissionsExt;
    let Some(_) = common::cudnn_or_skip("a_folder_or_file_others_can_write") else {
        return;
    };
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let chmod =
        |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    let target = h200();
    let g = graph();

    // Made private: a new folder 0700, its files 0600.
    let dir = fresh_dir("private").join("plans");
    let file = persisted(&dir, &g, &target);
    assert_eq!((mode(&dir), mode(&file)), (0o700, 0o600));

    // A file its group can write: rejected and rebuilt, the new file private again.
    chmod(&file, 0o660);
    assert_rejected_and_rebuilt(
        &dir,
        &g,
        &target,
        "group-writable file",
        "writable by its group",
    );
    assert_eq!(mode(&file), 0o600);

    // A folder its group can write: a warning, then memory only; planning works.
    chmod(&dir, 0o770);
    let cache = PlanCache::persistent(&dir).unwrap();
    assert_eq!(cache.dir(), None);
    let why = cache.refused().expect("the folder was used");
    assert!(
        why.contains("writable by its group") && why.contains("plans"),
        "{why}"
    );
    cache.get_or_build(&g, &target).unwrap();
    let s = cache.stats();
    assert_eq!((s.built, s.restored, s.write_failures), (1, 0, 0), "{s:?}");
    chmod(&dir, 0o700);
    // A folder above that others can write (not sticky) is refused too.
    let above = dir.parent().unwrap();
    chmod(above, 0o757);
    let cache = PlanCache::persistent(&dir).unwrap();
    assert!(
        cache.refused().unwrap().contains("writable by others"),
        "{:?}",
        cache.refused()
    );
    chmod(above, 0o755);

    // Another user's file or folder (only root can give one away).
    if running_as_root() {
        const NOBODY: u32 = 65534;
        std::os::unix::fs::chown(&file, Some(NOBODY), None).unwrap();
        assert_rejected_and_rebuilt(
            &dir,
            &g,
            &target,
            "another user's file",
            "owned by user 65534",
        );
        std::os::unix::fs::chown(&dir, Some(NOBODY), None).unwrap();
        let cache = PlanCache::persistent(&dir).unwrap();
        assert!(
            cache.refused().unwrap().contains("owned by user 65534"),
            "{:?}",
            cache.refused()
        );
        assert_eq!(cache.dir(), None);
    } else {
        println!("SKIP the other-owner cases: giving a file away needs root");
    }
    let _ = std::fs::remove_dir_all(above);
}

/// Whether this test runs as root (the owner of a file it creates).
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    let probe = fresh_dir("whoami");
    std::fs::write(&probe, b"").unwrap();
    let root = std::fs::metadata(&probe).unwrap().uid() == 0;
    let _ = std::fs::remove_file(&probe);
    root
}

#[test]
fn eight_threads_planning_one_graph_into_one_folder_all_succeed() {
    let Some(_) = common::cudnn_or_skip("eight_threads_planning_one_graph") else {
        return;
    };
    let target = Arc::new(h200());
    let dir = fresh_dir("threads");
    for round in 0..3 {
        let caches: Vec<_> = (0..8)
            .map(|_| Arc::new(PlanCache::persistent(&dir).unwrap()))
            .collect();
        let handles: Vec<_> = caches
            .iter()
            .map(|c| {
                let (c, t) = (c.clone(), target.clone());
                std::thread::spawn(move || c.get_or_build(&graph(), &t).map(|_| ()))
            })
            .collect();
        for h in handles {
            h.join()
                .unwrap()
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        for c in &caches {
            let s = c.stats();
            assert_eq!(
                (s.rejected, s.write_failures),
                (0, 0),
                "round {round}: {s:?}"
            );
        }
    }
    // No temporary file left behind, exactly one plan file.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_folder_that_cannot_be_written_keeps_plans_in_memory() {
    let Some(_) = common::cudnn_or_skip("a_folder_that_cannot_be_written") else {
        return;
    };
    let target = h200();
    // The folder vanishes after the cache was made (no permission bit would stop root).
    let dir = fresh_dir("vanished");
    let cache = PlanCache::persistent(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let p1 = cache.get_or_build(&graph(), &target).unwrap();
    let p2 = cache.get_or_build(&graph(), &target).unwrap();
    assert!(Arc::ptr_eq(&p1, &p2), "the built plan stays in memory");
    let s = cache.stats();
    assert_eq!((s.built, s.hits, s.write_failures), (1, 1, 1), "{s:?}");
    // A folder that cannot be created at all (a file is in the way): memory only, no error.
    let file = fresh_dir("in-the-way");
    std::fs::write(&file, b"a file").unwrap();
    let cache = PlanCache::persistent(file.join("plans")).unwrap();
    assert_eq!(cache.dir(), None);
    cache.get_or_build(&graph(), &target).unwrap();
    assert_eq!(
        cache.stats().write_failures,
        0,
        "nothing is written without a folder"
    );
    let _ = std::fs::remove_file(&file);
}

/// The main job's network at a small size, planned on the fused route with its fallbacks.
fn plan_mini(cache: &PlanCache, target: &Target) -> cudnn_cbr::fusion::Result<usize> {
    use cudnn_cbr::net::{compile, Preset, RoutePolicy};
    let spec = Preset::Mini.spec(8, 8, 16);
    let policy = RoutePolicy::Planned { target, cache };
    compile(&spec, 4, 16, &policy).map(|net| net.layers.len())
}

#[test]
fn two_processes_of_four_threads_plan_one_network_into_one_folder() {
    let Some(_) = common::cudnn_or_skip("two_processes_of_four_threads") else {
        return;
    };
    let dir = fresh_dir("processes");
    std::fs::create_dir_all(&dir).unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "cache_process_child",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("CACHE_CHILD_DIR", &dir)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn a planning process")
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains("CHILD OK"),
            "a planning process failed ({:?}):\n{stdout}\n{stderr}",
            out.status
        );
        assert!(!stderr.contains("warning: plan cache"), "{stderr}");
        println!(
            "{}",
            stdout.lines().find(|l| l.contains("CHILD OK")).unwrap()
        );
    }
    // Nothing lost, nothing corrupt: a fresh cache restores every plan, builds and rejects none.
    let files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files.iter().all(|f| f.ends_with(".plan.json")),
        "stray files (temporary or moved aside): {files:?}"
    );
    let cache = PlanCache::persistent(&dir).unwrap();
    plan_mini(&cache, &h200()).unwrap();
    let s = cache.stats();
    assert_eq!((s.built, s.rejected), (0, 0), "{s:?}");
    assert_eq!(
        s.restored as usize,
        files.len(),
        "{s:?} vs {} files",
        files.len()
    );
    println!(
        "two processes × four threads: {} plan files, all restored: {s:?}",
        files.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One of the two processes above (does nothing unless `CACHE_CHILD_DIR` is set): four
/// threads, each with its own cache on the shared folder, plan the network at once.
#[test]
fn cache_process_child() {
    let Some(dir) = std::env::var_os("CACHE_CHILD_DIR") else {
        return;
    };
    let target = Arc::new(h200());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (dir, target) = (dir.clone(), target.clone());
            std::thread::spawn(move || {
                let cache = PlanCache::persistent(&dir).unwrap();
                let layers = plan_mini(&cache, &target).unwrap();
                (layers, cache.stats())
            })
        })
        .collect();
    for t in threads {
        let (layers, s) = t.join().unwrap();
        assert_eq!((s.rejected, s.write_failures), (0, 0), "{s:?}");
        println!("CHILD OK: {layers} layers, {s:?}");
    }
}

#[test]
fn a_graph_without_an_engine_is_not_planned_again() {
    let Some(_) = common::cudnn_or_skip("a_graph_without_an_engine_is_not_planned_again") else {
        return;
    };
    // sm_50 passes the device checks, and cuDNN has no engine for its FP16 NHWC convs.
    let text = std::fs::read_to_string(&common::devprops_fixtures()[0].1).unwrap();
    let props = cudnn_cbr::fusion::DeviceProps::from_json(
        &text.replace("\"deviceVer\": 900", "\"deviceVer\": 500"),
    )
    .unwrap();
    let target = Target::deviceless(props).unwrap();
    let cache = PlanCache::new();
    let first = cache.get_or_build(&graph(), &target).unwrap_err();
    let t0 = std::time::Instant::now();
    let second = cache.get_or_build(&graph(), &target).unwrap_err();
    let again = t0.elapsed();
    assert_eq!(first.to_string(), second.to_string());
    let s = cache.stats();
    assert_eq!((s.built, s.failure_hits), (0, 1), "{s:?}");
    println!("no engine, remembered: {first}; the second lookup took {again:?}");
}

#[test]
fn a_parallel_prewarm_plans_what_the_compile_then_takes_from_the_cache() {
    use cudnn_cbr::fusion::cbr::RouteKind;
    use cudnn_cbr::net::{compile, prewarm, Preset, RoutePolicy};
    let Some(_) = common::cudnn_or_skip("a_parallel_prewarm_plans") else {
        return;
    };
    let target = h200();
    let cache = PlanCache::new();
    let spec = Preset::Mini.spec(8, 8, 16);
    let warm = prewarm(&spec, 4, 16, &[RouteKind::Fused], &target, &cache, 2).unwrap();
    assert_eq!(warm.threads, 2);
    assert!(warm.graphs > 10 && warm.planned == warm.graphs, "{warm:?}");
    let before = cache.stats();
    let policy = RoutePolicy::Planned {
        target: &target,
        cache: &cache,
    };
    let net = compile(&spec, 4, 16, &policy).unwrap();
    let after = cache.stats();
    // Every graph the compile needed was already planned by the parallel pass.
    assert_eq!(after.built, before.built, "{before:?} -> {after:?}");
    assert!(after.hits > before.hits);
    for l in &net.layers {
        assert_eq!(l.layer.route().kind(), RouteKind::Fused, "{}", l.name);
        assert_eq!(l.stored_input_why, None, "{}", l.name);
    }
    println!("prewarm: {warm:?}; compile after it: {after:?}");
}
