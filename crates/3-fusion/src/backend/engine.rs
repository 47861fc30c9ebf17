//! Device properties, heuristics and execution plans at the descriptor level.

use super::descriptor::Descriptor;
use crate::error::{Error, Result};
use crate::target::DeviceProps;
use cudnn_fe_sys as sys;
use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendDescriptorType_t as K;

/// A finalized `CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR` built from a JSON document (cuDNN ≥ 9.8).
pub fn device_prop_descriptor(props: &DeviceProps) -> Result<Descriptor> {
    let lib = sys::library()?;
    if !lib.supports_deviceless() {
        return Err(Error::DevicelessUnsupported {
            version: lib.version(),
        });
    }
    let mut d = Descriptor::new(K::CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR)?;
    d.set(
        A::CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION,
        props.json().as_bytes(),
    )?;
    d.finalize().map_err(|e| Error::DeviceProps {
        source_name: props.origin().map(str::to_string),
        reason: format!("cuDNN rejected the document: {e}"),
    })?;
    Ok(d)
}

/// A finalized `CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR` for the device behind a live cuDNN handle
/// (`CUDNN_ATTR_DEVICEPROP_HANDLE`, cuDNN ≥ 9.8): what the heuristics of a live target rank
/// engines for. The caller makes the handle's context current (an older cuDNN has no such
/// descriptor: [`crate::target::device_binding`] asks for none there).
pub fn device_prop_descriptor_for_handle(handle: sys::cudnnHandle_t) -> Result<Descriptor> {
    let mut d = Descriptor::new(K::CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR)?;
    d.set_one(A::CUDNN_ATTR_DEVICEPROP_HANDLE, handle)?;
    d.finalize()?;
    Ok(d)
}

/// Heuristics modes cuDNN offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeurMode {
    /// Fast rule-based ranking (`CUDNN_HEUR_MODE_A`).
    A,
    /// Slower, model-based ranking (`CUDNN_HEUR_MODE_B`).
    B,
    /// Engines that work everywhere, usually slow (`CUDNN_HEUR_MODE_FALLBACK`).
    Fallback,
}

impl HeurMode {
    fn raw(self) -> sys::cudnnBackendHeurMode_t {
        match self {
            HeurMode::A => sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            HeurMode::B => sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B,
            HeurMode::Fallback => sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        }
    }
}

/// What heuristics returned for one mode.
#[derive(Debug)]
pub struct HeuristicsResult {
    /// The mode asked.
    pub mode: HeurMode,
    /// The count cuDNN reported (includes configs that later fail its support checks).
    pub reported: usize,
    /// The engine configs cuDNN actually returned, best first.
    pub configs: Vec<Descriptor>,
}

