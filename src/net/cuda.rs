//! The CUDA executor of a compiled network: one device allocation per network buffer (or a
//! parameter's slot in the amp regions), each layer's table built per pass over borrowed
//! memory (no address is kept), layers on their cuDNN plans and the gradient joins on amp's
//! `add_f16` kernel, all on the handle's stream.
//!
//! # Recipe
//! 1. Compile with a planned [`RoutePolicy`](super::RoutePolicy) on the device's target.
//! 2. [`CudaNet::new`] with the handle, the amp kernels and, for training, the memory plan
//!    whose regions hold the parameters (`None`: the parameters get allocations of their own).
//!    A layer whose plans were built for another target (a deviceless fixture, another
//!    device or cuDNN) is planned again for the handle's device first ([`replan_for`]),
//!    saying so once on stderr.
//! 3. [`CudaNet::upload`] the input (and parameters when they are its own), then
//!    [`CudaNet::forward`] (or [`CudaNet::forward_with`] the amp regions, borrowed for the
//!    pass); write the output's gradient and [`CudaNet::backward`] (`backward_with`).
//!
//! The stem's max-pool runs on amp's pool kernels (`amp_pool.cu`, the same choice rule as the
//! CPU executor).

use super::buckets::GradSchedule;
use super::compile::{BufId, BufferRole, CompiledNet, NetBuffer};
use super::exec::{run_pass, run_pass_observed, NetExecutor};
use super::spec::PoolSpec;
use crate::amp::cuda::{
    check_device_memory, AmpKernels, CudaRegions, CudaSlice, CudaStream, DevRange, DevRangeMut,
};
use crate::amp::plan::{Bucket, ByteRange, MemoryPlan, Region};
use crate::amp::range::PoolShape;
use crate::amp::AmpError;
use crate::sys::DataType;
use cudnn_cbr_fusion::cache::PlanCache;
use cudnn_cbr_fusion::cbr::{ArenaId, DeviceBnSync, DeviceBuffers, Pass, Side};
use cudnn_cbr_fusion::exec::Handle;
use cudnn_cbr_fusion::reference::Nhwc;
use cudnn_cbr_fusion::Target;
use half::f16;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// What the CUDA executor of a network can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CudaNetError {
    /// A layer's cuDNN plans failed.
    #[error(transparent)]
    Fusion(#[from] cudnn_cbr_fusion::Error),
    /// An amp kernel or region refused.
    #[error(transparent)]
    Amp(#[from] AmpError),
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed while trying to {what}: {message}")]
    Driver {
        /// What the executor was doing.
        what: String,
        /// The driver's error.
        message: String,
    },
    /// A buffer cannot be bound or reached as asked.
    #[error("{0}")]
    Binding(String),
    /// A layer planned for another target could not be planned again for the live device.
    #[error(transparent)]
    Replan(Box<ReplanFailure>),
}

/// Why [`replan_for`] could not plan a layer for the live device (boxed in
/// [`CudaNetError::Replan`]: it is the largest error here).
#[derive(Debug, thiserror::Error)]
#[error("network `{net}`, layer {layer}: planned for {planned_for}; planning its route again for the live device {live} failed: {source}")]
pub struct ReplanFailure {
    /// The network.
    pub net: String,
    /// The layer.
    pub layer: String,
    /// The target identities its plans were built for.
    pub planned_for: String,
    /// The live device's target identity.
    pub live: String,
    /// Why planning failed (compile the network for the live target instead).
    pub source: cudnn_cbr_fusion::Error,
}

fn driver(what: String, e: impl std::fmt::Display) -> CudaNetError {
    CudaNetError::Driver {
        what,
        message: e.to_string(),
    }
}

type Result<T> = std::result::Result<T, CudaNetError>;

/// Where a network buffer lives on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A parameter's slot in an amp region (`<layer>.<suffix>`).
    Param {
        /// The amp parameter.
        key: String,
        /// Its region.
        region: Region,
    },
    /// An allocation of its own.
    Own,
}

