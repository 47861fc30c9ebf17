//! The main job's training loop learns (tier 1, CPU executor): loss falls and held-out accuracy
//! is far above chance after a short run.

use cudnn_cbr_trainer::{train, TrainConfig};

mod common;

#[test]
fn a_short_run_learns_the_synthetic_task() {
    let cfg = TrainConfig {
        steps: 40,
        batch: 16,
        ..TrainConfig::default()
    };
    let mut reports = 0;
    let r = train(&cfg, 10, |p| {
        reports += 1;
        assert!(p.loss.is_finite() && p.loss_scale >= 1.0, "{p:?}");
    })
    .unwrap();
    println!("{r:?}");
    assert_eq!(reports, 4);
    // Cross-entropy starts near ln(8) ≈ 2.08 for 8 classes; a working step must cut it a lot.
    assert!(r.first_loss > 1.5, "{r:?}");
    assert!(r.last_loss < 0.6 * r.first_loss, "loss did not fall: {r:?}");
    // Chance is 1/8; 40 steps reached 79% held-out when this was written. 3× chance is a
    // margin no broken gradient gets to.
    assert!(r.held_out_accuracy > 3.0 / 8.0, "{r:?}");
    // Measured with BN in evaluation mode (the running statistics); no EMA was kept.
    assert!(r.held_out_eval_mode);
    assert_eq!(r.held_out_ema_accuracy, None);
    // Nothing overflowed at the default scale with this model, so nothing may be skipped.
    assert_eq!(r.skipped, 0);
    assert_eq!(r.loss_scale, 8192.0);
}

#[test]
fn both_routes_train_to_the_same_place() {
    let cfg = TrainConfig {
        steps: 5,
        batch: 8,
        ..TrainConfig::default()
    };
    let fused = train(&cfg, 5, |_| {}).unwrap();
    let unfused = train(
        &TrainConfig {
            fused: false,
            ..cfg
        },
        5,
        |_| {},
    )
    .unwrap();
    // The CPU executor runs the two routes' op sequences; after 5 identical SGD steps their
    // losses agree to FP16 rounding of the stored activations (relative 1e-2).
    let rel = (fused.last_loss - unfused.last_loss).abs() / fused.last_loss;
    assert!(rel < 1e-2, "fused {fused:?} vs unfused {unfused:?}");
}

#[test]
fn a_bad_configuration_is_a_typed_error() {
    let err = train(
        &TrainConfig {
            batch: 1,
            ..TrainConfig::default()
        },
        1,
        |_| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("batch"), "{err}");
}

#[test]
fn sizes_no_host_could_hold_are_typed_errors_before_any_allocation() {
    use cudnn_cbr::net::Preset;
    // (what, config, words the error must contain). Each used to abort the process: shape
    // arithmetic that wrapped, or an allocation the host could never satisfy.
    let base = TrainConfig::default();
    let cases = [
        (
            "width 2^32",
            TrainConfig {
                width: 1 << 32,
                ..base
            },
            "width",
        ),
        (
            "batch 2^40",
            TrainConfig {
                batch: 1 << 40,
                ..base
            },
            "batch",
        ),
        (
            "hw 1e8",
            TrainConfig {
                hw: 100_000_000,
                ..base
            },
            "elements",
        ),
        (
            "hw 20000",
            TrainConfig { hw: 20_000, ..base },
            "host memory",
        ),
        (
            "resnet50 at hw 4",
            TrainConfig {
                net: Preset::ResNet50,
                hw: 1,
                ..base
            },
            "image size",
        ),
    ];
    for (what, cfg, words) in cases {
        let err = train(&cfg, 1, |_| {}).unwrap_err();
        assert!(err.to_string().contains(words), "{what}: {err}");
    }
}

