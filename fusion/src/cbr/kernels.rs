//! Our own kernels for a layer's element-wise steps: the BN apply with its residual forms,
//! the ReLU backward, the dBN apply, the per-channel statistics of a stored conv output, and
//! a BN backward's weight gradients and dBN-apply coefficients (`kernel_source.cu`).
//!
//! cuDNN runs these as runtime-compiled pointwise graphs: NVRTC once per *shape*, about
//! 0.5–0.9 s each on 2 cores, which is most of a network's cold planning time. Ours take the
//! shape as arguments, so one module is compiled once per *architecture* (and kept in the
//! disk [`crate::kernel_cache`]). They compute what the cuDNN graphs and the CPU reference ops
//! compute, in the same op order with one FP16 rounding per output, and run wherever a
//! planned layer has such a step ([`Pointwise::Own`], the default). [`Pointwise::Cudnn`]
//! (`CUDNN_CBR_POINTWISE=cudnn`) plans cuDNN's graphs instead: the parity reference.

// The thin launch layer: raw device addresses go to our kernels; each call's contract is
// stated where it is made.
#![allow(unsafe_code)]

use super::device_buffers::{DeviceBuffer, Resolved, Side};
use super::graphs::ApplyResidual;
use super::layer::{LayerGraph, Src};
use crate::error::{Error, Result};
use crate::exec::{driver, Handle, Scalar};
use crate::graph::{DataType, Graph, Node, TensorId};
use crate::kernel_cache::{CacheOutcome, KernelCache};
use crate::rtc;
use crate::Target;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

/// The CUDA source of every kernel here.
pub const SOURCE: &str = include_str!("kernel_source.cu");

/// The variable that chooses who runs the element-wise steps ([`Pointwise::from_env`]).
pub const POINTWISE_ENV: &str = "CUDNN_CBR_POINTWISE";

/// Who runs a layer's element-wise steps on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Pointwise {
    /// Our kernels (compiled once per architecture) where a step has one; cuDNN's graphs for
    /// the rest, and for all of them where NVRTC cannot be loaded or the architecture has no
    /// machine-code target here.
    #[default]
    Own,
    /// cuDNN's runtime-compiled graphs everywhere (the parity reference).
    Cudnn,
}

impl Pointwise {
    /// From [`POINTWISE_ENV`]: `cudnn`, or `own` / unset / empty for [`Pointwise::Own`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the variable for any other value.
    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var(POINTWISE_ENV).ok().as_deref())
    }

    /// As [`Pointwise::from_env`], from the variable's value.
    ///
    /// # Errors
    /// As [`Pointwise::from_env`].
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("" | "own") => Ok(Pointwise::Own),
            Some("cudnn") => Ok(Pointwise::Cudnn),
            Some(other) => Err(Error::InvalidConfig {
                layer: "every layer".into(),
                field: POINTWISE_ENV.into(),
                problem: format!("is `{other}`; expected `own` or `cudnn`"),
            }),
        }
    }
}

/// One of our element-wise kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OwnKernel {
    /// `a = relu(y·s + b [+ r | + r·s2 + b2])`: the graphs of [`super::graphs::apply`].
    Apply(ApplyResidual),
    /// `dx = dy` where `x > 0`, else 0: [`super::graphs::relu_backward`].
    ReluBackward,
    /// `dy_prev = dz·A + y_prev·B + C`: [`super::graphs::dbn_apply`].
    DbnApply,
    /// Per-channel `Σy` and `Σy²` in FP32: [`super::graphs::channel_stats`].
    ChannelStats,
    /// A BN's `dγ = Σ dz·x̂` and `dβ = Σ dz` in FP32: [`super::graphs::dbn_reduce`].
    DbnReduce,
    /// The dBN-apply coefficients A, B, C from `dγ`, `dβ`: [`super::graphs::dbn_coefficients`].
    DbnCoefficients,
}

/// A kernel argument: a graph tensor (by name), the element type the kernel reads, and its
/// size: the full tensor, one value per channel, or one by-value FP32 scalar.
struct Param {
    name: &'static str,
    dtype: DataType,
    size: Size,
}

#[derive(Clone, Copy, PartialEq)]
enum Size {
    Full,
    PerChannel,
    Scalar,
}

const fn full(name: &'static str) -> Param {
    Param {
        name,
        dtype: DataType::Half,
        size: Size::Full,
    }
}

