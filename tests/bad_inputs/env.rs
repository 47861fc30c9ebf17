//! Bad inputs: environment variables, launcher environments and rendezvous files.

use super::*;

pub(super) fn launch_err(
    vars: &'static [(&'static str, &'static str)],
    var: &str,
    needle: &str,
) -> Verdict {
    let e = LaunchEnv::from_vars(|n| {
        vars.iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.to_string())
    })
    .unwrap_err();
    assert!(
        matches!(&e, DistError::Bootstrap { var: v, problem, .. } if v == var && problem.contains(needle)),
        "{e:?}"
    );
    typed(e)
}

/// Rank 1's read of a rendezvous file at `path` (given `bytes`, or prepared by `make`) is
/// refused at once, saying `needle`.
pub(super) fn rendezvous_err(tag: &str, make: fn(&Path), needle: &str) -> Verdict {
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rendezvous");
    make(&path);
    let start = std::time::Instant::now();
    let e = read_id_file::<128>(&path, 2, std::time::Duration::from_secs(30)).unwrap_err();
    assert!(start.elapsed().as_secs() < 10, "{:?}", start.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        matches!(&e, DistError::Store { problem, .. } if problem.contains(needle)),
        "{e:?}"
    );
    typed(e)
}

pub(super) fn env_rows() -> Vec<Row> {
    vec![
        ("launcher env", "no launcher's rank variable", || {
            launch_err(&[], "RANK", "no launcher environment found")
        }),
        ("launcher env", "RANK without WORLD_SIZE", || {
            launch_err(&[("RANK", "0")], "WORLD_SIZE", "the world size is missing")
        }),
        ("launcher env", "WORLD_SIZE 0", || {
            launch_err(
                &[("RANK", "0"), ("WORLD_SIZE", "0")],
                "WORLD_SIZE",
                "at least one rank",
            )
        }),
        ("launcher env", "RANK 5 of WORLD_SIZE 2", || {
            launch_err(
                &[("RANK", "5"), ("WORLD_SIZE", "2")],
                "RANK",
                "not below the world size 2",
            )
        }),
        ("launcher env", "RANK not a number", || {
            launch_err(
                &[("RANK", "first"), ("WORLD_SIZE", "2")],
                "RANK",
                "not a non-negative integer",
            )
        }),
        ("launcher env", "LOCAL_WORLD_SIZE above WORLD_SIZE", || {
            launch_err(
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "3"),
                ],
                "LOCAL_WORLD_SIZE",
                "must be in 1..=2",
            )
        }),
        (
            "launcher env",
            "LOCAL_RANK not below LOCAL_WORLD_SIZE",
            || {
                launch_err(
                    &[
                        ("RANK", "0"),
                        ("WORLD_SIZE", "4"),
                        ("LOCAL_RANK", "2"),
                        ("LOCAL_WORLD_SIZE", "2"),
                    ],
                    "LOCAL_RANK",
                    "local rank is not below",
                )
            },
        ),
        ("launcher env", "MASTER_PORT 0", || {
            launch_err(
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "localhost"),
                    ("MASTER_PORT", "0"),
                ],
                "MASTER_PORT",
                "not a port number",
            )
        }),
        (
            "launcher env",
            "an MPI world size that is not a number",
            || {
                launch_err(
                    &[
                        ("OMPI_COMM_WORLD_RANK", "0"),
                        ("OMPI_COMM_WORLD_SIZE", "two"),
                    ],
                    "OMPI_COMM_WORLD_SIZE",
                    "not a non-negative integer",
                )
            },
        ),
        (
            "rendezvous",
            "a FIFO as the rendezvous file (was: a hang)",
            || {
                rendezvous_err(
                    "rdv-fifo",
                    mkfifo,
                    "is a FIFO (named pipe), not a regular file",
                )
            },
        ),
        ("rendezvous", "a folder as the rendezvous file", || {
            rendezvous_err(
                "rdv-folder",
                |p| std::fs::create_dir_all(p).unwrap(),
                "is a folder, not a regular file",
            )
        }),
        ("rendezvous", "a file too short for its header", || {
            rendezvous_err(
                "rdv-short",
                |p| std::fs::write(p, b"CBR").unwrap(),
                "3 bytes: too short for the header",
            )
        }),
        ("rendezvous", "a file of another program", || {
            rendezvous_err(
                "rdv-magic",
                |p| std::fs::write(p, [b'x'; 150]).unwrap(),
                "bad magic",
            )
        }),
        (
            "rendezvous",
            "a file written for another world size",
            || {
                rendezvous_err(
                    "rdv-world",
                    |p| write_id_file(p, 3, &[7; 128]).unwrap(),
                    "written for world size 3, this rank has 2",
                )
            },
        ),
        ("rendezvous", "a file with a 16-byte id", || {
            rendezvous_err(
                "rdv-len",
                |p| write_id_file(p, 2, &[7; 16]).unwrap(),
                "holds a 16-byte id",
            )
        }),
        (
            "rendezvous",
            "a 1 MiB file (read no further than a header and an id)",
            || {
                rendezvous_err(
                    "rdv-huge",
                    |p| {
                        write_id_file(p, 2, &[7; 128]).unwrap();
                        let mut b = std::fs::read(p).unwrap();
                        b.resize(1 << 20, 0);
                        std::fs::write(p, b).unwrap();
                    },
                    "in 151 bytes, expected 128 bytes",
                )
            },
        ),
        ("dist timeout", "CUDNN_CBR_DIST_TIMEOUT=soon", || {
            let e = parse_timeout(Some("soon")).unwrap_err();
            assert!(
                e.contains("`soon`; expected a positive number of seconds"),
                "{e}"
            );
            Verdict::Typed(e)
        }),
        ("dist timeout", "CUDNN_CBR_DIST_TIMEOUT=0", || {
            let e = parse_timeout(Some("0")).unwrap_err();
            assert!(e.contains("`0`; expected a positive number"), "{e}");
            Verdict::Typed(e)
        }),
        ("dist timeout", "CUDNN_CBR_DIST_TIMEOUT=inf", || {
            let e = parse_timeout(Some("inf")).unwrap_err();
            assert!(e.contains("`inf`; expected a positive number"), "{e}");
            Verdict::Typed(e)
        }),
        ("pointwise env", "CUDNN_CBR_POINTWISE=fast", || {
            let e = Pointwise::parse(Some("fast")).unwrap_err();
            invalid_field(&e, "CUDNN_CBR_POINTWISE");
            assert!(e.to_string().contains("expected `own` or `cudnn`"), "{e}");
            typed(e)
        }),
    ]
}
