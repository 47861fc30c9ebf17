//! cudnn-cbr-amp: the static, sync-free mixed-precision layer of cudnn-cbr.
//!
//! | concept   | what it is                                   | where                     |
//! |-----------|----------------------------------------------|---------------------------|
//! | region    | one contiguous allocation (W, A, G, G16, M, E, E16, S) | [`plan::Region`] |
//! | slot      | one parameter's bytes in one region          | [`plan::ParamView`]       |
//! | bucket    | parameters contiguous in every region        | [`plan::Bucket`]          |
//! | plan      | every slot of every parameter, validated     | [`plan::MemoryPlan`]      |
//! | range op  | one kernel over a byte range + its CPU twin  | [`range`], [`kernels`]    |
//! | scalars   | loss scale, overflow flag, counters (S)      | [`range::Scalars`]        |
//!
//! Recipe for a training step without host syncs:
//! 1. Build a [`plan::MemoryPlan`] from the network's parameters.
//! 2. Allocate and zero its regions; upload [`range::Scalars`] into S.
//! 3. Each step, launch the range ops in the order listed in [`range`]; the overflow flag
//!    and the loss scale never leave the device.
//!
//! This crate has no unsafe code yet: the planned kernel-launch module will be its only
//! home for `unsafe`.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod kernels;
pub mod plan;
pub mod range;

pub use error::{AmpError, PlanError, RangeOpError};
