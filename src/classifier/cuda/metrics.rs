//! What leaves the device, and when: the training metrics log and S copied asynchronously into
//! page-locked memory ([`crate::amp::cuda::Readback`]), a per-step history of S's leading bytes
//! copied on the device behind each step (a training curve with no host wait), and the
//! evaluation of host batches whose top-1 the metrics kernel counts on the device, with the
//! trained and the EMA weights.

use super::{driver, CudaClassifier, Result};
use crate::amp::cuda::{CudaSlice, DevRange, DevRangeMut};
use crate::amp::plan::Region;
use crate::amp::range::{s_layout, Scalars};
use crate::amp::AmpError;
use crate::classifier::{Accuracies, ClassifierError};
use crate::netops::head::{metrics_log_capacity, metrics_log_read, MetricsLog};
use half::f16;

/// Bytes of S kept per step in a [`ScalarHistory`]: up to and including the learning rate.
const KEPT: usize = s_layout::LR + 4;

/// One row of S's leading bytes per step of a run, on the device
/// ([`CudaClassifier::record_scalars`]).
#[derive(Debug)]
pub struct ScalarHistory {
    rows: CudaSlice<u8>,
    /// Rows written.
    written: usize,
}

/// The scalars of one recorded step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    /// The loss scale after the step.
    pub loss_scale: f32,
    /// The learning rate the step used.
    pub lr: f32,
}

fn f32_at(row: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]])
}

fn no_log() -> ClassifierError {
    ClassifierError::Config("the engine keeps no metrics log (EngineConfig::log_entries)".into())
}

impl CudaClassifier {
    /// Requests asynchronous copies of S and the metrics log into page-locked memory (never
    /// waits); [`CudaClassifier::poll_readback`] returns them once they have arrived.
    ///
    /// # Errors
    /// No metrics log; a driver error.
    pub fn request_readback(&mut self) -> Result<()> {
        self.step.request_scalars()?;
        let log = self.backend.head.log.as_ref().ok_or_else(no_log)?;
        let readback = self.backend.log_readback.as_mut().ok_or_else(no_log)?;
        Ok(readback.request(&self.backend.stream, log)?)
    }

    /// The metrics log and S of the last request, once both have arrived (never waits; S is
    /// the default where its copy has not arrived with the log's).
    ///
    /// # Errors
    /// No metrics log; a driver error; a log image that does not parse.
    pub fn poll_readback(&mut self) -> Result<Option<(MetricsLog, Scalars)>> {
        let readback = self.backend.log_readback.as_mut().ok_or_else(no_log)?;
        let Some(bytes) = readback.poll()? else {
            return Ok(None);
        };
        let log = metrics_log_read(bytes).map_err(AmpError::from)?;
        let s = self.step.poll_scalars()?.unwrap_or_default();
        Ok(Some((log, s)))
    }

    /// Requests the metrics log and waits for it (the end of a run); with S, read blocking.
    ///
    /// # Errors
    /// As [`CudaClassifier::poll_readback`].
    pub fn wait_readback(&mut self) -> Result<(MetricsLog, Scalars)> {
        self.request_readback()?;
        let readback = self.backend.log_readback.as_mut().ok_or_else(no_log)?;
        let bytes = readback.wait()?.map(<[u8]>::to_vec).unwrap_or_default();
        let log = metrics_log_read(&bytes).map_err(AmpError::from)?;
        let s = self.step.executor().read_scalars_blocking()?;
        Ok((log, s))
    }

    /// The training metrics log, downloaded (blocking).
    ///
    /// # Errors
    /// No metrics log; a driver error.
    pub fn metrics_log(&self) -> Result<MetricsLog> {
        let log = self.backend.head.log.as_ref().ok_or_else(no_log)?;
        let bytes = self
            .backend
            .stream
            .clone_dtoh(log)
            .map_err(|e| driver("download the metrics log", e))?;
        Ok(metrics_log_read(&bytes).map_err(AmpError::from)?)
    }

    /// A history of `steps` rows of S's leading bytes (loss scale to learning rate).
    ///
    /// # Errors
    /// A driver error (the allocation).
    pub fn scalar_history(&self, steps: usize) -> Result<ScalarHistory> {
        let rows = self
            .backend
            .stream
            .alloc_zeros::<u8>((steps * KEPT).max(1))
            .map_err(|e| driver("allocate the loss-scale history", e))?;
        Ok(ScalarHistory { rows, written: 0 })
    }

