//! The data-parallel step's collectives over a plan's regions on the device, with NCCL: the
//! CUDA side of [`crate::dist::grads`] (same order, same ranges).
//!
//! The collectives run on the communicator's stream. The regions' kernels record no cudarc
//! events (they must stay capturable), so each function orders the two streams itself: the
//! communication stream waits for the work enqueued on the regions' stream so far, and the
//! regions' stream waits for the collectives before what comes next. Neither waits on the
//! host.
//!
//! A gradient bucket's all-reduce is ordered by its byte ranges, not by its allocation: it
//! passes raw addresses to NCCL, outside cudarc's event tracking (which would record the
//! whole G16 or G allocation as written, so every later binding of that region on the compute
//! stream, the next layers' weight gradients included, would wait for it), and records one
//! event after it. [`CudaRegions`] keeps those events with the bucket's ranges
//! ([`CudaRegions::collectives_in_flight`]): a range op, copy or
//! [`CudaRegions::order_after_collectives`] over a range waits only for the buckets that
//! touch it ([`must_wait_for`]), and [`join_gradients`] joins them all at the step's join
//! point, before the overflow check.

use half::f16;

use super::{driver_error, CudaRegions};
use crate::dist::grads::bucket_collectives;
use crate::error::AmpError;
use crate::plan::{Bucket, ByteRange, DataType, Region};
use crate::range::{s_layout, S_REGION_BYTES};
use crate::step::RangeOp;
use cudarc::driver::{CudaSlice, CudaStream};
use cudnn_cbr_dist::nccl::NcclComm;
use cudnn_cbr_dist::{Collective, ReduceOp};
use std::sync::{Arc, Mutex};

