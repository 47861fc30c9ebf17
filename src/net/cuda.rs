//! The CUDA executor of a compiled network: one device allocation per network buffer (or a
//! parameter's slot in the amp regions), each layer's table built per pass over borrowed
//! memory (no address is kept), layers on their cuDNN plans and the gradient joins on amp's
//! `add_f16` kernel, all on the handle's stream.
//!
//! # Recipe
//! 1. Compile with a planned [`RoutePolicy`](super::RoutePolicy) on the device's target.
//! 2. [`CudaNet::new`] with the handle, the amp kernels and, for training, the memory plan
//!    whose regions hold the parameters (`None`: the parameters get allocations of their own).
//! 3. [`CudaNet::upload`] the input (and parameters when they are its own), then
//!    [`CudaNet::forward`] (or [`CudaNet::forward_with`] the amp regions, borrowed for the
//!    pass); write the output's gradient and [`CudaNet::backward`] (`backward_with`).
//!
//! The stem's max-pool runs on amp's pool kernels (`amp_pool.cu`, the same choice rule as the
//! CPU executor).

use super::compile::{BufId, BufferRole, CompiledNet, NetBuffer};
use super::exec::{run_pass, NetExecutor};
use super::spec::PoolSpec;
use crate::amp::cuda::{
    check_device_memory, AmpKernels, CudaRegions, CudaSlice, CudaStream, DevRange, DevRangeMut,
};
use crate::amp::plan::{Dtype, MemoryPlan, Region};
use crate::amp::range::PoolShape;
use crate::amp::AmpError;
use cudnn_cbr_fusion::cbr::{ArenaId, DeviceBuffers, Pass, Side};
use cudnn_cbr_fusion::exec::Handle;
use cudnn_cbr_fusion::graph::DataType;
use cudnn_cbr_fusion::reference::Nhwc;
use half::f16;
use std::collections::HashMap;
use std::sync::Arc;

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

