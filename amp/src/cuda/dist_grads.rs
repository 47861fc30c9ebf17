//! The data-parallel step's collectives over a plan's regions on the device, with NCCL: the
//! CUDA side of [`crate::dist::grads`] (same order, same ranges).
//!
//! The collectives run on the communicator's stream. The regions' kernels record no cudarc
//! events (they must stay capturable), so each function orders the two streams itself: the
//! communication stream waits for the work enqueued on the regions' stream so far, and the
//! regions' stream waits for the collectives before what comes next. Neither waits on the
//! host.

use half::f16;

use super::nccl::NcclComm;
use super::{driver_error, CudaRegions};
use crate::dist::Communicator;
use crate::dist::{Collective, ReduceOp};
use crate::error::AmpError;
use crate::plan::{ByteRange, Region};
use crate::range::s_layout;
use cudarc::driver::{CudaSlice, CudaStream};
use cudnn_cbr_fusion::cbr::DeviceBnSync;
use std::sync::{Arc, Mutex};

/// `region`'s bytes `range` as `len` elements of `T` (the region holds `T`s there).
fn typed<T>(
    regions: &mut CudaRegions,
    region: Region,
    range: ByteRange,
) -> Result<cudarc::driver::CudaViewMut<'_, u8>, AmpError> {
    let buf = regions.region_mut(region)?;
    if range.end > buf.len() || range.len() % std::mem::size_of::<T>() != 0 {
        return Err(crate::ExecError::WrongRegion {
            op: "collective",
            region,
            role: "typed view",
            needs: "a range inside the region of whole elements",
        }
        .into());
    }
    Ok(buf.slice_mut(range.start..range.end))
}

/// Runs `f` with the communication stream ordered after the regions' stream, then orders the
/// regions' stream after it.
fn joined(
    regions: &mut CudaRegions,
    comm: &mut NcclComm,
    what: &str,
    f: impl FnOnce(&mut CudaRegions, &mut NcclComm) -> Result<(), AmpError>,
) -> Result<(), AmpError> {
    let (compute, link) = (regions.stream().clone(), comm.stream().clone());
    link.join(&compute)
        .map_err(|e| driver_error(format!("order {what} after the step's work"), e))?;
    f(regions, comm)?;
    compute
        .join(&link)
        .map_err(|e| driver_error(format!("order the step after {what}"), e))
}

/// Sums the step's gradients over the NCCL group, the deepest bucket first: each bucket's
/// conv run of G16 in FP16, then the rest of its slots in G in FP32 (as
/// [`crate::dist::grads::all_reduce_gradients`]).
///
/// # Errors
/// [`AmpError::Dist`] from NCCL; a driver error ordering the streams.
pub fn all_reduce_gradients(
    regions: &mut CudaRegions,
    comm: &mut NcclComm,
) -> Result<(), AmpError> {
    let plan = regions.plan_arc().clone();
    let after = regions.stream().clone();
    for b in plan.buckets().iter().rev() {
        all_reduce_bucket(regions, comm, b.bucket(), &after)?;
    }
    join_gradients(regions, comm)
}

/// Enqueues the sum of one bucket's gradients (its conv run of G16 in FP16, the rest of its
/// slots in G in FP32) on the communicator's stream, after the work enqueued on `after` so far
/// (the stream whose backward wrote them: the collective overlaps what that stream does
/// next). Call [`join_gradients`] after the last bucket, before the amp step reads them.
///
/// # Errors
/// [`AmpError::Dist`] from NCCL; a plan error for an unknown bucket; a driver error ordering
/// the streams.
pub fn all_reduce_bucket(
    regions: &mut CudaRegions,
    comm: &mut NcclComm,
    bucket: crate::plan::Bucket,
    after: &CudaStream,
) -> Result<(), AmpError> {
    let plan = regions.plan_arc().clone();
    let b = plan.bucket_info(bucket)?;
    comm.stream()
        .join(after)
        .map_err(|e| driver_error("order a bucket's all-reduce after its gradients", e))?;
    if plan.has_region(Region::G16) {
        let g16 = plan.bucket_range(bucket, Region::G16)?;
        if !g16.is_empty() {
            let mut bytes = typed::<f16>(regions, Region::G16, g16)?;
            // SAFETY: a bucket's conv run of G16 holds FP16 gradients, its length is a whole
            // number of FP16 elements (checked in `typed`) and it starts on a 256-byte slot.
            if let Some(mut view) = unsafe { bytes.transmute_mut::<f16>(g16.len() / 2) } {
                comm.all_reduce(&mut view, ReduceOp::Sum)?;
            }
        }
    }
    let rest = crate::dist::grads::g_rest(b);
    if !rest.is_empty() {
        let mut bytes = typed::<f32>(regions, Region::G, rest)?;
        // SAFETY: G holds FP32 gradients; the range is a whole number of them from a 256-byte
        // slot (checked in `typed`).
        if let Some(mut view) = unsafe { bytes.transmute_mut::<f32>(rest.len() / 4) } {
            comm.all_reduce(&mut view, ReduceOp::Sum)?;
        }
    }
    Ok(())
}

