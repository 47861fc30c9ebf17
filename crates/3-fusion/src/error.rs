//! The fusion crate's error type. Every failure names what it was about.

use cudnn_fe_sys::{CudnnError, LoadError};

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while building, planning or running a graph.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// cuDNN could not be loaded (the message lists every path tried).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The graph failed validation (before any cuDNN call).
    #[error(transparent)]
    Graph(#[from] crate::graph::GraphError),
    /// A cuDNN call failed; `what` says which step (descriptor kind, attribute, graph).
    #[error("{what}: {source}")]
    Cudnn {
        /// The step that failed.
        what: String,
        /// cuDNN's status and last-error text.
        #[source]
        source: CudnnError,
    },
    /// A cuDNN step failed without a status (e.g. an attribute came back empty).
    #[error("{0}")]
    CudnnMessage(String),
    /// The loaded cuDNN is too old to build plans from device-properties JSON.
    #[error(
        "cuDNN {version} cannot build plans without a GPU: deviceless planning needs 9.8 or newer"
    )]
    DevicelessUnsupported {
        /// `cudnnGetVersion()` of the loaded library.
        version: usize,
    },
    /// The device-properties JSON is malformed or incomplete.
    #[error("device properties{}: {reason}", source_name.as_ref().map(|s| format!(" ({s})")).unwrap_or_default())]
    DeviceProps {
        /// File name or other origin of the JSON, when known.
        source_name: Option<String>,
        /// What is wrong (e.g. the missing key).
        reason: String,
    },
    /// Heuristics returned no usable engine configuration for a graph.
    #[error("no engine for graph `{graph}` on {target}: heuristics ({mode}) reported {reported} configs, {usable} passed cuDNN's support checks")]
    NoEngine {
        /// Graph name.
        graph: String,
        /// Target name.
        target: String,
        /// Heuristics mode(s) asked.
        mode: String,
        /// Count cuDNN reported.
        reported: usize,
        /// Configs actually returned.
        usable: usize,
    },
    /// No usable CUDA device (no driver, no GPU, or the driver refused).
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// What is missing.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("{what}: CUDA driver error {message}")]
    Driver {
        /// The step.
        what: String,
        /// The driver's error.
        message: String,
    },
    /// A tensor binding is unusable; nothing was sent to cuDNN.
    #[error("plan `{graph}`: tensor `{tensor}`: {problem}")]
    Binding {
        /// The plan's graph.
        graph: String,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        problem: BindingProblem,
    },
    /// The caller's workspace is smaller than the plan needs.
    #[error("plan `{graph}` needs {needed} bytes of workspace, got {got}")]
    WorkspaceTooSmall {
        /// The plan's graph.
        graph: String,
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        got: usize,
    },
    /// The handle's pooled workspace would have to grow while its stream captures a CUDA
    /// graph (an allocation inside a capture would be owned by the graph).
    #[error("the pooled workspace must grow from {pooled} to {needed} bytes while its stream is capturing a CUDA graph; call Handle::reserve_workspace({needed}) before capturing")]
    WorkspaceGrowthInCapture {
        /// Bytes needed.
        needed: usize,
        /// Bytes the pool holds.
        pooled: usize,
    },
    /// A handle on the per-thread default stream was used from another thread, whose
    /// per-thread stream is a different stream.
    #[error("this cuDNN handle is on the per-thread default stream of the thread that made it; use it from that thread (or make the handle on an owned stream)")]
    WrongThread,
    /// A plan-cache file could not be read or written.
    #[error("plan cache {path}: {reason}")]
    CacheFile {
        /// The file.
        path: String,
        /// What failed.
        reason: String,
    },
    /// A layer or network configuration is invalid (checked before any arithmetic on it).
    #[error("{layer}: `{field}` {problem}")]
    InvalidConfig {
        /// The layer (its shape label) or network element at fault.
        layer: String,
        /// The field.
        field: String,
        /// What is wrong with its value.
        problem: String,
    },
    /// A layer buffer is missing or of the wrong kind.
    #[error("buffer `{name}` {problem}")]
    Buffer {
        /// The buffer.
        name: String,
        /// What is wrong.
        problem: String,
    },
    /// One of our own kernels could not be compiled, loaded or launched.
    #[error("kernel {kernel}: {problem}")]
    Kernel {
        /// The kernel (its entry point) or module.
        kernel: String,
        /// What went wrong.
        problem: String,
    },
    /// Executing a plan on the simulated CUDA device (the graph interpreter in place of
    /// cuDNN, docs/simulator.md) failed or was refused.
    #[error("simulated device: plan `{plan}`: {problem}")]
    Simulator {
        /// The plan's graph.
        plan: String,
        /// What failed (an interpreter error names the tensor's uid and name).
        problem: String,
    },
    /// Synchronized BN could not sum its statistics over the replicas.
    #[error("synchronized BN: {0}")]
    BnSync(String),
    /// The CPU reference executor rejected its inputs.
    #[error(transparent)]
    Reference(#[from] crate::reference::ReferenceError),
    /// Neither route of a CBR layer has engines on this target.
    #[error("layer {layer}: no route runs on this target; fused: {fused}; unfused: {unfused}; generic: {generic}")]
    NoRoute {
        /// The layer's shape.
        layer: String,
        /// Why the fused route failed.
        fused: String,
        /// Why the unfused route failed.
        unfused: String,
        /// Why the generic (reduction-based) route failed.
        generic: String,
    },
    /// Engine configs existed but no execution plan finalized.
    #[error("no execution plan finalized for graph `{graph}` on {target}: tried {tried} configs; last error: {last}")]
    NoPlan {
        /// Graph name.
        graph: String,
        /// Target name.
        target: String,
        /// How many configs were tried.
        tried: usize,
        /// The last failure's text.
        last: String,
    },
    /// An operation graph lowered for one device was planned for another target: a graph
    /// lowered without a handle ([`OperationGraph::new`](crate::lower::OperationGraph::new))
    /// on a live target, whose heuristics would not rank for its device, or one lowered on
    /// another handle.
    #[error("graph `{graph}` was lowered for {lowered_for} but is planned for {planned_for}; lower it with OperationGraph::for_target(graph, target)")]
    LoweredForOtherTarget {
        /// Graph name.
        graph: String,
        /// What the graph was lowered for.
        lowered_for: String,
        /// The target it was planned for.
        planned_for: String,
    },
    /// Autotuning was asked for on a target without a device to time plans on, and no tuned
    /// choice was on record for the graph.
    #[error("graph `{graph}`: autotuning needs a live device, but {target} is a deviceless target and no tuned plan is on record; plan with heuristics, or tune on a target made from a cuDNN handle")]
    AutotuneNeedsDevice {
        /// Graph name.
        graph: String,
        /// Target name.
        target: String,
    },
    /// A file the library reads but does not control (a device-properties document) is not a
    /// regular file within its size limit, or cannot be read.
    #[error("{what} {path}: {problem}")]
    File {
        /// What the file was to be (e.g. "device-properties file").
        what: &'static str,
        /// The path.
        path: String,
        /// What it is instead, or what failed.
        problem: cudnn_cbr_runtime::untrusted::FileProblem,
    },
}

