//! A plan cache that cannot be poisoned (tier 2): tampered, truncated, empty and garbage files
//! are moved aside and rebuilt; many threads planning one graph into one folder lose nothing
//! and fail nothing; a folder that cannot be written or created degrades to memory with a
//! warning.

mod common;

use cudnn_cbr::fusion::cache::{PlanCache, PlanKey};
use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
use cudnn_cbr::fusion::graph::Graph;
use cudnn_cbr::fusion::Target;
use std::path::PathBuf;
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

#[test]
fn bad_files_are_moved_aside_and_rebuilt() {
    let Some(_) = common::cudnn_or_skip("bad_files_are_moved_aside_and_rebuilt") else {
        return;
    };
    let target = h200();
    let g = graph();
    type Edit = fn(String) -> String;
    let edits: [(&str, Edit); 6] = [
        // The attack: tensor dims edited 32 → 64 (the checksum recomputed would not
        // help either: the tensor check catches it, see below).
        ("tampered dims", |t| {
            t.replacen("[8,32,16,16]", "[8,64,16,16]", 1)
        }),
        ("truncated", |t| t[..t.len() / 2].to_string()),
        ("empty", |_| String::new()),
        ("garbage", |_| "\u{0}\u{1}not json".into()),
        ("no plan", |t| t.replacen("\"plan\"", "\"nalp\"", 1)),
        ("bad checksum", |t| {
            let i = t.find("\"checksum\":\"").unwrap() + 12;
            let mut t = t;
            t.replace_range(i..i + 1, if &t[i..i + 1] == "0" { "1" } else { "0" });
            t
        }),
    ];
    for (what, edit) in edits {
        let dir = fresh_dir("poison");
        let file = persisted(&dir, &g, &target);
        let text = std::fs::read_to_string(&file).unwrap();
        let bad = edit(text.clone());
        assert_ne!(bad, text, "{what}: the edit changed nothing");
        std::fs::write(&file, bad).unwrap();
        let cache = PlanCache::persistent(&dir).unwrap();
        cache
            .get_or_build(&g, &target)
            .unwrap_or_else(|e| panic!("{what}: planning failed: {e}"));
        let s = cache.stats();
        assert_eq!((s.rejected, s.built, s.restored), (1, 1, 0), "{what}");
        // The bad file is kept aside for inspection, and a good one is back in place.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().any(|n| n.contains("rejected")),
            "{what}: {names:?}"
        );
        let again = PlanCache::persistent(&dir).unwrap();
        again.get_or_build(&g, &target).unwrap();
        assert_eq!(
            again.stats().restored,
            1,
            "{what}: the rebuilt file restores"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_plan_whose_tensors_differ_from_the_graph_is_rejected_even_with_a_valid_checksum() {
    let Some(_) = common::cudnn_or_skip("a_plan_whose_tensors_differ") else {
        return;
    };
    let target = h200();
    let g = graph();
    let dir = fresh_dir("tensors");
    let file = persisted(&dir, &g, &target);
    // Rewrite the plan with edited dims and a checksum recomputed for the edit: only the
    // comparison with the graph's tensors can catch it.
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let plan = doc["plan"]
        .as_str()
        .unwrap()
        .replacen("[8,32,16,16]", "[8,64,16,16]", 1);
    let fnv = |b: &[u8]| {
        b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
            (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    doc["checksum"] = format!("{:016x}", fnv(plan.as_bytes())).into();
    doc["plan"] = plan.into();
    std::fs::write(&file, doc.to_string()).unwrap();
    let cache = PlanCache::persistent(&dir).unwrap();
    cache.get_or_build(&g, &target).unwrap();
    assert_eq!((cache.stats().rejected, cache.stats().built), (1, 1));
    let _ = std::fs::remove_dir_all(&dir);
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
