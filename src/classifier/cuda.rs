//! [`CudaClassifier`]: a compiled network on cuDNN, the head on amp's kernels, the amp step on
//! [`CudaRegions`], all on the handle's stream. The caller's image buffer is read in place
//! (borrowed for each pass); labels are copied into the head's own buffer.

use super::{check_batch, ClassifierError, EvalWeights, Evaluation};
use crate::amp::cuda::{CudaRegions, CudaSlice, CudaStream, DevRange, DevRangeMut};
use crate::amp::plan::Region;
use crate::amp::range::{self, HeadMetrics, HeadShape};
use crate::amp::step::{AmpStep, StepConfig};
use crate::fusion::exec::Handle;
use crate::net::{initial_weights, memory_plan_of, CompiledNet, CudaNet, PlanContents};
use half::f16;
use std::sync::Arc;

type Result<T> = std::result::Result<T, ClassifierError>;

/// The head's device buffers (bytes; FP32 pooled features and losses, FP16 logits).
#[derive(Debug)]
struct Head {
    shape: HeadShape,
    pooled: CudaSlice<u8>,
    logits: CudaSlice<u8>,
    dlogits: CudaSlice<u8>,
    loss: CudaSlice<u8>,
    dpooled: CudaSlice<u8>,
    labels: CudaSlice<u8>,
    /// The labels of the last batch, for the metrics.
    host_labels: Vec<i32>,
}

/// A classifier on a GPU.
#[derive(Debug)]
pub struct CudaClassifier {
    net: CudaNet,
    step: AmpStep<CudaRegions>,
    head: Head,
    stream: Arc<CudaStream>,
}

fn driver(what: &str, e: impl std::fmt::Display) -> ClassifierError {
    ClassifierError::Driver {
        what: what.to_string(),
        message: e.to_string(),
    }
}

impl CudaClassifier {
    /// The network (compiled with a planned policy for `handle`'s target) with an FC head of
    /// `classes` outputs, its memory plan in device regions on the handle's stream, and the
    /// amp step of `config`; the master weights start from [`initial_weights`] of `seed`
    /// (the same as [`super::CpuClassifier`]'s). A `config` that accumulates gradients over
    /// several micro-batches ([`StepConfig::with_accum`]) gets the accumulator GA
    /// ([`CudaClassifier::train_step`]).
    ///
    /// # Errors
    /// As [`CudaRegions::new`] and [`CudaNet::new`]; a plan or step configuration the amp
    /// layer refuses (`classes` other than the spec's is
    /// [`crate::amp::PlanError::HeadClasses`]).
    pub fn new(
        net: CompiledNet,
        handle: Arc<Handle>,
        classes: usize,
        config: StepConfig,
        seed: u64,
    ) -> Result<Self> {
        let stream = handle.stream().clone();
        // The network's step-long buffers in the plan's liveness-planned tensor arena; E and
        // E16 when the step keeps an EMA (as the CPU classifier's plan).
        let contents = PlanContents {
            ema: config.ema_decay.is_some(),
            buffers: true,
        };
        let plan = memory_plan_of(&net, classes, contents)?;
        let plan = Arc::new(if config.accum > 1 {
            plan.with_grad_accumulator()?
        } else {
            plan
        });
        let mut regions = CudaRegions::new(plan.clone(), stream.clone())?;
        for (name, values) in initial_weights(&net, classes, seed) {
            regions.upload_f32(Region::W, &name, &values)?;
        }
        let kernels = regions.kernels().clone();
        let mut step = AmpStep::new(regions, config)?;
        step.init_weights()?;
        let shape = HeadShape::new(net.batch, net.out_hw * net.out_hw, net.features, classes);
        let net = CudaNet::new(net, handle, kernels, Some(plan))?;
        let alloc = |bytes: usize, what: &str| {
            stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(|e| driver(&format!("allocate the head's {what}"), e))
        };
        let head = Head {
            pooled: alloc(4 * shape.pooled_elems(), "pooled features")?,
            logits: alloc(2 * shape.logits_elems(), "logits")?,
            dlogits: alloc(2 * shape.logits_elems(), "logit gradients")?,
            loss: alloc(4 * shape.batch, "per-row losses")?,
            dpooled: alloc(4 * shape.pooled_elems(), "pooled gradients")?,
            labels: alloc(4 * shape.batch, "labels")?,
            host_labels: Vec::new(),
            shape,
        };
        Ok(CudaClassifier {
            net,
            step,
            head,
            stream,
        })
    }

