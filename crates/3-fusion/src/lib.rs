//! A safe Rust frontend over the cuDNN graph API, and the fused Conv+BN+ReLU ops.
//!
//! Built on `cudnn_fe_sys` (the bindings) and `cudnn_cbr_runtime` (NVRTC for our own kernels,
//! the kernel cache, the device opener, reading untrusted files); the mixed-precision layer
//! (amp) sits beside it and neither depends on the other.
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | device properties | [`DeviceProps`] | the GPU a plan is built for (JSON, deviceless) |
//! | descriptor | [`backend::Descriptor`] | one owned cuDNN backend object |
//! | engine config | [`backend::heuristics`] | a ranked way to run an operation graph |
//! | execution plan | [`backend::finalize_plan`] | a finalized, runnable engine config |
//! | tuned plan | [`autotune::tune`] | the fastest candidate, timed on a live device |
//!
//! # Where `unsafe` lives
//! The crate denies `unsafe_code`; these modules allow it, each block with a `// SAFETY:`
//! comment:
//!
//! | module | why |
//! |---|---|
//! | [`backend`] | every cuDNN backend call (through cudnn-fe-sys) |
//! | [`exec`] (`bindings`, `launch`) | binding device addresses and executing plans on a stream |
//! | `cbr::kernels`, `cbr::device_buffers` | launching our own kernels, device buffers by address |
//! | [`sim`], [`interp`] (`execute`, `raw`, and its tests, which call `execute`) | the simulated device: its driver's allocation table, raw memory |
//! | `reference::element` | the `gemm` crate's FP32 GEMM, whose entry point is `unsafe fn` |
//! | `reference::convert` | FP16 ↔ FP32 conversion instructions chosen at run time (`std::arch`) |
//! | `reference::direct` | the conv tiles' AVX-512/AVX2 FMA register blocks, chosen at run time (`std::arch`) |
//! | `reference::sums` | the per-channel `f64` sums in AVX-512F/AVX lanes, chosen at run time (`std::arch`) |
//! | `reference::prologue` | the BN-apply prologue in AVX-512F/F16C lanes, chosen at run time (`std::arch`) |
//! | `reference::maps` | the element-wise maps (BN apply, dBN apply, add, the dgrad tile's dReLU) in AVX-512F/F16C lanes, chosen at run time (`std::arch`) |
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod autotune;
pub mod backend;
pub mod cache;
pub mod cbr;
mod error;
pub mod exec;
pub mod graph;
pub mod interp;
pub mod lower;
pub mod plan;
// Test scaffolding (the `deviceless_smoke` example and test), not part of the library's API:
// built only with the `testing` feature, which the root crate's tests and examples enable.
#[cfg(feature = "testing")]
pub mod probe;
pub mod reference;
pub mod sim;
mod target;
#[cfg(test)]
mod test_support;

pub use error::{BindingProblem, Error, Result};
pub use target::{
    device_binding, DeviceBinding, DevicePropSource, DeviceProps, Target, TargetKind,
    KNOWN_COMPUTE_CAPABILITIES, MAX_DEVICE_NAME_BYTES, MAX_DOCUMENT_BYTES, REQUIRED_KEYS,
};
