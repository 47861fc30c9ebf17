//! The trainer's CUDA executor on the simulated CUDA device (docs/simulator.md): this binary
//! runs itself again with the simulator selected (`CUDNN_CBR_DEVICE=sim`, its folder first on
//! the loader path), where `train` on `Device::Cuda` runs the mini network with the whole
//! step captured into one CUDA graph after the warm-up steps and replayed (cuDNN plan
//! executions recorded as host nodes that run the graph interpreter at each replay). The
//! per-step losses must match the CPU executor's on the same data and initial weights.
//!
//! It also holds the trainer's GPU tier (`crates/6-trainer/tests/gpu_train.rs`, included unchanged as a
//! module) and runs it in a child on the simulator: every test passes there, and the only SKIP
//! is the no-CUDA test's, which needs a machine without a device. Without the simulator
//! selected the included tests print their SKIP lines, as on any machine without a GPU.

// gpu_train.rs declares `mod gpu_shapes;` by path; included unchanged.
#![allow(clippy::duplicate_mod)]

#[path = "gpu_train.rs"]
mod gpu_train;
#[path = "../../3-amp/tests/sim/mod.rs"]
mod sim;

use cudnn_cbr::net::Arena;
use cudnn_cbr::net::Preset;
use cudnn_cbr_trainer::{train, Device, ExecutorKind, TrainConfig};
use std::process::Command;

/// Set in a child run (each child runs one test of this binary, `--exact`).
const CHILD: &str = "CUDNN_CBR_SIM_TRAIN_CHILD";

/// Whether this process is a child run on the simulated device.
fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// The child's side: trains `cfg` and prints what the parent reads (`EXECUTOR`, `HELD` and
/// one `LOSS` line per step).
fn train_and_print(cfg: &TrainConfig) {
    let r = train(cfg, 1, |_| {}).expect("CUDA training on the simulator");
    println!("EXECUTOR {:?} | {}", r.executor.kind, r.executor.detail);
    println!("HELD {} {}", r.held_out_accuracy, r.held_out_eval_mode);
    println!("HASH {:016x}", r.weights.hash());
    for l in &r.step_losses {
        println!("LOSS {l}");
    }
}

/// What a child run printed.
struct Child {
    stdout: String,
    stderr: String,
}

impl Child {
    /// The `EXECUTOR` line's text.
    fn executor(&self) -> &str {
        self.stdout
            .lines()
            .find_map(|l| l.strip_prefix("EXECUTOR "))
            .unwrap_or_else(|| panic!("no executor line:\n{}\n{}", self.stdout, self.stderr))
    }

    /// The `LOSS` lines' values, in order.
    fn losses(&self) -> Vec<f32> {
        self.stdout
            .lines()
            .filter_map(|l| l.strip_prefix("LOSS "))
            .map(|v| v.parse().expect("a loss"))
            .collect()
    }
}

/// Runs `test` again in a child on the simulator built in `dir`, with `envs` set, and asserts
/// that it exited 0.
fn run_child(test: &str, dir: &std::path::Path, envs: &[(&str, &std::ffi::OsStr)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
    sim::select(&mut cmd, dir)
        .args([test, "--exact", "--nocapture"])
        .env(CHILD, "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the test under the simulator");
    let child = Child {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        out.status.success(),
        "the simulated run failed:\n{}\n{}",
        child.stdout,
        child.stderr
    );
    child
}

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
    if in_child() {
        return train_and_print(&cfg(Device::Cuda));
    }
    let test = "the_whole_step_captured_on_the_simulator_matches_the_cpu_executor";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let child = run_child(test, &dir, &[]);
    let stdout = &child.stdout;
    let executor = child.executor();
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
    let sim_losses = child.losses();
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
    // The held-out accuracy, BN in evaluation mode on both executors (the device's
    // eval-mode coefficients from its running statistics, CudaNet::evaluate_with).
    let held = stdout
        .lines()
        .find_map(|l| l.strip_prefix("HELD "))
        .and_then(|l| l.split_once(' '))
        .unwrap_or_else(|| panic!("no held-out line:\n{stdout}"));
    let (sim_acc, sim_eval): (f32, bool) = (held.0.parse().unwrap(), held.1.parse().unwrap());
    println!(
        "held-out accuracy (eval mode): simulated cuda {sim_acc}, cpu {}",
        cpu.held_out_accuracy
    );
    assert!(sim_eval && cpu.held_out_eval_mode);
    // 8 batches of 16: an image whose two top logits are within the executors' rounding
    // differences may flip; two of 128 (1.6%) allows that, a wrong coefficient or a
    // training-mode BN moves it by far more (or not at all: then it matches exactly).
    assert!(
        (sim_acc - cpu.held_out_accuracy).abs() <= 2.0 / 128.0 + 1e-6,
        "simulated {sim_acc} vs cpu {}",
        cpu.held_out_accuracy
    );
}

