//! The head's device buffers, the engine's steps 1–6 on the resident batch (the head's passes
//! themselves are the backend's, `passes.rs`), the batch's way into the network's fixed input
//! (uploaded, or taken from a double-buffered copy), and the last batch's metrics read back.

use super::{driver, CudaClassifier, Result};
use crate::amp::cuda::{CudaSlice, CudaStream, DevRangeMut, DoubleInput};
use crate::amp::plan::ByteRange;
use crate::classifier::backend::Backend;
use crate::classifier::ClassifierError;
use crate::netops::head::{self, metrics_log_bytes, HeadMetrics, HeadShape};
use half::f16;
use std::sync::Arc;

/// The head's device buffers (bytes, typed by the kernels' checks).
#[derive(Debug)]
pub(super) struct Head {
    pub(super) shape: HeadShape,
    /// FP32 `[batch, features]`.
    pub(super) pooled: CudaSlice<u8>,
    /// FP16 `[batch, classes]`.
    pub(super) logits: CudaSlice<u8>,
    /// FP16 `[batch, classes]`, scaled by the loss scale.
    pub(super) dlogits: CudaSlice<u8>,
    /// FP32 `[batch]` per-row losses.
    pub(super) loss: CudaSlice<u8>,
    /// FP32 `[batch, features]`.
    pub(super) dpooled: CudaSlice<u8>,
    /// i32 `[batch]`.
    pub(super) labels: CudaSlice<u8>,
    /// The training metrics log, one entry per micro-batch (when the engine keeps one).
    pub(super) log: Option<CudaSlice<u8>>,
    /// The evaluation metrics log.
    pub(super) eval_log: CudaSlice<u8>,
    /// The labels of the last caller-buffer batch, for [`CudaClassifier::metrics_blocking`].
    pub(super) host_labels: Vec<i32>,
}

impl Head {
    /// The buffers of `shape`, a training log of `log_entries` (none for 0) and an evaluation
    /// log of `eval_batches` entries (at least one).
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        shape: HeadShape,
        log_entries: usize,
        eval_batches: usize,
    ) -> Result<Self> {
        let alloc = |bytes: usize, what: &str| {
            stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(|e| driver(&format!("allocate the head's {what}"), e))
        };
        Ok(Head {
            pooled: alloc(4 * shape.pooled_elems(), "pooled features")?,
            logits: alloc(2 * shape.logits_elems(), "logits")?,
            dlogits: alloc(2 * shape.logits_elems(), "logit gradients")?,
            loss: alloc(4 * shape.batch, "per-row losses")?,
            dpooled: alloc(4 * shape.pooled_elems(), "pooled gradients")?,
            labels: alloc(4 * shape.batch, "labels")?,
            log: match log_entries {
                0 => None,
                n => Some(alloc(metrics_log_bytes(n), "metrics log")?),
            },
            eval_log: alloc(metrics_log_bytes(eval_batches.max(1)), "held-out log")?,
            host_labels: Vec::new(),
            shape,
        })
    }
}

impl CudaClassifier {
    /// Backward through the network on the resident input, with the gradient joins at block
    /// inputs; in a group, each gradient bucket's NCCL sum is enqueued as soon as backward has
    /// written it, on the communication stream, so it overlaps the shallower layers' backward.
    fn backward(&mut self) -> Result<()> {
        match &self.backend.group {
            None => Ok(self.backend.net.backward_with(self.step.executor_mut())?),
            Some(g) => {
                let mut sync = g.sync.clone();
                Ok(self.backend.net.backward_overlapped(
                    self.step.executor_mut(),
                    None,
                    &g.schedule,
                    &mut |regions, bucket, after| Ok(sync.reduce_after(regions, bucket, after)?),
                )?)
            }
        }
    }

    /// Steps 1–6 of the module table on the resident batch (the network's input buffer and the
    /// head's labels, filled by [`CudaClassifier::upload_batch`] or
    /// [`CudaClassifier::take_input`]): zero the gradients, forward, head, backward.
    ///
    /// # Errors
    /// A refused plan or kernel; a driver or NCCL error.
    pub fn run_forward_backward(&mut self) -> Result<()> {
        self.step.begin()?;
        let regions = self.step.executor_mut();
        self.backend.net.forward_with(regions)?;
        self.backend.head_forward(regions)?;
        self.backend.head_backward(regions)?;
        self.backward()
    }