const fn vector(name: &'static str, dtype: DataType) -> Param {
    Param {
        name,
        dtype,
        size: Size::PerChannel,
    }
}

const fn scalar(name: &'static str) -> Param {
    Param {
        name,
        dtype: DataType::Float,
        size: Size::Scalar,
    }
}

impl OwnKernel {
    /// Every kernel.
    pub const ALL: [OwnKernel; 8] = [
        OwnKernel::Apply(ApplyResidual::None),
        OwnKernel::Apply(ApplyResidual::Add),
        OwnKernel::Apply(ApplyResidual::DualScaleBias),
        OwnKernel::ReluBackward,
        OwnKernel::DbnApply,
        OwnKernel::ChannelStats,
        OwnKernel::DbnReduce,
        OwnKernel::DbnCoefficients,
    ];

    /// The kernel that computes `graph`, by the graph's name (the builders in
    /// [`super::graphs`] name each form), or `None`.
    pub fn for_graph(graph: &Graph) -> Option<Self> {
        Some(match graph.name() {
            "scale_bias_relu" => OwnKernel::Apply(ApplyResidual::None),
            "scale_bias_add_relu" => OwnKernel::Apply(ApplyResidual::Add),
            "dual_scale_bias_add_relu" => OwnKernel::Apply(ApplyResidual::DualScaleBias),
            "relu_backward" => OwnKernel::ReluBackward,
            "dbn_apply" => OwnKernel::DbnApply,
            "channel_stats" => OwnKernel::ChannelStats,
            "dbn_reduce" => OwnKernel::DbnReduce,
            "dbn_coefficients" => OwnKernel::DbnCoefficients,
            _ => return None,
        })
    }

    /// The kernel's entry point in [`SOURCE`].
    pub fn entry(self) -> &'static str {
        match self {
            OwnKernel::Apply(ApplyResidual::None) => "cbr_apply_relu",
            OwnKernel::Apply(ApplyResidual::Add) => "cbr_apply_add_relu",
            OwnKernel::Apply(ApplyResidual::DualScaleBias) => "cbr_apply_dual_relu",
            OwnKernel::ReluBackward => "cbr_relu_backward",
            OwnKernel::DbnApply => "cbr_dbn_apply",
            OwnKernel::ChannelStats => "cbr_channel_stats",
            OwnKernel::DbnReduce => "cbr_dbn_reduce",
            OwnKernel::DbnCoefficients => "cbr_dbn_coefficients",
        }
    }

    /// The inputs in the kernel's argument order (the output follows them).
    fn params(self) -> &'static [Param] {
        const H: DataType = DataType::Half;
        const F: DataType = DataType::Float;
        const APPLY: &[Param] = &[full("Y"), vector("scale", H), vector("bias", H)];
        const APPLY_ADD: &[Param] = &[full("Y"), full("R"), vector("scale", H), vector("bias", H)];
        const APPLY_DUAL: &[Param] = &[
            full("Y"),
            full("R"),
            vector("scale", H),
            vector("bias", H),
            vector("scale2", H),
            vector("bias2", H),
        ];
        const RELU_BACKWARD: &[Param] = &[full("dA"), full("X")];
        const STATS: &[Param] = &[full("Y")];
        const DBN_REDUCE: &[Param] = &[
            full("Y"),
            full("dZ"),
            vector("mean", F),
            vector("inv_std", F),
        ];
        const DBN_COEFFICIENTS: &[Param] = &[
            vector("gamma", F),
            vector("inv_std", F),
            vector("mean", F),
            vector("dgamma", F),
            vector("dbeta", F),
            scalar("neg_inv_count"),
        ];
        const DBN_APPLY: &[Param] = &[
            full("dZ"),
            full("Yprev"),
            vector("A", F),
            vector("B", F),
            vector("C", F),
        ];
        match self {
            OwnKernel::Apply(ApplyResidual::None) => APPLY,
            OwnKernel::Apply(ApplyResidual::Add) => APPLY_ADD,
            OwnKernel::Apply(ApplyResidual::DualScaleBias) => APPLY_DUAL,
            OwnKernel::ReluBackward => RELU_BACKWARD,
            OwnKernel::DbnApply => DBN_APPLY,
            OwnKernel::ChannelStats => STATS,
            OwnKernel::DbnReduce => DBN_REDUCE,
            OwnKernel::DbnCoefficients => DBN_COEFFICIENTS,
        }
    }
}

