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

use super::layer::Src::{self, Prev, This};
use super::layer::{CbrLayer, GraphRole};
use super::run::{bn_activation, cpu_step, dbn_coefficients, dbn_reduce, residual_of, LayerIo};
use crate::reference::bn::bn_recompute;
use crate::reference::{self as r, BnParams, Element, Nhwc, RunningStats};
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

/// What synchronized BN does with a step of `role`.
pub fn sync_action(role: GraphRole) -> SyncAction {
    const DBN: [&str; 3] = ["dbn_a", "dbn_b", "dbn_c"];
    const APPLY_DBN: [&str; 3] = ["apply_dbn_a", "apply_dbn_b", "apply_dbn_c"];
    match role {
        GraphRole::ConvStats | GraphRole::Stats => SyncAction::ReduceStats,
        GraphRole::Finalize => SyncAction::GlobalCount,
        GraphRole::DgradDreluDbn => SyncAction::Coefficients {
            side: BnSide::Prev,
            outputs: DBN,
            after_step: true,
        },
        GraphRole::DbnCoefficients => SyncAction::Coefficients {
            side: BnSide::Prev,
            outputs: DBN,
            after_step: false,
        },
        GraphRole::ApplyDbnCoefficients => SyncAction::Coefficients {
            side: BnSide::This,
            outputs: APPLY_DBN,
            after_step: false,
        },
        GraphRole::BnForward | GraphRole::BnBackward | GraphRole::ApplyBnBackward => {
            SyncAction::Split
        }
        _ => SyncAction::Local,
    }
}

/// Which layer's BN a step synchronizes: this layer's own (its materialized activation) or
/// the previous layer's (read through the prologue).
type Side = fn(&'static str) -> Src;

/// One step of a layer's pass with synchronized BN (module docs); steps without BN
/// statistics run as they do locally.
pub(super) fn synced_step<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    role: GraphRole,
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
) -> Result<()> {
    let replicas = sync.replicas();
    let s = &layer.config().shape;
    let xs = Nhwc::new(s.n as usize, s.h as usize, s.w as usize, s.c as usize);
    let ys = Nhwc::new(s.n as usize, s.p() as usize, s.q() as usize, s.k as usize);
    let global = |shape: &Nhwc| shape.pixels() * replicas;
    let side_of = |side: BnSide| -> Side {
        match side {
            BnSide::This => This,
            BnSide::Prev => Prev,
        }
    };
    match sync_action(role) {
        SyncAction::Local | SyncAction::GlobalCount => cpu_step(layer, role, io, replicas)?,
        SyncAction::ReduceStats => {
            cpu_step(layer, role, io, replicas)?;
            let mut sums = io.float(This("sum"))?.to_vec();
            sums.extend_from_slice(io.float(This("sq_sum"))?);
            sync.all_reduce_sum(&mut sums)?;
            let sq = sums.split_off(sums.len() / 2);
            io.set_float(This("sum"), sums)?;
            io.set_float(This("sq_sum"), sq)?;
        }
        SyncAction::Coefficients {
            side,
            outputs,
            after_step,
        } => {
            if after_step {
                cpu_step(layer, role, io, replicas)?;
            }
            let count = match side {
                BnSide::Prev => global(&xs),
                BnSide::This => global(&ys),
            };
            let abc = coefficients(io, sync, side_of(side), count)?;
            put_coefficients(io, This, outputs, abc)?;
        }
        // The unfused route's whole-BN graphs: reduce, synchronize, apply.
        SyncAction::Split => match role {
            GraphRole::BnForward => bn_forward(layer, &ys, io, sync)?,
            GraphRole::BnBackward => bn_backward(io, sync, &xs, Prev, This("dz_prev"), replicas)?,
            _ => bn_backward(io, sync, &ys, This, This("dpre"), replicas)?,
        },
    }
    Ok(())
}

