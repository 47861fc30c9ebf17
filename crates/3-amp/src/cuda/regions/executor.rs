//! [`CudaRegions`] as the CUDA [`AmpExecutor`]: each validated range op as one launch on the
//! regions' stream, a list of them captured into a CUDA graph ([`CudaStepGraph`]) and
//! replayed, S written and read back without waiting.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use std::fmt;

use cudarc::driver::CudaGraph;

use super::{region_index, CudaRegions};
use crate::cuda::dist_grads::op_ranges;
use crate::cuda::driver_error;
use crate::error::AmpError;
use crate::plan::{ByteRange, MemoryPlan, Region};
use crate::range::{Scalars, SgdConfig, S_REGION_BYTES};
use crate::step::{check_graph_owner, validate_capture, AmpExecutor, RangeOp};

/// A CUDA graph of range ops captured on a [`CudaRegions`]; replay it with
/// [`AmpExecutor::replay`] (or [`crate::step::AmpStep::replay`]) on the same executor.
pub struct CudaStepGraph {
    owner: u64,
    graph: CudaGraph,
    ops: Vec<RangeOp>,
}

impl fmt::Debug for CudaStepGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStepGraph")
            .field("owner", &self.owner)
            .field("ops", &self.ops)
            .finish_non_exhaustive()
    }
}

impl CudaStepGraph {
    /// The ops it launches, in order.
    pub fn ops(&self) -> &[RangeOp] {
        &self.ops
    }
}

impl CudaRegions {
    /// Device address of `span16` in `region` (the op was validated against the plan, so
    /// the region exists and the span lies inside it).
    fn addr(&self, region: Region, span16: ByteRange) -> Result<u64, AmpError> {
        let scale = region.scale_from_fp16().unwrap_or(1);
        Ok(self.get(region)?.ptr + (span16.start * scale) as u64)
    }

    /// Enqueues one op that [`RangeOp::validate`] accepted for this plan.
    fn launch(&self, op: &RangeOp) -> Result<(), AmpError> {
        let k = &self.kernels;
        let st = &self.stream;
        let n = op.elems();
        match *op {
            RangeOp::Zero { region, span16 } => {
                let bytes = span16.len() * region.scale_from_fp16().unwrap_or(1);
                let dst = self.addr(region, span16)?;
                // SAFETY: validation put span16 inside `region`, whose buffer this executor
                // owns; the buffer is freed on this same stream, after the launch.
                unsafe { k.raw_zero(st, dst, bytes) }
            }
            RangeOp::CastF16ToF32 { src, dst, span16 } => {
                let (s, d) = (self.addr(src, span16)?, self.addr(dst, span16)?);
                // SAFETY: validated: src is an FP16 and dst another (FP32) region, each with
                // n elements at these addresses; distinct allocations cannot overlap.
                unsafe { k.raw_cast_f16_to_f32(st, s, d, n) }
            }
            RangeOp::CastF32ToF16 { src, dst, span16 } => {
                let (s, d) = (self.addr(src, span16)?, self.addr(dst, span16)?);
                // SAFETY: as above with the types swapped.
                unsafe { k.raw_cast_f32_to_f16(st, s, d, n) }
            }
            RangeOp::CopyF32 { src, dst, span16 } => {
                let (s, d) = (self.addr(src, span16)?, self.addr(dst, span16)?);
                st.context()
                    .bind_to_thread()
                    .map_err(|e| driver_error("bind the CUDA context", e))?;
                // SAFETY: validated: two distinct FP32 regions (separate allocations) with n
                // f32 at these addresses, owned by this executor and freed on this stream
                // after the copy; the context is current on this thread.
                unsafe { cudarc::driver::result::memcpy_dtod_async(d, s, n * 4, st.cu_stream()) }
                    .map_err(|e| driver_error("copy between regions", e))
            }
            RangeOp::AccumGrads { drain, span16 } => {
                let g = self.addr(Region::G, span16)?;
                let acc = self.addr(Region::GA, span16)?;
                // G16 ends at the last conv parameter: the span's elements it covers.
                let g16_elems = self.plan.region_len(Region::G16) / 2;
                let n16 = g16_elems.saturating_sub(span16.start / 2).min(n);
                let g16 = if n16 > 0 {
                    self.addr(Region::G16, span16)?
                } else {
                    0
                };
                // SAFETY: validated: n f32 of G and of GA at `g` and `acc`; G16 is read only
                // for the n16 elements that lie inside it (computed from the plan just above),
                // never when n16 is 0; the three are separate allocations of this executor,
                // freed on this stream after the launch.
                unsafe { k.raw_accum_grads(st, g16, g, acc, n, n16, drain) }
            }
            RangeOp::Check { policy, span16 } => {
                let (g, s) = (self.addr(Region::G, span16)?, self.get(Region::S)?.ptr);
                // SAFETY: validated: n f32 of G at `g`; S is the plan's 256-byte region
                // (256-aligned allocation); distinct allocations.
                unsafe { k.raw_check(st, policy, g, n, s) }
            }
            RangeOp::GradNorm { span16 } => {
                let (g, s) = (self.addr(Region::G, span16)?, self.get(Region::S)?.ptr);
                // SAFETY: validated: n f32 of G at `g`; S is the plan's 256-byte region
                // (256-aligned allocation, room for the partial sums); distinct allocations.
                unsafe { k.raw_grad_norm(st, g, n, s) }
            }
            RangeOp::Sgd {
                nesterov,
                decay,
                momentum_buffer,
                span16,
            } => {
                let m = if momentum_buffer {
                    self.addr(Region::M, span16)?
                } else {
                    0
                };
                let w = self.addr(Region::W, span16)?;
                let g = self.addr(Region::G, span16)?;
                let a = self.addr(Region::A, span16)?;
                let s = self.get(Region::S)?.ptr;
                // SAFETY: validated: n elements of W, G, A (and M when the op has a momentum
                // buffer, which the validation required the plan to have) at these addresses,
                // each region its own allocation; M null means the kernel never touches it.
                unsafe { k.raw_sgd(st, w, m, g, a, s, nesterov, decay, n) }
            }
            RangeOp::Ema { decay, span16 } => {
                let e = self.addr(Region::E, span16)?;
                let h = self.addr(Region::E16, span16)?;
                let w = self.addr(Region::W, span16)?;
                let s = self.get(Region::S)?.ptr;
                // SAFETY: validated: n elements of E, E16 and W, separate allocations.
                unsafe { k.raw_ema(st, e, h, w, s, decay, n) }
            }
            RangeOp::LossScaleUpdate { policy } => {
                let s = self.get(Region::S)?.ptr;
                // SAFETY: S is the plan's 256-byte region, 256-aligned.
                unsafe { k.raw_loss_scale_update(st, s, &policy) }
            }
        }
    }
}

