//! Execution on a GPU: cuDNN handles on cudarc streams, bindings (the variant pack), workspace,
//! and CUDA-graph population (autotuning: [`crate::autotune`]). One of the modules that allow
//! `unsafe` (the crate docs list them all).
//!
//! 1. `cudnn_cbr_runtime::cuda_device` opens a device (a typed error, never a panic, where
//!    there is none).
//! 2. [`Handle::new`] makes a cuDNN handle on a cudarc stream; [`Handle::target`] gives the
//!    live [`Target`] plans are built for.
//! 3. [`Bindings::new`] for a plan; bind every real tensor (buffers, or host scalars for by-value
//!    tensors); [`ExecutionPlan::execute`](crate::plan::ExecutionPlan::execute) checks each pointer (non-null, aligned, large enough,
//!    right type) before calling cuDNN.
#![allow(unsafe_code)]

mod bindings;
mod launch;

pub use bindings::{Bindings, DeviceElement, Scalar};
use launch::enqueue_holding;
pub use launch::{CudaGraph, Workspace};

use crate::backend::Descriptor;
use crate::error::{Error, Result};
use crate::target::{DeviceProps, Target};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use cudnn_fe_sys as sys;
use std::sync::{Arc, Mutex};
use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendDescriptorType_t as K;

/// The alignment every tensor pointer must have (cuDNN is told 16 bytes per tensor).
pub const TENSOR_ALIGNMENT: u64 = 16;

/// A cuDNN handle bound to one cudarc stream, with a workspace pool for plans that need one.
///
/// Work is ordered by that stream. Buffers reach cuDNN through borrow-checked tables
/// ([`Bindings::bind`], [`crate::cbr::DeviceBuffers`]) that take their addresses with
/// cudarc's `DevicePtrMut`, so cudarc's event tracking (on by default once a context has
/// several streams) orders cuDNN's work with the other streams as it does its own kernels.
/// Capturing a CUDA graph needs tracking off (one stream per context,
/// `ctx.per_thread_stream()`, or `CudaContext::disable_event_tracking`): an event wait on
/// work outside a capture cannot be captured. With `ctx.per_thread_stream()` the stream is
/// the calling thread's: use such a handle from the thread that made it.
pub struct Handle {
    raw: sys::cudnnHandle_t,
    stream: Arc<CudaStream>,
    lib: &'static sys::Library,
    workspace: Mutex<WorkspacePool>,
    /// The thread that made a handle on the per-thread default stream (that stream is the
    /// calling thread's, so only that thread may use the handle).
    owner: Option<std::thread::ThreadId>,
    /// On the simulated device ([`crate::sim`]): no cuDNN handle (`raw` is null), plans are
    /// built deviceless for the simulator's document and run in the graph interpreter.
    simulated: bool,
    /// On the simulated device: the first failure of a plan execution this handle recorded
    /// into a CUDA graph, at a replay; every later call on the handle returns it.
    replay_fault: crate::sim::ReplayFault,
}

/// `CU_STREAM_PER_THREAD`: the handle value of the calling thread's default stream.
const PER_THREAD_STREAM: usize = 0x2;

/// The pooled workspace. A buffer whose address a CUDA graph may hold (captured, or given to
/// cuDNN's graph population) is kept until the handle drops instead of freed when the pool
/// grows, so replaying that graph never touches freed memory.
#[derive(Default)]
struct WorkspacePool {
    current: Option<CudaSlice<u8>>,
    /// Whether `current`'s address may be inside a CUDA graph.
    pinned: bool,
    retired: Vec<CudaSlice<u8>>,
}

// SAFETY: a cuDNN handle may be used from any thread as long as calls on it do not overlap;
// every call that uses `raw` happens while the caller holds `&Handle` and enqueues work on the
// handle's one stream (a handle on the per-thread default stream refuses other threads, whose
// per-thread stream differs), and the workspace pool is behind a mutex.
unsafe impl Send for Handle {}
// SAFETY: see above.
unsafe impl Sync for Handle {}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("device", &self.stream.context().ordinal())
            .finish_non_exhaustive()
    }
}

/// A shared handle as a [`Target`] holds it.
#[derive(Debug, Clone)]
pub(crate) struct HandleRef(pub(crate) Arc<Handle>);

impl HandleRef {
    pub(crate) fn raw(&self) -> sys::cudnnHandle_t {
        self.0.raw
    }

    pub(crate) fn make_current(&self) -> Result<()> {
        bind_context(&self.0.stream)
    }
}

