//! [`Upload`]: host → device copies staged through page-locked memory, double-buffered, so a
//! training loop feeds each step's batch without the host waiting for the device.
//!
//! A copy from pageable memory may make the driver wait for the stream before staging it
//! (CUDA's "API synchronization behavior"): behind the previous step's work, once per step.
//! Copying from page-locked memory is truly asynchronous; two slots let the host fill one
//! while the other's copy is still queued, and it waits only when both are.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use crate::cuda::dev_range::DevRangeMut;
use crate::cuda::{driver_error, zeroed_pinned};
use crate::error::{AmpError, CudaError, ExecError};

struct Slot {
    pinned: PinnedHostSlice<u8>,
    /// Recorded behind the slot's last copies.
    done: CudaEvent,
    pending: bool,
}

/// Two page-locked staging slots of `capacity` bytes each for host → device copies.
///
/// Never call [`Upload::upload`] on a stream that is being captured into a CUDA graph: the
/// copies and events belong to the eager stream (the graph then reads the device buffers).
pub struct Upload {
    slots: [Slot; 2],
    next: usize,
}

impl fmt::Debug for Upload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upload")
            .field("capacity", &self.capacity())
            .field("pending", &[self.slots[0].pending, self.slots[1].pending])
            .finish_non_exhaustive()
    }
}

impl Upload {
    /// Two slots of `capacity` bytes (zeroed) in `ctx`.
    ///
    /// # Errors
    /// A driver error when the pinned allocation or an event cannot be made.
    pub fn new(ctx: &Arc<CudaContext>, capacity: usize) -> Result<Self, AmpError> {
        let capacity = capacity.max(1);
        let slot = || -> Result<Slot, AmpError> {
            let pinned = zeroed_pinned(ctx, capacity, "upload staging")?;
            let done = ctx
                .new_event(None)
                .map_err(|e| driver_error("create a staging event", e))?;
            Ok(Slot {
                pinned,
                done,
                pending: false,
            })
        };
        Ok(Upload {
            slots: [slot()?, slot()?],
            next: 0,
        })
    }

    /// Bytes one upload can carry.
    pub fn capacity(&self) -> usize {
        self.slots[0].pinned.len()
    }

    /// Copies each `(source, destination)` pair on `stream` through the next slot, then
    /// records the slot's event. Waits only while that slot's previous copies are still
    /// queued (the device is two uploads behind).
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when a source's length differs from its destination
    /// range's or all sources together exceed [`Upload::capacity`];
    /// [`CudaError::ContextMismatch`] for a destination in another context;
    /// [`ExecError::Capturing`] while `stream` is being captured; a driver error.
    pub fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        parts: &mut [(&[u8], DevRangeMut<'_>)],
    ) -> Result<(), AmpError> {
        // In a capture the copies would become graph nodes reading the slot at replay time,
        // long after the host refilled it: refuse rather than replay stale batches.
        let status = stream
            .capture_status()
            .map_err(|e| driver_error("query the stream's capture status", e))?;
        if status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(ExecError::Capturing {
                op: "Upload::upload",
            }
            .into());
        }
        let mut total = 0usize;
        for (src, dst) in parts.iter() {
            let range = dst.range();
            if src.len() != range.len() {
                return Err(ExecError::OutOfBounds {
                    op: "Upload::upload",
                    what: "a source for its destination range".into(),
                    start: range.start,
                    end: range.start + src.len(),
                    len: range.end,
                }
                .into());
            }
            if dst.buf_stream().context().cu_ctx() != stream.context().cu_ctx() {
                return Err(CudaError::ContextMismatch {
                    what: "an upload destination".into(),
                }
                .into());
            }
            total += src.len();
        }
        if total > self.capacity() {
            return Err(ExecError::OutOfBounds {
                op: "Upload::upload",
                what: "the sources together".into(),
                start: 0,
                end: total,
                len: self.capacity(),
            }
            .into());
        }
        let slot = &mut self.slots[self.next];
        self.next ^= 1;
        if slot.pending {
            slot.done
                .synchronize()
                .map_err(|e| driver_error("wait for a staging slot", e))?;
            slot.pending = false;
        }
        // No copy from this slot is queued any more (waited above), so the host may write it.
        let host = slot
            .pinned
            .as_mut_slice()
            .map_err(|e| driver_error("map pinned staging memory", e))?;
        let mut at = 0;
        for (src, dst) in parts.iter_mut() {
            host[at..at + src.len()].copy_from_slice(src);
            let (addr, _sync) = dst.addr_mut(stream);
            // SAFETY: `addr` starts a range of `src.len()` bytes inside a live device buffer
            // of the stream's context (checked above, via DevRangeMut); the source is
            // page-locked memory that stays untouched until the slot's event completes.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    addr,
                    &host[at..at + src.len()],
                    stream.cu_stream(),
                )
            }
            .map_err(|e| driver_error("copy from pinned staging memory", e))?;
            at += src.len();
        }
        slot.done
            .record(stream)
            .map_err(|e| driver_error("record a staging event", e))?;
        slot.pending = true;
        Ok(())
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        // The pinned memory must outlive the copies that read it. Drop cannot report errors.
        for slot in &self.slots {
            if slot.pending {
                let _ = slot.done.synchronize();
            }
        }
    }
}
