//! Execution on a GPU: cuDNN handles on cudarc streams, bindings (the variant pack), workspace,
//! and CUDA-graph population (autotuning: [`crate::autotune`]). The only module besides `backend` with `unsafe`.
//!
//! 1. `cudnn_cbr_runtime::cuda_device` opens a device (a typed error, never a panic, where
//!    there is none).
//! 2. [`Handle::new`] makes a cuDNN handle on a cudarc stream; [`Handle::target`] gives the
//!    live [`Target`] plans are built for.
//! 3. [`Bindings::new`] for a plan; bind every real tensor (buffers, or host scalars for by-value
//!    tensors); [`ExecutionPlan::execute`] checks each pointer (non-null, aligned, large enough,
//!    right type) before calling cuDNN.
#![allow(unsafe_code)]

use crate::backend::Descriptor;
use crate::error::{BindingProblem, Error, Result};
use crate::graph::{DataType, TensorId};
use crate::plan::ExecutionPlan;
use crate::target::{DeviceProps, Target};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};
use cudnn_fe_sys as sys;
use std::os::raw::c_void;
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
    /// [`ExecutionPlan::execute`] runs the plan's graph in the graph interpreter.
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

/// Element types a device buffer can have, mapped to graph data types.
pub trait DeviceElement: DeviceRepr {
    /// The graph type of this element.
    const DTYPE: DataType;
}

impl DeviceElement for half::f16 {
    const DTYPE: DataType = DataType::Half;
}
impl DeviceElement for f32 {
    const DTYPE: DataType = DataType::Float;
}
impl DeviceElement for f64 {
    const DTYPE: DataType = DataType::Double;
}
impl DeviceElement for i32 {
    const DTYPE: DataType = DataType::Int32;
}
impl DeviceElement for i64 {
    const DTYPE: DataType = DataType::Int64;
}

/// A host scalar for a by-value tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    /// FP32.
    F32(f32),
    /// FP64.
    F64(f64),
    /// INT64.
    I64(i64),
}

impl Scalar {
    fn dtype(self) -> DataType {
        match self {
            Scalar::F32(_) => DataType::Float,
            Scalar::F64(_) => DataType::Double,
            Scalar::I64(_) => DataType::Int64,
        }
    }

    /// The value's bytes in an 8-byte-aligned word (an FP32 value in its first four bytes),
    /// so cuDNN may read any scalar type through the pointer.
    fn word(self) -> u64 {
        let mut b = [0u8; 8];
        match self {
            Scalar::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
            Scalar::F64(v) => b = v.to_ne_bytes(),
            Scalar::I64(v) => b = v.to_ne_bytes(),
        }
        u64::from_ne_bytes(b)
    }
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Empty,
    Device {
        ptr: u64,
        bytes: usize,
        dtype: DataType,
    },
    Host(usize),
}

/// Pointers for every real tensor of one plan, in the plan's uid order (no map lookups at
/// execute time). Device pointers are raw: the caller keeps the buffers alive and unaliased
/// until the work finishes on the stream.
pub struct Bindings<'p> {
    plan: &'p ExecutionPlan,
    slots: Vec<Slot>,
    /// By-value scalars, one aligned word each.
    scalars: Vec<u64>,
    /// The same scalars as bound (for the graph interpreter's variant pack).
    values: Vec<Scalar>,
    /// cudarc's ordering guards of the buffers bound with [`Bindings::bind`]: they record the
    /// buffers' use on the stream when the bindings drop, after the work is enqueued.
    guards: Vec<SyncOnDrop<'p>>,
}

