//! Kernels of the network body on [`NetKernels`]: the residual join ([`NetKernels::add_f16`])
//! and max pooling.

use cudarc::driver::CudaStream;
use cudnn_cbr_amp::cuda::{Arg, DevRange, DevRangeMut};
use cudnn_cbr_amp::AmpError;

use crate::cuda::NetKernels;
use crate::kernels::entry;
use crate::pool::PoolShape;

// Named only by doc links.
#[cfg(doc)]
use cudnn_cbr_amp::{CudaError, ExecError};

impl NetKernels {
    /// # Safety
    /// `a`, `b` hold `n` f16, `out` room for `n` f16 overlapping neither; alive until the
    /// launch has run.
    pub(crate) unsafe fn raw_add_f16(
        &self,
        stream: &CudaStream,
        a: u64,
        b: u64,
        out: u64,
        n: usize,
    ) -> Result<(), AmpError> {
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::U64(a), Arg::U64(b), Arg::U64(out), Arg::size(n)];
        // SAFETY: elements [0, n) of each pointer only.
        unsafe {
            self.set
                .launch(stream, entry::ADD_F16, self.set.grid_elems(n), &args)
        }
    }

    /// `out = f16(f32(a) + f32(b))` (twin: [`crate::head::add_f16`]), all FP16 with the
    /// same element count: the gradient of an activation that feeds two branches.
    ///
    /// # Errors
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`], [`CudaError::ContextMismatch`];
    /// a driver error.
    pub fn add_f16(
        &self,
        stream: &CudaStream,
        a: DevRange<'_>,
        b: DevRange<'_>,
        mut out: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::ADD_F16;
        self.set.check_streams(
            stream,
            &[
                ("a", a.buf_stream()),
                ("b", b.buf_stream()),
                ("out", out.buf_stream()),
            ],
        )?;
        let n = a.elems(OP, "a", 2)?;
        b.expect_elems(OP, "b", 2, n)?;
        out.expect_elems(OP, "out", 2, n)?;
        let (ap, _a) = a.addr(stream);
        let (bp, _b) = b.addr(stream);
        let (op, _o) = out.addr_mut(stream);
        // SAFETY: the three ranges lie inside their buffers with n f16 each (checked);
        // `out` is an exclusive borrow, so it overlaps neither input; alive for the call.
        unsafe { self.raw_add_f16(stream, ap, bp, op, n) }
    }

    /// Max-pool forward (twin: [`crate::pool::max_pool_forward`]): FP16 NHWC `x` of the
    /// shape's input → FP16 `y` of its output; the first maximum of each window wins.
    ///
    /// # Errors
    /// [`cudnn_cbr_amp::RangeOpError::InvalidConfig`] for a bad shape, [`ExecError::Misaligned`],
    /// [`ExecError::ElemCount`], [`CudaError::ContextMismatch`]; a driver error.
    pub fn max_pool_forward(
        &self,
        stream: &CudaStream,
        shape: &PoolShape,
        x: DevRange<'_>,
        mut y: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::MAX_POOL_FORWARD;
        shape.validate(OP)?;
        self.set
            .check_streams(stream, &[("x", x.buf_stream()), ("y", y.buf_stream())])?;
        x.expect_elems(OP, "x", 2, shape.input_elems())?;
        y.expect_elems(OP, "y", 2, shape.output_elems())?;
        let (xp, _x) = x.addr(stream);
        let (yp, _y) = y.addr_mut(stream);
        let mut args = vec![Arg::U64(xp), Arg::U64(yp)];
        args.extend(pool_dims(shape));
        let cfg = self.set.grid(shape.output_elems());
        // SAFETY: `x` holds the shape's input and `y` room for its output (checked above);
        // `y` is an exclusive borrow, so it cannot overlap `x`; the kernel reads x inside the
        // input (windows are clipped to it) and writes y[0..output_elems); both stay alive for
        // the call, and cudarc frees a buffer on its own stream after enqueued work.
        unsafe { self.set.launch(stream, OP, cfg, &args) }
    }

    /// Max-pool backward (twin: [`crate::pool::max_pool_backward`]): the forward input `x`
    /// and the output gradient `dy` → the input gradient `dx`.
    ///
    /// # Errors
    /// As [`NetKernels::max_pool_forward`].
    pub fn max_pool_backward(
        &self,
        stream: &CudaStream,
        shape: &PoolShape,
        x: DevRange<'_>,
        dy: DevRange<'_>,
        mut dx: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::MAX_POOL_BACKWARD;
        shape.validate(OP)?;
        self.set.check_streams(
            stream,
            &[
                ("x", x.buf_stream()),
                ("dy", dy.buf_stream()),
                ("dx", dx.buf_stream()),
            ],
        )?;
        x.expect_elems(OP, "x", 2, shape.input_elems())?;
        dy.expect_elems(OP, "dy", 2, shape.output_elems())?;
        dx.expect_elems(OP, "dx", 2, shape.input_elems())?;
        let (xp, _x) = x.addr(stream);
        let (gp, _g) = dy.addr(stream);
        let (dp, _d) = dx.addr_mut(stream);
        let mut args = vec![Arg::U64(xp), Arg::U64(gp), Arg::U64(dp)];
        args.extend(pool_dims(shape));
        let cfg = self.set.grid(shape.input_elems());
        // SAFETY: the three ranges hold the shape's element counts (checked above); `dx` is an
        // exclusive borrow, so it overlaps neither input; the kernel reads x and dy inside them
        // and writes dx[0..input_elems); all stay alive for the call.
        unsafe { self.set.launch(stream, OP, cfg, &args) }
    }
}

/// The size arguments of the pool kernels: (batch, h, w, c, oh, ow, kernel, stride, pad).
fn pool_dims(shape: &PoolShape) -> [Arg; 9] {
    [
        Arg::size(shape.batch),
        Arg::size(shape.h),
        Arg::size(shape.w),
        Arg::size(shape.channels),
        Arg::size(shape.out_h()),
        Arg::size(shape.out_w()),
        Arg::size(shape.kernel),
        Arg::size(shape.stride),
        Arg::size(shape.pad),
    ]
}
