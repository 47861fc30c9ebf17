//! A deviceless end-to-end probe: build the forward conv + GenStats graph, run heuristics and
//! finalize a plan for a device-properties document.
//!
//! It proves that cuDNN works on the machine (library, sub-libraries, device-properties JSON,
//! heuristics, plan finalize) without a GPU; the `deviceless_smoke` example and test call it.
//! Test scaffolding, built only with the crate's `testing` feature.

use crate::cbr::graphs;
use crate::error::Result;
use crate::lower::OperationGraph;
use crate::plan::build_plan;
use crate::target::{DeviceProps, Target};
use std::time::Instant;

pub use crate::cbr::ConvShape;

/// What the probe saw.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeReport {
    /// The device the plan was built for.
    pub device: String,
    /// Engine configs heuristics reported.
    pub reported: usize,
    /// Engine configs that passed cuDNN's support checks.
    pub usable: usize,
    /// Index (in heuristics order) of the config whose plan finalized first.
    pub chosen: usize,
    /// The engine's global index (meaningful within the pattern only).
    pub engine_index: i64,
    /// The pattern cuDNN matched (`finalizeMode` in the plan JSON), when present.
    pub pattern: Option<String>,
    /// Workspace bytes of the chosen plan.
    pub workspace: usize,
    /// Wall time from the first descriptor to the finalized plan, in milliseconds.
    pub build_ms: f64,
}

/// Builds conv fprop + GenStats (FP16 NHWC in/out, FP32 stats) for `shape` and plans it for
/// `props`, deviceless.
pub fn conv_genstats(props: &DeviceProps, shape: ConvShape) -> Result<ProbeReport> {
    let start = Instant::now();
    let target = Target::deviceless(props.clone())?;
    let (graph, _) = graphs::conv_fprop(&shape, false, true);
    let op = OperationGraph::new(&graph)?;
    let plan = build_plan(&op, &target)?;
    let build_ms = start.elapsed().as_secs_f64() * 1e3;
    let (reported, usable) = plan.config_counts();
    Ok(ProbeReport {
        device: props.name().to_string(),
        reported,
        usable,
        chosen: plan.config_index(),
        engine_index: plan.engine().map(|e| e.global_index).unwrap_or(-1),
        pattern: plan.pattern(),
        workspace: plan.workspace_size(),
        build_ms,
    })
}
