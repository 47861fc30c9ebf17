//! [`Backend`]: what a device implements so that one [`super::Classifier`] trains on it.
//!
//! The classifier's calls (the step's micro-batch loop, the batch checks, evaluation, running
//! statistics, the memory plan and initial weights) are written once over this trait
//! (`shared.rs`); a backend supplies the passes they are made of:
//!
//! | level | what the backend brings | CPU ([`super::CpuBackend`]) | CUDA ([`super::CudaBackend`]) |
//! |-------|-------------------------|-----------------------------|-------------------------------|
//! | network | layer steps, adds, max-pools, walked by [`crate::net::run_pass`] | [`crate::net::CpuNet`] | [`crate::net::CudaNet`]'s pass |
//! | head | pooling, FC, loss seeded with the loss scale, metrics | netops' CPU twins ([`crate::netops::head`]), amp's loss seed ([`crate::amp::range`]) | netops' head kernels ([`crate::netops::cuda`]), amp's loss seed |
//! | amp step | range ops and their capture ([`AmpExecutor`]) | [`crate::amp::step::CpuRegions`] | [`crate::amp::cuda::CudaRegions`] (capture: CUDA graphs) |
//!
//! The forward and backward passes read and write the amp regions they are handed (the
//! parameters in A/W, their gradients into G16/G); a training pass is, in order,
//! [`Backend::load_labels`], [`Backend::forward`], [`Backend::head_forward`],
//! [`Backend::head_backward`], [`Backend::backward`].

use super::{ClassifierError, EvalWeights};
use crate::amp::plan::Region;
use crate::amp::step::AmpExecutor;
use crate::net::CompiledNet;
use half::f16;

/// One device's passes of a classifier (module docs).
pub trait Backend: Sized {
    /// The amp step's executor: the regions and their range ops.
    type Regions: AmpExecutor;
    /// The network on this device (its buffers, to inspect them).
    type Net;
    /// One batch of NHWC FP16 images as this backend reads it: a host slice, or the caller's
    /// device buffer read in place.
    type Images<'a>;
    /// What a training pass returns: the batch's loss and accuracy where the backend computes
    /// them on the host, nothing where they stay on the device.
    type Metrics;

    /// The compiled network.
    fn compiled(&self) -> &CompiledNet;

    /// The network on this device.
    fn network(&self) -> &Self::Net;

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

    /// The network's forward pass in training mode (BN with the batch's statistics, the
    /// running statistics updated) on `images`, the parameters read from `regions`.
    ///
    /// # Errors
    /// A refused plan, op or kernel; a driver error.
    fn forward(
        &mut self,
        regions: &mut Self::Regions,
        images: Self::Images<'_>,
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

    /// The network's backward pass on the same `images` as the forward: conv gradients FP16
    /// into G16, BN gradients FP32 into G.
    ///
    /// # Errors
    /// A refused plan, op or kernel; a driver error.
    fn backward(
        &mut self,
        regions: &mut Self::Regions,
        images: Self::Images<'_>,
    ) -> Result<(), ClassifierError>;

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
