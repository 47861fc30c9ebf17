//! Our own kernels for a layer's element-wise steps: the BN apply with its residual forms,
//! the ReLU backward, the dBN apply, the per-channel statistics of a stored conv output, and
//! a BN backward's weight gradients and dBN-apply coefficients (`kernel_source.cu`).
//!
//! cuDNN runs these as runtime-compiled pointwise graphs: NVRTC once per *shape*, about
//! 0.5–0.9 s each on 2 cores, which is most of a network's cold planning time. Ours take the
//! shape as arguments, so one module is compiled once per *architecture* (and kept in the
//! disk [`cudnn_cbr_runtime::kernel_cache`]). They compute what the cuDNN graphs and the CPU
//! reference ops compute, in the same op order with one FP16 rounding per output, and run wherever a
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
use crate::Target;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use cudnn_cbr_runtime::kernel_cache::{CacheOutcome, KernelCache};
use cudnn_cbr_runtime::rtc::{self, PtxParam};
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
    /// Evaluation-mode BN of the unfused route, `((y − μ)·inv_std)·γ + β` in FP32 from the
    /// running statistics, then the layer's residual and ReLU (or neither, for `y_bn`): no
    /// graph of its own; launched directly by [`bn_eval_launch`].
    BnEval,
}

/// What [`OwnKernel::BnEval`] writes after the BN: the unfused route's BN output `y_bn` (no
/// ReLU), or its activation with each residual form (the [`ApplyResidual`] of the layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnEvalOutput {
    /// `y_bn = bn(y)`.
    BnOnly,
    /// `a = relu(bn(y) [+ r | + r·s2 + b2])`.
    Activation(ApplyResidual),
}

