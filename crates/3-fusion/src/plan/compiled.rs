//! Runtime compilation once per process, for deviceless plans.
//!
//! Finalizing a plan for a runtime-compiled engine makes cuDNN generate and compile its
//! kernel: 0.6–1.9 s of CPU per graph for the BN and element-wise graphs of ResNet-50
//! (deviceless, cuDNN 9.28.1, one core of an AMD EPYC), against 1–2 ms to re-create the plan
//! from the JSON cuDNN serializes it to. A deviceless plan depends on nothing but the graph
//! (its signature), the device properties and cuDNN's version (the target's identity) and the
//! engine config (engine and knobs), so the first plan this process finalizes for such a key
//! is kept as JSON, and every later one is re-created from it: all plan caches, targets and
//! threads of a process share the compilation (tests and tools that plan the same network
//! several times, ranks of a group planning in one process).
//!
//! What is read back is only what this process serialized: nothing comes from a file (a
//! plan's JSON carries machine code, which the persistent plan cache never takes from disk).
//! Live targets always finalize (their plans are bound to a handle's device, and re-creating
//! them has not been measured on a GPU). At most [`MAX_BYTES`] of JSON are kept; past that,
//! plans are compiled as without the memo. A plan cuDNN will not re-create is compiled.

use crate::backend::{self, Descriptor};
use crate::error::Result;
use crate::lower::OperationGraph;
use crate::target::{Target, TargetKind};
use cudnn_fe_sys as sys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The most JSON the memo keeps (a runtime-compiled plan's is 60–110 kB: about 600 plans).
pub const MAX_BYTES: usize = 64 << 20;

/// What the memo holds and did, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompiledPlanStats {
    /// Plans kept.
    pub entries: usize,
    /// Bytes of JSON kept.
    pub bytes: usize,
    /// Plans re-created from a kept one instead of compiled.
    pub reused: u64,
}

#[derive(Default)]
struct Memo {
    plans: HashMap<String, Arc<str>>,
    bytes: usize,
}

static MEMO: OnceLock<Mutex<Memo>> = OnceLock::new();
static REUSED: AtomicU64 = AtomicU64::new(0);

fn memo() -> std::sync::MutexGuard<'static, Memo> {
    // A panic elsewhere while holding the lock leaves the map whole (inserts are single
    // calls): keep using it.
    MEMO.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What the memo holds and how often it was used in this process.
pub fn compiled_plan_stats() -> CompiledPlanStats {
    let m = memo();
    CompiledPlanStats {
        entries: m.plans.len(),
        bytes: m.bytes,
        reused: REUSED.load(Ordering::Relaxed),
    }
}

/// Empties the memo: later plans are compiled again (benchmarks of cold planning call this;
/// it also frees the memory).
pub fn forget_compiled_plans() {
    let mut m = memo();
    m.plans.clear();
    m.bytes = 0;
}

/// Finalizes the plan of `op` for engine config `cfg` on `target`: re-created from this
/// process's earlier compilation of the same deviceless plan when there is one.
pub(super) fn finalize(
    op: &OperationGraph,
    target: &Target,
    cfg: &Descriptor,
) -> Result<Descriptor> {
    let site = target.plan_site();
    let Some(key) = memo_key(op, target, cfg) else {
        return backend::finalize_plan(cfg, site);
    };
    let kept = memo().plans.get(&key).cloned();
    if let Some(json) = kept {
        // A refusal is not expected (cuDNN made this JSON): compile instead.
        if let Ok(plan) = backend::plan_from_json(&json, site) {
            REUSED.fetch_add(1, Ordering::Relaxed);
            return Ok(plan);
        }
    }
    let plan = backend::finalize_plan(cfg, site)?;
    if let Ok(json) = backend::plan_json(&plan) {
        let mut m = memo();
        if m.bytes + json.len() <= MAX_BYTES && !m.plans.contains_key(&key) {
            m.bytes += json.len();
            m.plans.insert(key, json.into());
        }
    }
    Ok(plan)
}

/// The memo's key for a deviceless plan of a runtime-compiled engine, `None` otherwise
/// (precompiled engines finalize in well under a millisecond).
fn memo_key(op: &OperationGraph, target: &Target, cfg: &Descriptor) -> Option<String> {
    if target.kind() != TargetKind::Deviceless {
        return None;
    }
    let engine = backend::engine_info(cfg).ok()?;
    let compiled = engine
        .behavior_notes
        .contains(&sys::cudnnBackendBehaviorNote_t::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION);
    if !compiled {
        return None;
    }
    let knobs = backend::config_knobs(cfg).ok()?;
    let knobs: Vec<String> = knobs
        .iter()
        .map(|k| format!("{}={}", k.knob, k.value))
        .collect();
    Some(format!(
        "{}\nengine {} knobs {}\n{}",
        target.identity(),
        engine.global_index,
        knobs.join(","),
        op.signature().text()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cbr::{graphs, ConvShape};
    use crate::plan::build_plan;
    use crate::test_support;

    /// Whether the memo holds a plan of the graph with this signature text.
    fn kept(signature: &str) -> bool {
        memo().plans.keys().any(|k| k.ends_with(signature))
    }

    #[test]
    fn a_deviceless_runtime_compiled_plan_is_compiled_once_per_process() {
        if !test_support::cudnn_or_skip(
            "a_deviceless_runtime_compiled_plan_is_compiled_once_per_process",
        ) {
            return;
        }
        let target = test_support::h200();
        // A shape no other test of this crate plans, so the memo's entry is this test's.
        let (graph, _) = graphs::relu_forward([3, 40, 7, 5]);
        let signature = graph.signature().unwrap().text().to_string();
        let first = build_plan(&OperationGraph::new(&graph).unwrap(), &target).unwrap();
        assert!(first.is_runtime_compiled(), "{}", first.engine_tag());
        assert!(kept(&signature), "the compiled plan is kept");
        let reused = compiled_plan_stats().reused;
        // Lowered again (a new operation graph, as another plan cache would): re-created.
        let second = build_plan(&OperationGraph::new(&graph).unwrap(), &target).unwrap();
        assert!(compiled_plan_stats().reused > reused);
        assert_eq!(second.engine_tag(), first.engine_tag());
        assert_eq!(second.workspace_size(), first.workspace_size());
        assert_eq!(second.engine(), first.engine());
        // (The JSON itself differs between compilations: its kernel parameters' raw bytes
        // hold whatever the compiling process had there.)
        assert_eq!(second.pattern(), first.pattern());
        assert_eq!(second.json().unwrap().len(), first.json().unwrap().len());
        assert_eq!(second.real_tensors(), first.real_tensors());

        // A precompiled engine's plan is not kept (it finalizes in well under a millisecond).
        let (conv, _) = graphs::conv_fprop(&ConvShape::square(3, 40, 7, 24, 3, 1, 1), false, false);
        let plan = build_plan(&OperationGraph::new(&conv).unwrap(), &target).unwrap();
        assert!(!plan.is_runtime_compiled(), "{}", plan.engine_tag());
        assert!(!kept(conv.signature().unwrap().text()));

        // Forgotten, then compiled (and kept) again.
        forget_compiled_plans();
        assert!(!kept(&signature));
        let third = build_plan(&OperationGraph::new(&graph).unwrap(), &target).unwrap();
        assert_eq!(third.engine_tag(), first.engine_tag());
        assert!(kept(&signature));
        let stats = compiled_plan_stats();
        assert!(stats.entries >= 1 && stats.bytes > 0, "{stats:?}");
    }
}
