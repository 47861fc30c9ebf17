//! [`AmpKernels`]: the compiled range kernels of one CUDA context, and one launch per op.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, Ptx};
use half::f16;

use crate::cuda::{cuda_include_dir, driver_error, nvrtc_library_present};
use crate::error::{AmpError, CudaError, ExecError};
use crate::kernels::{self, entry, CudaArch, KernelSource, ParamType};
use crate::plan::ByteRange;
use crate::range::{
    metrics_log_capacity, s_layout, HeadShape, LossScalePolicy, OverflowPolicy, PoolShape,
    METRICS_LOG_HEADER,
};
use crate::step::RangeOp;

/// Threads per block of the elementwise kernels.
const BLOCK: u32 = 256;
/// Resident blocks per SM the grid-stride launches aim for (8 × 256 = 2048 threads, the
/// most an SM of sm_80..sm_100 holds).
const BLOCKS_PER_SM: u32 = 8;

/// One block of one thread (the scalar kernels).
const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// One kernel argument, by value.
#[derive(Debug, Clone, Copy)]
enum Arg {
    U64(u64),
    U32(u32),
    I32(i32),
    F32(f32),
}

impl Arg {
    /// A `size_t` (the targets are 64-bit).
    fn size(n: usize) -> Arg {
        Arg::U64(n as u64)
    }

    fn param_type(&self) -> ParamType {
        match self {
            Arg::U64(_) => ParamType::U64,
            Arg::U32(_) | Arg::I32(_) => ParamType::U32,
            Arg::F32(_) => ParamType::F32,
        }
    }
}

/// The kernels of [`crate::kernels::ALL`], compiled for one CUDA context.
struct Functions {
    cast_f32_to_f16: CudaFunction,
    cast_f16_to_f32: CudaFunction,
    check_nonfinite: CudaFunction,
    check_clip: CudaFunction,
    loss_scale_update: CudaFunction,
    zero_bytes: CudaFunction,
    sgd_step: CudaFunction,
    ema_update: CudaFunction,
    softmax_xent_backward: CudaFunction,
    gap_forward: CudaFunction,
    gap_backward: CudaFunction,
    fc_forward: CudaFunction,
    fc_backward: CudaFunction,
    add_f16: CudaFunction,
    head_metrics: CudaFunction,
    max_pool_forward: CudaFunction,
    max_pool_backward: CudaFunction,
}

/// The range kernels compiled with NVRTC and loaded into one CUDA context.
///
/// Get it with [`AmpKernels::for_context`] (compiled once per context, then shared). Each
/// launch method checks its arguments (ranges inside their buffers, whole elements, equal
/// element counts, one CUDA context) and enqueues one kernel on `stream`; nothing waits.
/// Empty ranges launch nothing.
pub struct AmpKernels {
    ctx: Arc<CudaContext>,
    arch: CudaArch,
    /// What was loaded, e.g. "sm_90 machine code".
    code: String,
    max_blocks: u32,
    f: Functions,
}

impl fmt::Debug for AmpKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmpKernels")
            .field("device", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .field("code", &self.code)
            .field("max_blocks", &self.max_blocks)
            .finish_non_exhaustive()
    }
}

/// Compiled kernels per CUDA context (keyed by the context handle; each entry holds an `Arc`
/// to its context, so a handle in the map can never be reused by another context).
fn cache() -> &'static Mutex<HashMap<usize, Arc<AmpKernels>>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<AmpKernels>>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// [`AmpError::NoNvrtc`] unless the NVRTC library can be loaded.
fn require_nvrtc() -> Result<(), AmpError> {
    if nvrtc_library_present() {
        Ok(())
    } else {
        Err(AmpError::NoNvrtc {
            reason: "the NVRTC library (libnvrtc) is not on the loader path".into(),
        })
    }
}

fn describe_compile_error(e: &CompileError) -> String {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}\n{}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

