//! An example whose reader goes away (`cargo run --example … | head -1`, or `2>&1 | head -1`)
//! ends quietly: no panic on the closed pipe, standard output or error output (each prints
//! through `examples/out/mod.rs`, the library's warnings through `runtime::stderr`).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// `name args` started from the repository root, both outputs piped.
fn spawn(name: &str, args: &[&str]) -> std::process::Child {
    Command::new(common::example(name))
        .args(args)
        .current_dir(common::repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the example")
}

/// Runs `name args`, reads its first line of output, closes the pipe and returns the first
/// line, the exit code and the error output.
fn first_line_then_close(name: &str, args: &[&str]) -> (String, Option<i32>, String) {
    let mut child = spawn(name, args);
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut first)
        .expect("read the first line");
    // The reader is dropped here: the example's next line meets a closed pipe.
    let out = child.wait_with_output().expect("wait for the example");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (first, out.status.code(), stderr)
}

/// Runs `name args` with its error output's reader gone from the start, and returns the
/// exit code and the standard output.
fn run_with_stderr_closed(name: &str, args: &[&str]) -> (Option<i32>, String) {
    let mut child = spawn(name, args);
    // Every later line on stderr meets a closed pipe (a panic's own message too, so the exit
    // code is what tells: 101 for a panic).
    drop(child.stderr.take());
    let out = child.wait_with_output().expect("wait for the example");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
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

#[test]
fn deviceless_plans_and_the_plan_cache_warn_quietly_on_a_closed_stderr() {
    if common::cudnn_or_skip("deviceless_plans").is_none() {
        return;
    }
    // A plan-cache folder under a regular file cannot be made: the library warns on stderr
    // (`warning: plan cache: … plans stay in memory only`), and the example's progress lines
    // (`prewarm: …`, `planning mini on the fused route…`) follow; all meet the closed pipe.
    let file = std::env::temp_dir().join(format!("cbr-not-a-folder-{}", std::process::id()));
    std::fs::write(&file, b"").expect("write a plain file");
    let cache = file.join("plan-cache");
    let cache = cache.to_str().expect("a UTF-8 temp path");
    let (code, stdout) = run_with_stderr_closed(
        "deviceless_plans",
        &[
            "--net", "mini", "--batch", "2", "--hw", "16", "--cache", cache,
        ],
    );
    let _ = std::fs::remove_file(&file);
    assert_eq!(code, Some(0), "stdout:\n{stdout}");
    // The run went on to its table after the failed writes.
    assert!(stdout.starts_with("mini plans:"), "stdout:\n{stdout}");
    assert!(stdout.contains("fused"), "stdout:\n{stdout}");
}
