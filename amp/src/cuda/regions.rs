//! [`CudaRegions`]: a plan's regions in device memory, the CUDA [`AmpExecutor`].

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaEvent, CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
};
use half::f16;

use crate::cuda::dist_grads::{must_wait_for, op_ranges};
use crate::cuda::launch::AmpKernels;
use crate::cuda::readback::Readback;
use crate::cuda::{check_device_memory, driver_error};
use crate::error::{AmpError, ExecError};
use crate::plan::{ByteRange, DataType, MemoryPlan, Region};
use crate::range::{Scalars, SgdConfig, S_REGION_BYTES};
use crate::step::{check_graph_owner, next_executor_id, validate_capture, AmpExecutor, RangeOp};
use cudnn_cbr_runtime::cuda_device;

/// Every allocated region's buffer and the tensor arena, borrowed mutably at once
/// ([`CudaRegions::regions_and_tensors_mut`]).
pub type RegionsMut<'a> = (
    Vec<(Region, &'a mut CudaSlice<u8>)>,
    Option<&'a mut CudaSlice<u8>>,
);

/// One allocated region: the buffer and its device address (taken once, at allocation).
#[derive(Debug)]
struct DeviceRegion {
    buf: CudaSlice<u8>,
    ptr: u64,
}

/// A plan's regions in device memory, on one stream, with the plan's range kernels.
///
/// Created zeroed. Every op runs as one kernel launch (or one device-to-device copy) on
/// [`CudaRegions::stream`], never waiting for the device. Graphs captured from it
/// ([`CudaStepGraph`]) hold its device addresses and replay only on it.
pub struct CudaRegions {
    id: u64,
    plan: Arc<MemoryPlan>,
    stream: Arc<CudaStream>,
    kernels: Arc<AmpKernels>,
    /// The asynchronous copies of S behind [`AmpExecutor::request_scalars`]. Declared
    /// before `regions` so that it drops first: its drop waits for a copy still in flight.
    s_readback: Readback,
    regions: [Option<DeviceRegion>; 9],
    /// The plan's tensor arena (a network's activations, gradients and statistics), when it
    /// has one.
    tensors: Option<CudaSlice<u8>>,
    /// Collectives enqueued on another stream over byte ranges of these regions (a gradient
    /// bucket's all-reduce), each with the event recorded after it, until
    /// [`CudaRegions::join_collectives`]. They bypass cudarc's event tracking, which would
    /// order every later use of the whole allocation after them: a use waits only for those
    /// whose ranges it touches ([`must_wait_for`]).
    in_flight: Vec<InFlight>,
}

/// A collective in flight on another stream: the region ranges it reads or writes, and the
/// event recorded after it on that stream.
#[derive(Debug)]
struct InFlight {
    ranges: Vec<(Region, ByteRange)>,
    event: CudaEvent,
}

impl fmt::Debug for CudaRegions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaRegions")
            .field("id", &self.id)
            .field("device", &self.stream.context().ordinal())
            .field("total_bytes", &self.plan.total_bytes())
            .field("kernels", &self.kernels)
            .finish_non_exhaustive()
    }
}

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

const fn region_index(region: Region) -> usize {
    match region {
        Region::W => 0,
        Region::A => 1,
        Region::G => 2,
        Region::G16 => 3,
        Region::M => 4,
        Region::E => 5,
        Region::E16 => 6,
        Region::GA => 7,
        Region::S => 8,
    }
}

fn wrong_dtype(op: &'static str, region: Region, want: DataType) -> AmpError {
    ExecError::WrongRegion {
        op,
        region,
        role: "typed transfer",
        needs: match want {
            DataType::Half => "an FP16 region (A, G16, E16)",
            // Regions hold FP16 or FP32 only.
            _ => "an FP32 region (W, G, M, E)",
        },
    }
    .into()
}

