//! cudnn-cbr-amp: the static, sync-free mixed-precision layer of cudnn-cbr.
//!
//! | concept   | what it is                                   | where                     |
//! |-----------|----------------------------------------------|---------------------------|
//! | region    | one contiguous allocation (W, A, G, G16, M, E, E16, GA, S) | [`plan::Region`] |
//! | slot      | one parameter's bytes in one region          | [`plan::ParamView`]       |
//! | bucket    | parameters contiguous in every region        | [`plan::Bucket`]          |
//! | plan      | every slot of every parameter, validated     | [`plan::MemoryPlan`]      |
//! | range op  | one kernel over a byte range + its CPU twin  | [`range`], [`kernels`]    |
//! | scalars   | loss scale, overflow flag, counters (S)      | [`range::Scalars`]        |
//! | executor  | a plan's regions on a device + the range ops | [`step::AmpExecutor`]: [`step::CpuRegions`], [`cuda::CudaRegions`] |
//! | step      | begin (zero grads) … finish (cast, check, SGD, EMA, scale) | [`step::AmpStep`] |
//! | graph     | a recorded op list, replayed as one launch   | [`step::StepGraph`], [`cuda::CudaStepGraph`] |
//! | seed      | the loss gradient, scaled by the loss scale in S | [`range::softmax_xent_backward`], [`kernels::SEED`] |
//! | kernel set | sources compiled with NVRTC and loaded into a context, launches checked | [`cuda::KernelSet`] |
//! | group     | data-parallel ranks: gradient all-reduce, shared overflow verdict | [`dist`] |
//!
//! Recipe for a training step without host syncs:
//! 1. Build a [`plan::MemoryPlan`] from the network's parameters.
//! 2. Make its regions on an executor: [`step::CpuRegions::new`] or
//!    [`cuda::CudaRegions::open`] (a typed [`AmpError::NoDevice`] where there is no GPU).
//! 3. Write W, then [`step::AmpStep::new`] and [`step::AmpStep::init_weights`].
//! 4. Each step: [`step::AmpStep::begin`], forward and backward on the executor's stream,
//!    [`step::AmpStep::finish`] (or a replay of [`step::AmpStep::capture_finish`]); the
//!    overflow flag and the loss scale never leave the device. With gradient accumulation
//!    over N micro-batches ([`step::StepConfig::with_accum`], a plan with GA), each
//!    micro-batch but the last ends with [`step::AmpStep::accumulate`] instead.
//!
//! The crate builds on `cudnn_cbr_runtime` (NVRTC, the kernel cache, the device opener, the
//! library checks, the element type `DataType`) and runs its gradient
//! collectives over the communicators of `cudnn_cbr_dist`; it does not depend on the cuDNN
//! frontend (fusion), which sits beside it. The network's own ops around a step (the head:
//! pooling, FC, metrics log; residual joins; max-pool) are crate `cudnn-cbr-netops`'s, a floor
//! above: it launches them as a [`cuda::KernelSet`] of its own, over amp's regions.
//!
//! Unsafe code lives only in [`cuda`], the kernel-launch module; everything else denies it.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cuda;
pub mod dist;
pub(crate) mod error;
pub mod kernels;
pub mod memory;
pub mod plan;
pub mod range;
pub mod step;

pub use error::{AmpError, CudaError, ExecError, KernelTableError, PlanError, RangeOpError};
