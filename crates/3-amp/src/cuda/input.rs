//! [`DoubleInput`]: a training loop's batches copied host → device on a stream of their own,
//! into the second of two device input buffers while the current step trains, ordered with
//! CUDA events (the double-buffered transfer of the static AMP design).
//!
//! Per slot (batch `i` uses slot `i % 2`):
//! 1. [`DoubleInput::stage`] (host): waits until the slot's previous host → device copy has
//!    read its page-locked memory, writes the batch there, makes the copy stream wait for the
//!    slot's *consumed* event (the compute stream's last read of the slot's device buffer),
//!    enqueues the copy on the copy stream and records the slot's *copied* event behind it.
//! 2. [`DoubleInput::consume`] (compute stream): waits for the slot's *copied* event, copies
//!    the slot's device buffer into the fixed buffers the step reads (the network's input,
//!    the head's labels), and records the slot's *consumed* event.
//!
//! So the host → device copy of batch `i + 1` runs beside step `i`; the step waits only for
//! its own batch; and a copy never overwrites a slot before the step that read it has.
//!
//! The step reads **fixed** buffers, filled by a device-to-device copy before each step (not
//! inside its CUDA graph): a captured graph binds addresses, and the fixed buffers let one
//! graph serve both slots. The copy costs one read and write of the batch in device memory
//! per step (for ResNet-50's 256 × 224² × 3 FP16 images, 77 MB: tens of microseconds),
//! against a second captured graph per network otherwise.
//!
//! The copy stream is a raw driver stream, not a cudarc [`CudaStream`] of the context: a
//! second cudarc stream would switch the context object into cudarc's multi-stream event
//! tracking, which records events on every buffer access, also inside the step's stream
//! capture. Its work is ordered by the two events alone.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_wait_flags, CUstream, CUstreamCaptureStatus};
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice,
};

use crate::cuda::dev_range::DevRangeMut;
use crate::cuda::{driver_error, zeroed_pinned};
use crate::error::{AmpError, CudaError, ExecError};

struct Slot {
    pinned: PinnedHostSlice<u8>,
    dev: CudaSlice<u8>,
    /// Recorded on the copy stream behind the slot's host → device copy.
    copied: CudaEvent,
    /// Recorded on the compute stream behind the step's read of the slot.
    consumed: CudaEvent,
    /// A host → device copy from `pinned` may still be queued.
    copying: bool,
    /// Bytes staged and not yet consumed (the batch's parts' lengths), or `None`.
    staged: Option<Vec<usize>>,
}

/// Two page-locked host buffers and two device buffers of `capacity` bytes each, and a copy
/// stream of their own (module docs).
pub struct DoubleInput {
    ctx: Arc<CudaContext>,
    /// The compute stream the buffers were allocated on (for their addresses).
    stream: Arc<CudaStream>,
    copy: CUstream,
    slots: [Slot; 2],
}

impl fmt::Debug for DoubleInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DoubleInput")
            .field("capacity", &self.capacity())
            .field(
                "staged",
                &[
                    self.slots[0].staged.is_some(),
                    self.slots[1].staged.is_some(),
                ],
            )
            .finish_non_exhaustive()
    }
}

fn capturing(stream: &CudaStream, op: &'static str) -> Result<(), AmpError> {
    let status = stream
        .capture_status()
        .map_err(|e| driver_error("query the stream's capture status", e))?;
    if status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(ExecError::Capturing { op }.into());
    }
    Ok(())
}

