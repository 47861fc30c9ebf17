//! fusion's GPU tier on the simulated CUDA device: `tests/gpu_own_kernels.rs`,
//! `tests/gpu_cbr_parity.rs`, `tests/gpu_network.rs` and `tests/gpu_conv.rs` (included
//! unchanged as modules) run
//! again in a child of this binary with the simulator selected (`CUDNN_CBR_DEVICE=sim`, its
//! folder first on the loader path, docs/simulator.md). There cuDNN plans are built deviceless
//! for the simulator's device-properties document and each plan execution runs the plan's
//! graph in the graph interpreter (`fusion::interp`) over the simulator's allocations, while
//! our own kernels run their program text compiled for the host; every test compares against
//! the CPU executor. The child must pass every test and print no SKIP line. Without the
//! simulator selected the included tests print their SKIP lines, as on any machine without a
//! GPU.

// Each included file declares `mod common;`.
#![allow(clippy::duplicate_mod)]

#[path = "gpu_cbr_parity.rs"]
mod gpu_cbr_parity;
#[path = "gpu_conv.rs"]
mod gpu_conv;
#[path = "gpu_network.rs"]
mod gpu_network;
#[path = "gpu_own_kernels.rs"]
mod gpu_own_kernels;
#[path = "../amp/tests/sim/mod.rs"]
mod sim;

use std::process::Command;

/// The included modules' tests, counted from their sources.
fn included_tests() -> usize {
    [
        include_str!("gpu_cbr_parity.rs"),
        include_str!("gpu_conv.rs"),
        include_str!("gpu_network.rs"),
        include_str!("gpu_own_kernels.rs"),
    ]
    .iter()
    .map(|s| s.matches("#[test]").count())
    .sum()
}

/// Runs the included tests in a child with the simulator in `dir` selected (in the
/// adversarial stream order when asked) and asserts they all passed without a SKIP.
fn run_on_the_simulator(dir: &std::path::Path, adversarial: bool) {
    let mode = if adversarial { "adversarial" } else { "eager" };
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let mut child = Command::new(std::env::current_exe().expect("this test binary"));
    child
        .args([
            "gpu_cbr_parity::",
            "gpu_conv::",
            "gpu_network::",
            "gpu_own_kernels::",
            "--test-threads",
            "1",
        ])
        .env("CUDNN_CBR_DEVICE", "sim")
        .env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()))
        .env("CUDNN_CBR_KERNEL_CACHE", dir.join("kernel-cache"))
        .env("CUDNN_CBR_SIM_CACHE", dir.join("host-cache"));
    if adversarial {
        child.env("CUDNN_CBR_SIM_ADVERSARIAL", "1");
    }
    let out = child
        .output()
        .expect("run fusion's GPU tests under the simulator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{mode} stream order:\n{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "fusion's GPU tests failed on the simulator ({mode})"
    );
    assert!(
        !stdout.contains("SKIP"),
        "a GPU test skipped on the simulator ({mode})"
    );
    let tests = included_tests();
    assert!(tests >= 5, "the included files have {tests} tests");
    assert!(
        stdout.contains(&format!("test result: ok. {tests} passed")),
        "expected all {tests} GPU tests to pass ({mode})"
    );
}

/// Eagerly and in the adversarial stream order (each stream's work deferred until something
/// needs it: a missing event join would read stale data), every included test passes.
#[test]
fn fusion_gpu_tests_pass_on_the_simulated_device() {
    if std::env::var_os("CUDNN_CBR_DEVICE").is_some() {
        // The child run itself (this test is filtered out there), or a run that already
        // selected a device: the included tests are what runs.
        return;
    }
    let Some(dir) = sim::built("fusion_gpu_tests_pass_on_the_simulated_device") else {
        return;
    };
    run_on_the_simulator(&dir, false);
    run_on_the_simulator(&dir, true);
}