/// Compiles every source of [`crate::kernels::ALL`] to PTX for `arch` with NVRTC, with the
/// include directory of [`crate::cuda::cuda_include_dir`]. Needs no device: this is what
/// [`AmpKernels::for_context`] loads.
///
/// # Errors
/// [`AmpError::NoNvrtc`] without the NVRTC library, [`CudaError::Compile`] with NVRTC's log
/// when a source does not compile (e.g. `cuda_fp16.h` not found).
pub fn compile_ptx(arch: CudaArch) -> Result<Vec<(KernelSource, String)>, AmpError> {
    require_nvrtc()?;
    let include = cuda_include_dir().and_then(|d| d.into_os_string().into_string().ok());
    kernels::ALL
        .iter()
        .map(|source| {
            let opts = kernels::compile_options(source, arch, include.as_deref());
            compile_ptx_with_opts(source.program(), opts)
                .map(|ptx| (*source, ptx.to_src()))
                .map_err(|e| {
                    CudaError::Compile {
                        file: source.file,
                        arch: arch.sm_name(),
                        log: describe_compile_error(&e),
                    }
                    .into()
                })
        })
        .collect()
}

/// Compiles every source of [`crate::kernels::ALL`] to machine code (a cubin) for the real
/// architecture `real_arch` (e.g. `"sm_90"`, see [`kernels::real_arch`]) with NVRTC. Needs
/// no device. This is what [`AmpKernels::for_context`] loads where it can: unlike PTX, a
/// cubin does not depend on the driver accepting the NVRTC's PTX version.
///
/// # Errors
/// As [`compile_ptx`].
pub fn compile_cubin(real_arch: &'static str) -> Result<Vec<(KernelSource, Vec<u8>)>, AmpError> {
    use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
    use std::ffi::CString;
    require_nvrtc()?;
    let include = cuda_include_dir().and_then(|d| d.into_os_string().into_string().ok());
    let flags = kernels::cubin_flags(real_arch, include.as_deref());
    let fail = |file: &'static str, log: String| -> AmpError {
        CudaError::Compile {
            file,
            arch: real_arch,
            log,
        }
        .into()
    };
    /// Destroys the NVRTC program on every path.
    struct Program(nvrtc_sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
            let _ = unsafe { nvrtc::destroy_program(self.0) };
        }
    }
    kernels::ALL
        .iter()
        .map(|source| {
            // The sources are ours and hold no NUL byte.
            let text =
                CString::new(source.program()).map_err(|e| fail(source.file, e.to_string()))?;
            let name = CString::new(source.file).map_err(|e| fail(source.file, e.to_string()))?;
            let prog = Program(
                nvrtc::create_program(&text, Some(&name))
                    .map_err(|e| fail(source.file, format!("{e:?}")))?,
            );
            // SAFETY: `prog.0` is a live program (dropped only after this block).
            if let Err(e) = unsafe { nvrtc::compile_program(prog.0, &flags) } {
                // SAFETY: as above; the log exists after a failed compile.
                let log = unsafe { nvrtc::get_program_log(prog.0) }
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes)
                            .trim_end_matches('\0')
                            .to_owned()
                    })
                    .unwrap_or_default();
                return Err(fail(source.file, format!("{e:?}\n{log}")));
            }
            let mut size = 0usize;
            // SAFETY: `prog.0` compiled successfully; `size` is a valid out-pointer.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| fail(source.file, format!("nvrtcGetCUBINSize: {e:?}")))?;
            if size == 0 {
                return Err(fail(source.file, "NVRTC produced an empty cubin".into()));
            }
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` has exactly the `size` bytes NVRTC asked for.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| fail(source.file, format!("nvrtcGetCUBIN: {e:?}")))?;
            Ok((*source, cubin))
        })
        .collect()
}

/// The loaded NVRTC's version, e.g. `"13.0"` (`"unknown"` if it does not say). Call only
/// after [`nvrtc_library_present`] returned true.
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (the caller checked); both out-pointers are valid.
    let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if rc == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        "unknown".into()
    }
}

/// A read-only byte range of a device buffer ([`CudaSlice`], [`cudarc::driver::CudaView`] or
/// [`cudarc::driver::CudaViewMut`] of bytes), checked to lie inside it.
pub struct DevRange<'a> {
    buf: &'a dyn DevicePtr<u8>,
    range: ByteRange,
}

/// A writable byte range of a device buffer, checked to lie inside it.
pub struct DevRangeMut<'a> {
    buf: &'a mut dyn DevicePtrMut<u8>,
    range: ByteRange,
}

impl fmt::Debug for DevRange<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevRange")
            .field("buffer_len", &self.buf.len())
            .field("range", &self.range)
            .finish()
    }
}

impl fmt::Debug for DevRangeMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevRangeMut")
            .field("buffer_len", &self.buf.len())
            .field("range", &self.range)
            .finish()
    }
}

fn check_bounds(range: ByteRange, len: usize) -> Result<(), AmpError> {
    if range.start > range.end || range.end > len {
        return Err(ExecError::OutOfBounds {
            op: "device range",
            what: "buffer".into(),
            start: range.start,
            end: range.end,
            len,
        }
        .into());
    }
    Ok(())
}

/// Elements of `dtype` in `range`, which must start and end on element boundaries.
fn elems_of(
    op: &'static str,
    what: &'static str,
    range: ByteRange,
    size: usize,
) -> Result<usize, AmpError> {
    if range.start % size != 0 || range.end % size != 0 {
        return Err(ExecError::Misaligned {
            op,
            what: what.into(),
            start: range.start,
            end: range.end,
            align: size,
        }
        .into());
    }
    Ok(range.len() / size)
}

fn same_count(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), AmpError> {
    if expected == got {
        Ok(())
    } else {
        Err(ExecError::ElemCount {
            op,
            what,
            expected,
            got,
        }
        .into())
    }
}

/// The S range of an op: 4-byte aligned start (the struct's alignment), at least the 20 bytes
/// in use.
fn check_s(op: &'static str, range: ByteRange) -> Result<(), AmpError> {
    if range.start % 4 != 0 {
        return Err(ExecError::Misaligned {
            op,
            what: "S".into(),
            start: range.start,
            end: range.end,
            align: 4,
        }
        .into());
    }
    if range.len() < s_layout::USED {
        return Err(ExecError::OutOfBounds {
            op,
            what: format!("S (needs {} bytes)", s_layout::USED),
            start: range.start,
            end: range.end,
            len: range.len(),
        }
        .into());
    }
    Ok(())
}

impl<'a> DevRange<'a> {
    /// `range` of `buf`.
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when the range does not lie inside the buffer.
    pub fn new<P: DevicePtr<u8>>(buf: &'a P, range: ByteRange) -> Result<Self, AmpError> {
        check_bounds(range, buf.len())?;
        Ok(DevRange { buf, range })
    }

    /// All of `buf`.
    pub fn whole<P: DevicePtr<u8>>(buf: &'a P) -> Self {
        DevRange {
            range: ByteRange::new(0, buf.len()),
            buf,
        }
    }

    /// The byte range.
    pub fn range(&self) -> ByteRange {
        self.range
    }

    /// The stream the buffer was allocated on (for the context check).
    pub(crate) fn buf_stream(&self) -> &CudaStream {
        self.buf.stream()
    }

    /// The device address of the range's first byte, with cudarc's read guard (a no-op
    /// unless the context tracks events across several streams).
    pub(crate) fn addr<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        let (base, sync) = self.buf.device_ptr(stream);
        (base + self.range.start as u64, sync)
    }
}

impl<'a> DevRangeMut<'a> {
    /// `range` of `buf`.
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when the range does not lie inside the buffer.
    pub fn new<P: DevicePtrMut<u8>>(buf: &'a mut P, range: ByteRange) -> Result<Self, AmpError> {
        check_bounds(range, buf.len())?;
        Ok(DevRangeMut { buf, range })
    }

    /// All of `buf`.
    pub fn whole<P: DevicePtrMut<u8>>(buf: &'a mut P) -> Self {
        DevRangeMut {
            range: ByteRange::new(0, buf.len()),
            buf,
        }
    }

    /// The byte range.
    pub fn range(&self) -> ByteRange {
        self.range
    }

    /// The stream the buffer was allocated on (for the context check).
    pub(crate) fn buf_stream(&self) -> &CudaStream {
        self.buf.stream()
    }

    /// The device address of the range's first byte, with cudarc's write guard.
    pub(crate) fn addr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        let (base, sync) = self.buf.device_ptr_mut(stream);
        (base + self.range.start as u64, sync)
    }
}

impl AmpKernels {
    /// The kernels for `ctx`: compiled and loaded on the first call for a context, shared
    /// afterwards. The first call takes about a second (NVRTC).
    ///
    /// # Errors
    /// [`AmpError::NoNvrtc`] without the NVRTC library, [`CudaError::UnsupportedArch`] below
    /// sm_80, [`CudaError::Compile`] when NVRTC rejects a source (e.g. no `cuda_fp16.h`),
    /// [`CudaError::Driver`] when the driver cannot load the PTX.
    pub fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<AmpKernels>, AmpError> {
        let key = ctx.cu_ctx() as usize;
        // Compiling under the lock keeps two threads from compiling the same context twice.
        let mut map = cache().lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = map.get(&key) {
            return Ok(k.clone());
        }
        let k = Arc::new(Self::compile(ctx)?);
        map.insert(key, k.clone());
        Ok(k)
    }

    fn compile(ctx: &Arc<CudaContext>) -> Result<AmpKernels, AmpError> {
        require_nvrtc()?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver_error("query the compute capability", e))?;
        let cc = u32::try_from(major).ok().zip(u32::try_from(minor).ok());
        let arch = cc
            .and_then(|(ma, mi)| CudaArch::for_compute_capability(ma, mi))
            .ok_or(CudaError::UnsupportedArch { major, minor })?;
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("query the SM count", e))?;
        // Machine code for the device's own architecture where NVRTC knows it, else PTX for
        // the driver to JIT (see `kernels::real_arch` for why machine code comes first).
        let real = cc.and_then(|(ma, mi)| kernels::real_arch(ma, mi));
        let (images, code): (Vec<(KernelSource, Ptx)>, String) = match real {
            Some(sm) => (
                compile_cubin(sm)?
                    .into_iter()
                    .map(|(s, c)| (s, Ptx::from_binary(c)))
                    .collect(),
                format!("{sm} machine code"),
            ),
            None => (
                compile_ptx(arch)?
                    .into_iter()
                    .map(|(s, p)| (s, Ptx::from_src(p)))
                    .collect(),
                format!("{} PTX, JIT-compiled by the driver", arch.compute_name()),
            ),
        };
        let code = format!("{code}, NVRTC {}", nvrtc_version());
        let mut functions: HashMap<&'static str, CudaFunction> = HashMap::new();
        for (source, image) in images {
            let module = ctx
                .load_module(image)
                .map_err(|e| driver_error(format!("load the {code} of {}", source.file), e))?;
            for &name in source.entry_points {
                let f = module
                    .load_function(name)
                    .map_err(|e| driver_error(format!("look up kernel {name}"), e))?;
                functions.insert(name, f);
            }
        }
        let mut take = |name: &'static str| {
            functions.remove(name).ok_or_else(|| CudaError::Driver {
                op: format!("look up kernel {name}"),
                code: "not in the compiled module".into(),
            })
        };
        let f = Functions {
            cast_f32_to_f16: take(entry::CAST_F32_TO_F16)?,
            cast_f16_to_f32: take(entry::CAST_F16_TO_F32)?,
            check_nonfinite: take(entry::CHECK_NONFINITE)?,
            check_clip: take(entry::CHECK_CLIP)?,
            loss_scale_update: take(entry::LOSS_SCALE_UPDATE)?,
            zero_bytes: take(entry::ZERO_BYTES)?,
            sgd_step: take(entry::SGD_STEP)?,
            ema_update: take(entry::EMA_UPDATE)?,
            softmax_xent_backward: take(entry::SOFTMAX_XENT_BACKWARD)?,
            gap_forward: take(entry::GAP_FORWARD)?,
            gap_backward: take(entry::GAP_BACKWARD)?,
            fc_forward: take(entry::FC_FORWARD)?,
            fc_backward: take(entry::FC_BACKWARD)?,
            add_f16: take(entry::ADD_F16)?,
            head_metrics: take(entry::HEAD_METRICS)?,
            max_pool_forward: take(entry::MAX_POOL_FORWARD)?,
            max_pool_backward: take(entry::MAX_POOL_BACKWARD)?,
        };
        Ok(AmpKernels {
            ctx: ctx.clone(),
            arch,
            code,
            max_blocks: u32::try_from(sms.max(1))
                .unwrap_or(1)
                .saturating_mul(BLOCKS_PER_SM),
            f,
        })
    }

    /// The architecture the PTX was built for.
    pub fn arch(&self) -> CudaArch {
        self.arch
    }

    /// What was loaded and by which NVRTC: `"sm_90 machine code, NVRTC 13.0"`, or
    /// `"compute_90 PTX, JIT-compiled by the driver, NVRTC 13.0"` on an architecture
    /// [`kernels::real_arch`] does not list.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A grid-stride configuration for `work` independent items (8-element groups).
    fn grid(&self, work: usize) -> LaunchConfig {
        let blocks = work
            .div_ceil(BLOCK as usize)
            .clamp(1, self.max_blocks as usize);
        LaunchConfig {
            grid_dim: (u32::try_from(blocks).unwrap_or(self.max_blocks), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn grid_elems(&self, n: usize) -> LaunchConfig {
        self.grid(n.div_ceil(8))
    }

    /// The stream must belong to the kernels' context.
    fn check_stream(&self, stream: &CudaStream) -> Result<(), AmpError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(CudaError::ContextMismatch {
                what: "the stream".into(),
            }
            .into());
        }
        Ok(())
    }

    fn check_buf(
        &self,
        stream: &CudaStream,
        what: &'static str,
        buf_stream: &CudaStream,
    ) -> Result<(), AmpError> {
        if buf_stream.context().cu_ctx() != stream.context().cu_ctx() {
            return Err(CudaError::ContextMismatch { what: what.into() }.into());
        }
        Ok(())
    }

    /// [`AmpKernels::check_stream`], then [`AmpKernels::check_buf`] for each `(what, buffer
    /// stream)` in order: the preamble of every checked launch.
    fn check_streams(
        &self,
        stream: &CudaStream,
        bufs: &[(&'static str, &CudaStream)],
    ) -> Result<(), AmpError> {
        self.check_stream(stream)?;
        bufs.iter()
            .try_for_each(|&(what, buf_stream)| self.check_buf(stream, what, buf_stream))
    }

    // ------------------------------------------------------------------ raw launches
    //
    // Each takes device addresses and element counts that the caller has checked: every
    // address is inside a live allocation of the stream's context with room for `n`
    // elements of the kernel's type, and stays alive until the stream has run the launch.

    /// Launches `f` (entry point `name`) with `args`, after checking them against
    /// [`kernels::signature`].
    ///
    /// # Safety
    /// The pointer arguments satisfy what the kernel `name` reads and writes through them
    /// (each raw launch below spells that out), and outlive the launch on `stream`.
    unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), AmpError> {
        let got: Vec<ParamType> = args.iter().map(|a| a.param_type()).collect();
        let expected = kernels::signature(name).unwrap_or(&[]);
        if got != expected {
            return Err(CudaError::ArgumentMismatch {
                kernel: name,
                expected: expected.to_vec(),
                got,
            }
            .into());
        }
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::U64(v) => b.arg(v),
                Arg::U32(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: the argument list has the kernel's parameter types in its order (checked
        // just above against the signature that the NVRTC test checks against the PTX), each
        // argument lives in `args` until after the launch call returns, and the caller
        // guarantees the memory behind the pointers.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error(format!("launch {name}"), e))?;
        Ok(())
    }

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
                &self.f.zero_bytes,
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
        unsafe {
            self.launch_raw(
                stream,
                &self.f.cast_f32_to_f16,
                entry::CAST_F32_TO_F16,
                self.grid_elems(n),
                &args,
            )
        }
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
        unsafe {
            self.launch_raw(
                stream,
                &self.f.cast_f16_to_f32,
                entry::CAST_F16_TO_F32,
                self.grid_elems(n),
                &args,
            )
        }
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
                    &self.f.check_nonfinite,
                    entry::CHECK_NONFINITE,
                    cfg,
                    &[Arg::U64(g), Arg::size(n), Arg::U64(s)],
                )
            },
            // SAFETY: reads and writes g[0..n), atomically sets s->overflow.
            OverflowPolicy::ClipInf { bound } => unsafe {
                self.launch_raw(
                    stream,
                    &self.f.check_clip,
                    entry::CHECK_CLIP,
                    cfg,
                    &[Arg::U64(g), Arg::size(n), Arg::F32(bound), Arg::U64(s)],
                )
            },
        }
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
        unsafe {
            self.launch_raw(
                stream,
                &self.f.loss_scale_update,
                entry::LOSS_SCALE_UPDATE,
                cfg,
                &args,
            )
        }
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
        unsafe {
            self.launch_raw(
                stream,
                &self.f.sgd_step,
                entry::SGD_STEP,
                self.grid_elems(n),
                &args,
            )
        }
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
        unsafe {
            self.launch_raw(
                stream,
                &self.f.ema_update,
                entry::EMA_UPDATE,
                self.grid_elems(n),
                &args,
            )
        }
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
        let cfg = self.grid(shape.pooled_elems());
        // SAFETY: the kernel reads a[0..batch*pixels*features) and writes
        // pooled[0..batch*features), as the caller guarantees.
        unsafe { self.launch_raw(stream, &self.f.gap_forward, entry::GAP_FORWARD, cfg, &args) }
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
        let cfg = self.grid(shape.activation_elems());
        // SAFETY: reads dpooled[0..batch*features), writes da[0..batch*pixels*features).
        unsafe {
            self.launch_raw(
                stream,
                &self.f.gap_backward,
                entry::GAP_BACKWARD,
                cfg,
                &args,
            )
        }
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
        let cfg = self.grid(shape.logits_elems());
        // SAFETY: the kernel reads x, w, b and writes logits within the counts above.
        unsafe { self.launch_raw(stream, &self.f.fc_forward, entry::FC_FORWARD, cfg, &args) }
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
        let cfg = self.grid(shape.classes + shape.weight_elems() + shape.pooled_elems());
        // SAFETY: the kernel reads dlogits, x, w and writes dw, db, dx within the counts
        // above, as the caller guarantees.
        unsafe { self.launch_raw(stream, &self.f.fc_backward, entry::FC_BACKWARD, cfg, &args) }
    }

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
        unsafe {
            self.launch_raw(
                stream,
                &self.f.head_metrics,
                entry::HEAD_METRICS,
                cfg,
                &args,
            )
        }
    }

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
                u32::try_from(batch.min(self.max_blocks as usize)).unwrap_or(self.max_blocks),
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
        unsafe {
            self.launch_raw(
                stream,
                &self.f.softmax_xent_backward,
                entry::SOFTMAX_XENT_BACKWARD,
                cfg,
                &args,
            )
        }
    }

    /// Global average pooling (twin: [`crate::range::gap_forward`]): `a` holds the last
    /// stage's FP16 activation `[batch, pixels, features]`, `pooled` receives FP32
    /// `[batch, features]`.
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for a bad shape, [`ExecError::Misaligned`],
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
        self.check_streams(
            stream,
            &[("a", a.buf_stream()), ("pooled", pooled.buf_stream())],
        )?;
        expect_elems(OP, "a", a.range, 2, shape.activation_elems())?;
        expect_elems(OP, "pooled", pooled.range, 4, shape.pooled_elems())?;
        let (ap, _a) = a.addr(stream);
        let (pp, _p) = pooled.addr_mut(stream);
        // SAFETY: both ranges lie inside their buffers (checked at construction) and hold
        // exactly the shape's element counts (checked above); `pooled` is borrowed mutably,
        // so it cannot overlap `a`; the borrows keep both alive for the call and cudarc frees
        // a buffer on its own stream, after work enqueued on it.
        unsafe { self.raw_gap_forward(stream, ap, pp, shape) }
    }

    /// The pooling's backward (twin: [`crate::range::gap_backward`]): FP32 `dpooled`
    /// `[batch, features]` → FP16 `da` `[batch, pixels, features]`.
    ///
    /// # Errors
    /// As [`AmpKernels::gap_forward`].
    pub fn gap_backward(
        &self,
        stream: &CudaStream,
        shape: &HeadShape,
        dpooled: DevRange<'_>,
        mut da: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = entry::GAP_BACKWARD;
        shape.validate(OP)?;
        self.check_streams(
            stream,
            &[("dpooled", dpooled.buf_stream()), ("da", da.buf_stream())],
        )?;
        expect_elems(OP, "dpooled", dpooled.range, 4, shape.pooled_elems())?;
        expect_elems(OP, "da", da.range, 2, shape.activation_elems())?;
        let (gp, _g) = dpooled.addr(stream);
        let (dp, _d) = da.addr_mut(stream);
        // SAFETY: as in `gap_forward`: checked ranges with the shape's counts, the output
        // exclusively borrowed.
        unsafe { self.raw_gap_backward(stream, gp, dp, shape) }
    }

    /// The FC layer's forward (twin: [`crate::range::fc_forward`]): FP32 `x`
    /// `[batch, features]`, FP32 `w` `[classes, features]` and `b` `[classes]` (e.g. slots of
    /// region W) → FP16 `logits` `[batch, classes]`.
    ///
    /// # Errors
    /// As [`AmpKernels::gap_forward`].
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
        self.check_streams(
            stream,
            &[
                ("x", x.buf_stream()),
                ("w", w.buf_stream()),
                ("b", b.buf_stream()),
                ("logits", logits.buf_stream()),
            ],
        )?;
        expect_elems(OP, "x", x.range, 4, shape.pooled_elems())?;
        expect_elems(OP, "w", w.range, 4, shape.weight_elems())?;
        expect_elems(OP, "b", b.range, 4, shape.classes)?;
        expect_elems(OP, "logits", logits.range, 2, shape.logits_elems())?;
        let (xp, _x) = x.addr(stream);
        let (wp, _w) = w.addr(stream);
        let (bp, _b) = b.addr(stream);
        let (lp, _l) = logits.addr_mut(stream);
        // SAFETY: every range lies inside its buffer with the shape's element count
        // (checked); `logits` is borrowed mutably, so it overlaps none of the inputs; the
        // borrows keep the buffers alive for the call.
        unsafe { self.raw_fc_forward(stream, xp, wp, bp, lp, shape) }
    }

    /// The FC layer's backward (twin: [`crate::range::fc_backward`]): FP16 `dlogits`, FP32
    /// `x` and `w` → FP32 `dw` `[classes, features]`, `db` `[classes]` and `dx`
    /// `[batch, features]`, all overwritten. To write `dw`/`db` into region G, use
    /// [`crate::cuda::CudaRegions::fc_backward`].
    ///
    /// # Errors
    /// As [`AmpKernels::gap_forward`].
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
        self.check_streams(
            stream,
            &[
                ("w", w.buf_stream()),
                ("dw", dw.buf_stream()),
                ("db", db.buf_stream()),
            ],
        )?;
        expect_elems(OP, "w", w.range, 4, shape.weight_elems())?;
        expect_elems(OP, "dw", dw.range, 4, shape.weight_elems())?;
        expect_elems(OP, "db", db.range, 4, shape.classes)?;
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

    /// [`AmpKernels::fc_backward`] with the weight and its gradients given as addresses
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
        self.check_streams(
            stream,
            &[
                ("dlogits", dlogits.buf_stream()),
                ("x", x.buf_stream()),
                ("dx", dx.buf_stream()),
            ],
        )?;
        expect_elems(OP, "dlogits", dlogits.range, 2, shape.logits_elems())?;
        expect_elems(OP, "x", x.range, 4, shape.pooled_elems())?;
        expect_elems(OP, "dx", dx.range, 4, shape.pooled_elems())?;
        let (gp, _g) = dlogits.addr(stream);
        let (xp, _x) = x.addr(stream);
        let (dxp, _dx) = dx.addr_mut(stream);
        // SAFETY: the activation ranges were checked here (inside their buffers, the shape's
        // counts, `dx` exclusive), the parameter addresses by the caller's contract.
        unsafe { self.raw_fc_backward(stream, gp, xp, params.w, params.dw, params.db, dxp, shape) }
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

    /// Appends one batch's loss and accuracy to a metrics log (twin:
    /// [`crate::range::head_metrics`] then [`crate::range::metrics_log_append`]): `logits`
    /// FP16 `[batch, classes]`, `labels` i32 `[batch]`, `loss` (optional) the per-row FP32
    /// losses of the loss seed, `log` a log of [`crate::range::metrics_log_bytes`] bytes
    /// (zeroed once before the first append).
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for `classes == 0`,
    /// [`crate::RangeOpError::LengthMismatch`] for a log with no room for one entry,
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
        self.check_streams(
            stream,
            &[
                ("logits", logits.buf_stream()),
                ("labels", labels.buf_stream()),
                ("log", log.buf_stream()),
            ],
        )?;
        let batch = elems_of(OP, "labels", labels.range, 4)?;
        HeadShape::new(batch, 1, 1, classes).validate(OP)?;
        expect_elems(OP, "logits", logits.range, 2, batch * classes)?;
        if let Some(l) = &loss {
            self.check_buf(stream, "loss", l.buf_stream())?;
            expect_elems(OP, "loss", l.range, 4, batch)?;
        }
        let capacity = metrics_log_capacity(log.range.len());
        if capacity == 0 || log.range.start % 4 != 0 {
            return Err(crate::RangeOpError::LengthMismatch {
                op: OP,
                what: "log (bytes, 4-aligned)",
                expected: METRICS_LOG_HEADER + 8,
                got: log.range.len(),
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
        HeadShape::new(batch.max(1), 1, 1, classes).validate(OP)?;
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

/// The FC parameter addresses of [`AmpKernels::fc_backward_with`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct FcParams {
    /// FP32 weight `[classes, features]`.
    pub(crate) w: u64,
    /// FP32 weight gradient, same shape.
    pub(crate) dw: u64,
    /// FP32 bias gradient `[classes]`.
    pub(crate) db: u64,
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

/// The range holds exactly `expected` elements of `size` bytes, on element boundaries.
fn expect_elems(
    op: &'static str,
    what: &'static str,
    range: ByteRange,
    size: usize,
    expected: usize,
) -> Result<(), AmpError> {
    same_count(op, what, expected, elems_of(op, what, range, size)?)
}
