//! The CUDA executor of a compiled network: one device allocation per network buffer (or a
//! parameter's slot in the amp regions), each layer's binding table over them, layers on their
//! cuDNN plans and the gradient joins on amp's `add_f16` kernel, all on the handle's stream.
//!
//! # Recipe
//! 1. Compile with a planned [`RoutePolicy`](super::RoutePolicy) on the device's target.
//! 2. [`CudaNet::new`] with the handle, the amp kernels and, for training, the amp regions
//!    that hold the parameters (`None`: the parameters get allocations of their own).
//! 3. [`CudaNet::upload`] the input (and parameters when they are its own), then
//!    [`CudaNet::forward`]; write the output's gradient and [`CudaNet::backward`].
//!
//! The stem's max-pool runs on amp's pool kernels (`amp_pool.cu`, the same choice rule as the
//! CPU executor).

use super::compile::{BufId, BufferRole, CompiledNet, NetBuffer};
use super::exec::{run_pass, NetExecutor};
use super::spec::PoolSpec;
use crate::amp::cuda::cudarc::driver::DevicePtr;
use crate::amp::cuda::{
    check_device_memory, AmpKernels, CudaRegions, CudaSlice, CudaStream, DevRange, DevRangeMut,
};
use crate::amp::plan::{Dtype, Region};
use crate::amp::range::PoolShape;
use crate::amp::AmpError;
use cudnn_cbr_fusion::cbr::{DeviceBuffer, DeviceBuffers, Pass};
use cudnn_cbr_fusion::exec::Handle;
use cudnn_cbr_fusion::graph::DataType;
use cudnn_cbr_fusion::reference::Nhwc;
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
#[derive(Debug)]
pub struct CudaNet {
    net: CompiledNet,
    /// Each network buffer's own allocation (`None`: a parameter slot in the amp regions).
    bufs: Vec<Option<CudaSlice<u8>>>,
    /// Each layer's binding table, by its buffer names.
    tables: Vec<DeviceBuffers>,
    handle: Arc<Handle>,
    stream: Arc<CudaStream>,
    kernels: Arc<AmpKernels>,
}

impl CudaNet {
    /// Allocates every buffer of `net` on the handle's stream (zeroed; running variances at 1)
    /// and builds each layer's binding table; with `regions`, the parameters and their
    /// gradients are the regions' slots instead. Reserves the largest workspace any plan needs.
    ///
    /// # Errors
    /// [`AmpError::OutOfMemory`] (checked first) when the buffers exceed the device's free
    /// memory; a binding that does not fit; a driver error.
    pub fn new(
        net: CompiledNet,
        handle: Arc<Handle>,
        kernels: Arc<AmpKernels>,
        regions: Option<&CudaRegions>,
    ) -> Result<Self> {
        let stream = handle.stream().clone();
        let workspace = net.layers.iter().map(|l| l.layer.workspace_size()).max();
        handle.reserve_workspace(workspace.unwrap_or(0))?;
        let sources = binding_plan(&net, regions.is_some())?;
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
        let mut devs = Vec::with_capacity(net.buffers.len());
        for (b, source) in net.buffers.iter().zip(&sources) {
            let bytes = b.elems * b.dtype.size();
            let (slice, dev) = match (source, regions) {
                (Source::Param { key, region }, Some(regions)) => {
                    let p = regions.param(key, *region)?;
                    let dev = DeviceBuffer {
                        ptr: p.ptr,
                        bytes: p.len_bytes,
                        dtype: data_type(p.dtype),
                    };
                    (None, dev)
                }
                _ => {
                    let mut slice = stream
                        .alloc_zeros::<u8>(bytes.max(1))
                        .map_err(|e| driver(format!("allocate `{}`", b.name), e))?;
                    if b.name.ends_with(".running_var") {
                        // Running variance starts at 1, as in every framework (and the CPU
                        // executor).
                        let ones: Vec<u8> = (0..b.elems).flat_map(|_| 1f32.to_le_bytes()).collect();
                        stream
                            .memcpy_htod(&ones, &mut slice)
                            .map_err(|e| driver(format!("initialize `{}`", b.name), e))?;
                    }
                    let ptr = {
                        let (ptr, _sync) = slice.device_ptr(&stream);
                        ptr
                    };
                    let dev = DeviceBuffer {
                        ptr,
                        bytes,
                        dtype: b.dtype,
                    };
                    (Some(slice), dev)
                }
            };
            check_binding(b, dev.bytes, dev.dtype)?;
            bufs.push(slice);
            devs.push(dev);
        }
        let tables = net
            .layers
            .iter()
            .map(|l| {
                let mut t = DeviceBuffers::new();
                for (&name, &id) in &l.table {
                    t.insert_raw(name, devs[id]);
                }
                t
            })
            .collect();
        Ok(CudaNet {
            net,
            bufs,
            tables,
            handle,
            stream,
            kernels,
        })
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

    /// The forward pass (the input uploaded); the output in [`CompiledNet::output`].
    pub fn forward(&mut self) -> Result<()> {
        run_pass(self, false)
    }

    /// The backward pass (the output's gradient written).
    pub fn backward(&mut self) -> Result<()> {
        run_pass(self, true)
    }
}

impl NetExecutor for CudaNet {
    type Error = CudaNetError;

    fn compiled(&self) -> &CompiledNet {
        &self.net
    }

    fn layer_pass(&mut self, layer: usize, pass: Pass) -> Result<()> {
        let l = &self.net.layers[layer];
        let prev = l.prev.map(|p| &self.tables[p]);
        Ok(l.layer
            .run_gpu(pass, &self.handle, &self.tables[layer], prev)?)
    }

    fn add(&mut self, a: BufId, b: BufId, out: BufId) -> Result<()> {
        self.write_into(out, &[a, b], |net, o| {
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
        self.write_into(output, &[input], |net, y| {
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
        self.write_into(grad_input, &[input, grad_output], |net, dx| {
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
