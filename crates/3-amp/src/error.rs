//! Typed errors of the AMP layer.
//!
//! Four families, wrapped by [`AmpError`]:
//! 1. [`PlanError`]: a bad parameter registration or a plan query that cannot be answered.
//!    Every variant about a parameter carries its `name`, and the message names it too, so
//!    a failure in a 200-parameter network points at the culprit.
//! 2. [`RangeOpError`]: a CPU range op called with slices that disagree in length, or with a
//!    configuration the kernels would not accept (a NaN learning rate, a zero growth
//!    interval, ...).
//! 3. [`ExecError`]: a range op or a step that does not fit the regions it is given (a range
//!    past a region's end, a region the plan lacks, a graph replayed on the wrong executor).
//! 4. [`CudaError`]: the CUDA side failed (NVRTC compile, a driver call, a foreign context,
//!    a kernel table that disagrees with its sources: [`KernelTableError`]).
//!
//! Two conditions are variants of [`AmpError`] itself because callers branch on them:
//! [`AmpError::NoDevice`] and [`AmpError::NoNvrtc`] mean "this machine cannot run the CUDA
//! executor" (tests print a SKIP line on them), never "something is broken".

use thiserror::Error;

use crate::plan::{ParamKind, Region};

/// Any error of the AMP layer.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AmpError {
    /// Building or querying a memory plan failed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A range op (CPU twin) or its configuration was rejected.
    #[error(transparent)]
    RangeOp(#[from] RangeOpError),
    /// A range op, a step or a graph does not fit the executor it was given.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// A CUDA driver or NVRTC call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A data-parallel collective or group setup failed.
    #[error(transparent)]
    Dist(#[from] cudnn_cbr_dist::DistError),
    /// No usable CUDA device: no driver library, no device, or the device cannot be opened.
    #[error("no usable CUDA device: {reason}")]
    NoDevice {
        /// Why, in words (the driver's error when there is one).
        reason: String,
    },
    /// The NVRTC library (runtime compiler) is not on the loader path.
    #[error("NVRTC unavailable: {reason}")]
    NoNvrtc {
        /// Why, in words.
        reason: String,
    },
    /// A memory plan's regions do not fit in what the host or device has free; checked
    /// before anything is allocated.
    #[error(
        "{what}: {need} bytes ({:.1} GiB) of {place} memory needed, {have} bytes ({:.1} GiB) free",
        *need as f64 / GIB, *have as f64 / GIB
    )]
    OutOfMemory {
        /// What was to be allocated.
        what: String,
        /// `"host"` or `"device"`.
        place: &'static str,
        /// Bytes needed.
        need: u128,
        /// Bytes free.
        have: u128,
    },
}

const GIB: f64 = (1u64 << 30) as f64;

impl AmpError {
    /// Whether this error only says that the machine cannot run the CUDA executor
    /// ([`AmpError::NoDevice`] or [`AmpError::NoNvrtc`]): the reason to print a SKIP line.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, AmpError::NoDevice { .. } | AmpError::NoNvrtc { .. })
    }
}

