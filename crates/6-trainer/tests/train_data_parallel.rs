//! `train_cbr --ranks N [--sync-bn]` on the CPU executor: N ranks × batch B with synchronized
//! BN train like one rank × N·B; bad data-parallel configurations are typed errors; a
//! launched process that cannot join its group says why, quickly, with or without a GPU.
//! (Named apart from the workspace's `tests/data_parallel.rs`: test binaries are collected
//! into one folder by name.)

use cudnn_cbr_trainer::{train, Device, FaultDrill, TrainConfig, TrainError, Trainer};

mod common;

/// `--ranks 2 --batch 16 --sync-bn` against `--ranks 1 --batch 32`: the same global batches,
/// the same training. The losses agree to FP16 storage noise: the ranks' FP16 wgrads are
/// summed in FP16 and the statistics in another order, each a 2^-11 relative rounding that
/// 60 steps of SGD carry into the loss. We measure at most 8.4e-4 per step; 0.5% of the loss
/// (0.005 absolute near 0) leaves a margin of 6, while local BN, a different training, is
/// outside it from the first step.
#[test]
fn two_synchronized_ranks_train_like_one_rank_with_the_whole_batch() {
    let base = TrainConfig {
        steps: 60,
        ..TrainConfig::default()
    };
    let one = train(&TrainConfig { batch: 32, ..base }, 60, |_| {}).unwrap();
    let mut reports = 0;
    let two = train(
        &TrainConfig {
            batch: 16,
            ranks: 2,
            sync_bn: true,
            ..base
        },
        20,
        |p| {
            reports += 1;
            assert!(p.images_per_sec > 0.0 && p.loss.is_finite());
        },
    )
    .unwrap();
    assert_eq!(reports, 3, "rank 0 reports for the group");
    let local = train(
        &TrainConfig {
            batch: 16,
            ranks: 2,
            ..base
        },
        60,
        |_| {},
    )
    .unwrap();
    let close = |a: f32, b: f32| (a - b).abs() <= 0.005 * a.abs().max(1.0);
    let mut worst = 0f32;
    for (i, (a, b)) in one.step_losses.iter().zip(&two.step_losses).enumerate() {
        assert!(close(*a, *b), "step {i}: one rank {a}, two ranks {b}");
        worst = worst.max((a - b).abs());
    }
    println!(
        "loss {:.4} -> {:.4} (1 rank x 32) vs {:.4} -> {:.4} (2 ranks x 16, synchronized BN), \
         worst step difference {worst:.2e}; local BN {:.4} -> {:.4}",
        one.first_loss,
        one.last_loss,
        two.first_loss,
        two.last_loss,
        local.first_loss,
        local.last_loss
    );
    assert!(
        one.step_losses
            .iter()
            .zip(&local.step_losses)
            .any(|(a, b)| !close(*a, *b)),
        "local BN normalizes by the shard's statistics: a different training"
    );
    assert!(two.held_out_accuracy > 0.9, "{two:?}");
    assert_eq!((two.skipped, two.loss_scale), (0, 8192.0));
}

#[test]
fn bad_data_parallel_configurations_are_typed_errors() {
    let bad = |cfg: TrainConfig, needle: &str| match Trainer::new(&cfg) {
        Err(TrainError::Config(m)) => assert!(m.contains(needle), "{m}"),
        other => panic!("{cfg:?}: {other:?}"),
    };
    bad(
        TrainConfig {
            ranks: 0,
            ..TrainConfig::default()
        },
        "ranks",
    );
    bad(
        TrainConfig {
            ranks: 2,
            device: Device::Cuda,
            ..TrainConfig::default()
        },
        "CUDA",
    );
    // Synchronized BN on GPUs is a launched group's (one process per GPU).
    bad(
        TrainConfig {
            sync_bn: true,
            device: Device::Cuda,
            ..TrainConfig::default()
        },
        "launcher",
    );
    bad(
        TrainConfig {
            ranks: 2,
            drill: Some(FaultDrill {
                per_mille: 10,
                seed: 1,
            }),
            ..TrainConfig::default()
        },
        "drill",
    );
    bad(
        TrainConfig {
            ranks: 1024,
            batch: usize::MAX / 512,
            ..TrainConfig::default()
        },
        "overflows",
    );
}