    /// The amp step (begin, finish, capture, replay, learning rate, loss scale).
    pub fn step(&self) -> &AmpStep<CudaRegions> {
        &self.step
    }

    /// The amp step, to drive it.
    pub fn step_mut(&mut self) -> &mut AmpStep<CudaRegions> {
        &mut self.step
    }

    /// The compiled network.
    pub fn compiled(&self) -> &CompiledNet {
        self.net.compiled()
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
        let output = self.net.compiled().output;
        let kernels = self.step.executor().kernels().clone();
        let h = &mut self.head;
        kernels.gap_forward(
            &self.stream,
            &shape,
            DevRange::whole(self.net.buffer(output)?),
            DevRangeMut::whole(&mut h.pooled),
        )?;
        let regions = self.step.executor_mut();
        regions.fc_forward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&h.pooled),
            DevRangeMut::whole(&mut h.logits),
        )?;
        kernels.softmax_xent_backward_range(
            &self.stream,
            shape.classes,
            DevRange::whole(&h.logits),
            DevRange::whole(&h.labels),
            DevRange::whole(regions.region(Region::S)?),
            DevRangeMut::whole(&mut h.dlogits),
            Some(DevRangeMut::whole(&mut h.loss)),
        )?;
        regions.fc_backward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&h.dlogits),
            DevRange::whole(&h.pooled),
            DevRangeMut::whole(&mut h.dpooled),
        )?;
        let d_out = self.net.compiled().output_grad;
        kernels.gap_backward(
            &self.stream,
            &shape,
            DevRange::whole(&h.dpooled),
            DevRangeMut::whole(self.net.buffer_mut(d_out)?),
        )?;
        self.net
            .backward_from(Some(self.step.executor_mut()), images)?;
        Ok(())
    }

    /// One optimizer step over `micro_batches` (each the caller's image buffer, read in
    /// place, and its labels), as many as the step's [`StepConfig::accum`], enqueued on the
    /// handle's stream without a host sync: for each, [`AmpStep::begin`] and
    /// [`CudaClassifier::forward_backward`] (BN with that micro-batch's statistics), then
    /// [`AmpStep::accumulate`] (`amp_accum_grads` into GA), or [`AmpStep::finish`] after the
    /// last one (the sum into G, then the check, SGD and scale update once). The same
    /// sequence as [`super::CpuClassifier::train_step`]; a stream capture of it is a
    /// replayable step.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a count other than the step's (nothing runs) or a bad
    /// micro-batch; a refused plan or kernel; a driver error.
    pub fn train_step(
        &mut self,
        micro_batches: &mut [(&mut CudaSlice<f16>, &[i32])],
    ) -> Result<()> {
        super::check_micro_batches(micro_batches.len(), self.step.config().accum)?;
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
    /// [`CudaNet::evaluate`]), then the pooling and the FC layer; the logits are read back
    /// (this waits for the stream). Running statistics, weights, the step and the last
    /// training batch's metrics are left as they were.
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
        let kernels = self.step.executor().kernels().clone();
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

    /// The last batch's loss and accuracy, read back (waits for the stream: call it every
    /// few steps, not every step).
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
        Ok(range::head_metrics(
            &logits[..shape.logits_elems()],
            &self.head.host_labels,
            Some(&loss[..shape.batch]),
            shape.classes,
        )?)
    }
}
