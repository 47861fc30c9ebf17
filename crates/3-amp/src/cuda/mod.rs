//! The CUDA executor: NVRTC-compiled range kernels launched through cudarc, the regions of a
//! plan in device memory, and CUDA-graph capture of a step. The only module of this crate
//! with `unsafe` code; every unsafe block says why it is sound right above it.
//!
//! Recipe:
//! 1. [`cudnn_cbr_runtime::cuda_device`] opens a device, or says why there is none (no driver library, no
//!    device; [`AmpError::NoDevice`] with `?`): it never panics, unlike cudarc called without
//!    a driver.
//! 2. [`AmpKernels::for_context`] compiles every source of [`crate::kernels::ALL`] with NVRTC
//!    for the device's architecture, once per CUDA context (cached for the process), or
//!    returns [`AmpError::NoNvrtc`] when NVRTC is not on the loader path. Its methods launch
//!    one range op each over byte ranges of device buffers ([`DevRange`], [`DevRangeMut`]).
//! 3. [`CudaRegions::new`] allocates a plan's regions (zeroed) on a stream; it is an
//!    [`crate::step::AmpExecutor`], so [`crate::step::AmpStep`] runs on it exactly as on
//!    [`crate::step::CpuRegions`], and its graphs ([`CudaStepGraph`]) replay a step's launches.
//! 4. The loss seed ([`AmpKernels::softmax_xent_backward`], or
//!    [`AmpKernels::softmax_xent_backward_range`] over checked byte ranges ([`DevRange`]) of
//!    buffers shared with cuDNN) multiplies by the loss scale in S; the network's own kernels
//!    around it (the head, residual joins, pooling) are crate `cudnn-cbr-netops`'s, a
//!    [`KernelSet`] of their own over the same [`DevRange`]s and [`CudaRegions::param_addr`].
//!    A [`Readback`] brings a device buffer (e.g. a metrics log) to the host without waiting.
//! 5. A training loop's batches: [`Upload`] (page-locked staging on the compute stream) or
//!    [`DoubleInput`] (two device buffers filled on a copy stream of their own beside the
//!    step, ordered by events).
//!
//! Streams and ordering: every launch of [`CudaRegions`] goes to its one stream. Work that
//! writes the regions (cuDNN wgrad, cuBLAS, copies) must go to the same stream, or be ordered
//! with it by the caller. The executor passes raw device addresses to its kernels and records
//! no cudarc events, which is what makes its launches capturable into a CUDA graph. Launches
//! over [`DevRange`]s take cudarc buffers ([`DevRange`]) and so go through cudarc's event tracking,
//! which records nothing while the context has a single stream (no `new_stream` on that
//! [`CudaContext`]): only then can they be captured too.
//!
//! NVRTC needs the CUDA headers (`cuda_fp16.h`): the directory named by
//! [`crate::kernels::CUDA_INCLUDE_ENV`], else `$CUDA_HOME/include`, `$CUDA_PATH/include`,
//! `/usr/local/cuda/include`, or a CUDA wheel's, the first that has the header
//! ([`cuda_include_dir`]). NVRTC itself comes from the loader's path or a CUDA wheel.

#![allow(unsafe_code)]

mod compile;
mod dev_range;
pub mod dist_grads;
mod ema_weights;
mod input;
mod kernel_set;
mod launch;
mod readback;
mod regions;
mod seed_kernels;
mod step_kernels;
mod upload;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use compile::{compile_cubin, compile_cubin_cached, compile_ptx, Cubins};
/// The driver's flags a trainer passes to cudarc's capture and event calls, under one curated
/// path each, so that no user of this crate reaches into `cudarc::driver::sys`: the stream
/// capture mode (`CudaStream::begin_capture`), the graph instantiation flags
/// (`CudaStream::end_capture`) and the event flags (`CudaContext::new_event`).
pub use cudarc::driver::sys::{
    CUevent_flags as EventFlags, CUgraphInstantiate_flags as GraphInstantiateFlags,
    CUstreamCaptureMode as CaptureMode,
};
pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
pub use dev_range::{DevRange, DevRangeMut};
pub use ema_weights::TrainedWeights;
pub use input::DoubleInput;
pub use kernel_set::{Arg, KernelSet, Signatures, BLOCK, ONE_THREAD};
pub use launch::AmpKernels;
pub use readback::Readback;
pub use regions::{CudaRegions, CudaStepGraph, RegionsMut};
pub use upload::Upload;