/// The shared memory a block of the statistics kernel may use (the default per-block limit).
const STATS_SHARED_LIMIT: usize = 48 * 1024;

/// One argument of a planned kernel step.
#[derive(Debug, Clone, PartialEq)]
struct Arg {
    src: Src,
    dtype: DataType,
    elems: usize,
}

/// A layer step our kernel runs: the kernel, where each argument comes from, the tensor size.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelStep {
    kernel: OwnKernel,
    arch: &'static str,
    /// Inputs in argument order, then the output.
    args: Vec<Arg>,
    elems: u64,
    channels: u32,
}

impl KernelStep {
    /// The step for `lg` when one of our kernels computes its graph with the element types
    /// it was written for, else `None` (cuDNN plans it). `arch` is what the kernels are
    /// compiled for ([`prepare`]).
    pub fn for_graph(lg: &LayerGraph, arch: &'static str) -> Option<Self> {
        let kernel = OwnKernel::for_graph(&lg.graph)?;
        let g = &lg.graph;
        let src_of = |t: TensorId| lg.bindings.iter().find(|(b, _)| *b == t).map(|(_, s)| *s);
        let elems_of = |t: TensorId| {
            g.get(t)
                .and_then(|a| usize::try_from(a.dims.iter().product::<i64>()).ok())
        };
        let mut args = Vec::new();
        let mut inputs = Vec::new();
        for p in kernel.params() {
            let t = g
                .tensors()
                .iter()
                .position(|a| a.name == p.name && !a.is_virtual)
                .map(|i| TensorId(i as u32))?;
            if g.dtype(t)? != p.dtype {
                return None;
            }
            inputs.push(t);
            args.push(Arg {
                src: src_of(t)?,
                dtype: p.dtype,
                elems: if p.size == Size::Scalar {
                    1
                } else {
                    elems_of(t)?
                },
            });
        }
        // Sizes come from the first input, a full tensor in every kernel.
        let dims = &g.get(*inputs.first()?)?.dims;
        let elems = elems_of(inputs[0])?;
        let channels = u32::try_from(*dims.get(1)?).ok().filter(|&c| c > 0)?;
        let per_channel = channels as usize;
        let sizes_agree = args.iter().zip(kernel.params()).all(|(a, p)| match p.size {
            Size::Full => a.elems == elems,
            Size::PerChannel => a.elems == per_channel,
            Size::Scalar => matches!(a.src, Src::Scalar(Scalar::F32(_))),
        });
        // The outputs, in argument order: for the statistics Σy then Σy² (the reduction that
        // reads Y itself comes first); for the dBN reduction dγ then dβ (the reduction that
        // reads dZ itself is dβ); for the coefficients A, B, C as the layer binds them; all
        // FP32 per channel. Otherwise the one bound tensor that is not an input, FP16 like the
        // inputs.
        let reductions: Vec<(TensorId, TensorId)> = g
            .nodes()
            .iter()
            .filter_map(|n| match n {
                Node::Reduction { x, y, .. } => Some((*x, *y)),
                _ => None,
            })
            .collect();
        let vector_out = |t: TensorId| (t, DataType::Float, per_channel);
        let outputs: Vec<(TensorId, DataType, usize)> = match kernel {
            OwnKernel::ChannelStats | OwnKernel::DbnReduce => {
                // The reduction of an input itself: Σy (statistics) or Σdz = dβ (dBN).
                let direct = if kernel == OwnKernel::ChannelStats {
                    inputs[0]
                } else {
                    inputs[1]
                };
                let own = reductions.iter().find(|(x, _)| *x == direct)?.1;
                let other = reductions.iter().find(|(x, _)| *x != direct)?.1;
                // Two FP32 accumulators per channel in a block's shared memory.
                if reductions.len() != 2 || per_channel * 8 > STATS_SHARED_LIMIT {
                    return None;
                }
                if kernel == OwnKernel::ChannelStats {
                    vec![vector_out(own), vector_out(other)]
                } else {
                    vec![vector_out(other), vector_out(own)]
                }
            }
            OwnKernel::DbnCoefficients => lg
                .bindings
                .iter()
                .filter(|(t, _)| !inputs.contains(t))
                .map(|(t, _)| vector_out(*t))
                .collect(),
            _ => {
                let mut rest = lg.bindings.iter().filter(|(t, _)| !inputs.contains(t));
                let (out, _) = *rest.next()?;
                vec![(out, DataType::Half, elems)]
            }
        };
        if !sizes_agree || lg.bindings.len() != inputs.len() + outputs.len() {
            return None;
        }
        for (t, dtype, n) in outputs {
            if g.dtype(t)? != dtype || elems_of(t)? != n {
                return None;
            }
            args.push(Arg {
                src: src_of(t)?,
                dtype,
                elems: n,
            });
        }
        Some(KernelStep {
            kernel,
            arch,
            args,
            elems: elems as u64,
            channels,
        })
    }

