//! The loss-gradient seed on [`AmpKernels`]: softmax cross-entropy backward, scaled by the
//! loss scale read from S on the device (twin: [`crate::range::softmax_xent_backward`]), over
//! whole buffers or byte ranges of buffers shared with cuDNN.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::f16;

use crate::cuda::dev_range::{check_s, elems_of, expect_elems, DevRange, DevRangeMut};
use crate::cuda::kernel_set::{Arg, BLOCK};
use crate::cuda::launch::AmpKernels;
use crate::error::AmpError;
use crate::kernels::entry;

// Named only by doc links.
#[cfg(doc)]
use crate::error::{CudaError, ExecError};

impl AmpKernels {
    /// # Safety
    /// `logits` holds `batch * classes` f16, `labels` `batch` i32, `s` is a 4-aligned S
    /// image; `dlogits` has room for `batch * classes` f16 and `loss` for `batch` f32 (or is
    /// 0); outputs overlap nothing; `classes >= 1`; all alive until the launch has run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn raw_softmax_xent_backward(
        &self,
        stream: &CudaStream,
        logits: u64,
        labels: u64,
        dlogits: u64,
        loss: u64,
        s: u64,
        batch: usize,
        classes: usize,
    ) -> Result<(), AmpError> {
        if batch == 0 {
            return Ok(());
        }
        let threads = classes.next_multiple_of(32).min(BLOCK as usize);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(batch.min(self.max_blocks() as usize)).unwrap_or(self.max_blocks()),
                1,
                1,
            ),
            // threads <= 256, so the cast is exact.
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::U64(logits),
            Arg::U64(labels),
            Arg::U64(dlogits),
            Arg::U64(loss),
            Arg::U64(s),
            Arg::size(batch),
            Arg::size(classes),
        ];
        // SAFETY: the caller guarantees the buffers for these counts; blockDim is a multiple
        // of 32 and at most 256, as the kernel requires; a null loss is checked by the kernel.
        unsafe { self.launch_raw(stream, entry::SOFTMAX_XENT_BACKWARD, cfg, &args) }
    }

    /// The loss-gradient seed (twin: [`crate::range::softmax_xent_backward`]): `logits` and
    /// `dlogits` are `[batch, classes]` FP16, `labels` has `batch` entries, `loss` (optional)
    /// `batch` FP32, the scale comes from `s`.
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for `classes == 0`,
    /// [`crate::RangeOpError::LengthMismatch`] for a buffer of the wrong length, S-range
    /// errors, [`CudaError::ContextMismatch`]; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_xent_backward(
        &self,
        stream: &CudaStream,
        logits: &CudaSlice<f16>,
        labels: &CudaSlice<i32>,
        classes: usize,
        s: DevRange<'_>,
        dlogits: &mut CudaSlice<f16>,
        loss: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::SOFTMAX_XENT_BACKWARD;
        use crate::RangeOpError as R;
        if classes == 0 {
            return Err(R::InvalidConfig {
                op: OP,
                field: "classes",
                value: "0".into(),
                why: "must be >= 1",
            }
            .into());
        }
        self.check_streams(
            stream,
            &[
                ("logits", logits.stream()),
                ("labels", labels.stream()),
                ("dlogits", dlogits.stream()),
                ("s", s.buf_stream()),
            ],
        )?;
        check_s(OP, s.range)?;
        let batch = labels.len();
        let total = batch.checked_mul(classes).ok_or(R::InvalidConfig {
            op: OP,
            field: "classes",
            value: classes.to_string(),
            why: "batch * classes overflows",
        })?;
        let len = |what, expected, got| {
            if expected == got {
                Ok(())
            } else {
                Err(R::LengthMismatch {
                    op: OP,
                    what,
                    expected,
                    got,
                })
            }
        };
        len("logits", total, logits.len())?;
        len("dlogits", total, dlogits.len())?;
        if let Some(l) = loss.as_deref() {
            self.check_buf(stream, "loss", l.stream())?;
            len("loss", batch, l.len())?;
        }
        if batch == 0 {
            return Ok(());
        }
        let (xp, _x) = logits.device_ptr(stream);
        let (lp, _l) = labels.device_ptr(stream);
        let (dp, _d) = dlogits.device_ptr_mut(stream);
        let (sp, _s) = s.addr(stream);
        let (op, _o) = match loss {
            Some(l) => {
                let (p, sync) = l.device_ptr_mut(stream);
                (p, Some(sync))
            }
            None => (0u64, None),
        };
        // SAFETY: every buffer's length was checked against batch and classes, S is at least
        // 20 bytes 4-aligned, `classes >= 1`; `dlogits` and `loss` are exclusive borrows, so
        // they overlap nothing, and the loss pointer is null only when absent; the borrows
        // keep the buffers alive for the call and cudarc orders their release after it.
        unsafe { self.raw_softmax_xent_backward(stream, xp, lp, dp, op, sp, batch, classes) }
    }

    /// [`AmpKernels::softmax_xent_backward`] over byte ranges (e.g. buffers shared with
    /// cuDNN): `logits` FP16 `[batch, classes]`, `labels` i32 `[batch]`, `s` the S region,
    /// `dlogits` FP16 like `logits`, `loss` (optional) FP32 `[batch]`.
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for `classes == 0`, S-range errors,
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`], [`CudaError::ContextMismatch`];
    /// a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_xent_backward_range(
        &self,
        stream: &CudaStream,
        classes: usize,
        logits: DevRange<'_>,
        labels: DevRange<'_>,
        s: DevRange<'_>,
        mut dlogits: DevRangeMut<'_>,
        loss: Option<DevRangeMut<'_>>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::SOFTMAX_XENT_BACKWARD;
        self.check_streams(
            stream,
            &[
                ("logits", logits.buf_stream()),
                ("labels", labels.buf_stream()),
                ("s", s.buf_stream()),
                ("dlogits", dlogits.buf_stream()),
            ],
        )?;
        check_s(OP, s.range)?;
        let batch = elems_of(OP, "labels", labels.range, 4)?;
        check_classes(OP, batch, classes)?;
        expect_elems(OP, "logits", logits.range, 2, batch * classes)?;
        expect_elems(OP, "dlogits", dlogits.range, 2, batch * classes)?;
        let mut loss = loss;
        if let Some(l) = &loss {
            self.check_buf(stream, "loss", l.buf_stream())?;
            expect_elems(OP, "loss", l.range, 4, batch)?;
        }
        let (xp, _x) = logits.addr(stream);
        let (yp, _y) = labels.addr(stream);
        let (sp, _s) = s.addr(stream);
        let (dp, _d) = dlogits.addr_mut(stream);
        let (lp, _l) = match loss.as_mut() {
            Some(l) => {
                let (p, sync) = l.addr_mut(stream);
                (p, Some(sync))
            }
            None => (0, None),
        };
        // SAFETY: every range lies inside its buffer with the counts checked above, S at
        // least 20 bytes 4-aligned; `dlogits` and `loss` are exclusive borrows, so they
        // overlap nothing; `classes >= 1` (validated).
        unsafe { self.raw_softmax_xent_backward(stream, xp, yp, dp, lp, sp, batch, classes) }
    }
}

/// `classes` at least 1, and `batch * classes` FP32 values representable in bytes.
fn check_classes(op: &'static str, batch: usize, classes: usize) -> Result<(), AmpError> {
    use crate::RangeOpError as R;
    if classes == 0 {
        return Err(R::InvalidConfig {
            op,
            field: "classes",
            value: "0".into(),
            why: "must be >= 1",
        }
        .into());
    }
    if classes
        .checked_mul(batch.max(1))
        .and_then(|v| v.checked_mul(4))
        .is_none()
    {
        return Err(R::InvalidConfig {
            op,
            field: "classes",
            value: classes.to_string(),
            why: "batch * classes overflows",
        }
        .into());
    }
    Ok(())
}
