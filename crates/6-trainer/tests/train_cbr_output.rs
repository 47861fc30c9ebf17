//! `train_cbr` whose reader goes away (`train_cbr | head -1`, or its error output's) ends
//! quietly: no panic on the closed pipe.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// The `train_cbr` binary beside this test's.
fn train_cbr() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    [
        dir.join("../examples/train_cbr"),
        dir.join("example-train_cbr"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("train_cbr is built (`cargo build --workspace --examples`)")
}

#[test]
fn a_closed_output_pipe_ends_the_run_without_a_panic() {
    let mut child = Command::new(train_cbr())
        .args(["--device", "cpu", "--steps", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader is dropped here: the run's next line meets a closed pipe.
    assert!(first.starts_with("train_cbr"), "first line: {first}");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

#[test]
fn an_error_on_a_closed_error_pipe_still_exits_with_its_code() {
    // A checkpoint that is not there: `train_cbr: --resume …: …` on stderr, exit 1. With the
    // stderr reader gone that line meets a closed pipe; the run must still exit 1, not
    // panic (exit 101).
    let missing = std::env::temp_dir().join(format!("cbr-missing-{}.st", std::process::id()));
    let mut child = Command::new(train_cbr())
        .args(["--device", "cpu", "--steps", "2", "--resume"])
        .arg(&missing)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
