//! The thin `Result` layer over cudnn-fe-sys: every cuDNN backend call of this crate goes
//! through it (the crate docs list the other modules with `unsafe`).
//!
//! 1. [`Descriptor::new`] creates a backend descriptor; `Drop` destroys it.
//! 2. `set`/`set_one`/`set_descriptors` set typed attributes (the Rust type picks the
//!    `CUDNN_TYPE_*`, the slice carries the count); `finalize` freezes it.
//! 3. [`heuristics`] ranks engine configs for a finalized operation graph; [`finalize_plan`]
//!    turns one into an execution plan, deviceless or on a handle; [`engine_by_index`] and
//!    [`engine_config`] make the config of a known engine and knob settings instead.
//!
//! Every failing call becomes an [`Error`](crate::Error) that names the descriptor kind and
//! carries cuDNN's own last-error text.
#![allow(unsafe_code)]

mod descriptor;
mod engine;

pub use descriptor::{kind_name, AttrValue, Descriptor};
// Test scaffolding (descriptor accounting), built only with the `testing` feature.
#[cfg(feature = "testing")]
pub use descriptor::{descriptor_counts, DescriptorCounts};
pub use engine::{
    config_knobs, device_prop_descriptor, device_prop_descriptor_for_handle, engine_by_index,
    engine_config, engine_count, engine_info, engine_knobs, finalize_plan, heuristics,
    plan_engine_info, plan_from_json, plan_json, plan_workspace_size, EngineInfo, HeurMode,
    HeuristicsResult, KnobChoice, KnobRange, PlanSite,
};
