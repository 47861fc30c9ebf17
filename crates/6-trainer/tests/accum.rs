//! `train_cbr --accum N` on the CPU executor: the loss-scale trace of a drill that poisons
//! one micro-batch of some steps, a run that learns, `--accum 1` as the step without
//! accumulation, data-parallel ranks that accumulate, resuming, and bad values as typed
//! errors. (The simulated CUDA device's run is in
//! `crates/6-trainer/tests/sim_train.rs`.)

use cudnn_cbr::net::Preset;
use cudnn_cbr_trainer::{train, FaultDrill, TrainConfig, TrainError, Trainer, MAX_ACCUM};

mod common;

fn small(accum: usize) -> TrainConfig {
    TrainConfig {
        batch: 4,
        net: Preset::Mini,
        width: 4,
        hw: 8,
        channels: 3,
        classes: 4,
        accum,
        ..TrainConfig::default()
    }
}

/// The documented trace (docs/training.md): fixed policy from 8192. A step with a NaN or Inf
/// in any one of its 3 micro-batches (poisoned after that micro-batch's backward pass,
/// before it is added into the accumulator) is skipped as a whole: W, M and A keep their
/// bits, `skipped` counts it once, and the scale halves once (floor 1). Every other step is
/// applied; nothing carries over from a skipped step.
#[test]
fn an_overflow_in_one_micro_batch_skips_its_step_once_and_halves_the_scale_once() {
    let drill = FaultDrill {
        per_mille: 100,
        seed: 0xACC,
    };
    let cfg = TrainConfig {
        steps: 200,
        drill: Some(drill),
        ..small(3)
    };
    let r = train(&cfg, 200, |_| {}).unwrap();
    let trace = &r.trace;
    assert_eq!(trace.len(), 200);
    let poisoned: Vec<usize> = (0..200).filter(|&i| trace[i].poisoned).collect();
    // 10% of 200 is 20: enough steps, and the bad value lands in different micro-batches.
    assert!((8..=40).contains(&poisoned.len()), "{poisoned:?}");
    let which: std::collections::BTreeSet<usize> = poisoned
        .iter()
        .filter_map(|&i| drill.poisons(i))
        .map(|h| FaultDrill::micro_batch(h, 3))
        .collect();
    assert!(which.len() >= 2, "always micro-batch {which:?}");
    let mut scale = 8192.0f32;
    let mut prev = None;
    for (i, t) in trace.iter().enumerate() {
        assert_eq!(t.skipped, t.poisoned, "step {i}: {t:?}");
        if t.poisoned {
            scale = (scale / 2.0).max(1.0);
        }
        assert_eq!(t.loss_scale, scale, "step {i}: {t:?}");
        if let Some(prev) = prev {
            assert_eq!(t.state_hash == prev, t.poisoned, "step {i}: {t:?}");
        }
        prev = Some(t.state_hash);
    }
    assert_eq!(r.skipped as usize, poisoned.len());
    assert_eq!(r.loss_scale, scale);
    println!(
        "accum 3 drill: {} of 200 steps poisoned (in micro-batches {which:?}), all skipped once, \
         final scale {scale}",
        poisoned.len()
    );
}

#[test]
fn an_accumulating_run_learns_and_accum_1_is_the_plain_step() {
    let plain = TrainConfig {
        steps: 60,
        ..small(1)
    };
    let one = train(&plain, 60, |_| {}).unwrap();
    // accum 1 is the default: the same step, bit for bit.
    let default = train(
        &TrainConfig {
            accum: TrainConfig::default().accum,
            ..plain
        },
        60,
        |_| {},
    )
    .unwrap();
    assert_eq!(TrainConfig::default().accum, 1);
    assert_eq!(one.step_losses, default.step_losses);
    assert_eq!(one.weights_hash(), default.weights_hash());
    let two = train(&TrainConfig { accum: 2, ..plain }, 60, |_| {}).unwrap();
    println!(
        "accum 2: loss {:.4} -> {:.4}, held-out {:.3}; accum 1: {:.4} -> {:.4}",
        two.first_loss, two.last_loss, two.held_out_accuracy, one.first_loss, one.last_loss
    );
    assert_ne!(two.weights_hash(), one.weights_hash());
    // Learning: the last 10 steps' mean loss well below the first 10's (ln 4 ≈ 1.39 at
    // chance), and the held-out accuracy above chance (0.25).
    assert!(two.last_loss < 0.8 * two.first_loss, "{two:?}");
    assert!(two.held_out_accuracy > 0.3, "{two:?}");
}

