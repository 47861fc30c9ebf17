//! [`Backend`]: what a device implements so that one [`super::Classifier`] trains on it.
//!
//! The classifier's calls (the step's micro-batch loop, the batch checks, a network pass,
//! evaluation, running statistics, the memory plan and initial weights) are written once over
//! this trait (`shared.rs`). A backend names its executors for the two lower levels as
//! associated types and brings the head itself:
//!
//! | level | what the backend brings | CPU ([`super::CpuBackend`]) | CUDA ([`super::CudaBackend`]) |
//! |-------|-------------------------|-----------------------------|-------------------------------|
//! | network | [`Backend::Exec`], a [`NetExecutor`]: layer steps by graph role, adds, max-pools, walked by [`run_pass`] | [`crate::net::CpuNet`] | [`crate::net::CudaNetPass`] |
//! | head | pooling, FC, loss seeded with the loss scale, metrics | netops' CPU twins ([`crate::netops::head`]), amp's loss seed ([`crate::amp::range`]) | netops' head kernels ([`crate::netops::cuda`]), amp's loss seed |
//! | amp step | [`Backend::Regions`], an [`AmpExecutor`]: range ops and their capture | [`crate::amp::step::CpuRegions`] | [`crate::amp::cuda::CudaRegions`] (capture: CUDA graphs) |
//!
//! A network pass ([`Backend::network_pass`]) is [`Backend::begin_pass`] (the executor over
//! the batch and the regions' parameters), [`run_pass`] on it, [`Backend::end_pass`]; it reads
//! and writes the amp regions it is handed (the parameters in A/W, their gradients into
//! G16/G). A training pass is, in order, [`Backend::load_labels`], the forward network pass,
//! [`Backend::head_forward`], [`Backend::head_backward`], the backward network pass.

use super::{ClassifierError, EvalWeights};
use crate::amp::plan::{Bucket, Region};
use crate::amp::step::AmpExecutor;
use crate::fusion::cbr::Pass;
use crate::net::{run_pass, CompiledNet, GradSchedule, NetExecutor};
use half::f16;

/// What a data-parallel backward pass does with a gradient bucket once the pass has made it
/// final in the regions: its sum over the ranks ([`Backend::backward_reduced`]).
pub type BucketReduce<'a, R> = dyn FnMut(&mut R, Bucket) -> Result<(), ClassifierError> + 'a;

/// One device's passes of a classifier (module docs).
pub trait Backend: Sized {
    /// The amp step's executor: the regions and their range ops.
    type Regions: AmpExecutor;
    /// The network's executor for one pass (module docs), borrowing the backend and the
    /// regions.
    type Exec<'a>: NetExecutor<Error = Self::NetError>
    where
        Self: 'a;
    /// What the network's executor fails with.
    type NetError: Into<ClassifierError>;
    /// One batch of NHWC FP16 images as this backend reads it: a host slice, or the caller's
    /// device buffer read in place.
    type Images<'a>;
    /// What a training pass returns: the batch's loss and accuracy where the backend computes
    /// them on the host, nothing where they stay on the device.
    type Metrics;

    /// The compiled network.
    fn compiled(&self) -> &CompiledNet;

    /// How many FP16 values `images` holds.
    fn images_len(images: &Self::Images<'_>) -> usize;

    /// `images` again, for a shorter borrow (a pass reads the batch twice: forward and the
    /// first layer's weight gradient).
    fn reborrow<'s>(images: &'s mut Self::Images<'_>) -> Self::Images<'s>;

    /// Writes master weight `name` (FP32) into region W of `regions` (the initial weights).
    ///
    /// # Errors
    /// An unknown name or a length other than the parameter's.
    fn write_master(
        regions: &mut Self::Regions,
        name: &str,
        values: &[f32],
    ) -> Result<(), ClassifierError>;

    /// Region `region`'s image (padding included), read back (on a device: blocking).
    ///
    /// # Errors
    /// A region the plan lacks; a driver error.
    fn region_bytes(regions: &Self::Regions, region: Region) -> Result<Vec<u8>, ClassifierError>;

    /// Overwrites region `region` with an image of [`Backend::region_bytes`] (on a device: in
    /// stream order).
    ///
    /// # Errors
    /// A region the plan lacks or an image of another size; a driver error.
    fn load_region_bytes(
        regions: &mut Self::Regions,
        region: Region,
        bytes: &[u8],
    ) -> Result<(), ClassifierError>;

    /// Waits until everything enqueued so far has run (nothing to wait for on the host).
    ///
    /// # Errors
    /// A driver error.
    fn synchronize(&self) -> Result<(), ClassifierError>;

    /// Takes the batch's labels (checked by the caller) for the next
    /// [`Backend::head_backward`].
    ///
    /// # Errors
    /// A driver error.
    fn load_labels(&mut self, labels: &[i32]) -> Result<(), ClassifierError>;

    /// Readies a `pass` of the network on `images` with the parameters of `weights` in
    /// `regions` ([`EvalWeights::Ema`] only for [`Pass::Eval`]), and returns its executor.
    /// [`Pass::Backward`] follows the forward pass on the same `images` (the first layer's
    /// weight gradient reads them again) and [`Backend::head_backward`].
    ///
    /// # Errors
    /// The EMA weights of a step that keeps none; regions of another plan; a driver error.
    fn begin_pass<'a>(
        &'a mut self,
        regions: &'a mut Self::Regions,
        images: Self::Images<'a>,
        pass: Pass,
        weights: EvalWeights,
    ) -> Result<Self::Exec<'a>, ClassifierError>;

