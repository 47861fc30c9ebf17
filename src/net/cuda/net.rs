//! [`CudaNet`]: a compiled network's buffers on the device, and its passes over them.

use crate::amp::cuda::{check_device_memory, CudaRegions, CudaSlice, CudaStream};
use crate::amp::plan::{Bucket, MemoryPlan, Region};
use crate::net::buckets::GradSchedule;
use crate::net::compile::{BufId, CompiledNet, NetBuffer};
use crate::net::exec::{run_pass, run_pass_observed};
use crate::netops::cuda::NetKernels;
use cudnn_cbr_fusion::cache::PlanCache;
use cudnn_cbr_fusion::cbr::{ArenaId, DeviceBnSync, DeviceBuffers, Pass};
use cudnn_cbr_fusion::exec::Handle;
use half::f16;
use std::collections::HashMap;
use std::sync::Arc;

use super::binding::{check_bn_sync, layer_bindings, placement, Placement};
use super::pass::CudaNetPass;
use super::replan::replan_for;
use super::{driver, CudaNetError, Result};

/// Where a slot of the amp plan lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Home {
    /// A parameter region.
    Region(Region),
    /// The plan's tensor arena.
    Tensors,
}

/// A compiled network on the device.
///
/// Its buffers are allocations of its own, or slots of an amp memory plan: the parameters
/// and their gradients in the regions, and, when the plan has them
/// ([`crate::net::memory_plan_with_buffers`]), every other buffer but the input, the output
/// and its gradient in the plan's tensor arena. It holds no address of the amp memory:
/// [`CudaNet::forward_with`] borrows the regions for the pass, so they cannot be freed or
/// changed under it.
///
/// Streams: the network runs on the handle's stream. The regions may live on another stream
/// of the same context (an update stream for the amp step): each pass then waits for that
/// stream and that stream waits for the pass, through CUDA events. Capture a step into a
/// CUDA graph on one stream.
#[derive(Debug)]
pub struct CudaNet {
    pub(super) net: CompiledNet,
    /// Each network buffer's own allocation (`None`: a parameter slot in the amp regions).
    pub(super) bufs: Vec<Option<CudaSlice<u8>>>,
    /// Where each slot in the amp plan lives (offset and bytes in its region or the tensor
    /// arena), by buffer.
    pub(super) slots: Vec<Option<(Home, usize, usize)>>,
    /// The memory plan the slots belong to.
    amp_plan: Option<Arc<MemoryPlan>>,
    /// Whether the running variances in the tensor arena were set to 1 (on the first pass
    /// with the regions; the arena starts zeroed).
    arena_ready: bool,
    handle: Arc<Handle>,
    pub(super) stream: Arc<CudaStream>,
    /// The residual join and max-pool kernels of the stream's context.
    pub(super) kernels: Arc<NetKernels>,
    /// Synchronized BN's reducer ([`CudaNet::set_bn_sync`]); `None`: local BN.
    bn_sync: Option<SyncSlot>,
}

/// The synchronized-BN reducer of a data-parallel rank.
struct SyncSlot(Box<dyn DeviceBnSync + Send>);

impl std::fmt::Debug for SyncSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBnSync({} replicas)", self.0.replicas())
    }
}

impl CudaNet {
    /// Allocates every buffer of `net` on the handle's stream (zeroed; running variances at 1);
    /// with `amp_plan`, the parameters and their gradients are that plan's slots instead
    /// (checked here: each exists and is large enough). Layers whose plans were built for
    /// another target than the handle's device are planned again for it ([`replan_for`], in a
    /// cache of their own: [`CudaNet::with_cache`] gives one). Reserves the largest workspace
    /// any plan needs.
    ///
    /// # Errors
    /// [`AmpError::OutOfMemory`](crate::amp::AmpError::OutOfMemory) (checked first) when the
    /// buffers exceed the device's free memory; a parameter without a slot, or a slot that does
    /// not fit; a driver error;
    /// [`CudaNetError::Replan`] for a layer whose route does not plan on the device; as
    /// [`NetKernels::for_context`] for the network's own kernels (the residual join and
    /// max-pool), which are loaded into the context of the handle's stream.
    pub fn new(
        net: CompiledNet,
        handle: Arc<Handle>,
        amp_plan: Option<Arc<MemoryPlan>>,
    ) -> Result<Self> {
        Self::with_cache(net, handle, amp_plan, &PlanCache::new())
    }