/// Errors from [`crate::plan::MemoryPlanBuilder`] and [`crate::plan::MemoryPlan`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A parameter was registered with an empty name; `index` is its registration index.
    #[error("parameter #{index} has an empty name")]
    EmptyName {
        /// Registration index (0-based) of the nameless parameter.
        index: usize,
    },
    /// Two parameters share a name; names key every view, so they must be unique.
    #[error("parameter `{name}` is registered twice")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A shape with no dimensions: a scalar parameter has shape `[1]`, not `[]`.
    #[error("parameter `{name}` has an empty shape (use [1] for a single value)")]
    EmptyShape {
        /// The parameter.
        name: String,
    },
    /// A shape with a zero dimension would give a parameter with no elements.
    #[error("parameter `{name}` has a zero dimension in shape {shape:?}")]
    ZeroDim {
        /// The parameter.
        name: String,
        /// Its shape as registered.
        shape: Vec<usize>,
    },
    /// The shape's rank does not fit the parameter kind (e.g. a 2-D BN gamma).
    #[error("parameter `{name}` is a {kind:?} and needs rank {expected}, got shape {shape:?}")]
    RankMismatch {
        /// The parameter.
        name: String,
        /// Its kind.
        kind: ParamKind,
        /// The accepted rank(s), in words, e.g. `"1"` or `"3 to 5"`.
        expected: &'static str,
        /// Its shape as registered.
        shape: Vec<usize>,
    },
    /// The element count, a slot size or a region size does not fit in `usize` bytes.
    #[error("parameter `{name}` (shape {shape:?}) makes a size overflow: {what}")]
    SizeOverflow {
        /// The parameter whose size (or whose addition to a region) overflowed.
        name: String,
        /// Its shape as registered.
        shape: Vec<usize>,
        /// Which size overflowed.
        what: &'static str,
    },
    /// A registration after `finalize`: the plan handed out would silently lack it.
    #[error("parameter `{name}` registered after the plan was finalized")]
    RegisterAfterFinalize {
        /// The late parameter.
        name: String,
    },
    /// A bucket declared after `finalize`.
    #[error("bucket `{bucket}` declared after the plan was finalized")]
    BucketAfterFinalize {
        /// The late bucket's name.
        bucket: String,
    },
    /// `finalize` called a second time on the same builder.
    #[error("the memory plan builder was already finalized")]
    AlreadyFinalized,
    /// A bucket name declared twice, or an empty bucket name.
    #[error("bucket name `{bucket}` is empty or declared twice")]
    BadBucketName {
        /// The offending bucket name.
        bucket: String,
    },
    /// A parameter refers to a bucket handle this builder never made.
    #[error("parameter `{name}` refers to unknown bucket #{bucket}")]
    UnknownBucket {
        /// The parameter.
        name: String,
        /// The bucket's index.
        bucket: usize,
    },
    /// A plan query used a bucket handle the plan does not have.
    #[error("the memory plan has no bucket #{bucket}")]
    NoSuchBucket {
        /// The bucket's index.
        bucket: usize,
    },
    /// A declared bucket got no parameters; its ranges would be empty and a reduction over
    /// it would do nothing, which is almost always a registration mistake.
    #[error("bucket `{bucket}` has no parameters")]
    EmptyBucket {
        /// The bucket's name.
        bucket: String,
    },
    /// The FC head was asked for a class count other than its network's spec gives: the
    /// logits, labels and saved weights would disagree about what a class is.
    #[error("the FC head has {head} classes, but network `{net}`'s spec has {spec}")]
    HeadClasses {
        /// The network's name.
        net: String,
        /// Classes in the spec.
        spec: usize,
        /// Classes asked of the head.
        head: usize,
    },
    /// `finalize` with no parameters at all.
    #[error("the memory plan has no parameters")]
    EmptyPlan,
    /// A view or range was asked for a parameter name the plan does not know.
    #[error("no parameter named `{name}` in the plan")]
    UnknownParam {
        /// The name asked for.
        name: String,
    },
    /// A view was asked in a region the parameter does not live in (e.g. an FC weight in
    /// G16, or any parameter in E when EMA is off).
    #[error("parameter `{name}` has no slot in region {region:?}")]
    NotInRegion {
        /// The parameter.
        name: String,
        /// The region asked for.
        region: Region,
    },
    /// A range was asked in a region this plan does not allocate.
    #[error("region {region:?} is not part of this plan")]
    RegionAbsent {
        /// The region asked for.
        region: Region,
    },
    /// `validate` found a broken invariant (a bug in the planner, never a user error).
    #[error("memory plan invariant broken at parameter `{name}`: {what}")]
    Invariant {
        /// The parameter (or, for bucket checks, the bucket) where the check failed; empty
        /// for plan-wide checks.
        name: String,
        /// The invariant, in words.
        what: String,
    },
}

/// Errors from the CPU range ops and their configurations.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RangeOpError {
    /// Two slices that must cover the same elements have different lengths.
    #[error("{op}: `{what}` has {got} elements, expected {expected}")]
    LengthMismatch {
        /// The range op.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A configuration value the kernels would not accept.
    #[error("{op}: invalid {field} = {value}: {why}")]
    InvalidConfig {
        /// The range op or policy.
        op: &'static str,
        /// The field.
        field: &'static str,
        /// The value, printed.
        value: String,
        /// What is required.
        why: &'static str,
    },
    /// The S-region byte image is too short to hold the scalars.
    #[error("S region image has {got} bytes, needs at least {needed}")]
    ScalarsTooShort {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        needed: usize,
    },
}

/// A range op, a step or a captured graph that does not fit the executor it runs on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ExecError {
    /// A host-side operation was asked of a stream that is being captured into a CUDA graph,
    /// where it would be recorded with stale host data.
    #[error("{op}: the stream is being captured into a CUDA graph; call it outside the capture")]
    Capturing {
        /// The method.
        op: &'static str,
    },
    /// A byte range runs past the end of the buffer or region it addresses, or ends before it
    /// starts.
    #[error("{op}: `{what}` range {start}..{end} does not fit in {len} bytes")]
    OutOfBounds {
        /// The range op or method.
        op: &'static str,
        /// Which argument or region.
        what: String,
        /// Range start, bytes.
        start: usize,
        /// Range end, bytes.
        end: usize,
        /// Bytes available.
        len: usize,
    },
    /// A byte range whose start or length is not a multiple of the element size.
    #[error("{op}: `{what}` range {start}..{end} is not aligned to {align}-byte elements")]
    Misaligned {
        /// The range op or method.
        op: &'static str,
        /// Which argument.
        what: String,
        /// Range start, bytes.
        start: usize,
        /// Range end, bytes.
        end: usize,
        /// Required alignment, bytes.
        align: usize,
    },
    /// Two ranges of one op cover different numbers of elements.
    #[error("{op}: `{what}` covers {got} elements, expected {expected}")]
    ElemCount {
        /// The range op.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// Elements required (those of the first range).
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// A range op addresses a region of the wrong element type (e.g. an FP32 cast source in
    /// an FP16 region, or S as a parameter region).
    #[error("{op}: region {region} cannot be the {role} (needs {needs})")]
    WrongRegion {
        /// The range op.
        op: &'static str,
        /// The region given.
        region: Region,
        /// Its role in the op, e.g. `"source"`.
        role: &'static str,
        /// What the role needs, in words.
        needs: &'static str,
    },
    /// The step configuration needs a region the plan does not allocate.
    #[error("{what} needs region {region}, which the memory plan does not allocate")]
    MissingRegion {
        /// The configuration item, e.g. `"SGD momentum 0.9"`.
        what: String,
        /// The region it needs.
        region: Region,
    },
    /// A captured graph was replayed on an executor other than the one that captured it.
    #[error("graph captured on executor #{captured_on} replayed on executor #{replayed_on}")]
    ForeignGraph {
        /// Id of the executor that captured it.
        captured_on: u64,
        /// Id of the executor asked to replay it.
        replayed_on: u64,
    },
    /// A captured graph was replayed after the step's configuration changed (its launch
    /// arguments, e.g. the learning rate, are baked in): capture again.
    #[error("graph captured at configuration #{captured} replayed at configuration #{current}; capture it again")]
    StaleGraph {
        /// Configuration generation when captured.
        captured: u64,
        /// Current configuration generation.
        current: u64,
    },
    /// A capture was asked for an empty op list (CUDA would give no graph).
    #[error("nothing to capture: the op list is empty")]
    EmptyCapture,
}

