//! What a compiled network and its training step keep in device memory, by kind: the report
//! `deviceless_plans --memory` prints.
//!
//! The figures are the sizes of what the CUDA executor allocates for a step, as planned: the
//! amp regions ([`memory_plan`]: FP32 master weights W and their FP16 copy A, the gradients G
//! and G16, momentum M, EMA E/E16 when asked, the scalars S), the network's buffers, and one
//! cuDNN workspace, the largest any layer's plans need.
//!
//! The network's buffers are counted twice: by role with one slot each (what a plan without
//! lifetimes allocates), and as they are allocated, in the liveness-planned tensor arena of
//! [`super::memory_plan_with_buffers`] (buffers never alive together share bytes:
//! [`super::liveness`]) plus the buffers of their own (input, output and its gradient, running
//! statistics). The arena and the head-facing buffers are proportional to the batch;
//! everything else is not, which is what [`MemoryReport::largest_batch`] uses.

use std::fmt;

use super::compile::{BufferRole, CompiledNet};
use super::liveness::lifetimes;
use super::params::{in_arena, memory_plan};
use crate::amp::plan::{assign_tensor_offsets, peak_live, Lifetime, Region, SLOT_ALIGN};
use crate::amp::PlanError;

/// One megabyte as the report prints it (10^6 bytes).
const MB: f64 = 1e6;

/// Device bytes of one training step of a compiled network, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    /// Images per step.
    pub batch: usize,
    /// FP32 master weights (W) and their FP16 compute copy (A), the classifier head included.
    pub parameters: u64,
    /// Parameter gradients: FP32 (G) and the conv weights' FP16 (G16).
    pub gradients: u64,
    /// Optimizer state: momentum (M), EMA (E, E16) when planned, and the scalars (S).
    pub optimizer: u64,
    /// Activations, one slot each: the input images and every activation (stored for the
    /// backward pass or passed between layers).
    pub activations: u64,
    /// Activation gradients, one slot each.
    pub activation_grads: u64,
    /// BN running statistics and per-channel scratch (statistics, coefficients), one slot
    /// each.
    pub per_channel: u64,
    /// The liveness-planned tensor arena that holds the activations, their gradients and the
    /// per-channel scratch (all but the buffers of their own).
    pub arena: u64,
    /// The most bytes of the arena's buffers alive at one step: no arena can be smaller.
    pub arena_peak: u64,
    /// The buffers of their own: input, output and its gradient, running statistics.
    pub own: u64,
    /// The part of [`MemoryReport::own`] proportional to the batch (input, output, gradient).
    pub own_batched: u64,
    /// The cuDNN workspace: the largest any layer's plans need (one, shared by all).
    pub workspace: u64,
}

impl MemoryReport {
    /// The report of `net` with a head of `classes` classes.
    ///
    /// # Errors
    /// As [`memory_plan`] (a head or network the amp plan cannot lay out).
    pub fn of(net: &CompiledNet, classes: usize) -> Result<Self, PlanError> {
        let plan = memory_plan(net, classes)?;
        let len = |r: Region| plan.region_len(r) as u64;
        let by_role = |want: &[BufferRole]| -> u64 {
            net.buffers
                .iter()
                .filter(|b| want.contains(&b.role))
                .map(|b| b.elems as u64 * b.dtype.size() as u64)
                .sum()
        };
        let live = lifetimes(net).map_err(|e| PlanError::Invariant {
            name: net.spec.name.clone(),
            what: format!("buffer lifetimes: {e}"),
        })?;
        let bytes = |id: usize| net.buffers[id].elems as u64 * net.buffers[id].dtype.size() as u64;
        let items: Vec<(usize, Lifetime)> = (0..net.buffers.len())
            .filter(|&id| in_arena(net, id))
            .map(|id| (bytes(id) as usize, live[id]))
            .collect();
        let (_, arena) =
            assign_tensor_offsets(&items, SLOT_ALIGN).ok_or_else(|| PlanError::SizeOverflow {
                name: net.spec.name.clone(),
                shape: Vec::new(),
                what: "tensor arena total",
            })?;
        let own_ids = || {
            (0..net.buffers.len()).filter(|&id| {
                !in_arena(net, id)
                    && !matches!(
                        net.buffers[id].role,
                        BufferRole::Param | BufferRole::ParamGrad
                    )
            })
        };
        let own: u64 = own_ids().map(bytes).sum();
        let own_batched: u64 = own_ids()
            .filter(|&id| net.buffers[id].role != BufferRole::Running)
            .map(bytes)
            .sum();
        let workspace = net
            .layers
            .iter()
            .map(|l| l.layer.workspace_size() as u64)
            .max()
            .unwrap_or(0);
        Ok(MemoryReport {
            batch: net.batch,
            parameters: len(Region::W) + len(Region::A),
            gradients: len(Region::G) + len(Region::G16),
            optimizer: len(Region::M) + len(Region::E) + len(Region::E16) + len(Region::S),
            activations: by_role(&[BufferRole::Input, BufferRole::Activation]),
            activation_grads: by_role(&[BufferRole::Gradient]),
            per_channel: by_role(&[BufferRole::Running, BufferRole::Scratch]),
            arena: arena as u64,
            arena_peak: peak_live(&items) as u64,
            own,
            own_batched,
            workspace,
        })
    }