    /// [`CudaNet::new`], planning any layer built for another target again through `cache`
    /// (a persistent cache keeps those plans for the next process).
    ///
    /// # Errors
    /// As [`CudaNet::new`].
    pub fn with_cache(
        mut net: CompiledNet,
        handle: Arc<Handle>,
        amp_plan: Option<Arc<MemoryPlan>>,
        cache: &PlanCache,
    ) -> Result<Self> {
        // Before the workspace is sized: plans for this device may need another workspace.
        replan_for(&mut net, &handle.target()?, cache)?;
        let stream = handle.stream().clone();
        let workspace = net.layers.iter().map(|l| l.layer.workspace_size()).max();
        handle.reserve_workspace(workspace.unwrap_or(0))?;
        let placed = placement(&net, amp_plan.as_deref())?;
        // Checked before allocating: a network too large for the device is a typed error
        // naming the sizes, not a driver failure halfway through its buffers.
        let need: u128 = net
            .buffers
            .iter()
            .zip(&placed)
            .filter(|(_, p)| **p == Placement::Own)
            .map(|(b, _)| (b.elems as u128) * (b.dtype.size() as u128))
            .sum();
        check_device_memory(
            stream.context(),
            &format!("network `{}`'s buffers", net.spec.name),
            need,
        )?;
        // The network's own kernels, compiled here rather than at the first pass, which may be
        // captured into a CUDA graph.
        let kernels = NetKernels::for_context(stream.context())?;
        let mut bufs = Vec::with_capacity(net.buffers.len());
        let mut slots = Vec::with_capacity(net.buffers.len());
        for (b, p) in net.buffers.iter().zip(&placed) {
            let (buf, slot) = match *p {
                Placement::Own => (Some(alloc_buffer(&stream, b)?), None),
                Placement::Region {
                    region,
                    offset,
                    bytes,
                } => (None, Some((Home::Region(region), offset, bytes))),
                Placement::Tensors { offset, bytes } => {
                    (None, Some((Home::Tensors, offset, bytes)))
                }
            };
            bufs.push(buf);
            slots.push(slot);
        }
        Ok(CudaNet {
            net,
            bufs,
            slots,
            amp_plan,
            arena_ready: false,
            handle,
            stream,
            kernels,
            bn_sync: None,
        })
    }

    /// Turns on synchronized BN: every layer's statistics (forward) and BN-backward
    /// coefficients come from the batch of all of `sync`'s replicas
    /// ([`CbrLayer::run_gpu_synced`](cudnn_cbr_fusion::cbr::CbrLayer::run_gpu_synced)).
    /// Every replica runs the same network and calls the same passes.
    ///
    /// # Errors
    /// [`CudaNetError::Fusion`] with [`cudnn_cbr_fusion::Error::BnSync`] naming the first
    /// layer whose route sums its BN statistics inside one graph (the unfused route).
    pub fn set_bn_sync(&mut self, sync: Box<dyn DeviceBnSync + Send>) -> Result<()> {
        check_bn_sync(&self.net)?;
        self.bn_sync = Some(SyncSlot(sync));
        Ok(())
    }

    /// The network's own kernels (residual join, max-pool, the head), loaded in the handle's
    /// context.
    pub fn net_kernels(&self) -> &Arc<NetKernels> {
        &self.kernels
    }

