//! The EMA of the weights on the trainer's CUDA executor (`--ema DECAY`), on the simulated
//! CUDA device (docs/simulator.md): this binary runs itself again with the simulator selected,
//! as `sim_train.rs` does.
//!
//! 1. Step by step (3 eager steps, one eager step whose gradient is poisoned with NaN, then 4
//!    replays of the whole step captured as one CUDA graph), the device's E and E16 equal the
//!    CPU twin (`amp::range::ema_update`) applied to the previous E and the device's new W,
//!    bit for bit; the poisoned step leaves W, E and E16 as they were and counts a skip.
//!    After the 8 steps, E and E16 are compared with the CPU executor's, run through the same
//!    8 batches with the same poisoned element.
//! 2. `train` with an EMA on CUDA reports the held-out accuracy with the EMA weights, as the
//!    CPU executor does, and the same losses.
//! 3. `train_cbr --device cuda --ema 0.9`: the summary line prints the EMA accuracy, and a
//!    run saved after 5 steps and resumed to 12 in a new process writes the same checkpoint,
//!    byte for byte (E and E16 included), as 12 steps in one go.

#[path = "../../3-amp/tests/sim/mod.rs"]
mod sim;

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::range::{ema_update, Scalars};
use cudnn_cbr::classifier::{CpuClassifier, CudaGraphMode, GraphState, Snapshot, WARMUP_STEPS};
use cudnn_cbr_trainer::cuda::CudaTrainer;
use cudnn_cbr_trainer::{compile_net, cpu_policy, train, Device, Synthetic, TrainConfig};
use half::f16;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Set in a child run (each child runs one test of this binary, `--exact`).
const CHILD: &str = "CUDNN_CBR_SIM_EMA_CHILD";
/// Where a child writes the regions the parent compares.
const OUT: &str = "CUDNN_CBR_SIM_EMA_OUT";

const DECAY: f32 = 0.9;
const STEPS: usize = 8;
/// The step (0-based) whose gradient is poisoned: eager, after the capture.
const POISONED: usize = 3;

