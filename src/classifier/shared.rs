//! [`Classifier`]: the network, its head and the amp step on one [`Backend`], with the calls
//! every backend answers the same way written once: the memory plan and initial weights, the
//! batch checks, a forward and backward pass, the optimizer step over its micro-batches,
//! evaluation and the running statistics.

use super::backend::{Backend, BucketReduce};
use super::step_sync::StepSync;
use super::{check_batch, check_micro_batches, ClassifierError, EvalWeights, Evaluation};
use crate::amp::plan::{MemoryPlan, Region};
use crate::amp::range::Scalars;
use crate::amp::step::{AmpExecutor, AmpStep, StepConfig};
use crate::amp::AmpError;
use crate::fusion::cbr::Pass;
use crate::net::{initial_weights, memory_plan_of, CompiledNet, GradSchedule, PlanContents};
use crate::netops::head::HeadShape;
use std::fmt;

type Result<T> = std::result::Result<T, ClassifierError>;

/// A classifier on backend `B`: a compiled network with a global-average-pool, FC and
/// softmax cross-entropy head, and the amp step over one memory plan (module docs of
/// [`crate::classifier`]). [`super::CpuClassifier`] and [`super::CudaClassifier`] name the
/// two backends'.
pub struct Classifier<B: Backend> {
    pub(super) backend: B,
    pub(super) step: AmpStep<B::Regions>,
    pub(super) shape: HeadShape,
}

impl<B: Backend + fmt::Debug> fmt::Debug for Classifier<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Classifier")
            .field("backend", &self.backend)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// The memory plan of a classifier: `net`'s parameters and an FC head of `classes` outputs,
/// the EMA regions E and E16 when `config` keeps an EMA, the accumulator GA when it
/// accumulates several micro-batches, and the network's step-long buffers with `buffers`.
pub(super) fn step_plan(
    net: &CompiledNet,
    classes: usize,
    config: &StepConfig,
    buffers: bool,
) -> Result<MemoryPlan> {
    let contents = PlanContents {
        ema: config.ema_decay.is_some(),
        buffers,
    };
    let plan = memory_plan_of(net, classes, contents)?;
    // Gradient accumulation adds the FP32 accumulator GA; nothing else moves.
    Ok(if config.accum > 1 {
        plan.with_grad_accumulator()?
    } else {
        plan
    })
}

impl<B: Backend> Classifier<B> {
    /// The amp step of `config` on `regions` (made from [`step_plan`]), the master weights
    /// from [`initial_weights`] of `seed` (the same on every backend), then `before_init`
    /// (which may overwrite W: a group's broadcast), then A and the EMA made from W.
    pub(super) fn amp_step<T>(
        net: &CompiledNet,
        classes: usize,
        config: StepConfig,
        seed: u64,
        mut regions: B::Regions,
        before_init: impl FnOnce(&mut AmpStep<B::Regions>) -> Result<T>,
    ) -> Result<(AmpStep<B::Regions>, T)> {
        for (name, values) in initial_weights(net, classes, seed) {
            B::write_master(&mut regions, &name, &values)?;
        }
        let mut step = AmpStep::new(regions, config)?;
        let out = before_init(&mut step)?;
        step.init_weights()?;
        Ok((step, out))
    }

    /// The classifier of `backend` and `step`, its head of `classes` outputs.
    pub(super) fn assemble(backend: B, step: AmpStep<B::Regions>, classes: usize) -> Self {
        let net = backend.compiled();
        let shape = HeadShape::new(net.batch, net.out_hw * net.out_hw, net.features, classes);
        Classifier {
            backend,
            step,
            shape,
        }
    }

    /// The amp step (begin, finish, capture, replay, learning rate, loss scale, regions).
    pub fn step(&self) -> &AmpStep<B::Regions> {
        &self.step
    }

    /// The amp step, to drive it.
    pub fn step_mut(&mut self) -> &mut AmpStep<B::Regions> {
        &mut self.step
    }

    /// The compiled network.
    pub fn compiled(&self) -> &CompiledNet {
        self.backend.compiled()
    }

