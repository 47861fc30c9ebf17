//! Typed errors of the CPU reference executor.
//!
//! Every public op validates its inputs before it touches them and returns one of these instead
//! of panicking. Each variant names the tensor or parameter at fault, so a test can assert both
//! the variant and the name, and a message read in a log says what to fix.

use thiserror::Error;

/// What a reference op reports when its inputs are unusable.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// A slice does not hold the number of elements its shape calls for.
    #[error("tensor `{tensor}` has {got} elements, expected {expected}")]
    ShapeMismatch {
        /// The tensor's name, as in the op's signature (`x`, `w`, `dy`, `gamma`, ...).
        tensor: &'static str,
        /// The element count its shape calls for.
        expected: usize,
        /// The slice's length.
        got: usize,
    },
    /// Two tensors that must have the same NHWC shape do not (a chain's layers, a shortcut).
    #[error("tensor `{tensor}` has NHWC shape {got:?}, expected {expected:?}")]
    IncompatibleShapes {
        /// The tensor whose shape is wrong.
        tensor: &'static str,
        /// The shape it must have, `[N, H, W, C]`.
        expected: [usize; 4],
        /// The shape it has, `[N, H, W, C]`.
        got: [usize; 4],
    },
    /// A dimension, stride or dilation that must be positive is zero.
    #[error("tensor `{tensor}`: dimension `{dim}` must be positive, got 0")]
    ZeroDimension {
        /// The tensor (or `conv` for strides and dilations) the dimension belongs to.
        tensor: &'static str,
        /// The dimension's name (`n`, `h`, `stride_w`, ...).
        dim: &'static str,
    },
    /// The dilated filter does not fit in the padded input, so the conv output would be empty.
    #[error(
        "convolution output `{axis}` is empty: padded input extent {padded} is smaller than the \
         dilated filter extent {filter}"
    )]
    EmptyOutput {
        /// `out_h` or `out_w`.
        axis: &'static str,
        /// Input extent plus both paddings.
        padded: usize,
        /// `dilation * (filter - 1) + 1`.
        filter: usize,
    },
    /// A shape whose element count does not fit in `usize`.
    #[error("tensor `{tensor}` is too large: its element count overflows usize")]
    TooLarge {
        /// The tensor whose element count overflows.
        tensor: &'static str,
    },
    /// A batch-norm hyper-parameter outside its domain.
    #[error("BN parameter `{param}` = {value} is invalid: expected {expected}")]
    InvalidBnParam {
        /// `epsilon` or `momentum`.
        param: &'static str,
        /// The value given.
        value: f64,
        /// The domain, in words.
        expected: &'static str,
    },
    /// Batch statistics over fewer than two elements per channel.
    #[error(
        "BN element count {count} is too small: the unbiased running variance needs at least 2 \
         elements per channel"
    )]
    CountTooSmall {
        /// The element count per channel (`N * H * W` of the normalized tensor).
        count: usize,
    },
    /// A chain's forward record lacks what the backward needs (forward and backward were run
    /// on different routes, or the record was edited).
    #[error(
        "forward record of layer {layer} lacks `{what}`; run forward and backward on one route"
    )]
    MissingForwardState {
        /// The layer, counted from 0.
        layer: usize,
        /// What is missing.
        what: &'static str,
    },
    /// An error inside one layer of a chain.
    #[error("layer {layer}: {inner}")]
    Layer {
        /// The layer, counted from 0.
        layer: usize,
        /// What went wrong there.
        inner: Box<ReferenceError>,
    },
    /// An environment variable the CPU executor reads holds a value it does not accept.
    #[error("{var}={value:?} is not accepted: expected {expected}")]
    Env {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// The values accepted.
        expected: &'static str,
    },
    /// A broken internal invariant (a bug in this module, never a property of the input).
    #[error("internal error in the CPU reference executor: {what}")]
    Internal {
        /// What failed.
        what: &'static str,
    },
}

impl ReferenceError {
    /// Wraps `self` as having happened in layer `layer` of a chain.
    pub fn in_layer(self, layer: usize) -> Self {
        ReferenceError::Layer {
            layer,
            inner: Box::new(self),
        }
    }
}

/// The result type of the reference executor (crate-private; callers see
/// `Result<T, ReferenceError>`).
pub(crate) type Result<T, E = ReferenceError> = std::result::Result<T, E>;