    /// The kernel.
    pub fn kernel(&self) -> OwnKernel {
        self.kernel
    }

    /// Where each argument comes from, in the kernel's order: its inputs (buffers and by-value
    /// scalars), then its outputs.
    pub fn sources(&self) -> Vec<Src> {
        self.args.iter().map(|a| a.src).collect()
    }

    /// The architecture its machine code was compiled for (`sm_90`…).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Enqueues the kernel on the handle's stream over the resolved buffers, after checking
    /// each one (present, element type, size).
    pub(crate) fn launch(&self, handle: &Handle, r: &Resolved<'_>) -> Result<()> {
        let stream = handle.stream();
        let loaded = Loaded::for_context(stream.context(), self.arch)?;
        let f = loaded
            .functions
            .get(self.kernel.entry())
            .ok_or_else(|| kernel_error(self.kernel, "is not in the loaded module".into()))?;
        let mut values = Vec::with_capacity(self.args.len());
        for a in &self.args {
            let (side, name) = match a.src {
                Src::This(n) => (Side::This, n),
                Src::Prev(n) => (Side::Prev, n),
                Src::Scalar(Scalar::F32(v)) => {
                    values.push(Value::F32(v));
                    continue;
                }
                Src::Scalar(other) => {
                    return Err(kernel_error(
                        self.kernel,
                        format!("takes FP32 scalars, got {other:?}"),
                    ))
                }
            };
            let buf = r.get(side, name)?;
            let shown = || match side {
                Side::This => name.to_string(),
                Side::Prev => format!("prev.{name}"),
            };
            if buf.dtype != a.dtype {
                return Err(Error::Buffer {
                    name: shown(),
                    problem: format!(
                        "is {}; kernel {} reads {}",
                        buf.dtype,
                        self.kernel.entry(),
                        a.dtype
                    ),
                });
            }
            let need = a.elems * a.dtype.size();
            if buf.bytes < need {
                return Err(Error::Buffer {
                    name: shown(),
                    problem: format!(
                        "has {} bytes; kernel {} needs {need}",
                        buf.bytes,
                        self.kernel.entry()
                    ),
                });
            }
            values.push(Value::Ptr(buf.ptr));
        }
        enqueue(
            self.kernel,
            &loaded,
            stream,
            f,
            &values,
            self.elems,
            self.channels,
        )
    }
}

/// Enqueues `kernel` (`f`, from `loaded`) on `stream` with `values` (addresses checked by the
/// caller to hold what the kernel touches), over `elems` elements of `channels` channels.
fn enqueue(
    kernel: OwnKernel,
    loaded: &Loaded,
    stream: &CudaStream,
    f: &CudaFunction,
    values: &[Value],
    elems: u64,
    channels: u32,
) -> Result<()> {
    {
        if elems == 0 {
            return Ok(());
        }
        // Eight elements per 16-byte access when each access stays in one channel run and
        // every address is aligned to it.
        let stats = matches!(kernel, OwnKernel::ChannelStats | OwnKernel::DbnReduce);
        let aligned = values
            .iter()
            .all(|v| !matches!(v, Value::Ptr(p) if p % 16 != 0));
        let vec = !stats && channels % 8 == 0 && aligned;
        let work = if vec { elems / 8 } else { elems };
        const THREADS: u32 = 256;
        // The statistics flush 2·c atomics per block: fewer, fuller blocks.
        let per_sm = if stats { 2 } else { 8 };
        let blocks = work
            .div_ceil(u64::from(THREADS))
            .clamp(1, u64::from(loaded.sms) * per_sm) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: if stats { 8 * channels } else { 0 },
        };
        let vec = i32::from(vec);
        let mut b = stream.launch_builder(f);
        for v in values {
            match v {
                Value::Ptr(p) => b.arg(p),
                Value::F32(x) => b.arg(x),
            };
        }
        b.arg(&elems).arg(&channels).arg(&vec);
        // The arguments are a device address per tensor argument or an f32 per scalar, in the
        // order of `params` and the outputs, then n: u64, c: u32, vec: i32: the kernel's
        // parameters in order and type. Every address is memory the resolved table borrows for
        // this pass, with at least the bytes the kernel touches (checked above).
        // SAFETY: arguments as above; the launch is ordered on the handle's stream.
        unsafe { b.launch(cfg) }.map_err(|e| driver(&format!("launch {}", kernel.entry()), e))?;
        Ok(())
    }
}

