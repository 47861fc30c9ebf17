//! Data-parallel training: the distribution layer's communicators, collectives, launcher
//! bootstrap and watchdog (the workspace crate `cudnn-cbr-dist`, whose one public path is this
//! module), and data-parallel training on the CPU executor: each rank a thread with its own
//! [`CpuClassifier`] on its shard of the global batch, the ranks joined by an in-process group
//! ([`CpuGroup`]).
//!
//! A [`CpuReplica`] step is the classifier's data-parallel micro-batch
//! ([`crate::classifier::Classifier::train_micro_batch_synced`], the same for both backends)
//! over this module's communicators: begin, forward and backward on the shard, the gradients
//! summed over the ranks bucket by bucket (deepest first), the overflow flag shared (max)
//! between the check and SGD, SGD unscaling the sums by `1 / (loss_scale · ranks)`. The joins
//! ([`crate::classifier::StepSync`]) are [`CpuComm`]'s and, on the CUDA executor,
//! [`NcclStepSync`]'s. With synchronized BN every layer
//! normalizes with the global batch's statistics ([`crate::fusion::cbr::BnSync`]), so N ranks ×
//! batch B train like one rank × batch N·B. With gradient accumulation,
//! [`CpuReplica::train_step`] runs a step's micro-batches, each summed over the ranks and added
//! into the accumulator GA.
//!
//! On the CUDA executor, [`NcclBnSync`] is synchronized BN over a rank's NCCL communicator
//! ([`nccl::NcclComm`]); a launched job finds its rank through [`bootstrap`].
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cudnn_cbr::dist::{CpuGroup, CpuReplica};
//! use cudnn_cbr::fusion::cbr::RouteKind;
//! use cudnn_cbr::net::{compile, Preset, RoutePolicy};
//! use cudnn_cbr::amp::{range::SgdConfig, step::StepConfig};
//! use cudnn_cbr::classifier::CpuClassifier;
//! let ranks = 2;
//! let grads = CpuGroup::ranks(ranks)?;
//! let bn = CpuGroup::ranks(ranks)?; // synchronized BN (leave out for local BN)
//! std::thread::scope(|s| {
//!     for (grads, bn) in grads.into_iter().zip(bn) {
//!         s.spawn(move || -> Result<(), cudnn_cbr::classifier::ClassifierError> {
//!             let spec = Preset::Mini.spec(8, 10, 16);
//!             let net = compile(&spec, 16, 16, &RoutePolicy::Uniform(RouteKind::Fused))?; // per-rank batch 16
//!             let model = CpuClassifier::new(net, 10, StepConfig::new(SgdConfig::new(0.05)), 1)?;
//!             let mut replica = CpuReplica::new(model, grads, Some(bn))?;
//!             # let (images, labels) = (vec![half::f16::ZERO; 16 * 16 * 16 * 8], vec![0; 16]);
//!             let metrics = replica.step(&images, &labels)?; // this rank's shard
//!             println!("global loss {}", metrics.loss);
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok(())
//! # }
//! ```

// The distribution crate's items: this module is their one public path (the workspace crate
// `cudnn-cbr-dist` is not re-exported by name).
pub use cudnn_cbr_dist::cpu::{CpuComm, CpuGroup};
pub use cudnn_cbr_dist::{bootstrap, nccl, same, watchdog};
pub use cudnn_cbr_dist::{Collective, Communicator, DistError, ReduceOp};

use crate::amp::cuda::dist_grads::{self, all_reduce_sum_ordered, SharedComm};
use crate::amp::cuda::{CudaRegions, CudaSlice, CudaStream};
use crate::amp::dist::grads;
use crate::amp::plan::Bucket;
use crate::amp::step::CpuRegions;
use crate::amp::AmpError;
use crate::classifier::{Accuracies, ClassifierError, CpuClassifier, StepSync};
use crate::fusion::cbr::{BnSync, DeviceBnSync};
use crate::net::GradSchedule;
use crate::netops::head::HeadMetrics;
use half::f16;
use std::sync::Arc;