#[test]
fn bad_micro_batch_counts_are_typed_errors() {
    for accum in [0, MAX_ACCUM + 1, usize::MAX] {
        let cfg = TrainConfig {
            steps: 1,
            ..small(accum)
        };
        let e = train(&cfg, 1, |_| {}).unwrap_err();
        assert!(
            matches!(&e, TrainError::Config(m) if m.contains("accum")),
            "{accum}: {e}"
        );
    }
}

/// A run of 6 accumulated steps saved after step 3 and resumed in a new trainer ends with the
/// per-step losses and weights hash of the run in one go (the data position is the optimizer
/// step; its first batch is `step · accum`); a run with another micro-batch count refuses the
/// file, naming `accum`.
#[test]
fn an_accumulating_run_resumes_bit_for_bit_and_another_count_is_refused() {
    let dir = std::env::temp_dir().join(format!("cbr-accum-ck-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ck.safetensors");
    let cfg = TrainConfig {
        steps: 6,
        ..small(2)
    };
    let whole = train(&cfg, 6, |_| {}).unwrap();
    let (_, tail, joined) = common::in_two_runs(&cfg, 3, &path);
    assert_eq!(joined, whole.step_losses);
    assert_eq!(tail.weights_hash(), whole.weights_hash());
    for other in [1, 3] {
        let mut t = Trainer::new(&TrainConfig {
            accum: other,
            ..cfg
        })
        .unwrap();
        let e = t.resume(&path).unwrap_err();
        assert!(e.to_string().contains("accum"), "{other}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--ranks 2 --batch 8 --sync-bn --accum 2` against `--ranks 1 --batch 16 --accum 2`: the
/// same global micro-batches, the same training, SGD unscaling the rank and micro-batch sums
/// by `1 / (loss_scale · 2 · 2)` against `1 / (loss_scale · 2)`. The losses agree to FP16
/// storage noise, as in `train_data_parallel.rs` (the ranks' FP16 wgrads summed in FP16, the
/// statistics in another order): 0.5% of the loss, which local BN, a different training,
/// leaves.
#[test]
fn synchronized_ranks_that_accumulate_train_like_one_rank_with_the_whole_batch() {
    let base = TrainConfig {
        steps: 30,
        accum: 2,
        ..TrainConfig::default()
    };
    let one = train(&TrainConfig { batch: 16, ..base }, 30, |_| {}).unwrap();
    let two_cfg = TrainConfig {
        batch: 8,
        ranks: 2,
        sync_bn: true,
        ..base
    };
    let two = train(&two_cfg, 30, |_| {}).unwrap();
    let local = train(
        &TrainConfig {
            sync_bn: false,
            ..two_cfg
        },
        30,
        |_| {},
    )
    .unwrap();
    let close = |a: f32, b: f32| (a - b).abs() <= 0.005 * a.abs().max(1.0);
    let mut worst = 0f32;
    for (i, (a, b)) in one.step_losses.iter().zip(&two.step_losses).enumerate() {
        assert!(close(*a, *b), "step {i}: one rank {a}, two ranks {b}");
        worst = worst.max((a - b).abs());
    }
    assert_eq!(two.step_losses.len(), 30);
    assert!(
        one.step_losses
            .iter()
            .zip(&local.step_losses)
            .any(|(a, b)| !close(*a, *b)),
        "local BN is another training"
    );
    assert!(two.last_loss < two.first_loss, "{two:?}");
    println!(
        "accum 2: loss {:.4} -> {:.4} (1 rank x 16) vs {:.4} -> {:.4} (2 ranks x 8, \
         synchronized BN), worst step difference {worst:.2e}",
        one.first_loss, one.last_loss, two.first_loss, two.last_loss
    );
}
