//! The CUDA executor's evaluation: batches forward only, BN in evaluation mode, with the
//! trained weights and, where the step keeps an EMA ([`TrainConfig::ema`]), with the EMA
//! weights; top-1 counted on the device by the metrics kernel.
//!
//! **The EMA weights.** The network binds its conv weights to their slots in A and its BN
//! parameters (and the FC layer its weights) to W ([`cudnn_cbr::net::cuda::param_slot`]). E16
//! has A's layout and E has W's (one FP16 layout, FP32 regions at twice its offsets:
//! `amp::plan`), so evaluating with the EMA is evaluating with A and W holding E16's and E's
//! bytes: A and W are copied aside on the device, E16 and E copied over them, the batches
//! evaluated, and A and W copied back, all in stream order (device-to-device copies, no host
//! wait). The trained weights come back bit for bit, and the evaluation reads exactly what
//! the CPU classifier reads with [`cudnn_cbr::classifier::EvalWeights::Ema`]: conv weights
//! from E16 (the FP16 copy is what inference reads), BN and FC parameters from E.

use super::{amp_error, driver, CudaTrainer};
use crate::TrainError;
use cudnn_cbr::amp::cuda::{CudaRegions, CudaSlice, CudaStream, DevRange, DevRangeMut};
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::range::metrics_log_read;
use cudnn_cbr::amp::AmpError;
use half::f16;
use std::sync::Arc;

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

/// The trained A and W, kept aside while the EMA's bytes are in their place.
struct Aside {
    a: CudaSlice<u8>,
    w: CudaSlice<u8>,
}

/// Copies region `from` over region `to` (same length: E16 over A, E over W), in stream order.
fn copy_region(
    regions: &mut CudaRegions,
    stream: &Arc<CudaStream>,
    from: Region,
    to: Region,
) -> Result<(), TrainError> {
    let mut src = None;
    let mut dst = None;
    for (r, slice) in regions.regions_mut() {
        if r == from {
            src = Some(slice);
        } else if r == to {
            dst = Some(slice);
        }
    }
    let (Some(src), Some(dst)) = (src, dst) else {
        return Err(TrainError::Config(format!(
            "the memory plan lacks region {from} or {to} (evaluation with the EMA weights \
             needs --ema)"
        )));
    };
    if src.len() != dst.len() {
        return Err(TrainError::Config(format!(
            "regions {from} ({} bytes) and {to} ({} bytes) differ in length",
            src.len(),
            dst.len()
        )));
    }
    stream
        .memcpy_dtod(&*src, dst)
        .map_err(|e| driver(&format!("copy region {from} over {to}"), e))
}

/// Puts the EMA weights where the network and the head read the trained ones (module docs).
fn swap_in_ema(regions: &mut CudaRegions, stream: &Arc<CudaStream>) -> Result<Aside, TrainError> {
    let keep = |r: Region| -> Result<CudaSlice<u8>, TrainError> {
        let slice = regions.region(r).map_err(amp_error)?;
        stream
            .clone_dtod(slice)
            .map_err(|e| driver(&format!("keep region {r} aside"), e))
    };
    let aside = Aside {
        a: keep(Region::A)?,
        w: keep(Region::W)?,
    };
    copy_region(regions, stream, Region::E16, Region::A)?;
    copy_region(regions, stream, Region::E, Region::W)?;
    Ok(aside)
}

/// Puts the trained weights back (bit for bit).
fn swap_back(
    regions: &mut CudaRegions,
    stream: &Arc<CudaStream>,
    aside: &Aside,
) -> Result<(), TrainError> {
    for (r, kept) in [(Region::A, &aside.a), (Region::W, &aside.w)] {
        let dst = regions.region_mut(r).map_err(amp_error)?;
        stream
            .memcpy_dtod(kept, dst)
            .map_err(|e| driver(&format!("restore region {r}"), e))?;
    }
    Ok(())
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
                let stream = self.stream.clone();
                let aside = swap_in_ema(self.step.executor_mut(), &stream)?;
                let acc = self.accuracy(batches);
                // Always restore, so that a failed evaluation leaves the trained weights.
                swap_back(self.step.executor_mut(), &stream, &aside)?;
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
