//! The trainer's CUDA executor on the simulated CUDA device (docs/simulator.md): this binary
//! runs itself again with the simulator selected (`CUDNN_CBR_DEVICE=sim`, its folder first on
//! the loader path), where `train` on `Device::Cuda` runs the mini network with the whole
//! step captured into one CUDA graph after the warm-up steps and replayed (cuDNN plan
//! executions recorded as host nodes that run the graph interpreter at each replay). The
//! per-step losses must match the CPU executor's on the same data and initial weights.

#[path = "../../amp/tests/sim/mod.rs"]
mod sim;

use cudnn_cbr_trainer::{train, Device, ExecutorKind, TrainConfig};
use std::process::Command;

/// Set in the child run.
const CHILD: &str = "CUDNN_CBR_SIM_TRAIN_CHILD";

/// 3 eager warm-up steps, then 5 replays of the captured step.
fn cfg(device: Device) -> TrainConfig {
    TrainConfig {
        steps: 8,
        batch: 16,
        device,
        ..TrainConfig::default()
    }
}

#[test]
fn the_whole_step_captured_on_the_simulator_matches_the_cpu_executor() {
    if std::env::var_os(CHILD).is_some() {
        // The child: train on the simulated device and print what the parent checks.
        let r = train(&cfg(Device::Cuda), 1, |_| {}).expect("CUDA training on the simulator");
        println!("EXECUTOR {:?} | {}", r.executor.kind, r.executor.detail);
        for l in &r.step_losses {
            println!("LOSS {l}");
        }
        return;
    }
    let test = "the_whole_step_captured_on_the_simulator_matches_the_cpu_executor";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .args([test, "--exact", "--nocapture"])
        .env(CHILD, "1")
        .env("CUDNN_CBR_DEVICE", "sim")
        .env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()))
        .env("CUDNN_CBR_KERNEL_CACHE", dir.join("kernel-cache"))
        .env("CUDNN_CBR_SIM_CACHE", dir.join("host-cache"))
        .output()
        .expect("run the trainer under the simulator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the simulated run failed:\n{stdout}\n{stderr}"
    );
    let executor = stdout
        .lines()
        .find_map(|l| l.strip_prefix("EXECUTOR "))
        .unwrap_or_else(|| panic!("no executor line:\n{stdout}\n{stderr}"));
    println!("{executor}");
    // The simulated CUDA device ran it (not the CPU fallback), with the whole step replayed.
    assert!(
        executor.starts_with(&format!("{:?}", ExecutorKind::Cuda))
            && executor.contains("simulated"),
        "{executor}"
    );
    assert!(
        executor.contains("whole step replayed as one CUDA graph"),
        "{executor}"
    );
    let sim_losses: Vec<f32> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("LOSS "))
        .map(|v| v.parse().expect("a loss"))
        .collect();
    let cpu = train(&cfg(Device::Cpu), 1, |_| {}).expect("CPU training");
    assert_eq!(cpu.executor.kind, ExecutorKind::Cpu);
    assert_eq!(sim_losses.len(), cpu.step_losses.len(), "{stdout}");
    // Both store FP16 activations and gradients and compute in FP32; they differ in the order
    // of FP32 sums (the CPU executor's loops against the interpreter's f64-then-FP32 sums and
    // the kernels' block reductions), a few FP32 ulps per sum that FP16 storage mostly
    // absorbs. Measured on this configuration: at most 1e-4 relative per step over 8 steps
    // (6.8e-4 over 30 steps at batch 32). 1e-3 leaves room for that drift and still fails on
    // any wrong binding, stale replay or skipped plan, which moves a loss by percents.
    for (step, (s, c)) in sim_losses.iter().zip(&cpu.step_losses).enumerate() {
        let rel = (s - c).abs() / c.abs().max(1e-6);
        println!(
            "step {}: simulated cuda {s:.6}, cpu {c:.6}, relative {rel:.2e}",
            step + 1
        );
        assert!(rel < 1e-3, "step {}: simulated {s} vs cpu {c}", step + 1);
    }
}