    /// The network's forward pass on the resident input in evaluation mode (BN from the running
    /// statistics, none written: [`crate::net::CudaNet::evaluate_with`]), then the head's.
    pub(super) fn forward_eval(&mut self) -> Result<()> {
        let regions = self.step.executor_mut();
        self.backend.net.evaluate_with(regions)?;
        self.backend.head_forward(regions)
    }

    /// Bytes of one batch's NHWC FP16 images.
    pub fn image_bytes(&self) -> usize {
        let net = self.backend.net.compiled();
        2 * net.buffers[net.input].elems
    }

    /// Copies one batch in: NHWC FP16 images into the network's input, labels into the head,
    /// through the double-buffered page-locked staging ([`crate::amp::cuda::Upload`]):
    /// asynchronous, waiting only while the device is two batches behind. Not during a stream
    /// capture.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size; a driver error.
    pub fn upload_batch(&mut self, images: &[f16], labels: &[i32]) -> Result<()> {
        self.check_host_batch(images, labels)?;
        let image_bytes: Vec<u8> = images.iter().flat_map(|v| v.to_le_bytes()).collect();
        let label_bytes: Vec<u8> = labels.iter().flat_map(|l| l.to_le_bytes()).collect();
        let input = self.backend.net.compiled().input;
        let x = self.backend.net.buffer_mut(input)?;
        let x = DevRangeMut::new(x, ByteRange::new(0, image_bytes.len()))?;
        let labels = DevRangeMut::new(
            &mut self.backend.head.labels,
            ByteRange::new(0, label_bytes.len()),
        )?;
        Ok(self.backend.staging.upload(
            &self.backend.stream,
            &mut [(&image_bytes, x), (&label_bytes, labels)],
        )?)
    }

    /// Checks a host batch's sizes against the network's input and the head.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] naming the sizes.
    pub fn check_host_batch(&self, images: &[f16], labels: &[i32]) -> Result<()> {
        let batch = self.backend.head.shape.batch;
        let pixels = self.image_bytes() / 2;
        if labels.len() != batch || images.len() != pixels {
            return Err(ClassifierError::Input(format!(
                "a batch of {batch} needs {batch} labels and {pixels} image values, got {} and {}",
                labels.len(),
                images.len()
            )));
        }
        Ok(())
    }

    /// Copies batch `i` of `input` (staged there as the images' bytes, then the labels')
    /// into the network's input and the head's labels on the compute stream, after its
    /// host → device copy ([`DoubleInput::consume`]). Stage batch `i + 1` after enqueuing the
    /// step of `i`: its copy then runs beside the step. `input` needs
    /// [`CudaClassifier::image_bytes`] plus 4 bytes a label.
    ///
    /// # Errors
    /// A batch not staged (out of order); a driver error.
    pub fn take_input(&mut self, input: &mut DoubleInput, i: u64) -> Result<()> {
        let image_bytes = self.image_bytes();
        let label_bytes = 4 * self.backend.head.shape.batch;
        let x = self
            .backend
            .net
            .buffer_mut(self.backend.net.compiled().input)?;
        let x = DevRangeMut::new(x, ByteRange::new(0, image_bytes))?;
        let y = DevRangeMut::new(
            &mut self.backend.head.labels,
            ByteRange::new(0, label_bytes),
        )?;
        Ok(input.consume(i, &self.backend.stream, &mut [x, y])?)
    }

    /// The last caller-buffer batch's loss and accuracy, read back (waits for the stream:
    /// call it every few steps, not every step).
    ///
    /// # Errors
    /// A driver error; no batch run yet.
    pub fn metrics_blocking(&self) -> Result<HeadMetrics> {
        if self.backend.head.host_labels.is_empty() {
            return Err(ClassifierError::Input("no batch has run yet".into()));
        }
        let read = |b: &CudaSlice<u8>, what: &str| {
            self.backend
                .stream
                .clone_dtoh(b)
                .map_err(|e| driver(&format!("read the {what} back"), e))
        };
        let logits: Vec<f16> = read(&self.backend.head.logits, "logits")?
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        let loss: Vec<f32> = read(&self.backend.head.loss, "losses")?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let shape = self.backend.head.shape;
        Ok(head::head_metrics(
            &logits[..shape.logits_elems()],
            &self.backend.head.host_labels,
            Some(&loss[..shape.batch]),
            shape.classes,
        )?)
    }
}