/// `region`'s bytes `range` as `len` elements of `T` (the region holds `T`s there).
fn typed<T>(
    regions: &mut CudaRegions,
    region: Region,
    range: ByteRange,
) -> Result<cudarc::driver::CudaViewMut<'_, u8>, AmpError> {
    let buf = regions.region_mut(region)?;
    if range.end > buf.len() || !range.len().is_multiple_of(std::mem::size_of::<T>()) {
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

/// The ordering decision for a use of bytes `range` of `region` while collectives are in
/// flight: the indices of `in_flight` (each collective's region ranges) that touch at least
/// one byte of it, in order. An empty range waits for nothing; ranges of other regions never
/// overlap it (each region is its own allocation).
pub fn must_wait_for(
    in_flight: &[Vec<(Region, ByteRange)>],
    region: Region,
    range: ByteRange,
) -> Vec<usize> {
    in_flight
        .iter()
        .enumerate()
        .filter(|(_, ranges)| {
            ranges
                .iter()
                .any(|&(r, b)| r == region && overlaps(b, range))
        })
        .map(|(i, _)| i)
        .collect()
}

/// Whether two half-open byte ranges share a byte.
const fn overlaps(a: ByteRange, b: ByteRange) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// The region bytes a range op reads or writes (each span16 scaled to its region).
pub fn op_ranges(op: &RangeOp) -> Vec<(Region, ByteRange)> {
    let at = |region: Region, span16: ByteRange| {
        let scale = region.scale_from_fp16().unwrap_or(1);
        (
            region,
            ByteRange::new(span16.start * scale, span16.end * scale),
        )
    };
    let s = (Region::S, ByteRange::new(0, S_REGION_BYTES));
    match *op {
        RangeOp::Zero { region, span16 } => vec![at(region, span16)],
        RangeOp::CastF16ToF32 { src, dst, span16 }
        | RangeOp::CastF32ToF16 { src, dst, span16 }
        | RangeOp::CopyF32 { src, dst, span16 } => vec![at(src, span16), at(dst, span16)],
        RangeOp::AccumGrads { span16, .. } => vec![
            at(Region::G16, span16),
            at(Region::G, span16),
            at(Region::GA, span16),
        ],
        RangeOp::Check { span16, .. } | RangeOp::GradNorm { span16 } => {
            vec![at(Region::G, span16), s]
        }
        RangeOp::Sgd {
            momentum_buffer,
            span16,
            ..
        } => {
            let mut v = vec![
                at(Region::W, span16),
                at(Region::G, span16),
                at(Region::A, span16),
                s,
            ];
            if momentum_buffer {
                v.push(at(Region::M, span16));
            }
            v
        }
        RangeOp::Ema { span16, .. } => vec![
            at(Region::E, span16),
            at(Region::E16, span16),
            at(Region::W, span16),
            s,
        ],
        RangeOp::LossScaleUpdate { .. } => vec![s],
    }
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

/// Enqueues the sum of one bucket's gradients in place ([`bucket_collectives`]: its conv run
/// of G16 in FP16, the rest of its slots in G in FP32) on the communicator's stream, after the
/// work enqueued on `after` so far (the stream whose backward wrote them) and on the regions'
/// stream, then records one event after it. Later uses of the bucket's ranges through
/// `regions` wait for that event; uses of other ranges do not, so the sum overlaps what
/// `after` does next (the shallower layers' backward, which writes other buckets). Call
/// [`join_gradients`] after the last bucket, before the amp step reads them.
///
/// # Errors
/// [`AmpError::Dist`] from NCCL (a communicator on another device included); a plan error
/// for an unknown bucket; a driver error ordering the streams.
pub fn all_reduce_bucket(
    regions: &mut CudaRegions,
    comm: &mut NcclComm,
    bucket: Bucket,
    after: &CudaStream,
) -> Result<(), AmpError> {
    reduce_bucket(regions, None, comm, bucket, after)
}

/// [`all_reduce_bucket`] out of place: the group's sums of `regions`' bucket land in the same
/// ranges of `into` (another executor of the same plan on the same device), and `regions` is
/// left as it is, e.g. to keep a rank's own gradients beside the group's. Bytes of `into`
/// outside the bucket's ranges are not touched. Both executors' later uses of those ranges
/// wait for the sum; [`join_gradients`] each before reading them.
///
/// # Errors
/// As [`all_reduce_bucket`]; [`crate::ExecError::WrongRegion`] when `into` has another plan
/// or lives on another device.
pub fn all_reduce_bucket_into(
    regions: &mut CudaRegions,
    into: &mut CudaRegions,
    comm: &mut NcclComm,
    bucket: Bucket,
    after: &CudaStream,
) -> Result<(), AmpError> {
    let same_plan = Arc::ptr_eq(regions.plan_arc(), into.plan_arc())
        || **regions.plan_arc() == **into.plan_arc();
    if !same_plan || !Arc::ptr_eq(regions.stream().context(), into.stream().context()) {
        return Err(crate::ExecError::WrongRegion {
            op: "all_reduce_bucket_into",
            region: Region::G,
            role: "destination executor",
            needs: "an executor of the same memory plan on the same device",
        }
        .into());
    }
    reduce_bucket(regions, Some(into), comm, bucket, after)
}

fn reduce_bucket(
    regions: &mut CudaRegions,
    mut into: Option<&mut CudaRegions>,
    comm: &mut NcclComm,
    bucket: Bucket,
    after: &CudaStream,
) -> Result<(), AmpError> {
    let plan = regions.plan_arc().clone();
    let calls = bucket_collectives(&plan, bucket)?;
    if calls.is_empty() {
        return Ok(());
    }
    let link = comm.stream().clone();
    if !Arc::ptr_eq(link.context(), regions.stream().context()) {
        return Err(cudnn_cbr_dist::DistError::Nccl {
            op: "ncclAllReduce",
            code: None,
            message: format!(
                "the regions live on device {}, the communicator on device {}",
                regions.stream().context().ordinal(),
                link.context().ordinal()
            ),
        }
        .into());
    }
    let order = |e| driver_error("order a bucket's all-reduce after its gradients", e);
    link.join(after).map_err(order)?;
    let ranges: Vec<(Region, ByteRange)> = calls.iter().map(|c| (c.region, c.range)).collect();
    let mut executors: Vec<&CudaRegions> = vec![&*regions];
    if let Some(i) = into.as_deref() {
        executors.push(i);
    }
    for r in executors {
        if r.stream().cu_stream() != after.cu_stream() {
            link.join(r.stream()).map_err(order)?;
        }
        // A collective still in flight over the same ranges (on another stream) first.
        for &(region, range) in &ranges {
            r.order_after_collectives(&link, region, range)?;
        }
    }
    for c in &calls {
        let offset = c.range.start as u64;
        let send = regions.region_addr(c.region)? + offset;
        let recv = match into.as_deref() {
            Some(i) => i.region_addr(c.region)? + offset,
            None => send,
        };
        // SAFETY: `send` and `recv` address `c.count()` elements of the region's type inside
        // allocations of `regions` (and `into`): `bucket_collectives` checked the range
        // against the plan these executors were allocated from, and both are on the
        // communicator's context (checked above and in `all_reduce_bucket_into`). In place they
        // are one address; out of place two executors' allocations, which cannot overlap. The
        // communication stream was ordered above after every use of those ranges enqueued so
        // far; afterwards each executor waits for the event noted below before using them
        // again, and waits for it before freeing its buffers (its `Drop`).
        let sent = unsafe {
            match c.dtype {
                DataType::Half => comm.all_reduce_raw::<f16>(send, recv, c.count(), ReduceOp::Sum),
                _ => comm.all_reduce_raw::<f32>(send, recv, c.count(), ReduceOp::Sum),
            }
        };
        if let Err(e) = sent {
            // What was enqueued before the failure still runs: keep it ordered.
            note_after(regions, into.as_deref_mut(), &ranges, &link)?;
            return Err(e.into());
        }
    }
    note_after(regions, into, &ranges, &link)
}

/// Records an event after the work on `link` and notes it on each executor for `ranges`; if
/// the event cannot be recorded, waits for `link` on the host instead (the driver is failing:
/// no later use may overtake the collectives).
fn note_after(
    regions: &mut CudaRegions,
    into: Option<&mut CudaRegions>,
    ranges: &[(Region, ByteRange)],
    link: &CudaStream,
) -> Result<(), AmpError> {
    for r in std::iter::once(regions).chain(into) {
        match link.record_event(None) {
            Ok(event) => r.note_collective(ranges.to_vec(), event),
            Err(e) => {
                let _ = link.synchronize();
                return Err(driver_error("record a bucket's all-reduce", e));
            }
        }
    }
    Ok(())
}

/// Orders the regions' stream after every bucket all-reduce in flight over them (the end of
/// [`all_reduce_bucket`]'s series: the step's join point, before the overflow check), and
/// forgets them.
///
/// # Errors
/// A driver error ordering the streams.
pub fn join_gradients(regions: &mut CudaRegions, _comm: &mut NcclComm) -> Result<(), AmpError> {
    regions.join_collectives()
}

/// A rank's NCCL communicator, shared by its gradient collectives and its synchronized BN:
/// one communicator whose collectives every rank enqueues in the same order on one stream.
pub type SharedComm = Arc<Mutex<NcclComm>>;

/// The communicator, also after a thread panicked while holding it (its calls leave no
/// half-made state behind on the host).
pub fn lock(comm: &SharedComm) -> std::sync::MutexGuard<'_, NcclComm> {
    comm.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Replaces FP32 `values` by their elementwise sum over `comm`'s group, enqueued on the
/// communicator's stream between events joining it with `stream`: after the work enqueued on
/// `stream` so far and before what is enqueued there next (no host wait), and after any
/// gradient bucket already enqueued on the communicator (the ranks issue both in the same
/// order). Synchronized BN's device sums (the root crate's `dist::NcclBnSync`).
///
/// # Errors
/// [`AmpError::Dist`] from NCCL; a driver error ordering the streams.
pub fn all_reduce_sum_ordered(
    comm: &SharedComm,
    stream: &Arc<CudaStream>,
    values: &mut CudaSlice<f32>,
) -> Result<(), AmpError> {
    let mut comm = lock(comm);
    let link = comm.stream().clone();
    link.join(stream)
        .map_err(|e| driver_error("order the sum after the statistics", e))?;
    comm.all_reduce(values, ReduceOp::Sum)?;
    stream
        .join(&link)
        .map_err(|e| driver_error("order the layer after the sum", e))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{MemoryPlan, MemoryPlanBuilder, ParamKind};

    /// Two buckets, declared shallow first (backward finishes `deep` first), each with conv,
    /// BN and (in `deep`) FC slots.
    fn plan() -> MemoryPlan {
        let mut b = MemoryPlanBuilder::new();
        let first = b.bucket("first").unwrap();
        let deep = b.bucket("deep").unwrap();
        b.add("c1.w", ParamKind::ConvWeight, &[16, 3, 3, 8], first)
            .unwrap();
        b.add("c1.gamma", ParamKind::BnGamma, &[16], first).unwrap();
        b.add("c2.w", ParamKind::ConvWeight, &[32, 1, 1, 16], deep)
            .unwrap();
        b.add("c2.beta", ParamKind::BnBeta, &[32], deep).unwrap();
        b.add("fc.w", ParamKind::FcWeight, &[10, 32], deep).unwrap();
        b.add("fc.b", ParamKind::FcBias, &[10], deep).unwrap();
        b.finalize().unwrap()
    }

    fn ranges(calls: &[crate::dist::grads::BucketCollective]) -> Vec<(Region, ByteRange)> {
        calls.iter().map(|c| (c.region, c.range)).collect()
    }

    #[test]
    fn a_buckets_calls_cover_its_fp16_conv_run_and_its_fp32_rest_exactly() {
        let plan = plan();
        for b in plan.buckets() {
            let calls = bucket_collectives(&plan, b.bucket()).unwrap();
            assert_eq!(calls.len(), 2, "{calls:?}");
            let (g16, g) = (calls[0], calls[1]);
            assert_eq!(g16.region, Region::G16);
            assert_eq!(g16.dtype, DataType::Half);
            assert_eq!(
                g16.range,
                plan.bucket_range(b.bucket(), Region::G16).unwrap()
            );
            assert_eq!(g16.count() * 2, g16.range.len());
            assert_eq!(g.region, Region::G);
            assert_eq!(g.dtype, DataType::Float);
            assert_eq!(g.range, crate::dist::grads::g_rest(b));
            assert_eq!(g.count() * 4, g.range.len());
            // The FP32 rest ends where the bucket ends in G and starts after its conv slots.
            let whole = plan.bucket_range(b.bucket(), Region::G).unwrap();
            assert_eq!(g.range.end, whole.end);
            assert_eq!(g.range.start, g16.range.end * 2);
        }
        // The element counts of the parameters: the conv run holds both conv weights'
        // elements of their bucket (plus slot padding), the FP32 rest the BN and FC ones.
        let deep = bucket_collectives(&plan, plan.buckets()[1].bucket()).unwrap();
        assert!(deep[0].count() >= 32 * 16);
        assert!(deep[1].count() >= 32 + 10 * 32 + 10);
        assert!(bucket_collectives(&plan, Bucket(7)).is_err());
    }

    #[test]
    fn a_binding_waits_only_for_the_buckets_whose_ranges_it_touches() {
        let plan = plan();
        let (first, deep) = (plan.buckets()[0].bucket(), plan.buckets()[1].bucket());
        let deep_calls = bucket_collectives(&plan, deep).unwrap();
        let first_calls = bucket_collectives(&plan, first).unwrap();
        // The deep bucket's all-reduce is in flight; backward now binds the first layer's
        // weight gradient (G16) and BN gradient (G): neither waits.
        let in_flight = vec![ranges(&deep_calls)];
        for c in &first_calls {
            assert_eq!(
                must_wait_for(&in_flight, c.region, c.range),
                Vec::<usize>::new()
            );
        }
        let c1 = plan.view("c1.w", Region::G16).unwrap().data_range();
        assert!(must_wait_for(&in_flight, Region::G16, c1).is_empty());
        // The same bytes of the deep bucket do, one byte of overlap too, and a range across
        // both buckets.
        let c2 = plan.view("c2.w", Region::G16).unwrap().data_range();
        assert_eq!(must_wait_for(&in_flight, Region::G16, c2), vec![0]);
        let last = ByteRange::new(c2.end - 1, c2.end);
        assert_eq!(must_wait_for(&in_flight, Region::G16, last), vec![0]);
        let across = ByteRange::new(c1.start, c2.end);
        assert_eq!(must_wait_for(&in_flight, Region::G16, across), vec![0]);
        let fc = plan.view("fc.w", Region::G).unwrap().data_range();
        assert_eq!(must_wait_for(&in_flight, Region::G, fc), vec![0]);
        // The deep conv weight's FP32 slot in G is the cast's, not the sum's: no wait; nor
        // for the same byte numbers in another region, or an empty range.
        let c2_g = plan.view("c2.w", Region::G).unwrap().data_range();
        assert!(must_wait_for(&in_flight, Region::G, c2_g).is_empty());
        assert!(must_wait_for(&in_flight, Region::A, c2).is_empty());
        assert!(
            must_wait_for(&in_flight, Region::G16, ByteRange::new(c2.start, c2.start)).is_empty()
        );
        // Both in flight: each binding waits for its own bucket only.
        let both = vec![ranges(&deep_calls), ranges(&first_calls)];
        assert_eq!(must_wait_for(&both, Region::G16, c1), vec![1]);
        assert_eq!(must_wait_for(&both, Region::G16, c2), vec![0]);
        assert_eq!(must_wait_for(&both, Region::G16, across), vec![0, 1]);
    }

    #[test]
    fn range_ops_wait_for_the_buckets_their_spans_touch() {
        let plan = plan();
        let (first, deep) = (plan.buckets()[0].bucket(), plan.buckets()[1].bucket());
        let in_flight = vec![ranges(&bucket_collectives(&plan, deep).unwrap())];
        let waits = |op: RangeOp| -> Vec<usize> {
            let mut v: Vec<usize> = op_ranges(&op)
                .into_iter()
                .flat_map(|(r, b)| must_wait_for(&in_flight, r, b))
                .collect();
            v.dedup();
            v
        };
        let span = |b: Bucket| plan.bucket_range(b, Region::G16).unwrap();
        let whole16 = ByteRange::new(0, plan.region_range(Region::G).unwrap().len() / 2);
        // Zeroing all of G (the next step's begin) waits; the cast over the first bucket's
        // conv run reads G16 bytes no sum writes and does not.
        assert_eq!(
            waits(RangeOp::Zero {
                region: Region::G,
                span16: whole16
            }),
            vec![0]
        );
        assert!(waits(RangeOp::CastF16ToF32 {
            src: Region::G16,
            dst: Region::G,
            span16: span(first)
        })
        .is_empty());
        assert_eq!(
            waits(RangeOp::CastF16ToF32 {
                src: Region::G16,
                dst: Region::G,
                span16: span(deep)
            }),
            vec![0]
        );
        // Spans are FP16-scaled: a Zero of G over bytes [a, b) of G16 covers [2a, 2b) of G.
        let z = op_ranges(&RangeOp::Zero {
            region: Region::G,
            span16: ByteRange::new(8, 24),
        });
        assert_eq!(z, vec![(Region::G, ByteRange::new(16, 48))]);
    }
}
