//! The CUDA side: [`NetKernels`], the network's own kernels ([`crate::kernels::ALL`])
//! compiled with NVRTC and loaded into one CUDA context, and their launches over checked byte
//! ranges ([`DevRange`], [`DevRangeMut`]) of buffers shared with cuDNN. The only module of this
//! crate with `unsafe` code; every unsafe block says why it is sound right above it.
//!
//! Recipe:
//! 1. [`NetKernels::for_context`] compiles the sources for the device (once per context,
//!    cached for the process, through the disk kernel cache like amp's), or says why it
//!    cannot ([`AmpError::NoNvrtc`], ...).
//! 2. Its methods launch one op each on a stream of that context: the residual join
//!    ([`NetKernels::add_f16`]), max-pool ([`NetKernels::max_pool_forward`],
//!    [`NetKernels::max_pool_backward`]), the head ([`NetKernels::gap_forward`],
//!    [`NetKernels::fc_forward`], [`NetKernels::fc_backward`], [`NetKernels::gap_backward`],
//!    [`NetKernels::head_metrics`]).
//! 3. With the FC's parameters in amp's regions, [`RegionsFc`] on [`CudaRegions`] reads W
//!    and writes G.
//!
//! Streams and ordering are amp's (`cudnn_cbr_amp::cuda`): the launches take cudarc buffers
//! and so go through cudarc's event tracking, which records nothing while the context has a
//! single stream; only then can they be captured into a CUDA graph.

#![allow(unsafe_code)]

mod body;
mod fc_regions;
mod head;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::CudaContext;
use cudnn_cbr_amp::cuda::KernelSet;
use cudnn_cbr_amp::kernels::CudaArch;
use cudnn_cbr_amp::AmpError;

pub use fc_regions::RegionsFc;

use crate::kernels;

// Named only by doc links.
#[cfg(doc)]
use cudnn_cbr_amp::cuda::{CudaRegions, DevRange, DevRangeMut};

/// The network's kernels compiled with NVRTC and loaded into one CUDA context.
///
/// Get it with [`NetKernels::for_context`] (compiled once per context, then shared). Each
/// launch method checks its arguments (ranges inside their buffers, whole elements, the
/// shape's element counts, one CUDA context) and enqueues one kernel on `stream`; nothing
/// waits.
pub struct NetKernels {
    set: KernelSet,
}

impl fmt::Debug for NetKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NetKernels")
            .field("set", &self.set)
            .finish()
    }
}

/// Compiled kernels per CUDA context (keyed by the context handle; each entry holds an `Arc`
/// to its context, so a handle in the map can never be reused by another context).
fn cache() -> &'static Mutex<HashMap<usize, Arc<NetKernels>>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<NetKernels>>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

impl NetKernels {
    /// The kernels for `ctx`: compiled and loaded on the first call for a context, shared
    /// afterwards ([`KernelSet::load`] under the family name `net`).
    ///
    /// # Errors
    /// As [`KernelSet::load`]: [`AmpError::NoNvrtc`] without the NVRTC library, an
    /// unsupported architecture, a source NVRTC rejects, code the driver cannot load.
    pub fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<NetKernels>, AmpError> {
        let key = ctx.cu_ctx() as usize;
        // Compiling under the lock keeps two threads from compiling the same context twice.
        let mut map = cache().lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = map.get(&key) {
            return Ok(k.clone());
        }
        let set = KernelSet::load(ctx, "net", &kernels::ALL, kernels::signature)?;
        let k = Arc::new(NetKernels { set });
        map.insert(key, k.clone());
        Ok(k)
    }

    /// The architecture the code was built for.
    pub fn arch(&self) -> CudaArch {
        self.set.arch()
    }

    /// What was loaded and by which NVRTC (as [`KernelSet::code`]).
    pub fn code(&self) -> &str {
        self.set.code()
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.set.context()
    }
}
