//! When each amp bucket's gradients are final during a network's backward pass, so that a
//! data-parallel step can sum a bucket over the ranks while the backward of the shallower
//! layers still runs (the deepest bucket first, as backward finishes them).
//!
//! The schedule is read off the compiled network: a gradient buffer is final after the last
//! backward step that binds it (reads or writes it: a later read must not see the sum either),
//! and a bucket after the last of its parameters' gradients. Parameters without a network
//! buffer (the classifier head's) are final before the network's backward starts.

use super::compile::{BufId, BufferRole, CompiledNet, Step};
use super::cuda::{layer_bindings, param_slot, CudaNetError};
use crate::amp::plan::{Bucket, MemoryPlan};
use std::collections::HashMap;

/// Which buckets may be summed when, in a backward pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradSchedule {
    /// Final before the first backward step (gradients the network does not write).
    pub before: Vec<Bucket>,
    /// `after[i]`: final once backward step `i` ([`CompiledNet::backward`]) has run. Each
    /// list is in declaration order reversed (deepest first).
    pub after: Vec<Vec<Bucket>>,
}

impl GradSchedule {
    /// Every bucket in the order the schedule releases them.
    pub fn order(&self) -> impl Iterator<Item = Bucket> + '_ {
        self.before
            .iter()
            .chain(self.after.iter().flatten())
            .copied()
    }
}

/// The schedule of `net`'s backward pass for the buckets of `plan` (the plan the network's
/// parameters live in: [`super::memory_plan`]).
///
/// # Errors
/// A network buffer the layers bind that does not exist ([`layer_bindings`]).
pub fn grad_schedule(net: &CompiledNet, plan: &MemoryPlan) -> Result<GradSchedule, CudaNetError> {
    // The last backward step binding each buffer.
    let mut last: HashMap<BufId, usize> = HashMap::new();
    for (i, step) in net.backward.iter().enumerate() {
        let bound: Vec<BufId> = match *step {
            Step::Layer { layer, .. } => layer_bindings(net, layer)?
                .into_iter()
                .map(|(_, _, id)| id)
                .collect(),
            // Adds and pools bind their operands (never an error).
            other => super::liveness::step_buffers(net, &other)?,
        };
        for id in bound {
            last.insert(id, i);
        }
    }
    // Each amp parameter's gradient buffers in the network.
    let mut grads: HashMap<String, Vec<BufId>> = HashMap::new();
    for (id, b) in net.buffers.iter().enumerate() {
        if b.role == BufferRole::ParamGrad {
            if let Some((key, _)) = param_slot(&b.name) {
                grads.entry(key).or_default().push(id);
            }
        }
    }
    let mut schedule = GradSchedule {
        before: Vec::new(),
        after: vec![Vec::new(); net.backward.len()],
    };
    for b in plan.buckets().iter().rev() {
        let ready = plan.params()[b.params()]
            .iter()
            .flat_map(|p| grads.get(p.name()).into_iter().flatten())
            .filter_map(|id| last.get(id).copied())
            .max();
        match ready {
            Some(i) => schedule.after[i].push(b.bucket()),
            None => schedule.before.push(b.bucket()),
        }
    }
    Ok(schedule)
}
