//! The network head on [`NetKernels`]: global average pooling, the FC layer and the metrics
//! log, as raw launches over checked addresses and checked launches over [`DevRange`]s.

use cudarc::driver::CudaStream;
use cudnn_cbr_amp::cuda::{Arg, DevRange, DevRangeMut, ONE_THREAD};
use cudnn_cbr_amp::AmpError;

use crate::cuda::NetKernels;
use crate::head::{metrics_log_capacity, HeadShape, METRICS_LOG_HEADER};
use crate::kernels::entry;

// Named only by doc links.
#[cfg(doc)]
use cudnn_cbr_amp::{CudaError, ExecError};

impl NetKernels {
    // ------------------------------------------------------------------ the network head
    //
    // Each raw launch takes device addresses the caller has checked: every address is inside
    // a live allocation of the stream's context with room for the stated element counts of
    // the kernel's types, outputs do not overlap inputs or each other, and all stay alive
    // until the stream has run the launch.

    /// # Safety
    /// `a` holds `shape.activation_elems()` f16, `pooled` room for `shape.pooled_elems()`
    /// f32; no overlap; alive until the launch has run.
    pub(crate) unsafe fn raw_gap_forward(
        &self,
        stream: &CudaStream,
        a: u64,
        pooled: u64,
        shape: &HeadShape,
    ) -> Result<(), AmpError> {
        let args = [
            Arg::U64(a),
            Arg::U64(pooled),
            Arg::size(shape.batch),
            Arg::size(shape.pixels),
            Arg::size(shape.features),
        ];
        let cfg = self.set.grid(shape.pooled_elems());
        // SAFETY: the kernel reads a[0..batch*pixels*features) and writes
        // pooled[0..batch*features), as the caller guarantees.
        unsafe { self.set.launch(stream, entry::GAP_FORWARD, cfg, &args) }
    }

    /// # Safety
    /// `dpooled` holds `shape.pooled_elems()` f32, `da` room for `shape.activation_elems()`
    /// f16; no overlap; alive until the launch has run.
    pub(crate) unsafe fn raw_gap_backward(
        &self,
        stream: &CudaStream,
        dpooled: u64,
        da: u64,
        shape: &HeadShape,
    ) -> Result<(), AmpError> {
        let args = [
            Arg::U64(dpooled),
            Arg::U64(da),
            Arg::size(shape.batch),
            Arg::size(shape.pixels),
            Arg::size(shape.features),
        ];
        let cfg = self.set.grid(shape.activation_elems());
        // SAFETY: reads dpooled[0..batch*features), writes da[0..batch*pixels*features).
        unsafe { self.set.launch(stream, entry::GAP_BACKWARD, cfg, &args) }
    }

    /// # Safety
    /// `x` holds `shape.pooled_elems()` f32, `w` `shape.weight_elems()` f32, `b`
    /// `shape.classes` f32, `logits` room for `shape.logits_elems()` f16; `logits` overlaps
    /// none of them; alive until the launch has run.
    pub(crate) unsafe fn raw_fc_forward(
        &self,
        stream: &CudaStream,
        x: u64,
        w: u64,
        b: u64,
        logits: u64,
        shape: &HeadShape,
    ) -> Result<(), AmpError> {
        let args = [
            Arg::U64(x),
            Arg::U64(w),
            Arg::U64(b),
            Arg::U64(logits),
            Arg::size(shape.batch),
            Arg::size(shape.features),
            Arg::size(shape.classes),
        ];
        let cfg = self.set.grid(shape.logits_elems());
        // SAFETY: the kernel reads x, w, b and writes logits within the counts above.
        unsafe { self.set.launch(stream, entry::FC_FORWARD, cfg, &args) }
    }