/// `train_cbr` run with a launcher's environment (as torchrun or Slurm would start it).
fn launched_with(env: &[(&str, &str)], args: &[&str], driver_path: bool) -> (Option<i32>, String) {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let bin = [
        dir.join("../examples/train_cbr"),
        dir.join("example-train_cbr"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("train_cbr is built (`cargo build --workspace --examples`)");
    let mut cmd = std::process::Command::new(bin);
    for v in [
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ] {
        cmd.env_remove(v);
    }
    if !driver_path {
        // Not even the test machines' stand-in driver: the libraries are not found at all.
        cmd.env_remove("LD_LIBRARY_PATH");
    }
    let out = cmd.envs(env.iter().copied()).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

fn launched(env: &[(&str, &str)], args: &[&str]) -> (Option<i32>, String) {
    launched_with(env, args, true)
}

/// Under a launcher a process joins a group of GPUs; what cannot join says why (a typed
/// error, exit 1), and a group of one is an ordinary run.
///
/// Rank 1 of 2 never has a rank 0 here. Where CUDA is usable it would reach the rendezvous
/// and wait for rank 0 (five minutes): its rendezvous is a file that already holds something
/// else, which a peer reads and refuses at once (a typed store error). So every case ends
/// quickly on a machine with a GPU and on one without, and says why either way.
#[test]
fn a_launched_process_that_cannot_join_says_why() {
    let dir = std::env::temp_dir().join(format!("train-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rendezvous = dir.join("rendezvous");
    std::fs::write(&rendezvous, b"not a rendezvous file of any rank 0").unwrap();
    let rendezvous_s = rendezvous.to_str().unwrap().to_owned();
    let two = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("CUDNN_CBR_RENDEZVOUS_FILE", rendezvous_s.as_str()),
    ];
    // Without CUDA the reason is CUDA's; with it, the refused rendezvous file.
    let cannot_join = |text: &str| {
        text.contains("CUDA") || (text.contains(&rendezvous_s) && text.contains("bad magic"))
    };
    let start = std::time::Instant::now();
    let (code, text) = launched(&two, &["--device", "cpu", "--steps", "1"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("rank 1 of 2") && text.contains("--device cuda"),
        "{text}"
    );
    let (code, text) = launched(&two, &["--ranks", "2", "--steps", "1"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("threads"), "{text}");
    // Whether CUDA is usable or not, a launched rank that cannot join must not fall back to
    // training alone on the CPU.
    let (code, text) = launched(&two, &["--device", "auto", "--steps", "1"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(!text.contains("summary") && cannot_join(&text), "{text}");
    // Without the loader path (on a machine whose driver is in a system folder CUDA may
    // still load).
    let (code, text) = launched_with(&two, &["--device", "cuda", "--steps", "1"], false);
    assert_eq!(code, Some(1), "{text}");
    assert!(cannot_join(&text) && !text.contains("panicked"), "{text}");
    let (code, text) = launched(&[("RANK", "x"), ("WORLD_SIZE", "2")], &["--steps", "1"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("RANK"), "{text}");
    let (code, text) = launched(&[("RANK", "0"), ("WORLD_SIZE", "1")], &["--steps", "2"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("summary"), "{text}");
    // Planning and two steps take seconds; a rendezvous wait would take 300 s.
    let took = start.elapsed();
    assert!(took < std::time::Duration::from_secs(120), "took {took:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Checkpoints of a data-parallel run: `--ranks 2 --sync-bn --accum 2` trained 6 steps in one
/// go, and 3 steps saved (by rank 0) then resumed for 3 more in a new trainer (every rank
/// loading the file), give the same per-step losses and final weights bit for bit (with
/// synchronized BN every rank holds the same state, and the data position counts global
/// batches). The file records the group's size; a run of another size refuses it, naming
/// `ranks`, and the group refuses a one-rank file.
#[test]
fn a_synchronized_group_resumes_bit_for_bit_and_another_group_size_is_refused() {
    use cudnn_cbr_trainer::checkpoint;
    let dir = std::env::temp_dir().join(format!("cbr-group-ck-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ck.safetensors");
    let cfg = TrainConfig {
        steps: 6,
        batch: 8,
        ranks: 2,
        sync_bn: true,
        accum: 2,
        ..TrainConfig::default()
    };
    let whole = train(&cfg, 6, |_| {}).unwrap();
    let (_, tail, joined) = common::in_two_runs(&cfg, 3, &path);
    let loaded = checkpoint::load(&path, &cfg).unwrap();
    assert_eq!(loaded.meta.get("ranks"), Some("2"));
    assert_eq!(loaded.meta.get("batch"), Some("8"), "the per-rank batch");
    assert_eq!(joined, whole.step_losses);
    assert_eq!(tail.weights_hash(), whole.weights_hash());
    // SGD after the resume still averaged over the group: the same bits say so, and so does S.
    assert_eq!((tail.skipped, tail.loss_scale), (0, 8192.0));
    let refused = |cfg: TrainConfig, path: &std::path::Path| {
        let e = Trainer::new(&cfg).unwrap().resume(path).unwrap_err();
        assert!(
            matches!(
                &e,
                TrainError::Checkpoint(checkpoint::CheckpointError::OtherRun { field, .. })
                    if field == "ranks"
            ),
            "{cfg:?}: {e}"
        );
    };
    refused(TrainConfig { ranks: 4, ..cfg }, &path);
    refused(
        TrainConfig {
            ranks: 1,
            sync_bn: false,
            ..cfg
        },
        &path,
    );
    // A one-rank file in a group.
    let single = dir.join("one.safetensors");
    let mut one = Trainer::new(&TrainConfig {
        steps: 3,
        ranks: 1,
        sync_bn: false,
        ..cfg
    })
    .unwrap();
    one.save_to(&single, 0).unwrap();
    one.run(3, |_| {}).unwrap();
    refused(cfg, &single);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A group's checkpoint evaluated without training by a new group of CPU ranks (each rank its
/// shard of every held-out batch, counts summed): the held-out accuracies, trained and EMA,
/// the group's run reported, bit for bit; and a different answer before loading it.
#[test]
fn a_group_of_cpu_ranks_evaluates_its_checkpoint_to_its_runs_accuracy() {
    let dir = std::env::temp_dir().join(format!("cbr-group-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ck.safetensors");
    // Long enough to learn (well above the 1/8 of chance), with an EMA.
    let cfg = TrainConfig {
        steps: 30,
        batch: 8,
        ranks: 2,
        sync_bn: true,
        ema: Some(0.9),
        ..TrainConfig::default()
    };
    let (report, e, untrained) = common::evaluated_checkpoint(&cfg, &path);
    assert_eq!(e.held_out_accuracy, report.held_out_accuracy);
    assert_eq!(e.held_out_ema_accuracy, report.held_out_ema_accuracy);
    assert!(e.held_out_accuracy > 0.25, "{e:?}");
    assert_ne!(e, untrained, "the checkpoint was not loaded");
    std::fs::remove_dir_all(&dir).unwrap();
}