/// `side`'s BN-backward coefficients from `dγ`, `dβ` summed over the replicas (the layer's
/// own buffers keep the local sums) and the global element count.
fn coefficients<T: Element, I: LayerIo<T> + ?Sized>(
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
    side: Side,
    count: usize,
) -> Result<[Vec<T::Acc>; 3]> {
    let mut sums = io.float(side("dgamma"))?.to_vec();
    sums.extend_from_slice(io.float(side("dbeta"))?);
    sync.all_reduce_sum(&mut sums)?;
    let (dgamma, dbeta) = sums.split_at(sums.len() / 2);
    dbn_coefficients(
        count,
        io.float(side("gamma"))?,
        io.float(side("saved_inv_std"))?,
        io.float(side("saved_mean"))?,
        dgamma,
        dbeta,
    )
}

fn put_coefficients<T: Element, I: LayerIo<T> + ?Sized>(
    io: &mut I,
    side: Side,
    names: [&'static str; 3],
    values: [Vec<T::Acc>; 3],
) -> Result<()> {
    for (name, v) in names.into_iter().zip(values) {
        io.set_float(side(name), v)?;
    }
    Ok(())
}

/// A BN backward over `shape` (the BN's input `y` and saved statistics on `side`, the
/// gradient w.r.t. its output in `dz`): local `dγ`, `dβ` into `side`'s buffers, coefficients
/// from the global sums, then `dy = A·dz + B·y + C` into `side`'s `dy`.
fn bn_backward<T: Element, I: LayerIo<T> + ?Sized>(
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
    shape: &Nhwc,
    side: Side,
    dz: Src,
    replicas: usize,
) -> Result<()> {
    let [dgamma, dbeta] = dbn_reduce(
        shape,
        io.half(side("y"))?,
        io.half(dz)?,
        io.float(side("saved_mean"))?,
        io.float(side("saved_inv_std"))?,
    )?;
    io.set_float(side("dgamma"), dgamma)?;
    io.set_float(side("dbeta"), dbeta)?;
    let [a, b, c] = coefficients(io, sync, side, shape.pixels() * replicas)?;
    let dy = r::dbn_apply(shape, io.half(dz)?, io.half(side("y"))?, &a, &b, &c)?;
    io.set_half(side("dy"), dy)
}

/// The unfused route's BN forward (training) with the global batch's statistics: GenStats
/// sums reduced over the replicas, finalized with the global count, then the normalization
/// (and the fused activation, when the layer materializes it) as the local graph does it.
fn bn_forward<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    ys: &Nhwc,
    io: &mut I,
    sync: &mut dyn BnSync<T::Acc>,
) -> Result<()> {
    let cfg = layer.config();
    let mut stats = r::genstats(ys, io.half(This("y"))?)?;
    let mut sums = std::mem::take(&mut stats.sum);
    sums.append(&mut stats.sqsum);
    sync.all_reduce_sum(&mut sums)?;
    stats.sqsum = sums.split_off(sums.len() / 2);
    stats.sum = sums;
    let mut mean = io.float(This("running_mean"))?.to_vec();
    let mut var = io.float(This("running_var"))?.to_vec();
    let fin: r::BnFinalized<T> = r::bn_finalize(
        &stats,
        io.float(This("gamma"))?,
        io.float(This("beta"))?,
        RunningStats {
            mean: &mut mean,
            var: &mut var,
        },
        ys.pixels() * sync.replicas(),
        &BnParams {
            epsilon: cfg.epsilon,
            momentum: cfg.momentum,
        },
    )?;
    let (y, gamma, beta) = (
        io.half(This("y"))?,
        io.float(This("gamma"))?,
        io.float(This("beta"))?,
    );
    let out = match cfg.apply {
        Some(_) => bn_activation(
            ys,
            y,
            &fin.saved_mean,
            &fin.saved_inv_std,
            gamma,
            beta,
            residual_of(io, cfg.apply)?,
        )?,
        None => y
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let ch = i % ys.c;
                T::from_acc(bn_recompute(
                    v.to_acc(),
                    fin.saved_mean[ch],
                    fin.saved_inv_std[ch],
                    gamma[ch],
                    beta[ch],
                ))
            })
            .collect(),
    };
    io.set_float(This("running_mean_next"), mean)?;
    io.set_float(This("running_var_next"), var)?;
    io.set_float(This("saved_mean"), fin.saved_mean)?;
    io.set_float(This("saved_inv_std"), fin.saved_inv_std)?;
    match cfg.apply {
        Some(_) => io.set_half(This("a"), out),
        None => io.set_half(This("y_bn"), out),
    }
}
