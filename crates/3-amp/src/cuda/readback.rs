//! [`Readback`]: an asynchronous device → host copy into page-locked memory, polled without
//! waiting: how a training loop logs device-side values (a metrics log, counters) without a
//! host synchronization inside a step.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

use crate::cuda::{driver_error, zeroed_pinned};
use crate::error::{AmpError, ExecError};

/// A page-locked host buffer that receives copies of one device buffer.
///
/// [`Readback::request`] enqueues the copy and records an event behind it, [`Readback::poll`]
/// hands out the latest copy that has arrived and never waits, [`Readback::wait`] blocks
/// until the latest request has arrived (for the end of a run). A request made while an
/// earlier one is still in flight replaces it (the earlier snapshot is then never seen).
///
/// Never call [`Readback::request`] on a stream that is being captured into a CUDA graph:
/// the copy and the event belong to the eager stream.
pub struct Readback {
    pinned: PinnedHostSlice<u8>,
    done: CudaEvent,
    pending: bool,
    last: Option<Vec<u8>>,
}

impl fmt::Debug for Readback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Readback")
            .field("len", &self.pinned.len())
            .field("pending", &self.pending)
            .field("arrived", &self.last.is_some())
            .finish_non_exhaustive()
    }
}

impl Readback {
    /// Page-locked room for `len` bytes (zeroed) in `ctx`.
    ///
    /// # Errors
    /// A driver error when the pinned allocation or the event cannot be made.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, AmpError> {
        let len = len.max(1);
        let pinned = zeroed_pinned(ctx, len, "a readback")?;
        let done = ctx
            .new_event(None)
            .map_err(|e| driver_error("create a readback event", e))?;
        Ok(Readback {
            pinned,
            done,
            pending: false,
            last: None,
        })
    }

    /// Bytes it receives.
    pub fn len(&self) -> usize {
        self.pinned.len()
    }

    /// Whether it receives nothing (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.pinned.len() == 0
    }

    /// Enqueues a copy of all of `src` on `stream` and an event behind it; never waits.
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when `src` is longer than the pinned buffer; a driver error.
    pub fn request(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
    ) -> Result<(), AmpError> {
        if src.len() > self.pinned.len() {
            return Err(ExecError::OutOfBounds {
                op: "Readback::request",
                what: "source buffer".into(),
                start: 0,
                end: src.len(),
                len: self.pinned.len(),
            }
            .into());
        }
        stream
            .memcpy_dtoh(src, &mut self.pinned)
            .map_err(|e| driver_error("copy to pinned host memory", e))?;
        self.done
            .record(stream)
            .map_err(|e| driver_error("record the readback event", e))?;
        self.pending = true;
        Ok(())
    }

    fn take_arrived(&mut self) -> Result<(), AmpError> {
        // The copy has completed, so this does not wait.
        let bytes = self
            .pinned
            .as_slice()
            .map_err(|e| driver_error("read pinned readback memory", e))?;
        self.last = Some(bytes.to_vec());
        self.pending = false;
        Ok(())
    }

    /// The latest copy that has arrived (`None` before the first); never waits.
    ///
    /// # Errors
    /// A driver error (including one of earlier asynchronous work).
    pub fn poll(&mut self) -> Result<Option<&[u8]>, AmpError> {
        if self.pending {
            let done = self
                .done
                .try_is_complete()
                .map_err(|e| driver_error("query the readback event", e))?;
            if done {
                self.take_arrived()?;
            }
        }
        Ok(self.last.as_deref())
    }

    /// Waits until the latest request has arrived and returns it (`None` when nothing was
    /// ever requested). This blocks the host: for the end of a run, not inside a step.
    ///
    /// # Errors
    /// A driver error.
    pub fn wait(&mut self) -> Result<Option<&[u8]>, AmpError> {
        if self.pending {
            self.done
                .synchronize()
                .map_err(|e| driver_error("wait for the readback event", e))?;
            self.take_arrived()?;
        }
        Ok(self.last.as_deref())
    }
}

impl Drop for Readback {
    fn drop(&mut self) {
        // The pinned memory must outlive a copy still in flight into it. Drop cannot report
        // errors.
        if self.pending {
            let _ = self.done.synchronize();
        }
    }
}
