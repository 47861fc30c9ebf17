//! cudnn-cbr-runtime: the bottom floor of cudnn-cbr, what every crate above needs from the
//! machine before any cuDNN or mixed-precision work: finding libraries, checking them before
//! they are loaded, opening a CUDA device, compiling kernels with NVRTC and keeping their
//! machine code on disk.
//!
//! | concern | where | what it is |
//! |---|---|---|
//! | library discovery | [`wheels`] | CUDA libraries and headers from pip's wheels (a PyTorch virtualenv's) |
//! | preflight | [`preflight`] | a file is a complete shared object for this machine with the symbols of its kind, checked before `dlopen` |
//! | device open | [`cuda_device`], [`cuda_device_count`] | the one CUDA device opener of the workspace: a typed [`NoCudaDevice`] where cudarc would panic without a driver |
//! | NVRTC | [`rtc`] | whether it loads, its version, source to a cubin (and PTX), launch parameters checked against the PTX |
//! | kernel cache | [`kernel_cache`] | NVRTC's output kept across processes, keyed by everything the compilation depends on |
//! | stderr | [`stderr`] | lines on stderr that cannot panic (a closed pipe is ignored) |
//! | untrusted files | [`untrusted`] | reading files the library does not control; the cache folders' ownership rule |
//! | element types | [`DataType`] | the one element type enum of the workspace: cuDNN's tensor types and the mixed-precision regions' storage types |
//!
//! cudnn-fe-sys (the cuDNN bindings and their loader), fusion and amp build on this crate;
//! it depends on none of them.
//!
//! # Where `unsafe` lives
//! The crate denies `unsafe_code`; these modules allow it, each block with a `// SAFETY:`
//! comment: [`wheels`] (`dlopen` of a wheel's library), `device` (cudarc's driver-library
//! probe), [`rtc`] (NVRTC calls), [`untrusted`] (the effective user id, `geteuid`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod device;
mod dtype;
pub mod kernel_cache;
pub mod preflight;
pub mod rtc;
pub mod stderr;
pub mod untrusted;
pub mod wheels;

pub use device::{cuda_device, cuda_device_count, NoCudaDevice, DEVICE_ENV};
pub use dtype::DataType;
