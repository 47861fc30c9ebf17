//! The unsafe half of [`crate::nccl`]: the communicator (the library and its entry points are in
//! `library.rs`). See that module for where the library is looked for and how ranks meet.

// The crate denies unsafe code everywhere else; FFI into libnccl cannot avoid it.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut, DevicePtrMut};
use cudarc::nccl::sys::{ncclComm_t, ncclUniqueId};
use cudarc::nccl::NcclType;

use super::library::{nccl_library, NcclLibrary};
use super::NcclId;
use crate::{Collective, Communicator, DistError, ReduceOp};

/// One rank of an NCCL communicator, on a CUDA stream of its own context: a
/// [`Collective`] over device buffers ([`CudaSlice`] and [`CudaViewMut`] of any
/// [`NcclType`]: f32, f16, bf16, f64, u32, …).
///
/// The collectives are enqueued on the communicator's stream ([`NcclComm::stream`]) and
/// return once enqueued: the stream is made to wait for the buffer's earlier work, and the
/// buffer's later users wait for the collective (cudarc's event tracking). Buffers of
/// different lengths on different ranks are not detected (NCCL would wait or read past the
/// shorter one): every rank must call the same collectives on the same shapes.
///
/// Asynchronous failures (a peer lost mid-collective) show in [`NcclComm::check_async`].
/// [`NcclComm::destroy`] waits for the stream and frees the communicator; dropping it
/// instead aborts whatever is still pending (`ncclCommAbort`, which never waits for peers).
pub struct NcclComm {
    /// The communicator, shared with its [`NcclAbort`] handles.
    shared: Arc<Shared>,
    lib: &'static NcclLibrary,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

/// A communicator handle moved from the initialisation thread.
struct RawComm(ncclComm_t);

// SAFETY: a communicator may be used from any thread, one at a time; this one is handed over
// whole (the initialising thread keeps no copy).
unsafe impl Send for RawComm {}

/// A communicator's state, shared by the [`NcclComm`] and its [`NcclAbort`] handles.
///
/// Calls through the communicator take `calls` (one at a time, as NCCL requires) and load the
/// handle; an abort does not wait for `calls`: NCCL's abort exists to end a call that hangs in
/// another thread (a collective waiting on a dead peer, or its connection setup), so it swaps
/// the handle out and aborts it at once, and every later call finds it gone.
struct Shared {
    /// The `ncclComm_t`; null once aborted, destroyed or dropped.
    comm: AtomicPtr<c_void>,
    /// Why it was aborted.
    reason: Mutex<Option<String>>,
    /// Held through each call made with the handle.
    calls: Mutex<()>,
}

impl Shared {
    /// The live handle, or why there is none.
    fn comm(&self, op: &'static str) -> Result<ncclComm_t, DistError> {
        let p = self.comm.load(Ordering::Acquire);
        if !p.is_null() {
            return Ok(p.cast());
        }
        let message = match &*lock(&self.reason) {
            Some(why) => format!("the communicator was aborted: {why}"),
            None => "the communicator was destroyed".into(),
        };
        Err(DistError::Nccl {
            op,
            code: None,
            message,
        })
    }

