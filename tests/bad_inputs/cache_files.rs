//! Bad inputs: plan cache files and folders (recoveries: the plan is rebuilt, nothing escapes).

use super::*;

pub(super) fn scratch(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("cudnn-cbr-bad-inputs-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub(super) fn small_graph() -> Graph {
    conv_graph(
        [2, 16, 8, 8],
        [16, 16, 3, 3],
        ConvAttrs::default().padding(1),
    )
}

/// Persists the small graph's plan in a fresh folder, edits the file, and plans again.
pub(super) fn cache_after_edit(tag: &str, edit: fn(String) -> String) -> Verdict {
    if common::cudnn_or_skip("cache rows").is_none() {
        return Verdict::Recovered("SKIP (no cuDNN)".into());
    }
    let dir = scratch(tag);
    let target = h200();
    let g = small_graph();
    PlanCache::persistent(&dir)
        .unwrap()
        .get_or_build(&g, &target)
        .unwrap();
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, edit(text)).unwrap();
    let cache = PlanCache::persistent(&dir).unwrap();
    cache
        .get_or_build(&g, &target)
        .expect("the plan is rebuilt");
    let s = cache.stats();
    assert_eq!((s.built, s.restored), (1, 0), "{s:?}");
    // And the rebuilt file restores.
    let again = PlanCache::persistent(&dir).unwrap();
    again.get_or_build(&g, &target).unwrap();
    assert_eq!(again.stats().restored, 1);
    let _ = std::fs::remove_dir_all(&dir);
    Verdict::Recovered(if s.rejected == 1 {
        "rebuilt; the bad file was moved aside".to_string()
    } else {
        "rebuilt; the file (another key) was overwritten".to_string()
    })
}

pub(super) fn cache_rows() -> Vec<Row> {
    vec![
        ("plan cache", "a truncated file", || {
            cache_after_edit("trunc", |t| t[..t.len() / 3].into())
        }),
        ("plan cache", "an empty file", || {
            cache_after_edit("empty", |_| String::new())
        }),
        ("plan cache", "binary garbage", || {
            cache_after_edit("garbage", |_| "\u{0}\u{ff}\u{7}".into())
        }),
        (
            "plan cache",
            "an earlier version's file (cuDNN's plan JSON)",
            || {
                // What an edit of alpha, precision or dims used to go through: now an unknown
                // format, whatever it says.
                cache_after_edit("old-format", |t| {
                    let mut v: serde_json::Value = serde_json::from_str(&t).unwrap();
                    v.as_object_mut().unwrap().remove("format");
                    v["plan"] = "{\"operationGraph\":{}}".into();
                    v.to_string()
                })
            },
        ),
        ("plan cache", "a file for another target", || {
            cache_after_edit("target", |t| t.replacen("NVIDIA H200", "NVIDIA A100", 1))
        }),
        ("plan cache", "a file from another cuDNN version", || {
            cache_after_edit("version", |t| {
                let v: serde_json::Value = serde_json::from_str(&t).unwrap();
                let target = v["target"].as_str().unwrap();
                let mut v = v.clone();
                v["target"] = format!("{target}-cudnn90100").into();
                v.to_string()
            })
        }),
        ("plan cache", "a folder that vanished (writes fail)", || {
            if common::cudnn_or_skip("cache rows").is_none() {
                return Verdict::Recovered("SKIP (no cuDNN)".into());
            }
            let dir = scratch("vanish");
            let cache = PlanCache::persistent(&dir).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
            cache.get_or_build(&small_graph(), &h200()).unwrap();
            cache.get_or_build(&small_graph(), &h200()).unwrap();
            let s = cache.stats();
            assert_eq!((s.built, s.hits, s.write_failures), (1, 1, 1), "{s:?}");
            Verdict::Recovered("plan kept in memory, one write failure counted".into())
        }),
        ("plan cache", "a folder that cannot be created", || {
            if common::cudnn_or_skip("cache rows").is_none() {
                return Verdict::Recovered("SKIP (no cuDNN)".into());
            }
            let file = scratch("file-in-the-way");
            std::fs::write(&file, b"x").unwrap();
            let cache = PlanCache::persistent(file.join("plans")).unwrap();
            assert_eq!(cache.dir(), None);
            cache.get_or_build(&small_graph(), &h200()).unwrap();
            let _ = std::fs::remove_file(&file);
            Verdict::Recovered("memory-only cache".into())
        }),
    ]
}
