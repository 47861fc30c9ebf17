//! The CUDA executor's evaluation: batches forward only, BN in evaluation mode, with the
//! trained weights and, where the step keeps an EMA ([`TrainConfig::ema`]), with the EMA
//! weights; top-1 counted on the device by the metrics kernel.
//!
//! **The EMA weights** are put where the trained ones are read and back again on the device
//! ([`cudnn_cbr::amp::cuda::CudaRegions::swap_in_ema`]), in stream order, no host wait.

use super::{amp_error, driver, CudaTrainer};
use crate::TrainError;
use cudnn_cbr::amp::cuda::{DevRange, DevRangeMut};
use cudnn_cbr::amp::range::metrics_log_read;
use cudnn_cbr::amp::AmpError;
use half::f16;

/// The accuracies of one evaluation over a set of batches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Accuracies {
    /// Top-1 accuracy with the trained weights.
    pub trained: f32,
    /// Top-1 accuracy with the EMA weights, when the step keeps an EMA.
    pub ema: Option<f32>,
    /// Whether BN ran in evaluation mode (the running statistics): always, on every route
    /// (the unfused route's BN through `cbr_bn_eval`).
    pub eval_mode: bool,
}

impl CudaTrainer {
    /// Evaluates `batches` (this rank's shards: NHWC FP16 images, labels) forward only with
    /// the trained weights and, with an EMA, with the EMA weights; the accuracies are the
    /// group's (every rank calls it with as many batches). The training state is left as it
    /// was: weights bit for bit, running statistics and the training metrics log untouched.
    ///
    /// # Errors
    /// A batch of the wrong size; a driver, cuDNN or amp error.
    pub(crate) fn evaluate_batches(
        &mut self,
        batches: &[(Vec<f16>, Vec<i32>)],
    ) -> Result<Accuracies, TrainError> {
        let trained = self.accuracy(batches)?;
        let ema = match self.cfg.ema {
            None => None,
            Some(_) => {
                let aside = self.step.executor_mut().swap_in_ema().map_err(amp_error)?;
                let acc = self.accuracy(batches);
                // Always restore, so that a failed evaluation leaves the trained weights.
                self.step
                    .executor_mut()
                    .swap_back(aside)
                    .map_err(amp_error)?;
                Some(acc?)
            }
        };
        Ok(Accuracies {
            trained,
            ema,
            eval_mode: true,
        })
    }

    /// The steps (1-based) after which an epoch of the training data ends, where it has
    /// epochs ([`crate::data::Dataset::train_len`]).
    pub(crate) fn epoch_ends(&self) -> Vec<usize> {
        let images = self.cfg.batch * self.rank().1 * self.cfg.accum.max(1);
        self.data
            .train_len()
            .map(|n| crate::data::epoch_ends(n, images, self.cfg.steps))
            .unwrap_or_default()
    }

    /// The whole test set in evaluation mode, with the trained and (with an EMA) the EMA
    /// weights, after epoch `epoch` ended at step `step`.
    ///
    /// # Errors
    /// As [`CudaTrainer::evaluate_batches`].
    pub(crate) fn test_epoch(
        &mut self,
        epoch: usize,
        step: usize,
    ) -> Result<crate::EpochEval, TrainError> {
        let per = self.cfg.batch * self.rank().1;
        let len = self.data.held_out_len().unwrap_or(0);
        let batches: Vec<_> = (0..crate::data::test_batches(len, per))
            .map(|i| self.shard(self.data.held_out_batch(per, i)))
            .collect();
        let acc = self.evaluate_batches(&batches)?;
        Ok(crate::EpochEval {
            epoch,
            step,
            accuracy: acc.trained,
            ema_accuracy: acc.ema,
        })
    }

    /// The group's top-1 accuracy over `batches` with the weights now in A and W.
    fn accuracy(&mut self, batches: &[(Vec<f16>, Vec<i32>)]) -> Result<f32, TrainError> {
        // As many batches at a time as the evaluation log holds.
        let capacity = cudnn_cbr::amp::range::metrics_log_capacity(self.head.eval_log.len());
        let mut correct = 0usize;
        for chunk in batches.chunks(capacity.max(1)) {
            correct += self.correct(chunk)?;
        }
        let per_batch = self.cfg.batch * self.rank().1;
        Ok(correct as f32 / (batches.len() * per_batch).max(1) as f32)
    }

    /// The group's correct top-1 predictions over `batches` (at most the log's capacity).
    fn correct(&mut self, batches: &[(Vec<f16>, Vec<i32>)]) -> Result<usize, TrainError> {
        self.stream
            .memset_zeros(&mut self.head.eval_log)
            .map_err(|e| driver("clear the evaluation log", e))?;
        for (images, labels) in batches {
            self.upload_batch(images, labels)?;
            self.forward_eval()?;
            let h = &mut self.head;
            self.kernels
                .head_metrics(
                    &self.stream,
                    self.cfg.classes,
                    DevRange::whole(&h.logits),
                    DevRange::whole(&h.labels),
                    None,
                    DevRangeMut::whole(&mut h.eval_log),
                )
                .map_err(amp_error)?;
        }
        let log = self
            .stream
            .clone_dtoh(&self.head.eval_log)
            .map_err(|e| driver("download the evaluation log", e))?;
        let log = metrics_log_read(&log).map_err(AmpError::from)?;
        let entries = self.global_metrics(&log.entries)?;
        let world = self.rank().1;
        let per_batch = self.cfg.batch * world;
        Ok(entries
            .iter()
            .map(|m| (m.accuracy * per_batch as f32).round() as usize)
            .sum())
    }
}
