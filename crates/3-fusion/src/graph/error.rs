//! Everything graph validation catches, each naming the tensor and/or node.

/// A graph that cannot be lowered, found before any cuDNN call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// The graph has no nodes.
    #[error("graph `{graph}` has no nodes")]
    EmptyGraph {
        /// Graph name.
        graph: String,
    },
    /// The graph stores nothing (every tensor produced is virtual).
    #[error("graph `{graph}` has no real output: mark at least one with set_output")]
    NoOutputs {
        /// Graph name.
        graph: String,
    },
    /// A node refers to a tensor id that is not in this graph.
    #[error("{node}: tensor id {id} does not belong to this graph")]
    UnknownTensor {
        /// Node.
        node: String,
        /// The foreign id.
        id: u32,
    },
    /// A dimension is zero or negative.
    #[error("tensor `{tensor}`: dimension {index} is {value}; dims must be positive")]
    NonPositiveDim {
        /// Tensor.
        tensor: String,
        /// Which dim.
        index: usize,
        /// Its value.
        value: i64,
    },
    /// A tensor has no dims (and none could be inferred).
    #[error("tensor `{tensor}` has no dims")]
    MissingDims {
        /// Tensor.
        tensor: String,
    },
    /// Strides and dims differ in length.
    #[error("tensor `{tensor}` has {dims} dims but {strides} strides")]
    StridesRank {
        /// Tensor.
        tensor: String,
        /// Number of dims.
        dims: usize,
        /// Number of strides.
        strides: usize,
    },
    /// A stride is zero or negative.
    #[error("tensor `{tensor}`: stride {index} is {value}; strides must be positive")]
    NonPositiveStride {
        /// Tensor.
        tensor: String,
        /// Which stride.
        index: usize,
        /// Its value.
        value: i64,
    },
    /// Element count or byte size does not fit in i64.
    #[error("tensor `{tensor}`: its size overflows a 64-bit integer")]
    SizeOverflow {
        /// Tensor.
        tensor: String,
    },
    /// Two tensors carry the same explicit unique id.
    #[error("tensors `{first}` and `{second}` share the unique id {uid}")]
    DuplicateUid {
        /// The id.
        uid: i64,
        /// First tensor.
        first: String,
        /// Second tensor.
        second: String,
    },
    /// A declared tensor no node uses.
    #[error("tensor `{tensor}` is declared but no node uses it")]
    DanglingTensor {
        /// Tensor.
        tensor: String,
    },
    /// A virtual tensor is produced but nothing consumes it (its value would be lost).
    #[error("virtual tensor `{tensor}` is produced by {node} but never used: mark it as an output or drop it")]
    UnusedVirtual {
        /// Tensor.
        tensor: String,
        /// Producer.
        node: String,
    },
    /// A virtual tensor is read but no node produces it.
    #[error("virtual tensor `{tensor}` is read by {node} but nothing produces it")]
    VirtualInput {
        /// Tensor.
        tensor: String,
        /// Consumer.
        node: String,
    },
    /// A tensor is written by more than one node.
    #[error("tensor `{tensor}` is written by both {first} and {second}")]
    MultipleProducers {
        /// Tensor.
        tensor: String,
        /// First writer.
        first: String,
        /// Second writer.
        second: String,
    },
    /// A by-value (host scalar) tensor is written by a node.
    #[error("{node}: by-value scalar `{tensor}` cannot be an output")]
    ByValueOutput {
        /// Tensor.
        tensor: String,
        /// Node.
        node: String,
    },
    /// A by-value tensor that is not a single element `[1,1,1,1]`.
    #[error("by-value scalar `{tensor}` must have dims [1,1,1,1], has {dims:?}")]
    ByValueShape {
        /// Tensor.
        tensor: String,
        /// Its dims.
        dims: Vec<i64>,
    },
    /// A by-value tensor marked virtual.
    #[error("by-value scalar `{tensor}` cannot be virtual")]
    VirtualByValue {
        /// Tensor.
        tensor: String,
    },
    /// A node needs a scalar passed by value here.
    #[error("{node}: `{tensor}` must be a by-value scalar (TensorAttrs::scalar)")]
    ScalarRequired {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
    },
    /// Wrong number of dims for the node.
    #[error("{node}: `{tensor}` must have {expected} dims, has {got}")]
    Rank {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
        /// Required rank.
        expected: usize,
        /// Actual rank.
        got: usize,
    },
    /// Channel counts disagree between tensors of one node.
    #[error("{node}: `{tensor}` has {got} channels, expected {expected}")]
    ChannelMismatch {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
        /// Required channels.
        expected: i64,
        /// Actual channels.
        got: i64,
    },
    /// A tensor has the wrong element type for the node.
    #[error("{node}: `{tensor}` is {got}, expected {expected}")]
    WrongDtype {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
        /// Allowed types.
        expected: String,
        /// Actual type.
        got: String,
    },
    /// A 4-D tensor that must be channels-last (NHWC) is not.
    #[error("{node}: `{tensor}` must be channels-last NHWC (packed strides would be {expected:?}), has strides {got:?}")]
    NotNhwc {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
        /// Packed NHWC strides for its dims.
        expected: Vec<i64>,
        /// Its strides.
        got: Vec<i64>,
    },
    /// Bad convolution geometry.
    #[error("{node}: {reason}")]
    ConvAttr {
        /// Node.
        node: String,
        /// What is wrong.
        reason: String,
    },
    /// The convolution's output would be empty.
    #[error("{node}: output {dim} would be smaller than 1 (input {input}, filter {filter})")]
    ConvOutputEmpty {
        /// Node.
        node: String,
        /// "height" or "width".
        dim: &'static str,
        /// Input extent.
        input: i64,
        /// Filter extent.
        filter: i64,
    },
    /// A tensor's dims differ from what the node requires.
    #[error("{node}: `{tensor}` has dims {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
        /// Required dims.
        expected: Vec<i64>,
        /// Actual dims.
        got: Vec<i64>,
    },
    /// Pointwise inputs that cannot broadcast to one shape.
    #[error("{node}: `{tensor}` with dims {dims:?} does not broadcast to {to:?}")]
    NotBroadcastable {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
        /// Its dims.
        dims: Vec<i64>,
        /// The shape of the first input.
        to: Vec<i64>,
    },
    /// A pointwise mode got the wrong number of inputs.
    #[error("{node}: {mode} takes {expected} inputs, got {got}")]
    Arity {
        /// Node.
        node: String,
        /// Mode name.
        mode: &'static str,
        /// Required count.
        expected: usize,
        /// Actual count.
        got: usize,
    },
    /// A tensor that must be a per-channel vector `[1,C,1,1]` is not.
    #[error(
        "{node}: `{tensor}` must be a per-channel vector [1,{channels},1,1], has dims {dims:?}"
    )]
    NotPerChannel {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
        /// Required C.
        channels: i64,
        /// Its dims.
        dims: Vec<i64>,
    },
    /// Running mean and variance must be given together.
    #[error("{node}: running mean and running variance must be given together")]
    RunningStatsPair {
        /// Node.
        node: String,
    },
    /// Alphas other than 1 on a mode that ignores them.
    #[error("{node}: alphas apply to add only; {mode} got α1={alpha1}, α2={alpha2}")]
    AlphaUnsupported {
        /// Node.
        node: String,
        /// Mode name.
        mode: &'static str,
        /// α1.
        alpha1: f32,
        /// α2.
        alpha2: f32,
    },
    /// A reduction's output dims are not the input's with some dims collapsed to 1.
    #[error("{node}: reduction output `{tensor}` has dims {output:?}; each must equal the input's ({input:?}) or be 1")]
    ReductionDims {
        /// Node.
        node: String,
        /// The output tensor.
        tensor: String,
        /// The input's dims.
        input: Vec<i64>,
        /// The requested output dims.
        output: Vec<i64>,
    },
    /// A node reads a tensor that it also writes.
    #[error("{node}: `{tensor}` is both an input and an output")]
    InPlace {
        /// Node.
        node: String,
        /// Tensor.
        tensor: String,
    },
}
