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
