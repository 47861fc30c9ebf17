//! [`CudaRegions`]: a plan's regions in device memory, the CUDA [`AmpExecutor`]: allocation
//! and the buffers and addresses it hands out here; the executor's launches, capture and
//! replay in [`executor`], host transfers in [`transfer`], collectives in flight on another
//! stream in [`collectives`].

mod collectives;
mod executor;
mod transfer;

pub use executor::CudaStepGraph;

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr};

use crate::cuda::launch::AmpKernels;
use crate::cuda::readback::Readback;
use crate::cuda::{check_device_memory, driver_error};
use crate::error::AmpError;
use crate::plan::{MemoryPlan, Region};
use crate::range::S_REGION_BYTES;
use crate::step::next_executor_id;

// Named only by doc links.
#[cfg(doc)]
use crate::step::AmpExecutor;
use collectives::InFlight;
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
    /// whose ranges it touches (`dist_grads::must_wait_for`).
    in_flight: Vec<InFlight>,
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

pub(super) const fn region_index(region: Region) -> usize {
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

impl CudaRegions {
    /// Allocates `plan`'s regions, zeroed, on `stream` (S holds zeros until
    /// [`AmpExecutor::write_scalars`], which [`crate::step::AmpStep::new`] calls), and gets
    /// the kernels of the stream's context (compiling them on first use).
    ///
    /// For capture into a CUDA graph, use any stream but the legacy default one
    /// (`ctx.default_stream()`): `ctx.per_thread_stream()` keeps cudarc's event tracking off
    /// (so launches over a [`DevRange`](crate::cuda::DevRange), such as the network head's,
    /// capture too), while `ctx.new_stream()` turns it on, after which only the regions' own
    /// launches capture.
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
}
