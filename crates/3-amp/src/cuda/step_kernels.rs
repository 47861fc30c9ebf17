//! The range ops of the amp step on [`AmpKernels`]: zero, casts, gradient check, loss-scale
//! update, SGD and EMA (the loss seed is in [`super::seed_kernels`]); raw launches over
//! checked addresses (used by [`super::CudaRegions`]) and checked launches over [`DevRange`]s.

use cudarc::driver::{CudaStream, LaunchConfig};

use crate::cuda::dev_range::{check_s, elems_of, same_count, DevRange, DevRangeMut};
use crate::cuda::kernel_set::{Arg, ONE_THREAD};
use crate::cuda::launch::AmpKernels;
use crate::error::AmpError;
use crate::kernels::entry;
use crate::plan::ByteRange;
use crate::range::{s_layout, LossScalePolicy, OverflowPolicy, NORM_THREADS};
use crate::step::RangeOp;

use crate::error::ExecError;
// Named only by doc links.
#[cfg(doc)]
use crate::error::CudaError;

impl AmpKernels {
    // ------------------------------------------------------------------ raw launches
    //
    // Each takes device addresses and element counts that the caller has checked: every
    // address is inside a live allocation of the stream's context with room for `n`
    // elements of the kernel's type, and stays alive until the stream has run the launch.

    /// # Safety
    /// `dst .. dst + nbytes` is live device memory of the stream's context until the launch
    /// has run.
    pub(crate) unsafe fn raw_zero(
        &self,
        stream: &CudaStream,
        dst: u64,
        nbytes: usize,
    ) -> Result<(), AmpError> {
        if nbytes == 0 {
            return Ok(());
        }
        let cfg = self.grid(nbytes.div_ceil(16));
        // SAFETY: `amp_zero_bytes` writes only `dst[0..nbytes)`, which the caller guarantees.
        unsafe {
            self.launch_raw(
                stream,
                entry::ZERO_BYTES,
                cfg,
                &[Arg::U64(dst), Arg::size(nbytes)],
            )
        }
    }