/// The SKIP line the included no-CUDA test prints where CUDA is usable.
const NO_CUDA_SKIP: &str =
    "SKIP without_cuda_the_cuda_device_is_a_typed_error_and_auto_says_why: CUDA is usable here";

#[test]
fn the_trainers_gpu_tests_pass_on_the_simulated_device() {
    if std::env::var_os("CUDNN_CBR_DEVICE").is_some() {
        return;
    }
    let Some(dir) = sim::built("the_trainers_gpu_tests_pass_on_the_simulated_device") else {
        return;
    };
    let out = sim::select(
        &mut Command::new(std::env::current_exe().expect("this test binary")),
        &dir,
    )
    .args(["gpu_train::", "--test-threads", "1", "--nocapture"])
    .output()
    .expect("run the trainer's GPU tests under the simulator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "the trainer's GPU tests failed on the simulator"
    );
    // (With --nocapture a SKIP line may follow the harness's "test … ... " on its line.)
    let skips: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.find("SKIP ").map(|i| &l[i..]))
        .collect();
    assert_eq!(
        skips,
        [NO_CUDA_SKIP],
        "only the no-CUDA test may skip on the simulator"
    );
    let tests = include_str!("gpu_train.rs").matches("#[test]").count();
    assert!(tests >= 5, "gpu_train.rs has {tests} tests");
    assert!(
        stdout.contains(&format!("test result: ok. {tests} passed")),
        "expected all {tests} GPU tests to run"
    );
}

/// ResNet-18 at 32×32, batch 2: 3 eager warm-up steps, then one replay of the whole step.
fn resnet18(device: Device) -> TrainConfig {
    TrainConfig {
        net: Preset::ResNet18,
        hw: 32,
        batch: 2,
        steps: 4,
        device,
        ..TrainConfig::default()
    }
}

/// A real ResNet (7×7/2 stem, max-pool, four stages of basic blocks with projections) trains
/// on the simulated device with the whole step replayed. Its losses are not compared with the
/// CPU executor's: at batch 2 the last stage normalizes over 2 values per channel, where one
/// FP16 rounding of either value moves the variance by a large factor. Measured against an
/// f64 CPU executor on the same inputs, the FP16 CPU executor's own saved inverse standard
/// deviations of that stage are 0.65 relative L2 away and the simulated device's 0.46, while
/// through stage 2 the two FP16 executors agree ten times more closely than either does with
/// f64 (docs/simulator.md). The per-buffer comparison of such a network at 8 values per channel
/// is tests/gpu_network.rs's pooled network, run on the simulator by tests/sim_gpu_fusion.rs.
#[test]
fn a_resnet18_step_is_captured_and_replayed_on_the_simulator() {
    if in_child() {
        return train_and_print(&resnet18(Device::Cuda));
    }
    let test = "a_resnet18_step_is_captured_and_replayed_on_the_simulator";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let child = run_child(test, &dir, &[]);
    let executor = child.executor();
    println!("{executor}");
    assert!(
        executor.starts_with(&format!("{:?}", ExecutorKind::Cuda))
            && executor.contains("simulated")
            && executor.contains("whole step replayed as one CUDA graph"),
        "{executor}"
    );
    let losses = child.losses();
    println!("losses {losses:?}");
    assert_eq!(losses.len(), 4, "{}", child.stdout);
    // Eight classes: a loss from initial weights is near ln 8 ≈ 2.08, and any wrong binding
    // that reads NaN-filled fresh memory (the simulator's allocations start as NaN) shows as a
    // NaN or infinite loss.
    assert!(
        losses.iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );
    assert!((losses[0] - 8f32.ln()).abs() < 1.5, "{losses:?}");
}