impl Handle {
    /// Creates a cuDNN handle whose work goes to `stream`.
    ///
    /// On the simulated device ([`crate::sim::active`]) no cuDNN handle is made (cuDNN sees
    /// no driver there): [`Handle::target`] is the simulator's deviceless target and
    /// [`ExecutionPlan::execute`](crate::plan::ExecutionPlan::execute) runs the plan's graph in the graph interpreter.
    pub fn new(stream: Arc<CudaStream>) -> Result<Arc<Self>> {
        let lib = sys::library()?;
        bind_context(&stream)?;
        if crate::sim::active() {
            return Ok(Arc::new(Handle {
                raw: std::ptr::null_mut(),
                owner: stream_is_per_thread(&stream).then(|| std::thread::current().id()),
                stream,
                lib,
                workspace: Mutex::new(WorkspacePool::default()),
                simulated: true,
                replay_fault: Default::default(),
            }));
        }
        let mut raw: sys::cudnnHandle_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current on this thread.
        unsafe { (lib.api.cudnnCreate)(&mut raw) }
            .result()
            .map_err(|e| Error::cudnn("cudnnCreate", e))?;
        let owner = stream_is_per_thread(&stream).then(|| std::thread::current().id());
        let handle = Handle {
            raw,
            stream,
            lib,
            workspace: Mutex::new(WorkspacePool::default()),
            owner,
            simulated: false,
            replay_fault: Default::default(),
        };
        // SAFETY: `raw` is a live handle; the stream outlives it (held in `handle`).
        unsafe { (lib.api.cudnnSetStream)(raw, handle.stream.cu_stream() as sys::cudaStream_t) }
            .result()
            .map_err(|e| Error::cudnn("cudnnSetStream", e))?;
        Ok(Arc::new(handle))
    }

    /// The stream work is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's properties as cuDNN sees them (serialized to the same JSON the deviceless
    /// fixtures use). Keys cuDNN leaves out are tolerated ([`DeviceProps::from_live_json`];
    /// [`DeviceProps::missing_keys`] names them).
    ///
    /// On the simulated device: the simulator's device-properties document.
    pub fn device_props(&self) -> Result<DeviceProps> {
        if self.simulated {
            return DeviceProps::from_file(self.simulator_devprops()?);
        }
        DeviceProps::from_live_json(&self.device_props_json()?)
    }

    /// Where the simulator's device-properties document is.
    fn simulator_devprops(&self) -> Result<std::path::PathBuf> {
        crate::sim::devprops_path().ok_or_else(|| Error::Simulator {
            plan: String::new(),
            problem: "the simulated driver no longer answers (CUDNN_CBR_DEVICE changed?)".into(),
        })
    }

    /// The device-properties JSON document exactly as cuDNN serializes it for this device
    /// (on the simulated device: the simulator's document as written).
    pub fn device_props_json(&self) -> Result<String> {
        if self.simulated {
            let path = self.simulator_devprops()?;
            // As DeviceProps::from_file reads it: a regular file of bounded size (a FIFO
            // would block a plain read).
            return cudnn_cbr_runtime::untrusted::read_regular_text(
                &path,
                crate::target::MAX_DOCUMENT_BYTES,
            )
            .map_err(|problem| Error::File {
                what: "device-properties file",
                path: path.display().to_string(),
                problem,
            });
        }
        let mut d = Descriptor::new(K::CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR)?;
        d.set_one(A::CUDNN_ATTR_DEVICEPROP_HANDLE, self.raw)?;
        d.finalize()?;
        d.get_string(A::CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION)
    }

    /// A live target: plans built for it can execute on this handle.
    ///
    /// On the simulated device: the deviceless target of the simulator's device-properties
    /// document (real cuDNN plans, built without a device).
    pub fn target(self: &Arc<Self>) -> Result<Target> {
        if self.simulated {
            return Target::deviceless(self.device_props()?);
        }
        Target::live(self.device_props()?, HandleRef(self.clone()))
    }

    /// Enqueues zeroing of `bytes` bytes at device address `ptr` on the handle's stream.
    ///
    /// # Safety
    /// `ptr .. ptr + bytes` is live device memory of the handle's context that nothing frees
    /// or uses on another stream (unordered with this one) until the memset has run. Null is
    /// refused with an error.
    pub unsafe fn zero_device_bytes(&self, ptr: u64, bytes: usize) -> Result<()> {
        if ptr == 0 {
            return Err(Error::Driver {
                what: "zero a device buffer".into(),
                message: "null pointer".into(),
            });
        }
        self.ready()?;
        bind_context(&self.stream)?;
        // SAFETY: the caller's contract above; the memset is ordered on the handle's stream.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver("zero a device buffer", e))
    }

