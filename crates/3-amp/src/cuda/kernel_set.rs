//! [`KernelSet`]: kernel sources compiled with NVRTC and loaded into one CUDA context, with
//! the launch plumbing every op shares (kernel arguments checked against their signature,
//! grids, context checks). [`super::AmpKernels`] is amp's set; the network's own kernels
//! (crate `cudnn-cbr-netops`) are another, built the same way. Compiling and loading live in
//! [`super::compile`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::cuda::driver_error;
use crate::error::{AmpError, CudaError};
use crate::kernels::{CudaArch, ParamType};

/// Threads per block of the elementwise kernels.
pub const BLOCK: u32 = 256;
/// Resident blocks per SM the grid-stride launches aim for (8 × 256 = 2048 threads, the
/// most an SM of sm_80..sm_100 holds).
pub(super) const BLOCKS_PER_SM: u32 = 8;

/// One block of one thread (the scalar kernels).
pub const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

pub use crate::kernels::Signatures;

/// One kernel argument, by value.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A pointer or a `size_t`.
    U64(u64),
    /// An `unsigned int`.
    U32(u32),
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
}

impl Arg {
    /// A `size_t` (the targets are 64-bit).
    pub fn size(n: usize) -> Arg {
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

/// Kernel sources compiled with NVRTC and loaded into one CUDA context
/// ([`KernelSet::load`]): the entry points by name, each launch checked against the set's
/// [`Signatures`].
pub struct KernelSet {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) arch: CudaArch,
    /// What was loaded, e.g. "sm_90 machine code".
    pub(super) code: String,
    pub(super) max_blocks: u32,
    pub(super) functions: HashMap<&'static str, CudaFunction>,
    pub(super) signatures: Signatures,
}

impl fmt::Debug for KernelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelSet")
            .field("device", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .field("code", &self.code)
            .field("max_blocks", &self.max_blocks)
            .field("kernels", &self.functions.len())
            .finish_non_exhaustive()
    }
}

impl KernelSet {
    /// The architecture the code was built for.
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

    /// The most blocks a grid-stride launch uses: 8 per SM of the device.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// A grid-stride configuration for `work` independent items ([`BLOCK`] threads a block,
    /// at most [`KernelSet::max_blocks`] blocks).
    pub fn grid(&self, work: usize) -> LaunchConfig {
        let blocks = work
            .div_ceil(BLOCK as usize)
            .clamp(1, self.max_blocks as usize);
        LaunchConfig {
            grid_dim: (u32::try_from(blocks).unwrap_or(self.max_blocks), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// [`KernelSet::grid`] for `n` elements handled in groups of 8.
    pub fn grid_elems(&self, n: usize) -> LaunchConfig {
        self.grid(n.div_ceil(8))
    }

    /// The stream must belong to the kernels' context.
    ///
    /// # Errors
    /// [`CudaError::ContextMismatch`].
    pub fn check_stream(&self, stream: &CudaStream) -> Result<(), AmpError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(CudaError::ContextMismatch {
                what: "the stream".into(),
            }
            .into());
        }
        Ok(())
    }

    /// A buffer (`what`, allocated on `buf_stream`) must belong to `stream`'s context.
    ///
    /// # Errors
    /// [`CudaError::ContextMismatch`] naming `what`.
    pub fn check_buf(
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

    /// [`KernelSet::check_stream`], then [`KernelSet::check_buf`] for each `(what, buffer
    /// stream)` in order: the preamble of every checked launch.
    ///
    /// # Errors
    /// [`CudaError::ContextMismatch`] for the first that does not match.
    pub fn check_streams(
        &self,
        stream: &CudaStream,
        bufs: &[(&'static str, &CudaStream)],
    ) -> Result<(), AmpError> {
        self.check_stream(stream)?;
        bufs.iter()
            .try_for_each(|&(what, buf_stream)| self.check_buf(stream, what, buf_stream))
    }

    /// Launches entry point `name` with `args` on `stream`, after checking them against the
    /// set's signature of `name`.
    ///
    /// # Errors
    /// [`CudaError::ArgumentMismatch`] when `args` do not have the signature's types;
    /// [`CudaError::Driver`] when `name` is not an entry point of the set, or the launch
    /// fails.
    ///
    /// # Safety
    /// The pointer arguments satisfy what the kernel `name` reads and writes through them
    /// (each caller spells that out), and outlive the launch on `stream`.
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), AmpError> {
        let got: Vec<ParamType> = args.iter().map(|a| a.param_type()).collect();
        let expected = (self.signatures)(name).unwrap_or(&[]);
        if got != expected {
            return Err(CudaError::ArgumentMismatch {
                kernel: name,
                expected: expected.to_vec(),
                got,
            }
            .into());
        }
        let f = self.functions.get(name).ok_or_else(|| CudaError::Driver {
            op: format!("launch {name}"),
            code: "not an entry point of the loaded kernels".into(),
        })?;
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
        // just above against the signature that the NVRTC tests check against the PTX), each
        // argument lives in `args` until after the launch call returns, and the caller
        // guarantees the memory behind the pointers.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error(format!("launch {name}"), e))?;
        Ok(())
    }
}