/// The mini network (eager warm-up, then the whole step replayed) and ResNet-18 (stem,
/// max-pool, projections) with the network's buffers in the liveness-planned tensor arena
/// and with one allocation each: the same losses and the same weights bit for bit, and the
/// held-out accuracy (evaluation mode reads the arena too). The simulator checks every
/// binding of every plan execution and kernel launch against its allocation, and flags a
/// graph whose output overlaps an input.
#[test]
fn the_shared_arena_on_the_simulator_gives_the_same_bits_as_separate_buffers() {
    let runs = |arena| {
        [
            TrainConfig {
                arena,
                ..cfg(Device::Cuda)
            },
            TrainConfig {
                arena,
                ..resnet18(Device::Cuda)
            },
        ]
    };
    if in_child() {
        let arena = match std::env::var("CUDNN_CBR_TEST_ARENA").as_deref() {
            Ok("separate") => Arena::Separate,
            _ => Arena::Shared,
        };
        for c in runs(arena) {
            train_and_print(&c);
        }
        return;
    }
    let test = "the_shared_arena_on_the_simulator_gives_the_same_bits_as_separate_buffers";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let var = "CUDNN_CBR_TEST_ARENA";
    let shared = run_child(test, &dir, &[(var, "shared".as_ref())]);
    let separate = run_child(test, &dir, &[(var, "separate".as_ref())]);
    let lines = |c: &Child, tag: &str| -> Vec<String> {
        c.stdout
            .lines()
            .filter(|l| l.starts_with(tag))
            .map(str::to_owned)
            .collect()
    };
    for tag in ["LOSS ", "HASH ", "HELD "] {
        let (a, b) = (lines(&shared, tag), lines(&separate, tag));
        println!("{tag}shared {a:?}\n{tag}separate {b:?}");
        assert!(!a.is_empty(), "{}", shared.stdout);
        assert_eq!(a, b, "{tag}: the layouts differ");
    }
    assert_eq!(lines(&shared, "HASH ").len(), 2);
    assert!(
        shared.executor().contains("whole step replayed"),
        "{}",
        shared.stdout
    );
    // The layouts really differ: the shared run's buffers are in the tensor arena.
    assert!(
        shared.executor().contains("shared arena of"),
        "{}",
        shared.executor()
    );
    assert!(
        separate.executor().contains("one by one"),
        "{}",
        separate.executor()
    );
}

/// The mini network with clipping by global norm at 0.5, below the gradients' norm.
fn clipped(device: Device) -> TrainConfig {
    TrainConfig {
        steps: 5,
        batch: 16,
        device,
        clip_norm: Some(0.5),
        ..TrainConfig::default()
    }
}

