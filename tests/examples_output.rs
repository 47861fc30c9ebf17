//! An example whose reader goes away (`cargo run --example … | head -1`) ends quietly: no
//! panic on the closed pipe (each prints through `examples/out/mod.rs`).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// Runs `name args`, reads its first line of output, closes the pipe and returns the first
/// line, the exit code and the error output.
fn first_line_then_close(name: &str, args: &[&str]) -> (String, Option<i32>, String) {
    let mut child = Command::new(common::example(name))
        .args(args)
        .current_dir(common::repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the example");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut first)
        .expect("read the first line");
    // The reader is dropped here: the example's next line meets a closed pipe.
    let out = child.wait_with_output().expect("wait for the example");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (first, out.status.code(), stderr)
}

fn assert_quiet_end(name: &str, args: &[&str], first_starts: &str) {
    if common::cudnn_or_skip(name).is_none() {
        return;
    }
    let (first, code, stderr) = first_line_then_close(name, args);
    assert!(
        first.starts_with(first_starts),
        "{name}: first line `{first}`, expected `{first_starts}…`"
    );
    assert!(!stderr.contains("panicked"), "{name} panicked:\n{stderr}");
    assert_eq!(code, Some(0), "{name} {args:?}:\n{stderr}");
}

#[test]
fn deviceless_plans_ends_quietly_on_a_closed_pipe() {
    // Its first line is the header; a table of every layer follows.
    assert_quiet_end(
        "deviceless_plans",
        &["--net", "resnet18", "--batch", "2", "--hw", "32"],
        "resnet18 plans:",
    );
}

#[test]
fn custom_trainer_ends_quietly_on_a_closed_pipe() {
    // One line per step, then the summary.
    assert_quiet_end(
        "custom_trainer",
        &["--device", "cpu", "--steps", "40"],
        "step    0",
    );
}

#[test]
fn deviceless_smoke_ends_quietly_on_a_closed_pipe() {
    // The cuDNN version line, then a line per fixture.
    assert_quiet_end("deviceless_smoke", &[], "cuDNN ");
}

#[test]
fn fuzz_graphs_ends_quietly_on_a_closed_pipe() {
    // The totals line, then a table of outcomes.
    assert_quiet_end("fuzz_graphs", &["--cases", "30"], "fuzz_graphs: 30 cases");
}