    /// The network it runs.
    pub fn compiled(&self) -> &CompiledNet {
        &self.net
    }

    pub(super) fn not_own(&self, id: BufId) -> CudaNetError {
        let name = &self.net.buffers[id].name;
        CudaNetError::Binding(match self.slots[id] {
            Some((Home::Tensors, ..)) => format!(
                "network buffer `{name}` lives in the amp plan's tensor arena, where buffers \
                 never alive together share bytes (its value is gone once its lifetime ends); \
                 make the network with a plan without buffers (one allocation each) to read it"
            ),
            _ => format!(
                "network buffer `{name}` is a slot of the amp plan, not an allocation of its own"
            ),
        })
    }

    fn id(&self, name: &str) -> Result<BufId> {
        self.net.buffer_id(name).ok_or_else(|| {
            CudaNetError::Binding(format!("`{name}` is not a buffer of this network"))
        })
    }

    /// A buffer's own allocation.
    pub fn buffer(&self, id: BufId) -> Result<&CudaSlice<u8>> {
        self.bufs[id].as_ref().ok_or_else(|| self.not_own(id))
    }

    /// A buffer's own allocation, for writing.
    pub fn buffer_mut(&mut self, id: BufId) -> Result<&mut CudaSlice<u8>> {
        if self.bufs[id].is_none() {
            return Err(self.not_own(id));
        }
        Ok(self.bufs[id].as_mut().expect("checked just above"))
    }

    /// Copies `bytes` into the buffer `name` (asynchronously, in stream order); the length must
    /// match.
    pub fn upload(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let id = self.id(name)?;
        let stream = self.stream.clone();
        let slice = self.buffer_mut(id)?;
        if slice.len() != bytes.len().max(1) {
            return Err(CudaNetError::Binding(format!(
                "`{name}` has {} bytes, got {}",
                slice.len(),
                bytes.len()
            )));
        }
        stream
            .memcpy_htod(bytes, slice)
            .map_err(|e| driver(format!("upload `{name}`"), e))
    }

    /// The buffer `name`'s bytes (blocking).
    pub fn download(&self, name: &str) -> Result<Vec<u8>> {
        let slice = self.buffer(self.id(name)?)?;
        self.stream
            .clone_dtoh(slice)
            .map_err(|e| driver(format!("download `{name}`"), e))
    }

    /// The forward pass (the input uploaded) of a network whose parameters are its own; the
    /// output in [`CompiledNet::output`].
    pub fn forward(&mut self) -> Result<()> {
        run_pass(&mut self.pass(None, None)?, Pass::Forward)
    }

    /// The forward pass in evaluation mode (the input uploaded) of a network whose
    /// parameters are its own: every BN from its running statistics (eq_scale and eq_bias
    /// computed on the host from the device's values, [`Pass::Eval`]; on the unfused route our
    /// `cbr_bn_eval` kernel in place of its training-mode NormForward), the running statistics
    /// read and never written; the output in [`CompiledNet::output`].
    ///
    /// # Errors
    /// A running variance the evaluation refuses; a driver or kernel error.
    pub fn evaluate(&mut self) -> Result<()> {
        run_pass(&mut self.pass(None, None)?, Pass::Eval)
    }

    /// [`CudaNet::evaluate`] with the parameters in `regions`.
    ///
    /// # Errors
    /// As [`CudaNet::evaluate`].
    pub fn evaluate_with(&mut self, regions: &mut CudaRegions) -> Result<()> {
        run_pass(&mut self.pass(Some(regions), None)?, Pass::Eval)
    }

    /// [`CudaNet::evaluate`] reading the caller's `input` (NHWC FP16, at least the network's
    /// input size, borrowed for the pass), with the parameters in `regions` when given.
    ///
    /// # Errors
    /// As [`CudaNet::evaluate`].
    pub fn evaluate_from(
        &mut self,
        regions: Option<&mut CudaRegions>,
        input: &mut CudaSlice<f16>,
    ) -> Result<()> {
        self.run(regions, Some(input), Pass::Eval)
    }