/// Enqueues `cbr_dbn_coefficients` on the handle's stream over explicit buffers: `inputs`
/// γ, 1/σ, μ, dγ, dβ and `neg_inv_count`, into `outputs` A, B, C, `channels` FP32 values
/// each (synchronized BN's recomputation from the summed dγ and dβ). The module is the one
/// compiled for the device's architecture.
///
/// # Errors
/// [`Error::Buffer`] for a buffer that is not FP32 or too short; [`Error::Kernel`] when the
/// module cannot be compiled or loaded.
pub(crate) fn launch_dbn_coefficients(
    handle: &Handle,
    inputs: [DeviceBuffer; 5],
    neg_inv_count: f32,
    outputs: [DeviceBuffer; 3],
    channels: usize,
) -> Result<()> {
    const NAMES: [&str; 8] = ["gamma", "inv_std", "mean", "dgamma", "dbeta", "A", "B", "C"];
    let kernel = OwnKernel::DbnCoefficients;
    let c = u32::try_from(channels)
        .map_err(|_| kernel_error(kernel, format!("{channels} channels")))?;
    let mut values = Vec::with_capacity(9);
    for (i, buf) in inputs.iter().chain(&outputs).enumerate() {
        if buf.dtype != DataType::Float || buf.bytes < 4 * channels {
            return Err(Error::Buffer {
                name: NAMES[i].into(),
                problem: format!(
                    "has {} bytes of {}; kernel {} needs {channels} FP32 values",
                    buf.bytes,
                    buf.dtype,
                    kernel.entry()
                ),
            });
        }
        values.push(Value::Ptr(buf.ptr));
        if i == 4 {
            values.push(Value::F32(neg_inv_count));
        }
    }
    let stream = handle.stream();
    let loaded = Loaded::load(stream.context())?;
    let f = loaded
        .functions
        .get(kernel.entry())
        .ok_or_else(|| kernel_error(kernel, "is not in the loaded module".into()))?;
    enqueue(kernel, &loaded, stream, f, &values, c.into(), c)
}

/// A launch argument, in order.
enum Value {
    Ptr(u64),
    F32(f32),
}

fn kernel_error(kernel: OwnKernel, problem: String) -> Error {
    Error::Kernel {
        kernel: kernel.entry().into(),
        problem,
    }
}

/// The module compiled for one architecture.
#[derive(Debug)]
pub struct Compiled {
    /// `sm_90`…
    pub arch: &'static str,
    /// The machine code.
    pub cubin: Vec<u8>,
    /// Whether it came from the disk cache.
    pub outcome: CacheOutcome,
    /// Seconds spent compiling or loading it.
    pub seconds: f64,
}