    /// When each gradient bucket of this classifier's memory plan is final in its backward
    /// pass ([`crate::net::grad_schedule`]): the schedule a data-parallel step reduces by
    /// ([`Classifier::train_micro_batch_synced`]).
    ///
    /// # Errors
    /// A plan whose buckets the network does not write.
    pub fn grad_schedule(&self) -> Result<GradSchedule> {
        let plan = self.step.executor().plan();
        Ok(crate::net::grad_schedule(self.backend.compiled(), plan)?)
    }

    /// Values of one batch's NHWC FP16 images.
    fn input_elems(&self) -> usize {
        let net = self.backend.compiled();
        net.buffers[net.input].elems
    }

    /// Checks a batch of `images` values and its labels against the network and the head.
    pub(super) fn check(&self, images: usize, labels: &[i32]) -> Result<()> {
        let (batch, classes) = (self.shape.batch, self.shape.classes);
        check_batch(images, self.input_elems(), labels, batch, classes)
    }

    /// One forward and backward pass on a batch (`images` NHWC FP16, `labels`): the network,
    /// the head and the backward pass; gradients land in G16 (conv weights) and G (BN, FC),
    /// scaled by the current loss scale. Returns what the backend's head gives back
    /// ([`Backend::Metrics`]: the batch's loss and accuracy on the CPU; on a GPU they stay on
    /// the device, [`super::CudaClassifier::metrics_blocking`]).
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size or a label out of range
    /// (nothing runs); a refused plan, op or kernel; a driver error.
    pub fn forward_backward(
        &mut self,
        images: B::Images<'_>,
        labels: &[i32],
    ) -> Result<B::Metrics> {
        self.pass_of(images, labels, None)
    }

    /// [`Classifier::forward_backward`] for a data-parallel step: each gradient bucket is in
    /// the regions and handed to `reduce` as soon as the backward pass has made it final
    /// (`schedule`, from [`crate::net::grad_schedule`] for this classifier's network and
    /// plan), the deepest first, while the shallower layers' backward is still to run
    /// ([`Backend::backward_reduced`]).
    ///
    /// # Errors
    /// As [`Classifier::forward_backward`]; a schedule of another network; `reduce`'s error
    /// (the pass stops there).
    pub fn forward_backward_reduced(
        &mut self,
        images: B::Images<'_>,
        labels: &[i32],
        schedule: &GradSchedule,
        reduce: &mut BucketReduce<'_, B::Regions>,
    ) -> Result<B::Metrics> {
        self.pass_of(images, labels, Some((schedule, reduce)))
    }

