//! A safe Rust frontend over the cuDNN graph API, and the fused Conv+BN+ReLU ops.
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | device properties | [`DeviceProps`] | the GPU a plan is built for (JSON, deviceless) |
//! | descriptor | [`backend::Descriptor`] | one owned cuDNN backend object |
//! | engine config | [`backend::heuristics`] | a ranked way to run an operation graph |
//! | execution plan | [`backend::finalize_plan`] | a finalized, runnable engine config |
//! | tuned plan | [`autotune::tune`] | the fastest candidate, timed on a live device |
#![deny(unsafe_code)]

pub mod autotune;
pub mod backend;
pub mod cache;
pub mod cbr;
mod error;
pub mod exec;
pub mod graph;
pub mod interp;
pub mod kernel_cache;
pub mod lower;
pub mod plan;
pub mod probe;
pub mod reference;
pub mod rtc;
pub mod sim;
mod target;
pub mod untrusted;

pub use error::{BindingProblem, Error, Result};
pub use target::{
    device_binding, DeviceBinding, DevicePropSource, DeviceProps, Target, TargetKind,
    KNOWN_COMPUTE_CAPABILITIES, MAX_DEVICE_NAME_BYTES, MAX_DOCUMENT_BYTES, REQUIRED_KEYS,
};
