//! [`AmpKernels`]: amp's range kernels ([`crate::kernels::ALL`]) as a [`KernelSet`] of one
//! CUDA context. The ops themselves live in [`super::step_kernels`] and
//! [`super::seed_kernels`]; compiling and loading in [`super::compile`].

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, LaunchConfig};

use crate::cuda::kernel_set::{Arg, KernelSet};
use crate::error::AmpError;
use crate::kernels::CudaArch;

/// The range kernels compiled with NVRTC and loaded into one CUDA context.
///
/// Get it with [`AmpKernels::for_context`] (compiled once per context, then shared). Each
/// launch method checks its arguments (ranges inside their buffers, whole elements, equal
/// element counts, one CUDA context) and enqueues one kernel on `stream`; nothing waits.
/// Empty ranges launch nothing.
pub struct AmpKernels {
    pub(super) set: KernelSet,
}

impl fmt::Debug for AmpKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmpKernels")
            .field("device", &self.set.ctx.ordinal())
            .field("arch", &self.set.arch)
            .field("code", &self.set.code)
            .field("max_blocks", &self.set.max_blocks)
            .finish_non_exhaustive()
    }
}

impl AmpKernels {
    /// The architecture the PTX was built for.
    pub fn arch(&self) -> CudaArch {
        self.set.arch()
    }

    /// What was loaded and by which NVRTC: `"sm_90 machine code, NVRTC 13.0"`, or
    /// `"compute_90 PTX, JIT-compiled by the driver, NVRTC 13.0"` on an architecture
    /// [`cudnn_cbr_runtime::rtc::real_arch`] does not list.
    pub fn code(&self) -> &str {
        self.set.code()
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.set.context()
    }

    pub(super) fn max_blocks(&self) -> u32 {
        self.set.max_blocks()
    }

    pub(super) fn grid(&self, work: usize) -> LaunchConfig {
        self.set.grid(work)
    }

    pub(super) fn grid_elems(&self, n: usize) -> LaunchConfig {
        self.set.grid_elems(n)
    }

    pub(super) fn check_buf(
        &self,
        stream: &CudaStream,
        what: &'static str,
        buf_stream: &CudaStream,
    ) -> Result<(), AmpError> {
        self.set.check_buf(stream, what, buf_stream)
    }

    pub(super) fn check_streams(
        &self,
        stream: &CudaStream,
        bufs: &[(&'static str, &CudaStream)],
    ) -> Result<(), AmpError> {
        self.set.check_streams(stream, bufs)
    }

    /// [`KernelSet::launch`] of entry point `name`.
    ///
    /// # Safety
    /// As [`KernelSet::launch`]: the pointer arguments satisfy what the kernel `name` reads
    /// and writes through them (each raw launch spells that out), and outlive the launch on
    /// `stream`.
    pub(super) unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), AmpError> {
        // SAFETY: the caller's contract is the set's.
        unsafe { self.set.launch(stream, name, cfg, args) }
    }
}
