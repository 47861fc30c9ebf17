//! Bad inputs: library files that are not regular files (a FIFO used to block the process for good).

use super::*;

pub(super) fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let made = Command::new("mkfifo").arg(path).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
}

/// `load_from(path)` is refused at once, the attempt naming `path` and `why`.
pub(super) fn load_refused(path: &Path, why: &str) -> Verdict {
    let e = load_from(path).unwrap_err();
    let shown = path.display().to_string();
    assert!(
        matches!(&e, LoadError::NotFound { attempts }
            if attempts[0].candidate == shown && attempts[0].reason == why),
        "{e:?}"
    );
    typed(e)
}

/// NCCL from `candidates` is refused, one attempt saying `why`.
pub(super) fn nccl_refused(candidates: &[NcclCandidate], why: &str) -> Verdict {
    let e = NcclLibrary::open_first(candidates).unwrap_err();
    match &e {
        DistError::NcclUnavailable { tried } => {
            assert!(tried.iter().any(|t| t.contains(why)), "{tried:?}")
        }
        other => panic!("{other:?}"),
    }
    Verdict::Typed(e.to_string().replace('\n', " "))
}

pub(super) fn library_rows() -> Vec<Row> {
    vec![
        (
            "loader",
            "a FIFO given as libcudnn.so.9 (was: a hang)",
            || {
                let dir = scratch("fifo-main");
                std::fs::create_dir_all(&dir).unwrap();
                let fifo = dir.join("libcudnn.so.9");
                mkfifo(&fifo);
                let v = load_refused(&fifo, "is a FIFO (named pipe), not a regular file");
                let _ = std::fs::remove_dir_all(&dir);
                v
            },
        ),
        ("loader", "a folder given as libcudnn.so.9", || {
            let dir = scratch("folder-main").join("libcudnn.so.9");
            std::fs::create_dir_all(&dir).unwrap();
            load_refused(&dir, "is a folder, not a regular file")
        }),
        ("loader", "/dev/null given as the library", || {
            load_refused(
                Path::new("/dev/null"),
                "is a character device, not a regular file",
            )
        }),
        ("loader", "a FIFO as libcudnn.so.9 in CUDNN_LIB_DIR", || {
            let dir = scratch("fifo-lib-dir");
            std::fs::create_dir_all(&dir).unwrap();
            mkfifo(&dir.join("libcudnn.so.9"));
            let e = SearchPaths {
                lib_dir: Some(dir.clone()),
                system_loader: false,
                site_packages: vec![],
            }
            .load()
            .unwrap_err();
            let _ = std::fs::remove_dir_all(&dir);
            assert!(
                matches!(&e, LoadError::NotFound { attempts }
                    if attempts[0].reason == "is a FIFO (named pipe), not a regular file"),
                "{e:?}"
            );
            typed(e)
        }),
        (
            "loader",
            "a FIFO as libcudnn_graph.so.9 beside cuDNN",
            || in_child("fifo_graph", "libcudnn_graph.so.9").expect_says("is a FIFO"),
        ),
        (
            "loader",
            "a folder as libcudnn_heuristic.so.9 beside cuDNN",
            || in_child("folder_heuristic", "libcudnn_heuristic.so.9").expect_says("is a folder"),
        ),
        ("loader", "a FIFO as libcuda.so.1 beside cuDNN", || {
            in_child("fifo_driver", "libcuda.so.1").expect_says("is a FIFO")
        }),
        ("nccl", "a FIFO given as the library (was: a hang)", || {
            let dir = scratch("fifo-nccl");
            std::fs::create_dir_all(&dir).unwrap();
            let fifo = dir.join("libnccl.so.2");
            mkfifo(&fifo);
            let v = nccl_refused(
                &[NcclCandidate::Path(fifo)],
                "libnccl.so.2: is a FIFO (named pipe), not a regular file",
            );
            let _ = std::fs::remove_dir_all(&dir);
            v
        }),
        ("nccl", "CUDNN_CBR_NCCL naming a FIFO", || {
            let dir = scratch("fifo-nccl-env");
            std::fs::create_dir_all(&dir).unwrap();
            let fifo = dir.join("nccl-pipe");
            mkfifo(&fifo);
            let shown = fifo.display().to_string();
            let c = nccl_candidates(|v| (v == NCCL_PATH_ENV).then(|| shown.clone()), &[]);
            assert_eq!(c[0], NcclCandidate::Path(fifo.clone()));
            let v = nccl_refused(&c[..1], &format!("{shown}: is a FIFO"));
            let _ = std::fs::remove_dir_all(&dir);
            v
        }),
        (
            "nccl",
            "NCCL_LIB_DIR holding a FIFO named libnccl.so.2",
            || {
                let dir = scratch("fifo-nccl-dir");
                std::fs::create_dir_all(&dir).unwrap();
                mkfifo(&dir.join("libnccl.so.2"));
                let shown = dir.display().to_string();
                let c = nccl_candidates(|v| (v == NCCL_LIB_DIR_ENV).then(|| shown.clone()), &[]);
                let v = nccl_refused(&c[..2], "libnccl.so.2: is a FIFO");
                let _ = std::fs::remove_dir_all(&dir);
                v
            },
        ),
        ("nccl", "a folder named libnccl.so.2", || {
            let dir = scratch("folder-nccl").join("libnccl.so.2");
            std::fs::create_dir_all(&dir).unwrap();
            nccl_refused(
                &[NcclCandidate::Path(dir)],
                "is a folder, not a regular file",
            )
        }),
        ("nccl", "a text file named libnccl.so.2", || {
            let dir = scratch("text-nccl");
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join("libnccl.so.2");
            std::fs::write(&file, "not a library\n".repeat(10)).unwrap();
            nccl_refused(&[NcclCandidate::Path(file)], "no ELF magic number")
        }),
        ("nccl", "a library that is not NCCL", || {
            let libm = cudnn_cbr::runtime::preflight::resolve_by_name("libm.so.6").unwrap();
            nccl_refused(&[NcclCandidate::Path(libm)], "missing ncclGetVersion")
        }),
        ("nccl", "no candidate places at all", || {
            nccl_refused(&[], "(no candidate places)")
        }),
    ]
}