/// Why a tensor binding was rejected before calling cuDNN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindingProblem {
    /// No buffer or scalar was bound.
    Missing,
    /// The device pointer is null.
    Null,
    /// The pointer is not aligned to the bytes cuDNN was promised.
    Misaligned {
        /// The pointer value.
        address: u64,
        /// Required alignment.
        alignment: u64,
    },
    /// The buffer is smaller than the tensor.
    TooSmall {
        /// Bytes the tensor spans.
        needed: usize,
        /// Bytes bound.
        got: usize,
    },
    /// The buffer's element type is not the tensor's.
    WrongType {
        /// The tensor's type.
        expected: crate::graph::DataType,
        /// The bound type.
        got: crate::graph::DataType,
    },
    /// A device buffer bound to a by-value scalar, or a scalar bound to a device tensor.
    WrongKind,
    /// The tensor is not a real tensor of this plan.
    NotInPlan,
}

impl std::fmt::Display for BindingProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BindingProblem::Missing => write!(f, "nothing is bound to it"),
            BindingProblem::Null => write!(f, "its device pointer is null"),
            BindingProblem::Misaligned { address, alignment } => {
                write!(f, "pointer {address:#x} is not {alignment}-byte aligned")
            }
            BindingProblem::TooSmall { needed, got } => {
                write!(f, "it spans {needed} bytes but the buffer has {got}")
            }
            BindingProblem::WrongType { expected, got } => {
                write!(f, "it is {expected} but a {got} buffer was bound")
            }
            BindingProblem::WrongKind => {
                write!(
                    f,
                    "by-value scalars take host values, device tensors take buffers"
                )
            }
            BindingProblem::NotInPlan => write!(f, "it is not a real tensor of this plan"),
        }
    }
}

impl Error {
    pub(crate) fn cudnn(what: impl Into<String>, source: CudnnError) -> Self {
        Error::Cudnn {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn cudnn_msg(what: impl Into<String>) -> Self {
        Error::CudnnMessage(what.into())
    }
}

impl From<cudnn_cbr_runtime::NoCudaDevice> for Error {
    fn from(e: cudnn_cbr_runtime::NoCudaDevice) -> Self {
        Error::NoDevice { reason: e.reason }
    }
}