impl BnEvalOutput {
    /// The kernel's `mode` argument.
    fn mode(self) -> i32 {
        match self {
            BnEvalOutput::BnOnly => 0,
            BnEvalOutput::Activation(ApplyResidual::None) => 1,
            BnEvalOutput::Activation(ApplyResidual::Add) => 2,
            BnEvalOutput::Activation(ApplyResidual::DualScaleBias) => 3,
        }
    }
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
    pub const ALL: [OwnKernel; 9] = [
        OwnKernel::Apply(ApplyResidual::None),
        OwnKernel::Apply(ApplyResidual::Add),
        OwnKernel::Apply(ApplyResidual::DualScaleBias),
        OwnKernel::ReluBackward,
        OwnKernel::DbnApply,
        OwnKernel::ChannelStats,
        OwnKernel::DbnReduce,
        OwnKernel::DbnCoefficients,
        OwnKernel::BnEval,
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

    /// Whether it reduces over the tensor into per-channel sums (shared-memory accumulators,
    /// added into its outputs).
    fn reduces(self) -> bool {
        matches!(self, OwnKernel::ChannelStats | OwnKernel::DbnReduce)
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
            OwnKernel::BnEval => "cbr_bn_eval",
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
        const BN_EVAL: &[Param] = &[
            full("Y"),
            full("R"),
            vector("mean", F),
            vector("inv_std", F),
            vector("gamma", F),
            vector("beta", F),
            vector("scale2", H),
            vector("bias2", H),
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
            OwnKernel::BnEval => BN_EVAL,
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

    /// How many of [`KernelStep::sources`] are outputs (the last ones).
    pub fn output_count(&self) -> usize {
        self.args.len() - self.kernel.params().len()
    }

    /// The architecture its machine code was compiled for (`sm_90`…).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Enqueues the kernel on the handle's stream over the resolved buffers, after checking
    /// each one (present, element type, size) and the argument list against the compiled
    /// kernel's parameters.
    pub(crate) fn launch(&self, handle: &Handle, r: &Resolved<'_>) -> Result<()> {
        let launch = self.launch_with(|side, name| r.get(side, name))?;
        let stream = handle.stream();
        let loaded = Loaded::for_context(stream.context(), self.arch)?;
        enqueue(&loaded, stream, &launch)
    }

    /// The launch of this step over the buffers `buffer` gives for each (side, name): the
    /// arguments in the kernel's order, each buffer checked first (element type, size). No
    /// device is needed: this is the list `KernelStep::launch` pushes to the driver.
    ///
    /// # Errors
    /// `buffer`'s error for a buffer it lacks; [`Error::Buffer`] for one of another element
    /// type or too short; [`Error::Kernel`] for a by-value scalar that is not FP32.
    pub fn launch_with(
        &self,
        buffer: impl Fn(Side, &'static str) -> Result<DeviceBuffer>,
    ) -> Result<Launch> {
        let mut values = Vec::with_capacity(self.args.len());
        for a in &self.args {
            let (side, name) = match a.src {
                Src::This(n) => (Side::This, n),
                Src::Prev(n) => (Side::Prev, n),
                Src::Scalar(Scalar::F32(v)) => {
                    values.push(KernelArg::F32(v));
                    continue;
                }
                Src::Scalar(other) => {
                    return Err(kernel_error(
                        self.kernel,
                        format!("takes FP32 scalars, got {other:?}"),
                    ))
                }
            };
            let buf = buffer(side, name)?;
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
            values.push(KernelArg::Ptr(buf.ptr));
        }
        Ok(Launch::new(self.kernel, values, self.elems, self.channels))
    }
}

/// One launch argument, by value: what is pushed to the driver, in the kernel's order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArg {
    /// A device address (a `T*` parameter).
    Ptr(u64),
    /// A `float`.
    F32(f32),
    /// An `unsigned long long` (`u64` in the source).
    U64(u64),
    /// An `unsigned`.
    U32(u32),
    /// An `int`.
    I32(i32),
}

impl KernelArg {
    /// How the argument is passed: the PTX parameter it must match.
    pub fn param(self) -> PtxParam {
        match self {
            KernelArg::Ptr(_) | KernelArg::U64(_) => PtxParam::Int64,
            KernelArg::U32(_) | KernelArg::I32(_) => PtxParam::Int32,
            KernelArg::F32(_) => PtxParam::F32,
        }
    }
}

/// One launch of one of our kernels, as data: the kernel, every argument in order (the
/// step's buffers and scalars, then `n: u64`, `c: unsigned`, `vec: int`), and the grid's
/// inputs. Built without a device ([`KernelStep::launch_with`], [`dbn_coefficients_launch`]),
/// checked against the compiled kernel's parameters ([`Launch::check`]) before it is pushed.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    kernel: OwnKernel,
    args: Vec<KernelArg>,
    elems: u64,
    channels: u32,
    vec: bool,
}

impl Launch {
    /// The launch of `kernel` with `values` (its buffers and scalars) over `elems` elements
    /// of `channels` channels.
    fn new(kernel: OwnKernel, mut values: Vec<KernelArg>, elems: u64, channels: u32) -> Self {
        // Eight elements per 16-byte access when each access stays in one channel run and
        // every address is aligned to it.
        let aligned = values
            .iter()
            .all(|v| !matches!(v, KernelArg::Ptr(p) if p % 16 != 0));
        let vec = !kernel.reduces() && channels.is_multiple_of(8) && aligned;
        values.extend([
            KernelArg::U64(elems),
            KernelArg::U32(channels),
            KernelArg::I32(i32::from(vec)),
        ]);
        Launch {
            kernel,
            args: values,
            elems,
            channels,
            vec,
        }
    }

    /// The kernel.
    pub fn kernel(&self) -> OwnKernel {
        self.kernel
    }

    /// Every argument, in the kernel's order.
    pub fn args(&self) -> &[KernelArg] {
        &self.args
    }

    /// Checks the arguments against `params`, the parameters of the compiled kernel's PTX
    /// entry ([`rtc::ptx_entry_params`]), in kind and size.
    ///
    /// # Errors
    /// [`Error::Kernel`] naming the kernel and the first parameter (by index from 0) that
    /// differs, or both counts.
    pub fn check(&self, params: &[PtxParam]) -> Result<()> {
        check_args(self.kernel.entry(), params, &self.args)
    }

    /// The grid on a device with `sms` multiprocessors.
    fn config(&self, sms: u32) -> LaunchConfig {
        let stats = self.kernel.reduces();
        let work = if self.vec { self.elems / 8 } else { self.elems };
        const THREADS: u32 = 256;
        // The statistics flush 2·c atomics per block: fewer, fuller blocks.
        let per_sm = if stats { 2 } else { 8 };
        let blocks = work
            .div_ceil(u64::from(THREADS))
            .clamp(1, u64::from(sms) * per_sm) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: if stats { 8 * self.channels } else { 0 },
        }
    }
}

/// Checks a launch's arguments `args` against the parameters `params` of the compiled entry
/// `entry`.
///
/// # Errors
/// [`Error::Kernel`] naming the entry and the first parameter that differs (or both counts).
pub fn check_args(entry: &str, params: &[PtxParam], args: &[KernelArg]) -> Result<()> {
    let got: Vec<PtxParam> = args.iter().map(|a| a.param()).collect();
    rtc::check_launch_params(entry, params, &got).map_err(|problem| Error::Kernel {
        kernel: entry.into(),
        // The error names the kernel once.
        problem: problem
            .strip_prefix(&format!("kernel {entry}: "))
            .unwrap_or(&problem)
            .to_string(),
    })
}

/// Enqueues `launch` on `stream` (its addresses checked by whoever built it to hold what the
/// kernel touches), after checking its arguments against the loaded kernel's parameters.
fn enqueue(loaded: &Loaded, stream: &CudaStream, launch: &Launch) -> Result<()> {
    let kernel = launch.kernel;
    let (f, params) = loaded
        .functions
        .get(kernel.entry())
        .ok_or_else(|| kernel_error(kernel, "is not in the loaded module".into()))?;
    launch.check(params)?;
    if launch.elems == 0 {
        return Ok(());
    }
    let cfg = launch.config(loaded.sms);
    let mut b = stream.launch_builder(f);
    for a in &launch.args {
        match a {
            KernelArg::Ptr(v) | KernelArg::U64(v) => b.arg(v),
            KernelArg::F32(v) => b.arg(v),
            KernelArg::U32(v) => b.arg(v),
            KernelArg::I32(v) => b.arg(v),
        };
    }
    // SAFETY: the arguments have the kernel's parameter kinds and sizes in its order (checked
    // just above against the PTX of the module the function was loaded from); each lives in
    // `launch` until the launch call returns; every address is memory the caller's table
    // borrows for this pass, with at least the bytes the kernel touches (checked when the
    // launch was built). The launch is ordered on the handle's stream.
    unsafe { b.launch(cfg) }.map_err(|e| driver(&format!("launch {}", kernel.entry()), e))?;
    Ok(())
}

/// Enqueues `cbr_dbn_coefficients` on the handle's stream over explicit buffers: `inputs`
/// γ, 1/σ, μ, dγ, dβ and `neg_inv_count`, into `outputs` A, B, C, `channels` FP32 values
/// each (synchronized BN's recomputation from the summed dγ and dβ). The module is the one
/// compiled for the device's architecture.
///
/// # Errors
/// [`Error::Buffer`] for a buffer that is not FP32 or too short; [`Error::Kernel`] when the
/// module cannot be compiled or loaded, or the arguments do not match it.
pub(crate) fn launch_dbn_coefficients(
    handle: &Handle,
    inputs: [DeviceBuffer; 5],
    neg_inv_count: f32,
    outputs: [DeviceBuffer; 3],
    channels: usize,
) -> Result<()> {
    let launch = dbn_coefficients_launch(inputs, neg_inv_count, outputs, channels)?;
    let stream = handle.stream();
    let loaded = Loaded::load(stream.context())?;
    enqueue(&loaded, stream, &launch)
}

/// The launch `launch_dbn_coefficients` enqueues, built and checked without a device.
///
/// # Errors
/// [`Error::Buffer`] for a buffer that is not FP32 or holds fewer than `channels` values;
/// [`Error::Kernel`] for more channels than a `u32`.
pub fn dbn_coefficients_launch(
    inputs: [DeviceBuffer; 5],
    neg_inv_count: f32,
    outputs: [DeviceBuffer; 3],
    channels: usize,
) -> Result<Launch> {
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
        values.push(KernelArg::Ptr(buf.ptr));
        if i == 4 {
            values.push(KernelArg::F32(neg_inv_count));
        }
    }
    Ok(Launch::new(kernel, values, c.into(), c))
}

