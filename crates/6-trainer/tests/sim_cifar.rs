//! CIFAR-10 on the trainer's CUDA executor, on the simulated CUDA device (docs/simulator.md):
//! the batches are made and augmented on a CPU thread ahead of the step, copied host → device
//! on a stream of their own into the second of two device buffers while the current step
//! trains, ordered by CUDA events (`amp::cuda::DoubleInput`), and the test set is evaluated
//! after every epoch. The files are generated in the exact CIFAR-10 binary format (as
//! `cifar10.rs` does). This binary runs itself again with the simulator selected, eagerly and
//! in its adversarial stream order (work of a stream runs only when something needs it, the
//! most recently enqueued first: a read of the copy stream's buffer without the event join
//! would see the previous batch there), and compares with the CPU executor. A second test
//! trains a launched group of two GPU ranks (threads) on the files with gradient accumulation,
//! in the adversarial order, against one GPU rank on the whole batches.

#[path = "../../3-amp/tests/sim/mod.rs"]
mod sim;

use cudnn_cbr_trainer::cifar::{HW, RECORD_BYTES, TEST_FILE, TRAIN_FILES};
use cudnn_cbr_trainer::{train, DataSource, Device, TrainConfig};
use std::path::{Path, PathBuf};
use std::process::Command;

const CHILD: &str = "CUDNN_CBR_SIM_CIFAR_CHILD";
const DIR: &str = "CUDNN_CBR_SIM_CIFAR_DIR";
/// Records per generated file: 100 training images, 20 test images.
const N: usize = 20;

/// One file of `n` records in the format (label byte, then R, G, B planes, row-major), with
/// a class-dependent pattern so that the network can learn something.
fn file_bytes(f: usize, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * RECORD_BYTES);
    for r in 0..n {
        let label = (f * 7 + r * 3) % 10;
        out.push(label as u8);
        for c in 0..3 {
            for y in 0..HW {
                for x in 0..HW {
                    let v = (label * 25 + c * 40 + (y * x * (label + 1)) % 50 + r) % 256;
                    out.push(v as u8);
                }
            }
        }
    }
    out
}

fn folder() -> PathBuf {
    folder_named("cpu")
}

/// A fresh folder of generated files, one per test of this binary (they run in parallel).
fn folder_named(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cifar10-sim-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (f, file) in TRAIN_FILES.iter().chain([&TEST_FILE]).enumerate() {
        std::fs::write(dir.join(file), file_bytes(f, N)).unwrap();
    }
    dir
}

/// 16 steps of 8 images: an epoch of 100 images ends after steps 13 (104 images) and beyond,
/// so one epoch end falls inside the run, after the whole step is captured (step 3).
fn cfg(dir: &Path, device: Device) -> TrainConfig {
    TrainConfig {
        steps: 16,
        batch: 8,
        hw: HW,
        classes: 10,
        device,
        ema: Some(0.9),
        data: DataSource::Cifar10(Box::leak(dir.to_path_buf().into_boxed_path())),
        ..TrainConfig::default()
    }
}

fn child() {
    let dir = PathBuf::from(std::env::var_os(DIR).expect("the data folder"));
    let r = train(&cfg(&dir, Device::Cuda), 1, |_| {}).expect("CUDA training on the simulator");
    println!("EXECUTOR {:?} | {}", r.executor.kind, r.executor.detail);
    println!(
        "HELD {} {:?}",
        r.held_out_accuracy,
        r.held_out_ema_accuracy.unwrap()
    );
    for e in &r.epochs {
        println!(
            "EPOCH {} {} {} {}",
            e.epoch,
            e.step,
            e.accuracy,
            e.ema_accuracy.unwrap()
        );
    }
    for l in &r.step_losses {
        println!("LOSS {l}");
    }
}

fn lines<'a>(stdout: &'a str, tag: &str) -> Vec<&'a str> {
    stdout.lines().filter_map(|l| l.strip_prefix(tag)).collect()
}

