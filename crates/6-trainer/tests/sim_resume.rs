//! Checkpoint and resume on the CUDA executor, on the simulated CUDA device
//! (docs/simulator.md): `train_cbr --device cuda` runs as a child process under the simulator
//! (as `sim_train.rs` runs its children), 12 steps in one go against 5 steps, a checkpoint,
//! and 7 more in a new process (the first run also saving after steps 2 and 4). Each run plans, warms up 3 eager steps and then replays the
//! whole step as a CUDA graph, so the resumed run replays from its step 8 where the one-go
//! run did from step 3: the losses and the weights hash must still be equal bit for bit. The
//! same with gradient accumulation (`--accum 2`, 8 steps against 5 + 3), whose replayed
//! graphs also train the eager run's bits (`--cuda-graph off`, `finish`, `step`).

#[path = "../../3-amp/tests/sim/mod.rs"]
mod sim;

use std::path::PathBuf;
use std::process::Command;

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

/// (weights hash, first step of the losses, per-step losses as printed, all output).
fn run(sim: &std::path::Path, args: &[&str]) -> (String, usize, Vec<String>, String) {
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
    let hash = text
        .lines()
        .find(|l| l.starts_with("train_cbr summary:"))
        .and_then(|l| l.rsplit_once("weights hash "))
        .map(|(_, h)| h.trim().to_string())
        .unwrap_or_else(|| panic!("no summary line with a hash:\n{text}"));
    let (from, losses) = text
        .lines()
        .find_map(|l| l.strip_prefix("train_cbr: step losses from step "))
        .and_then(|l| l.split_once(": "))
        .map(|(n, l)| {
            (
                n.parse().unwrap(),
                l.split(' ').map(str::to_string).collect(),
            )
        })
        .unwrap_or_else(|| panic!("no losses line:\n{text}"));
    (hash, from, losses, text)
}