impl CudaRegions {
    /// Allocates `plan`'s regions, zeroed, on `stream` (S holds zeros until
    /// [`AmpExecutor::write_scalars`], which [`crate::step::AmpStep::new`] calls), and gets
    /// the kernels of the stream's context (compiling them on first use).
    ///
    /// For capture into a CUDA graph, use any stream but the legacy default one
    /// (`ctx.default_stream()`): `ctx.per_thread_stream()` keeps cudarc's event tracking off
    /// (so head launches through [`DevRange`](crate::cuda::DevRange) capture too), while
    /// `ctx.new_stream()` turns it on, after which only the regions' own launches capture.
    ///
    /// # Errors
    /// As [`AmpKernels::for_context`]; [`AmpError::OutOfMemory`] when the plan exceeds the
    /// device's free memory; a driver error when an allocation fails.
    pub fn new(
        plan: impl Into<Arc<MemoryPlan>>,
        stream: Arc<CudaStream>,
    ) -> Result<Self, AmpError> {
        let plan = plan.into();
        let ctx = stream.context().clone();
        let kernels = AmpKernels::for_context(&ctx)?;
        // Checked before allocating: a plan too large for the device is a typed error naming
        // the sizes rather than a driver failure halfway through the regions.
        check_device_memory(
            &ctx,
            "the memory plan's regions and tensor arena",
            plan.total_bytes() as u128 + plan.tensor_bytes() as u128,
        )?;
        let mut regions: [Option<DeviceRegion>; 9] = Default::default();
        for region in Region::ALL {
            if !plan.has_region(region) {
                continue;
            }
            let buf = stream
                .alloc_zeros::<u8>(plan.region_len(region))
                .map_err(|e| driver_error(format!("allocate region {region}"), e))?;
            let (ptr, sync) = buf.device_ptr(&stream);
            drop(sync);
            regions[region_index(region)] = Some(DeviceRegion { buf, ptr });
        }
        let tensors = match plan.tensor_bytes() {
            0 => None,
            n => Some(
                stream
                    .alloc_zeros::<u8>(n)
                    .map_err(|e| driver_error("allocate the tensor arena", e))?,
            ),
        };
        let s_readback = Readback::new(&ctx, S_REGION_BYTES)?;
        Ok(CudaRegions {
            id: next_executor_id(),
            plan,
            stream,
            kernels,
            regions,
            tensors,
            s_readback,
            in_flight: Vec::new(),
        })
    }

    /// Opens device `ordinal`, makes a new stream on it and allocates `plan`'s regions there.
    ///
    /// # Errors
    /// [`AmpError::NoDevice`], [`AmpError::NoNvrtc`], as [`CudaRegions::new`].
    pub fn open(plan: impl Into<Arc<MemoryPlan>>, ordinal: usize) -> Result<Self, AmpError> {
        let ctx = cuda_device(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("create a stream", e))?;
        Self::new(plan, stream)
    }

    /// The stream every op of this executor goes to; enqueue forward and backward here.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The compiled kernels.
    pub fn kernels(&self) -> &Arc<AmpKernels> {
        &self.kernels
    }

    /// The plan, shared.
    pub fn plan_arc(&self) -> &Arc<MemoryPlan> {
        &self.plan
    }

    /// Records a collective enqueued on another stream over `ranges` of these regions (raw
    /// addresses, outside cudarc's event tracking), finished at `event`: later uses of those
    /// ranges through this executor wait for it, others do not.
    pub(crate) fn note_collective(&mut self, ranges: Vec<(Region, ByteRange)>, event: CudaEvent) {
        self.in_flight.push(InFlight { ranges, event });
    }