    /// Ends a pass of [`Backend::begin_pass`] after [`run_pass`] ran it: what a backward pass
    /// leaves in the network's buffers reaches the regions (conv gradients FP16 into G16, BN
    /// gradients FP32 into G), and the regions' work waits for the pass.
    ///
    /// # Errors
    /// A driver error.
    fn end_pass(&mut self, regions: &mut Self::Regions, pass: Pass) -> Result<(), ClassifierError>;

    /// One pass of the network: [`Backend::begin_pass`], [`run_pass`], [`Backend::end_pass`].
    /// [`Pass::Forward`] is training mode (BN with the batch's statistics, the running
    /// statistics updated), [`Pass::Eval`] evaluation mode (BN from the running statistics,
    /// nothing statistical written).
    ///
    /// # Errors
    /// As [`Backend::begin_pass`]; a refused plan, op or kernel.
    fn network_pass(
        &mut self,
        regions: &mut Self::Regions,
        mut images: Self::Images<'_>,
        pass: Pass,
        weights: EvalWeights,
    ) -> Result<(), ClassifierError> {
        {
            let mut exec = self.begin_pass(regions, Self::reborrow(&mut images), pass, weights)?;
            run_pass(&mut exec, pass).map_err(Into::into)?;
        }
        self.end_pass(regions, pass)
    }

    /// The backward network pass of a data-parallel step (as [`Backend::network_pass`] with
    /// [`Pass::Backward`]): each gradient bucket is in the regions and handed to `reduce` as
    /// soon as the pass has made it final (`schedule`, from [`crate::net::grad_schedule`] for
    /// this network and the regions' plan), the deepest first, while the shallower layers'
    /// backward is still to run (on a GPU: enqueued, so the sums overlap it).
    ///
    /// # Errors
    /// As [`Backend::network_pass`]; a schedule of another network; `reduce`'s error (the
    /// pass stops there).
    fn backward_reduced(
        &mut self,
        regions: &mut Self::Regions,
        images: Self::Images<'_>,
        schedule: &GradSchedule,
        reduce: &mut BucketReduce<'_, Self::Regions>,
    ) -> Result<(), ClassifierError>;

    /// The head's forward on the network's output: global average pool and FC (FC weights
    /// from W) into the logits.
    ///
    /// # Errors
    /// A refused op or kernel.
    fn head_forward(&mut self, regions: &mut Self::Regions) -> Result<(), ClassifierError>;

    /// The head's backward: the loss gradient seeded with the loss scale read from S, the
    /// metrics, FC's gradients into G and the pooling's into the network output's gradient.
    ///
    /// # Errors
    /// A refused op or kernel; a label out of range.
    fn head_backward(
        &mut self,
        regions: &mut Self::Regions,
    ) -> Result<Self::Metrics, ClassifierError>;

    /// Forward in evaluation mode (BN from the running statistics, nothing statistical
    /// written) with the `weights` of `regions`, pooling and FC: the logits on the host,
    /// `[batch, classes]` row-major. The trained weights and the last training batch's head
    /// buffers are left as they were.
    ///
    /// # Errors
    /// The EMA weights of a step that keeps none; a running variance below `−ε`; a driver
    /// error.
    fn eval_logits(
        &mut self,
        regions: &mut Self::Regions,
        images: Self::Images<'_>,
        weights: EvalWeights,
    ) -> Result<Vec<f16>, ClassifierError>;

    /// The running statistic `name` (a buffer of [`crate::net::cuda::running_stats`]).
    ///
    /// # Errors
    /// An unknown name; a driver error.
    fn read_running_stat(&self, name: &str) -> Result<Vec<f32>, ClassifierError>;

    /// Overwrites running statistic `name`.
    ///
    /// # Errors
    /// An unknown name or a length other than the statistic's; a driver error.
    fn write_running_stat(&mut self, name: &str, values: Vec<f32>) -> Result<(), ClassifierError>;
}