/// A communicator as the CPU executor's synchronized-BN reducer.
#[derive(Debug)]
pub struct CommBnSync<C>(pub C);

impl<A, C: Collective<[A]>> BnSync<A> for CommBnSync<C> {
    fn replicas(&self) -> usize {
        self.0.world()
    }

    fn all_reduce_sum(&mut self, values: &mut [A]) -> crate::fusion::Result<()> {
        self.0
            .all_reduce(values, ReduceOp::Sum)
            .map_err(|e| crate::fusion::Error::BnSync(e.to_string()))
    }
}

/// Synchronized BN over NCCL for the CUDA executor ([`crate::net::CudaNet::set_bn_sync`]):
/// each sum is amp's [`all_reduce_sum_ordered`] on the rank's shared communicator, enqueued
/// on its stream between events joining it with the layer's stream. It sits here, where the
/// frontend and the mixed-precision layer meet, so that neither depends on the other.
#[derive(Debug, Clone)]
pub struct NcclBnSync {
    comm: SharedComm,
    world: usize,
}

impl NcclBnSync {
    /// The reducer over `comm`'s group.
    pub fn new(comm: SharedComm) -> Self {
        let world = dist_grads::lock(&comm).world();
        NcclBnSync { comm, world }
    }
}

impl DeviceBnSync for NcclBnSync {
    fn replicas(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(
        &mut self,
        stream: &Arc<CudaStream>,
        values: &mut CudaSlice<f32>,
    ) -> crate::fusion::Result<()> {
        all_reduce_sum_ordered(&self.comm, stream, values)
            .map_err(|e| crate::fusion::Error::BnSync(e.to_string()))
    }
}

/// The CPU group's join of a data-parallel step: the buckets and the overflow flag summed
/// (max) over the in-process group.
impl StepSync<CpuRegions> for CpuComm {
    fn reduce_bucket(
        &mut self,
        regions: &mut CpuRegions,
        bucket: Bucket,
    ) -> Result<(), ClassifierError> {
        Ok(grads::all_reduce_bucket(regions, self, bucket)?)
    }

    /// The sums are done when [`StepSync::reduce_bucket`] returns.
    fn join(&mut self, _regions: &mut CpuRegions) -> Result<(), ClassifierError> {
        Ok(())
    }

    fn share_overflow(&mut self, regions: &mut CpuRegions) -> Result<(), AmpError> {
        grads::all_reduce_overflow(regions, self)
    }

    fn fail(&mut self, why: &str) {
        CpuComm::fail(self, why);
    }
}

/// NCCL's join of a data-parallel step on the CUDA executor: each bucket's sum enqueued on
/// the rank's communicator stream after `stream`'s work so far (the compute stream of the
/// network), so it overlaps the shallower layers' backward; after the backward pass the
/// regions' stream waits for every sum. The GPU engine's group joins its ranks with it too.
#[derive(Debug, Clone)]
pub struct NcclStepSync {
    comm: SharedComm,
    stream: Arc<CudaStream>,
}

impl NcclStepSync {
    /// The join over `comm`'s group, the sums ordered after `stream` (the classifier's).
    pub fn new(comm: SharedComm, stream: Arc<CudaStream>) -> Self {
        NcclStepSync { comm, stream }
    }
}

impl NcclStepSync {
    /// Enqueues the sum of `bucket` on the communicator's stream after `after`'s work so far.
    pub(crate) fn reduce_after(
        &mut self,
        regions: &mut CudaRegions,
        bucket: Bucket,
        after: &CudaStream,
    ) -> Result<(), AmpError> {
        let mut comm = dist_grads::lock(&self.comm);
        dist_grads::all_reduce_bucket(regions, &mut comm, bucket, after)
    }
}

impl StepSync<CudaRegions> for NcclStepSync {
    fn reduce_bucket(
        &mut self,
        regions: &mut CudaRegions,
        bucket: Bucket,
    ) -> Result<(), ClassifierError> {
        let after = self.stream.clone();
        Ok(self.reduce_after(regions, bucket, &after)?)
    }