/// The buffers of one [`OwnKernel::BnEval`] launch: FP16 `y` and the output (`n` elements),
/// FP32 `[C]` running mean, `1/sqrt(running_var + ε)`, γ and β, and the residual (FP16 `[n]`)
/// with its scale and bias (FP16 `[C]`) where `output` reads them.
#[derive(Debug, Clone, Copy)]
pub struct BnEvalBuffers {
    /// The conv output, FP16 NHWC.
    pub y: DeviceBuffer,
    /// The running mean, FP32 per channel.
    pub mean: DeviceBuffer,
    /// `1/sqrt(running_var + ε)`, FP32 per channel.
    pub inv_std: DeviceBuffer,
    /// γ, FP32 per channel.
    pub gamma: DeviceBuffer,
    /// β, FP32 per channel.
    pub beta: DeviceBuffer,
    /// The residual (`Add`, `DualScaleBias`).
    pub residual: Option<DeviceBuffer>,
    /// The residual's own scale and bias (`DualScaleBias`).
    pub residual_scale_bias: Option<(DeviceBuffer, DeviceBuffer)>,
    /// `y_bn` or `a`, FP16 NHWC like `y`.
    pub out: DeviceBuffer,
}

/// Enqueues [`OwnKernel::BnEval`] on the handle's stream ([`bn_eval_launch`]); the module is
/// the one compiled for the device's architecture.
///
/// # Errors
/// As [`bn_eval_launch`]; [`Error::Kernel`] when the module cannot be compiled or loaded.
pub(crate) fn launch_bn_eval(
    handle: &Handle,
    bufs: &BnEvalBuffers,
    output: BnEvalOutput,
    elems: usize,
    channels: usize,
) -> Result<()> {
    let launch = bn_eval_launch(bufs, output, elems, channels)?;
    let stream = handle.stream();
    let loaded = Loaded::load(stream.context())?;
    enqueue(&loaded, stream, &launch)
}