/// A failure on the CUDA side.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CudaError {
    /// NVRTC rejected a kernel source.
    #[error("NVRTC failed on {file} for {arch}: {log}")]
    Compile {
        /// The `.cu` file (NVRTC program name).
        file: &'static str,
        /// The target, e.g. `"sm_90"`.
        arch: &'static str,
        /// NVRTC's error and log.
        log: String,
    },
    /// The device is older than any architecture the kernels are built for.
    #[error("compute capability {major}.{minor} is not supported (needs 8.0 or newer)")]
    UnsupportedArch {
        /// Major compute capability.
        major: i32,
        /// Minor compute capability.
        minor: i32,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed while trying to {op}: {code}")]
    Driver {
        /// What we were doing, e.g. `"launch amp_sgd_step"`.
        op: String,
        /// The driver's error, printed.
        code: String,
    },
    /// A launch's argument list does not match the kernel's [`crate::kernels::signature`]
    /// (a bug in the launch module, caught before the driver sees it).
    #[error(
        "arguments for {kernel} do not match its signature: expected {expected:?}, got {got:?}"
    )]
    ArgumentMismatch {
        /// The entry point.
        kernel: &'static str,
        /// The signature's parameter types.
        expected: Vec<crate::kernels::ParamType>,
        /// The types passed.
        got: Vec<crate::kernels::ParamType>,
    },
    /// A buffer or stream belongs to another CUDA context than the kernels or the stream.
    #[error("{what} belongs to another CUDA context")]
    ContextMismatch {
        /// Which argument.
        what: String,
    },
    /// A kernel table disagrees with its sources or its signatures (found before compiling).
    #[error(transparent)]
    Table(#[from] KernelTableError),
}

/// How a kernel table (its [`crate::kernels::KernelSource`]s and their
/// [`crate::kernels::Signatures`]) disagrees with the sources: found by
/// [`crate::kernels::check_table`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KernelTableError {
    /// A listed entry point is not defined in its file as
    /// `extern "C" __global__ void <name>(...)`.
    #[error("{file} does not define entry point {entry} (as `extern \"C\" __global__ void {entry}(...)`)")]
    NotDefined {
        /// The `.cu` file.
        file: &'static str,
        /// The entry point.
        entry: &'static str,
    },
    /// A file exports another number of kernels than its table lists.
    #[error(
        "{file} exports {exported} `extern \"C\" __global__` kernels, its table lists {listed}"
    )]
    ExportCount {
        /// The `.cu` file.
        file: &'static str,
        /// `extern "C" __global__` declarations in the file.
        exported: usize,
        /// Entry points the table lists for it.
        listed: usize,
    },
    /// A listed entry point has no signature.
    #[error("entry point {entry} has no signature")]
    NoSignature {
        /// The entry point.
        entry: &'static str,
    },
    /// An entry point's definition and its signature differ in parameter count.
    #[error(
        "entry point {entry} takes {declared} parameters in {file}, its signature {signature}"
    )]
    ParamCount {
        /// The `.cu` file.
        file: &'static str,
        /// The entry point.
        entry: &'static str,
        /// Parameters in the definition.
        declared: usize,
        /// Parameters in the signature.
        signature: usize,
    },
    /// An entry point is listed twice (a launch looks kernels up by name).
    #[error("entry point {entry} is listed twice")]
    Duplicate {
        /// The entry point.
        entry: &'static str,
    },
}

impl From<cudnn_cbr_runtime::NoCudaDevice> for AmpError {
    fn from(e: cudnn_cbr_runtime::NoCudaDevice) -> Self {
        AmpError::NoDevice { reason: e.reason }
    }
}
