//! A classifier a trainer links: a compiled network ([`crate::net`]) with a classification
//! head (global average pool, FC, softmax cross-entropy) and the amp step over one memory
//! plan ([`crate::net::memory_plan`]). The trainer keeps the loop: data, schedule, logging.
//!
//! One classifier, [`Classifier`], generic over the device it runs on through one trait,
//! [`Backend`]: a backend names its amp regions (the range ops and their capture,
//! [`crate::amp::step::AmpExecutor`]) and its network executor for a pass (layer steps, adds,
//! max-pools, a [`crate::net::NetExecutor`] walked by [`crate::net::run_pass`]) as associated
//! types, and brings its batch input and the head's passes; the calls every device answers
//! the same way are written once over it (`shared.rs`): a network pass, the memory
//! plan with its EMA and accumulator regions, the initial weights, the batch checks,
//! [`Classifier::forward_backward`], [`Classifier::train_step`] over the micro-batches,
//! [`Classifier::evaluate`] and the running statistics. Two backends:
//! - [`CpuBackend`] ([`CpuClassifier`]): the CPU reference executor (host slices in, no GPU
//!   needed); its own calls are synchronized BN and the training-mode logits;
//! - [`CudaBackend`] ([`CudaClassifier`]): cuDNN plans and amp's kernels on the handle's
//!   stream, reading the caller's cudarc image buffer in place. [`CudaClassifier`] is also the
//!   GPU training engine ([`EngineConfig`]; docs/training.md, "The GPU engine"): whole-step capture into
//!   a CUDA graph, the device-side metrics log read back asynchronously, the EMA evaluation
//!   and a launched data-parallel group over NCCL, on the network's fixed input buffer.
//!   `train_cbr`'s CUDA executor is a loop around it.
//!
//! One training step on either:
//! 1. `step_mut().begin()` zeroes the gradients;
//! 2. `forward_backward(images, labels)` runs the network, the head and the backward pass,
//!    leaving conv gradients FP16 in G16 and the others FP32 in G;
//! 3. `step_mut().finish()` (or `replay` of a captured finish, see
//!    [`crate::amp::step::AmpStep::capture_finish`]) casts, checks, updates and rescales,
//!    with no host sync; `step_mut().set_lr(..)` between replays changes the learning rate.
//!
//! With gradient accumulation ([`crate::amp::step::StepConfig::with_accum`]`(N)`), one
//! optimizer step is N micro-batches: `train_step` runs 1–2 for each and ends the first N − 1
//! with `step_mut().accumulate()` (their gradients summed in FP32 into the plan's GA region)
//! and the last with 3, which runs once over the sum ([`Classifier::train_step`];
//! docs/training.md).
//!
//! Evaluation (forward only, BN in evaluation mode: each layer normalizes with its running
//! statistics, nothing statistical written): [`Classifier::evaluate`]`(images, weights)` gives
//! an [`Evaluation`] (the logits and each image's top-1 class), with the trained weights or,
//! where the step keeps an EMA ([`crate::amp::step::StepConfig::with_ema`]), the EMA weights
//! ([`EvalWeights`]). Both backends' `evaluate_batches` give the [`Accuracies`] of a list of
//! host batches with the trained and (with an EMA) the EMA weights, so that a trainer's
//! test-set and held-out evaluations are one call on either:
//! [`CpuClassifier::evaluate_batches`] (one batch at a time through `evaluate`, the top-1
//! counted on the host; [`crate::dist::CpuReplica::evaluate_batches`] sums the counts over a
//! data-parallel group) and [`CudaClassifier::evaluate_batches`] (the top-1 counted on the
//! device, the EMA swapped in there).

pub(crate) mod backend;
pub(crate) mod cpu;
pub(crate) mod cuda;
mod shared;
pub(crate) mod step_sync;

pub use backend::{Backend, BucketReduce};
pub use cpu::{CpuBackend, CpuClassifier};
pub use cuda::{
    check_fits, open_device, CudaBackend, CudaClassifier, CudaGraphMode, EngineConfig, GraphState,
    ScalarHistory, Snapshot, StepScalars, WARMUP_STEPS,
};
pub use shared::Classifier;
pub use step_sync::StepSync;

use crate::amp::AmpError;
use crate::net::CudaNetError;