/// A device buffer's element type as the graphs see it.
pub fn data_type(d: Dtype) -> DataType {
    match d {
        Dtype::F16 => DataType::Half,
        Dtype::F32 => DataType::Float,
    }
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

/// A compiled network on the device.
///
/// It owns the allocations of the activations, their gradients and the BN statistics; the
/// parameters and their gradients are either allocations of its own or slots of the amp
/// regions, which it holds no address of: [`CudaNet::forward_with`] borrows the regions for
/// the pass, so they cannot be freed or changed under it.
#[derive(Debug)]
pub struct CudaNet {
    net: CompiledNet,
    /// Each network buffer's own allocation (`None`: a parameter slot in the amp regions).
    bufs: Vec<Option<CudaSlice<u8>>>,
    /// Where each parameter slot lives (offset and bytes in its region), by buffer.
    slots: Vec<Option<(Region, usize, usize)>>,
    /// The memory plan the parameter slots belong to.
    amp_plan: Option<Arc<MemoryPlan>>,
    handle: Arc<Handle>,
    stream: Arc<CudaStream>,
    kernels: Arc<AmpKernels>,
}

impl CudaNet {
    /// Allocates every buffer of `net` on the handle's stream (zeroed; running variances at 1);
    /// with `amp_plan`, the parameters and their gradients are that plan's slots instead
    /// (checked here: each exists and is large enough). Reserves the largest workspace any
    /// plan needs.
    ///
    /// # Errors
    /// [`AmpError::OutOfMemory`] (checked first) when the buffers exceed the device's free
    /// memory; a parameter without a slot, or a slot that does not fit; a driver error.
    pub fn new(
        net: CompiledNet,
        handle: Arc<Handle>,
        kernels: Arc<AmpKernels>,
        amp_plan: Option<Arc<MemoryPlan>>,
    ) -> Result<Self> {
        let stream = handle.stream().clone();
        let workspace = net.layers.iter().map(|l| l.layer.workspace_size()).max();
        handle.reserve_workspace(workspace.unwrap_or(0))?;
        let sources = binding_plan(&net, amp_plan.is_some())?;
        // Checked before allocating: a network too large for the device is a typed error
        // naming the sizes, not a driver failure halfway through its buffers.
        let need: u128 = net
            .buffers
            .iter()
            .zip(&sources)
            .filter(|(_, s)| matches!(s, Source::Own))
            .map(|(b, _)| (b.elems as u128) * (b.dtype.size() as u128))
            .sum();
        check_device_memory(
            stream.context(),
            &format!("network `{}`'s buffers", net.spec.name),
            need,
        )?;
        let mut bufs = Vec::with_capacity(net.buffers.len());
        let mut slots = Vec::with_capacity(net.buffers.len());
        for (b, source) in net.buffers.iter().zip(&sources) {
            match (source, &amp_plan) {
                (Source::Param { key, region }, Some(plan)) => {
                    let v = plan.view(key, *region).map_err(AmpError::from)?;
                    check_binding(b, v.len_bytes, data_type(v.dtype))?;
                    bufs.push(None);
                    slots.push(Some((*region, v.offset_bytes, v.len_bytes)));
                }
                _ => {
                    bufs.push(Some(alloc_buffer(&stream, b)?));
                    slots.push(None);
                }
            }
        }
        Ok(CudaNet {
            net,
            bufs,
            slots,
            amp_plan,
            handle,
            stream,
            kernels,
        })
    }

    /// The network it runs.
    pub fn compiled(&self) -> &CompiledNet {
        &self.net
    }

    fn not_own(&self, id: BufId) -> CudaNetError {
        CudaNetError::Binding(format!(
            "network buffer `{}` is a parameter slot, not an allocation of its own",
            self.net.buffers[id].name
        ))
    }

    /// Runs `f` with the whole of `out`'s allocation as the output while the executor stays
    /// readable for the inputs (`out` must be none of `inputs`): the slot is taken out for the
    /// call and put back, whatever `f` returns.
    fn write_into(
        &mut self,
        out: BufId,
        inputs: &[BufId],
        f: impl FnOnce(&Self, DevRangeMut<'_>) -> Result<()>,
    ) -> Result<()> {
        if inputs.contains(&out) {
            return Err(CudaNetError::Binding(format!(
                "a step writes `{}`, which it also reads",
                self.net.buffers[out].name
            )));
        }
        let mut o = self.bufs[out].take().ok_or_else(|| self.not_own(out))?;
        let done = f(self, DevRangeMut::whole(&mut o));
        self.bufs[out] = Some(o);
        done
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
        run_pass(&mut self.pass(None, None)?, false)
    }

    /// The backward pass (the output's gradient written) of a network whose parameters are
    /// its own.
    pub fn backward(&mut self) -> Result<()> {
        run_pass(&mut self.pass(None, None)?, true)
    }

    /// The forward pass with the parameters in `regions` (made from the plan given to
    /// [`CudaNet::new`]).
    pub fn forward_with(&mut self, regions: &mut CudaRegions) -> Result<()> {
        run_pass(&mut self.pass(Some(regions), None)?, false)
    }

    /// The backward pass with the parameters and their gradients in `regions`.
    pub fn backward_with(&mut self, regions: &mut CudaRegions) -> Result<()> {
        run_pass(&mut self.pass(Some(regions), None)?, true)
    }

    /// The forward pass reading the caller's `input` (NHWC FP16, at least the network's input
    /// size) instead of the network's own input buffer, borrowed for the pass; the parameters
    /// in `regions` when given (as for [`CudaNet::forward_with`]).
    pub fn forward_from(
        &mut self,
        regions: Option<&mut CudaRegions>,
        input: &mut CudaSlice<f16>,
    ) -> Result<()> {
        run_pass(&mut self.pass(regions, Some(input))?, false)
    }

    /// The backward pass of a forward pass made with [`CudaNet::forward_from`]: the first
    /// layer's weight gradient reads the same `input` again.
    pub fn backward_from(
        &mut self,
        regions: Option<&mut CudaRegions>,
        input: &mut CudaSlice<f16>,
    ) -> Result<()> {
        run_pass(&mut self.pass(regions, Some(input))?, true)
    }

    fn pass<'n>(
        &'n mut self,
        regions: Option<&'n mut CudaRegions>,
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
                    return Err(CudaNetError::Binding(
                        "the amp regions run on another stream than the network's handle".into(),
                    ));
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
        let mut region_arenas: HashMap<Region, ArenaId> = HashMap::new();
        if let Some(regions) = regions {
            for (region, slice) in regions.regions_mut() {
                let used = wanted
                    .iter()
                    .any(|w| self.slots[w.2].is_some_and(|s| s.0 == region));
                if used {
                    region_arenas.insert(region, io.arena(slice));
                }
            }
        }
        for (side, name, id) in wanted {
            let b = &self.net.buffers[id];
            let bytes = b.elems * b.dtype.size();
            let (arena, offset) = match (arenas.get(&id), self.slots[id]) {
                (Some(&a), _) => (a, 0),
                (None, Some((region, offset, _))) => {
                    let a = region_arenas.get(&region).copied().ok_or_else(|| {
                        CudaNetError::Binding(format!("region {region} of `{}` is absent", b.name))
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
        Ok(l.layer.run_gpu(pass, &self.handle, &mut io)?)
    }
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
        self.net.write_into(out, &[a, b], |net, o| {
            Ok(net.kernels.add_f16(
                &net.stream,
                DevRange::whole(net.buffer(a)?),
                DevRange::whole(net.buffer(b)?),
                o,
            )?)
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
        self.net.write_into(output, &[input], |net, y| {
            Ok(net.kernels.max_pool_forward(
                &net.stream,
                &p,
                DevRange::whole(net.buffer(input)?),
                y,
            )?)
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
        self.net
            .write_into(grad_input, &[input, grad_output], |net, dx| {
                Ok(net.kernels.max_pool_backward(
                    &net.stream,
                    &p,
                    DevRange::whole(net.buffer(input)?),
                    DevRange::whole(net.buffer(grad_output)?),
                    dx,
                )?)
            })
    }
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