impl std::fmt::Debug for Bindings<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bindings")
            .field("graph", &self.plan.graph_name())
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl<'p> Bindings<'p> {
    /// Empty bindings for `plan`.
    pub fn new(plan: &'p ExecutionPlan) -> Self {
        Bindings {
            plan,
            slots: vec![Slot::Empty; plan.real_tensors().len()],
            scalars: Vec::new(),
            values: Vec::new(),
            guards: Vec::new(),
        }
    }

    fn position(&self, t: TensorId) -> Result<usize> {
        self.plan
            .real_tensors()
            .iter()
            .position(|r| r.id == t)
            .ok_or_else(|| Error::Binding {
                graph: self.plan.graph_name().into(),
                tensor: format!("#{}", t.index()),
                problem: BindingProblem::NotInPlan,
            })
    }

    /// Binds a device buffer to a real tensor, borrowed mutably while the bindings live
    /// (cuDNN may write any tensor it is given). The address is taken through cudarc's
    /// `DevicePtrMut` on `stream` (the handle's): with cudarc's event tracking on, `stream`
    /// waits for the buffer's earlier work and the use is recorded when the bindings drop.
    pub fn bind<T: DeviceElement>(
        &mut self,
        t: TensorId,
        buffer: &'p mut CudaSlice<T>,
        stream: &'p CudaStream,
    ) -> Result<&mut Self> {
        let i = self.position(t)?;
        let bytes = buffer.len() * std::mem::size_of::<T>();
        let (ptr, guard) = buffer.device_ptr_mut(stream);
        self.guards.push(guard);
        self.slots[i] = Slot::Device {
            ptr,
            bytes,
            dtype: T::DTYPE,
        };
        Ok(self)
    }

    /// Binds a byte buffer as `dtype` elements (memory laid out by the caller, such as an amp
    /// region or a scratch buffer), borrowed as [`Bindings::bind`] borrows.
    pub fn bind_bytes(
        &mut self,
        t: TensorId,
        buffer: &'p mut CudaSlice<u8>,
        dtype: DataType,
        stream: &'p CudaStream,
    ) -> Result<&mut Self> {
        let i = self.position(t)?;
        let bytes = buffer.len();
        let (ptr, guard) = buffer.device_ptr_mut(stream);
        self.guards.push(guard);
        self.slots[i] = Slot::Device { ptr, bytes, dtype };
        Ok(self)
    }

    /// Binds a raw device pointer spanning `bytes` bytes of `dtype` elements.
    ///
    /// # Safety
    /// If the bindings are executed (or put in a CUDA graph): until that work has finished
    /// on the device, `ptr .. ptr + bytes` is live device memory of the handle's context
    /// holding `dtype` elements, that nothing frees and no other stream uses unless ordered
    /// with the handle's stream by the caller (cudarc's event tracking cannot see a raw
    /// address). Only checking them ([`Bindings::check`]) needs nothing.
    pub unsafe fn bind_raw(
        &mut self,
        t: TensorId,
        ptr: u64,
        bytes: usize,
        dtype: DataType,
    ) -> Result<&mut Self> {
        let i = self.position(t)?;
        self.slots[i] = Slot::Device { ptr, bytes, dtype };
        Ok(self)
    }

    /// Binds a host value to a by-value scalar tensor.
    pub fn bind_scalar(&mut self, t: TensorId, value: Scalar) -> Result<&mut Self> {
        let i = self.position(t)?;
        let real = &self.plan.real_tensors()[i];
        if real.dtype != value.dtype() {
            return Err(self.problem(
                i,
                BindingProblem::WrongType {
                    expected: real.dtype,
                    got: value.dtype(),
                },
            ));
        }
        self.scalars.push(value.word());
        self.values.push(value);
        self.slots[i] = Slot::Host(self.scalars.len() - 1);
        Ok(self)
    }

    fn problem(&self, i: usize, problem: BindingProblem) -> Error {
        Error::Binding {
            graph: self.plan.graph_name().into(),
            tensor: self.plan.real_tensors()[i].name.clone(),
            problem,
        }
    }

    /// Checks every binding (present, non-null, aligned, right type and kind, large enough)
    /// without running anything.
    pub fn check(&self) -> Result<()> {
        self.checked().map(|_| ())
    }

    /// Checks every binding and returns (uids, pointers) in uid order.
    fn checked(&self) -> Result<(Vec<i64>, Vec<*mut c_void>)> {
        let mut uids = Vec::with_capacity(self.slots.len());
        let mut ptrs = Vec::with_capacity(self.slots.len());
        for (i, (slot, real)) in self.slots.iter().zip(self.plan.real_tensors()).enumerate() {
            let ptr = match (*slot, real.by_value) {
                (Slot::Empty, _) => return Err(self.problem(i, BindingProblem::Missing)),
                (Slot::Host(k), true) => &self.scalars[k] as *const u64 as *mut c_void,
                (Slot::Device { ptr, bytes, dtype }, false) => {
                    if ptr == 0 {
                        return Err(self.problem(i, BindingProblem::Null));
                    }
                    if ptr % TENSOR_ALIGNMENT != 0 {
                        return Err(self.problem(
                            i,
                            BindingProblem::Misaligned {
                                address: ptr,
                                alignment: TENSOR_ALIGNMENT,
                            },
                        ));
                    }
                    if dtype != real.dtype {
                        return Err(self.problem(
                            i,
                            BindingProblem::WrongType {
                                expected: real.dtype,
                                got: dtype,
                            },
                        ));
                    }
                    if bytes < real.bytes {
                        return Err(self.problem(
                            i,
                            BindingProblem::TooSmall {
                                needed: real.bytes,
                                got: bytes,
                            },
                        ));
                    }
                    ptr as *mut c_void
                }
                _ => return Err(self.problem(i, BindingProblem::WrongKind)),
            };
            uids.push(real.uid);
            ptrs.push(ptr);
        }
        Ok((uids, ptrs))
    }

    /// The variant pack as the graph interpreter takes it ([`crate::interp::VariantPack`]):
    /// (uid, device address) of every device tensor and (uid, value) of every by-value one,
    /// in uid order, after the checks of [`Bindings::check`].
    #[allow(clippy::type_complexity)]
    pub fn pack(&self) -> Result<(Vec<(i64, u64)>, Vec<(i64, Scalar)>)> {
        self.check()?;
        let mut pointers = Vec::new();
        let mut scalars = Vec::new();
        for (slot, real) in self.slots.iter().zip(self.plan.real_tensors()) {
            match *slot {
                Slot::Device { ptr, .. } => pointers.push((real.uid, ptr)),
                Slot::Host(k) => scalars.push((real.uid, self.values[k])),
                Slot::Empty => {}
            }
        }
        Ok((pointers, scalars))
    }

    fn variant_pack(&self, workspace: u64) -> Result<Descriptor> {
        let (uids, ptrs) = self.checked()?;
        let mut vp = Descriptor::new(K::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        vp.set(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?
            .set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &ptrs)?
            .set_one(
                A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                workspace as *mut c_void,
            )?;
        vp.finalize()?;
        Ok(vp)
    }
}

/// Workspace for one execution.
#[derive(Debug)]
pub enum Workspace<'a> {
    /// The handle's internal pool (grown on demand).
    Pooled,
    /// A caller-provided buffer.
    Buffer(&'a CudaSlice<u8>),
}

impl ExecutionPlan {
    /// Runs `enqueue` with the address of the workspace this plan needs (0 for none), holding
    /// the workspace's cudarc ordering guard until `enqueue` has returned: the guard records
    /// the workspace's use on the handle's stream when it drops, and work on other streams
    /// that later touches the buffer waits for that event, so it must be recorded after
    /// cuDNN's work is enqueued, not before ([`enqueue_holding`]).
    fn with_workspace<R>(
        &self,
        handle: &Handle,
        ws: Workspace<'_>,
        for_graph: bool,
        enqueue: impl FnOnce(u64) -> Result<R>,
    ) -> Result<R> {
        handle.ready()?;
        let need = self.workspace_size();
        match ws {
            Workspace::Pooled if need == 0 => enqueue(0),
            Workspace::Pooled => handle.with_pooled_workspace(need, for_graph, enqueue),
            Workspace::Buffer(buf) => {
                if buf.len() < need {
                    return Err(Error::WorkspaceTooSmall {
                        graph: self.graph_name().into(),
                        needed: need,
                        got: buf.len(),
                    });
                }
                let (ptr, guard) = buf.device_ptr(handle.stream());
                enqueue_holding(guard, || enqueue(ptr))
            }
        }
    }

    /// Enqueues the plan on the handle's stream. Every binding is checked first; nothing is
    /// sent to cuDNN when one is wrong.
    pub fn execute(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
        ws: Workspace<'_>,
    ) -> Result<()> {
        if handle.simulated {
            return self.with_workspace(handle, ws, false, |_| {
                self.execute_simulated(handle, bindings)
            });
        }
        self.with_workspace(handle, ws, false, |workspace| {
            let vp = bindings.variant_pack(workspace)?;
            bind_context(&handle.stream)?;
            // SAFETY: the plan and variant pack are finalized descriptors; every pointer in the
            // pack was checked non-null, aligned, of the right type and large enough; the
            // caller keeps the buffers alive until the stream reaches this work (Bindings'
            // contract), and the workspace's guard is held until this call has returned.
            unsafe {
                (handle.lib.api.cudnnBackendExecute)(handle.raw, self.descriptor().raw(), vp.raw())
            }
            .result()
            .map_err(|e| Error::cudnn(format!("execute plan `{}`", self.graph_name()), e))
        })
    }

    fn simulator_error(&self, problem: impl Into<String>) -> Error {
        Error::Simulator {
            plan: self.graph_name().into(),
            problem: problem.into(),
        }
    }

    /// The simulated device's execution: the plan's graph in the graph interpreter over the
    /// bound addresses (the simulator's allocations), in stream order. The handle's stream is
    /// synchronized first (what was enqueued before has run), then the interpreter runs on
    /// the calling thread, so its errors come back from this call.
    ///
    /// During a stream capture the execution is recorded instead, as a host node of the
    /// capture's graph that runs the interpreter over this call's variant pack at every
    /// replay, in stream order (`crate::sim::record_replay`, which documents who owns the
    /// recorded pack). A failure at replay faults the simulated context and is kept on the
    /// handle ([`Handle::replay_failure`]).
    fn execute_simulated(&self, handle: &Handle, bindings: &Bindings<'_>) -> Result<()> {
        let (pointers, scalars) = bindings.pack()?;
        let graph = self.source_graph().ok_or_else(|| {
            self.simulator_error(
                "the plan keeps no graph for the interpreter to run (plans the plan cache \
                 builds or restores keep theirs)",
            )
        })?;
        if handle.capturing()? {
            bind_context(&handle.stream)?;
            let replay = crate::sim::Replay {
                plan: self.graph_name().into(),
                graph: graph.clone(),
                pointers,
                scalars,
                fault: handle.replay_fault.clone(),
            };
            return crate::sim::record_replay(handle.stream.cu_stream(), replay).map_err(|e| {
                self.simulator_error(format!("record the execution into the capture: {e}"))
            });
        }
        let memory = crate::sim::SimMemory::new()
            .ok_or_else(|| self.simulator_error("the simulated driver no longer answers"))?;
        bind_context(&handle.stream)?;
        handle
            .stream
            .synchronize()
            .map_err(|e| driver("synchronize before a simulated plan execution", e))?;
        let pack = crate::interp::VariantPack {
            pointers: &pointers,
            scalars: &scalars,
        };
        // SAFETY: the simulator's allocations are host memory handed out as device pointers,
        // live for their whole length while the table lists them; the bound buffers are kept
        // alive and unaliased by the caller until the stream reaches this work (Bindings'
        // contract), and the stream has just been synchronized, so no enqueued work touches
        // them while the interpreter runs (eager mode runs work at enqueue; the adversarial
        // mode's queues of other streams are ordered through the bindings' event waits, which
        // the synchronize ran).
        unsafe { crate::interp::execute(graph, &pack, &memory, &crate::interp::Options::default()) }
            .map_err(|e| self.simulator_error(e.to_string()))
    }

    fn require_cuda_graph_api(&self) -> Result<()> {
        if self.supports_cuda_graph_api() {
            return Ok(());
        }
        Err(Error::CudnnMessage(format!(
            "plan `{}` ({}) does not support cuDNN's CUDA-graph API; capture its stream instead",
            self.graph_name(),
            self.engine_tag()
        )))
    }

    /// Adds this plan's kernels to a new CUDA graph (cuDNN's native population API; only for
    /// plans whose engine reports support, see [`ExecutionPlan::supports_cuda_graph_api`]).
    pub fn populate_cuda_graph(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
    ) -> Result<CudaGraph> {
        if handle.simulated {
            return Err(self.simulator_error(
                "cuDNN's CUDA-graph population is not simulated; capture the stream instead",
            ));
        }
        self.require_cuda_graph_api()?;
        self.with_workspace(handle, Workspace::Pooled, true, |workspace| {
            self.populate_with(handle, bindings, workspace)
        })
    }

    fn populate_with(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
        workspace: u64,
    ) -> Result<CudaGraph> {
        let vp = bindings.variant_pack(workspace)?;
        let mut graph: cudarc::driver::sys::CUgraph = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags must be 0.
        unsafe { cudarc::driver::sys::cuGraphCreate(&mut graph, 0) }
            .result()
            .map_err(|e| driver("cuGraphCreate", e))?;
        let owned = CudaGraph { raw: graph };
        // SAFETY: handle, plan and pack are live and finalized; `graph` is an empty CUDA graph
        // owned by `owned`, which destroys it on every path.
        unsafe {
            (handle.lib.api.cudnnBackendPopulateCudaGraph)(
                handle.raw,
                self.descriptor().raw(),
                vp.raw(),
                owned.raw as sys::cudaGraph_t,
            )
        }
        .result()
        .map_err(|e| {
            Error::cudnn(
                format!("populate a CUDA graph from `{}`", self.graph_name()),
                e,
            )
        })?;
        Ok(owned)
    }
}

impl ExecutionPlan {
    /// Points a CUDA graph made by [`ExecutionPlan::populate_cuda_graph`] at new buffers.
    pub fn update_cuda_graph(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
        graph: &mut CudaGraph,
    ) -> Result<()> {
        if handle.simulated {
            return Err(self.simulator_error(
                "cuDNN's CUDA-graph population is not simulated; capture the stream instead",
            ));
        }
        self.require_cuda_graph_api()?;
        self.with_workspace(handle, Workspace::Pooled, true, |workspace| {
            let vp = bindings.variant_pack(workspace)?;
            // SAFETY: handle, plan and pack are live and finalized; `graph` was populated from
            // this plan and is exclusively borrowed.
            unsafe {
                (handle.lib.api.cudnnBackendUpdateCudaGraph)(
                    handle.raw,
                    self.descriptor().raw(),
                    vp.raw(),
                    graph.raw as sys::cudaGraph_t,
                )
            }
            .result()
            .map_err(|e| {
                Error::cudnn(
                    format!("update the CUDA graph of `{}`", self.graph_name()),
                    e,
                )
            })
        })
    }
}

/// An owned CUDA graph (destroyed on drop).
#[derive(Debug)]
pub struct CudaGraph {
    raw: cudarc::driver::sys::CUgraph,
}

impl CudaGraph {
    /// The raw graph, for instantiation by the caller.
    pub fn raw(&self) -> cudarc::driver::sys::CUgraph {
        self.raw
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: `raw` came from cuGraphCreate and is destroyed once.
        let _ = unsafe { cudarc::driver::sys::cuGraphDestroy(self.raw) };
    }
}

/// Runs `enqueue` while holding `guards` (cudarc's ordering guards of the memory the work
/// uses), dropping them only after it returns, on success and on error alike: a guard records
/// the memory's use on the stream when it drops, so dropped before the work is enqueued it
/// would order later users after nothing. Every address handed to cuDNN goes through here or
/// through [`Bindings`], which hold their guards until they drop.
fn enqueue_holding<G, R>(guards: G, enqueue: impl FnOnce() -> R) -> R {
    let out = enqueue();
    drop(guards);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A guard that logs when it drops.
    struct Logged<'a>(&'a RefCell<Vec<&'static str>>);

    impl Drop for Logged<'_> {
        fn drop(&mut self) {
            self.0.borrow_mut().push("guard dropped");
        }
    }

    /// The workspace's guard outlives the enqueue, whether it succeeds or fails.
    #[test]
    fn guards_drop_only_after_the_work_is_enqueued() {
        for ok in [true, false] {
            let log = RefCell::new(Vec::new());
            let out: std::result::Result<u64, &str> = enqueue_holding(Logged(&log), || {
                log.borrow_mut().push("enqueued");
                if ok {
                    Ok(7)
                } else {
                    Err("refused")
                }
            });
            assert_eq!(out.is_ok(), ok);
            assert_eq!(*log.borrow(), ["enqueued", "guard dropped"]);
        }
        // cudarc's own guard type goes through unchanged (a guard with no event to record,
        // as cudarc hands out where tracking is off).
        let out = enqueue_holding(SyncOnDrop::Record(None), || 3);
        assert_eq!(out, 3);
    }
}