    /// Labels, forward, head, backward (reduced bucket by bucket with `reduce`).
    fn pass_of(
        &mut self,
        mut images: B::Images<'_>,
        labels: &[i32],
        reduce: Option<(&GradSchedule, &mut BucketReduce<'_, B::Regions>)>,
    ) -> Result<B::Metrics> {
        self.check(B::images_len(&images), labels)?;
        let regions = self.step.executor_mut();
        let trained = EvalWeights::Trained;
        let backend = &mut self.backend;
        backend.load_labels(labels)?;
        backend.network_pass(regions, B::reborrow(&mut images), Pass::Forward, trained)?;
        backend.head_forward(regions)?;
        let metrics = backend.head_backward(regions)?;
        match reduce {
            None => backend.network_pass(regions, images, Pass::Backward, trained)?,
            Some((schedule, reduce)) => {
                backend.backward_reduced(regions, images, schedule, reduce)?
            }
        }
        Ok(metrics)
    }

    /// One optimizer step over `micro_batches` (images NHWC FP16, labels), as many as the
    /// step's [`StepConfig::accum`]: for each, [`AmpStep::begin`] and
    /// [`Classifier::forward_backward`] (BN normalizes with that micro-batch's statistics and
    /// updates the running statistics once per micro-batch, as PyTorch's does), then
    /// [`AmpStep::accumulate`] (the gradients added in FP32 into GA), or [`AmpStep::finish`]
    /// after the last one: the check, SGD (unscaling by `1 / (loss_scale · N)`) and the scale
    /// update run once, over the sum of the micro-batches' gradients. Returns what each
    /// micro-batch's pass returned. On a GPU everything is enqueued without a host sync, and a
    /// stream capture of it is a replayable step.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a count other than the step's (nothing runs) or a bad
    /// micro-batch (the step stops there, before its update); a refused plan, op or kernel; a
    /// driver error.
    pub fn train_step(
        &mut self,
        micro_batches: &mut [(B::Images<'_>, &[i32])],
    ) -> Result<Vec<B::Metrics>> {
        check_micro_batches(micro_batches.len(), self.step.config().accum)?;
        let n = micro_batches.len();
        let mut metrics = Vec::with_capacity(n);
        for (k, (images, labels)) in micro_batches.iter_mut().enumerate() {
            metrics.push(self.train_micro_batch(k, B::reborrow(images), labels, |_| Ok(()))?);
        }
        Ok(metrics)
    }

    /// Micro-batch `k` (from 0) of an optimizer step of [`StepConfig::accum`] micro-batches,
    /// for a loop that makes them one at a time: [`AmpStep::begin`],
    /// [`Classifier::forward_backward`], then `inspect` on the regions (this micro-batch's
    /// gradients in G16 and G, before they are added or applied: a fault drill's or a gradient
    /// check's hook), then [`AmpStep::accumulate`], or [`AmpStep::finish`] after the last
    /// (`k + 1 == accum`). [`Classifier::train_step`] is this over a whole step.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for `k` not below the step's micro-batch count (nothing runs)
    /// or a bad batch; what `inspect` returns; as [`Classifier::train_step`].
    pub fn train_micro_batch(
        &mut self,
        k: usize,
        images: B::Images<'_>,
        labels: &[i32],
        inspect: impl FnOnce(&mut B::Regions) -> Result<()>,
    ) -> Result<B::Metrics> {
        self.micro_batch_of(k, images, labels, None, inspect)
    }

    /// [`Classifier::train_micro_batch`] as one rank of a data-parallel step (every rank calls
    /// it together, with its shard): the gradient buckets summed over the ranks through `sync`
    /// as the backward pass makes them final ([`Classifier::forward_backward_reduced`] with
    /// `schedule`), then [`AmpStep::accumulate`], or after the last micro-batch
    /// [`AmpStep::finish_with`] sharing the overflow flag, so that SGD unscales the sums by
    /// `1 / (loss_scale · ranks · N)` ([`AmpStep::set_ranks`]) and every rank skips together.
    /// A failed pass is told to the others ([`StepSync::fail`]).
    ///
    /// # Errors
    /// As [`Classifier::train_micro_batch`]; what `sync` returns.
    pub fn train_micro_batch_synced(
        &mut self,
        k: usize,
        images: B::Images<'_>,
        labels: &[i32],
        schedule: &GradSchedule,
        sync: &mut dyn StepSync<B::Regions>,
    ) -> Result<B::Metrics> {
        self.micro_batch_of(k, images, labels, Some((schedule, sync)), |_| Ok(()))
    }

    /// The micro-batch sequence, local or (with `sync`) data-parallel.
    fn micro_batch_of(
        &mut self,
        k: usize,
        images: B::Images<'_>,
        labels: &[i32],
        mut sync: Option<(&GradSchedule, &mut dyn StepSync<B::Regions>)>,
        inspect: impl FnOnce(&mut B::Regions) -> Result<()>,
    ) -> Result<B::Metrics> {
        let n = self.step.config().accum.max(1) as usize;
        if k >= n {
            return Err(ClassifierError::Input(format!(
                "micro-batch {k} of a step that accumulates {n} (StepConfig::accum)"
            )));
        }
        self.step.begin()?;
        let metrics = match sync.as_mut() {
            None => self.forward_backward(images, labels)?,
            Some((schedule, sync)) => {
                let mut reduce = |r: &mut B::Regions, b| sync.reduce_bucket(r, b);
                match self.forward_backward_reduced(images, labels, schedule, &mut reduce) {
                    Ok(m) => {
                        sync.join(self.step.executor_mut())?;
                        m
                    }
                    Err(e) => {
                        sync.fail(&format!("its forward/backward failed: {e}"));
                        return Err(e);
                    }
                }
            }
        };
        inspect(self.step.executor_mut())?;
        match sync {
            _ if k + 1 < n => self.step.accumulate()?,
            None => self.step.finish()?,
            Some((_, sync)) => self.step.finish_with(|r| sync.share_overflow(r))?,
        }
        Ok(metrics)
    }

    /// Evaluates one batch of `images` (NHWC FP16): forward only, BN in evaluation mode (each
    /// layer normalizes with its running statistics), then the pooling and the FC layer, with
    /// the trained or the EMA weights ([`EvalWeights`]). Running statistics, weights, the step
    /// and the last training batch's metrics are left as they were. On a GPU the logits are
    /// read back (this waits for the stream).
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size; the EMA weights of a step
    /// that keeps none ([`ClassifierError::Input`] on the CPU,
    /// [`crate::amp::PlanError::RegionAbsent`] on a GPU); a running variance below `−ε`; a
    /// driver error.
    pub fn evaluate(&mut self, images: B::Images<'_>, weights: EvalWeights) -> Result<Evaluation> {
        self.check(B::images_len(&images), &vec![0; self.shape.batch])?;
        let logits = self
            .backend
            .eval_logits(self.step.executor_mut(), images, weights)?;
        Ok(Evaluation::from_logits(logits, self.shape.classes))
    }

    /// Every layer's running statistics (`stem.running_mean`, `stem.running_var`, …), in the
    /// network's buffer order: what a checkpoint saves besides the amp regions. On a GPU they
    /// are downloaded (blocking).
    ///
    /// # Errors
    /// A statistic the network does not hold as FP32; a driver error.
    pub fn running_stats(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let net = self.backend.compiled();
        crate::net::cuda::running_stats(net)
            .map(|id| {
                let name = &net.buffers[id].name;
                Ok((name.clone(), self.backend.read_running_stat(name)?))
            })
            .collect()
    }

    /// Overwrites running statistic `name` (as [`Classifier::running_stats`] names it), e.g.
    /// from a checkpoint (on a GPU in stream order).
    ///
    /// # Errors
    /// An unknown name or a length other than the statistic's; a driver error.
    pub fn set_running_stat(&mut self, name: &str, values: Vec<f32>) -> Result<()> {
        self.backend.write_running_stat(name, values)
    }

    /// The images (padding included) of those of `regions` the plan has, in that order: what
    /// a checkpoint or a snapshot saves. On a device they are downloaded (blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn region_images(&self, regions: &[Region]) -> Result<Vec<(Region, Vec<u8>)>> {
        let executor = self.step.executor();
        regions
            .iter()
            .filter(|&&r| executor.plan().has_region(r))
            .map(|&r| Ok((r, B::region_bytes(executor, r)?)))
            .collect()
    }

    /// Restores a checkpoint's state and waits for it: `regions` in order (W, then A and the
    /// EMA made from it; S through [`AmpStep::restore_scalars`], with this step's SGD values;
    /// any other region as it is), then the running statistics.
    ///
    /// # Errors
    /// A state of another network (a region the plan lacks, an image or a statistic of
    /// another size); a driver error.
    pub fn load_state(
        &mut self,
        regions: &[(Region, Vec<u8>)],
        running: &[(String, Vec<f32>)],
    ) -> Result<()> {
        let mut scalars = None;
        for (r, bytes) in regions {
            match r {
                Region::W => {
                    B::load_region_bytes(self.step.executor_mut(), *r, bytes)?;
                    self.step.init_weights()?;
                }
                Region::S => scalars = Some(Scalars::from_bytes(bytes).map_err(AmpError::from)?),
                _ => B::load_region_bytes(self.step.executor_mut(), *r, bytes)?,
            }
        }
        if let Some(s) = scalars {
            self.step.restore_scalars(&s)?;
        }
        for (name, values) in running {
            self.set_running_stat(name, values.clone())?;
        }
        self.backend.synchronize()
    }
}