    /// Takes the handle out (null afterwards), recording `reason` if it is the first.
    fn take(&self, reason: Option<&str>) -> ncclComm_t {
        if let Some(why) = reason {
            lock(&self.reason).get_or_insert_with(|| why.to_string());
        }
        self.comm
            .swap(std::ptr::null_mut(), Ordering::AcqRel)
            .cast()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A handle that aborts an [`NcclComm`] from another thread (a watchdog's), or reads NCCL's
/// asynchronous error. Stop the threads that use it before the communicator is dropped.
#[derive(Clone)]
pub struct NcclAbort {
    shared: Arc<Shared>,
    lib: &'static NcclLibrary,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for NcclAbort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclAbort").finish_non_exhaustive()
    }
}

impl NcclAbort {
    /// Aborts the communicator (`ncclCommAbort`: its pending and hanging calls return, peers
    /// are not waited for); later calls on it fail naming `reason`. Does nothing to one
    /// already aborted or freed.
    pub fn abort(&self, reason: &str) {
        let comm = self.shared.take(Some(reason));
        if comm.is_null() {
            return;
        }
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: `comm` was live and is now out of `shared`, so this is its only abort or
        // destroy; a call already inside NCCL with it is what the abort ends.
        unsafe { (self.lib.comm_abort)(comm) };
    }

    /// NCCL's asynchronous error on the communicator, if any (`ncclCommGetAsyncError`); `None`
    /// once it is aborted or freed.
    pub fn async_error(&self) -> Option<String> {
        let comm = self.shared.comm("ncclCommGetAsyncError").ok()?;
        async_error(self.lib, comm).err().map(|e| e.to_string())
    }
}

/// `ncclCommGetAsyncError` on a live communicator.
fn async_error(lib: &NcclLibrary, comm: ncclComm_t) -> Result<(), DistError> {
    let mut state: c_int = 0;
    // SAFETY: `comm` is live (only an abort or the owner's drop frees it, and the owner stops
    // its watchdog first); NCCL writes one int into the local.
    let code = unsafe { (lib.async_error)(comm, &mut state) };
    lib.check("ncclCommGetAsyncError", code, Some(comm))?;
    // 7: ncclInProgress, only for non-blocking communicators (not made here).
    if state == 7 {
        return Ok(());
    }
    lib.check("an enqueued collective", state, Some(comm))
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.stream.context().ordinal())
            .field("nccl", &self.lib.path)
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// Rank `rank` of a communicator of `world` ranks (`ncclCommInitRank`), communicating on
    /// `stream` (its CUDA context's device is this rank's GPU). Every rank calls this with
    /// the same `id` and `world`; it returns once all of them have. NCCL's blocking
    /// initialisation has no timeout of its own: a rank that never calls this holds the
    /// others here ([`NcclComm::new_within`] bounds the wait).
    /// [`crate::bootstrap::exchange_id`] over TCP returns on rank 0 only once every
    /// rank has fetched the id (within its timeout), which narrows that window to a rank
    /// failing between the exchange and this call.
    ///
    /// # Errors
    /// [`DistError::NcclUnavailable`] without the library (checked before the stream is
    /// touched); [`DistError::InvalidRank`] for `rank >= world`; [`DistError::Nccl`] for a
    /// group too large for NCCL, a context that cannot be bound, or NCCL's own failure.
    pub fn new(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: &NcclId,
    ) -> Result<Self, DistError> {
        Self::new_within(stream, rank, world, id, None)
    }

    /// [`NcclComm::new`], giving up after `timeout` (when given): NCCL's initialisation then
    /// runs on a thread of its own, and a rank whose peers do not all arrive in time gets
    /// [`DistError::Nccl`] saying so instead of waiting forever (a communicator made after
    /// that is aborted as soon as it exists).
    ///
    /// # Errors
    /// As [`NcclComm::new`]; [`DistError::Nccl`] when the group did not form in time.
    pub fn new_within(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: &NcclId,
        timeout: Option<Duration>,
    ) -> Result<Self, DistError> {
        let lib = nccl_library()?;
        if world == 0 {
            return Err(DistError::EmptyGroup);
        }
        if rank >= world {
            return Err(DistError::InvalidRank {
                rank,
                world,
                why: "an NCCL rank must be below the world size",
            });
        }
        let n = c_int::try_from(world).map_err(|_| DistError::Nccl {
            op: "ncclCommInitRank",
            code: None,
            message: format!("world size {world} does not fit NCCL's int"),
        })?;
        let r = c_int::try_from(rank).unwrap_or(c_int::MAX); // rank < world <= c_int::MAX
        bind(&stream, "ncclCommInitRank")?;
        let mut raw = ncclUniqueId { internal: [0; 128] };
        for (dst, src) in raw.internal.iter_mut().zip(id.to_bytes()) {
            *dst = src as c_char;
        }
        let init = move || -> Result<RawComm, DistError> {
            let mut comm: ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is a live local NCCL writes the new communicator into; the id is
            // passed by value as NCCL declares; the stream's context is current on this thread.
            let code = unsafe { (lib.comm_init_rank)(&mut comm, n, raw, r) };
            lib.check("ncclCommInitRank", code, None)?;
            Ok(RawComm(comm))
        };
        let comm = match timeout {
            None => init()?.0,
            Some(timeout) => {
                let (tx, rx) = std::sync::mpsc::channel();
                let theirs = stream.clone();
                std::thread::Builder::new()
                    .name("nccl-init".into())
                    .spawn(move || {
                        let made = bind(&theirs, "ncclCommInitRank").and_then(|()| init());
                        if let Err(std::sync::mpsc::SendError(Ok(late))) = tx.send(made) {
                            // The caller gave up: nothing will use this communicator.
                            // SAFETY: `late` is a live communicator no one else holds.
                            unsafe { (lib.comm_abort)(late.0) };
                        }
                    })
                    .map_err(|e| DistError::Nccl {
                        op: "ncclCommInitRank",
                        code: None,
                        message: format!("cannot start the initialisation thread: {e}"),
                    })?;
                match rx.recv_timeout(timeout) {
                    Ok(made) => made?.0,
                    Err(_) => {
                        return Err(DistError::Nccl {
                            op: "ncclCommInitRank",
                            code: None,
                            message: format!(
                                "rank {rank}: the group of {world} did not form within {:.0} s \
                                 (a rank did not start, or failed before joining)",
                                timeout.as_secs_f64()
                            ),
                        })
                    }
                }
            }
        };
        if comm.is_null() {
            return Err(DistError::Nccl {
                op: "ncclCommInitRank",
                code: None,
                message: "NCCL returned success and no communicator".into(),
            });
        }
        Ok(NcclComm {
            shared: Arc::new(Shared {
                comm: AtomicPtr::new(comm.cast()),
                reason: Mutex::new(None),
                calls: Mutex::new(()),
            }),
            lib,
            stream,
            rank,
            world,
        })
    }

    /// A handle that can abort this communicator from another thread (`NcclAbort`).
    pub fn abort_handle(&self) -> NcclAbort {
        NcclAbort {
            shared: self.shared.clone(),
            lib: self.lib,
            stream: self.stream.clone(),
        }
    }

    /// The stream the collectives are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The NCCL library in use.
    pub fn library(&self) -> &'static NcclLibrary {
        self.lib
    }