    /// How many collectives over these regions are in flight on another stream (noted by
    /// [`crate::cuda::dist_grads::all_reduce_bucket`], until
    /// [`CudaRegions::join_collectives`]).
    pub fn collectives_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Makes `stream` wait for the collectives in flight that touch bytes `range` of
    /// `region`, and for no other: e.g. before binding one slot of G16 on the compute stream
    /// while other buckets' all-reduces still run. [`CudaRegions::region_mut`] and its kin
    /// hand out whole buffers without waiting: a caller that uses a range a collective is
    /// still summing orders itself with this first.
    ///
    /// # Errors
    /// A driver error.
    pub fn order_after_collectives(
        &self,
        stream: &CudaStream,
        region: Region,
        range: ByteRange,
    ) -> Result<(), AmpError> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let ranges: Vec<Vec<(Region, ByteRange)>> =
            self.in_flight.iter().map(|f| f.ranges.clone()).collect();
        for i in must_wait_for(&ranges, region, range) {
            stream.wait(&self.in_flight[i].event).map_err(|e| {
                driver_error(format!("order a use of {region} after a collective"), e)
            })?;
        }
        Ok(())
    }

    /// Orders this executor's stream after every collective in flight over its regions and
    /// forgets them (the step's join point, before the amp step reads the gradients).
    ///
    /// # Errors
    /// A driver error; the collectives stay noted then.
    pub fn join_collectives(&mut self) -> Result<(), AmpError> {
        for f in &self.in_flight {
            self.stream
                .wait(&f.event)
                .map_err(|e| driver_error("order the step after the collectives", e))?;
        }
        self.in_flight.clear();
        Ok(())
    }

    /// The device address of `region`'s first byte (for collectives that order themselves).
    pub(crate) fn region_addr(&self, region: Region) -> Result<u64, AmpError> {
        Ok(self.get(region)?.ptr)
    }

    fn get(&self, region: Region) -> Result<&DeviceRegion, AmpError> {
        self.plan.region_range(region)?;
        self.regions[region_index(region)]
            .as_ref()
            .ok_or_else(|| crate::PlanError::RegionAbsent { region }.into())
    }

    fn get_mut(&mut self, region: Region) -> Result<&mut DeviceRegion, AmpError> {
        self.plan.region_range(region)?;
        self.regions[region_index(region)]
            .as_mut()
            .ok_or_else(|| crate::PlanError::RegionAbsent { region }.into())
    }

    /// A whole region's buffer.
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`].
    pub fn region(&self, region: Region) -> Result<&CudaSlice<u8>, AmpError> {
        Ok(&self.get(region)?.buf)
    }

    /// A whole region's buffer, to write with cudarc (e.g. `memcpy_htod` on
    /// [`CudaRegions::stream`]). Keep padding and G16's holes zero.
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`].
    pub fn region_mut(&mut self, region: Region) -> Result<&mut CudaSlice<u8>, AmpError> {
        Ok(&mut self.get_mut(region)?.buf)
    }

    /// Every allocated region's buffer, mutably at once: a table that binds several slots
    /// (a layer's weight in A, its BN parameters in W, their gradients in G16 and G) borrows
    /// each region once.
    pub fn regions_mut(&mut self) -> impl Iterator<Item = (Region, &mut CudaSlice<u8>)> {
        self.regions_and_tensors_mut().0.into_iter()
    }

    /// [`CudaRegions::regions_mut`] and the tensor arena, mutably at once.
    pub fn regions_and_tensors_mut(&mut self) -> RegionsMut<'_> {
        debug_assert!(Region::ALL
            .iter()
            .enumerate()
            .all(|(i, &r)| region_index(r) == i));
        let regions = Region::ALL
            .into_iter()
            .zip(self.regions.iter_mut())
            .filter_map(|(r, d)| d.as_mut().map(|d| (r, &mut d.buf)))
            .collect();
        (regions, self.tensors.as_mut())
    }

    /// The tensor arena ([`MemoryPlan::tensors`] gives its slots), when the plan has one.
    pub fn tensor_arena(&self) -> Option<&CudaSlice<u8>> {
        self.tensors.as_ref()
    }

    /// The tensor arena, to write.
    pub fn tensor_arena_mut(&mut self) -> Option<&mut CudaSlice<u8>> {
        self.tensors.as_mut()
    }

    /// Parameter `name`'s data bytes in `region`, as a cudarc view.
    ///
    /// # Errors
    /// [`crate::PlanError::UnknownParam`], [`crate::PlanError::NotInRegion`].
    pub fn param_view(&self, name: &str, region: Region) -> Result<CudaView<'_, u8>, AmpError> {
        let r = self.plan.view(name, region)?.data_range();
        Ok(self.get(region)?.buf.slice(r.start..r.end))
    }

    /// Parameter `name`'s data bytes in `region`, as a writable cudarc view (e.g. a
    /// gradient's destination).
    ///
    /// # Errors
    /// [`crate::PlanError::UnknownParam`], [`crate::PlanError::NotInRegion`].
    pub fn param_view_mut(
        &mut self,
        name: &str,
        region: Region,
    ) -> Result<CudaViewMut<'_, u8>, AmpError> {
        let r = self.plan.view(name, region)?.data_range();
        Ok(self.get_mut(region)?.buf.slice_mut(r.start..r.end))
    }

    fn upload_bytes(
        &mut self,
        region: Region,
        at: ByteRange,
        bytes: &[u8],
    ) -> Result<(), AmpError> {
        let stream = self.stream.clone();
        self.order_after_collectives(&stream, region, at)?;
        let buf = &mut self.get_mut(region)?.buf;
        let mut view = buf.slice_mut(at.start..at.end);
        stream
            .memcpy_htod(bytes, &mut view)
            .map_err(|e| driver_error(format!("copy into region {region}"), e))
    }

    fn download_bytes(&self, region: Region, at: ByteRange) -> Result<Vec<u8>, AmpError> {
        self.order_after_collectives(&self.stream, region, at)?;
        let view = self.get(region)?.buf.slice(at.start..at.end);
        self.stream
            .clone_dtoh(&view)
            .map_err(|e| driver_error(format!("copy out of region {region}"), e))
    }

    fn data_range(
        &self,
        name: &str,
        region: Region,
        want: DataType,
        op: &'static str,
        elems: Option<usize>,
    ) -> Result<ByteRange, AmpError> {
        let v = self.plan.view(name, region)?;
        if v.dtype != want {
            return Err(wrong_dtype(op, region, want));
        }
        if let Some(n) = elems {
            if n != v.elems {
                return Err(crate::RangeOpError::LengthMismatch {
                    op,
                    what: "data",
                    expected: v.elems,
                    got: n,
                }
                .into());
            }
        }
        Ok(v.data_range())
    }

    /// Copies `data` into parameter `name`'s slot of FP32 `region` (asynchronously: the host
    /// data is staged at once, the copy runs in stream order).
    ///
    /// # Errors
    /// [`crate::RangeOpError::LengthMismatch`] when `data` is not the parameter's element
    /// count, [`ExecError::WrongRegion`] for an FP16 region, plan lookup errors; a driver
    /// error.
    pub fn upload_f32(&mut self, region: Region, name: &str, data: &[f32]) -> Result<(), AmpError> {
        let r = self.data_range(
            name,
            region,
            DataType::Float,
            "upload_f32",
            Some(data.len()),
        )?;
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload_bytes(region, r, &bytes)
    }

    /// Copies `data` into parameter `name`'s slot of FP16 `region` (e.g. a conv gradient
    /// into G16).
    ///
    /// # Errors
    /// As [`CudaRegions::upload_f32`].
    pub fn upload_f16(&mut self, region: Region, name: &str, data: &[f16]) -> Result<(), AmpError> {
        let r = self.data_range(name, region, DataType::Half, "upload_f16", Some(data.len()))?;
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload_bytes(region, r, &bytes)
    }

    /// Overwrites a whole region from its byte image (little-endian; S is its 256 bytes).
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when `bytes` is not the region's length; a driver error.
    pub fn upload_region_bytes(&mut self, region: Region, bytes: &[u8]) -> Result<(), AmpError> {
        let len = self.plan.region_range(region)?.len();
        if bytes.len() != len {
            return Err(ExecError::OutOfBounds {
                op: "upload_region_bytes",
                what: region.to_string(),
                start: 0,
                end: bytes.len(),
                len,
            }
            .into());
        }
        if region == Region::S {
            Scalars::from_bytes(bytes)?;
        }
        self.upload_bytes(region, ByteRange::new(0, len), bytes)
    }

    /// Reads parameter `name` out of FP32 `region`. Waits for the stream: for checkpoints
    /// and tests, not for the training loop.
    ///
    /// # Errors
    /// [`ExecError::WrongRegion`] for an FP16 region, plan lookup errors; a driver error.
    pub fn download_f32(&self, region: Region, name: &str) -> Result<Vec<f32>, AmpError> {
        let r = self.data_range(name, region, DataType::Float, "download_f32", None)?;
        let bytes = self.download_bytes(region, r)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Reads parameter `name` out of FP16 `region`. Waits for the stream.
    ///
    /// # Errors
    /// As [`CudaRegions::download_f32`].
    pub fn download_f16(&self, region: Region, name: &str) -> Result<Vec<f16>, AmpError> {
        let r = self.data_range(name, region, DataType::Half, "download_f16", None)?;
        let bytes = self.download_bytes(region, r)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect())
    }

    /// A whole region's bytes (S: its 256-byte image). Waits for the stream.
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`]; a driver error.
    pub fn download_region_bytes(&self, region: Region) -> Result<Vec<u8>, AmpError> {
        let len = self.plan.region_range(region)?.len();
        self.download_bytes(region, ByteRange::new(0, len))
    }

    /// Waits for the stream, then reads S. For tests and the end of a run; in the loop use
    /// [`AmpExecutor::request_scalars`] and [`AmpExecutor::poll_scalars`].
    ///
    /// # Errors
    /// A driver error.
    pub fn read_scalars_blocking(&self) -> Result<Scalars, AmpError> {
        let bytes = self.download_region_bytes(Region::S)?;
        Ok(Scalars::from_bytes(&bytes)?)
    }

    /// The device address of parameter `name`'s data in `region`: for launches that bind
    /// slots of several regions, or two slots of one, at once (e.g. the FC layer's backward,
    /// which writes two gradients of G). The address is the region's own, taken at
    /// allocation, outside cudarc's event tracking; it stays valid while these regions live,
    /// and work enqueued on [`CudaRegions::stream`] runs before they are freed.
    ///
    /// # Errors
    /// [`crate::PlanError::UnknownParam`], [`crate::PlanError::NotInRegion`],
    /// [`crate::PlanError::RegionAbsent`].
    pub fn param_addr(&self, name: &str, region: Region) -> Result<u64, AmpError> {
        let v = self.plan.view(name, region)?;
        Ok(self.get(region)?.ptr + v.offset_bytes as u64)
    }

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

impl Drop for CudaRegions {
    fn drop(&mut self) {
        // The buffers are freed on this stream: after the collectives still reading or
        // writing them on another (their raw addresses are invisible to cudarc's tracking).
        for f in &self.in_flight {
            let _ = self.stream.wait(&f.event);
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
