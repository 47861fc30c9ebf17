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
use crate::dist::{Collective, ReduceOp};
use crate::error::AmpError;
use crate::plan::{ByteRange, Region};
use crate::range::s_layout;

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
    joined(regions, comm, "the gradient all-reduce", |regions, comm| {
        for b in plan.buckets().iter().rev() {
            if plan.has_region(Region::G16) {
                let g16 = plan.bucket_range(b.bucket(), Region::G16)?;
                if !g16.is_empty() {
                    let mut bytes = typed::<f16>(regions, Region::G16, g16)?;
                    // SAFETY: a bucket's conv run of G16 holds FP16 gradients, its length is a
                    // whole number of FP16 elements (checked in `typed`) and it starts on a
                    // 256-byte slot.
                    let view = unsafe { bytes.transmute_mut::<f16>(g16.len() / 2) };
                    let Some(mut view) = view else { continue };
                    comm.all_reduce(&mut view, ReduceOp::Sum)?;
                }
            }
            let rest = crate::dist::grads::g_rest(b);
            if !rest.is_empty() {
                let mut bytes = typed::<f32>(regions, Region::G, rest)?;
                // SAFETY: G holds FP32 gradients; the range is a whole number of them from a
                // 256-byte slot (checked in `typed`).
                let view = unsafe { bytes.transmute_mut::<f32>(rest.len() / 4) };
                let Some(mut view) = view else { continue };
                comm.all_reduce(&mut view, ReduceOp::Sum)?;
            }
        }
        Ok(())
    })
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
