//! Shared by the trainer's test binaries: a run split by its own checkpoint, and a run's
//! checkpoint evaluated without training.

use cudnn_cbr_trainer::{Evaluation, TrainConfig, TrainReport, Trainer};
use std::path::Path;

/// The first `k` steps of `cfg` (a run of `steps: k`) saved to `path`, then a new trainer of
/// `cfg` resuming from that file for the rest: both reports, and their per-step losses joined
/// (to compare with `cfg` trained in one go).
// (Not every binary that includes this module splits a run.)
#[allow(dead_code)]
pub fn in_two_runs(
    cfg: &TrainConfig,
    k: usize,
    path: &Path,
) -> (TrainReport, TrainReport, Vec<f32>) {
    let mut first = Trainer::new(&TrainConfig { steps: k, ..*cfg }).unwrap();
    first.save_to(path, 0).unwrap();
    let head = first.run(k, |_| {}).unwrap();
    let mut rest = Trainer::new(cfg).unwrap();
    assert_eq!(rest.resume(path).unwrap(), k, "the checkpoint's step");
    let tail = rest.run(cfg.steps, |_| {}).unwrap();
    let joined = head
        .step_losses
        .iter()
        .chain(&tail.step_losses)
        .copied()
        .collect();
    (head, tail, joined)
}

/// `cfg` trained for all its steps and saved to `path` after the last, then that file
/// evaluated without training by a new trainer of `cfg` (`load_checkpoint`, `evaluate`), and a
/// trainer of `cfg` evaluated untrained: the run's report and the two evaluations.
// (Not every binary that includes this module evaluates.)
#[allow(dead_code)]
pub fn evaluated_checkpoint(
    cfg: &TrainConfig,
    path: &Path,
) -> (TrainReport, Evaluation, Evaluation) {
    let mut t = Trainer::new(cfg).unwrap();
    t.save_to(path, 0).unwrap();
    let report = t.run(cfg.steps, |_| {}).unwrap();
    let mut loaded = Trainer::new(cfg).unwrap();
    assert_eq!(
        loaded.load_checkpoint(path).unwrap(),
        cfg.steps,
        "the checkpoint's step"
    );
    let evaluated = loaded.evaluate().unwrap();
    let untrained = Trainer::new(cfg).unwrap().evaluate().unwrap();
    println!(
        "{evaluated:?} vs the run's {} (EMA {:?}); untrained {untrained:?}",
        report.held_out_accuracy, report.held_out_ema_accuracy
    );
    (report, evaluated, untrained)
}
