//! Synchronized batch normalization on the CPU executor: every replica of a data-parallel
//! group normalizes with the statistics of the global batch.
//!
//! A layer run with a [`BnSync`] ([`super::CbrLayer::run_cpu_io_synced`]) sums, over the
//! replicas:
//! - forward: the GenStats sums `[Σy, Σy²]` between conv+GenStats and BN finalize, which then
//!   divides by the global element count (`N·P·Q` times the replicas);
//! - backward: `dγ = Σ dz·x̂` and `dβ = Σ dz` before the BN-backward coefficients are computed
//!   (with the global count), in FP32 in the order of the generic route's `dbn_coefficients`
//!   graph: cuDNN's fused graphs derive them from the local sums, so a synchronized step
//!   computes them itself.
//!
//! The layer's own `dgamma` / `dbeta` buffers keep the local sums: they are the parameter
//! gradients that the data-parallel step all-reduces with the rest, once.

use crate::error::Result;

/// Sums per-channel values over the replicas of a data-parallel group (synchronized BN).
///
/// Every replica makes the same calls in the same order with the same lengths.
pub trait BnSync<A> {
    /// How many replicas' batches make one BN batch (1: local BN).
    fn replicas(&self) -> usize;

    /// Replaces `values` with their elementwise sum over the replicas (the same result on
    /// every replica).
    ///
    /// # Errors
    /// [`crate::Error::BnSync`] when the group fails (a replica failed or timed out).
    fn all_reduce_sum(&mut self, values: &mut [A]) -> Result<()>;
}

/// `a` and `b` each summed over the replicas, in one collective (`[a, b]` reduced, then split).
pub(crate) fn all_reduce_pair<A: Copy>(
    sync: &mut dyn BnSync<A>,
    a: &[A],
    b: &[A],
) -> Result<(Vec<A>, Vec<A>)> {
    let mut sums = Vec::with_capacity(a.len() + b.len());
    sums.extend_from_slice(a);
    sums.extend_from_slice(b);
    sync.all_reduce_sum(&mut sums)?;
    let second = sums.split_off(a.len());
    Ok((sums, second))
}

use super::keys as k;
use super::layer::{CbrLayer, GraphRole, Src};
use super::role::bn_backward::{dbn_coefficients, names};
use super::role::{cpu_step, split_synced_step, Cx};
use super::run::LayerIo;
use crate::reference::{Element, Nhwc};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// Sums device FP32 values over the replicas of a data-parallel group: synchronized BN on
/// the GPU ([`super::CbrLayer::run_gpu_synced`]).
///
/// Every replica makes the same calls in the same order with the same lengths.
pub trait DeviceBnSync {
    /// How many replicas' batches make one BN batch (1: local BN).
    fn replicas(&self) -> usize;

    /// Enqueues the replacement of `values` by their elementwise sum over the replicas, ordered
    /// after the work enqueued on `stream` so far and before what is enqueued there next (no
    /// host wait).
    ///
    /// # Errors
    /// [`crate::Error::BnSync`] when the collective cannot be enqueued or the group failed.
    fn all_reduce_sum(
        &mut self,
        stream: &Arc<CudaStream>,
        values: &mut CudaSlice<f32>,
    ) -> Result<()>;
}

/// The BN whose statistics a synchronized step reads: this layer's own (its materialized
/// activation) or the previous layer's (read through the prologue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnSide {
    /// This layer's BN.
    This,
    /// The previous layer's BN.
    Prev,
}

impl BnSide {
    /// The buffer of this BN's layer named `name`.
    pub(crate) const fn src(self, name: &'static str) -> Src {
        match self {
            BnSide::This => Src::This(name),
            BnSide::Prev => Src::Prev(name),
        }
    }
}

/// What synchronized BN does with one step of a layer's pass, the same on both executors
/// ([`sync_action`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncAction {
    /// The step runs as with local BN.
    Local,
    /// After the step, this layer's `[Σy, Σy²]` (`sum`, `sq_sum`) are summed over the replicas.
    ReduceStats,
    /// The BN finalize divides by the global element count (the local count × replicas).
    GlobalCount,
    /// The dBN-apply coefficients of `side`'s BN come from its `dγ`, `dβ` summed over the
    /// replicas (a copy: the layer's own buffers keep the local sums) and the global count,
    /// into this layer's `outputs`. With `after_step` the step runs first (cuDNN's fused graph
    /// writes the local sums and local coefficients, which are then replaced); otherwise the
    /// synchronized computation replaces the step.
    Coefficients {
        /// Whose BN.
        side: BnSide,
        /// This layer's buffers for A, B, C.
        outputs: [&'static str; 3],
        /// Whether the step itself runs first.
        after_step: bool,
    },
    /// A whole-BN graph (the unfused route's NormForward / NormBackward) that sums inside
    /// itself: the CPU executor splits it into reduce, synchronize and apply; the GPU cannot.
    Split,
}

/// What synchronized BN does with a step of `role` (the per-role table: each role's family
/// module in `cbr::role` says).
pub fn sync_action(role: GraphRole) -> SyncAction {
    role.def().sync
}

/// One step of a layer's pass with synchronized BN (module docs); steps without BN
/// statistics run as they do locally.
pub(super) fn synced_step<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    role: GraphRole,
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
) -> Result<()> {
    let replicas = sync.replicas();
    let cx = Cx::new(layer, replicas);
    match sync_action(role) {
        SyncAction::Local | SyncAction::GlobalCount => cpu_step(layer, role, io, replicas)?,
        SyncAction::ReduceStats => {
            cpu_step(layer, role, io, replicas)?;
            let (sum, sq) =
                all_reduce_pair(sync, io.float(k::SUM.this())?, io.float(k::SQ_SUM.this())?)?;
            io.set_float(k::SUM.this(), sum)?;
            io.set_float(k::SQ_SUM.this(), sq)?;
        }
        SyncAction::Coefficients {
            side,
            outputs,
            after_step,
        } => {
            if after_step {
                cpu_step(layer, role, io, replicas)?;
            }
            let shape: Nhwc = match side {
                BnSide::Prev => cx.xs(),
                BnSide::This => cx.ys(),
            };
            let abc = coefficients(io, sync, side, shape.pixels() * replicas)?;
            for (name, v) in outputs.into_iter().zip(abc) {
                io.set_float(Src::This(name), v)?;
            }
        }
        // The unfused route's whole-BN graphs: reduce, synchronize, apply.
        SyncAction::Split => split_synced_step(layer, role, io, sync)?,
    }
    Ok(())
}

/// `side`'s BN-backward coefficients from `dγ`, `dβ` summed over the replicas (the layer's
/// own buffers keep the local sums) and the global element count.
pub(crate) fn coefficients<T: Element, I: LayerIo<T> + ?Sized>(
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
    side: BnSide,
    count: usize,
) -> Result<[Vec<T::Acc>; 3]> {
    let n = names(side);
    let (dgamma, dbeta) = all_reduce_pair(sync, io.float(n.dgamma)?, io.float(n.dbeta)?)?;
    dbn_coefficients(
        count,
        io.float(n.gamma)?,
        io.float(n.inv_std)?,
        io.float(n.mean)?,
        &dgamma,
        &dbeta,
    )
}
