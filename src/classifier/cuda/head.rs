//! The head's device buffers and passes (steps 2–6 of the module table), the batch's way in
//! (the caller's buffer read in place, or copied into the network's fixed input), and the
//! evaluation of one batch in the caller's buffer.

use super::{driver, CudaClassifier, Result};
use crate::amp::cuda::{CudaSlice, CudaStream, DevRange, DevRangeMut, DoubleInput};
use crate::amp::plan::{ByteRange, Region};
use crate::classifier::{check_batch, ClassifierError, EvalWeights, Evaluation};
use crate::net::CudaNetError;
use crate::netops::cuda::{AmpKernelsHead, RegionsFc};
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
    /// Pooling and FC of the network's output into the logits (steps 3).
    pub(super) fn head_forward(&mut self) -> Result<()> {
        let shape = self.head.shape;
        let a = self.net.buffer(self.net.compiled().output)?;
        self.kernels.gap_forward(
            &self.stream,
            &shape,
            DevRange::whole(a),
            DevRangeMut::whole(&mut self.head.pooled),
        )?;
        Ok(self.step.executor().fc_forward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&self.head.pooled),
            DevRangeMut::whole(&mut self.head.logits),
        )?)
    }

    /// Loss seed, metrics (with a log), FC and pooling backward into the network output's
    /// gradient (steps 4–5).
    pub(super) fn head_backward(&mut self) -> Result<()> {
        let shape = self.head.shape;
        let h = &mut self.head;
        self.kernels.softmax_xent_backward_range(
            &self.stream,
            shape.classes,
            DevRange::whole(&h.logits),
            DevRange::whole(&h.labels),
            DevRange::whole(self.step.executor().region(Region::S)?),
            DevRangeMut::whole(&mut h.dlogits),
            Some(DevRangeMut::whole(&mut h.loss)),
        )?;
        if let Some(log) = h.log.as_mut() {
            self.kernels.head_metrics(
                &self.stream,
                shape.classes,
                DevRange::whole(&h.logits),
                DevRange::whole(&h.labels),
                Some(DevRange::whole(&h.loss)),
                DevRangeMut::whole(log),
            )?;
        }
        self.step.executor_mut().fc_backward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&h.dlogits),
            DevRange::whole(&h.pooled),
            DevRangeMut::whole(&mut h.dpooled),
        )?;
        let d_out = self.net.compiled().output_grad;
        let d_out = self.net.buffer_mut(d_out)?;
        Ok(self.kernels.gap_backward(
            &self.stream,
            &shape,
            DevRange::whole(&h.dpooled),
            DevRangeMut::whole(d_out),
        )?)
    }

    /// Backward through the network on the resident input, with the gradient joins at block
    /// inputs; in a group, each gradient bucket's NCCL sum is enqueued as soon as backward has
    /// written it, on the communication stream, so it overlaps the shallower layers' backward.
    fn backward(&mut self) -> Result<()> {
        match &self.group {
            None => Ok(self.net.backward_with(self.step.executor_mut())?),
            Some(g) => {
                let comm = g.comm.clone();
                Ok(self.net.backward_overlapped(
                    self.step.executor_mut(),
                    None,
                    &g.schedule,
                    &mut |regions, bucket, after| {
                        let mut comm = crate::amp::cuda::dist_grads::lock(&comm);
                        crate::amp::cuda::dist_grads::all_reduce_bucket(
                            regions, &mut comm, bucket, after,
                        )
                        .map_err(CudaNetError::from)
                    },
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
        self.net.forward_with(self.step.executor_mut())?;
        self.head_forward()?;
        self.head_backward()?;
        self.backward()
    }

    /// The network's forward pass on the resident input in evaluation mode (BN from the running
    /// statistics, none written: [`crate::net::CudaNet::evaluate_with`]), then the head's.
    pub(super) fn forward_eval(&mut self) -> Result<()> {
        self.net.evaluate_with(self.step.executor_mut())?;
        self.head_forward()
    }

    /// Bytes of one batch's NHWC FP16 images.
    pub fn image_bytes(&self) -> usize {
        let net = self.net.compiled();
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
        let input = self.net.compiled().input;
        let x = self.net.buffer_mut(input)?;
        let x = DevRangeMut::new(x, ByteRange::new(0, image_bytes.len()))?;
        let labels = DevRangeMut::new(&mut self.head.labels, ByteRange::new(0, label_bytes.len()))?;
        Ok(self.staging.upload(
            &self.stream,
            &mut [(&image_bytes, x), (&label_bytes, labels)],
        )?)
    }

    /// Checks a host batch's sizes against the network's input and the head.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] naming the sizes.
    pub fn check_host_batch(&self, images: &[f16], labels: &[i32]) -> Result<()> {
        let batch = self.head.shape.batch;
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
        let label_bytes = 4 * self.head.shape.batch;
        let x = self.net.buffer_mut(self.net.compiled().input)?;
        let x = DevRangeMut::new(x, ByteRange::new(0, image_bytes))?;
        let y = DevRangeMut::new(&mut self.head.labels, ByteRange::new(0, label_bytes))?;
        Ok(input.consume(i, &self.stream, &mut [x, y])?)
    }

    /// One forward and backward pass on a batch, enqueued on the handle's stream (nothing
    /// waits for the GPU): `images` (NHWC FP16, the caller's buffer, read in place) and
    /// `labels` (copied in). Gradients land in G16 (conv weights) and G (BN, FC), scaled by
    /// the loss scale on the device.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size or a label out of range; a
    /// refused plan or kernel; a driver error.
    pub fn forward_backward(&mut self, images: &mut CudaSlice<f16>, labels: &[i32]) -> Result<()> {
        let shape = self.head.shape;
        let net = self.net.compiled();
        let want = net.buffers[net.input].elems;
        check_batch(images.len(), want, labels, shape.batch, shape.classes)?;
        let bytes: Vec<u8> = labels.iter().flat_map(|l| l.to_le_bytes()).collect();
        self.stream
            .memcpy_htod(&bytes, &mut self.head.labels)
            .map_err(|e| driver("copy the labels in", e))?;
        self.head.host_labels = labels.to_vec();
        self.net
            .forward_from(Some(self.step.executor_mut()), images)?;
        self.head_forward()?;
        self.head_backward()?;
        self.net
            .backward_from(Some(self.step.executor_mut()), images)?;
        Ok(())
    }

    /// One optimizer step over `micro_batches` (each the caller's image buffer, read in
    /// place, and its labels), as many as the step's [`crate::amp::step::StepConfig::accum`],
    /// enqueued on the handle's stream without a host sync: for each,
    /// [`crate::amp::step::AmpStep::begin`] and [`CudaClassifier::forward_backward`] (BN with
    /// that micro-batch's statistics), then [`crate::amp::step::AmpStep::accumulate`]
    /// (`amp_accum_grads` into GA), or [`crate::amp::step::AmpStep::finish`] after the last
    /// one (the sum into G, then the check, SGD and scale update once). The same sequence as
    /// [`crate::classifier::CpuClassifier::train_step`]; a stream capture of it is a
    /// replayable step.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a count other than the step's (nothing runs) or a bad
    /// micro-batch; a refused plan or kernel; a driver error.
    pub fn train_step(
        &mut self,
        micro_batches: &mut [(&mut CudaSlice<f16>, &[i32])],
    ) -> Result<()> {
        crate::classifier::check_micro_batches(micro_batches.len(), self.step.config().accum)?;
        let n = micro_batches.len();
        for (k, (images, labels)) in micro_batches.iter_mut().enumerate() {
            self.step.begin()?;
            self.forward_backward(images, labels)?;
            if k + 1 < n {
                self.step.accumulate()?;
            } else {
                self.step.finish()?;
            }
        }
        Ok(())
    }

    /// Evaluates one batch of `images` (NHWC FP16, read in place): forward only, BN in
    /// evaluation mode (each layer normalizes with its running statistics:
    /// [`crate::net::CudaNet::evaluate`]), then the pooling and the FC layer; the logits are
    /// read back (this waits for the stream). Running statistics, weights, the step and the
    /// last training batch's metrics are left as they were.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size; the EMA weights of a
    /// classifier made without an EMA ([`crate::amp::PlanError::RegionAbsent`]); a driver
    /// error.
    pub fn evaluate(
        &mut self,
        images: &mut CudaSlice<f16>,
        weights: EvalWeights,
    ) -> Result<Evaluation> {
        if weights == EvalWeights::Ema {
            let aside = self.step.executor_mut().swap_in_ema()?;
            let out = self.evaluate(images, EvalWeights::Trained);
            // Always restored, so that a failed evaluation leaves the trained weights.
            self.step.executor_mut().swap_back(aside)?;
            return out;
        }
        let shape = self.head.shape;
        let net = self.net.compiled();
        let want = net.buffers[net.input].elems;
        check_batch(
            images.len(),
            want,
            &vec![0; shape.batch],
            shape.batch,
            shape.classes,
        )?;
        self.net
            .evaluate_from(Some(self.step.executor_mut()), images)?;
        let output = self.net.compiled().output;
        let kernels = self.kernels.clone();
        // Logits of their own, so that the last training batch's metrics stay readable.
        let mut logits = self
            .stream
            .alloc_zeros::<u8>(shape.batch * shape.classes * 2)
            .map_err(|e| driver("allocate the evaluation logits", e))?;
        kernels.gap_forward(
            &self.stream,
            &shape,
            DevRange::whole(self.net.buffer(output)?),
            DevRangeMut::whole(&mut self.head.pooled),
        )?;
        self.step.executor_mut().fc_forward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&self.head.pooled),
            DevRangeMut::whole(&mut logits),
        )?;
        let logits: Vec<f16> = self
            .stream
            .clone_dtoh(&logits)
            .map_err(|e| driver("read the evaluation logits back", e))?
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        Ok(Evaluation::from_logits(logits, shape.classes))
    }

    /// The last caller-buffer batch's loss and accuracy, read back (waits for the stream:
    /// call it every few steps, not every step).
    ///
    /// # Errors
    /// A driver error; no batch run yet.
    pub fn metrics_blocking(&self) -> Result<HeadMetrics> {
        if self.head.host_labels.is_empty() {
            return Err(ClassifierError::Input("no batch has run yet".into()));
        }
        let read = |b: &CudaSlice<u8>, what: &str| {
            self.stream
                .clone_dtoh(b)
                .map_err(|e| driver(&format!("read the {what} back"), e))
        };
        let logits: Vec<f16> = read(&self.head.logits, "logits")?
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        let loss: Vec<f32> = read(&self.head.loss, "losses")?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let shape = self.head.shape;
        Ok(head::head_metrics(
            &logits[..shape.logits_elems()],
            &self.head.host_labels,
            Some(&loss[..shape.batch]),
            shape.classes,
        )?)
    }
}