/// The amp parameter (`{layer}.{suffix}`) and region a network parameter buffer is bound to:
/// `{layer}.w` → the weight in A, `{layer}.dw` → its slot in G16, `{layer}.gamma`/`beta` → W,
/// `{layer}.dgamma`/`dbeta` → G.
pub fn param_slot(buffer: &str) -> Option<(String, Region)> {
    let (layer, name) = buffer.rsplit_once('.')?;
    let (suffix, region) = match name {
        "w" => ("w", Region::A),
        "dw" => ("w", Region::G16),
        "gamma" => ("gamma", Region::W),
        "beta" => ("beta", Region::W),
        "dgamma" => ("gamma", Region::G),
        "dbeta" => ("beta", Region::G),
        _ => return None,
    };
    Some((format!("{layer}.{suffix}"), region))
}

/// Where each network buffer lives (no device involved): with `amp_params`, parameters and
/// their gradients in the amp regions; everything else (and without it, everything) its own
/// allocation.
///
/// # Errors
/// A parameter buffer whose name maps to no amp parameter.
pub fn binding_plan(net: &CompiledNet, amp_params: bool) -> Result<Vec<Source>> {
    net.buffers
        .iter()
        .map(|b| match b.role {
            BufferRole::Param | BufferRole::ParamGrad if amp_params => param_slot(&b.name)
                .map(|(key, region)| Source::Param { key, region })
                .ok_or_else(|| {
                    CudaNetError::Binding(format!("parameter buffer `{}` has no amp slot", b.name))
                }),
            _ => Ok(Source::Own),
        })
        .collect()
}

/// Where a network buffer lives on the device, given an amp memory plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// An allocation of the network's own.
    Own,
    /// A parameter's (or its gradient's) slot in an amp region.
    Region {
        /// The region.
        region: Region,
        /// Byte offset in it.
        offset: usize,
        /// Bytes of data.
        bytes: usize,
    },
    /// A slot of the plan's tensor arena.
    Tensors {
        /// Byte offset in the arena.
        offset: usize,
        /// Bytes of data.
        bytes: usize,
    },
}

/// Where each buffer of `net` lives (no device involved): with `plan`, parameters and their
/// gradients in its regions and the buffers it registered in its tensor arena; everything
/// else an allocation of the network's own. Each slot is checked to hold its buffer.
///
/// # Errors
/// A parameter buffer without a slot; a slot of the wrong type or too small.
pub fn placement(net: &CompiledNet, plan: Option<&MemoryPlan>) -> Result<Vec<Placement>> {
    let sources = binding_plan(net, plan.is_some())?;
    net.buffers
        .iter()
        .zip(sources)
        .map(|(b, source)| match (source, plan) {
            (Source::Param { key, region }, Some(plan)) => {
                let v = plan.view(&key, region).map_err(AmpError::from)?;
                check_binding(b, v.len_bytes, v.dtype)?;
                Ok(Placement::Region {
                    region,
                    offset: v.offset_bytes,
                    bytes: v.len_bytes,
                })
            }
            (_, Some(plan)) if plan.tensor(&b.name).is_some() => {
                let t = plan.tensor(&b.name).expect("checked in the guard");
                check_binding(b, t.len_bytes(), t.dtype())?;
                Ok(Placement::Tensors {
                    offset: t.offset_bytes(),
                    bytes: t.len_bytes(),
                })
            }
            _ => Ok(Placement::Own),
        })
        .collect()
}

/// A binding's (bytes, type) must cover the buffer's.
pub fn check_binding(buffer: &NetBuffer, bytes: usize, dtype: DataType) -> Result<()> {
    let need = buffer.elems * buffer.dtype.size();
    if dtype != buffer.dtype || bytes < need {
        return Err(CudaNetError::Binding(format!(
            "buffer `{}` needs {need} bytes of {:?}, its binding has {bytes} of {dtype:?}",
            buffer.name, buffer.dtype,
        )));
    }
    Ok(())
}

