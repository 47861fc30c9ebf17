//! Launching our kernels: each launch as data ([`Launch`]), checked against the compiled
//! kernel's parameters, then pushed to the driver.

// The thin launch layer: raw device addresses go to our kernels; each call's contract is
// stated where it is made.
#![allow(unsafe_code)]

use super::module::Loaded;
use super::{kernel_error, BnEvalOutput, OwnKernel};
use crate::cbr::device_buffers::DeviceBuffer;
use crate::cbr::graphs::ApplyResidual;
use crate::error::{Error, Result};
use crate::exec::{driver, Handle};
use crate::graph::DataType;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use cudnn_cbr_runtime::rtc::{self, PtxParam};

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
///
/// [`KernelStep::launch_with`]: super::KernelStep::launch_with
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
    pub(super) fn new(
        kernel: OwnKernel,
        mut values: Vec<KernelArg>,
        elems: u64,
        channels: u32,
    ) -> Self {
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
    pub(super) fn config(&self, sms: u32) -> LaunchConfig {
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
pub(super) fn enqueue(loaded: &Loaded, stream: &CudaStream, launch: &Launch) -> Result<()> {
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
    // The arguments have the kernel's parameter kinds and sizes in its order (checked just
    // above against the PTX of the module the function was loaded from); each lives in
    // `launch` until the launch call returns; every address is memory the caller's table
    // borrows for this pass, with at least the bytes the kernel touches (checked when the
    // launch was built). The launch is ordered on the handle's stream.
    // SAFETY: arguments checked against the kernel's PTX and borrowed for the call (above).
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