fn cfg(device: Device) -> TrainConfig {
    TrainConfig {
        steps: STEPS,
        batch: 16,
        device,
        ema: Some(DECAY),
        ..TrainConfig::default()
    }
}

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs `test` again in a child on the simulator built in `dir`, with `envs` set; asserts it
/// exited 0 and returns its stdout.
fn run_child(test: &str, dir: &Path, envs: &[(&str, &std::ffi::OsStr)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
    sim::select(&mut cmd, dir)
        .args([test, "--exact", "--nocapture"])
        .env(CHILD, "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the test under the simulator");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the simulated run failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn region(s: &Snapshot, r: Region) -> &[u8] {
    &s.regions
        .iter()
        .find(|(x, _)| *x == r)
        .unwrap_or_else(|| panic!("the snapshot has no region {r}"))
        .1
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn f16s(b: &[u8]) -> Vec<f16> {
    b.chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// FP16 NaN written over the first element of G16 (the first conv weight's gradient, cast
/// into G by the step's finish): the overflow check must then skip the step.
fn poison(bytes: &mut [u8]) {
    bytes[..2].copy_from_slice(&f16::NAN.to_le_bytes());
}

/// The child: 8 steps driven one by one, each checked against the CPU twin; E, E16 and W
/// written to `$OUT` for the parent.
fn child_steps() {
    let cfg = cfg(Device::Cuda);
    let mut t = CudaTrainer::new(&cfg).expect("the CUDA executor on the simulator");
    let data = Synthetic::new(cfg.hw, cfg.channels, cfg.classes, cfg.seed);
    let mut prev = t.snapshot().unwrap();
    // The EMA starts at the initial weights.
    assert_eq!(region(&prev, Region::E), region(&prev, Region::W));
    let s0 = Scalars::from_bytes(region(&prev, Region::S)).unwrap();
    for i in 0..STEPS {
        let (images, labels) = data.batch(cfg.batch, i as u64, 0);
        t.upload_batch(&images, &labels).unwrap();
        if i == POISONED {
            t.forward_backward().unwrap();
            let mut s = t.snapshot().unwrap();
            let g16 = s
                .regions
                .iter_mut()
                .find(|(r, _)| *r == Region::G16)
                .unwrap();
            poison(&mut g16.1);
            t.restore(&s).unwrap();
            t.finish(false).unwrap();
        } else {
            t.step().unwrap();
        }
        if i + 1 == WARMUP_STEPS {
            t.capture(CudaGraphMode::Step).unwrap();
            assert_eq!(*t.graph_state(), GraphState::Step);
        }
        let next = t.snapshot().unwrap();
        let s = Scalars::from_bytes(region(&next, Region::S)).unwrap();
        if i == POISONED {
            assert_eq!(
                s.skipped,
                s0.skipped + 1,
                "the poisoned step was not skipped"
            );
            for r in [Region::W, Region::E, Region::E16] {
                assert!(region(&next, r) == region(&prev, r), "step {i}: {r} moved");
            }
        } else {
            // The twin from the previous E and this step's W: bit for bit (the kernel and the
            // twin round `1 − decay` once and compute `decay·e + (1 − decay)·w` without
            // contraction; the simulator compiles with -ffp-contract=off as NVRTC with
            // --fmad=false).
            let mut e = f32s(region(&prev, Region::E));
            let mut e16 = f16s(region(&prev, Region::E16));
            let w = f32s(region(&next, Region::W));
            ema_update(&mut e, &mut e16, &w, &Scalars::default(), DECAY).unwrap();
            assert!(e == f32s(region(&next, Region::E)), "step {i}: E differs");
            assert!(
                e16 == f16s(region(&next, Region::E16)),
                "step {i}: E16 differs"
            );
            assert_ne!(region(&next, Region::E), region(&prev, Region::E));
        }
        prev = next;
    }
    println!("GRAPH {}", t.graph_state());
    let out = PathBuf::from(std::env::var_os(OUT).expect("the output folder"));
    for r in [Region::W, Region::E, Region::E16] {
        std::fs::write(out.join(format!("{r}.bin")), region(&prev, r)).unwrap();
    }
}

/// The CPU executor through the same 8 batches, the same element poisoned at the same step:
/// its W, E and E16 bytes.
fn cpu_regions() -> Vec<(Region, Vec<u8>)> {
    let cfg = cfg(Device::Cpu);
    let net = compile_net(&cfg, &cpu_policy(&cfg)).unwrap();
    let mut model = CpuClassifier::new(net, cfg.classes, cfg.step_config(), cfg.seed).unwrap();
    let data = Synthetic::new(cfg.hw, cfg.channels, cfg.classes, cfg.seed);
    for i in 0..STEPS {
        let (images, labels) = data.batch(cfg.batch, i as u64, 0);
        model.step_mut().begin().unwrap();
        model.forward_backward(&images, &labels).unwrap();
        if i == POISONED {
            let regions = model.step_mut().executor_mut();
            let mut g16 = regions.region_bytes(Region::G16).unwrap();
            poison(&mut g16);
            regions.load_region_bytes(Region::G16, &g16).unwrap();
        }
        model.step_mut().finish().unwrap();
    }
    assert_eq!(model.step().executor().scalars().skipped, 1);
    [Region::W, Region::E, Region::E16]
        .into_iter()
        .map(|r| (r, model.step().executor().region_bytes(r).unwrap()))
        .collect()
}

/// ‖a − b‖ / ‖b − base‖: the difference relative to how far training moved the values.
fn rel_to_movement(a: &[f64], b: &[f64], base: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().zip(base).map(|(x, y)| (x - y).powi(2)).sum();
    num.sqrt() / den.sqrt().max(1e-30)
}

#[test]
fn the_devices_ema_follows_its_twin_and_the_cpu_executor() {
    if in_child() {
        return child_steps();
    }
    let test = "the_devices_ema_follows_its_twin_and_the_cpu_executor";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let out = std::env::temp_dir().join(format!("cbr-sim-ema-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let stdout = run_child(test, &dir, &[(OUT, out.as_os_str())]);
    assert!(
        stdout.contains("GRAPH whole step replayed as one CUDA graph"),
        "{stdout}"
    );
    let init = cudnn_cbr_trainer::initial_master_weights(&cfg(Device::Cpu)).unwrap();
    let init: Vec<f64> = init
        .0
        .iter()
        .flat_map(|(_, v)| v)
        .map(|&x| x.into())
        .collect();
    let cpu = cpu_regions();
    let values = |r: Region, b: &[u8]| -> Vec<f64> {
        match r {
            Region::E16 => f16s(b).iter().map(|x| x.to_f64()).collect(),
            _ => f32s(b).iter().map(|&x| x.into()).collect(),
        }
    };
    // The regions hold padded slots; the plan's views pick the values out.
    let net = compile_net(&cfg(Device::Cpu), &cpu_policy(&cfg(Device::Cpu))).unwrap();
    let plan = cudnn_cbr::net::memory_plan_with_ema(&net, cfg(Device::Cpu).classes).unwrap();
    let pick = |r: Region, all: &[f64]| -> Vec<f64> {
        let scale = if r == Region::E16 { 2 } else { 4 };
        plan.views(r)
            .iter()
            .flat_map(|v| {
                let at = v.offset_bytes / scale;
                all[at..at + v.elems].to_vec()
            })
            .collect()
    };
    for (r, cpu_bytes) in &cpu {
        let dev = std::fs::read(out.join(format!("{r}.bin"))).unwrap();
        assert_eq!(dev.len(), cpu_bytes.len(), "{r}");
        let (d, c) = (
            pick(*r, &values(*r, &dev)),
            pick(*r, &values(*r, cpu_bytes)),
        );
        assert_eq!(d.len(), init.len());
        let rel = rel_to_movement(&d, &c, &init);
        println!("{r} after {STEPS} steps (one skipped): simulated cuda vs cpu, ‖Δ‖/‖movement‖ {rel:.2e}");
        // The two executors' weights differ by their op sequences (cuDNN's sums against the
        // CPU's, gpu_train.rs: the first update's per-parameter difference is up to 5.7e-2 of
        // the update between two CPU op sequences, and UPDATE_REL = 0.2 bounds the GPU's).
        // The EMA averages the weights, so its movement differs by the same fraction; 0.2 of
        // the movement is far below what a skipped or doubled update, a wrong decay or a
        // stale E gives (O(1) of the movement). E16 adds one FP16 rounding (2^-11 of E, a
        // fraction of the movement after 7 steps at decay 0.9), so it gets the same bound.
        // Measured: W 1.0e-2, E 8.3e-3, E16 1.8e-2.
        assert!(rel < 0.2, "{r}: {rel}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn train_with_an_ema_on_the_simulator_reports_the_ema_accuracy_like_the_cpu() {
    if in_child() {
        let r = train(&cfg(Device::Cuda), 1, |_| {}).expect("CUDA training on the simulator");
        println!("EMA {:?} {}", r.held_out_ema_accuracy, r.held_out_accuracy);
        for l in &r.step_losses {
            println!("LOSS {l}");
        }
        return;
    }
    let test = "train_with_an_ema_on_the_simulator_reports_the_ema_accuracy_like_the_cpu";
    let Some(dir) = sim::built(test) else {
        return;
    };
    let stdout = run_child(test, &dir, &[]);
    let cpu = train(&cfg(Device::Cpu), 1, |_| {}).unwrap();
    let (ema, held) = stdout
        .lines()
        .find_map(|l| l.strip_prefix("EMA Some("))
        .and_then(|l| l.split_once(") "))
        .unwrap_or_else(|| panic!("no EMA accuracy:\n{stdout}"));
    let (ema, held): (f32, f32) = (ema.parse().unwrap(), held.parse().unwrap());
    let cpu_ema = cpu.held_out_ema_accuracy.unwrap();
    println!(
        "held-out accuracy: trained {held} (cpu {}), EMA {ema} (cpu {cpu_ema})",
        cpu.held_out_accuracy
    );
    // As sim_train.rs: 8 batches of 16; two images of 128 may flip between executors.
    let flips = 2.0 / 128.0 + 1e-6;
    assert!((ema - cpu_ema).abs() <= flips, "{ema} vs {cpu_ema}");
    assert!((held - cpu.held_out_accuracy).abs() <= flips);
    let losses: Vec<f32> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("LOSS "))
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(losses.len(), cpu.step_losses.len());
    // sim_train.rs's tolerance: the EMA reads W and writes only E and E16.
    for (s, c) in losses.iter().zip(&cpu.step_losses) {
        assert!((s - c).abs() / c.abs() < 1e-3, "{s} vs {c}");
    }
}

fn train_cbr() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    [
        dir.join("../examples/train_cbr"),
        dir.join("example-train_cbr"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("train_cbr is built (`cargo build --release -p cudnn-cbr-trainer --examples`)")
}

/// All output of `train_cbr args` on the simulator (asserted to succeed on the device).
fn run_train_cbr(sim: &Path, args: &[&str]) -> String {
    let out = sim::select(&mut Command::new(train_cbr()), sim)
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "train_cbr {args:?} failed:\n{text}");
    assert!(
        text.contains("device cuda") && text.contains("simulated"),
        "not the simulated device:\n{text}"
    );
    text
}

#[test]
fn an_ema_run_resumes_bit_exact_on_the_simulator() {
    if in_child() {
        return;
    }
    let test = "an_ema_run_resumes_bit_exact_on_the_simulator";
    let Some(sim) = sim::built(test) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("cbr-sim-ema-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let (whole, part, resumed) = (path("whole"), path("part"), path("resumed"));
    let base = [
        "--device", "cuda", "--batch", "4", "--width", "8", "--ema", "0.9",
    ];
    let text = run_train_cbr(
        &sim,
        &[&base[..], &["--steps", "12", "--save", &whole]].concat(),
    );
    let summary = text
        .lines()
        .find(|l| l.starts_with("train_cbr summary:"))
        .unwrap_or_else(|| panic!("no summary:\n{text}"));
    println!("{summary}");
    assert!(summary.contains("EMA held-out accuracy"), "{summary}");
    assert!(
        text.contains("whole step replayed as one CUDA graph"),
        "{text}"
    );
    // The EMA and its evaluation (the trained A and W put aside and back) leave the trained
    // weights as a run without it has them.
    let hash = |summary: &str| summary.rsplit_once("weights hash ").unwrap().1.to_string();
    let plain = run_train_cbr(&sim, &[&base[..6], &["--steps", "12"]].concat());
    let plain = plain
        .lines()
        .find(|l| l.starts_with("train_cbr summary:"))
        .unwrap();
    assert!(!plain.contains("EMA"), "{plain}");
    assert_eq!(hash(plain), hash(summary));
    run_train_cbr(
        &sim,
        &[&base[..], &["--steps", "5", "--save", &part]].concat(),
    );
    let text = run_train_cbr(
        &sim,
        &[
            &base[..],
            &["--steps", "12", "--resume", &part, "--save", &resumed],
        ]
        .concat(),
    );
    assert!(text.contains("at step 5"), "{text}");
    let run = TrainConfig {
        batch: 4,
        width: 8,
        steps: 12,
        ema: Some(0.9),
        ..TrainConfig::default()
    };
    let load = |p: &str| cudnn_cbr_trainer::checkpoint::load(Path::new(p), &run).unwrap();
    let (a, b) = (load(&whole), load(&resumed));
    assert!(
        a.state.region(Region::E).is_some() && a.state.region(Region::E16).is_some(),
        "the checkpoint holds no EMA"
    );
    // The whole state (W, M, E, E16, S, running statistics), bit for bit, and the metadata
    // (step, hash, each tensor's checksum). (The files' bytes differ only in the order of the
    // header's metadata keys.)
    assert_eq!(a.step, 12);
    assert!(
        a.state == b.state,
        "the resumed run's state differs from the one-go run's"
    );
    assert_eq!(a.meta.0, b.meta.0);
    std::fs::remove_dir_all(&dir).unwrap();
}
