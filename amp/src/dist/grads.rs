//! The collectives of a data-parallel step on the CPU executor ([`CpuRegions`]).
//!
//! The order of a step on each rank:
//! 1. [`broadcast_weights`] once at start (W from rank 0; then `AmpStep::init_weights`);
//! 2. `AmpStep::begin`, forward and backward on the rank's shard;
//! 3. [`all_reduce_gradients`]: every bucket's FP16 conv gradients (G16) and FP32 gradients
//!    (G, its BN and FC part), the deepest bucket first, as backward produces them;
//! 4. `AmpStep::finish_with`, with [`all_reduce_overflow`] between the check and SGD, on a
//!    step whose S has `ranks` set (`AmpStep::set_ranks`): SGD unscales the sums by
//!    `1 / (loss_scale · ranks)`, so the averaging costs no pass of its own.

use half::f16;

use super::{Collective, ReduceOp};
use crate::error::AmpError;
use crate::plan::{Bucket, BucketInfo, ByteRange, DataType, Region};
use crate::step::{AmpExecutor, CpuRegions};

/// Sums the step's gradients over the group, bucket by bucket from the last declared (the
/// deepest layers, whose gradients backward finishes first) to the first: each bucket's conv
/// run of G16 in FP16, then the rest of its slots in G (BN parameters, FC) in FP32. The conv
/// slots of G are not sent: the cast from G16 overwrites them after this.
///
/// # Errors
/// [`AmpError::Dist`] from the collectives; a plan error for a plan without G.
pub fn all_reduce_gradients<C>(regions: &mut CpuRegions, comm: &mut C) -> Result<(), AmpError>
where
    C: Collective<[f16]> + Collective<[f32]>,
{
    let plan = regions.plan_arc().clone();
    for b in plan.buckets().iter().rev() {
        all_reduce_bucket(regions, comm, b.bucket())?;
    }
    Ok(())
}

/// Sums one bucket's gradients over the group: its conv run of G16 in FP16, then the rest of
/// its slots in G in FP32 (what [`all_reduce_gradients`] does for each bucket; a step that
/// overlaps the sums with its backward calls it per bucket as backward finishes them).
///
/// # Errors
/// [`AmpError::Dist`] from the collectives; a plan error for an unknown bucket or a plan
/// without G.
pub fn all_reduce_bucket<C>(
    regions: &mut CpuRegions,
    comm: &mut C,
    bucket: Bucket,
) -> Result<(), AmpError>
where
    C: Collective<[f16]> + Collective<[f32]>,
{
    let plan = regions.plan_arc().clone();
    let b = plan.bucket_info(bucket)?;
    if plan.has_region(Region::G16) {
        let g16 = plan.bucket_range(bucket, Region::G16)?;
        if !g16.is_empty() {
            let v = &mut regions.f16_region_mut(Region::G16)?[g16.elem_range(DataType::Half)];
            comm.all_reduce(v, ReduceOp::Sum)?;
        }
    }
    let rest = g_rest(b);
    if !rest.is_empty() {
        let v = &mut regions.f32_region_mut(Region::G)?[rest.elem_range(DataType::Float)];
        comm.all_reduce(v, ReduceOp::Sum)?;
    }
    Ok(())
}

/// The bytes of G that a bucket's all-reduce sends in FP32: its slots after the conv run (BN
/// parameters, FC); the conv slots of G are the cast's, from G16.
pub(crate) fn g_rest(b: &BucketInfo) -> ByteRange {
    ByteRange::new(b.conv16().end.max(b.span16().start), b.span16().end).to_fp32()
}

/// The overflow flag of S, the maximum over the group: if any rank's check found NaN or Inf,
/// every rank skips the step and backs its loss scale off the same way.
///
/// # Errors
/// [`AmpError::Dist`] from the collective.
pub fn all_reduce_overflow<C>(regions: &mut CpuRegions, comm: &mut C) -> Result<(), AmpError>
where
    C: Collective<[u32]>,
{
    let mut s = regions.scalars();
    let mut flag = [s.overflow];
    comm.all_reduce(&mut flag[..], ReduceOp::Max)?;
    s.overflow = flag[0];
    regions.write_scalars(&s)
}

/// Rank 0's master weights (W) on every rank. Call `AmpStep::init_weights` afterwards so that
/// A (and E) follow.
///
/// # Errors
/// [`AmpError::Dist`] from the collective.
pub fn broadcast_weights<C>(regions: &mut CpuRegions, comm: &mut C) -> Result<(), AmpError>
where
    C: Collective<[f32]>,
{
    comm.broadcast(regions.f32_region_mut(Region::W)?, 0)?;
    Ok(())
}
