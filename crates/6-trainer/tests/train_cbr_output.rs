//! `train_cbr` whose reader goes away (`train_cbr | head -1`) ends quietly: no panic on the
//! closed pipe.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[test]
fn a_closed_output_pipe_ends_the_run_without_a_panic() {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let bin = [
        dir.join("../examples/train_cbr"),
        dir.join("example-train_cbr"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("train_cbr is built (`cargo build --workspace --examples`)");
    let mut child = Command::new(bin)
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
