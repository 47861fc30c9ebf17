//! [`AmpKernels`]: the compiled range kernels of one CUDA context, and the launch plumbing
//! shared by its ops (kernel arguments, grids, context checks). The ops themselves live in
//! [`super::step_kernels`], [`super::head_kernels`] and [`super::net_kernels`]; compiling and
//! loading in [`super::compile`].

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::cuda::driver_error;
use crate::error::{AmpError, CudaError};
use crate::kernels::{self, CudaArch, ParamType};

/// Threads per block of the elementwise kernels.
pub(super) const BLOCK: u32 = 256;
/// Resident blocks per SM the grid-stride launches aim for (8 × 256 = 2048 threads, the
/// most an SM of sm_80..sm_100 holds).
pub(super) const BLOCKS_PER_SM: u32 = 8;

/// One block of one thread (the scalar kernels).
pub(super) const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// One kernel argument, by value.
#[derive(Debug, Clone, Copy)]
pub(super) enum Arg {
    U64(u64),
    U32(u32),
    I32(i32),
    F32(f32),
}

impl Arg {
    /// A `size_t` (the targets are 64-bit).
    pub(super) fn size(n: usize) -> Arg {
        Arg::U64(n as u64)
    }

    fn param_type(&self) -> ParamType {
        match self {
            Arg::U64(_) => ParamType::U64,
            Arg::U32(_) | Arg::I32(_) => ParamType::U32,
            Arg::F32(_) => ParamType::F32,
        }
    }
}

/// The kernels of [`crate::kernels::ALL`], compiled for one CUDA context.
pub(super) struct Functions {
    pub(super) cast_f32_to_f16: CudaFunction,
    pub(super) cast_f16_to_f32: CudaFunction,
    pub(super) accum_grads: CudaFunction,
    pub(super) check_nonfinite: CudaFunction,
    pub(super) check_clip: CudaFunction,
    pub(super) grad_sumsq: CudaFunction,
    pub(super) grad_norm: CudaFunction,
    pub(super) loss_scale_update: CudaFunction,
    pub(super) zero_bytes: CudaFunction,
    pub(super) sgd_step: CudaFunction,
    pub(super) ema_update: CudaFunction,
    pub(super) softmax_xent_backward: CudaFunction,
    pub(super) gap_forward: CudaFunction,
    pub(super) gap_backward: CudaFunction,
    pub(super) fc_forward: CudaFunction,
    pub(super) fc_backward: CudaFunction,
    pub(super) add_f16: CudaFunction,
    pub(super) head_metrics: CudaFunction,
    pub(super) max_pool_forward: CudaFunction,
    pub(super) max_pool_backward: CudaFunction,
}

/// The range kernels compiled with NVRTC and loaded into one CUDA context.
///
/// Get it with [`AmpKernels::for_context`] (compiled once per context, then shared). Each
/// launch method checks its arguments (ranges inside their buffers, whole elements, equal
/// element counts, one CUDA context) and enqueues one kernel on `stream`; nothing waits.
/// Empty ranges launch nothing.
pub struct AmpKernels {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) arch: CudaArch,
    /// What was loaded, e.g. "sm_90 machine code".
    pub(super) code: String,
    pub(super) max_blocks: u32,
    pub(super) f: Functions,
}

impl fmt::Debug for AmpKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmpKernels")
            .field("device", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .field("code", &self.code)
            .field("max_blocks", &self.max_blocks)
            .finish_non_exhaustive()
    }
}

impl AmpKernels {
    /// The architecture the PTX was built for.
    pub fn arch(&self) -> CudaArch {
        self.arch
    }

    /// What was loaded and by which NVRTC: `"sm_90 machine code, NVRTC 13.0"`, or
    /// `"compute_90 PTX, JIT-compiled by the driver, NVRTC 13.0"` on an architecture
    /// [`cudnn_cbr_runtime::rtc::real_arch`] does not list.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A grid-stride configuration for `work` independent items (8-element groups).
    pub(super) fn grid(&self, work: usize) -> LaunchConfig {
        let blocks = work
            .div_ceil(BLOCK as usize)
            .clamp(1, self.max_blocks as usize);
        LaunchConfig {
            grid_dim: (u32::try_from(blocks).unwrap_or(self.max_blocks), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub(super) fn grid_elems(&self, n: usize) -> LaunchConfig {
        self.grid(n.div_ceil(8))
    }

    /// The stream must belong to the kernels' context.
    pub(super) fn check_stream(&self, stream: &CudaStream) -> Result<(), AmpError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(CudaError::ContextMismatch {
                what: "the stream".into(),
            }
            .into());
        }
        Ok(())
    }

    pub(super) fn check_buf(
        &self,
        stream: &CudaStream,
        what: &'static str,
        buf_stream: &CudaStream,
    ) -> Result<(), AmpError> {
        if buf_stream.context().cu_ctx() != stream.context().cu_ctx() {
            return Err(CudaError::ContextMismatch { what: what.into() }.into());
        }
        Ok(())
    }

    /// [`AmpKernels::check_stream`], then [`AmpKernels::check_buf`] for each `(what, buffer
    /// stream)` in order: the preamble of every checked launch.
    pub(super) fn check_streams(
        &self,
        stream: &CudaStream,
        bufs: &[(&'static str, &CudaStream)],
    ) -> Result<(), AmpError> {
        self.check_stream(stream)?;
        bufs.iter()
            .try_for_each(|&(what, buf_stream)| self.check_buf(stream, what, buf_stream))
    }

    /// Launches `f` (entry point `name`) with `args`, after checking them against
    /// [`kernels::signature`].
    ///
    /// # Safety
    /// The pointer arguments satisfy what the kernel `name` reads and writes through them
    /// (each raw launch below spells that out), and outlive the launch on `stream`.
    pub(super) unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), AmpError> {
        let got: Vec<ParamType> = args.iter().map(|a| a.param_type()).collect();
        let expected = kernels::signature(name).unwrap_or(&[]);
        if got != expected {
            return Err(CudaError::ArgumentMismatch {
                kernel: name,
                expected: expected.to_vec(),
                got,
            }
            .into());
        }
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::U64(v) => b.arg(v),
                Arg::U32(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: the argument list has the kernel's parameter types in its order (checked
        // just above against the signature that the NVRTC test checks against the PTX), each
        // argument lives in `args` until after the launch call returns, and the caller
        // guarantees the memory behind the pointers.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error(format!("launch {name}"), e))?;
        Ok(())
    }
}