use cudarc::driver::DriverError;

use crate::error::{AmpError, CudaError};

/// Whether a CUDA driver library can be loaded (never panics).
pub fn driver_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library under its known
    // names and drops the handle again; we call it precisely so that no later cudarc call
    // panics on a missing library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Checks that `need` bytes fit in the device memory `ctx` has free, before allocating: a
/// request too large is a typed error naming the sizes, not a driver failure halfway through.
///
/// # Errors
/// [`AmpError::OutOfMemory`] naming `what`; a driver error from the query.
pub fn check_device_memory(ctx: &CudaContext, what: &str, need: u128) -> Result<(), AmpError> {
    let (free, _) = ctx
        .mem_get_info()
        .map_err(|e| driver_error("query free device memory", e))?;
    if need > free as u128 {
        return Err(AmpError::OutOfMemory {
            what: what.to_string(),
            place: "device",
            need,
            have: free as u128,
        });
    }
    Ok(())
}

/// The directory NVRTC gets as include path: the first of [`crate::kernels::cuda_include_dir`],
/// `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include` (and its
/// `targets/x86_64-linux/include`) and the CUDA wheels' `include` folders that holds
/// `cuda_fp16.h`; `None` when none does (NVRTC then relies on its built-in headers).
pub fn cuda_include_dir() -> Option<PathBuf> {
    let from_env = |var: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(|v| PathBuf::from(v).join("include"))
    };
    crate::kernels::cuda_include_dir()
        .into_iter()
        .chain(from_env("CUDA_HOME"))
        .chain(from_env("CUDA_PATH"))
        .chain(Some(PathBuf::from("/usr/local/cuda/include")))
        .chain(Some(PathBuf::from(
            "/usr/local/cuda/targets/x86_64-linux/include",
        )))
        .chain(cudnn_cbr_runtime::wheels::cuda_wheel_include_dirs(
            "cuda_fp16.h",
        ))
        .find(|d| Path::new(d).join("cuda_fp16.h").is_file())
}

/// `len` bytes of page-locked host memory in `ctx`, zeroed (cached memory: the host reads
/// and writes it). `what` names its use in errors.
pub(crate) fn zeroed_pinned(
    ctx: &Arc<CudaContext>,
    len: usize,
    what: &str,
) -> Result<cudarc::driver::PinnedHostSlice<u8>, AmpError> {
    // SAFETY: `alloc_pinned_with_flags` hands out uninitialised page-locked memory; all of it
    // is zeroed through the raw pointer below before any slice of it is made. Flags 0: cached
    // (not write-combined) memory.
    let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }
        .map_err(|e| driver_error(format!("allocate pinned memory for {what}"), e))?;
    let raw = pinned
        .as_mut_ptr()
        .map_err(|e| driver_error(format!("map pinned memory for {what}"), e))?;
    // SAFETY: `raw` points at `len` bytes of page-locked memory owned exclusively by `pinned`,
    // with no copy into it enqueued yet; writing bytes needs no initialised value.
    unsafe { std::ptr::write_bytes(raw, 0, len) };
    Ok(pinned)
}

/// A driver error, with what we were doing.
pub(crate) fn driver_error(op: impl Into<String>, e: DriverError) -> AmpError {
    CudaError::Driver {
        op: op.into(),
        code: e.to_string(),
    }
    .into()
}