/// Clipping by global norm (the norm reduced on the device, the factor applied inside the
/// SGD kernel) trains on the simulated device with the CPU executor's losses, and changes
/// them: the bound is below the gradients' norm, so every step after the first is clipped.
#[test]
fn clipping_by_norm_on_the_simulator_matches_the_cpu_executor() {
    if in_child() {
        return train_and_print(&clipped(Device::Cuda));
    }
    let test = "clipping_by_norm_on_the_simulator_matches_the_cpu_executor";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let child = run_child(test, &dir, &[]);
    let stdout = &child.stdout;
    assert!(stdout.contains("EXECUTOR Cuda"), "{stdout}");
    let on_sim = child.losses();
    let cpu = train(&clipped(Device::Cpu), 1, |_| {}).expect("clipped CPU training");
    let free = train(
        &TrainConfig {
            clip_norm: None,
            ..clipped(Device::Cpu)
        },
        1,
        |_| {},
    )
    .expect("unclipped CPU training");
    assert_eq!(on_sim.len(), cpu.step_losses.len(), "{stdout}");
    for (step, (s, c)) in on_sim.iter().zip(&cpu.step_losses).enumerate() {
        println!("step {}: simulated cuda {s:.6}, cpu {c:.6}", step + 1);
        // As the unclipped comparison above: FP32 sums in other orders, absorbed by FP16.
        assert!(
            (s - c).abs() / c.abs() < 1e-3,
            "step {}: {s} vs {c}",
            step + 1
        );
    }
    assert_eq!(
        cpu.step_losses[0], free.step_losses[0],
        "step 1 trains from the same weights"
    );
    assert!(
        cpu.step_losses[1..] != free.step_losses[1..],
        "clipping at 0.5 changed nothing: {:?}",
        cpu.step_losses
    );
}

/// The mini network with gradient accumulation over 2 micro-batches of 8: 3 eager warm-up
/// steps, then 3 steps replayed from the two captured graphs (a micro-batch with amp's
/// `accumulate`, the last one with `finish`).
fn accumulated(device: Device) -> TrainConfig {
    TrainConfig {
        steps: 6,
        batch: 8,
        accum: 2,
        device,
        ..TrainConfig::default()
    }
}

/// `train_cbr --accum 2` on the simulated device: the CUDA executor (`amp_accum_grads` into
/// GA, every micro-batch replayed from its graph after the warm-up) has the CPU executor's
/// per-step losses (each the mean of its two micro-batches').
#[test]
fn gradient_accumulation_on_the_simulator_matches_the_cpu_executor() {
    if in_child() {
        return train_and_print(&accumulated(Device::Cuda));
    }
    let test = "gradient_accumulation_on_the_simulator_matches_the_cpu_executor";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let child = run_child(test, &dir, &[]);
    let stdout = &child.stdout;
    assert!(
        child.executor().starts_with("Cuda")
            && child
                .executor()
                .contains("whole step replayed as one CUDA graph"),
        "{stdout}"
    );
    let on_sim = child.losses();
    let cpu = train(&accumulated(Device::Cpu), 1, |_| {}).expect("CPU training");
    assert_eq!(on_sim.len(), 6, "{stdout}");
    assert_eq!(on_sim.len(), cpu.step_losses.len(), "{stdout}");
    for (step, (s, c)) in on_sim.iter().zip(&cpu.step_losses).enumerate() {
        println!("step {}: simulated cuda {s:.6}, cpu {c:.6}", step + 1);
        // As the comparison without accumulation: FP32 sums in other orders (cuDNN's
        // kernels vs the reference ops), absorbed by FP16 storage.
        assert!(
            (s - c).abs() / c.abs() < 1e-3,
            "step {}: {s} vs {c}",
            step + 1
        );
    }
}

/// The mini network with a 4-step warmup then a cosine schedule: 3 eager warm-up steps, then
/// 3 replays of the captured step, whose SGD reads the rate written into S before each.
fn scheduled(device: Device) -> TrainConfig {
    TrainConfig {
        steps: 6,
        batch: 16,
        device,
        lr: 0.1,
        lr_schedule: cudnn_cbr_trainer::LrSchedule::Cosine,
        warmup: 4,
        ..TrainConfig::default()
    }
}