#[test]
fn poisoned_gradients_on_one_percent_of_2000_steps_are_each_skipped_exactly() {
    use cudnn_cbr::net::Preset;
    use cudnn_cbr_trainer::FaultDrill;
    let cfg = TrainConfig {
        steps: 2000,
        batch: 2,
        net: Preset::Mini,
        width: 4,
        hw: 8,
        channels: 3,
        classes: 4,
        drill: Some(FaultDrill {
            per_mille: 10,
            seed: 0xD811,
        }),
        ..TrainConfig::default()
    };
    let r = train(&cfg, 500, |_| {}).unwrap();
    let trace = &r.trace;
    assert_eq!(trace.len(), 2000);
    let poisoned = trace.iter().filter(|t| t.poisoned).count();
    // 1% of 2000 is 20; the seed's draw must be near it for the drill to mean anything.
    assert!((10..=40).contains(&poisoned), "{poisoned} poisoned steps");
    let mut expected_scale = 8192.0f32;
    let mut prev_hash = None;
    for (i, t) in trace.iter().enumerate() {
        // Skipped exactly when poisoned: no other step overflowed, none poisoned got through.
        assert_eq!(t.skipped, t.poisoned, "step {i}: {t:?}");
        if t.poisoned {
            // Fixed policy: halve on overflow, never below 1, never grow.
            expected_scale = (expected_scale / 2.0).max(1.0);
        }
        assert_eq!(t.loss_scale, expected_scale, "step {i}: {t:?}");
        if let Some(prev) = prev_hash {
            if t.poisoned {
                assert_eq!(
                    t.state_hash, prev,
                    "step {i}: a skipped step changed the weights"
                );
            } else {
                assert_ne!(
                    t.state_hash, prev,
                    "step {i}: a good step left the weights as they were"
                );
            }
        }
        prev_hash = Some(t.state_hash);
    }
    assert_eq!(r.skipped as usize, poisoned);
    assert!(r.last_loss.is_finite(), "{r:?}");
    println!(
        "drill: {poisoned} of 2000 steps poisoned, all skipped, weights unchanged across each; final scale {}",
        r.loss_scale
    );
}

#[test]
fn an_ema_run_reports_both_eval_mode_accuracies() {
    let cfg = TrainConfig {
        steps: 40,
        batch: 16,
        ema: Some(0.9),
        ..TrainConfig::default()
    };
    let r = train(&cfg, 40, |_| {}).unwrap();
    println!("{r:?}");
    let ema = r
        .held_out_ema_accuracy
        .expect("an EMA run reports its accuracy");
    // The EMA (decay 0.9: an average over the last ~10 steps) of weights that learn the task
    // learns it too: 3× chance, as the trained weights' bound above.
    assert!(ema > 3.0 / 8.0, "{r:?}");
    assert!(r.held_out_accuracy > 3.0 / 8.0, "{r:?}");
    // The EMA does not touch the trained weights: the same run without it ends on the same
    // master weights, bit for bit.
    let plain = train(&TrainConfig { ema: None, ..cfg }, 40, |_| {}).unwrap();
    assert_eq!(plain.weights_hash(), r.weights_hash());
    assert_eq!(plain.held_out_accuracy, r.held_out_accuracy);
    // A decay outside [0, 1) is a typed error naming the flag.
    for bad in [1.0, -0.1, f32::NAN] {
        let err = train(
            &TrainConfig {
                ema: Some(bad),
                ..cfg
            },
            1,
            |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("ema"), "{err}");
    }
}

/// The learning-rate schedule on the CPU executor: every step trains at
/// `TrainConfig::lr_at` of its index (the curve holds S's rate after each step, the one SGD
/// read), and a run that stopped inside the warmup (a first slice of 5 steps of a 12-step
/// schedule, saved) and resumed for the rest ends bit for bit as the run in one go: the
/// resumed steps are trained at their own rates, not at the rate S was saved with.
#[test]
fn a_warmup_and_cosine_schedule_sets_each_steps_rate_and_resumes_bit_for_bit() {
    use cudnn_cbr_trainer::LrSchedule;
    let cfg = TrainConfig {
        steps: 12,
        batch: 8,
        lr: 0.1,
        lr_schedule: LrSchedule::Cosine,
        warmup: 8,
        ..TrainConfig::default()
    };
    let whole = train(&cfg, 12, |_| {}).unwrap();
    let rates: Vec<f32> = whole.curve.iter().map(|p| p.lr).collect();
    let want: Vec<f32> = (0..12).map(|i| cfg.lr_at(i)).collect();
    println!("rates {rates:?}");
    assert_eq!(rates, want);
    assert_eq!(rates[0], 0.1 / 8.0);
    assert_eq!(rates[7], 0.1);
    assert!(rates[8..].windows(2).all(|w| w[1] < w[0]), "{rates:?}");
    let constant = train(
        &TrainConfig {
            lr_schedule: LrSchedule::Constant,
            warmup: 0,
            ..cfg
        },
        12,
        |_| {},
    )
    .unwrap();
    assert_ne!(constant.weights_hash(), whole.weights_hash());
    let dir = std::env::temp_dir().join(format!("cbr-schedule-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ck.safetensors");
    let (_, tail, joined) = common::in_two_runs(&cfg, 5, &path);
    assert_eq!(joined, whole.step_losses);
    assert_eq!(tail.weights_hash(), whole.weights_hash());
    std::fs::remove_dir_all(&dir).unwrap();
}
