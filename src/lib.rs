//! cudnn-cbr: the fastest Conv+BatchNorm+ReLU training step on cuDNN's graph API, with a
//! static, sync-free mixed-precision layer.
//!
//! This facade re-exports the workspace crates:
//! - [`sys`]: raw bindings to the cuDNN graph (backend) API, loaded at run time;
//! - [`fusion`]: the safe graph frontend and the CBR ops;
//! - [`amp`]: the mixed-precision layer (memory plan, range ops, loss scaling, the step);
//! - [`train`]: the main job's training loop (a small CBR ResNet on synthetic data).
#![forbid(unsafe_code)]

pub use cudnn_cbr_amp as amp;
pub use cudnn_cbr_fusion as fusion;
pub use cudnn_fe_sys as sys;

pub mod train;
