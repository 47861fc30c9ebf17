//! Evaluation mode on the trainer's CUDA executor with every layer on the unfused route, on the
//! simulated CUDA device (docs/simulator.md): this binary runs itself again with the simulator
//! selected, as `sim_train.rs` does. The unfused route's BN forward is cuDNN's training-mode
//! NormForward; in evaluation our `cbr_bn_eval` kernel normalizes with the running statistics
//! instead, so the held-out accuracy is measured in evaluation mode as on the CPU executor.

#[path = "../../3-amp/tests/sim/mod.rs"]
mod sim;

use cudnn_cbr_trainer::{train, Device, TrainConfig};
use std::process::Command;

const CHILD: &str = "CUDNN_CBR_SIM_CUDA_EVAL_CHILD";

fn cfg(device: Device) -> TrainConfig {
    TrainConfig {
        steps: 8,
        batch: 16,
        fused: false,
        device,
        ..TrainConfig::default()
    }
}

#[test]
fn the_unfused_route_evaluates_in_eval_mode_like_the_cpu_executor() {
    let test = "the_unfused_route_evaluates_in_eval_mode_like_the_cpu_executor";
    if std::env::var_os(CHILD).is_some() {
        let r = train(&cfg(Device::Cuda), 1, |_| {}).expect("CUDA training on the simulator");
        println!("EXECUTOR {}", r.executor.detail);
        println!("HELD {} {}", r.held_out_accuracy, r.held_out_eval_mode);
        for l in &r.step_losses {
            println!("LOSS {l}");
        }
        return;
    }
    let Some(dir) = sim::built(test) else {
        return;
    };
    let out = sim::select(
        &mut Command::new(std::env::current_exe().expect("this test binary")),
        &dir,
    )
    .args([test, "--exact", "--nocapture"])
    .env(CHILD, "1")
    .output()
    .expect("run the test under the simulator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the simulated run failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let executor = stdout
        .lines()
        .find_map(|l| l.strip_prefix("EXECUTOR "))
        .unwrap_or_else(|| panic!("no executor line:\n{stdout}"));
    // Every layer on the unfused route, on the simulated device, the whole step replayed.
    assert!(executor.contains("simulated"), "{executor}");
    assert!(
        !executor.contains("fused)") && executor.contains("unfused"),
        "{executor}"
    );
    assert!(
        executor.contains("whole step replayed as one CUDA graph"),
        "{executor}"
    );
    let (acc, eval_mode) = stdout
        .lines()
        .find_map(|l| l.strip_prefix("HELD "))
        .and_then(|l| l.split_once(' '))
        .map(|(a, m)| (a.parse::<f32>().unwrap(), m == "true"))
        .unwrap_or_else(|| panic!("no held-out line:\n{stdout}"));
    let cpu = train(&cfg(Device::Cpu), 1, |_| {}).unwrap();
    println!(
        "held-out accuracy (eval mode, unfused route): simulated cuda {acc}, cpu {}",
        cpu.held_out_accuracy
    );
    assert!(eval_mode && cpu.held_out_eval_mode);
    // As sim_train.rs: 8 batches of 16, two images of 128 may flip between the executors;
    // training-mode BN (the batch's statistics) instead of the running ones moves it by more.
    assert!(
        (acc - cpu.held_out_accuracy).abs() <= 2.0 / 128.0 + 1e-6,
        "simulated {acc} vs cpu {}",
        cpu.held_out_accuracy
    );
    let losses: Vec<f32> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("LOSS "))
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(losses.len(), cpu.step_losses.len());
    // sim_train.rs's tolerance (measured there at most 1e-4 relative over 8 steps).
    for (s, c) in losses.iter().zip(&cpu.step_losses) {
        assert!((s - c).abs() / c.abs() < 1e-3, "{s} vs {c}");
    }
}
