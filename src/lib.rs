//! cudnn-cbr: the fastest Conv+BatchNorm+ReLU training step on cuDNN's graph API, with a
//! static, sync-free mixed-precision layer.
//!
//! This facade re-exports the workspace crates:
//! - [`runtime`]: library discovery, preflight checks, the CUDA device opener, NVRTC and the
//!   kernel cache (the floor under all the others);
//! - [`sys`]: raw bindings to the cuDNN graph (backend) API, loaded at run time;
//! - [`fusion`]: the safe graph frontend and the CBR ops;
//! - [`amp`]: the mixed-precision layer (memory plan, range ops, loss scaling, the step);
//! - [`netops`]: the network's own kernels (residual join, max-pool, the head: pooling, FC,
//!   metrics log) and their bit-exact CPU twins, over amp's regions;
//! - [`net`]: network descriptions (presets: a small net, ResNet-18/34/50/101), their compiler
//!   (layers, prologue pairings with per-pair fallback, buffers, forward/backward steps) and
//!   the CPU executor of a compiled network (FP16 storage or exact `f64`);
//! - [`classifier`]: a compiled network with a classification head and the amp step, on the
//!   CPU executor or CUDA: what a trainer links;
//! - [`dist`]: the distribution crate's communicators (CPU group, NCCL), launcher bootstrap,
//!   same-model check and watchdog (`cudnn-cbr-dist`, public only here), data-parallel training
//!   of a classifier over ranks (threads on the CPU), and synchronized BN over NCCL for the
//!   CUDA executor.
//!
//! fusion and amp sit side by side and neither depends on the other; netops sits on amp; what
//! needs fusion and amp (or netops) together lives here (docs/architecture.md, "The floors").
//!
//! The main job's training loop (a small CBR ResNet on synthetic data) is the workspace crate
//! `cudnn-cbr-trainer`, built on the types below.
//!
//! # The types a trainer uses
//!
//! Every item has one public path: the workspace crates under their modules above, the
//! network and classifier layers here.
//!
//! | step | type | what it is |
//! |---|---|---|
//! | the GPU | [`runtime::cuda_device`], [`fusion::exec::Handle`], [`fusion::Target`] | open a device; a cuDNN handle on your cudarc stream; a live target (`Handle::target`) or device-properties JSON (deviceless) |
//! | plans | [`fusion::cache::PlanCache`] | built plans by graph and target, optionally persisted to a folder |
//! | a network | [`net::NetSpec`], [`net::Preset`] | stem, stages of basic/bottleneck blocks, head |
//! | compiling it | [`net::compile()`], [`net::RoutePolicy`], [`net::CompiledNet`] | every layer, buffer and step; [`net::prewarm()`] plans on threads first |
//! | running it | [`net::CpuNet`], [`net::CudaNet`] | the CPU reference executor, the cuDNN executor |
//! | training it | [`classifier::CpuClassifier`], [`classifier::CudaClassifier`], [`classifier::ClassifierError`] | network + GAP/FC/softmax head + amp step: one [`classifier::Classifier`] generic over a [`classifier::Backend`] (the CPU's or CUDA's), its calls written once; on a GPU also the training engine ([`classifier::EngineConfig`]: whole-step capture, device metrics log, NCCL group) |
//! | on many ranks | [`dist::CpuReplica`], [`dist::CpuGroup`] | data-parallel CPU ranks: gradient all-reduce, shared overflow verdict, synchronized BN |
//! | its parameters | [`net::memory_plan`], [`net::initial_weights`] | a compiled network's slots in the amp plan, and their start values |
//! | one layer | [`fusion::cbr::CbrConfig`], [`fusion::cbr::ConvShape`], [`fusion::cbr::CbrLayer`] | a Conv+BN+ReLU layer and its plans |
//! | its buffers | [`fusion::cbr::DeviceBuffers`], [`fusion::cbr::keys`] | borrowed cudarc slices under typed keys (`keys::Y: Key<f16>`) |
//! | weights | [`amp::plan::MemoryPlanBuilder`], [`amp::plan::ParamKind`] | the static memory plan of the parameters |
//! | the step | [`amp::step::AmpStep`], [`amp::step::StepConfig`], [`amp::range::SgdConfig`] | cast, check, SGD, EMA, loss scale; no host sync |
//! | its memory | [`amp::step::CpuRegions`], [`amp::cuda::CudaRegions`] | a plan's regions on the host or a device |
//! | errors | [`fusion::Error`], [`amp::AmpError`], [`sys::LoadError`] | typed, naming what is wrong |
//!
//! # A tour (the README's, compiled here)
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cudnn_cbr::fusion::cbr::{CbrConfig, CbrLayer, ConvShape, HostBuffers, Pass};
//! use cudnn_cbr::fusion::{cache::PlanCache, Target};
//!
//! // Plan a layer for an H200 without a GPU (or `Handle::new(stream)?.target()?` on a device).
//! let target = Target::deviceless_from_file("tests/fixtures/devprops/h200-sm90.json")?;
//! let cache = PlanCache::persistent("target/plan-cache")?; // engine choices survive restarts
//! let config = CbrConfig::new(ConvShape::square(32, 64, 56, 64, 3, 1, 1));
//! let layer = CbrLayer::plan(config, &target, &cache)?;
//! println!("{} route, {} B workspace", layer.route().name(), layer.workspace_size());
//! for b in layer.buffers() {
//!     println!("{} {} x{}", b.name, b.dtype, b.elems);
//! }
//!
//! // Run it on the CPU over host buffers named as on the GPU (`run_gpu` takes `DeviceBuffers`).
//! let mut this = HostBuffers::zeros(layer.buffers());
//! let mut prev = HostBuffers::zeros(layer.prev_buffers());
//! layer.run_cpu(Pass::Forward, &mut this, Some(&mut prev))?;
//! layer.run_cpu(Pass::Backward, &mut this, Some(&mut prev))?;
//!
//! // The amp step: a memory plan, regions on an executor, begin/finish around fwd+bwd.
//! use cudnn_cbr::amp::{plan::{MemoryPlanBuilder, ParamKind}, range::SgdConfig};
//! use cudnn_cbr::amp::step::{AmpStep, CpuRegions, StepConfig};
//! let mut b = MemoryPlanBuilder::new();
//! let bucket = b.bucket("all")?;
//! b.add("conv.w", ParamKind::ConvWeight, &[64, 3, 3, 64], bucket)?;
//! let regions = CpuRegions::new(b.finalize()?)?;
//! let mut step = AmpStep::new(regions, StepConfig::new(SgdConfig::new(0.05)))?;
//! step.init_weights()?;
//! step.begin()?; // forward and backward go here: wgrads FP16 into G16
//! step.finish()?;
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub use cudnn_cbr_amp as amp;
pub use cudnn_cbr_fusion as fusion;
pub use cudnn_cbr_netops as netops;
pub use cudnn_cbr_runtime as runtime;
pub use cudnn_fe_sys as sys;

/// The README's code blocks, compiled and run as doc tests (its "Link cudnn-cbr into your
/// trainer" section; the tour is compiled above).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod classifier;
pub mod dist;
pub mod net;
