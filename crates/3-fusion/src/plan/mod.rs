//! Execution plans: heuristics, plan finalize, introspection.
//!
//! 1. Lower a graph ([`OperationGraph::for_target`]; [`OperationGraph::new`] for a
//!    deviceless target).
//! 2. [`build_plans`] asks heuristics (modes in [`PlanPolicy::modes`] order) and finalizes the
//!    first config that works, or every config when autotuning.
//! 3. An [`ExecutionPlan`] knows its workspace, engine, knob settings ([`EngineChoice`]),
//!    notes, JSON and the real tensors (uids) its variant pack needs.
//! 4. [`plan_from_choice`] rebuilds a plan from an engine choice without heuristics (the plan
//!    cache's restore): the operations are always the lowered graph's, only the engine and its
//!    knobs come from the choice, and cuDNN validates them at finalize.
//! 5. Deviceless plans of runtime-compiled engines are compiled once per process and
//!    re-created from cuDNN's JSON afterwards ([`compiled_plan_stats`], module `compiled`).

mod compiled;

pub use compiled::{compiled_plan_stats, forget_compiled_plans, CompiledPlanStats, MAX_BYTES};

use crate::backend::{self, Descriptor, EngineInfo, HeurMode, KnobChoice};
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::lower::{OperationGraph, RealTensor};
use crate::target::Target;
use cudnn_fe_sys as sys;

/// How plans are chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanPolicy {
    /// Heuristics modes to ask, in order; configs keep that order (duplicates are kept).
    pub modes: Vec<HeurMode>,
    /// Finalize every config (for autotuning) instead of stopping at the first that works.
    pub build_all: bool,
    /// With `build_all`, stop after this many finalized plans.
    pub max_plans: Option<usize>,
}

impl Default for PlanPolicy {
    /// Mode A, then the fallback list; the first plan that finalizes.
    fn default() -> Self {
        PlanPolicy {
            modes: vec![HeurMode::A, HeurMode::Fallback],
            build_all: false,
            max_plans: None,
        }
    }
}

impl PlanPolicy {
    /// Every config of mode A (for autotuning), at most `max`.
    pub fn autotune(max: usize) -> Self {
        PlanPolicy {
            modes: vec![HeurMode::A],
            build_all: true,
            max_plans: Some(max),
        }
    }
}

/// An engine of an operation graph and its knob settings: all a plan adds to its graph, and so
/// all the plan cache persists ([`plan_from_choice`] rebuilds the plan from it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineChoice {
    /// `CUDNN_ATTR_ENGINE_GLOBAL_INDEX` (an index among the graph's engines).
    pub engine: i64,
    /// The engine config's knob settings.
    pub knobs: Vec<KnobChoice>,
}

/// A finalized execution plan and what execution needs to know about it.
#[derive(Debug)]
pub struct ExecutionPlan {
    desc: Descriptor,
    graph_name: String,
    real: Vec<RealTensor>,
    /// [`Target::identity`] of the target it was built (or restored) for.
    target: std::sync::Arc<str>,
    workspace: usize,
    engine: Option<EngineInfo>,
    mode: Option<HeurMode>,
    config_index: usize,
    configs_reported: usize,
    configs_usable: usize,
    /// The engine and knobs it was finalized with (`None` only where cuDNN could not say).
    choice: Option<EngineChoice>,
    /// The graph the plan was built or restored for (kept by [`build_plans`] and the plan
    /// cache): what the graph interpreter ([`crate::interp`]) runs in place of cuDNN under
    /// the simulated device.
    source: Option<Box<Graph>>,
}

impl ExecutionPlan {
    pub(crate) fn from_parts(
        desc: Descriptor,
        graph_name: String,
        real: Vec<RealTensor>,
        target: &Target,
    ) -> Result<Self> {
        let workspace = backend::plan_workspace_size(&desc)?;
        Ok(ExecutionPlan {
            desc,
            graph_name,
            real,
            target: std::sync::Arc::from(target.identity()),
            workspace,
            engine: None,
            mode: None,
            config_index: 0,
            configs_reported: 0,
            configs_usable: 0,
            choice: None,
            source: None,
        })
    }