    /// An error NCCL has recorded on this communicator since, e.g. a network failure during
    /// an enqueued collective (`ncclCommGetAsyncError`). After one, drop the communicator.
    ///
    /// # Errors
    /// [`DistError::Nccl`] with NCCL's error.
    pub fn check_async(&self) -> Result<(), DistError> {
        let _calls = lock(&self.shared.calls);
        async_error(self.lib, self.shared.comm("ncclCommGetAsyncError")?)
    }

    /// Waits for the stream (every enqueued collective), then frees the communicator
    /// (`ncclCommDestroy`).
    ///
    /// # Errors
    /// [`DistError::Nccl`]: the stream's wait failed (the communicator is then aborted) or
    /// NCCL's own error.
    pub fn destroy(self) -> Result<(), DistError> {
        let _calls = lock(&self.shared.calls);
        let comm = self.shared.take(None);
        if comm.is_null() {
            // Aborted: the reason.
            return self.shared.comm("ncclCommDestroy").map(|_| ());
        }
        let synced = bind(&self.stream, "ncclCommDestroy").and_then(|()| {
            self.stream.synchronize().map_err(|e| DistError::Nccl {
                op: "ncclCommDestroy",
                code: None,
                message: format!("waiting for the communication stream: {e}"),
            })
        });
        if let Err(e) = synced {
            // SAFETY: `comm` is live and no longer reachable through `self`.
            unsafe { (self.lib.comm_abort)(comm) };
            return Err(e);
        }
        // SAFETY: `comm` is live, no longer reachable through `self`, and its work is done.
        let code = unsafe { (self.lib.comm_destroy)(comm) };
        self.lib.check("ncclCommDestroy", code, None)
    }

