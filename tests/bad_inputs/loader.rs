//! Bad inputs: the loader (each in a child process: these faults used to kill the process).

use super::*;

pub(super) fn cudnn_dir() -> Option<PathBuf> {
    let lib = common::cudnn_or_skip("loader rows")?;
    Some(Path::new(lib.path()).parent()?.to_path_buf())
}

pub(super) fn loader_rows() -> Vec<Row> {
    vec![
        ("loader", "a folder without cuDNN", || {
            let dir = scratch("no-cudnn");
            std::fs::create_dir_all(&dir).unwrap();
            let e = SearchPaths {
                lib_dir: Some(dir),
                system_loader: false,
                site_packages: vec![],
            }
            .load()
            .unwrap_err();
            assert!(
                matches!(&e, LoadError::NotFound { attempts } if attempts[0].reason == "no such file"),
                "{e:?}"
            );
            typed(e)
        }),
        ("loader", "a library without cuDNN's symbols", || {
            let e = load_from("libm.so.6").unwrap_err();
            assert!(e.to_string().contains("cudnnGetVersion"), "{e}");
            typed(e)
        }),
        ("loader", "a text file named libcudnn.so.9", || {
            in_child("text_file", "ELF magic")
        }),
        ("loader", "a truncated libcudnn.so.9", || {
            in_child("truncated_main", "truncated")
        }),
        ("loader", "libcudnn.so.9 without its sub-libraries", || {
            in_child("no_sublibraries", "libcudnn_graph.so.9 is missing")
        }),
        ("loader", "a truncated sub-library", || {
            in_child("truncated_graph", "truncated")
        }),
        (
            "loader",
            "a foreign library under libcudnn_graph.so.9 (aborted in cuDNN's version call)",
            || {
                in_child("foreign_graph", "libcudnn_graph.so.9 at")
                    .expect_says("does not define cudnnGetVersion")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn_heuristic.so.9 (was: every layer unfused)",
            || {
                in_child("foreign_heuristic", "libcudnn_heuristic.so.9 at")
                    .expect_says("dummyHeuristicSymbol")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn_engines_precompiled.so.9",
            || {
                in_child(
                    "foreign_precompiled",
                    "libcudnn_engines_precompiled.so.9 at",
                )
                .expect_says("dummyBackendEnginesPreCompiledSymbol")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn_engines_runtime_compiled.so.9",
            || {
                in_child(
                    "foreign_runtime_compiled",
                    "libcudnn_engines_runtime_compiled.so.9 at",
                )
                .expect_says("dummyBackendEnginesRuntimeCompiledSymbol")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn.so.9 (checked before dlopen)",
            || {
                in_child(
                    "foreign_main",
                    "not cuDNN: it does not define cudnnGetVersion",
                )
            },
        ),
        (
            "loader",
            "no libcuda.so.1 (was blamed on the device properties)",
            || {
                in_child(
                    "no_driver",
                    "the CUDA driver library libcuda.so.1 is missing",
                )
            },
        ),
        ("loader", "a truncated libcuda.so.1 beside cuDNN", || {
            in_child("truncated_driver", "libcuda.so.1 at").expect_says("truncated")
        }),
    ]
}

pub(super) trait ExpectSays {
    /// The typed error's text also says `needle`.
    fn expect_says(self, needle: &str) -> Verdict;
}

impl ExpectSays for Verdict {
    fn expect_says(self, needle: &str) -> Verdict {
        if let Verdict::Typed(text) = &self {
            assert!(
                text.starts_with("SKIP") || text.contains(needle),
                "`{needle}` not in: {text}"
            );
        }
        self
    }
}

/// Runs a loader fault in a child process with no loader path, so nothing outside the
/// prepared folder can stand in; asserts the child exited normally and printed `needle`.
pub(super) fn in_child(case: &str, needle: &str) -> Verdict {
    if cudnn_dir().is_none() {
        return Verdict::Typed("SKIP (no cuDNN to build the faulty folder from)".into());
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "loader::loader_fault_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("BAD_INPUTS_CHILD", case)
        .env("BAD_INPUTS_CUDNN_DIR", cudnn_dir().unwrap())
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("CUDNN_LIB_DIR")
        .output()
        .expect("spawn the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.code() == Some(0),
        "child {case} did not exit normally ({:?}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("CHILD ").map(|(_, v)| v))
        .unwrap_or_else(|| panic!("child {case} printed no verdict:\n{stdout}"));
    assert!(line.contains(needle), "child {case}: {line}");
    Verdict::Typed(line.to_string())
}

/// The child half of the loader rows (does nothing unless `BAD_INPUTS_CHILD` is set).
#[test]
pub(super) fn loader_fault_child() {
    let Some(case) = std::env::var_os("BAD_INPUTS_CHILD") else {
        return;
    };
    let src = PathBuf::from(std::env::var_os("BAD_INPUTS_CUDNN_DIR").unwrap());
    let dir = scratch(&format!("child-{}", case.to_string_lossy()));
    std::fs::create_dir_all(&dir).unwrap();
    let main = dir.join("libcudnn.so.9");
    let bytes = || std::fs::read(src.join("libcudnn.so.9")).unwrap();
    let link = |name: &str| std::os::unix::fs::symlink(src.join(name), dir.join(name)).unwrap();
    // A complete shared object for this machine that is not cuDNN (the C math library).
    let foreign = |name: &str| {
        let libm = cudnn_cbr::runtime::preflight::resolve_by_name("libm.so.6").expect("libm.so.6");
        std::fs::copy(libm, dir.join(name)).unwrap();
    };
    let subs = [
        "libcudnn_graph.so.9",
        "libcudnn_heuristic.so.9",
        "libcudnn_engines_precompiled.so.9",
        "libcudnn_engines_runtime_compiled.so.9",
    ];
    // The main library and every sub-library but `odd`, which `foreign` replaces.
    let all_but = |odd: &str| {
        link("libcudnn.so.9");
        for name in subs.iter().filter(|n| **n != odd) {
            link(name);
        }
    };
    match case.to_str().unwrap() {
        "foreign_graph" => {
            all_but(subs[0]);
            foreign(subs[0]);
        }
        "foreign_heuristic" => {
            all_but(subs[1]);
            foreign(subs[1]);
        }
        "foreign_precompiled" => {
            all_but(subs[2]);
            foreign(subs[2]);
        }
        "foreign_runtime_compiled" => {
            all_but(subs[3]);
            foreign(subs[3]);
        }
        "foreign_main" => foreign("libcudnn.so.9"),
        // The child runs without LD_LIBRARY_PATH, so the stand-in driver is out of reach.
        "no_driver" => all_but(""),
        "truncated_driver" => {
            all_but("");
            std::fs::write(dir.join("libcuda.so.1"), &bytes()[..4096]).unwrap();
        }
        "text_file" => std::fs::write(&main, "this is not a library\n".repeat(8)).unwrap(),
        "truncated_main" => std::fs::write(&main, &bytes()[..bytes().len() * 2 / 3]).unwrap(),
        "no_sublibraries" => std::fs::write(&main, bytes()).unwrap(),
        "truncated_graph" => {
            std::fs::write(&main, bytes()).unwrap();
            let graph = std::fs::read(src.join("libcudnn_graph.so.9")).unwrap();
            std::fs::write(dir.join("libcudnn_graph.so.9"), &graph[..graph.len() / 2]).unwrap();
            for name in [
                "libcudnn_heuristic.so.9",
                "libcudnn_engines_precompiled.so.9",
                "libcudnn_engines_runtime_compiled.so.9",
            ] {
                link(name);
            }
        }
        "fifo_graph" => {
            all_but(subs[0]);
            mkfifo(&dir.join(subs[0]));
        }
        "folder_heuristic" => {
            all_but(subs[1]);
            std::fs::create_dir_all(dir.join(subs[1])).unwrap();
        }
        "fifo_driver" => {
            all_but("");
            mkfifo(&dir.join("libcuda.so.1"));
        }
        other => panic!("unknown child case {other}"),
    }
    let result = load_from(&main);
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Ok(lib) => println!("CHILD loaded?! {lib:?}"),
        Err(e) => println!("CHILD {}", e.to_string().replace('\n', " ")),
    }
}