    /// Copies S's leading bytes into the history's next row, device to device behind the step
    /// just enqueued (no host wait; outside a captured step, whose addresses are fixed).
    ///
    /// # Errors
    /// A history already full; a driver error.
    pub fn record_scalars(&self, h: &mut ScalarHistory) -> Result<()> {
        let at = h.written * KEPT;
        if at + KEPT > h.rows.len() {
            return Err(ClassifierError::Config(format!(
                "the loss-scale history holds {} steps",
                h.rows.len() / KEPT
            )));
        }
        let s = self.step.executor().region(Region::S)?;
        let src = s.slice(0..KEPT);
        let mut dst = h.rows.slice_mut(at..at + KEPT);
        self.backend
            .stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| driver("copy the scalars into the history", e))?;
        h.written += 1;
        Ok(())
    }

    /// The recorded rows, in step order (downloads the history: waits for the stream).
    ///
    /// # Errors
    /// A driver error.
    pub fn scalar_rows(&self, h: &ScalarHistory) -> Result<Vec<StepScalars>> {
        let bytes = self
            .backend
            .stream
            .clone_dtoh(&h.rows)
            .map_err(|e| driver("download the loss-scale history", e))?;
        Ok(bytes
            .chunks_exact(KEPT)
            .take(h.written)
            .map(|row| StepScalars {
                loss_scale: f32_at(row, s_layout::LOSS_SCALE),
                lr: f32_at(row, s_layout::LR),
            })
            .collect())
    }

    /// Evaluates `batches` (this rank's shards: NHWC FP16 images, labels) forward only, BN in
    /// evaluation mode, with the trained weights and, where the step keeps an EMA, with the
    /// EMA weights (put where the trained ones are read and back again, on the device in
    /// stream order: [`crate::amp::cuda::CudaRegions::swap_in_ema`]); the accuracies are the
    /// group's (every rank calls it with as many batches). The training state is left as it
    /// was: weights bit for bit, running statistics and the training metrics log untouched.
    ///
    /// # Errors
    /// A batch of the wrong size; a driver, cuDNN or amp error.
    pub fn evaluate_batches(&mut self, batches: &[(Vec<f16>, Vec<i32>)]) -> Result<Accuracies> {
        let trained = self.accuracy(batches)?;
        let ema = match self.step.config().ema_decay {
            None => None,
            Some(_) => {
                let aside = self.step.executor_mut().swap_in_ema()?;
                let acc = self.accuracy(batches);
                // Always restore, so that a failed evaluation leaves the trained weights.
                self.step.executor_mut().swap_back(aside)?;
                Some(acc?)
            }
        };
        Ok(Accuracies {
            trained,
            ema,
            eval_mode: true,
        })
    }

    /// The group's top-1 accuracy over `batches` with the weights now in A and W.
    fn accuracy(&mut self, batches: &[(Vec<f16>, Vec<i32>)]) -> Result<f32> {
        // As many batches at a time as the evaluation log holds.
        let capacity = metrics_log_capacity(self.backend.head.eval_log.len());
        let mut correct = 0usize;
        for chunk in batches.chunks(capacity.max(1)) {
            correct += self.correct(chunk)?;
        }
        let per_batch = self.backend.head.shape.batch * self.rank().1;
        Ok(correct as f32 / (batches.len() * per_batch).max(1) as f32)
    }

    /// The group's correct top-1 predictions over `batches` (at most the log's capacity).
    fn correct(&mut self, batches: &[(Vec<f16>, Vec<i32>)]) -> Result<usize> {
        self.backend
            .stream
            .memset_zeros(&mut self.backend.head.eval_log)
            .map_err(|e| driver("clear the evaluation log", e))?;
        for (images, labels) in batches {
            self.upload_batch(images, labels)?;
            self.forward_eval()?;
            let h = &mut self.backend.head;
            self.backend.net_kernels.head_metrics(
                &self.backend.stream,
                h.shape.classes,
                DevRange::whole(&h.logits),
                DevRange::whole(&h.labels),
                None,
                DevRangeMut::whole(&mut h.eval_log),
            )?;
        }
        let log = self
            .backend
            .stream
            .clone_dtoh(&self.backend.head.eval_log)
            .map_err(|e| driver("download the evaluation log", e))?;
        let log = metrics_log_read(&log).map_err(AmpError::from)?;
        let entries = self.global_metrics(&log.entries)?;
        let per_batch = self.backend.head.shape.batch * self.rank().1;
        Ok(entries
            .iter()
            .map(|m| (m.accuracy * per_batch as f32).round() as usize)
            .sum())
    }
}