/// What a classifier can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClassifierError {
    /// A graph, plan or reference op refused.
    #[error(transparent)]
    Fusion(#[from] crate::fusion::Error),
    /// The amp plan, step or a range op refused.
    #[error(transparent)]
    Amp(#[from] AmpError),
    /// The CUDA network executor refused.
    #[error(transparent)]
    Net(#[from] CudaNetError),
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed while trying to {what}: {message}")]
    Driver {
        /// What the classifier was doing.
        what: String,
        /// The driver's error.
        message: String,
    },
    /// An input does not fit the network (its size, a label out of range).
    #[error("{0}")]
    Input(String),
    /// A setup or call the GPU engine refuses: a step that does not fit on the device, a
    /// graph replayed before its capture, a group with gradient accumulation.
    #[error("{0}")]
    Config(String),
    /// No CUDA device can be opened.
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// Why.
        reason: String,
    },
    /// cuDNN cannot be loaded.
    #[error("cuDNN cannot be loaded: {reason}")]
    NoCudnn {
        /// Why (the loader's first line).
        reason: String,
    },
    /// NVRTC (the amp kernels' compiler) cannot be loaded.
    #[error("NVRTC cannot be loaded: {reason}")]
    NoNvrtc {
        /// Why.
        reason: String,
    },
}

impl From<crate::amp::PlanError> for ClassifierError {
    fn from(e: crate::amp::PlanError) -> Self {
        ClassifierError::Amp(e.into())
    }
}

impl From<crate::amp::RangeOpError> for ClassifierError {
    fn from(e: crate::amp::RangeOpError) -> Self {
        ClassifierError::Amp(e.into())
    }
}

/// Which weights an evaluation reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvalWeights {
    /// The trained weights: conv weights from A (FP16), BN and FC parameters from W (FP32),
    /// as a training step reads them.
    #[default]
    Trained,
    /// The EMA of the weights: conv weights from E16 (the FP16 copy of the EMA), BN and FC
    /// parameters from E (FP32). Needs a step with EMA.
    Ema,
}

/// The accuracies of one evaluation over a set of batches (`evaluate_batches` of
/// [`CpuClassifier`], [`crate::dist::CpuReplica`] and [`CudaClassifier`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accuracies {
    /// Top-1 accuracy with the trained weights.
    pub trained: f32,
    /// Top-1 accuracy with the EMA weights, when the step keeps an EMA.
    pub ema: Option<f32>,
    /// Whether BN ran in evaluation mode (the running statistics): always, on every backend
    /// and route (on CUDA the unfused route's BN through `cbr_bn_eval`).
    pub eval_mode: bool,
}

impl Accuracies {
    /// From the correct top-1 counts with the trained and the EMA weights over `images`
    /// images, BN in evaluation mode; `ema`: whether the step keeps an EMA.
    pub(crate) fn from_counts(correct: [f32; 2], images: f32, ema: bool) -> Self {
        let n = images.max(1.0);
        Accuracies {
            trained: correct[0] / n,
            ema: ema.then(|| correct[1] / n),
            eval_mode: true,
        }
    }
}

/// One evaluated batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// FP16 logits, `[batch, classes]` row-major.
    pub logits: Vec<half::f16>,
    /// Per image, the predicted class: [`crate::netops::head::argmax_last`] of its logits (the
    /// rule the training accuracy uses).
    pub top1: Vec<usize>,
}

impl Evaluation {
    /// From a batch's logits (`classes` per row, `classes > 0`).
    pub(crate) fn from_logits(logits: Vec<half::f16>, classes: usize) -> Self {
        let top1 = logits
            .chunks(classes.max(1))
            .map(|row| crate::netops::head::argmax_last(row).unwrap_or(0))
            .collect();
        Evaluation { logits, top1 }
    }

    /// The fraction of images whose top-1 class is their label (`labels` as long as the
    /// batch; a label outside the classes never matches).
    pub fn accuracy(&self, labels: &[i32]) -> f32 {
        self.correct(labels) as f32 / self.top1.len().max(1) as f32
    }

    /// How many images' top-1 class is their label (a label outside the classes never
    /// matches).
    pub(crate) fn correct(&self, labels: &[i32]) -> usize {
        self.top1
            .iter()
            .zip(labels)
            .filter(|(&p, &l)| usize::try_from(l).is_ok_and(|l| l == p))
            .count()
    }
}

/// Checks the number of micro-batches handed to a `train_step` against the step's
/// [`crate::amp::step::StepConfig::accum`].
fn check_micro_batches(got: usize, accum: u32) -> Result<(), ClassifierError> {
    if got != accum as usize {
        return Err(ClassifierError::Input(format!(
            "{got} micro-batches for a step that accumulates {accum} (StepConfig::accum)"
        )));
    }
    Ok(())
}

/// Checks a batch's sizes and labels against the network and head.
fn check_batch(
    images: usize,
    want_images: usize,
    labels: &[i32],
    batch: usize,
    classes: usize,
) -> Result<(), ClassifierError> {
    if images != want_images {
        return Err(ClassifierError::Input(format!(
            "the images have {images} values, the network reads {want_images} (NHWC FP16)"
        )));
    }
    if labels.len() != batch {
        return Err(ClassifierError::Input(format!(
            "{} labels for a batch of {batch}",
            labels.len()
        )));
    }
    if let Some(l) = labels.iter().find(|&&l| l < 0 || l as usize >= classes) {
        return Err(ClassifierError::Input(format!(
            "label {l} is outside 0..{classes}"
        )));
    }
    Ok(())
}