impl DoubleInput {
    /// Two slots of `capacity` bytes (zeroed) on `stream`'s context, and the copy stream.
    ///
    /// # Errors
    /// A driver error when memory, an event or the stream cannot be made.
    pub fn new(stream: &Arc<CudaStream>, capacity: usize) -> Result<Self, AmpError> {
        let capacity = capacity.max(1);
        let ctx = stream.context().clone();
        let slot = || -> Result<Slot, AmpError> {
            let event = || {
                ctx.new_event(None)
                    .map_err(|e| driver_error("create an input event", e))
            };
            Ok(Slot {
                pinned: zeroed_pinned(&ctx, capacity, "input staging")?,
                dev: stream
                    .alloc_zeros::<u8>(capacity)
                    .map_err(|e| driver_error("allocate an input buffer", e))?,
                copied: event()?,
                consumed: event()?,
                copying: false,
                staged: None,
            })
        };
        let slots = [slot()?, slot()?];
        ctx.bind_to_thread()
            .map_err(|e| driver_error("bind the context", e))?;
        let copy = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_error("create the input copy stream", e))?;
        // The slots' device buffers were zeroed on `stream`: the copy stream's first copies
        // must come after that.
        let input = DoubleInput {
            ctx,
            stream: stream.clone(),
            copy,
            slots,
        };
        for s in &input.slots {
            s.consumed
                .record(stream)
                .map_err(|e| driver_error("record an input event", e))?;
        }
        Ok(input)
    }

    /// Bytes one batch may have (all its parts together).
    pub fn capacity(&self) -> usize {
        self.slots[0].pinned.len()
    }

    /// Stages batch `index`'s `parts` into slot `index % 2` (module docs, step 1): the host
    /// waits only while that slot's previous copy has not read its page-locked memory yet.
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when the parts together exceed [`DoubleInput::capacity`];
    /// [`ExecError::Capturing`] when the slot still holds a batch not consumed (a batch
    /// staged twice, or two ahead); a driver error.
    pub fn stage(&mut self, index: u64, parts: &[&[u8]]) -> Result<(), AmpError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > self.capacity() {
            return Err(ExecError::OutOfBounds {
                op: "DoubleInput::stage",
                what: "the batch's parts together".into(),
                start: 0,
                end: total,
                len: self.capacity(),
            }
            .into());
        }
        let copy = self.copy;
        let compute = self.stream.clone();
        let slot = &mut self.slots[(index % 2) as usize];
        if slot.staged.is_some() {
            return Err(ExecError::OutOfBounds {
                op: "DoubleInput::stage",
                what: format!("batch {index}: its slot still holds a batch not consumed"),
                start: 0,
                end: 1,
                len: 0,
            }
            .into());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("bind the context", e))?;
        if slot.copying {
            slot.copied
                .synchronize()
                .map_err(|e| driver_error("wait for an input copy", e))?;
            slot.copying = false;
        }
        // No copy from this slot's page-locked memory is queued any more (waited above).
        let host = slot
            .pinned
            .as_mut_slice()
            .map_err(|e| driver_error("map pinned input memory", e))?;
        let mut at = 0;
        for p in parts {
            host[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        // SAFETY: `copy` is this value's own live stream and `consumed` a live event of the
        // same context (both outlive the call: the stream is destroyed only in Drop).
        unsafe {
            result::stream::wait_event(
                copy,
                slot.consumed.cu_event(),
                CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_error("order the input copy after the step's read", e))?;
        // The copy is ordered by the events; cudarc's guard is the compute stream's (it records
        // nothing unless the context tracks events across several cudarc streams).
        let (dst, _guard) = slot.dev.device_ptr_mut(&compute);
        // SAFETY: `dst` starts the slot's live device buffer of `capacity` bytes and the copy
        // writes `total` ≤ `capacity` bytes; the source is page-locked memory of the slot that
        // the host does not touch again before `copied` completes (waited above before any
        // write); the copy stream waited for the compute stream's last read of the buffer.
        unsafe { result::memcpy_htod_async(dst, &host[..total], copy) }
            .map_err(|e| driver_error("copy a batch to the device", e))?;
        // SAFETY: as for the wait above.
        unsafe { result::event::record(slot.copied.cu_event(), copy) }
            .map_err(|e| driver_error("record an input event", e))?;
        slot.copying = true;
        slot.staged = Some(parts.iter().map(|p| p.len()).collect());
        Ok(())
    }

    /// Copies batch `index` (staged in slot `index % 2`) into `dsts` on `stream`, one
    /// destination per staged part in order, after the slot's copy (module docs, step 2).
    /// Not during a stream capture.
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when the slot holds no staged batch or a destination's
    /// length differs from its part's; [`CudaError::ContextMismatch`] for another context;
    /// [`ExecError::Capturing`] while `stream` is being captured; a driver error.
    pub fn consume(
        &mut self,
        index: u64,
        stream: &Arc<CudaStream>,
        dsts: &mut [DevRangeMut<'_>],
    ) -> Result<(), AmpError> {
        capturing(stream, "DoubleInput::consume")?;
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(CudaError::ContextMismatch {
                what: "the input's compute stream".into(),
            }
            .into());
        }
        let slot = &mut self.slots[(index % 2) as usize];
        let Some(lens) = slot.staged.as_ref() else {
            return Err(ExecError::OutOfBounds {
                op: "DoubleInput::consume",
                what: format!("batch {index}: nothing staged in its slot"),
                start: 0,
                end: 1,
                len: 0,
            }
            .into());
        };
        if lens.len() != dsts.len() {
            return Err(ExecError::OutOfBounds {
                op: "DoubleInput::consume",
                what: format!(
                    "{} destinations for {} staged parts",
                    dsts.len(),
                    lens.len()
                ),
                start: 0,
                end: dsts.len(),
                len: lens.len(),
            }
            .into());
        }
        for (d, &len) in dsts.iter().zip(lens) {
            let r = d.range();
            if r.len() != len {
                return Err(ExecError::OutOfBounds {
                    op: "DoubleInput::consume",
                    what: "a destination for its staged part".into(),
                    start: r.start,
                    end: r.start + len,
                    len: r.end,
                }
                .into());
            }
            if d.buf_stream().context().cu_ctx() != self.ctx.cu_ctx() {
                return Err(CudaError::ContextMismatch {
                    what: "an input destination".into(),
                }
                .into());
            }
        }
        stream
            .wait(&slot.copied)
            .map_err(|e| driver_error("order the step after its input copy", e))?;
        let (src, _read) = slot.dev.device_ptr(stream);
        let mut at = 0u64;
        for (d, &len) in dsts.iter_mut().zip(lens) {
            let (dst, _write) = d.addr_mut(stream);
            // The parts were staged in the slot back to back, within its capacity, and each
            // destination was checked above to hold exactly `len` bytes in this context.
            // SAFETY: `src + at` and `dst` start `len`-byte ranges of two distinct live device
            // buffers; the copy is ordered on `stream` after the slot's host → device copy.
            unsafe { result::memcpy_dtod_async(dst, src + at, len, stream.cu_stream()) }
                .map_err(|e| driver_error("copy a batch into the step's buffers", e))?;
            at += len as u64;
        }
        slot.consumed
            .record(stream)
            .map_err(|e| driver_error("record an input event", e))?;
        slot.staged = None;
        Ok(())
    }
}

impl Drop for DoubleInput {
    fn drop(&mut self) {
        // The page-locked memory and the device buffers must outlive the copies that use
        // them, and the stream its work. Drop cannot report errors.
        let _ = self.ctx.bind_to_thread();
        for slot in &self.slots {
            let _ = slot.copied.synchronize();
            let _ = slot.consumed.synchronize();
        }
        // SAFETY: the stream is this value's own; nothing enqueued on it is pending (its last
        // work recorded `copied`, waited above), and it is not used after this.
        let _ = unsafe { result::stream::destroy(self.copy) };
    }
}