impl AmpExecutor for CudaRegions {
    type Graph = CudaStepGraph;

    fn id(&self) -> u64 {
        self.id
    }

    fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    fn run(&mut self, op: &RangeOp) -> Result<(), AmpError> {
        op.validate(&self.plan)?;
        for (region, range) in op_ranges(op) {
            self.order_after_collectives(&self.stream, region, range)?;
        }
        self.launch(op)
    }

    fn capture(&mut self, ops: &[RangeOp]) -> Result<CudaStepGraph, AmpError> {
        validate_capture(&self.plan, ops)?;
        // A graph's replays may touch any range: order after every collective before the
        // capture (an event recorded outside a capture cannot be waited on inside it).
        self.join_collectives()?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver_error("begin stream capture", e))?;
        // Only raw launches from here to `end_capture`: no cudarc event is recorded or waited
        // on, so nothing outside the graph is captured into it.
        let launched = ops.iter().try_for_each(|op| self.launch(op));
        // Always end the capture, so the stream is usable again whatever happened.
        let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        let graph = ended
            .map_err(|e| driver_error("end stream capture and instantiate the graph", e))?
            .ok_or_else(|| {
                driver_error(
                    "end stream capture",
                    cudarc::driver::DriverError(
                        cudarc::driver::sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                    ),
                )
            })?;
        Ok(CudaStepGraph {
            owner: self.id,
            graph,
            ops: ops.to_vec(),
        })
    }

    fn replay(&mut self, graph: &CudaStepGraph) -> Result<(), AmpError> {
        check_graph_owner(graph.owner, self.id)?;
        // As for capture: the replay may touch any range.
        self.join_collectives()?;
        graph
            .graph
            .launch()
            .map_err(|e| driver_error("launch the captured graph", e))
    }

    fn write_scalars(&mut self, s: &Scalars) -> Result<(), AmpError> {
        // A loss scale of 0, NaN or ±Inf never recovers (as on the CPU executor).
        s.validate()?;
        let bytes = s.to_bytes();
        self.upload_bytes(Region::S, ByteRange::new(0, S_REGION_BYTES), &bytes)
    }

    fn write_hyper(&mut self, sgd: &SgdConfig) -> Result<(), AmpError> {
        use crate::range::s_layout::{LR, WEIGHT_DECAY};
        let bytes = Scalars::default().with_sgd(sgd).to_bytes();
        let at = ByteRange::new(LR, WEIGHT_DECAY + 4);
        self.upload_bytes(Region::S, at, &bytes[at.start..at.end])
    }

    fn write_ranks(&mut self, ranks: u32) -> Result<(), AmpError> {
        use crate::range::s_layout::RANKS;
        let at = ByteRange::new(RANKS, RANKS + 4);
        self.upload_bytes(Region::S, at, &ranks.to_le_bytes())
    }

    fn write_clip_norm(&mut self, max_norm: f32) -> Result<(), AmpError> {
        use crate::range::s_layout::CLIP_NORM;
        let at = ByteRange::new(CLIP_NORM, CLIP_NORM + 4);
        self.upload_bytes(Region::S, at, &max_norm.to_le_bytes())
    }

    fn write_accum(&mut self, accum: u32) -> Result<(), AmpError> {
        use crate::range::s_layout::ACCUM;
        let at = ByteRange::new(ACCUM, ACCUM + 4);
        self.upload_bytes(Region::S, at, &accum.to_le_bytes())
    }

    fn request_scalars(&mut self) -> Result<(), AmpError> {
        self.plan.region_range(Region::S)?;
        let Some(s) = self.regions[region_index(Region::S)].as_ref() else {
            return Err(crate::PlanError::RegionAbsent { region: Region::S }.into());
        };
        // S is exactly `S_REGION_BYTES` long (the plan's S region), so it fits the readback.
        self.s_readback.request(&self.stream, &s.buf)
    }

    fn poll_scalars(&mut self) -> Result<Option<Scalars>, AmpError> {
        match self.s_readback.poll()? {
            Some(bytes) => Ok(Some(Scalars::from_bytes(bytes)?)),
            None => Ok(None),
        }
    }
}