    /// Enqueues a copy of `bytes` bytes from device address `src` to `dst` on the handle's
    /// stream (capturable in a CUDA graph).
    ///
    /// # Safety
    /// Both ranges are live device memory of the handle's context, at least `bytes` long,
    /// not overlapping, that nothing frees or uses on another stream (unordered with this
    /// one) until the copy has run. Null is refused with an error.
    pub unsafe fn copy_device_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if dst == 0 || src == 0 {
            return Err(Error::Driver {
                what: "copy a device buffer".into(),
                message: "null pointer".into(),
            });
        }
        self.ready()?;
        bind_context(&self.stream)?;
        // SAFETY: the caller's contract above; the copy is ordered on the handle's stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        }
        .map_err(|e| driver("copy a device buffer", e))
    }

    /// Grows the pooled workspace to at least `bytes` now. Call it with the largest
    /// workspace any plan will need before capturing this handle's stream into a CUDA graph:
    /// the pool cannot grow during a capture.
    pub fn reserve_workspace(&self, bytes: usize) -> Result<()> {
        self.ready()?;
        let mut pool = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        self.grow_pool(&mut pool, bytes, false)
    }

    /// Whether the handle's stream is capturing a CUDA graph now.
    fn capturing(&self) -> Result<bool> {
        use cudarc::driver::sys::CUstreamCaptureStatus as S;
        let status = self
            .stream
            .capture_status()
            .map_err(|e| driver("query the stream's capture status", e))?;
        Ok(status != S::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Grows the pool to at least `bytes` (never shrinks). `for_graph`: the address goes into
    /// a CUDA graph (pinned until the handle drops).
    fn grow_pool(&self, pool: &mut WorkspacePool, bytes: usize, for_graph: bool) -> Result<()> {
        let have = pool.current.as_ref().map_or(0, |w| w.len());
        if have < bytes.max(1) {
            if self.capturing()? {
                return Err(Error::WorkspaceGrowthInCapture {
                    needed: bytes,
                    pooled: have,
                });
            }
            let grown = self
                .stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(|e| driver("allocate workspace", e))?;
            if let Some(old) = pool.current.replace(grown) {
                if pool.pinned {
                    pool.retired.push(old);
                }
            }
            pool.pinned = false;
        }
        if !pool.pinned && (for_graph || self.capturing()?) {
            pool.pinned = true;
        }
        Ok(())
    }

    /// Runs `enqueue` with the address of at least `bytes` of pooled workspace (grown as
    /// [`Handle::grow_pool`] grows it), holding the pool and the workspace's ordering guard
    /// until `enqueue` has returned ([`enqueue_holding`]).
    fn with_pooled_workspace<R>(
        &self,
        bytes: usize,
        for_graph: bool,
        enqueue: impl FnOnce(u64) -> Result<R>,
    ) -> Result<R> {
        let mut pool = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        self.grow_pool(&mut pool, bytes, for_graph)?;
        let ws = pool.current.as_ref().ok_or_else(|| Error::Driver {
            what: "allocate workspace".into(),
            message: "the pool holds no buffer after growing".into(),
        })?;
        let (ptr, guard) = ws.device_ptr(&self.stream);
        enqueue_holding(guard, || enqueue(ptr))
    }

    /// Whether the handle runs plans on the simulated device ([`crate::sim`]).
    pub fn is_simulated(&self) -> bool {
        self.simulated
    }

    /// Refuses work from a thread whose per-thread stream is not the handle's, and (on the
    /// simulated device) every call after a replayed plan execution failed.
    pub(crate) fn ready(&self) -> Result<()> {
        if self.owner.is_some_and(|t| t != std::thread::current().id()) {
            return Err(Error::WrongThread);
        }
        self.replay_failure()
    }

    /// On the simulated device: the first failure of a plan execution this handle recorded
    /// into a CUDA graph, when a replay of that graph ran it (`Error::Simulator`, naming the
    /// plan and, for an interpreter error, the tensor). The simulated driver has then
    /// faulted the context as well (every later synchronize, copy or launch fails with
    /// `CUDA_ERROR_LAUNCH_FAILED`), so the failure is never lost; this says which plan it was.
    pub fn replay_failure(&self) -> Result<()> {
        match self.replay_fault.get() {
            Some((plan, problem)) => Err(Error::Simulator {
                plan: plan.clone(),
                problem: format!("at a replay of the CUDA graph it was recorded in: {problem}"),
            }),
            None => Ok(()),
        }
    }
}

fn stream_is_per_thread(stream: &CudaStream) -> bool {
    stream.cu_stream() as usize == PER_THREAD_STREAM
}

impl Drop for Handle {
    fn drop(&mut self) {
        if self.simulated {
            return; // no cuDNN handle was made
        }
        // SAFETY: `raw` was created by cudnnCreate and is destroyed once; errors are ignored
        // because Drop cannot report them.
        let _ = unsafe { (self.lib.api.cudnnDestroy)(self.raw) };
    }
}

/// Makes the stream's CUDA context current on this thread.
fn bind_context(stream: &CudaStream) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| driver("bind the CUDA context", e))
}

pub(crate) fn driver(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Driver {
        what: what.into(),
        message: e.to_string(),
    }
}
