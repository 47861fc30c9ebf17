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

use crate::error::AmpError;
use crate::plan::{Bucket, BucketInfo, ByteRange, DataType, MemoryPlan, Region};
use crate::step::{AmpExecutor, CpuRegions};
use cudnn_cbr_dist::{Collective, ReduceOp};

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
    for call in bucket_collectives(&plan, bucket)? {
        match call.dtype {
            DataType::Half => {
                let v = regions.f16_region_mut(call.region)?;
                comm.all_reduce(&mut v[call.range.elem_range(DataType::Half)], ReduceOp::Sum)?;
            }
            _ => {
                let v = regions.f32_region_mut(call.region)?;
                comm.all_reduce(
                    &mut v[call.range.elem_range(DataType::Float)],
                    ReduceOp::Sum,
                )?;
            }
        }
    }
    Ok(())
}

/// One NCCL call of a bucket's all-reduce: bytes `range` of `region`, as `dtype` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCollective {
    /// The region summed.
    pub region: Region,
    /// Its bytes.
    pub range: ByteRange,
    /// The element type NCCL is told (the region's).
    pub dtype: DataType,
}

impl BucketCollective {
    /// The element count NCCL is told.
    pub const fn count(&self) -> usize {
        self.range.len() / self.dtype.size()
    }
}

/// The NCCL calls of `bucket`'s all-reduce, in order: its conv run of G16 in FP16 (when the
/// plan has G16 and the run is not empty), then the rest of its slots in G in FP32 (BN
/// parameters, FC; when not empty), as [`all_reduce_bucket`] sums them and the CUDA side
/// (`crate::cuda::dist_grads`) enqueues them.
/// Each range lies inside its region and holds whole elements.
///
/// # Errors
/// A plan error for an unknown bucket or a plan without G; [`crate::ExecError::WrongRegion`]
/// for a range that is not whole elements inside its region.
pub fn bucket_collectives(
    plan: &MemoryPlan,
    bucket: Bucket,
) -> Result<Vec<BucketCollective>, AmpError> {
    let b = plan.bucket_info(bucket)?;
    let mut calls = Vec::with_capacity(2);
    if plan.has_region(Region::G16) {
        let g16 = plan.bucket_range(bucket, Region::G16)?;
        calls.push((Region::G16, g16, DataType::Half));
    }
    calls.push((Region::G, g_rest(b), DataType::Float));
    let mut out = Vec::with_capacity(2);
    for (region, range, dtype) in calls {
        if range.is_empty() {
            continue;
        }
        let len = plan.region_range(region)?.len();
        if range.end > len || range.len() % dtype.size() != 0 {
            return Err(crate::ExecError::WrongRegion {
                op: "bucket all-reduce",
                region,
                role: "summed range",
                needs: "a range inside the region of whole elements",
            }
            .into());
        }
        out.push(BucketCollective {
            region,
            range,
            dtype,
        });
    }
    Ok(out)
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
