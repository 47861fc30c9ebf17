//! What a compiled network and its training step keep in device memory, by kind: the report
//! `deviceless_plans --memory` prints.
//!
//! The figures are the sizes of what the CUDA executor allocates for a step, as planned: the
//! amp regions ([`memory_plan`]: FP32 master weights W and their FP16 copy A, the gradients G
//! and G16, momentum M, EMA E/E16 when asked, the scalars S), the network's own buffers by
//! role (each its own slot today, alive for the whole step), and one cuDNN workspace, the
//! largest any layer's plans need. The activations and their gradients are proportional to the
//! batch; everything else is not, which is what [`MemoryReport::largest_batch`] uses.

use std::fmt;

use super::compile::{BufferRole, CompiledNet};
use super::params::memory_plan;
use crate::amp::plan::Region;
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
    /// Stored activations: the input images and every activation the backward pass reads.
    pub activations: u64,
    /// Activation gradients.
    pub activation_grads: u64,
    /// BN running statistics and per-channel scratch (statistics, coefficients).
    pub per_channel: u64,
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
            workspace,
        })
    }

    /// Every byte of the report.
    pub fn total(&self) -> u64 {
        self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.activation_grads
            + self.per_channel
            + self.workspace
    }

    /// The network's buffers (activations, their gradients, per-channel buffers) per image.
    pub fn network_bytes_per_image(&self) -> f64 {
        (self.activations + self.activation_grads + self.per_channel) as f64
            / self.batch.max(1) as f64
    }

    /// The largest batch whose step fits in `device_bytes`, counting the activations and their
    /// gradients as proportional to the batch and everything else (the workspace at this
    /// report's batch included) as fixed; `None` when not even one image fits.
    pub fn largest_batch(&self, device_bytes: u64) -> Option<u64> {
        let per_image =
            (self.activations + self.activation_grads).div_ceil(self.batch.max(1) as u64);
        let fixed = self.total() - self.activations - self.activation_grads;
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
        row(f, "cuDNN workspace", self.workspace)?;
        row(f, "total", self.total())?;
        write!(
            f,
            "network buffers {:.1} MB per image",
            self.network_bytes_per_image() / MB
        )
    }
}