/// The current running statistics (`{layer}.running_mean`, `{layer}.running_var`).
pub fn running_stats(net: &CompiledNet) -> impl Iterator<Item = BufId> + '_ {
    net.buffers.iter().enumerate().filter_map(|(id, b)| {
        let current = b.name.ends_with(".running_mean") || b.name.ends_with(".running_var");
        (b.role == BufferRole::Running && current).then_some(id)
    })
}

/// The layers of `net` (indices, in forward order) with a plan built for another target than
/// the one whose [`Target::identity`] is `live`: what [`replan_for`] plans again. A layer
/// without plans (made for the CPU executor) is not one of them.
pub fn layers_to_replan(net: &CompiledNet, live: &str) -> Vec<usize> {
    net.layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.layer.plans().any(|(_, p)| p.target_identity() != live))
        .map(|(i, _)| i)
        .collect()
}

/// What [`replan_for`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replanned {
    /// The layers planned again, by name.
    pub layers: Vec<String>,
    /// The target identities their plans had been built for.
    pub planned_for: Vec<String>,
    /// The target they were planned for now.
    pub live: String,
    /// The one-line note naming both.
    pub note: String,
    /// Whether this call printed the note (the first time in this process for these targets).
    pub printed: bool,
}

/// Targets whose re-planning was reported already, as `planned → live`: the note is said once
/// per pair and process, not once per network or layer.
static REPLAN_NOTES: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Records `key` and says whether it is new (the note for it is to be printed).
fn first_time(key: &str) -> bool {
    let mut said = REPLAN_NOTES.lock().unwrap_or_else(|p| p.into_inner());
    said.get_or_insert_with(HashSet::new)
        .insert(key.to_string())
}

/// Plans again, through `cache`, every layer of `net` whose plans were built for another target
/// than `target` ([`layers_to_replan`]), on the same route ([`CbrLayer::replan`]), so no plan
/// made for a fixture (or another device or cuDNN) runs on `target`'s device unchecked. Prints
/// one note on stderr naming the targets, the first time in this process for those targets.
/// `None` when every plan was built for `target`.
///
/// # Errors
/// [`CudaNetError::Replan`] naming the layer whose route has no plan on `target` (the network
/// must then be compiled for it).
///
/// [`CbrLayer::replan`]: cudnn_cbr_fusion::cbr::CbrLayer::replan
pub fn replan_for(
    net: &mut CompiledNet,
    target: &Target,
    cache: &PlanCache,
) -> Result<Option<Replanned>> {
    let live = target.identity();
    let stale = layers_to_replan(net, live);
    if stale.is_empty() {
        return Ok(None);
    }
    let mut planned_for: Vec<String> = Vec::new();
    for &i in &stale {
        for id in net.layers[i].layer.plan_targets() {
            if id != live && !planned_for.iter().any(|p| p == id) {
                planned_for.push(id.to_string());
            }
        }
    }
    let mut layers = Vec::with_capacity(stale.len());
    for &i in &stale {
        let l = &net.layers[i];
        let replanned = l.layer.replan(target, cache).map_err(|source| {
            CudaNetError::Replan(Box::new(ReplanFailure {
                net: net.spec.name.clone(),
                layer: l.name.clone(),
                planned_for: l.layer.plan_targets().join(", "),
                live: live.to_string(),
                source,
            }))
        })?;
        net.layers[i].layer = replanned;
        layers.push(net.layers[i].name.clone());
    }
    let note = format!(
        "note: network `{}`: {} of {} layers were planned for {}, not for the live device {}; planned them again for it",
        net.spec.name,
        stale.len(),
        net.layers.len(),
        planned_for.join(", "),
        live
    );
    let printed = first_time(&format!("{} -> {live}", planned_for.join(", ")));
    if printed {
        eprintln!("{note}");
    }
    Ok(Some(Replanned {
        layers,
        planned_for,
        live: live.to_string(),
        note,
        printed,
    }))
}

