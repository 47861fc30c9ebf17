//! Shared by the trainer's test binaries: a run split by its own checkpoint.

use cudnn_cbr_trainer::{TrainConfig, TrainReport, Trainer};
use std::path::Path;

/// The first `k` steps of `cfg` (a run of `steps: k`) saved to `path`, then a new trainer of
/// `cfg` resuming from that file for the rest: both reports, and their per-step losses joined
/// (to compare with `cfg` trained in one go).
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