/// The launch of [`OwnKernel::BnEval`] over `bufs` (`elems` elements of `channels` channels),
/// every buffer checked (element type, size), built without a device. Where `output` reads
/// no residual (or no residual scale and bias), `y` stands in for it: the kernel never reads
/// it, and every pointer argument stays a live FP16 buffer.
///
/// # Errors
/// [`Error::Buffer`] naming a buffer of another element type, too short, or missing for
/// `output`; [`Error::Kernel`] for more elements or channels than the kernel's integers.
pub fn bn_eval_launch(
    bufs: &BnEvalBuffers,
    output: BnEvalOutput,
    elems: usize,
    channels: usize,
) -> Result<Launch> {
    let kernel = OwnKernel::BnEval;
    let c = u32::try_from(channels)
        .ok()
        .filter(|&c| c > 0)
        .ok_or_else(|| kernel_error(kernel, format!("{channels} channels")))?;
    let n = u64::try_from(elems).map_err(|_| kernel_error(kernel, format!("{elems} elements")))?;
    let needs_residual = matches!(
        output,
        BnEvalOutput::Activation(ApplyResidual::Add | ApplyResidual::DualScaleBias)
    );
    let needs_dual = output == BnEvalOutput::Activation(ApplyResidual::DualScaleBias);
    let absent = |name: &str| Error::Buffer {
        name: name.into(),
        problem: format!("is needed by kernel {} for {output:?}", kernel.entry()),
    };
    let residual = match (bufs.residual, needs_residual) {
        (Some(r), true) => r,
        (None, true) => return Err(absent("residual")),
        (_, false) => bufs.y,
    };
    let (s2, b2) = match (bufs.residual_scale_bias, needs_dual) {
        (Some(sb), true) => sb,
        (None, true) => return Err(absent("residual_scale")),
        (_, false) => (bufs.y, bufs.y),
    };
    let checked = [
        ("y", bufs.y, DataType::Half, elems),
        ("residual", residual, DataType::Half, elems),
        ("mean", bufs.mean, DataType::Float, channels),
        ("inv_std", bufs.inv_std, DataType::Float, channels),
        ("gamma", bufs.gamma, DataType::Float, channels),
        ("beta", bufs.beta, DataType::Float, channels),
        ("residual_scale", s2, DataType::Half, channels),
        ("residual_bias", b2, DataType::Half, channels),
    ];
    let mut values = Vec::with_capacity(10);
    for (name, buf, dtype, count) in checked {
        if buf.dtype != dtype || buf.bytes < count * dtype.size() {
            return Err(Error::Buffer {
                name: name.into(),
                problem: format!(
                    "has {} bytes of {}; kernel {} needs {count} {dtype} values",
                    buf.bytes,
                    buf.dtype,
                    kernel.entry()
                ),
            });
        }
        values.push(KernelArg::Ptr(buf.ptr));
    }
    values.push(KernelArg::I32(output.mode()));
    let out = bufs.out;
    if out.dtype != DataType::Half || out.bytes < 2 * elems {
        return Err(Error::Buffer {
            name: "out".into(),
            problem: format!(
                "has {} bytes of {}; kernel {} writes {elems} FP16 values",
                out.bytes,
                out.dtype,
                kernel.entry()
            ),
        });
    }
    values.push(KernelArg::Ptr(out.ptr));
    Ok(Launch::new(kernel, values, n, c))
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
    /// Each entry's parameters in order, from the PTX of the same compilation: what a launch
    /// must pass ([`Launch::check`]).
    pub params: HashMap<String, Vec<PtxParam>>,
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
    // v2: the PTX is kept beside the machine code (its entries' parameter lists).
    let mut parts: Vec<&[u8]> = vec![b"cbr kernels v2", version.as_bytes(), arch.as_bytes()];
    parts.extend(flags.iter().map(|f| f.as_bytes()));
    parts.push(SOURCE.as_bytes());
    let key = KernelCache::key(&parts);
    let (images, outcome) =
        KernelCache::get_or_compile(cache, &format!("cbr-{arch}"), key, 2, || {
            rtc::compile_cubin_and_ptx("kernel_source.cu", SOURCE, &flags)
                .map(|(cubin, ptx)| vec![cubin, ptx.into_bytes()])
        })
        .map_err(fail)?;
    let [cubin, ptx]: [Vec<u8>; 2] = images
        .try_into()
        .map_err(|_| fail("not one machine-code image and its PTX".into()))?;
    let ptx = String::from_utf8(ptx).map_err(|_| fail("the PTX is not UTF-8".into()))?;
    let params: HashMap<String, Vec<PtxParam>> = rtc::ptx_entry_params(&ptx)
        .map_err(fail)?
        .into_iter()
        .collect();
    if let Some(k) = OwnKernel::ALL
        .iter()
        .find(|k| !params.contains_key(k.entry()))
    {
        return Err(kernel_error(*k, format!("is not in the {arch} PTX")));
    }
    Ok(Compiled {
        arch,
        cubin,
        params,
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
    /// Each kernel with its PTX parameters (every launch is checked against them).
    functions: HashMap<&'static str, (CudaFunction, Vec<PtxParam>)>,
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
            let params = compiled
                .params
                .get(k.entry())
                .ok_or_else(|| kernel_error(k, format!("is not in the {arch} PTX")))?;
            functions.insert(k.entry(), (f, params.clone()));
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

/// What the deviceless tests of the kernels and of the layer runner share: layer
/// configurations that select our kernels and cuDNN's graphs, a fake buffer table, and a
/// reading of [`SOURCE`].
#[cfg(test)]
pub(crate) mod test_support {
    use super::super::device_buffers::{DeviceBuffer, Side};
    use super::super::graphs::{ApplyResidual, BackwardResidual};
    use super::super::layer::{route_buffers, CbrConfig, LayerGraph};
    use super::super::shape::ConvShape;
    use super::SOURCE;
    use crate::error::{Error, Result};

    /// Layers of every kind the networks plan: 3-channel stems (statistics on our kernel),
    /// 20-channel layers (no 8-wide vector access), first convs with 8k channels (conv +
    /// GenStats), inner convs through the previous BN with each apply form and backward
    /// residual, and a projection shortcut's BN.
    pub(crate) fn configs() -> Vec<CbrConfig> {
        let sq = ConvShape::square;
        vec![
            CbrConfig::first(sq(8, 3, 32, 64, 7, 3, 2)).with_apply(ApplyResidual::None),
            CbrConfig::first(sq(2, 3, 16, 20, 3, 1, 1)),
            CbrConfig::first(sq(2, 16, 16, 32, 3, 1, 1)).with_apply(ApplyResidual::None),
            CbrConfig::new(sq(2, 20, 8, 20, 3, 1, 1)),
            CbrConfig::new(sq(2, 20, 8, 20, 3, 1, 1)).with_apply(ApplyResidual::Add),
            CbrConfig::new(sq(4, 64, 14, 64, 3, 1, 1)),
            CbrConfig::new(sq(4, 64, 14, 256, 1, 0, 1))
                .with_apply(ApplyResidual::Add)
                .with_backward_residual(BackwardResidual::FuseAdd),
            CbrConfig::new(sq(4, 64, 14, 256, 1, 0, 1)).with_apply(ApplyResidual::DualScaleBias),
            CbrConfig::new(sq(4, 64, 14, 256, 1, 0, 1)).with_shortcut_bn(),
            CbrConfig::after_activation(sq(4, 32, 8, 64, 3, 1, 2)).with_apply(ApplyResidual::None),
        ]
    }

    /// A buffer table over `graphs`' buffers (this layer's and the previous one's) at
    /// distinct 256-byte-aligned fake addresses, each its exact size: what a launch is built
    /// over without a device.
    pub(crate) fn fake_buffers(
        graphs: &[LayerGraph],
    ) -> impl Fn(Side, &'static str) -> Result<DeviceBuffer> {
        let (this, prev) = route_buffers(graphs);
        move |side, name| {
            let (table, base) = match side {
                Side::This => (&this, 0x7f00_0000_0000u64),
                Side::Prev => (&prev, 0x7e00_0000_0000u64),
            };
            let i = table
                .iter()
                .position(|b| b.name == name)
                .ok_or_else(|| Error::Buffer {
                    name: name.into(),
                    problem: "is not a buffer of the route".into(),
                })?;
            Ok(DeviceBuffer {
                ptr: base + ((i as u64) << 32),
                bytes: table[i].bytes(),
                dtype: table[i].dtype,
            })
        }
    }

    /// The source's kernels as (entry, parameter names in order, body).
    pub(crate) fn entries() -> Vec<(String, Vec<String>, String)> {
        let mut out = Vec::new();
        let marker = "extern \"C\" __global__ void ";
        let starts: Vec<usize> = SOURCE.match_indices(marker).map(|(i, _)| i).collect();
        for (n, &at) in starts.iter().enumerate() {
            let end = starts.get(n + 1).copied().unwrap_or(SOURCE.len());
            let text = &SOURCE[at + marker.len()..end];
            let open = text.find('(').expect("a parameter list");
            let close = text.find(')').expect("a closed parameter list");
            let params = text[open + 1..close]
                .split(',')
                .map(|p| {
                    p.trim()
                        .rsplit(|c: char| c.is_whitespace() || c == '*')
                        .next()
                        .unwrap_or_default()
                        .to_string()
                })
                .collect();
            out.push((
                text[..open].trim().to_string(),
                params,
                text[close..].to_string(),
            ));
        }
        out
    }

    /// The parameters (by index) of each kernel of the source that it adds into with
    /// `atomicAdd` (its global-memory accumulators; the shared-memory ones are its own),
    /// by entry. Panics on an `atomicAdd` it cannot attribute (outside a kernel's own body,
    /// or into neither a parameter nor a `__shared__` array of that kernel), so a kernel
    /// rewritten another way fails the tests that use this instead of escaping them.
    pub(crate) fn accumulated_params() -> Vec<(String, Vec<usize>)> {
        let entries = entries();
        let in_bodies: usize = entries
            .iter()
            .map(|(_, _, body)| body.matches("atomicAdd(").count())
            .sum();
        assert_eq!(
            in_bodies,
            SOURCE.matches("atomicAdd(").count(),
            "an atomicAdd outside a kernel's body: attribute it to a kernel's parameters"
        );
        entries
            .into_iter()
            .map(|(entry, params, body)| {
                let mut targets = Vec::new();
                for (at, _) in body.match_indices("atomicAdd(") {
                    let arg = body[at + "atomicAdd(".len()..].trim_start();
                    let arg = arg.strip_prefix('&').unwrap_or(arg).trim_start();
                    let name: String = arg
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if let Some(i) = params.iter().position(|p| *p == name) {
                        if !targets.contains(&i) {
                            targets.push(i);
                        }
                    } else {
                        assert!(
                            body.contains(&format!("__shared__ float {name}[")),
                            "{entry}: atomicAdd into `{name}`, neither a parameter nor shared"
                        );
                    }
                }
                (entry, targets)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::device_buffers::DeviceBuffer;
    use super::super::layer::{route_graphs, RouteKind};
    use super::test_support::{accumulated_params, configs, entries, fake_buffers};
    use super::*;
    use std::collections::HashSet;

    /// NVRTC is part of the test dependencies (`.deps/`): its absence is a failure here.
    fn sm90_params() -> HashMap<String, Vec<PtxParam>> {
        assert!(
            rtc::nvrtc_library_present(),
            "NVRTC cannot be loaded: run scripts/setup-test-deps.sh and `source .deps/env.sh`"
        );
        compile_uncached("sm_90", None)
            .expect("our kernels compile for sm_90")
            .params
    }

    fn float_buffer(i: u64, channels: usize) -> DeviceBuffer {
        DeviceBuffer {
            ptr: 0x7000_0000_0000 + (i << 20),
            bytes: 4 * channels,
            dtype: DataType::Float,
        }
    }

    /// Every launch our layers make (each route of each configuration, through the function
    /// the GPU path pushes from) and synchronized BN's coefficients launch has the compiled
    /// kernels' parameter kinds and sizes, in order.
    #[test]
    fn every_launch_matches_the_compiled_kernel() {
        let params = sm90_params();
        // The PTX says what the source says: one entry per kernel, with its parameter count.
        let source = entries();
        assert_eq!(source.len(), OwnKernel::ALL.len());
        for (entry, names, _) in &source {
            assert_eq!(params[entry].len(), names.len(), "{entry}");
        }
        let mut launched = HashSet::new();
        for config in configs() {
            for kind in [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic] {
                let graphs = route_graphs(&config, kind);
                let buffers = fake_buffers(&graphs);
                for lg in &graphs {
                    let Some(step) = KernelStep::for_graph(lg, "sm_90") else {
                        continue;
                    };
                    let launch = step
                        .launch_with(&buffers)
                        .unwrap_or_else(|e| panic!("{:?} {:?}: {e}", kind, lg.role));
                    let entry = step.kernel().entry();
                    launch
                        .check(&params[entry])
                        .unwrap_or_else(|e| panic!("{} {kind:?}: {e}", config.shape.label()));
                    launched.insert(entry);
                }
            }
        }
        let inputs = [0, 1, 2, 3, 4].map(|i| float_buffer(i, 20));
        let outputs = [5, 6, 7].map(|i| float_buffer(i, 20));
        let coefficients = dbn_coefficients_launch(inputs, -0.5, outputs, 20).unwrap();
        coefficients.check(&params["cbr_dbn_coefficients"]).unwrap();
        launched.insert("cbr_dbn_coefficients");
        let half = |i: u64, n: usize| DeviceBuffer {
            ptr: 0x7d00_0000_0000 + (i << 32),
            bytes: 2 * n,
            dtype: DataType::Half,
        };
        let (n, c) = (2 * 8 * 8 * 20, 20);
        let bufs = BnEvalBuffers {
            y: half(0, n),
            mean: float_buffer(1, c),
            inv_std: float_buffer(2, c),
            gamma: float_buffer(3, c),
            beta: float_buffer(4, c),
            residual: Some(half(5, n)),
            residual_scale_bias: Some((half(6, c), half(7, c))),
            out: half(8, n),
        };
        for output in [
            BnEvalOutput::BnOnly,
            BnEvalOutput::Activation(ApplyResidual::None),
            BnEvalOutput::Activation(ApplyResidual::Add),
            BnEvalOutput::Activation(ApplyResidual::DualScaleBias),
        ] {
            let launch = bn_eval_launch(&bufs, output, n, c).unwrap();
            launch.check(&params["cbr_bn_eval"]).unwrap();
        }
        // A residual form without its residual is refused by name.
        let no_residual = BnEvalBuffers {
            residual: None,
            ..bufs
        };
        let e = bn_eval_launch(
            &no_residual,
            BnEvalOutput::Activation(ApplyResidual::Add),
            n,
            c,
        )
        .unwrap_err();
        assert!(e.to_string().contains("residual"), "{e}");
        launched.insert("cbr_bn_eval");
        let all: HashSet<_> = OwnKernel::ALL.iter().map(|k| k.entry()).collect();
        assert_eq!(launched, all, "every kernel is launched by some layer");
    }

    /// A planted mismatch (an argument pushed with the wrong kind, one left out) is caught,
    /// naming the kernel and the parameter.
    #[test]
    fn a_wrong_argument_list_names_the_kernel_and_the_parameter() {
        let params = sm90_params();
        let inputs = [0, 1, 2, 3, 4].map(|i| float_buffer(i, 8));
        let outputs = [5, 6, 7].map(|i| float_buffer(i, 8));
        let launch = dbn_coefficients_launch(inputs, -0.25, outputs, 8).unwrap();
        let expected = &params["cbr_dbn_coefficients"];
        launch.check(expected).unwrap();
        let mut args = launch.args().to_vec();
        // neg_inv_count (parameter 5) pushed as a pointer-sized integer.
        args[5] = KernelArg::U64(0);
        let msg = check_args("cbr_dbn_coefficients", expected, &args)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("cbr_dbn_coefficients") && msg.contains("parameter 5"),
            "{msg}"
        );
        // `c` (parameter 10, an unsigned) pushed as an f32: same size, another kind.
        let mut args = launch.args().to_vec();
        args[10] = KernelArg::F32(8.0);
        let msg = check_args("cbr_dbn_coefficients", expected, &args)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("parameter 10"), "{msg}");
        // The trailing `vec` left out.
        let args = &launch.args()[..launch.args().len() - 1];
        let msg = check_args("cbr_dbn_coefficients", expected, args)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("takes 12 parameters") && msg.contains("passes 11"),
            "{msg}"
        );
        // Another kernel's list for this one.
        let stats = &params["cbr_channel_stats"];
        let e = launch.check(stats).unwrap_err();
        assert!(matches!(e, Error::Kernel { ref kernel, .. } if kernel == "cbr_dbn_coefficients"));
    }

    /// The trailing arguments and the grid: eight-wide access only for 8k channels at
    /// 16-byte-aligned addresses and never for a reduction, whose blocks get 2·c FP32
    /// accumulators of shared memory.
    #[test]
    fn the_trailing_arguments_and_the_grid_follow_the_shape() {
        let ptrs = |base: u64| vec![KernelArg::Ptr(base); 4];
        let apply = OwnKernel::Apply(ApplyResidual::None);
        let l = Launch::new(apply, ptrs(0x1000), 64 * 100, 64);
        assert_eq!(
            l.args()[4..],
            [KernelArg::U64(6400), KernelArg::U32(64), KernelArg::I32(1)]
        );
        assert_eq!(l.config(132).shared_mem_bytes, 0);
        // 6400 / 8 groups over 256 threads: 4 blocks.
        assert_eq!(l.config(132).grid_dim.0, 4);
        for (values, c) in [(ptrs(0x1008), 64), (ptrs(0x1000), 20)] {
            let l = Launch::new(apply, values, u64::from(c) * 100, c);
            assert_eq!(l.args()[6], KernelArg::I32(0));
        }
        let stats = Launch::new(
            OwnKernel::ChannelStats,
            ptrs(0x1000)[..3].to_vec(),
            6400,
            64,
        );
        assert_eq!(stats.args()[5], KernelArg::I32(0));
        let cfg = stats.config(132);
        assert_eq!(cfg.shared_mem_bytes, 8 * 64);
        // Capped at two blocks per SM.
        let big = Launch::new(
            OwnKernel::ChannelStats,
            ptrs(0x1000)[..3].to_vec(),
            1 << 30,
            64,
        );
        assert_eq!(big.config(132).grid_dim.0, 264);
    }

    /// The reading of the source the zeroing test relies on finds the two reductions'
    /// accumulators and nothing else.
    #[test]
    fn the_source_accumulates_only_into_the_reductions_outputs() {
        let found: Vec<(String, Vec<usize>)> = accumulated_params()
            .into_iter()
            .filter(|(_, t)| !t.is_empty())
            .collect();
        assert_eq!(
            found,
            vec![
                ("cbr_channel_stats".to_string(), vec![1, 2]),
                ("cbr_dbn_reduce".to_string(), vec![4, 5]),
            ]
        );
    }
}
