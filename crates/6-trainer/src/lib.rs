//! The main job's training loop: a small ResNet-style CBR network on a synthetic dataset,
//! trained with the amp step (FP32 master weights, FP16 compute weights, fixed loss scaling,
//! SGD with momentum), on the CPU reference executor or on CUDA.
//!
//! A crate of its own, on the `cudnn_cbr` facade's public API. `examples/train_cbr.rs` drives
//! it from the command line; tests run it with fewer steps.
//! Every parameter lives in an [`amp`](cudnn_cbr::amp) memory plan: conv weights are read from
//! region A (FP16) and their FP16 wgrads written to G16; BN and FC parameters are read from W
//! and their FP32 gradients written to G. The step then casts, checks, applies SGD (skipping
//! on overflow) and updates the loss scale.
//!
//! Recipe:
//! 1. A [`TrainConfig`]; its [`Device`] picks the executor: [`Device::Cpu`] (the default),
//!    [`Device::Cuda`] (a typed error when it cannot run: [`TrainError::is_unavailable`]) or
//!    [`Device::Auto`] (CUDA when it can run, else the CPU, saying why).
//! 2. [`Trainer::new`] makes that choice and sets the executor up (on CUDA: plans every
//!    layer, allocates, uploads the initial weights); [`Trainer::executor`] says which and
//!    why. [`train`] is `Trainer::new` followed by [`Trainer::run`].
//! 3. Optionally, [`Trainer::resume`] loads a checkpoint, [`Trainer::save_to`] saves them
//!    ([`checkpoint`]: safetensors with torchvision's names, bit-exact resume) and
//!    [`Trainer::record_curve`] asks the CUDA executor for per-step [`curves`] too.
//! 4. [`Trainer::run`] trains and reports progress every few steps; the
//!    [`TrainReport`] holds the per-step losses, the final master weights and their
//!    [`TrainReport::weights_hash`], and the curve ([`curves::write`] draws it).
//!
//! Both executors run the same network (the preset [`TrainConfig::net`], compiled by
//! [`cudnn_cbr::net::compile()`]), from the same initial
//! weights and data, with the same head (the [`cudnn_cbr::netops::head`] twins of
//! `crates/4-netops/kernels/net_head.cu`); [`cuda`] explains what the CUDA executor runs, captures and
//! reads back.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod augment;
mod bookkeeping;
pub mod checkpoint;
pub mod cifar;
mod config;
mod cpu;
mod cpu_dp;
pub mod cuda;
pub mod curves;
mod data;
mod error;
mod net;
mod report;
mod run;
pub mod schedule;

pub use data::{DataSource, Dataset, Prefetch, Synthetic};
pub use net::{compile_net, cpu_policy};
pub use schedule::LrSchedule;

pub use config::{Device, FaultDrill, StepTrace, TrainConfig, MAX_ACCUM, MAX_STEPS};
pub use error::TrainError;
pub use report::{
    initial_master_weights, EpochEval, Evaluation, ExecutorInfo, ExecutorKind, MasterWeights,
    Progress, TrainReport,
};
pub use run::{train, Trainer};

pub(crate) use bookkeeping::{
    Bookkeeping, Checkpointed, Finished, HostMetrics, RunModel, HELD_OUT_BATCHES,
};
pub(crate) use report::{FNV_OFFSET, FNV_PRIME};
pub(crate) use run::{mean_metrics, plan_and_initial_weights, Session};