    fn all_reduce_on<T: NcclType, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        self.same_context(buf.stream(), "ncclAllReduce")?;
        bind(&self.stream, "ncclAllReduce")?;
        let count = buf.len();
        let red = nccl_op(op);
        let _calls = lock(&self.shared.calls);
        let comm = self.shared.comm("ncclAllReduce")?;
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` addresses `count` elements of `T` in the stream's context (checked
        // above), which the stream now waits for and which stay borrowed until `_record`
        // marks the collective's end on the stream; in place is allowed by NCCL; `comm` is
        // live (calls are serialized; only an abort may end it meanwhile, which is what abort
        // is for) and the context is current.
        let code = unsafe {
            (self.lib.all_reduce)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                T::as_nccl_type() as c_int,
                red,
                comm,
                self.stream.cu_stream() as *mut c_void,
            )
        };
        self.lib.check("ncclAllReduce", code, Some(comm))
    }

    /// `ncclAllReduce` of `count` elements of `T` from `send` into `recv` (the same address
    /// for in place), enqueued on [`NcclComm::stream`] with no cudarc event recorded or
    /// waited on: the caller orders the stream with the buffers' other users (a gradient
    /// bucket's sum is ordered by its byte ranges, `cudnn_cbr_amp::cuda::dist_grads`).
    ///
    /// # Safety
    /// `send` and `recv` each address `count` elements of `T` in device memory of the
    /// communicator's context, the same address or ranges that do not overlap; the stream has
    /// been ordered after every earlier write of `send` and use of `recv`; neither is freed,
    /// nor `recv` used (or `send` written) on another stream, until that stream is ordered
    /// after the collective.
    pub unsafe fn all_reduce_raw<T: NcclType>(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        bind(&self.stream, "ncclAllReduce")?;
        let _calls = lock(&self.shared.calls);
        let comm = self.shared.comm("ncclAllReduce")?;
        // SAFETY: the addresses and their ordering are the caller's contract; `comm` is live
        // (calls are serialized; only an abort may end it meanwhile, which is what abort is
        // for) and the context is current.
        let code = unsafe {
            (self.lib.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                T::as_nccl_type() as c_int,
                nccl_op(op),
                comm,
                self.stream.cu_stream() as *mut c_void,
            )
        };
        self.lib.check("ncclAllReduce", code, Some(comm))
    }

    fn broadcast_on<T: NcclType, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        root: usize,
    ) -> Result<(), DistError> {
        if root >= self.world {
            return Err(DistError::InvalidRank {
                rank: root,
                world: self.world,
                why: "a broadcast root must be in the group",
            });
        }
        self.same_context(buf.stream(), "ncclBroadcast")?;
        bind(&self.stream, "ncclBroadcast")?;
        let count = buf.len();
        let _calls = lock(&self.shared.calls);
        let comm = self.shared.comm("ncclBroadcast")?;
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: as in `all_reduce_on`; `root` < world <= c_int::MAX (checked in `new`).
        let code = unsafe {
            (self.lib.broadcast)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                T::as_nccl_type() as c_int,
                root as c_int,
                comm,
                self.stream.cu_stream() as *mut c_void,
            )
        };
        self.lib.check("ncclBroadcast", code, Some(comm))
    }

    fn same_context(&self, theirs: &Arc<CudaStream>, op: &'static str) -> Result<(), DistError> {
        if Arc::ptr_eq(theirs.context(), self.stream.context()) {
            return Ok(());
        }
        Err(DistError::Nccl {
            op,
            code: None,
            message: format!(
                "the buffer lives on device {}, the communicator on device {}",
                theirs.context().ordinal(),
                self.stream.context().ordinal()
            ),
        })
    }
}

/// NCCL's code for `op`.
fn nccl_op(op: ReduceOp) -> c_int {
    (match op {
        ReduceOp::Sum => cudarc::nccl::sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => cudarc::nccl::sys::ncclRedOp_t::ncclMax,
    }) as c_int
}

/// Makes the stream's context current on this thread, as NCCL expects.
fn bind(stream: &CudaStream, op: &'static str) -> Result<(), DistError> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| DistError::Nccl {
            op,
            code: None,
            message: format!("binding the CUDA context: {e}"),
        })
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let _calls = lock(&self.shared.calls);
        let comm = self.shared.take(None);
        if comm.is_null() {
            return;
        }
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: `comm` was live and is now out of `shared`, so nothing reaches it again;
        // abort frees it without waiting for peers (the result is ignored: nothing is left to
        // report it to).
        unsafe { (self.lib.comm_abort)(comm) };
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
}

impl<T: NcclType> Collective<CudaSlice<T>> for NcclComm {
    fn all_reduce(&mut self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<(), DistError> {
        self.all_reduce_on(buf, op)
    }
    fn broadcast(&mut self, buf: &mut CudaSlice<T>, root: usize) -> Result<(), DistError> {
        self.broadcast_on(buf, root)
    }
}

impl<T: NcclType> Collective<CudaViewMut<'_, T>> for NcclComm {
    fn all_reduce(&mut self, buf: &mut CudaViewMut<'_, T>, op: ReduceOp) -> Result<(), DistError> {
        self.all_reduce_on(buf, op)
    }
    fn broadcast(&mut self, buf: &mut CudaViewMut<'_, T>, root: usize) -> Result<(), DistError> {
        self.broadcast_on(buf, root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_ops_map_to_ncclh_codes() {
        // nccl.h: ncclSum = 0, ncclProd = 1, ncclMax = 2 (a one-rank group cannot tell them
        // apart: every op of one rank is the identity).
        assert_eq!(nccl_op(ReduceOp::Sum), 0);
        assert_eq!(nccl_op(ReduceOp::Max), 2);
        // And the element types a bucket's sum is told: ncclFloat16 = 6, ncclFloat32 = 7.
        assert_eq!(<half::f16 as NcclType>::as_nccl_type() as c_int, 6);
        assert_eq!(<f32 as NcclType>::as_nccl_type() as c_int, 7);
    }
}