    fn join(&mut self, regions: &mut CudaRegions) -> Result<(), ClassifierError> {
        let mut comm = dist_grads::lock(&self.comm);
        Ok(dist_grads::join_gradients(regions, &mut comm)?)
    }

    fn share_overflow(&mut self, regions: &mut CudaRegions) -> Result<(), AmpError> {
        dist_grads::all_reduce_overflow(regions, &mut dist_grads::lock(&self.comm))
    }

    /// NCCL has no message to send: the others see the failure at their next collective.
    fn fail(&mut self, _why: &str) {}
}

/// One rank of a data-parallel CPU run: a classifier for the per-rank batch and the rank's
/// communicator.
#[derive(Debug)]
pub struct CpuReplica {
    model: CpuClassifier,
    comm: CpuComm,
    /// When each gradient bucket is final in the backward pass.
    schedule: GradSchedule,
}

impl CpuReplica {
    /// Joins `model` (compiled for the per-rank batch) to the group of `comm`: every rank's
    /// network must be the same ([`crate::net::CompiledNet::fingerprint`]), then rank 0's
    /// master weights are broadcast to every rank (then A, and E with EMA, follow them), and
    /// S counts the ranks. `bn` (a communicator of a second group of the same ranks) turns
    /// on synchronized BN; `None` keeps BN local to each rank's shard.
    ///
    /// # Errors
    /// [`ClassifierError::Amp`] with [`AmpError::Dist`] when the group fails (on every rank
    /// [`DistError::ModelMismatch`] when two ranks compiled different networks);
    /// [`ClassifierError::Input`]
    /// when `bn`'s group is not the same ranks as `comm`'s.
    pub fn new(
        mut model: CpuClassifier,
        mut comm: CpuComm,
        bn: Option<CpuComm>,
    ) -> Result<Self, ClassifierError> {
        if let Some(bn) = bn {
            if (bn.rank(), bn.world()) != (comm.rank(), comm.world()) {
                return Err(ClassifierError::Input(format!(
                    "the synchronized-BN communicator is rank {} of {}, the gradients' rank {} of {}",
                    bn.rank(),
                    bn.world(),
                    comm.rank(),
                    comm.world()
                )));
            }
            model.set_bn_sync(Box::new(CommBnSync(bn)));
        }
        // Before anything is exchanged: ranks of different networks must not train together.
        same::check_same_model(&mut comm, &model.net().fingerprint()).map_err(AmpError::from)?;
        let ranks = u32::try_from(comm.world()).map_err(|_| {
            ClassifierError::Input(format!("{} ranks do not fit S's counter", comm.world()))
        })?;
        let step = model.step_mut();
        grads::broadcast_weights(step.executor_mut(), &mut comm)?;
        step.init_weights()?;
        step.set_ranks(ranks)?;
        let schedule = model.grad_schedule()?;
        Ok(CpuReplica {
            model,
            comm,
            schedule,
        })
    }

    /// One data-parallel training step on this rank's shard (`images`, `labels`: the
    /// per-rank batch). Every rank calls it with its own shard. Returns the global batch's
    /// loss and accuracy (the mean over the ranks' shards, which are the same size).
    ///
    /// # Errors
    /// As [`CpuClassifier::forward_backward`]; [`AmpError::Dist`] when another rank failed
    /// or timed out.
    pub fn step(&mut self, images: &[f16], labels: &[i32]) -> Result<HeadMetrics, ClassifierError> {
        self.train_step(&[(images, labels)])
    }

    /// One data-parallel optimizer step with gradient accumulation over `micro_batches`
    /// (this rank's shard of each, as many as the step's
    /// [`crate::amp::step::StepConfig::accum`]; every rank calls it together with its own
    /// shards): [`CpuReplica::micro_batch`] for each. Returns the global loss and accuracy,
    /// the mean over the micro-batches.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a count other than the step's (nothing runs, nothing
    /// is exchanged); as [`CpuReplica::step`].
    pub fn train_step(
        &mut self,
        micro_batches: &[(&[f16], &[i32])],
    ) -> Result<HeadMetrics, ClassifierError> {
        let accum = self.model.step().config().accum;
        if micro_batches.len() != accum.max(1) as usize {
            return Err(ClassifierError::Input(format!(
                "{} micro-batches for a step that accumulates {accum} (StepConfig::accum)",
                micro_batches.len()
            )));
        }
        let (mut loss, mut accuracy) = (0f32, 0f32);
        for (k, (images, labels)) in micro_batches.iter().enumerate() {
            let local = self.micro_batch(k, images, labels)?;
            loss += local.loss;
            accuracy += local.accuracy;
        }
        let n = micro_batches.len() as f32;
        self.global_metrics(HeadMetrics {
            loss: loss / n,
            accuracy: accuracy / n,
        })
    }