/// `--lr-schedule cosine --warmup 4` on the simulated device: the replayed whole-step graph
/// trains each step at its own rate (the curve holds S's rate after each step, copied on the
/// device behind it), equal to `TrainConfig::lr_at` bit for bit, and the losses follow the
/// CPU executor's on the same schedule.
#[test]
fn a_learning_rate_schedule_on_the_simulator_is_followed_by_the_replayed_steps() {
    if in_child() {
        let mut t = cudnn_cbr_trainer::Trainer::new(&scheduled(Device::Cuda)).unwrap();
        t.record_curve(true);
        let r = t.run(1, |_| {}).expect("CUDA training on the simulator");
        println!("EXECUTOR {:?} | {}", r.executor.kind, r.executor.detail);
        for (p, l) in r.curve.iter().zip(&r.step_losses) {
            println!("RATE {}", p.lr);
            println!("LOSS {l}");
        }
        return;
    }
    let test = "a_learning_rate_schedule_on_the_simulator_is_followed_by_the_replayed_steps";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let child = run_child(test, &dir, &[]);
    assert!(
        child
            .executor()
            .contains("whole step replayed as one CUDA graph"),
        "{}",
        child.stdout
    );
    let rates: Vec<f32> = child
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("RATE "))
        .map(|v| v.parse().expect("a rate"))
        .collect();
    let cfg = scheduled(Device::Cpu);
    let want: Vec<f32> = (0..cfg.steps).map(|i| cfg.lr_at(i)).collect();
    println!("rates on the simulated device {rates:?}, schedule {want:?}");
    assert_eq!(rates, want);
    let cpu = train(&cfg, 1, |_| {}).expect("CPU training");
    let on_sim = child.losses();
    assert_eq!(on_sim.len(), cpu.step_losses.len(), "{}", child.stdout);
    for (step, (s, c)) in on_sim.iter().zip(&cpu.step_losses).enumerate() {
        println!("step {}: simulated cuda {s:.6}, cpu {c:.6}", step + 1);
        // As the comparisons above: FP32 sums in other orders, absorbed by FP16 storage.
        assert!(
            (s - c).abs() / c.abs() < 1e-3,
            "step {}: {s} vs {c}",
            step + 1
        );
    }
}

/// A batch the device cannot hold is refused before the step allocates anything, with the
/// memory report: the simulated device is given 64 MB (its device-properties document with
/// a smaller `totalGlobalMem`), and the mini network at batch 1024 needs more (about 100 MB;
/// batch 512 fits in 50 MB since its buffers share the liveness-planned arena).
#[test]
fn a_batch_the_device_cannot_hold_is_refused_with_the_memory_report() {
    let cfg = TrainConfig {
        steps: 1,
        batch: 1024,
        device: Device::Cuda,
        ..TrainConfig::default()
    };
    if in_child() {
        match train(&cfg, 1, |_| {}) {
            Ok(r) => println!("TRAINED {:?}", r.step_losses),
            Err(e) => println!("REFUSED {e}"),
        }
        return;
    }
    let test = "a_batch_the_device_cannot_hold_is_refused_with_the_memory_report";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let fixture = sim::repo()
        .expect("the repository")
        .join("tests/fixtures/devprops/h200-sm90.json");
    let mut props: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).expect("the fixture"))
            .expect("JSON");
    props["totalGlobalMem"] = serde_json::json!(64_000_000u64);
    let small = std::env::temp_dir().join(format!("cudnn-cbr-64mb-{}.json", std::process::id()));
    std::fs::write(&small, props.to_string()).expect("write the document");
    let child = run_child(test, &dir, &[("CUDNN_CBR_SIM_DEVPROPS", small.as_os_str())]);
    let _ = std::fs::remove_file(&small);
    let (stdout, stderr) = (&child.stdout, &child.stderr);
    println!("{stdout}");
    assert!(
        stdout.contains("REFUSED") && stdout.contains("batch 1024 does not fit"),
        "{stdout}\n{stderr}"
    );
    for needle in [
        "the largest batch that fits is about",
        "activation gradients",
        "shared arena",
        "network buffers",
        "MB per image",
    ] {
        assert!(stdout.contains(needle), "no `{needle}` in:\n{stdout}");
    }
}