    /// # Safety
    /// `src` holds `n` f32 and `dst` room for `n` f16, live until the launch has run; they
    /// do not overlap.
    pub(crate) unsafe fn raw_cast_f32_to_f16(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        n: usize,
    ) -> Result<(), AmpError> {
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::U64(src), Arg::U64(dst), Arg::size(n)];
        // SAFETY: the kernel touches elements [0, n) of each pointer only, which the caller
        // guarantees exist.
        unsafe { self.launch_raw(stream, entry::CAST_F32_TO_F16, self.grid_elems(n), &args) }
    }

    /// # Safety
    /// `src` holds `n` f16 and `dst` room for `n` f32, live until the launch has run; they
    /// do not overlap.
    pub(crate) unsafe fn raw_cast_f16_to_f32(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        n: usize,
    ) -> Result<(), AmpError> {
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::U64(src), Arg::U64(dst), Arg::size(n)];
        // SAFETY: elements [0, n) of each pointer only, as the caller guarantees.
        unsafe { self.launch_raw(stream, entry::CAST_F16_TO_F32, self.grid_elems(n), &args) }
    }

    /// # Safety
    /// `g` and `acc` hold `n` f32 each and `g16` (when `n16 > 0`) `n16 ≤ n` f16, live until
    /// the launch has run; the three do not overlap.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn raw_accum_grads(
        &self,
        stream: &CudaStream,
        g16: u64,
        g: u64,
        acc: u64,
        n: usize,
        n16: usize,
        drain: bool,
    ) -> Result<(), AmpError> {
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::U64(g16),
            Arg::U64(g),
            Arg::U64(acc),
            Arg::size(n),
            Arg::size(n16.min(n)),
            Arg::U32(u32::from(drain)),
        ];
        // SAFETY: the kernel reads g16[0..n16) and reads/writes g[0..n) and acc[0..n) only,
        // which the caller guarantees exist and do not overlap.
        unsafe { self.launch_raw(stream, entry::ACCUM_GRADS, self.grid_elems(n), &args) }
    }

    /// # Safety
    /// `g` holds `n` f32 (written too under `ClipInf`); `s` is a 4-aligned S image of at
    /// least 20 bytes; both live until the launch has run and do not overlap.
    pub(crate) unsafe fn raw_check(
        &self,
        stream: &CudaStream,
        policy: OverflowPolicy,
        g: u64,
        n: usize,
        s: u64,
    ) -> Result<(), AmpError> {
        if n == 0 {
            return Ok(());
        }
        let cfg = self.grid_elems(n);
        match policy {
            // SAFETY: reads g[0..n), atomically sets s->overflow; both guaranteed by the
            // caller.
            OverflowPolicy::NanOrInf => unsafe {
                self.launch_raw(
                    stream,
                    entry::CHECK_NONFINITE,
                    cfg,
                    &[Arg::U64(g), Arg::size(n), Arg::U64(s)],
                )
            },
            // SAFETY: reads and writes g[0..n), atomically sets s->overflow.
            OverflowPolicy::ClipInf { bound } => unsafe {
                self.launch_raw(
                    stream,
                    entry::CHECK_CLIP,
                    cfg,
                    &[Arg::U64(g), Arg::size(n), Arg::F32(bound), Arg::U64(s)],
                )
            },
        }
    }

    /// # Safety
    /// `g` holds `n` f32; `s` is a whole, 4-aligned S image (its partial sums included); both
    /// live until the launches have run and do not overlap.
    pub(crate) unsafe fn raw_grad_norm(
        &self,
        stream: &CudaStream,
        g: u64,
        n: usize,
        s: u64,
    ) -> Result<(), AmpError> {
        // The reduction's order depends on this geometry (crates/3-amp/kernels/amp_norm.cu), so it is
        // fixed, whatever n is (n = 0 too: the norm is then 0).
        let sumsq = LaunchConfig {
            grid_dim: (s_layout::NORM_BLOCKS as u32, 1, 1),
            block_dim: (NORM_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads g[0..n) and writes S's partial sums, both guaranteed by the caller.
        unsafe {
            self.launch_raw(
                stream,
                entry::GRAD_SUMSQ,
                sumsq,
                &[Arg::U64(g), Arg::size(n), Arg::U64(s)],
            )?;
        }
        // SAFETY: one thread reads the partial sums, the scale and ranks, writes grad_norm.
        unsafe { self.launch_raw(stream, entry::GRAD_NORM, ONE_THREAD, &[Arg::U64(s)]) }
    }

    /// # Safety
    /// `s` is a 4-aligned S image of at least 20 bytes, live until the launch has run.
    pub(crate) unsafe fn raw_loss_scale_update(
        &self,
        stream: &CudaStream,
        s: u64,
        policy: &LossScalePolicy,
    ) -> Result<(), AmpError> {
        let (interval, factor, max_scale) = policy.kernel_args();
        let cfg = ONE_THREAD;
        let args = [
            Arg::U64(s),
            Arg::U32(interval),
            Arg::F32(factor),
            Arg::F32(max_scale),
        ];
        // SAFETY: one thread reads and writes the 20 bytes of S in use.
        unsafe { self.launch_raw(stream, entry::LOSS_SCALE_UPDATE, cfg, &args) }
    }

    /// # Safety
    /// `w`, `g` hold `n` f32, `a` room for `n` f16, `m` `n` f32 or 0 (then S's momentum must
    /// be 0, or it is ignored); `s` a 4-aligned S image; all live until the launch has run,
    /// and no two overlap.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn raw_sgd(
        &self,
        stream: &CudaStream,
        w: u64,
        m: u64,
        g: u64,
        a: u64,
        s: u64,
        nesterov: bool,
        decay: bool,
        n: usize,
    ) -> Result<(), AmpError> {
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::U64(w),
            Arg::U64(m),
            Arg::U64(g),
            Arg::U64(a),
            Arg::U64(s),
            Arg::I32(i32::from(nesterov)),
            Arg::I32(i32::from(decay)),
            Arg::size(n),
        ];
        // SAFETY: elements [0, n) of each pointer; a null M is never touched.
        unsafe { self.launch_raw(stream, entry::SGD_STEP, self.grid_elems(n), &args) }
    }

    /// # Safety
    /// `e`, `w` hold `n` f32, `e16` room for `n` f16, `s` a 4-aligned S image; all live until
    /// the launch has run, and no two overlap.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn raw_ema(
        &self,
        stream: &CudaStream,
        e: u64,
        e16: u64,
        w: u64,
        s: u64,
        decay: f32,
        n: usize,
    ) -> Result<(), AmpError> {
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::U64(e),
            Arg::U64(e16),
            Arg::U64(w),
            Arg::U64(s),
            Arg::F32(decay),
            Arg::size(n),
        ];
        // SAFETY: elements [0, n) of each pointer only.
        unsafe { self.launch_raw(stream, entry::EMA_UPDATE, self.grid_elems(n), &args) }
    }

    // ------------------------------------------------------------------ checked launches

    /// Zeroes `dst` (twin: [`crate::range::zero_bytes`]).
    ///
    /// # Errors
    /// [`CudaError::ContextMismatch`]; a driver error.
    pub fn zero(&self, stream: &CudaStream, mut dst: DevRangeMut<'_>) -> Result<(), AmpError> {
        self.check_streams(stream, &[("dst", dst.buf_stream())])?;
        let len = dst.range.len();
        let (dp, _d) = dst.addr_mut(stream);
        // SAFETY: `dst.range` was checked to lie inside the buffer, which the borrow keeps
        // alive for this call; cudarc frees it on its own stream, after this launch when that
        // is `stream`, and its event tracking orders other streams.
        unsafe { self.raw_zero(stream, dp, len) }
    }

    /// `dst = f16(src)` (twin: [`crate::range::cast_f32_to_f16`]); `src` holds FP32, `dst`
    /// FP16, the same number of elements.
    ///
    /// # Errors
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`], [`CudaError::ContextMismatch`];
    /// a driver error.
    pub fn cast_f32_to_f16(
        &self,
        stream: &CudaStream,
        src: DevRange<'_>,
        mut dst: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::CAST_F32_TO_F16;
        self.check_streams(
            stream,
            &[("src", src.buf_stream()), ("dst", dst.buf_stream())],
        )?;
        let n = elems_of(OP, "src", src.range, 4)?;
        same_count(OP, "dst", n, elems_of(OP, "dst", dst.range, 2)?)?;
        let (sp, _s) = src.addr(stream);
        let (dp, _d) = dst.addr_mut(stream);
        // SAFETY: both ranges lie inside their buffers (checked at construction) and hold n
        // elements of their type; they cannot overlap (one is borrowed mutably); the borrows
        // keep the buffers alive for this call and cudarc orders their release after it.
        unsafe { self.raw_cast_f32_to_f16(stream, sp, dp, n) }
    }

    /// `dst = f32(src)` (twin: [`crate::range::cast_f16_to_f32`]); `src` holds FP16, `dst`
    /// FP32, the same number of elements.
    ///
    /// # Errors
    /// As [`AmpKernels::cast_f32_to_f16`].
    pub fn cast_f16_to_f32(
        &self,
        stream: &CudaStream,
        src: DevRange<'_>,
        mut dst: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::CAST_F16_TO_F32;
        self.check_streams(
            stream,
            &[("src", src.buf_stream()), ("dst", dst.buf_stream())],
        )?;
        let n = elems_of(OP, "src", src.range, 2)?;
        same_count(OP, "dst", n, elems_of(OP, "dst", dst.range, 4)?)?;
        let (sp, _s) = src.addr(stream);
        let (dp, _d) = dst.addr_mut(stream);
        // SAFETY: as in `cast_f32_to_f16`.
        unsafe { self.raw_cast_f16_to_f32(stream, sp, dp, n) }
    }

    /// The gradient check by `policy` over FP32 `g`, setting the flag in `s` (twins:
    /// [`crate::range::check_nonfinite`], [`crate::range::check_and_clip`]).
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for a bad clip bound, [`ExecError::Misaligned`],
    /// [`ExecError::OutOfBounds`] for an S range under 20 bytes,
    /// [`CudaError::ContextMismatch`]; a driver error.
    pub fn check(
        &self,
        stream: &CudaStream,
        policy: OverflowPolicy,
        mut g: DevRangeMut<'_>,
        mut s: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        let op = RangeOp::Check {
            policy,
            span16: ByteRange::default(),
        }
        .name();
        policy.validate()?;
        self.check_streams(stream, &[("g", g.buf_stream()), ("s", s.buf_stream())])?;
        let n = elems_of(op, "g", g.range, 4)?;
        check_s(op, s.range)?;
        let (gp, _g) = g.addr_mut(stream);
        let (sp, _s) = s.addr_mut(stream);
        // SAFETY: g holds n f32 inside its buffer, S at least 20 bytes 4-aligned (checked);
        // two distinct mutable borrows, so no overlap; alive for the call, release ordered by
        // cudarc.
        unsafe { self.raw_check(stream, policy, gp, n, sp) }
    }

    /// The global L2 norm of the unscaled FP32 gradients `g` into `s`'s `grad_norm`, summed
    /// in a fixed order (twin: [`crate::range::grad_norm`]).
    ///
    /// # Errors
    /// [`ExecError::Misaligned`], [`ExecError::OutOfBounds`] for an S range shorter than the
    /// S region, [`CudaError::ContextMismatch`]; a driver error.
    pub fn grad_norm(
        &self,
        stream: &CudaStream,
        g: DevRange<'_>,
        mut s: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        let op = entry::GRAD_SUMSQ;
        self.check_streams(stream, &[("g", g.buf_stream()), ("s", s.buf_stream())])?;
        let n = elems_of(op, "g", g.range, 4)?;
        check_s(op, s.range)?;
        let need = s_layout::NORM_PARTIALS + 4 * s_layout::NORM_BLOCKS;
        if s.range.len() < need {
            return Err(ExecError::OutOfBounds {
                op,
                what: format!("S (the partial sums need {need} bytes)"),
                start: s.range.start,
                end: s.range.end,
                len: s.range.len(),
            }
            .into());
        }
        let (gp, _g) = g.addr(stream);
        let (sp, _s) = s.addr_mut(stream);
        // SAFETY: g holds n f32 inside its buffer, S the whole image, 4-aligned (checked);
        // one shared and one mutable borrow of distinct buffers, alive for the call.
        unsafe { self.raw_grad_norm(stream, gp, n, sp) }
    }

    /// The loss-scale update on `s` (twin: [`crate::range::update_loss_scale`]).
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for a bad policy, S-range errors as
    /// [`AmpKernels::check`]; a driver error.
    pub fn loss_scale_update(
        &self,
        stream: &CudaStream,
        mut s: DevRangeMut<'_>,
        policy: &LossScalePolicy,
    ) -> Result<(), AmpError> {
        policy.validate()?;
        self.check_streams(stream, &[("s", s.buf_stream())])?;
        check_s(entry::LOSS_SCALE_UPDATE, s.range)?;
        let (sp, _s) = s.addr_mut(stream);
        // SAFETY: S is at least 20 bytes, 4-aligned, inside its buffer (checked) and kept
        // alive by the borrow.
        unsafe { self.raw_loss_scale_update(stream, sp, policy) }
    }

    /// SGD over FP32 `w`, `m`, `g`, writing FP16 `a`, reading the flag, the scale and the
    /// learning rate, momentum and weight decay from `s` (twin: [`crate::range::sgd_step`]);
    /// `decay: false` treats S's weight decay as 0 for this range. Without `m` the momentum in
    /// S must be 0 (the kernel leaves momentum out).
    ///
    /// # Errors
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`], S-range errors,
    /// [`CudaError::ContextMismatch`]; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn sgd_step(
        &self,
        stream: &CudaStream,
        mut w: DevRangeMut<'_>,
        m: Option<DevRangeMut<'_>>,
        g: DevRange<'_>,
        mut a: DevRangeMut<'_>,
        s: DevRange<'_>,
        nesterov: bool,
        decay: bool,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::SGD_STEP;
        self.check_streams(
            stream,
            &[
                ("w", w.buf_stream()),
                ("g", g.buf_stream()),
                ("a", a.buf_stream()),
                ("s", s.buf_stream()),
            ],
        )?;
        let n = elems_of(OP, "w", w.range, 4)?;
        same_count(OP, "g", n, elems_of(OP, "g", g.range, 4)?)?;
        same_count(OP, "a", n, elems_of(OP, "a", a.range, 2)?)?;
        check_s(OP, s.range)?;
        let mut m = match m {
            Some(m) => {
                self.check_buf(stream, "m", m.buf_stream())?;
                same_count(OP, "m", n, elems_of(OP, "m", m.range, 4)?)?;
                Some(m)
            }
            None => None,
        };
        // `s` may alias nothing mutable here (g and s are shared borrows, w/a/m exclusive).
        let (wp, _w) = w.addr_mut(stream);
        let (gp, _g) = g.addr(stream);
        let (ap, _a) = a.addr_mut(stream);
        let (sp, _s) = s.addr(stream);
        let (mp, _m) = match m.as_mut() {
            Some(m) => {
                let (p, sync) = m.addr_mut(stream);
                (p, Some(sync))
            }
            None => (0, None),
        };
        // SAFETY: every range lies inside its buffer and holds n elements of its type
        // (checked); the exclusive borrows of w, a and m rule out overlaps with each other and
        // with g and s; a null M is never touched.
        unsafe { self.raw_sgd(stream, wp, mp, gp, ap, sp, nesterov, decay, n) }
    }

    /// EMA of FP32 `w` into FP32 `e` and FP16 `e16`, skipped when the flag in `s` is set
    /// (twin: [`crate::range::ema_update`]).
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for a decay outside [0, 1],
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`], S-range errors,
    /// [`CudaError::ContextMismatch`]; a driver error.
    pub fn ema_update(
        &self,
        stream: &CudaStream,
        mut e: DevRangeMut<'_>,
        mut e16: DevRangeMut<'_>,
        w: DevRange<'_>,
        s: DevRange<'_>,
        decay: f32,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::EMA_UPDATE;
        crate::step::validate_decay(decay)?;
        self.check_streams(
            stream,
            &[
                ("e", e.buf_stream()),
                ("e16", e16.buf_stream()),
                ("w", w.buf_stream()),
                ("s", s.buf_stream()),
            ],
        )?;
        let n = elems_of(OP, "e", e.range, 4)?;
        same_count(OP, "e16", n, elems_of(OP, "e16", e16.range, 2)?)?;
        same_count(OP, "w", n, elems_of(OP, "w", w.range, 4)?)?;
        check_s(OP, s.range)?;
        let (ep, _e) = e.addr_mut(stream);
        let (hp, _h) = e16.addr_mut(stream);
        let (wp, _w) = w.addr(stream);
        let (sp, _s) = s.addr(stream);
        // SAFETY: as in `sgd_step`: checked ranges, exclusive borrows of the outputs.
        unsafe { self.raw_ema(stream, ep, hp, wp, sp, decay, n) }
    }
}