/// Compiles [`SOURCE`] for `arch` (`sm_90`…) with NVRTC, through the disk kernel cache the
/// environment names ([`KernelCache::from_env`]), once per process, architecture and cache
/// folder.
///
/// # Errors
/// [`Error::Kernel`] without NVRTC or when NVRTC rejects the source (with its log).
pub fn compile(arch: &'static str) -> Result<Arc<Compiled>> {
    type Done = HashMap<(&'static str, Option<PathBuf>), Arc<Compiled>>;
    static DONE: OnceLock<Mutex<Done>> = OnceLock::new();
    let cache = KernelCache::from_env();
    // Keyed by the cache folder too: a process that moves the folder compiles (or loads)
    // again, as a fresh process would.
    let key = (arch, cache.as_ref().map(|c| c.dir().to_path_buf()));
    let mut done = DONE
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(c) = done.get(&key) {
        return Ok(c.clone());
    }
    let c = Arc::new(compile_uncached(arch, cache.as_ref())?);
    done.insert(key, c.clone());
    Ok(c)
}

/// [`compile`] without the per-process memo, through `cache` (or none): for tests and
/// benchmarks that measure a cold or a cached compile.
///
/// # Errors
/// As [`compile`].
pub fn compile_uncached(arch: &'static str, cache: Option<&KernelCache>) -> Result<Compiled> {
    let fail = |problem: String| Error::Kernel {
        kernel: format!("module for {arch}"),
        problem,
    };
    if !rtc::nvrtc_library_present() {
        return Err(fail("the NVRTC library (libnvrtc) cannot be loaded".into()));
    }
    let start = Instant::now();
    // No headers to include: the source declares what it uses.
    let flags = rtc::cubin_flags(arch, None);
    let version = rtc::nvrtc_version();
    let mut parts: Vec<&[u8]> = vec![b"cbr kernels v1", version.as_bytes(), arch.as_bytes()];
    parts.extend(flags.iter().map(|f| f.as_bytes()));
    parts.push(SOURCE.as_bytes());
    let key = KernelCache::key(&parts);
    let (mut images, outcome) =
        KernelCache::get_or_compile(cache, &format!("cbr-{arch}"), key, 1, || {
            rtc::compile_cubin("kernel_source.cu", SOURCE, &flags).map(|c| vec![c])
        })
        .map_err(fail)?;
    Ok(Compiled {
        arch,
        cubin: images.pop().ok_or_else(|| fail("no machine code".into()))?,
        outcome,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The architecture our kernels are compiled for on `target` when `pointwise` asks for them,
/// compiling them now (once per process); `None` where cuDNN's graphs run instead: with
/// [`Pointwise::Cudnn`], without NVRTC, or for an architecture with no machine-code target.
///
/// # Errors
/// [`Error::Kernel`] when NVRTC rejects the source.
pub fn prepare(target: &Target, pointwise: Pointwise) -> Result<Option<&'static str>> {
    let arch = arch_for(target, pointwise);
    if let Some(arch) = arch {
        compile(arch)?;
    }
    Ok(arch)
}

/// The architecture [`prepare`] would compile for, without compiling.
pub fn arch_for(target: &Target, pointwise: Pointwise) -> Option<&'static str> {
    let (major, minor) = target.props().compute_capability();
    match (pointwise, rtc::real_arch(major, minor)) {
        (Pointwise::Own, Some(arch)) if rtc::nvrtc_library_present() => Some(arch),
        _ => None,
    }
}

/// The module loaded into one CUDA context.
struct Loaded {
    _ctx: Arc<CudaContext>,
    /// The device's architecture.
    arch: &'static str,
    functions: HashMap<&'static str, CudaFunction>,
    sms: u32,
}

impl Loaded {
    /// Loaded once per context (the map holds the context, so its handle is never reused);
    /// refused for a step planned for another architecture than the device's.
    fn for_context(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Arc<Loaded>> {
        let loaded = Self::load(ctx)?;
        if loaded.arch != arch {
            return Err(Error::Kernel {
                kernel: format!("module for {arch}"),
                problem: format!(
                    "the layer was planned for {arch}, but this device is {}: plan it for this \
                     device",
                    loaded.arch
                ),
            });
        }
        Ok(loaded)
    }

    fn load(ctx: &Arc<CudaContext>) -> Result<Arc<Loaded>> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Loaded>>>> = OnceLock::new();
        let key = ctx.cu_ctx() as usize;
        let mut map = LOADED
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = map.get(&key) {
            return Ok(l.clone());
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("query the compute capability", e))?;
        let arch = u32::try_from(major)
            .ok()
            .zip(u32::try_from(minor).ok())
            .and_then(|(ma, mi)| rtc::real_arch(ma, mi))
            .ok_or_else(|| Error::Kernel {
                kernel: "module".into(),
                problem: format!(
                    "compute capability {major}.{minor} has no machine-code target here; plan \
                     the layer for this device (cuDNN then runs every step)"
                ),
            })?;
        let compiled = compile(arch)?;
        let module = ctx
            .load_module(Ptx::from_binary(compiled.cubin.clone()))
            .map_err(|e| driver(&format!("load our {arch} kernels"), e))?;
        let mut functions = HashMap::new();
        for k in OwnKernel::ALL {
            let f = module
                .load_function(k.entry())
                .map_err(|e| driver(&format!("look up kernel {}", k.entry()), e))?;
            functions.insert(k.entry(), f);
        }
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver("query the SM count", e))?;
        let l = Arc::new(Loaded {
            _ctx: ctx.clone(),
            arch,
            functions,
            sms: u32::try_from(sms).unwrap_or(1).max(1),
        });
        map.insert(key, l.clone());
        Ok(l)
    }
}