/// Runs heuristics `mode` on a finalized operation graph, ranking engines for the device
/// `devprop` describes (a document's, or a live handle's) when given.
pub fn heuristics(
    op_graph: &Descriptor,
    mode: HeurMode,
    devprop: Option<&Descriptor>,
) -> Result<HeuristicsResult> {
    let mut heur = Descriptor::new(K::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_descriptors(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[op_graph])?;
    heur.set_one(A::CUDNN_ATTR_ENGINEHEUR_MODE, mode.raw())?;
    if let Some(dp) = devprop {
        heur.set_descriptors(A::CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, &[dp])?;
    }
    heur.finalize()?;
    let reported = heur.count(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        sys::cudnnBackendAttributeType_t::CUDNN_TYPE_BACKEND_DESCRIPTOR,
    )?;
    // cuDNN returns only the configs that pass its support checks, possibly fewer than
    // `reported`, with a success status.
    let configs = heur.get_descriptors(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
        reported,
    )?;
    Ok(HeuristicsResult {
        mode,
        reported,
        configs,
    })
}

/// Where a plan is finalized: on a live handle, or deviceless for a device-properties descriptor.
#[derive(Debug, Clone, Copy)]
pub enum PlanSite<'a> {
    /// Deviceless: the plan is built for these device properties.
    Deviceless(&'a Descriptor),
    /// On the device behind this cuDNN handle.
    Handle(sys::cudnnHandle_t),
}

/// Finalizes an execution plan for one engine config.
pub fn finalize_plan(engine_config: &Descriptor, site: PlanSite<'_>) -> Result<Descriptor> {
    let mut plan = Descriptor::new(K::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set_descriptors(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[engine_config])?;
    match site {
        PlanSite::Deviceless(dp) => {
            plan.set_descriptors(A::CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, &[dp])?;
        }
        PlanSite::Handle(h) => {
            plan.set_one(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, h)?;
        }
    }
    plan.finalize()?;
    Ok(plan)
}

/// Re-creates a plan from its JSON representation (skips heuristics and runtime compilation).
pub fn plan_from_json(json: &str, site: PlanSite<'_>) -> Result<Descriptor> {
    let mut plan = Descriptor::new(K::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    match site {
        PlanSite::Deviceless(dp) => {
            plan.set_descriptors(A::CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, &[dp])?;
        }
        PlanSite::Handle(h) => {
            plan.set_one(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, h)?;
        }
    }
    plan.set(
        A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
        json.as_bytes(),
    )?;
    plan.finalize()?;
    Ok(plan)
}

/// The workspace bytes a finalized plan needs.
pub fn plan_workspace_size(plan: &Descriptor) -> Result<usize> {
    let ws: i64 = plan.get_one(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
    Ok(ws.max(0) as usize)
}

/// The JSON representation of a finalized plan (names the matched pattern and the engine).
pub fn plan_json(plan: &Descriptor) -> Result<String> {
    plan.get_string(A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION)
}

/// The engine behind an engine config: its global index, behaviour and numerical notes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// `CUDNN_ATTR_ENGINE_GLOBAL_INDEX` (meaningful only within one pattern class).
    pub global_index: i64,
    /// Behaviour notes, e.g. runtime compilation.
    pub behavior_notes: Vec<sys::cudnnBackendBehaviorNote_t>,
    /// Numerical notes, e.g. tensor cores, reduced precision reduction.
    pub numerical_notes: Vec<sys::cudnnBackendNumericalNote_t>,
}

/// Reads the engine of an engine config.
pub fn engine_info(engine_config: &Descriptor) -> Result<EngineInfo> {
    let engine = engine_config
        .get_descriptors(
            A::CUDNN_ATTR_ENGINECFG_ENGINE,
            K::CUDNN_BACKEND_ENGINE_DESCRIPTOR,
            1,
        )?
        .pop()
        .ok_or_else(|| Error::cudnn_msg("engine config has no engine"))?;
    Ok(EngineInfo {
        global_index: engine.get_one(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?,
        behavior_notes: engine.get(A::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, 16)?,
        numerical_notes: engine.get(A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, 16)?,
    })
}

/// The engine behind a finalized plan, read back through the plan's engine config (a plan
/// re-created from JSON has no config of ours to ask).
pub fn plan_engine_info(plan: &Descriptor) -> Result<EngineInfo> {
    let config = plan
        .get_descriptors(
            A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
            K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
            1,
        )?
        .pop()
        .ok_or_else(|| Error::cudnn_msg("execution plan has no engine config"))?;
    engine_info(&config)
}

/// One knob setting of an engine config: the knob (`CUDNN_KNOB_TYPE_*`, raw) and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KnobChoice {
    /// The knob type's raw value.
    pub knob: u32,
    /// The value chosen for it.
    pub value: i64,
}

/// What values an engine accepts for one knob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnobRange {
    /// The knob type's raw value.
    pub knob: u32,
    /// The smallest value.
    pub min: i64,
    /// The largest value.
    pub max: i64,
    /// Values are `min + k * stride`.
    pub stride: i64,
}

impl KnobRange {
    /// Whether `value` is one this knob takes.
    pub fn accepts(&self, value: i64) -> bool {
        (self.min..=self.max).contains(&value)
            && (self.stride <= 1 || (value - self.min) % self.stride == 0)
    }
}

/// How many engines cuDNN has for a finalized operation graph: their global indices are
/// `0..count` (meaningful for this graph only).
pub fn engine_count(op_graph: &Descriptor) -> Result<i64> {
    op_graph.get_one(A::CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT)
}

/// A finalized engine: the one of global index `index` for a finalized operation graph, on
/// the device `devprop` describes when given (as for [`heuristics`]; cuDNN refuses an index it
/// has no engine for, or one that does not support the graph on that device).
pub fn engine_by_index(
    op_graph: &Descriptor,
    index: i64,
    devprop: Option<&Descriptor>,
) -> Result<Descriptor> {
    let mut engine = Descriptor::new(K::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    engine.set_descriptors(A::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, &[op_graph])?;
    engine.set_one(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, index)?;
    if let Some(dp) = devprop {
        engine.set_descriptors(A::CUDNN_ATTR_ENGINE_DEVICEPROP, &[dp])?;
    }
    engine.finalize()?;
    Ok(engine)
}

/// The knobs a finalized engine has, with the values each takes.
pub fn engine_knobs(engine: &Descriptor) -> Result<Vec<KnobRange>> {
    // A count query answers 0 here: ask for room for every knob type instead.
    let n = sys::cudnnBackendKnobType_t::CUDNN_KNOB_TYPE_COUNTS.0 as usize;
    let infos = engine.get_descriptors(
        A::CUDNN_ATTR_ENGINE_KNOB_INFO,
        K::CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR,
        n,
    )?;
    infos
        .iter()
        .map(|info| {
            let knob: sys::cudnnBackendKnobType_t = info.get_one(A::CUDNN_ATTR_KNOB_INFO_TYPE)?;
            Ok(KnobRange {
                knob: knob.0,
                min: info.get_one(A::CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE)?,
                max: info.get_one(A::CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE)?,
                stride: info.get_one(A::CUDNN_ATTR_KNOB_INFO_STRIDE)?,
            })
        })
        .collect()
}

/// A finalized engine config: `engine` with `knobs` set (cuDNN checks the values).
pub fn engine_config(engine: &Descriptor, knobs: &[KnobChoice]) -> Result<Descriptor> {
    let mut choices = Vec::with_capacity(knobs.len());
    for k in knobs {
        let mut c = Descriptor::new(K::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)?;
        c.set_one(
            A::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
            sys::cudnnBackendKnobType_t(k.knob),
        )?;
        c.set_one(A::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, k.value)?;
        c.finalize()?;
        choices.push(c);
    }
    let mut cfg = Descriptor::new(K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)?;
    cfg.set_descriptors(A::CUDNN_ATTR_ENGINECFG_ENGINE, &[engine])?;
    if !choices.is_empty() {
        let refs: Vec<&Descriptor> = choices.iter().collect();
        cfg.set_descriptors(A::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, &refs)?;
    }
    cfg.finalize()?;
    Ok(cfg)
}

/// The knob settings of an engine config (heuristics' or [`engine_config`]'s).
pub fn config_knobs(engine_config: &Descriptor) -> Result<Vec<KnobChoice>> {
    // A count query answers 0 here: ask for room for every knob type instead.
    let n = sys::cudnnBackendKnobType_t::CUDNN_KNOB_TYPE_COUNTS.0 as usize;
    let choices = engine_config.get_descriptors(
        A::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
        K::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR,
        n,
    )?;
    choices
        .iter()
        .map(|c| {
            let knob: sys::cudnnBackendKnobType_t =
                c.get_one(A::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE)?;
            Ok(KnobChoice {
                knob: knob.0,
                value: c.get_one(A::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE)?,
            })
        })
        .collect()
}