    /// # Safety
    /// `dlogits` holds `shape.logits_elems()` f16, `x` `shape.pooled_elems()` f32, `w`
    /// `shape.weight_elems()` f32; `dw` has room for `shape.weight_elems()` f32, `db` for
    /// `shape.classes` f32, `dx` for `shape.pooled_elems()` f32; the three outputs overlap
    /// nothing; all alive until the launch has run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn raw_fc_backward(
        &self,
        stream: &CudaStream,
        dlogits: u64,
        x: u64,
        w: u64,
        dw: u64,
        db: u64,
        dx: u64,
        shape: &HeadShape,
    ) -> Result<(), AmpError> {
        let args = [
            Arg::U64(dlogits),
            Arg::U64(x),
            Arg::U64(w),
            Arg::U64(dw),
            Arg::U64(db),
            Arg::U64(dx),
            Arg::size(shape.batch),
            Arg::size(shape.features),
            Arg::size(shape.classes),
        ];
        let cfg = self
            .set
            .grid(shape.classes + shape.weight_elems() + shape.pooled_elems());
        // SAFETY: the kernel reads dlogits, x, w and writes dw, db, dx within the counts
        // above, as the caller guarantees.
        unsafe { self.set.launch(stream, entry::FC_BACKWARD, cfg, &args) }
    }

    /// # Safety
    /// `logits` holds `batch * classes` f16, `labels` `batch` i32, `loss` `batch` f32 or is
    /// 0; `log` is a 4-aligned metrics log of `metrics_log_bytes(capacity)` bytes with
    /// `capacity >= 1`, overlapping none of the inputs; all alive until the launch has run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn raw_head_metrics(
        &self,
        stream: &CudaStream,
        logits: u64,
        labels: u64,
        loss: u64,
        log: u64,
        batch: usize,
        classes: usize,
        capacity: usize,
    ) -> Result<(), AmpError> {
        let args = [
            Arg::U64(logits),
            Arg::U64(labels),
            Arg::U64(loss),
            Arg::U64(log),
            Arg::size(batch),
            Arg::size(classes),
            Arg::size(capacity),
        ];
        let cfg = ONE_THREAD;
        // SAFETY: one thread reads the inputs within the counts above (loss only when
        // non-null) and writes the log's count and entry `count % capacity`.
        unsafe { self.set.launch(stream, entry::HEAD_METRICS, cfg, &args) }
    }

    /// Global average pooling (twin: [`crate::head::gap_forward`]): `a` holds the last
    /// stage's FP16 activation `[batch, pixels, features]`, `pooled` receives FP32
    /// `[batch, features]`.
    ///
    /// # Errors
    /// [`cudnn_cbr_amp::RangeOpError::InvalidConfig`] for a bad shape, [`ExecError::Misaligned`],
    /// [`ExecError::ElemCount`] for a range of the wrong size,
    /// [`CudaError::ContextMismatch`]; a driver error.
    pub fn gap_forward(
        &self,
        stream: &CudaStream,
        shape: &HeadShape,
        a: DevRange<'_>,
        mut pooled: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::GAP_FORWARD;
        shape.validate(OP)?;
        self.set.check_streams(
            stream,
            &[("a", a.buf_stream()), ("pooled", pooled.buf_stream())],
        )?;
        a.expect_elems(OP, "a", 2, shape.activation_elems())?;
        pooled.expect_elems(OP, "pooled", 4, shape.pooled_elems())?;
        let (ap, _a) = a.addr(stream);
        let (pp, _p) = pooled.addr_mut(stream);
        // SAFETY: both ranges lie inside their buffers (checked at construction) and hold
        // exactly the shape's element counts (checked above); `pooled` is borrowed mutably,
        // so it cannot overlap `a`; the borrows keep both alive for the call and cudarc frees
        // a buffer on its own stream, after work enqueued on it.
        unsafe { self.raw_gap_forward(stream, ap, pp, shape) }
    }

    /// The pooling's backward (twin: [`crate::head::gap_backward`]): FP32 `dpooled`
    /// `[batch, features]` → FP16 `da` `[batch, pixels, features]`.
    ///
    /// # Errors
    /// As [`NetKernels::gap_forward`].
    pub fn gap_backward(
        &self,
        stream: &CudaStream,
        shape: &HeadShape,
        dpooled: DevRange<'_>,
        mut da: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::GAP_BACKWARD;
        shape.validate(OP)?;
        self.set.check_streams(
            stream,
            &[("dpooled", dpooled.buf_stream()), ("da", da.buf_stream())],
        )?;
        dpooled.expect_elems(OP, "dpooled", 4, shape.pooled_elems())?;
        da.expect_elems(OP, "da", 2, shape.activation_elems())?;
        let (gp, _g) = dpooled.addr(stream);
        let (dp, _d) = da.addr_mut(stream);
        // SAFETY: as in `gap_forward`: checked ranges with the shape's counts, the output
        // exclusively borrowed.
        unsafe { self.raw_gap_backward(stream, gp, dp, shape) }
    }

    /// The FC layer's forward (twin: [`crate::head::fc_forward`]): FP32 `x`
    /// `[batch, features]`, FP32 `w` `[classes, features]` and `b` `[classes]` (e.g. slots of
    /// region W) → FP16 `logits` `[batch, classes]`.
    ///
    /// # Errors
    /// As [`NetKernels::gap_forward`].
    pub fn fc_forward(
        &self,
        stream: &CudaStream,
        shape: &HeadShape,
        x: DevRange<'_>,
        w: DevRange<'_>,
        b: DevRange<'_>,
        mut logits: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::FC_FORWARD;
        shape.validate(OP)?;
        self.set.check_streams(
            stream,
            &[
                ("x", x.buf_stream()),
                ("w", w.buf_stream()),
                ("b", b.buf_stream()),
                ("logits", logits.buf_stream()),
            ],
        )?;
        x.expect_elems(OP, "x", 4, shape.pooled_elems())?;
        w.expect_elems(OP, "w", 4, shape.weight_elems())?;
        b.expect_elems(OP, "b", 4, shape.classes)?;
        logits.expect_elems(OP, "logits", 2, shape.logits_elems())?;
        let (xp, _x) = x.addr(stream);
        let (wp, _w) = w.addr(stream);
        let (bp, _b) = b.addr(stream);
        let (lp, _l) = logits.addr_mut(stream);
        // SAFETY: every range lies inside its buffer with the shape's element count
        // (checked); `logits` is borrowed mutably, so it overlaps none of the inputs; the
        // borrows keep the buffers alive for the call.
        unsafe { self.raw_fc_forward(stream, xp, wp, bp, lp, shape) }
    }

    /// The FC layer's backward (twin: [`crate::head::fc_backward`]): FP16 `dlogits`, FP32
    /// `x` and `w` → FP32 `dw` `[classes, features]`, `db` `[classes]` and `dx`
    /// `[batch, features]`, all overwritten. To write `dw`/`db` into region G, use
    /// [`crate::cuda::RegionsFc::fc_backward`].
    ///
    /// # Errors
    /// As [`NetKernels::gap_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn fc_backward(
        &self,
        stream: &CudaStream,
        shape: &HeadShape,
        dlogits: DevRange<'_>,
        x: DevRange<'_>,
        w: DevRange<'_>,
        mut dw: DevRangeMut<'_>,
        mut db: DevRangeMut<'_>,
        dx: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::FC_BACKWARD;
        shape.validate(OP)?;
        self.set.check_streams(
            stream,
            &[
                ("w", w.buf_stream()),
                ("dw", dw.buf_stream()),
                ("db", db.buf_stream()),
            ],
        )?;
        w.expect_elems(OP, "w", 4, shape.weight_elems())?;
        dw.expect_elems(OP, "dw", 4, shape.weight_elems())?;
        db.expect_elems(OP, "db", 4, shape.classes)?;
        let (wp, _w) = w.addr(stream);
        let (dwp, _dw) = dw.addr_mut(stream);
        let (dbp, _db) = db.addr_mut(stream);
        let params = FcParams {
            w: wp,
            dw: dwp,
            db: dbp,
        };
        // SAFETY: `w`, `dw` and `db` lie inside their buffers with the shape's counts
        // (checked); `dw` and `db` are exclusive borrows, so they overlap each other, `w`
        // and the activation ranges not at all; the borrows keep them alive for the call.
        unsafe { self.fc_backward_with(stream, shape, dlogits, x, dx, params) }
    }

    /// [`NetKernels::fc_backward`] with the weight and its gradients given as addresses
    /// (slots of a region the caller owns).
    ///
    /// # Safety
    /// `params.w` holds `shape.weight_elems()` f32; `params.dw` has room for as many f32 and
    /// `params.db` for `shape.classes` f32; `dw` and `db` overlap nothing else of the launch;
    /// all three stay alive until the launch has run.
    pub(crate) unsafe fn fc_backward_with(
        &self,
        stream: &CudaStream,
        shape: &HeadShape,
        dlogits: DevRange<'_>,
        x: DevRange<'_>,
        mut dx: DevRangeMut<'_>,
        params: FcParams,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::FC_BACKWARD;
        shape.validate(OP)?;
        self.set.check_streams(
            stream,
            &[
                ("dlogits", dlogits.buf_stream()),
                ("x", x.buf_stream()),
                ("dx", dx.buf_stream()),
            ],
        )?;
        dlogits.expect_elems(OP, "dlogits", 2, shape.logits_elems())?;
        x.expect_elems(OP, "x", 4, shape.pooled_elems())?;
        dx.expect_elems(OP, "dx", 4, shape.pooled_elems())?;
        let (gp, _g) = dlogits.addr(stream);
        let (xp, _x) = x.addr(stream);
        let (dxp, _dx) = dx.addr_mut(stream);
        // SAFETY: the activation ranges were checked here (inside their buffers, the shape's
        // counts, `dx` exclusive), the parameter addresses by the caller's contract.
        unsafe { self.raw_fc_backward(stream, gp, xp, params.w, params.dw, params.db, dxp, shape) }
    }

    /// Appends one batch's loss and accuracy to a metrics log (twin:
    /// [`crate::head::head_metrics`] then [`crate::head::metrics_log_append`]): `logits`
    /// FP16 `[batch, classes]`, `labels` i32 `[batch]`, `loss` (optional) the per-row FP32
    /// losses of the loss seed, `log` a log of [`crate::head::metrics_log_bytes`] bytes
    /// (zeroed once before the first append).
    ///
    /// # Errors
    /// [`cudnn_cbr_amp::RangeOpError::InvalidConfig`] for `classes == 0`,
    /// [`cudnn_cbr_amp::RangeOpError::LengthMismatch`] for a log with no room for one entry,
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`], [`CudaError::ContextMismatch`];
    /// a driver error.
    pub fn head_metrics(
        &self,
        stream: &CudaStream,
        classes: usize,
        logits: DevRange<'_>,
        labels: DevRange<'_>,
        loss: Option<DevRange<'_>>,
        mut log: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::HEAD_METRICS;
        self.set.check_streams(
            stream,
            &[
                ("logits", logits.buf_stream()),
                ("labels", labels.buf_stream()),
                ("log", log.buf_stream()),
            ],
        )?;
        let batch = labels.elems(OP, "labels", 4)?;
        HeadShape::new(batch, 1, 1, classes).validate(OP)?;
        logits.expect_elems(OP, "logits", 2, batch * classes)?;
        if let Some(l) = &loss {
            self.set.check_buf(stream, "loss", l.buf_stream())?;
            l.expect_elems(OP, "loss", 4, batch)?;
        }
        let capacity = metrics_log_capacity(log.range().len());
        if capacity == 0 || !log.range().start.is_multiple_of(4) {
            return Err(cudnn_cbr_amp::RangeOpError::LengthMismatch {
                op: OP,
                what: "log (bytes, 4-aligned)",
                expected: METRICS_LOG_HEADER + 8,
                got: log.range().len(),
            }
            .into());
        }
        let (xp, _x) = logits.addr(stream);
        let (yp, _y) = labels.addr(stream);
        let (lp, _l) = match &loss {
            Some(l) => {
                let (p, sync) = l.addr(stream);
                (p, Some(sync))
            }
            None => (0, None),
        };
        let (gp, _g) = log.addr_mut(stream);
        // SAFETY: every range lies inside its buffer with the counts checked above, the log
        // 4-aligned with room for `capacity >= 1` entries; the log is an exclusive borrow,
        // so it overlaps no input; a null loss is what the kernel checks for.
        unsafe { self.raw_head_metrics(stream, xp, yp, lp, gp, batch, classes, capacity) }
    }
}

/// The FC parameter addresses of [`NetKernels::fc_backward_with`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct FcParams {
    /// FP32 weight `[classes, features]`.
    pub(crate) w: u64,
    /// FP32 weight gradient, same shape.
    pub(crate) dw: u64,
    /// FP32 bias gradient `[classes]`.
    pub(crate) db: u64,
}