/// Where a slot of the amp plan lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Home {
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
    net: CompiledNet,
    /// Each network buffer's own allocation (`None`: a parameter slot in the amp regions).
    bufs: Vec<Option<CudaSlice<u8>>>,
    /// Where each slot in the amp plan lives (offset and bytes in its region or the tensor
    /// arena), by buffer.
    slots: Vec<Option<(Home, usize, usize)>>,
    /// The memory plan the slots belong to.
    amp_plan: Option<Arc<MemoryPlan>>,
    /// Whether the running variances in the tensor arena were set to 1 (on the first pass
    /// with the regions; the arena starts zeroed).
    arena_ready: bool,
    handle: Arc<Handle>,
    stream: Arc<CudaStream>,
    kernels: Arc<AmpKernels>,
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
    /// [`AmpError::OutOfMemory`] (checked first) when the buffers exceed the device's free
    /// memory; a parameter without a slot, or a slot that does not fit; a driver error;
    /// [`CudaNetError::Replan`] for a layer whose route does not plan on the device.
    pub fn new(
        net: CompiledNet,
        handle: Arc<Handle>,
        kernels: Arc<AmpKernels>,
        amp_plan: Option<Arc<MemoryPlan>>,
    ) -> Result<Self> {
        Self::with_cache(net, handle, kernels, amp_plan, &PlanCache::new())
    }

    /// [`CudaNet::new`], planning any layer built for another target again through `cache`
    /// (a persistent cache keeps those plans for the next process).
    ///
    /// # Errors
    /// As [`CudaNet::new`].
    pub fn with_cache(
        mut net: CompiledNet,
        handle: Arc<Handle>,
        kernels: Arc<AmpKernels>,
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

    /// The network it runs.
    pub fn compiled(&self) -> &CompiledNet {
        &self.net
    }

    fn not_own(&self, id: BufId) -> CudaNetError {
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
        mut regions: Option<&mut CudaRegions>,
        input: &mut CudaSlice<f16>,
    ) -> Result<()> {
        run_pass(
            &mut self.pass(regions.as_deref_mut(), Some(input))?,
            Pass::Eval,
        )?;
        if let Some(r) = regions {
            if !Arc::ptr_eq(r.stream(), &self.stream) {
                r.stream()
                    .join(&self.stream)
                    .map_err(|e| driver("order the amp stream after the pass".into(), e))?;
            }
        }
        Ok(())
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
    /// `stream` (`schedule`, from [`super::grad_schedule`] for the regions' plan): the
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
                &mut |pass: &mut NetPass<'_>, i| {
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
        if !Arc::ptr_eq(regions.stream(), &self.stream) {
            regions
                .stream()
                .join(&self.stream)
                .map_err(|e| driver("order the amp stream after the pass".into(), e))?;
        }
        Ok(())
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

    /// One pass; with the regions on a stream of their own (an update stream beside the
    /// compute stream), that stream then waits for the pass (a CUDA event), so the amp step
    /// enqueued there reads finished gradients.
    fn run(
        &mut self,
        mut regions: Option<&mut CudaRegions>,
        input: Option<&mut CudaSlice<f16>>,
        pass: Pass,
    ) -> Result<()> {
        run_pass(&mut self.pass(regions.as_deref_mut(), input)?, pass)?;
        if let Some(r) = regions {
            if !Arc::ptr_eq(r.stream(), &self.stream) {
                r.stream()
                    .join(&self.stream)
                    .map_err(|e| driver("order the amp stream after the pass".into(), e))?;
            }
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
    ) -> Result<NetPass<'n>> {
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
        Ok(NetPass {
            net: self,
            regions,
            input,
        })
    }

    /// One layer's table: this layer's buffers and the previous layer's that it binds, each
    /// network allocation or amp region borrowed once.
    fn layer_pass(
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

/// Whether synchronized BN can run on the GPU for `net` (no device involved): every layer on
/// a route whose BN sums can be reduced between its steps (fused or generic).
///
/// # Errors
/// [`cudnn_cbr_fusion::Error::BnSync`] naming the first layer whose route sums its BN
/// statistics inside one graph (the unfused route's NormForward / NormBackward).
pub fn check_bn_sync(net: &CompiledNet) -> Result<()> {
    for l in &net.layers {
        l.layer.check_gpu_bn_sync().map_err(|e| match e {
            cudnn_cbr_fusion::Error::BnSync(m) => {
                cudnn_cbr_fusion::Error::BnSync(format!("`{}`: {m}", l.name))
            }
            other => other,
        })?;
    }
    Ok(())
}

/// What one layer's pass binds: each of its buffer names (this layer's, and the previous
/// layer's that [`CbrLayer::prev_buffers`](cudnn_cbr_fusion::cbr::CbrLayer::prev_buffers)
/// lists) with the network buffer behind it.
///
/// # Errors
/// A previous-layer buffer the previous layer does not have.
pub fn layer_bindings(net: &CompiledNet, layer: usize) -> Result<Vec<(Side, &'static str, BufId)>> {
    let l = &net.layers[layer];
    let mut wanted: Vec<(Side, &'static str, BufId)> = l
        .table
        .iter()
        .map(|(&n, &id)| (Side::This, n, id))
        .collect();
    if let Some(p) = l.prev {
        let prev_table = &net.layers[p].table;
        for spec in l.layer.prev_buffers() {
            let id = *prev_table.get(spec.name).ok_or_else(|| {
                CudaNetError::Binding(format!(
                    "layer `{}` reads `{}` of layer `{}`, which has no such buffer",
                    l.name, spec.name, net.layers[p].name
                ))
            })?;
            wanted.push((Side::Prev, spec.name, id));
        }
    }
    Ok(wanted)
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

/// A network with the amp regions (if its parameters are there) borrowed for one pass.
struct NetPass<'n> {
    net: &'n mut CudaNet,
    regions: Option<&'n mut CudaRegions>,
    /// The caller's input, read instead of the network's own input buffer.
    input: Option<&'n mut CudaSlice<f16>>,
}

impl NetExecutor for NetPass<'_> {
    type Error = CudaNetError;

    fn compiled(&self) -> &CompiledNet {
        &self.net.net
    }

    fn layer_pass(&mut self, layer: usize, pass: Pass) -> Result<()> {
        self.net.layer_pass(
            self.regions.as_deref_mut(),
            self.input.as_deref_mut(),
            layer,
            pass,
        )
    }

    fn add(&mut self, a: BufId, b: BufId, out: BufId) -> Result<()> {
        self.with_io(out, &[a, b], |k, stream, ins, o| {
            let [a, b] = two(ins)?;
            Ok(k.add_f16(stream, a, b, o)?)
        })
    }

    fn max_pool(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        output: BufId,
    ) -> Result<()> {
        let p = pool_shape(pool, shape);
        self.with_io(output, &[input], |k, stream, ins, y| {
            let x = ins.into_iter().next().expect("one input given");
            Ok(k.max_pool_forward(stream, &p, x, y)?)
        })
    }

    fn max_pool_backward(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        grad_output: BufId,
        grad_input: BufId,
    ) -> Result<()> {
        let p = pool_shape(pool, shape);
        self.with_io(grad_input, &[input, grad_output], |k, stream, ins, dx| {
            let [x, dy] = two(ins)?;
            Ok(k.max_pool_backward(stream, &p, x, dy, dx)?)
        })
    }
}

/// Two kernel inputs out of a list of two.
fn two(ins: Vec<DevRange<'_>>) -> Result<[DevRange<'_>; 2]> {
    <[DevRange<'_>; 2]>::try_from(ins)
        .map_err(|v| CudaNetError::Binding(format!("a step has {} inputs, expected 2", v.len())))
}

impl NetPass<'_> {
    /// Runs `f` with `out` writable and `inputs` readable, each the network's own allocation
    /// or a slot of the amp plan's tensor arena (the output's slot split off the arena, so the
    /// inputs around it stay readable). `out` must be none of `inputs`.
    fn with_io(
        &mut self,
        out: BufId,
        inputs: &[BufId],
        f: impl FnOnce(&AmpKernels, &CudaStream, Vec<DevRange<'_>>, DevRangeMut<'_>) -> Result<()>,
    ) -> Result<()> {
        let net = &mut *self.net;
        if inputs.contains(&out) {
            return Err(CudaNetError::Binding(format!(
                "a step writes `{}`, which it also reads",
                net.net.buffers[out].name
            )));
        }
        let (kernels, stream) = (net.kernels.clone(), net.stream.clone());
        let arena = self
            .regions
            .as_deref_mut()
            .and_then(|r| r.tensor_arena_mut());
        let absent = |id: BufId| {
            CudaNetError::Binding(format!(
                "`{}` lives in the amp plan's tensor arena: run the pass with the regions",
                net.net.buffers[id].name
            ))
        };
        if let Some((Home::Tensors, start, len)) = net.slots[out] {
            let arena = arena.ok_or_else(|| absent(out))?;
            let (left, mut rest) = arena.split_at_mut(start);
            let (mut mid, right) = rest.split_at_mut(len);
            let mut ins = Vec::with_capacity(inputs.len());
            for &i in inputs {
                ins.push(match net.slots[i] {
                    Some((Home::Tensors, o, l)) if o + l <= start => {
                        DevRange::new(&left, ByteRange::new(o, o + l))?
                    }
                    Some((Home::Tensors, o, l)) if o >= start + len => {
                        let at = o - start - len;
                        DevRange::new(&right, ByteRange::new(at, at + l))?
                    }
                    Some(_) => {
                        return Err(CudaNetError::Binding(format!(
                            "`{}` overlaps the output `{}`",
                            net.net.buffers[i].name, net.net.buffers[out].name
                        )))
                    }
                    None => DevRange::whole(net.bufs[i].as_ref().ok_or_else(|| absent(i))?),
                });
            }
            return f(&kernels, &stream, ins, DevRangeMut::whole(&mut mid));
        }
        let mut o = net.bufs[out].take().ok_or_else(|| net.not_own(out))?;
        let done = own_output(net, arena.as_deref(), inputs, |ins| {
            f(&kernels, &stream, ins, DevRangeMut::whole(&mut o))
        });
        net.bufs[out] = Some(o);
        done
    }
}

/// The inputs of a step whose output is an allocation of the network's own (taken out of
/// `net` for the call): each an allocation or a slot of the tensor arena.
fn own_output(
    net: &CudaNet,
    arena: Option<&CudaSlice<u8>>,
    inputs: &[BufId],
    f: impl FnOnce(Vec<DevRange<'_>>) -> Result<()>,
) -> Result<()> {
    let mut ins = Vec::with_capacity(inputs.len());
    for &i in inputs {
        ins.push(match (net.slots[i], arena) {
            (Some((Home::Tensors, o, l)), Some(a)) => DevRange::new(a, ByteRange::new(o, o + l))?,
            _ => DevRange::whole(net.bufs[i].as_ref().ok_or_else(|| net.not_own(i))?),
        });
    }
    f(ins)
}

/// The amp kernels' pool shape of a compiled max-pool step.
fn pool_shape(pool: &PoolSpec, shape: &Nhwc) -> PoolShape {
    PoolShape {
        batch: shape.n,
        h: shape.h,
        w: shape.w,
        channels: shape.c,
        kernel: pool.kernel,
        stride: pool.stride,
        pad: pool.pad,
    }
}
