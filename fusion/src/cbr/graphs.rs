//! The graphs of a CBR training step, built with the [`Graph`] API, FP16 NHWC tensors and FP32
//! per-channel statistics (CUDNN_PATTERNS.md records which of these cuDNN accepts for sm_90).
//!
//! Each builder returns the graph and the ids of its real tensors, so callers can bind buffers.

use super::ConvShape;
use crate::graph::{BnFinalizeInputs, BnFinalizeOutputs, DataType, Graph, TensorAttrs, TensorId};

/// Real tensors of a forward conv graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvFpropTensors {
    /// Input (the previous conv's raw output when there is a prologue).
    pub x: TensorId,
    /// Filter.
    pub w: TensorId,
    /// Output.
    pub y: TensorId,
    /// Prologue scale and bias (FP16), when present.
    pub prologue: Option<(TensorId, TensorId)>,
    /// Σy and Σy² per channel, when GenStats is fused.
    pub stats: Option<(TensorId, TensorId)>,
}

/// y = conv(x, w), optionally with the BN-apply prologue `relu(x·s + b)` and GenStats.
pub fn conv_fprop(shape: &ConvShape, prologue: bool, genstats: bool) -> (Graph, ConvFpropTensors) {
    let name = match (prologue, genstats) {
        (true, true) => "scale_bias_relu_conv_genstats",
        (false, true) => "conv_genstats",
        (true, false) => "scale_bias_relu_conv",
        (false, false) => "conv_fprop",
    };
    let mut g = Graph::new(name);
    let x = g.tensor(TensorAttrs::new("X", shape.x_dims()));
    let w = g.tensor(TensorAttrs::new("W", shape.w_dims()));
    let (input, pro) = if prologue {
        let s = g.tensor(TensorAttrs::vector("scale", shape.c).dtype(DataType::Half));
        let b = g.tensor(TensorAttrs::vector("bias", shape.c).dtype(DataType::Half));
        let v1 = g.mul(x, s);
        let v2 = g.add(v1, b);
        (g.relu(v2), Some((s, b)))
    } else {
        (x, None)
    };
    let y = g.conv_fprop(input, w, shape.conv_attrs());
    g.set_output(y, None).expect("y is in the graph");
    let stats = genstats.then(|| {
        let (sum, sq) = g.genstats(y);
        g.set_output(sum, Some(DataType::Float)).expect("in graph");
        g.set_output(sq, Some(DataType::Float)).expect("in graph");
        (sum, sq)
    });
    (
        g,
        ConvFpropTensors {
            x,
            w,
            y,
            prologue: pro,
            stats,
        },
    )
}

/// dx = conv_dgrad(dy, w): returns (graph, dy, w, dx).
pub fn conv_dgrad(shape: &ConvShape) -> (Graph, [TensorId; 3]) {
    let mut g = Graph::new("conv_dgrad");
    let dy = g.tensor(TensorAttrs::new("dY", shape.y_dims()));
    let w = g.tensor(TensorAttrs::new("W", shape.w_dims()));
    let dx = g.conv_dgrad(dy, w, shape.conv_attrs(), shape.x_dims());
    g.set_output(dx, None).expect("in graph");
    (g, [dy, w, dx])
}

/// dw = conv_wgrad(x, dy) with dW in `dw_dtype`: returns (graph, x, dy, dw).
pub fn conv_wgrad(shape: &ConvShape, dw_dtype: DataType) -> (Graph, [TensorId; 3]) {
    let mut g = Graph::new("conv_wgrad");
    let x = g.tensor(TensorAttrs::new("X", shape.x_dims()));
    let dy = g.tensor(TensorAttrs::new("dY", shape.y_dims()));
    let dw = g.conv_wgrad(x, dy, shape.conv_attrs(), shape.w_dims());
    g.set_output(dw, Some(dw_dtype)).expect("in graph");
    (g, [x, dy, dw])
}

/// BN finalize for `k` channels: by-value ε and momentum (f64) and element count (i64);
/// eq_scale/eq_bias FP16.
pub fn bn_finalize(k: i64) -> (Graph, BnFinalizeInputs, BnFinalizeOutputs) {
    let mut g = Graph::new("bn_finalize");
    let mut v = |name: &str| g.tensor(TensorAttrs::vector(name, k).dtype(DataType::Float));
    let (sum, sq_sum, scale, bias, rm, rv) = (
        v("sum"),
        v("sq_sum"),
        v("gamma"),
        v("beta"),
        v("running_mean"),
        v("running_var"),
    );
    let inputs = BnFinalizeInputs {
        sum,
        sq_sum,
        scale,
        bias,
        prev_running_mean: rm,
        prev_running_var: rv,
        epsilon: g.tensor(TensorAttrs::scalar("epsilon", DataType::Double)),
        momentum: g.tensor(TensorAttrs::scalar("momentum", DataType::Double)),
        accum_count: g.tensor(TensorAttrs::scalar("count", DataType::Int64)),
    };
    let o = g.bn_finalize(inputs);
    for t in [
        o.eq_scale,
        o.eq_bias,
        o.saved_mean,
        o.saved_inv_std,
        o.updated_running_mean,
        o.updated_running_var,
    ] {
        g.set_output(t, None).expect("in graph");
    }
    (g, inputs, o)
}

/// The BN apply: a = relu(y·s + b) over `[N,K,P,Q]`: returns (graph, y, s, b, a).
pub fn scale_bias_relu(dims: [i64; 4], vec_dtype: DataType) -> (Graph, [TensorId; 4]) {
    let mut g = Graph::new("scale_bias_relu");
    let y = g.tensor(TensorAttrs::new("Y", dims));
    let s = g.tensor(TensorAttrs::vector("scale", dims[1]).dtype(vec_dtype));
    let b = g.tensor(TensorAttrs::vector("bias", dims[1]).dtype(vec_dtype));
    let v1 = g.mul(y, s);
    let v2 = g.add(v1, b);
    let a = g.relu(v2);
    g.set_output(a, None).expect("in graph");
    (g, [y, s, b, a])
}