    /// The backward pass (the output's gradient written) of a network whose parameters are
    /// its own.
    pub fn backward(&mut self) -> Result<()> {
        run_pass(&mut self.pass(None, None)?, Pass::Backward)
    }

    /// The forward pass with the parameters in `regions` (made from the plan given to
    /// [`CudaNet::new`]).
    pub fn forward_with(&mut self, regions: &mut CudaRegions) -> Result<()> {
        self.run(Some(regions), None, Pass::Forward)
    }

    /// The backward pass with the parameters and their gradients in `regions`.
    pub fn backward_with(&mut self, regions: &mut CudaRegions) -> Result<()> {
        self.run(Some(regions), None, Pass::Backward)
    }

    /// The backward pass with the parameters and their gradients in `regions` (and the
    /// caller's `input`, as for [`CudaNet::backward_from`]), calling `reduce(regions, bucket,
    /// stream)` for each bucket as soon as the steps that write its gradients are enqueued on
    /// `stream` (`schedule`, from [`crate::net::grad_schedule`] for the regions' plan): the
    /// data-parallel step enqueues the bucket's sum on another stream, after `stream`'s work so
    /// far, and it runs while the backward of the shallower layers does.
    ///
    /// # Errors
    /// As [`CudaNet::backward_with`]; `reduce`'s error; a schedule for another network.
    pub fn backward_overlapped(
        &mut self,
        regions: &mut CudaRegions,
        input: Option<&mut CudaSlice<f16>>,
        schedule: &GradSchedule,
        reduce: &mut dyn FnMut(&mut CudaRegions, Bucket, &CudaStream) -> Result<()>,
    ) -> Result<()> {
        if schedule.after.len() != self.net.backward.len() {
            return Err(CudaNetError::Binding(format!(
                "the gradient schedule has {} backward steps, network `{}` has {}",
                schedule.after.len(),
                self.net.spec.name,
                self.net.backward.len()
            )));
        }
        let stream = self.stream.clone();
        for &b in &schedule.before {
            reduce(regions, b, &stream)?;
        }
        {
            let mut pass = self.pass(Some(&mut *regions), input)?;
            run_pass_observed(
                &mut pass,
                Pass::Backward,
                &mut |pass: &mut CudaNetPass<'_>, i| {
                    let regions = pass.regions.as_deref_mut().ok_or_else(|| {
                        CudaNetError::Binding("the pass has no amp regions".into())
                    })?;
                    for &b in &schedule.after[i] {
                        reduce(regions, b, &stream)?;
                    }
                    Ok(())
                },
            )?;
        }
        self.after_pass(regions)
    }

    /// The forward pass reading the caller's `input` (NHWC FP16, at least the network's input
    /// size) instead of the network's own input buffer, borrowed for the pass; the parameters
    /// in `regions` when given (as for [`CudaNet::forward_with`]).
    pub fn forward_from(
        &mut self,
        regions: Option<&mut CudaRegions>,
        input: &mut CudaSlice<f16>,
    ) -> Result<()> {
        self.run(regions, Some(input), Pass::Forward)
    }

    /// The backward pass of a forward pass made with [`CudaNet::forward_from`]: the first
    /// layer's weight gradient reads the same `input` again.
    pub fn backward_from(
        &mut self,
        regions: Option<&mut CudaRegions>,
        input: &mut CudaSlice<f16>,
    ) -> Result<()> {
        self.run(regions, Some(input), Pass::Backward)
    }

    /// One pass, then [`CudaNet::after_pass`] with the regions when given.
    fn run(
        &mut self,
        mut regions: Option<&mut CudaRegions>,
        input: Option<&mut CudaSlice<f16>>,
        pass: Pass,
    ) -> Result<()> {
        run_pass(&mut self.pass(regions.as_deref_mut(), input)?, pass)?;
        match regions {
            Some(r) => self.after_pass(r),
            None => Ok(()),
        }
    }

    /// A pass with the parameters in `regions`, reading the caller's `input` (as for
    /// [`CudaNet::forward_from`]): the executor [`run_pass`] walks. Follow it with
    /// [`CudaNet::after_pass`].
    pub(crate) fn pass_on<'n>(
        &'n mut self,
        regions: &'n mut CudaRegions,
        input: &'n mut CudaSlice<f16>,
    ) -> Result<CudaNetPass<'n>> {
        self.pass(Some(regions), Some(input))
    }

    /// After a pass with `regions`: with the regions on a stream of their own (an update
    /// stream beside the compute stream), that stream waits for the pass (a CUDA event), so
    /// the amp step enqueued there reads finished gradients.
    pub(crate) fn after_pass(&self, regions: &CudaRegions) -> Result<()> {
        if !Arc::ptr_eq(regions.stream(), &self.stream) {
            regions
                .stream()
                .join(&self.stream)
                .map_err(|e| driver("order the amp stream after the pass".into(), e))?;
        }
        Ok(())
    }

    /// Sets the running variances that live in the tensor arena to 1, as every framework
    /// (and the CPU executor) starts them.
    fn init_arena(&mut self, regions: &mut CudaRegions) -> Result<()> {
        let stream = self.stream.clone();
        for (id, b) in self.net.buffers.iter().enumerate() {
            let Some((Home::Tensors, offset, len)) = self.slots[id] else {
                continue;
            };
            if !b.name.ends_with(".running_var") {
                continue;
            }
            let arena = regions.tensor_arena_mut().ok_or_else(|| {
                CudaNetError::Binding("the amp regions have no tensor arena".into())
            })?;
            let ones: Vec<u8> = (0..b.elems).flat_map(|_| 1f32.to_le_bytes()).collect();
            let mut view = arena.slice_mut(offset..offset + len);
            stream
                .memcpy_htod(&ones, &mut view)
                .map_err(|e| driver(format!("initialize `{}`", b.name), e))?;
        }
        self.arena_ready = true;
        Ok(())
    }

    fn pass<'n>(
        &'n mut self,
        mut regions: Option<&'n mut CudaRegions>,
        input: Option<&'n mut CudaSlice<f16>>,
    ) -> Result<CudaNetPass<'n>> {
        match (&self.amp_plan, &regions) {
            (None, None) => {}
            (Some(plan), Some(r)) => {
                if !(Arc::ptr_eq(plan, r.plan_arc()) || **plan == **r.plan_arc()) {
                    return Err(CudaNetError::Binding(
                        "the amp regions are not of the memory plan this network was made with"
                            .into(),
                    ));
                }
                if !Arc::ptr_eq(r.stream(), &self.stream) {
                    if !Arc::ptr_eq(r.stream().context(), self.stream.context()) {
                        return Err(CudaNetError::Binding(
                            "the amp regions are on another CUDA context than the network's handle"
                                .into(),
                        ));
                    }
                    // An update stream beside the compute stream: the pass waits for the amp
                    // work enqueued there so far (zeroed gradients, updated weights).
                    self.stream
                        .join(r.stream())
                        .map_err(|e| driver("order the pass after the amp stream".into(), e))?;
                }
            }
            (Some(_), None) => {
                return Err(CudaNetError::Binding(
                    "the parameters live in amp regions: run the pass with them \
                     (`forward_with` / `backward_with`)"
                        .into(),
                ))
            }
            (None, Some(_)) => {
                return Err(CudaNetError::Binding(
                    "the parameters are the network's own: run `forward` / `backward`".into(),
                ))
            }
        }
        if let Some(r) = regions.as_deref_mut() {
            if !self.arena_ready {
                self.init_arena(r)?;
            }
        }
        if let Some(x) = &input {
            let b = &self.net.buffers[self.net.input];
            if x.len() < b.elems {
                return Err(CudaNetError::Binding(format!(
                    "the input has {} FP16 values, the network reads {}",
                    x.len(),
                    b.elems
                )));
            }
        }
        Ok(CudaNetPass {
            net: self,
            regions,
            input,
        })
    }

    /// One layer's table: this layer's buffers and the previous layer's that it binds, each
    /// network allocation or amp region borrowed once.
    pub(super) fn layer_pass(
        &mut self,
        regions: Option<&mut CudaRegions>,
        input: Option<&mut CudaSlice<f16>>,
        layer: usize,
        pass: Pass,
    ) -> Result<()> {
        let l = &self.net.layers[layer];
        let wanted = layer_bindings(&self.net, layer)?;
        let mut io = DeviceBuffers::new();
        let mut arenas: HashMap<BufId, ArenaId> = HashMap::new();
        let input_id = self.net.input;
        if let Some(x) = input {
            if wanted.iter().any(|w| w.2 == input_id) {
                arenas.insert(input_id, io.arena(x));
            }
        }
        for (id, slot) in self.bufs.iter_mut().enumerate() {
            if let Some(slice) = slot {
                if !arenas.contains_key(&id) && wanted.iter().any(|w| w.2 == id) {
                    arenas.insert(id, io.arena(slice));
                }
            }
        }
        let mut region_arenas: HashMap<Home, ArenaId> = HashMap::new();
        if let Some(regions) = regions {
            let (slices, tensors) = regions.regions_and_tensors_mut();
            let homes = slices
                .into_iter()
                .map(|(r, s)| (Home::Region(r), s))
                .chain(tensors.map(|s| (Home::Tensors, s)));
            for (home, slice) in homes {
                let used = wanted
                    .iter()
                    .any(|w| self.slots[w.2].is_some_and(|s| s.0 == home));
                if used {
                    region_arenas.insert(home, io.arena(slice));
                }
            }
        }
        for (side, name, id) in wanted {
            let b = &self.net.buffers[id];
            let bytes = b.elems * b.dtype.size();
            let (arena, offset) = match (arenas.get(&id), self.slots[id]) {
                (Some(&a), _) => (a, 0),
                (None, Some((home, offset, _))) => {
                    let a = region_arenas.get(&home).copied().ok_or_else(|| {
                        CudaNetError::Binding(format!("the amp memory of `{}` is absent", b.name))
                    })?;
                    (a, offset)
                }
                (None, None) => {
                    return Err(CudaNetError::Binding(format!(
                        "network buffer `{}` has neither an allocation nor an amp slot",
                        b.name
                    )))
                }
            };
            io.place(side, name, arena, offset, bytes, b.dtype)?;
        }
        match &mut self.bn_sync {
            Some(sync) => l
                .layer
                .run_gpu_synced(pass, &self.handle, &mut io, sync.0.as_mut())?,
            None => l.layer.run_gpu(pass, &self.handle, &mut io)?,
        }
        Ok(())
    }
}

/// Allocates one network buffer (zeroed; a running variance at 1, as in every framework and
/// the CPU executor).
fn alloc_buffer(stream: &Arc<CudaStream>, b: &NetBuffer) -> Result<CudaSlice<u8>> {
    let bytes = b.elems * b.dtype.size();
    let mut slice = stream
        .alloc_zeros::<u8>(bytes.max(1))
        .map_err(|e| driver(format!("allocate `{}`", b.name), e))?;
    if b.name.ends_with(".running_var") {
        let ones: Vec<u8> = (0..b.elems).flat_map(|_| 1f32.to_le_bytes()).collect();
        stream
            .memcpy_htod(&ones, &mut slice)
            .map_err(|e| driver(format!("initialize `{}`", b.name), e))?;
    }
    Ok(slice)
}