    /// Gives a plan rebuilt from an engine choice what was recorded about how it was chosen
    /// (heuristics mode and config index), so it reads as the plan that was built or timed.
    pub(crate) fn set_origin(&mut self, mode: Option<HeurMode>, config_index: usize) {
        self.mode = mode;
        self.config_index = config_index;
    }

    /// The engine and knob settings it was finalized with: what rebuilds it
    /// ([`plan_from_choice`]).
    pub fn engine_choice(&self) -> Option<&EngineChoice> {
        self.choice.as_ref()
    }

    /// Keeps the graph the plan was built for (its signature is the plan's; the graph
    /// interpreter runs it where there is no cuDNN execution).
    pub(crate) fn set_source_graph(&mut self, graph: &Graph) {
        self.source = Some(Box::new(graph.clone()));
    }

    /// The graph the plan was built or restored for (every plan [`build_plans`] builds or
    /// the plan cache restores keeps it): its real tensors carry the uids of
    /// [`ExecutionPlan::real_tensors`], so [`crate::interp::execute`] can run it over the
    /// variant pack's addresses.
    pub fn source_graph(&self) -> Option<&Graph> {
        self.source.as_deref()
    }

    /// The plan descriptor.
    pub fn descriptor(&self) -> &Descriptor {
        &self.desc
    }

    /// The graph it runs.
    pub fn graph_name(&self) -> &str {
        &self.graph_name
    }

    /// [`Target::identity`] of the target the plan was built for (a plan runs only on a
    /// device of that identity).
    pub fn target_identity(&self) -> &str {
        &self.target
    }

    /// Real tensors (uid-sorted): the variant pack must give each one a pointer.
    pub fn real_tensors(&self) -> &[RealTensor] {
        &self.real
    }

    /// Workspace bytes.
    pub fn workspace_size(&self) -> usize {
        self.workspace
    }

    /// The engine (read back from cuDNN; `None` only where cuDNN could not say).
    pub fn engine(&self) -> Option<&EngineInfo> {
        self.engine.as_ref()
    }

    /// The heuristics mode that proposed it (for a restored plan, as its file records).
    pub fn heuristics_mode(&self) -> Option<HeurMode> {
        self.mode
    }

    /// Its index among the configs heuristics returned.
    pub fn config_index(&self) -> usize {
        self.config_index
    }

    /// (reported, usable) config counts of the heuristics query that produced it.
    pub fn config_counts(&self) -> (usize, usize) {
        (self.configs_reported, self.configs_usable)
    }

    /// Whether cuDNN compiles this engine at run time (NVRTC).
    pub fn is_runtime_compiled(&self) -> bool {
        self.has_behavior(sys::cudnnBackendBehaviorNote_t::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION)
    }

    /// Whether cuDNN's native CUDA-graph population supports this plan.
    pub fn supports_cuda_graph_api(&self) -> bool {
        self.has_behavior(
            sys::cudnnBackendBehaviorNote_t::CUDNN_BEHAVIOR_NOTE_SUPPORTS_CUDA_GRAPH_NATIVE_API,
        )
    }

    fn has_behavior(&self, note: sys::cudnnBackendBehaviorNote_t) -> bool {
        self.engine
            .as_ref()
            .is_some_and(|e| e.behavior_notes.contains(&note))
    }

    /// The plan's JSON representation (names the matched pattern and the engine; for
    /// inspection: the plan cache does not persist it).
    pub fn json(&self) -> Result<String> {
        backend::plan_json(&self.desc)
    }

    /// A short tag: `eng<index>`, or `restored` when the engine is unknown.
    pub fn engine_tag(&self) -> String {
        match &self.engine {
            Some(e) => format!("eng{}", e.global_index),
            None => "restored".into(),
        }
    }

    /// The pattern cuDNN matched (`finalizeMode` in the plan JSON), when present.
    pub fn pattern(&self) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(&self.json().ok()?).ok()?;
        find_key(&v, "finalizeMode")
    }
}