#[test]
fn cifar10_on_the_simulated_device_matches_the_cpu_executor() {
    let test = "cifar10_on_the_simulated_device_matches_the_cpu_executor";
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    if std::env::var_os(LAUNCHED_CHILD).is_some() {
        return;
    }
    let Some(sim) = sim::built(test) else {
        return;
    };
    let dir = folder();
    let cpu = train(&cfg(&dir, Device::Cpu), 1, |_| {}).unwrap();
    assert_eq!(cpu.epochs.len(), 1, "{:?}", cpu.epochs);
    assert_eq!(cpu.epochs[0].step, 13);
    let mut eager_losses: Option<Vec<f32>> = None;
    for adversarial in [false, true] {
        let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
        sim::select(&mut cmd, &sim)
            .args([test, "--exact", "--nocapture"])
            .env(CHILD, "1")
            .env(DIR, &dir);
        if adversarial {
            cmd.env("CUDNN_CBR_SIM_ADVERSARIAL", "1");
        }
        let out = cmd.output().expect("run the test under the simulator");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "the simulated run failed (adversarial {adversarial}):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let executor = lines(&stdout, "EXECUTOR ");
        assert!(
            executor.len() == 1
                && executor[0].starts_with("Cuda")
                && executor[0].contains("simulated")
                && executor[0].contains("whole step replayed as one CUDA graph"),
            "{stdout}"
        );
        let losses: Vec<f32> = lines(&stdout, "LOSS ")
            .iter()
            .map(|v| v.parse().unwrap())
            .collect();
        assert_eq!(losses.len(), cpu.step_losses.len(), "{stdout}");
        // gpu_train.rs's per-step tolerance for the CUDA executor against the CPU one (1e-2:
        // the executors' FP32 sums differ in order, and SGD carries the difference into the
        // weights). Measured here: at most 3e-4 relative through step 15 and 1.3e-3 at step 16
        // (batches of 8, so each BN normalizes over few values and the drift grows as the net
        // learns). A batch read before its copy (the slot's previous batch, or zeros) is
        // another batch: its loss differs by O(10%).
        let mut worst = 0f32;
        for (step, (s, c)) in losses.iter().zip(&cpu.step_losses).enumerate() {
            let rel = (s - c).abs() / c.abs().max(1e-6);
            worst = worst.max(rel);
            println!(
                "step {}: simulated {s}, cpu {c}, relative {rel:.2e}",
                step + 1
            );
            assert!(
                rel < 1e-2,
                "adversarial {adversarial}, step {}: simulated {s} vs cpu {c}",
                step + 1
            );
        }
        println!(
            "adversarial {adversarial}: {} losses, worst relative difference {worst:.2e}",
            losses.len()
        );
        // The stream order changes nothing: the same losses bit for bit in both orders (the
        // adversarial order runs a stream's work only when an event wait or synchronize needs
        // it, so every read of a copied batch waited for its copy).
        match &eager_losses {
            None => eager_losses = Some(losses.clone()),
            Some(eager) => assert!(
                eager
                    .iter()
                    .map(|l| l.to_bits())
                    .eq(losses.iter().map(|l| l.to_bits())),
                "the adversarial order changed the losses: {losses:?} vs {eager:?}"
            ),
        }
        // The test set after the epoch, and the held-out batches at the end: trained and EMA
        // weights. Twenty test images (three batches of 8, the last wrapping around) and the
        // held-out 64: an image whose top two logits are within the executors' rounding may
        // flip; one image of 24 and two of 64 allow that.
        let epochs = lines(&stdout, "EPOCH ");
        assert_eq!(epochs.len(), 1, "{stdout}");
        let f: Vec<f32> = epochs[0].split(' ').map(|v| v.parse().unwrap()).collect();
        let e = cpu.epochs[0];
        assert_eq!((f[0], f[1]), (1.0, 13.0));
        println!(
            "epoch 1: test accuracy {} (cpu {}), EMA {} (cpu {:?})",
            f[2], e.accuracy, f[3], e.ema_accuracy
        );
        assert!((f[2] - e.accuracy).abs() <= 1.0 / 24.0 + 1e-6);
        assert!((f[3] - e.ema_accuracy.unwrap()).abs() <= 1.0 / 24.0 + 1e-6);
        let held: Vec<f32> = lines(&stdout, "HELD ")[0]
            .split(' ')
            .map(|v| v.parse().unwrap())
            .collect();
        assert!((held[0] - cpu.held_out_accuracy).abs() <= 2.0 / 64.0 + 1e-6);
        assert!((held[1] - cpu.held_out_ema_accuracy.unwrap()).abs() <= 2.0 / 64.0 + 1e-6);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

const LAUNCHED_CHILD: &str = "CUDNN_CBR_SIM_CIFAR_LAUNCHED_CHILD";

/// 4 steps of 2 micro-batches of 16 images (32 per step): the first epoch of the 100
/// training images ends after the last step.
fn launched_cfg(dir: &Path) -> TrainConfig {
    TrainConfig {
        steps: 4,
        batch: 16,
        accum: 2,
        ema: None,
        ..cfg(dir, Device::Cuda)
    }
}

/// Two ranks of a launched group (threads, each its own device context and streams: the
/// simulated NCCL's ranks are threads) meeting through `rendezvous`, each a
/// `Trainer::launched` on `cfg` handed to `each`; what `each` returns, in rank order.
fn group<R: Send>(
    cfg: &TrainConfig,
    rendezvous: &Path,
    each: impl Fn(cudnn_cbr_trainer::Trainer) -> R + Sync,
) -> Vec<R> {
    use cudnn_cbr::dist::bootstrap::LaunchEnv;
    use cudnn_cbr_trainer::Trainer;
    let each = &each;
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2usize)
            .map(|rank| {
                let file = rendezvous.to_str().unwrap().to_owned();
                s.spawn(move || {
                    let env = LaunchEnv::from_vars(|n| match n {
                        "RANK" | "LOCAL_RANK" => Some(rank.to_string()),
                        "WORLD_SIZE" => Some("2".into()),
                        "CUDNN_CBR_RENDEZVOUS_FILE" => Some(file.clone()),
                        _ => None,
                    })
                    .unwrap();
                    let t = Trainer::launched(cfg, env).expect("join the group");
                    assert_eq!(t.process_rank(), (rank, 2));
                    each(t)
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// [`group`] training `cfg`, saving to `save` and resuming from `resume` when given.
fn train_group(
    cfg: &TrainConfig,
    rendezvous: &Path,
    save: Option<&Path>,
    resume: Option<&Path>,
) -> Vec<cudnn_cbr_trainer::TrainReport> {
    group(cfg, rendezvous, |mut t| {
        if let Some(path) = save {
            t.save_to(path, 0).unwrap();
        }
        if let Some(path) = resume {
            t.resume(path).expect("every rank loads the checkpoint");
        }
        t.run(100, |_| {}).expect("train as a rank of the group")
    })
}

/// In the child: two ranks of a launched group with synchronized BN, each on its half of
/// every global batch (8 of 16 images, decoded by that rank alone), against one CUDA trainer
/// on the whole batches; then the group's checkpoint after 2 steps (rank 0's) and a new
/// group resuming from it for the last 2.
fn launched_child() {
    let dir = PathBuf::from(std::env::var_os(DIR).expect("the data folder"));
    let one = train(&launched_cfg(&dir), 100, |_| {}).expect("one CUDA rank");
    let cfg = TrainConfig {
        batch: 8,
        sync_bn: true,
        ..launched_cfg(&dir)
    };
    let reports = train_group(&cfg, &dir.join("rendezvous-whole"), None, None);
    let (two, other) = (&reports[0], &reports[1]);
    println!(
        "one rank x 16: losses {:?}, epochs {:?}; two ranks x 8: losses {:?}, epochs {:?}",
        one.step_losses, one.epochs, two.step_losses, two.epochs
    );
    assert_eq!(
        two.weights_hash(),
        other.weights_hash(),
        "the ranks' weights differ"
    );
    assert!(
        two.executor.detail.contains("simulated"),
        "{}",
        two.executor.detail
    );
    // Step 1 sees the same weights, images and (synchronized) statistics: the same loss up
    // to the order of the sums; then the FP16 sum of the ranks' wgrads enters. On the CPU
    // executor the same comparison measures at most 1.1e-5 through step 3, and local BN
    // (each half's statistics) 9.3e-4 and more (crates/6-trainer/tests/cifar10.rs); here
    // 2e-7, 2.4e-5 and 8e-7. 1e-4 leaves a margin of 4 and stays 9× under local BN.
    for (k, (x, y)) in one
        .step_losses
        .iter()
        .zip(&two.step_losses)
        .enumerate()
        .take(3)
    {
        assert!(
            (x - y).abs() < 1e-4,
            "step {}: one rank {x}, two ranks {y}",
            k + 1
        );
    }
    assert_eq!(two.step_losses.len(), 4);
    let steps = |r: &cudnn_cbr_trainer::TrainReport| -> Vec<usize> {
        r.epochs.iter().map(|e| e.step).collect()
    };
    assert_eq!(steps(&one), [4]);
    assert_eq!(steps(two), [4]);
    // The test set's 20 images in batches of 16 (32 predictions, the second batch wrapping
    // around): an image whose top two logits are within the runs' rounding may flip.
    for (x, y) in one.epochs.iter().zip(&two.epochs) {
        assert!(
            (x.accuracy - y.accuracy).abs() <= 2.0 / 32.0 + 1e-6,
            "{x:?} vs {y:?}"
        );
    }
    // Saved by rank 0 after 2 steps, resumed by a new group: the same losses and weights
    // bit for bit as the group in one go (its steps run eagerly, in the same order).
    let ck = dir.join("group.safetensors");
    let head = train_group(
        &TrainConfig { steps: 2, ..cfg },
        &dir.join("rendezvous-head"),
        Some(&ck),
        None,
    );
    let tail = train_group(&cfg, &dir.join("rendezvous-tail"), None, Some(&ck));
    let joined: Vec<f32> = head[0]
        .step_losses
        .iter()
        .chain(&tail[0].step_losses)
        .copied()
        .collect();
    assert_eq!(joined, two.step_losses, "the resumed group's losses");
    assert_eq!(
        tail[0].weights_hash(),
        two.weights_hash(),
        "the resumed group's weights"
    );
    assert_eq!(tail[1].weights_hash(), two.weights_hash());
    // The checkpoint evaluated by a new group without training: the held-out accuracy the
    // first group reported after its 2 steps, and the same figures on both ranks.
    let evaluated = group(&cfg, &dir.join("rendezvous-evaluate"), |mut t| {
        t.load_checkpoint(&ck)
            .expect("every rank loads the checkpoint");
        t.evaluate().expect("the group evaluates")
    });
    println!("the checkpoint evaluated by a group: {:?}", evaluated[0]);
    assert_eq!(evaluated[0], evaluated[1]);
    assert_eq!(evaluated[0].held_out_accuracy, head[0].held_out_accuracy);
    assert!(evaluated[0].test_set.is_some(), "CIFAR-10 has a test set");
    println!("LAUNCHED GROUP TRAINED AND RESUMED");
}

/// The trainer as a launched group of two GPU ranks on the files, with gradient
/// accumulation, on the simulated device in its adversarial stream order (a missing join of
/// the copy, NCCL or compute streams would read stale data): it trains like one rank on the
/// whole batches, its ranks end with the same weights, and its checkpoint resumes it bit
/// for bit.
#[test]
fn a_launched_group_trains_on_the_files_like_one_rank() {
    let test = "a_launched_group_trains_on_the_files_like_one_rank";
    if std::env::var_os(LAUNCHED_CHILD).is_some() {
        return launched_child();
    }
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let Some(dir_sim) = sim::built(test) else {
        return;
    };
    let dir = folder_named("launched");
    let mut cmd = sim::child(&dir_sim, true);
    cmd.args([test, "--exact", "--nocapture"])
        .env(LAUNCHED_CHILD, "1")
        .env(DIR, &dir);
    let ran = sim::run("the launched group on the simulator", &mut cmd);
    assert!(ran.ok, "the launched group's run failed");
    assert!(
        ran.stdout.contains("LAUNCHED GROUP TRAINED"),
        "it did not run"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
