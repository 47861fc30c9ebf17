//! Networks: a description ([`NetSpec`], with presets), its compiler ([`compile()`]) and the
//! executors that run a compiled network ([`cpu`]).
//!
//! # Recipe
//! 1. A [`NetSpec`]: [`Preset::spec`] (`mini`, ResNet-18/34/50/101) or your own stages.
//! 2. [`compile()`]`(&spec, batch, hw, &policy)` → a [`CompiledNet`]: its conv layers with
//!    their configs and routes, every buffer, and the forward/backward [`Step`]s.
//! 3. Run it through one interface ([`NetExecutor`], walked by [`run_pass`]): [`CpuNet`] on
//!    the CPU reference executor (FP16 storage, or exact `f64`), [`CudaNet`] on a GPU.

pub mod buckets;
pub mod compile;
pub mod cpu;
pub mod cuda;
pub mod exec;
// The exact-arithmetic head, the oracle of the network tests (tests/, tools/netcheck/), not used by
// the library itself: built only with the `testing` feature.
#[cfg(feature = "testing")]
pub mod head;
mod host_store;
pub mod liveness;
pub mod memory;
pub mod params;
pub mod prewarm;
pub mod spec;

pub use buckets::{grad_schedule, GradSchedule};
pub use compile::{
    compile, validate, BufId, BufferRole, CompiledNet, LayerRole, NetBuffer, NetLayer, RoutePolicy,
    Step,
};
pub use cpu::{Arena, CpuNet};
pub use cuda::{CudaNet, CudaNetError};
pub use exec::{run_pass, run_pass_observed, NetExecutor};
pub use memory::MemoryReport;
pub use params::{
    initial_weights, memory_plan, memory_plan_of, memory_plan_with_buffers, memory_plan_with_ema,
    PlanContents,
};
pub use prewarm::{prewarm, Prewarmed};
pub use spec::{BlockKind, BlockSpec, NetSpec, PoolSpec, Preset, StemSpec};
