//! Planning again for the live device the layers of a network planned for another target
//! (a deviceless fixture, another device or cuDNN), saying so once per network and device.

use crate::net::compile::CompiledNet;
use cudnn_cbr_fusion::cache::PlanCache;
use cudnn_cbr_fusion::Target;
use std::collections::HashSet;
use std::sync::Mutex;

use super::{CudaNetError, ReplanFailure, Result};

/// The layers of `net` (indices, in forward order) with a plan built for another target than
/// the one whose [`Target::identity`] is `live`: what [`replan_for`] plans again. A layer
/// without plans (made for the CPU executor) is not one of them.
pub fn layers_to_replan(net: &CompiledNet, live: &str) -> Vec<usize> {
    net.layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.layer.plans().any(|(_, p)| p.target_identity() != live))
        .map(|(i, _)| i)
        .collect()
}

/// What [`replan_for`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replanned {
    /// The layers planned again, by name.
    pub layers: Vec<String>,
    /// The target identities their plans had been built for.
    pub planned_for: Vec<String>,
    /// The target they were planned for now.
    pub live: String,
    /// The one-line note naming both.
    pub note: String,
    /// Whether this call printed the note (the first time in this process for these targets).
    pub printed: bool,
}

/// Targets whose re-planning was reported already, as `planned → live`: the note is said once
/// per pair and process, not once per network or layer.
static REPLAN_NOTES: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Records `key` and says whether it is new (the note for it is to be printed).
fn first_time(key: &str) -> bool {
    let mut said = REPLAN_NOTES.lock().unwrap_or_else(|p| p.into_inner());
    said.get_or_insert_with(HashSet::new)
        .insert(key.to_string())
}

/// Plans again, through `cache`, every layer of `net` whose plans were built for another target
/// than `target` ([`layers_to_replan`]), on the same route ([`CbrLayer::replan`]), so no plan
/// made for a fixture (or another device or cuDNN) runs on `target`'s device unchecked. Prints
/// one note on stderr naming the targets, the first time in this process for those targets.
/// `None` when every plan was built for `target`.
///
/// # Errors
/// [`CudaNetError::Replan`] naming the layer whose route has no plan on `target` (the network
/// must then be compiled for it).
///
/// [`CbrLayer::replan`]: cudnn_cbr_fusion::cbr::CbrLayer::replan
pub fn replan_for(
    net: &mut CompiledNet,
    target: &Target,
    cache: &PlanCache,
) -> Result<Option<Replanned>> {
    let live = target.identity();
    let stale = layers_to_replan(net, live);
    if stale.is_empty() {
        return Ok(None);
    }
    let mut planned_for: Vec<String> = Vec::new();
    for &i in &stale {
        for id in net.layers[i].layer.plan_targets() {
            if id != live && !planned_for.iter().any(|p| p == id) {
                planned_for.push(id.to_string());
            }
        }
    }
    let mut layers = Vec::with_capacity(stale.len());
    for &i in &stale {
        let l = &net.layers[i];
        let replanned = l.layer.replan(target, cache).map_err(|source| {
            CudaNetError::Replan(Box::new(ReplanFailure {
                net: net.spec.name.clone(),
                layer: l.name.clone(),
                planned_for: l.layer.plan_targets().join(", "),
                live: live.to_string(),
                source,
            }))
        })?;
        net.layers[i].layer = replanned;
        layers.push(net.layers[i].name.clone());
    }
    let note = format!(
        "note: network `{}`: {} of {} layers were planned for {}, not for the live device {}; planned them again for it",
        net.spec.name,
        stale.len(),
        net.layers.len(),
        planned_for.join(", "),
        live
    );
    let printed = first_time(&format!("{} -> {live}", planned_for.join(", ")));
    if printed {
        crate::runtime::stderr::line(&note);
    }
    Ok(Some(Replanned {
        layers,
        planned_for,
        live: live.to_string(),
        note,
        printed,
    }))
}