#[test]
fn resuming_on_the_simulated_device_is_bit_exact() {
    let test = "resuming_on_the_simulated_device_is_bit_exact";
    let Some(sim) = sim::built(test) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("cbr-sim-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ck = dir.join("ck.safetensors");
    let ck = ck.to_str().unwrap();
    let log = dir.join("log");
    let base = ["--device", "cuda", "--batch", "4", "--width", "8"];
    let whole_log = dir.join("whole-log");
    let (whole, _, all, text) = run(
        &sim,
        &[
            &base[..],
            &["--steps", "12", "--log-dir", whole_log.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(
        text.contains("whole step replayed as one CUDA graph"),
        "{text}"
    );
    assert_eq!(all.len(), 12, "{text}");
    // Saves after steps 2 and 4 (before and after the capture) and 5: downloading the state
    // mid-run must not change the run.
    let (part, _, first, _) = run(
        &sim,
        &[
            &base[..],
            &["--steps", "5", "--save", ck, "--save-every", "2"],
        ]
        .concat(),
    );
    assert_eq!(first[..], all[..5]);
    let (resumed, from, rest, text) = run(
        &sim,
        &[
            &base[..],
            &[
                "--steps",
                "12",
                "--resume",
                ck,
                "--log-dir",
                log.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(text.contains("at step 5"), "{text}");
    println!("cuda (simulated): one go {whole}, after 5 steps {part}, resumed {resumed}");
    println!("cuda (simulated): steps 6-12 one go {:?}", &all[5..]);
    println!("cuda (simulated): steps 6-12 resumed {rest:?}");
    assert_eq!(from, 6);
    assert_eq!(rest[..], all[5..], "the resumed steps' losses differ");
    assert_eq!(resumed, whole, "the resumed run ends with other weights");
    assert_ne!(part, whole);
    // The CUDA executor's curve: steps 6..=12, losses from the device's metrics log.
    let csv = std::fs::read_to_string(log.join("curves.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 7, "{csv}");
    assert!(rows[0].starts_with(&format!("6,{},", all[5])), "{csv}");
    // The CUDA executor's loss scale and learning rate per step come from S copied on the
    // device behind each step (no host wait): the same as the CPU executor's, step for step.
    let cpu_log = dir.join("cpu-log");
    let out = Command::new(train_cbr())
        .args([
            "--device", "cpu", "--batch", "4", "--width", "8", "--steps", "12",
        ])
        .args(["--log-dir", cpu_log.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let columns = |csv: &str| -> Vec<(String, String, String)> {
        csv.lines()
            .skip(1)
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                (f[0].to_string(), f[3].to_string(), f[4].to_string())
            })
            .collect()
    };
    let gpu_csv = std::fs::read_to_string(whole_log.join("curves.csv")).unwrap();
    let cpu_csv = std::fs::read_to_string(cpu_log.join("curves.csv")).unwrap();
    assert_eq!(columns(&gpu_csv).len(), 12, "{gpu_csv}");
    assert_eq!(columns(&gpu_csv), columns(&cpu_csv), "{gpu_csv}\n{cpu_csv}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same with gradient accumulation (`--accum 2`): 8 steps in one go against 5, a
/// checkpoint (the optimizer state after a drained step: GA is zero there and not saved),
/// and 3 more in a new process, which captures its two graphs at step 8; and a run with
/// another micro-batch count refuses the checkpoint.
#[test]
fn resuming_an_accumulating_run_on_the_simulated_device_is_bit_exact() {
    let test = "resuming_an_accumulating_run_on_the_simulated_device_is_bit_exact";
    let Some(sim) = sim::built(test) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("cbr-sim-resume-accum-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ck = dir.join("ck.safetensors");
    let ck = ck.to_str().unwrap();
    let base = [
        "--device", "cuda", "--batch", "4", "--width", "8", "--accum", "2",
    ];
    let (whole, _, all, text) = run(&sim, &[&base[..], &["--steps", "8"]].concat());
    assert!(
        text.contains("whole step replayed as one CUDA graph"),
        "{text}"
    );
    assert_eq!(all.len(), 8, "{text}");
    let (_, _, first, _) = run(&sim, &[&base[..], &["--steps", "5", "--save", ck]].concat());
    assert_eq!(first[..], all[..5]);
    let (resumed, from, rest, _) = run(
        &sim,
        &[&base[..], &["--steps", "8", "--resume", ck]].concat(),
    );
    assert_eq!(from, 6);
    assert_eq!(rest[..], all[5..], "the resumed steps' losses differ");
    assert_eq!(resumed, whole, "the resumed run ends with other weights");
    let out = sim::select(&mut Command::new(train_cbr()), &sim)
        .args([
            "--device", "cuda", "--batch", "4", "--width", "8", "--steps", "8",
        ])
        .args(["--resume", ck])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("`accum` is 2"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With gradient accumulation, every micro-batch replayed from its graph (`step`), only amp's
/// accumulate and finish op lists replayed (`finish`) and every launch eager (`off`) train
/// the same bits: the same per-step losses and weights hash.
#[test]
fn accumulating_steps_replayed_from_graphs_equal_eager_ones_on_the_simulated_device() {
    let test = "accumulating_steps_replayed_from_graphs_equal_eager_ones_on_the_simulated_device";
    let Some(sim) = sim::built(test) else {
        return;
    };
    let base = [
        "--device", "cuda", "--batch", "4", "--width", "8", "--accum", "2",
    ];
    let runs: Vec<(String, Vec<String>)> = ["off", "finish", "step"]
        .iter()
        .map(|mode| {
            let (hash, _, losses, text) = run(
                &sim,
                &[&base[..], &["--steps", "6", "--cuda-graph", mode]].concat(),
            );
            if *mode == "step" {
                assert!(text.contains("whole step replayed"), "{text}");
            }
            (hash, losses)
        })
        .collect();
    assert_eq!(runs[0].1.len(), 6);
    assert_eq!(runs[1], runs[0], "finish graphs vs eager");
    assert_eq!(runs[2], runs[0], "step graphs vs eager");
}