/// Orders the regions' stream after every collective enqueued on the communicator's stream
/// (the end of [`all_reduce_bucket`]'s series).
///
/// # Errors
/// A driver error ordering the streams.
pub fn join_gradients(regions: &mut CudaRegions, comm: &mut NcclComm) -> Result<(), AmpError> {
    regions
        .stream()
        .join(comm.stream())
        .map_err(|e| driver_error("order the step after the gradient all-reduce", e))
}

/// A rank's NCCL communicator, shared by its gradient collectives and its synchronized BN:
/// one communicator whose collectives every rank enqueues in the same order on one stream.
pub type SharedComm = Arc<Mutex<NcclComm>>;

/// Synchronized BN over NCCL ([`DeviceBnSync`]): each sum is enqueued on the communicator's
/// stream between events joining it with the layer's stream (after any gradient bucket
/// already enqueued there: the ranks issue both in the same order).
#[derive(Debug, Clone)]
pub struct NcclBnSync {
    comm: SharedComm,
    world: usize,
}

impl NcclBnSync {
    /// The reducer over `comm`'s group.
    pub fn new(comm: SharedComm) -> Self {
        let world = lock(&comm).world();
        NcclBnSync { comm, world }
    }
}

/// The communicator, also after a thread panicked while holding it (its calls leave no
/// half-made state behind on the host).
pub fn lock(comm: &SharedComm) -> std::sync::MutexGuard<'_, NcclComm> {
    comm.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl DeviceBnSync for NcclBnSync {
    fn replicas(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(
        &mut self,
        stream: &Arc<CudaStream>,
        values: &mut CudaSlice<f32>,
    ) -> cudnn_cbr_fusion::Result<()> {
        let mut comm = lock(&self.comm);
        let link = comm.stream().clone();
        let fail = |e: String| cudnn_cbr_fusion::Error::BnSync(e);
        link.join(stream)
            .map_err(|e| fail(format!("order the sum after the statistics: {e}")))?;
        comm.all_reduce(values, ReduceOp::Sum)
            .map_err(|e| fail(e.to_string()))?;
        stream
            .join(&link)
            .map_err(|e| fail(format!("order the layer after the sum: {e}")))
    }
}

/// The overflow flag in S, the maximum over the group (between the check and SGD, as
/// [`crate::step::AmpStep::finish_with`] runs it).
///
/// # Errors
/// [`AmpError::Dist`] from NCCL; a driver error ordering the streams.
pub fn all_reduce_overflow(regions: &mut CudaRegions, comm: &mut NcclComm) -> Result<(), AmpError> {
    joined(
        regions,
        comm,
        "the overflow flag's all-reduce",
        |regions, comm| {
            let at = ByteRange::new(s_layout::OVERFLOW, s_layout::OVERFLOW + 4);
            let mut bytes = typed::<u32>(regions, Region::S, at)?;
            // SAFETY: bytes 4..8 of S are the `u32` overflow flag (`s_layout`), 4-byte aligned.
            let view = unsafe { bytes.transmute_mut::<u32>(1) };
            if let Some(mut view) = view {
                comm.all_reduce(&mut view, ReduceOp::Max)?;
            }
            Ok(())
        },
    )
}

/// Rank 0's master weights W on every rank; run `AmpStep::init_weights` afterwards.
///
/// # Errors
/// [`AmpError::Dist`] from NCCL; a driver error ordering the streams.
pub fn broadcast_weights(regions: &mut CudaRegions, comm: &mut NcclComm) -> Result<(), AmpError> {
    joined(regions, comm, "the weights' broadcast", |regions, comm| {
        let w = regions.plan_arc().region_range(Region::W)?;
        let mut bytes = typed::<f32>(regions, Region::W, w)?;
        // SAFETY: W holds FP32 master weights (and zero padding) over its whole length.
        let view = unsafe { bytes.transmute_mut::<f32>(w.len() / 4) };
        if let Some(mut view) = view {
            comm.broadcast(&mut view, 0)?;
        }
        Ok(())
    })
}