fn find_key(v: &serde_json::Value, key: &str) -> Option<String> {
    match v {
        serde_json::Value::Object(m) => m
            .get(key)
            .and_then(|x| x.as_str().map(str::to_string))
            .or_else(|| m.values().find_map(|x| find_key(x, key))),
        serde_json::Value::Array(a) => a.iter().find_map(|x| find_key(x, key)),
        _ => None,
    }
}

/// Builds plans for a lowered graph on `target` following `policy`.
/// Returns at least one plan, or a typed error saying how many configs heuristics offered.
pub fn build_plans(
    op: &OperationGraph,
    target: &Target,
    policy: &PlanPolicy,
) -> Result<Vec<ExecutionPlan>> {
    let mut plans = Vec::new();
    let mut reported_total = 0;
    let mut usable_total = 0;
    let mut tried = 0;
    let mut last = String::from("no engine config to try");
    check_lowering(
        op.name(),
        op.handle_addr(),
        target.graph_handle().map(|h| h.raw() as usize),
        &target.describe(),
    )?;
    target.make_current()?;
    'modes: for &mode in &policy.modes {
        let heur = match backend::heuristics(op.descriptor(), mode, target.devprop()) {
            Ok(heur) => heur,
            // cuDNN refuses to run heuristics at all for some graphs it has no engine for
            // (NOT_SUPPORTED family, 3000–3999): that is "no engine", and the caller's
            // fallback applies, not a hard failure.
            Err(e @ Error::Cudnn { .. }) if not_supported(&e) => {
                last = e.to_string();
                continue;
            }
            Err(e) => return Err(e),
        };
        reported_total += heur.reported;
        usable_total += heur.configs.len();
        for (i, cfg) in heur.configs.iter().enumerate() {
            tried += 1;
            match compiled::finalize(op, target, cfg) {
                Ok(desc) => {
                    let mut plan = finished_plan(op, target, cfg, desc)?;
                    plan.mode = Some(mode);
                    plan.config_index = i;
                    plan.configs_reported = heur.reported;
                    plan.configs_usable = heur.configs.len();
                    plans.push(plan);
                    let enough =
                        !policy.build_all || policy.max_plans.is_some_and(|m| plans.len() >= m);
                    if enough {
                        break 'modes;
                    }
                }
                Err(e) => last = e.to_string(),
            }
        }
    }
    if !plans.is_empty() {
        return Ok(plans);
    }
    let modes = policy
        .modes
        .iter()
        .map(|m| format!("{m:?}"))
        .collect::<Vec<_>>()
        .join("+");
    if usable_total == 0 {
        return Err(Error::NoEngine {
            graph: op.name().to_string(),
            target: target.props().name().to_string(),
            mode: modes,
            reported: reported_total,
            usable: 0,
        });
    }
    Err(Error::NoPlan {
        graph: op.name().to_string(),
        target: target.props().name().to_string(),
        tried,
        last,
    })
}

/// The plan of a finalized `desc` for `op` from engine config `cfg`: its graph, engine and
/// knob settings recorded.
fn finished_plan(
    op: &OperationGraph,
    target: &Target,
    cfg: &Descriptor,
    desc: Descriptor,
) -> Result<ExecutionPlan> {
    let mut plan = ExecutionPlan::from_parts(
        desc,
        op.name().to_string(),
        op.real_tensors().to_vec(),
        target,
    )?;
    plan.set_source_graph(op.source_graph());
    plan.engine = backend::engine_info(cfg).ok();
    plan.choice = match (&plan.engine, backend::config_knobs(cfg)) {
        (Some(e), Ok(knobs)) => Some(EngineChoice {
            engine: e.global_index,
            knobs,
        }),
        _ => None,
    };
    Ok(plan)
}

