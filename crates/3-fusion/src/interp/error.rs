//! What the interpreter refuses, each error naming the tensor (uid and name) or the node.

use crate::graph::{DataType, GraphError};

/// Why a graph could not be interpreted over the given memory.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InterpError {
    /// The graph itself is invalid (what [`crate::graph::Graph::validate`] reports).
    #[error("invalid graph: {0}")]
    Graph(#[from] GraphError),
    /// A real tensor has no address (or a by-value tensor no scalar) in the variant pack.
    #[error("tensor uid {uid} `{name}`: not bound in the variant pack")]
    Unbound {
        /// Unique id.
        uid: i64,
        /// Name.
        name: String,
    },
    /// A tensor's address is null.
    #[error("tensor uid {uid} `{name}`: null address")]
    Null {
        /// Unique id.
        uid: i64,
        /// Name.
        name: String,
    },
    /// A tensor's address is not aligned as cuDNN is told (16 bytes).
    #[error("tensor uid {uid} `{name}`: address {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// Unique id.
        uid: i64,
        /// Name.
        name: String,
        /// The address.
        addr: u64,
        /// The alignment required.
        align: u64,
    },
    /// A tensor's address falls in no allocation the memory map knows.
    #[error("tensor uid {uid} `{name}`: address {addr:#x} is in no allocation")]
    Unmapped {
        /// Unique id.
        uid: i64,
        /// Name.
        name: String,
        /// The address.
        addr: u64,
    },
    /// The extent a tensor's dims and strides reach runs past its allocation's end.
    #[error(
        "tensor uid {uid} `{name}`: its dims and strides reach {span} bytes from {addr:#x}, \
         past the end of its allocation ({base:#x}, {len} bytes)"
    )]
    OutOfBounds {
        /// Unique id.
        uid: i64,
        /// Name.
        name: String,
        /// The address.
        addr: u64,
        /// Bytes the tensor spans from its address.
        span: u64,
        /// The allocation's base.
        base: u64,
        /// The allocation's length in bytes.
        len: u64,
    },
    /// An output's extent overlaps another real tensor's (cuDNN documents no in-place form).
    #[error("tensor uid {uid} `{name}`: output memory overlaps tensor uid {other_uid} `{other}`")]
    Overlap {
        /// Unique id of the output.
        uid: i64,
        /// Its name.
        name: String,
        /// Unique id of the other tensor.
        other_uid: i64,
        /// Its name.
        other: String,
    },
    /// A tensor's dims or strides cannot be laid out (negative stride, size overflow).
    #[error("tensor uid {uid} `{name}`: {problem}")]
    Layout {
        /// Unique id (0 for a virtual tensor).
        uid: i64,
        /// Name.
        name: String,
        /// What is wrong.
        problem: String,
    },
    /// A by-value tensor's scalar has another type than the tensor declares.
    #[error("tensor uid {uid} `{name}`: scalar is {got:?}, the tensor is {expected:?}")]
    ScalarType {
        /// Unique id.
        uid: i64,
        /// Name.
        name: String,
        /// What the pack gave.
        got: DataType,
        /// What the tensor declares.
        expected: DataType,
    },
    /// A node cannot run on the shapes or values it is given.
    #[error("node {index} ({kind}): {problem}")]
    Node {
        /// Node index in the graph.
        index: usize,
        /// Node kind.
        kind: &'static str,
        /// What is wrong.
        problem: String,
    },
}

/// Result of the interpreter (crate-private; callers see `Result<T, InterpError>`).
pub(crate) type Result<T> = std::result::Result<T, InterpError>;

/// A node error.
pub(super) fn node_err(
    index: usize,
    kind: &'static str,
    problem: impl Into<String>,
) -> InterpError {
    InterpError::Node {
        index,
        kind,
        problem: problem.into(),
    }
}
