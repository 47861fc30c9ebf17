//! The CUDA executor's training curve without a per-step host wait: after each step the
//! scalars the curve needs (loss scale and learning rate, the first [`KEPT`] bytes of S) are
//! copied device to device into a history buffer, one row per step, on the compute stream
//! behind the step (outside its CUDA graph, whose addresses are fixed); the history is read
//! back once at the end, with the metrics log that holds each step's loss and accuracy.

use super::{amp_error, driver, CudaTrainer};
use crate::curves::CurvePoint;
use crate::TrainError;
use cudnn_cbr::amp::cuda::CudaSlice;
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::range::s_layout;

/// Bytes of S kept per step: up to and including the learning rate.
const KEPT: usize = s_layout::LR + 4;

/// One row of S's leading bytes per step of a run.
pub(crate) struct ScalarHistory {
    rows: CudaSlice<u8>,
    /// The run's first step (0-based index of row 0).
    first: usize,
    /// Rows written.
    written: usize,
}

fn f32_at(row: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]])
}

impl CudaTrainer {
    /// A history for steps `first..steps` (one row each).
    ///
    /// # Errors
    /// A driver error (the allocation).
    pub(crate) fn scalar_history(
        &self,
        first: usize,
        steps: usize,
    ) -> Result<ScalarHistory, TrainError> {
        let rows = self
            .stream
            .alloc_zeros::<u8>((steps.saturating_sub(first) * KEPT).max(1))
            .map_err(|e| driver("allocate the loss-scale history", e))?;
        Ok(ScalarHistory {
            rows,
            first,
            written: 0,
        })
    }

    /// Copies S's leading bytes into the history's next row, behind the step just enqueued
    /// (no host wait).
    ///
    /// # Errors
    /// A history already full; a driver error.
    pub(crate) fn record_scalars(&self, h: &mut ScalarHistory) -> Result<(), TrainError> {
        let at = h.written * KEPT;
        if at + KEPT > h.rows.len() {
            return Err(TrainError::Config(format!(
                "the loss-scale history holds {} steps",
                h.rows.len() / KEPT
            )));
        }
        let s = self.step.executor().region(Region::S).map_err(amp_error)?;
        let src = s.slice(0..KEPT);
        let mut dst = h.rows.slice_mut(at..at + KEPT);
        self.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| driver("copy the scalars into the history", e))?;
        h.written += 1;
        Ok(())
    }

    /// The curve of the recorded steps (downloads the history: waits for the stream), with
    /// images per second from `images_per_sec(done)` for the step `done` steps into the run;
    /// loss and accuracy are filled in from the metrics log afterwards.
    ///
    /// # Errors
    /// A driver error.
    pub(crate) fn curve_from(
        &self,
        h: &ScalarHistory,
        images_per_sec: impl Fn(usize) -> f64,
    ) -> Result<Vec<CurvePoint>, TrainError> {
        let bytes = self
            .stream
            .clone_dtoh(&h.rows)
            .map_err(|e| driver("download the loss-scale history", e))?;
        Ok(bytes
            .chunks_exact(KEPT)
            .take(h.written)
            .enumerate()
            .map(|(k, row)| CurvePoint {
                step: h.first + k + 1,
                loss: f32::NAN,
                accuracy: f32::NAN,
                loss_scale: f32_at(row, s_layout::LOSS_SCALE),
                lr: f32_at(row, s_layout::LR),
                images_per_sec: images_per_sec(k + 1),
            })
            .collect())
    }
}