/// The plan of `op` on `target` with the engine and knobs of `choice`, without heuristics.
/// Only the engine and its knobs come from `choice`: every operation, tensor and scalar is the
/// lowered graph's own, and cuDNN checks the engine and knobs against it.
///
/// # Errors
/// [`Error::InvalidConfig`] for an engine index the graph has no engine for, a knob the
/// engine does not have (or given twice), or a value outside the knob's range; cuDNN's error
/// when it refuses the engine, the config or the plan.
pub fn plan_from_choice(
    op: &OperationGraph,
    target: &Target,
    choice: &EngineChoice,
) -> Result<ExecutionPlan> {
    check_lowering(
        op.name(),
        op.handle_addr(),
        target.graph_handle().map(|h| h.raw() as usize),
        &target.describe(),
    )?;
    target.make_current()?;
    let bad = |field: &str, problem: String| Error::InvalidConfig {
        layer: format!("engine choice for `{}`", op.name()),
        field: field.into(),
        problem,
    };
    let count = backend::engine_count(op.descriptor())?;
    if !(0..count).contains(&choice.engine) {
        return Err(bad(
            "engine",
            format!(
                "{} is not an engine of this graph (it has {count})",
                choice.engine
            ),
        ));
    }
    let engine = backend::engine_by_index(op.descriptor(), choice.engine, target.devprop())?;
    let ranges = backend::engine_knobs(&engine)?;
    for (i, k) in choice.knobs.iter().enumerate() {
        if choice.knobs[..i].iter().any(|o| o.knob == k.knob) {
            return Err(bad("knobs", format!("knob {} is given twice", k.knob)));
        }
        let range = ranges.iter().find(|r| r.knob == k.knob).ok_or_else(|| {
            bad(
                "knobs",
                format!("engine {} has no knob {}", choice.engine, k.knob),
            )
        })?;
        if !range.accepts(k.value) {
            return Err(bad(
                "knobs",
                format!(
                    "knob {} of engine {} takes {}..={} in steps of {}, not {}",
                    k.knob, choice.engine, range.min, range.max, range.stride, k.value
                ),
            ));
        }
    }
    let cfg = backend::engine_config(&engine, &choice.knobs)?;
    let desc = compiled::finalize(op, target, &cfg)?;
    finished_plan(op, target, &cfg, desc)
}

/// Refuses a graph lowered with another handle than the one its target gives operation graphs
/// (`graph_handle`, `target_handle`: handle addresses, `None` for no handle): on a live target
/// a graph without the handle would be ranked for whatever device is current, not the
/// target's.
fn check_lowering(
    graph: &str,
    graph_handle: Option<usize>,
    target_handle: Option<usize>,
    target: &str,
) -> Result<()> {
    if graph_handle == target_handle {
        return Ok(());
    }
    let lowered_for = match graph_handle {
        None => "no device (without a handle)".to_string(),
        Some(_) => "a live device's handle".to_string(),
    };
    let planned_for = match target_handle {
        Some(_) if graph_handle.is_some() => format!("{target} on another handle"),
        _ => target.to_string(),
    };
    Err(Error::LoweredForOtherTarget {
        graph: graph.to_string(),
        lowered_for,
        planned_for,
    })
}

/// Whether `e` is cuDNN saying "not supported" (status 3000–3999).
fn not_supported(e: &Error) -> bool {
    matches!(e, Error::Cudnn { source, .. } if (3000..4000).contains(&source.code))
}

/// The first plan that finalizes, under the default policy.
pub fn build_plan(op: &OperationGraph, target: &Target) -> Result<ExecutionPlan> {
    Ok(build_plans(op, target, &PlanPolicy::default())?.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_graph_is_planned_only_for_the_handle_it_was_lowered_with() {
        // Deviceless: neither has a handle.
        check_lowering("g", None, None, "NVIDIA H200 (deviceless)").unwrap();
        // Live, lowered with the target's own handle.
        check_lowering("g", Some(0x10), Some(0x10), "NVIDIA H200 (live)").unwrap();
        for (graph, target, needle) in [
            (None, Some(0x10), "lowered for no device"),
            (Some(0x10), None, "lowered for a live device's handle"),
            (Some(0x10), Some(0x20), "on another handle"),
        ] {
            let err = check_lowering("conv", graph, target, "NVIDIA H200").unwrap_err();
            assert!(
                matches!(&err, Error::LoweredForOtherTarget { graph, .. } if graph == "conv"),
                "{err}"
            );
            let text = err.to_string();
            assert!(text.contains(needle), "{text}");
            assert!(text.contains("OperationGraph::for_target"), "{text}");
        }
    }
}
