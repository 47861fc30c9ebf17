//! Networks: a description ([`NetSpec`], with presets), its compiler ([`compile()`]) and the
//! executors that run a compiled network ([`CpuNet`], [`CudaNet`]).
//!
//! # Recipe
//! 1. A [`NetSpec`]: [`Preset::spec`] (`mini`, ResNet-18/34/50/101) or your own stages.
//! 2. [`compile()`]`(&spec, batch, hw, &policy)` → a [`CompiledNet`]: its conv layers with
//!    their configs and routes, every buffer, and the forward/backward [`Step`]s.
//! 3. Run it through one interface ([`NetExecutor`], walked by [`run_pass`]): [`CpuNet`] on
//!    the CPU reference executor (FP16 storage, or exact `f64`), [`CudaNet`] on a GPU.

pub(crate) mod buckets;
pub(crate) mod compile;
pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod exec;
// The exact-arithmetic head, the oracle of the network tests (tests/, tools/netcheck/), not used by
// the library itself: built only with the `testing` feature.
#[cfg(feature = "testing")]
pub mod head;
mod host_store;
pub(crate) mod layer_params;
pub mod liveness;
pub(crate) mod memory;
pub(crate) mod params;
pub(crate) mod prewarm;
pub(crate) mod spec;

pub use buckets::{grad_schedule, GradSchedule};
pub use compile::{
    compile, validate, BufId, BufferRole, CompiledNet, LayerRole, NetBuffer, NetLayer, RoutePolicy,
    Step,
};
pub use cpu::{max_pool, max_pool_backward, Arena, CpuNet};
pub use cuda::{
    binding_plan, check_binding, check_bn_sync, layer_bindings, layers_to_replan, param_slot,
    placement, replan_for, running_stats, CudaNet, CudaNetError, CudaNetPass, Placement,
    ReplanFailure, Replanned, Source,
};
pub use exec::{run_pass, run_pass_observed, AfterStep, NetExecutor};
pub use memory::MemoryReport;
pub use params::{
    in_arena, initial_weights, memory_plan, memory_plan_of, memory_plan_with_buffers,
    memory_plan_with_ema, splitmix, uniform, PlanContents,
};
pub use prewarm::{prewarm, Prewarmed};
pub use spec::{BlockKind, BlockSpec, NetSpec, PoolSpec, Preset, StemSpec};
