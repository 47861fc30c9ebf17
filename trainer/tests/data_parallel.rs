//! `train_cbr --ranks N [--sync-bn]` on the CPU executor: N ranks × batch B with synchronized
//! BN train like one rank × N·B; bad data-parallel configurations are typed errors.

use cudnn_cbr_trainer::{train, Device, FaultDrill, TrainConfig, TrainError, Trainer};

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