    /// The report of the same step with one allocation per buffer (no shared arena: what
    /// a [`crate::net::CudaNet`] made without the tensor arena allocates): the arena's
    /// buffers counted one slot each.
    pub fn separate(mut self) -> Self {
        self.arena = self.network_separate() - self.own;
        self.arena_peak = self.arena;
        self
    }

    /// Every byte the step allocates (the network's buffers as allocated: the arena and the
    /// buffers of their own).
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer + self.network() + self.workspace
    }

    /// The network's buffers as allocated: the arena and the buffers of their own.
    pub fn network(&self) -> u64 {
        self.arena + self.own
    }

    /// The network's buffers with one slot each (activations, their gradients, per-channel).
    pub fn network_separate(&self) -> u64 {
        self.activations + self.activation_grads + self.per_channel
    }

    /// The network's buffers as allocated, per image.
    pub fn network_bytes_per_image(&self) -> f64 {
        self.network() as f64 / self.batch.max(1) as f64
    }

    /// The network's buffers with one slot each, per image (the figure before the arena).
    pub fn separate_bytes_per_image(&self) -> f64 {
        self.network_separate() as f64 / self.batch.max(1) as f64
    }

    /// The largest batch whose step fits in `device_bytes`, counting the arena and the
    /// head-facing buffers as proportional to the batch and everything else (the workspace at
    /// this report's batch included) as fixed; `None` when not even one image fits.
    pub fn largest_batch(&self, device_bytes: u64) -> Option<u64> {
        let batched = self.arena + self.own_batched;
        let per_image = batched.div_ceil(self.batch.max(1) as u64);
        let fixed = self.total() - batched;
        let room = device_bytes.checked_sub(fixed)?;
        let batch = room / per_image.max(1);
        (batch > 0).then_some(batch)
    }
}

impl fmt::Display for MemoryReport {
    /// One line per kind (MB = 10^6 bytes), the total, then the line ending
    /// `network buffers X.X MB per image`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, what: &str, bytes: u64| {
            writeln!(f, "  {what:<24} {:>12.1} MB", bytes as f64 / MB)
        };
        writeln!(
            f,
            "device memory of one training step, batch {}:",
            self.batch
        )?;
        row(f, "parameters (W, A)", self.parameters)?;
        row(f, "gradients (G, G16)", self.gradients)?;
        row(f, "optimizer (M, E, S)", self.optimizer)?;
        row(f, "activations", self.activations)?;
        row(f, "activation gradients", self.activation_grads)?;
        row(f, "per-channel buffers", self.per_channel)?;
        row(f, "  one slot each", self.network_separate())?;
        row(f, "  shared arena", self.arena)?;
        row(f, "  (peak alive)", self.arena_peak)?;
        row(f, "  own buffers", self.own)?;
        row(f, "  as allocated", self.network())?;
        row(f, "cuDNN workspace", self.workspace)?;
        row(f, "total", self.total())?;
        writeln!(
            f,
            "one slot per buffer: {:.1} MB per image",
            self.separate_bytes_per_image() / MB
        )?;
        write!(
            f,
            "network buffers {:.1} MB per image",
            self.network_bytes_per_image() / MB
        )
    }
}
