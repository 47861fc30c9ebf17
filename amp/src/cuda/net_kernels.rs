//! Kernels of the network body on [`AmpKernels`]: the residual join ([`AmpKernels::add_f16`])
//! and max pooling.

use cudarc::driver::CudaStream;

use crate::cuda::dev_range::{elems_of, expect_elems, same_count, DevRange, DevRangeMut};
use crate::cuda::launch::{AmpKernels, Arg};
use crate::error::AmpError;
use crate::kernels::entry;
use crate::range::PoolShape;

// Named only by doc links.
#[cfg(doc)]
use crate::error::{CudaError, ExecError};

impl AmpKernels {
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
            self.launch_raw(
                stream,
                &self.f.add_f16,
                entry::ADD_F16,
                self.grid_elems(n),
                &args,
            )
        }
    }

    /// `out = f16(f32(a) + f32(b))` (twin: [`crate::range::add_f16`]), all FP16 with the
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
        self.check_streams(
            stream,
            &[
                ("a", a.buf_stream()),
                ("b", b.buf_stream()),
                ("out", out.buf_stream()),
            ],
        )?;
        let n = elems_of(OP, "a", a.range, 2)?;
        same_count(OP, "b", n, elems_of(OP, "b", b.range, 2)?)?;
        same_count(OP, "out", n, elems_of(OP, "out", out.range, 2)?)?;
        let (ap, _a) = a.addr(stream);
        let (bp, _b) = b.addr(stream);
        let (op, _o) = out.addr_mut(stream);
        // SAFETY: the three ranges lie inside their buffers with n f16 each (checked);
        // `out` is an exclusive borrow, so it overlaps neither input; alive for the call.
        unsafe { self.raw_add_f16(stream, ap, bp, op, n) }
    }

    /// Max-pool forward (twin: [`crate::range::max_pool_forward`]): FP16 NHWC `x` of the
    /// shape's input → FP16 `y` of its output; the first maximum of each window wins.
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for a bad shape, [`ExecError::Misaligned`],
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
        self.check_streams(stream, &[("x", x.buf_stream()), ("y", y.buf_stream())])?;
        expect_elems(OP, "x", x.range, 2, shape.input_elems())?;
        expect_elems(OP, "y", y.range, 2, shape.output_elems())?;
        let (xp, _x) = x.addr(stream);
        let (yp, _y) = y.addr_mut(stream);
        let mut args = vec![Arg::U64(xp), Arg::U64(yp)];
        args.extend(pool_dims(shape));
        let cfg = self.grid(shape.output_elems());
        // SAFETY: `x` holds the shape's input and `y` room for its output (checked above);
        // `y` is an exclusive borrow, so it cannot overlap `x`; the kernel reads x inside the
        // input (windows are clipped to it) and writes y[0..output_elems); both stay alive for
        // the call, and cudarc frees a buffer on its own stream after enqueued work.
        unsafe { self.launch_raw(stream, &self.f.max_pool_forward, OP, cfg, &args) }
    }

    /// Max-pool backward (twin: [`crate::range::max_pool_backward`]): the forward input `x`
    /// and the output gradient `dy` → the input gradient `dx`.
    ///
    /// # Errors
    /// As [`AmpKernels::max_pool_forward`].
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
        self.check_streams(
            stream,
            &[
                ("x", x.buf_stream()),
                ("dy", dy.buf_stream()),
                ("dx", dx.buf_stream()),
            ],
        )?;
        expect_elems(OP, "x", x.range, 2, shape.input_elems())?;
        expect_elems(OP, "dy", dy.range, 2, shape.output_elems())?;
        expect_elems(OP, "dx", dx.range, 2, shape.input_elems())?;
        let (xp, _x) = x.addr(stream);
        let (gp, _g) = dy.addr(stream);
        let (dp, _d) = dx.addr_mut(stream);
        let mut args = vec![Arg::U64(xp), Arg::U64(gp), Arg::U64(dp)];
        args.extend(pool_dims(shape));
        let cfg = self.grid(shape.input_elems());
        // SAFETY: the three ranges hold the shape's element counts (checked above); `dx` is an
        // exclusive borrow, so it overlaps neither input; the kernel reads x and dy inside them
        // and writes dx[0..input_elems); all stay alive for the call.
        unsafe { self.launch_raw(stream, &self.f.max_pool_backward, OP, cfg, &args) }
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