    /// Micro-batch `k` (from 0) of a data-parallel step on this rank's shard (every rank
    /// calls it together): [`crate::classifier::Classifier::train_micro_batch_synced`] over
    /// this rank's communicator, its buckets summed over the ranks as backward makes them
    /// final, then amp's `accumulate` adds the sums into GA, or after the step's last
    /// micro-batch (`k + 1 == accum`) `finish` adds it and moves GA into G, and the check, the
    /// shared overflow flag, SGD (unscaling by `1 / (loss_scale · ranks · N)`) and the scale
    /// update run once. Returns this rank's loss and accuracy (not reduced).
    ///
    /// # Errors
    /// As [`CpuReplica::step`]; [`ClassifierError::Input`] for `k` not below the step's
    /// micro-batch count.
    pub fn micro_batch(
        &mut self,
        k: usize,
        images: &[f16],
        labels: &[i32],
    ) -> Result<HeadMetrics, ClassifierError> {
        let (schedule, comm) = (&self.schedule, &mut self.comm);
        self.model
            .train_micro_batch_synced(k, images, labels, schedule, comm)
    }

    /// The logits of this rank's shard with the current weights. With synchronized BN every
    /// rank must call it together (the forward reduces the statistics).
    ///
    /// # Errors
    /// As [`CpuClassifier::logits`].
    pub fn logits(&mut self, images: &[f16]) -> Result<Vec<f16>, ClassifierError> {
        self.model.logits(images)
    }

    /// Evaluates this rank's shards of `batches` ([`CpuClassifier::evaluate_batches`]; every
    /// rank calls it together, with as many batches): the group's accuracies, the correct
    /// top-1 counts summed over the ranks. BN runs in evaluation mode, so nothing else is
    /// exchanged.
    ///
    /// # Errors
    /// As [`CpuClassifier::evaluate_batches`]; [`AmpError::Dist`] when another rank failed or
    /// timed out.
    pub fn evaluate_batches(
        &mut self,
        batches: &[(Vec<f16>, Vec<i32>)],
    ) -> Result<Accuracies, ClassifierError> {
        let (correct, images) = self.model.correct_top1(batches)?;
        // Whole counts, exact in f32 up to 2^24 images.
        let mut v = [correct[0] as f32, correct[1] as f32];
        self.comm
            .all_reduce(&mut v[..], ReduceOp::Sum)
            .map_err(AmpError::from)?;
        let images = (images * self.comm.world()) as f32;
        let ema = self.model.step().config().ema_decay.is_some();
        Ok(Accuracies::from_counts(v, images, ema))
    }

    /// The global mean of per-rank metrics.
    fn global_metrics(&mut self, local: HeadMetrics) -> Result<HeadMetrics, ClassifierError> {
        let mut v = [local.loss, local.accuracy];
        self.comm
            .all_reduce(&mut v[..], ReduceOp::Sum)
            .map_err(AmpError::from)?;
        let n = self.comm.world() as f32;
        Ok(HeadMetrics {
            loss: v[0] / n,
            accuracy: v[1] / n,
        })
    }

    /// The classifier (its amp step, regions, network).
    pub fn model(&self) -> &CpuClassifier {
        &self.model
    }

    /// The classifier, mutable.
    pub fn model_mut(&mut self) -> &mut CpuClassifier {
        &mut self.model
    }

    /// This rank's communicator (e.g. to reduce evaluation counts).
    pub fn comm_mut(&mut self) -> &mut CpuComm {
        &mut self.comm
    }
}
