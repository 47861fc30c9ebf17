//! The graphs of a CBR training step, built with the [`Graph`] API, FP16 NHWC tensors and FP32
//! per-channel statistics (docs/cudnn-graphs.md says which of these cuDNN accepts for sm_90, and why).
//!
//! Each builder returns the graph and the ids of its real tensors, so callers can bind buffers.

use super::ConvShape;
use crate::graph::{
    BatchNormBackwardInputs, BatchNormBackwardOutputs, BatchNormInputs, BatchNormOutputs,
    BnFinalizeInputs, BnFinalizeOutputs, DataType, DbnWeightInputs, DbnWeightOutputs, Graph,
    PointwiseAttrs, PointwiseMode, TensorAttrs, TensorId,
};

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
        let (a, scale_bias) = bn_prologue(&mut g, x, shape.c);
        (a, Some(scale_bias))
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

/// The BN-apply prologue `relu(x·s + b)` on `x`, with FP16 scale and bias over `c` channels:
/// returns the prologue's output and its (scale, bias) tensors.
fn bn_prologue(g: &mut Graph, x: TensorId, c: i64) -> (TensorId, (TensorId, TensorId)) {
    let s = g.tensor(TensorAttrs::vector("scale", c).dtype(DataType::Half));
    let b = g.tensor(TensorAttrs::vector("bias", c).dtype(DataType::Half));
    let v1 = g.mul(x, s);
    let v2 = g.add(v1, b);
    (g.relu(v2), (s, b))
}

/// Stores every output of the node added last (as [`Node::outputs`](crate::graph::Node::outputs)
/// lists them), with `dtype` when given.
fn store_last_outputs(g: &mut Graph, dtype: Option<DataType>) {
    let outputs = g.nodes().last().expect("a node was added").outputs();
    for t in outputs {
        g.set_output(t, dtype).expect("in graph");
    }
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
    store_last_outputs(&mut g, None);
    (g, inputs, o)
}

/// The residual form of the BN apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApplyResidual {
    /// a = relu(y·s + b).
    None,
    /// a = relu(y·s + b + r): an identity shortcut.
    Add,
    /// a = relu(y·s + b + r·s2 + b2): a shortcut through its own BN (downsample blocks).
    DualScaleBias,
}

/// Real tensors of an apply graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyTensors {
    /// Raw conv output.
    pub y: TensorId,
    /// eq_scale.
    pub scale: TensorId,
    /// eq_bias.
    pub bias: TensorId,
    /// Residual input, when present.
    pub residual: Option<TensorId>,
    /// Residual's own scale and bias (dual form).
    pub residual_scale_bias: Option<(TensorId, TensorId)>,
    /// The activation.
    pub a: TensorId,
}

/// The BN apply over `[N,K,P,Q]`: relu(y·s + b [+ r | + r·s2 + b2]), runtime-compiled by cuDNN.
pub fn apply(
    dims: [i64; 4],
    vec_dtype: DataType,
    residual: ApplyResidual,
) -> (Graph, ApplyTensors) {
    let name = match residual {
        ApplyResidual::None => "scale_bias_relu",
        ApplyResidual::Add => "scale_bias_add_relu",
        ApplyResidual::DualScaleBias => "dual_scale_bias_add_relu",
    };
    let mut g = Graph::new(name);
    let y = g.tensor(TensorAttrs::new("Y", dims));
    let s = g.tensor(TensorAttrs::vector("scale", dims[1]).dtype(vec_dtype));
    let b = g.tensor(TensorAttrs::vector("bias", dims[1]).dtype(vec_dtype));
    let v1 = g.mul(y, s);
    let v = g.add(v1, b);
    let (v, r_id, rsb) = residual_add(&mut g, v, dims, residual, vec_dtype);
    let a = g.relu(v);
    g.set_output(a, None).expect("in graph");
    (
        g,
        ApplyTensors {
            y,
            scale: s,
            bias: b,
            residual: r_id,
            residual_scale_bias: rsb,
            a,
        },
    )
}

/// `v [+ r | + r·s2 + b2]` with the residual tensors (FP16 `r` over `dims`, `s2`, `b2` in
/// `vec_dtype`):
/// returns the sum and the residual's tensors.
/// Real tensors of an evaluation-mode conv with its BN folded into an epilogue
/// ([`conv_scale_bias_relu`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvEpilogueTensors {
    /// Input.
    pub x: TensorId,
    /// Filter.
    pub w: TensorId,
    /// The eval-mode BN's per-channel scale (FP16 `[K]`).
    pub scale: TensorId,
    /// The eval-mode BN's per-channel bias (FP16 `[K]`).
    pub bias: TensorId,
    /// Residual input, when present.
    pub residual: Option<TensorId>,
    /// Residual's own scale and bias (dual form).
    pub residual_scale_bias: Option<(TensorId, TensorId)>,
    /// The output: the activation (with `relu`), else the BN output.
    pub out: TensorId,
}

/// Evaluation mode (inference), forward only: `out = relu(conv(x, w)·s + b [+ residual])`,
/// the BN folded into the conv's epilogue with the running statistics' `eq_scale` / `eq_bias`
/// (no statistics in the graph), the conv output virtual. `relu == false` leaves the ReLU
/// out (a shortcut's BN output, or a BN whose ReLU the next conv's prologue applies);
/// `residual` as in [`apply`].
pub fn conv_scale_bias_relu(
    shape: &ConvShape,
    residual: ApplyResidual,
    relu: bool,
) -> (Graph, ConvEpilogueTensors) {
    let name = match (residual, relu) {
        (ApplyResidual::None, true) => "conv_scale_bias_relu",
        (ApplyResidual::None, false) => "conv_scale_bias",
        (ApplyResidual::Add, _) => "conv_scale_bias_add_relu",
        (ApplyResidual::DualScaleBias, _) => "conv_scale_bias_dual_add_relu",
    };
    let dims = shape.y_dims();
    let mut g = Graph::new(name);
    let x = g.tensor(TensorAttrs::new("X", shape.x_dims()));
    let w = g.tensor(TensorAttrs::new("W", shape.w_dims()));
    let y = g.conv_fprop(x, w, shape.conv_attrs());
    let s = g.tensor(TensorAttrs::vector("scale", dims[1]).dtype(DataType::Half));
    let b = g.tensor(TensorAttrs::vector("bias", dims[1]).dtype(DataType::Half));
    let v1 = g.mul(y, s);
    let v = g.add(v1, b);
    let (v, r_id, rsb) = residual_add(&mut g, v, dims, residual, DataType::Half);
    // A residual is always followed by the block's ReLU.
    let out = if relu || residual != ApplyResidual::None {
        g.relu(v)
    } else {
        v
    };
    g.set_output(out, None).expect("in graph");
    (
        g,
        ConvEpilogueTensors {
            x,
            w,
            scale: s,
            bias: b,
            residual: r_id,
            residual_scale_bias: rsb,
            out,
        },
    )
}

fn residual_add(
    g: &mut Graph,
    v: TensorId,
    dims: [i64; 4],
    residual: ApplyResidual,
    vec_dtype: DataType,
) -> (TensorId, Option<TensorId>, Option<(TensorId, TensorId)>) {
    match residual {
        ApplyResidual::None => (v, None, None),
        ApplyResidual::Add => {
            let r = g.tensor(TensorAttrs::new("R", dims));
            (g.add(v, r), Some(r), None)
        }
        ApplyResidual::DualScaleBias => {
            let r = g.tensor(TensorAttrs::new("R", dims));
            let s2 = g.tensor(TensorAttrs::vector("scale2", dims[1]).dtype(vec_dtype));
            let b2 = g.tensor(TensorAttrs::vector("bias2", dims[1]).dtype(vec_dtype));
            let r1 = g.mul(r, s2);
            let r2 = g.add(r1, b2);
            (g.add(v, r2), Some(r), Some((s2, b2)))
        }
    }
}

/// The BN apply without residual: returns (graph, y, s, b, a).
pub fn scale_bias_relu(dims: [i64; 4], vec_dtype: DataType) -> (Graph, [TensorId; 4]) {
    let (g, t) = apply(dims, vec_dtype, ApplyResidual::None);
    (g, [t.y, t.scale, t.bias, t.a])
}

/// The residual form of the fused backward (docs/cudnn-graphs.md §5.2).
///
/// A form where the prologue's ReLU also had a residual added before it (`relu(BN(y) + r)`)
/// is deliberately absent: no network needs it (a block's input is stored and read raw by its
/// first conv and its shortcut), and the fused forward prologue has no add, so such a layer
/// would compute different functions on the fused and unfused routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackwardResidual {
    /// The previous BN's relu fed only this conv.
    None,
    /// The relu output also fed a shortcut: its gradient `dY_branch` adds to the dgrad output.
    FuseAdd,
}

/// Real tensors of the fused dgrad + dReLU + dBN-weights graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DgradDreluDbnTensors {
    /// Gradient w.r.t. this conv's output.
    pub dy: TensorId,
    /// This conv's filter.
    pub w: TensorId,
    /// The previous conv's raw output (the BN input).
    pub y_prev: TensorId,
    /// Saved mean of the previous BN.
    pub mean: TensorId,
    /// Saved inverse std of the previous BN.
    pub inv_std: TensorId,
    /// γ of the previous BN (FP32 parameter).
    pub gamma: TensorId,
    /// β of the previous BN.
    pub beta: TensorId,
    /// The shortcut gradient (FuseAdd).
    pub residual: Option<TensorId>,
    /// Gradient w.r.t. the BN output (after the relu backward), FP16.
    pub dz: TensorId,
    /// dγ, dβ and the dBN-apply coefficients.
    pub dbn: DbnWeightOutputs,
}

/// dgrad → BN recompute (the literal 4-op form) → relu backward → BN backward weights.
pub fn dgrad_drelu_dbn(
    shape: &ConvShape,
    residual: BackwardResidual,
) -> (Graph, DgradDreluDbnTensors) {
    let name = match residual {
        BackwardResidual::None => "dgrad_drelu_dbn",
        BackwardResidual::FuseAdd => "dgrad_add_drelu_dbn",
    };
    let mut g = Graph::new(name);
    let dy = g.tensor(TensorAttrs::new("dY", shape.y_dims()));
    let w = g.tensor(TensorAttrs::new("W", shape.w_dims()));
    let y_prev = g.tensor(TensorAttrs::new("Yprev", shape.x_dims()));
    let mut v = |name: &str| g.tensor(TensorAttrs::vector(name, shape.c).dtype(DataType::Float));
    let (mean, inv_std, gamma, beta) = (v("mean"), v("inv_std"), v("gamma"), v("beta"));
    let dxc = g.conv_dgrad(dy, w, shape.conv_attrs(), shape.x_dims());
    // Yprev − mean as ADD with α2 = −1: the form the specialised engine matches.
    let centered = g.pointwise(
        &[y_prev, mean],
        PointwiseAttrs::new(PointwiseMode::Add).alphas(1.0, -1.0),
    );
    let normed = g.mul(centered, inv_std);
    let scaled = g.mul(normed, gamma);
    let bn_out = g.add(scaled, beta);
    let mut grad = dxc;
    let mut res = None;
    match residual {
        BackwardResidual::None => {}
        BackwardResidual::FuseAdd => {
            let branch = g.tensor(TensorAttrs::new("dY_branch", shape.x_dims()));
            grad = g.add(dxc, branch);
            res = Some(branch);
        }
    }
    let dz = g.relu_backward(grad, bn_out);
    g.set_output(dz, Some(DataType::Half)).expect("in graph");
    let dbn = g.dbn_weight(DbnWeightInputs {
        x: y_prev,
        mean,
        inv_std,
        scale: gamma,
        dy: dz,
    });
    store_last_outputs(&mut g, Some(DataType::Float));
    (
        g,
        DgradDreluDbnTensors {
            dy,
            w,
            y_prev,
            mean,
            inv_std,
            gamma,
            beta,
            residual: res,
            dz,
            dbn,
        },
    )
}

/// Real tensors of the wgrad-with-prologue graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgradTensors {
    /// This conv's input before the BN apply (previous raw output), or the raw input.
    pub x: TensorId,
    /// Prologue scale and bias (FP16), when present.
    pub prologue: Option<(TensorId, TensorId)>,
    /// Gradient w.r.t. this conv's output.
    pub dy: TensorId,
    /// Filter gradient (FP16).
    pub dw: TensorId,
}

/// dW = wgrad(relu(x·s + b), dY) with FP16 dW (docs/cudnn-graphs.md §5.1); plain wgrad without the
/// prologue (first layer).
pub fn wgrad(shape: &ConvShape, prologue: bool) -> (Graph, WgradTensors) {
    let mut g = Graph::new(if prologue {
        "scale_bias_relu_wgrad"
    } else {
        "wgrad"
    });
    let x = g.tensor(TensorAttrs::new("X", shape.x_dims()));
    let (input, pro) = if prologue {
        let (a, scale_bias) = bn_prologue(&mut g, x, shape.c);
        (a, Some(scale_bias))
    } else {
        (x, None)
    };
    let dy = g.tensor(TensorAttrs::new("dY", shape.y_dims()));
    let dw = g.conv_wgrad(input, dy, shape.conv_attrs(), shape.w_dims());
    g.set_output(dw, Some(DataType::Half)).expect("in graph");
    (
        g,
        WgradTensors {
            x,
            prologue: pro,
            dy,
            dw,
        },
    )
}

/// Real tensors of the dBN apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbnApplyTensors {
    /// Gradient w.r.t. the BN output.
    pub dz: TensorId,
    /// The BN input.
    pub y_prev: TensorId,
    /// Coefficients A, B, C (FP32 per channel).
    pub abc: [TensorId; 3],
    /// Gradient w.r.t. the BN input (FP16).
    pub dy_prev: TensorId,
}

/// dYprev = A·dZ + B·Yprev + C over `[N,C,H,W]` (runtime-compiled by cuDNN).
pub fn dbn_apply(dims: [i64; 4]) -> (Graph, DbnApplyTensors) {
    let mut g = Graph::new("dbn_apply");
    let dz = g.tensor(TensorAttrs::new("dZ", dims));
    let y_prev = g.tensor(TensorAttrs::new("Yprev", dims));
    let mut v = |name: &str| g.tensor(TensorAttrs::vector(name, dims[1]).dtype(DataType::Float));
    let abc = [v("A"), v("B"), v("C")];
    let v1 = g.mul(dz, abc[0]);
    let v2 = g.mul(y_prev, abc[1]);
    let v3 = g.add(v1, v2);
    let dy_prev = g.add(v3, abc[2]);
    g.set_output(dy_prev, None).expect("in graph");
    (
        g,
        DbnApplyTensors {
            dz,
            y_prev,
            abc,
            dy_prev,
        },
    )
}

/// Unfused route: BN forward (training) with running stats, output `y_bn` stored FP16.
/// The previous and the updated running statistics are distinct tensors (bind them to distinct
/// buffers: cuDNN does not document in-place updates).
pub fn batchnorm_forward(dims: [i64; 4]) -> (Graph, BatchNormInputs, BatchNormOutputs) {
    let (mut g, inputs, o) = batchnorm_graph("batchnorm_forward", dims);
    g.set_output(o.y, None).expect("in graph");
    (g, inputs, o)
}

/// Real tensors of a BN forward fused with its activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchNormActivationTensors {
    /// Residual input, when present.
    pub residual: Option<TensorId>,
    /// The residual's own scale and bias (dual form).
    pub residual_scale_bias: Option<(TensorId, TensorId)>,
    /// The activation `relu(BN(x) [+ r | + r·s2 + b2])`, FP16.
    pub a: TensorId,
}

/// Unfused route, activation materialized: BN forward (training) whose normalized output stays
/// virtual and goes through the residual add and the ReLU in the same graph, storing only the
/// activation (what an unfused framework stores: its BN+add+ReLU kernel's output).
pub fn batchnorm_activation(
    dims: [i64; 4],
    residual: ApplyResidual,
) -> (
    Graph,
    BatchNormInputs,
    BatchNormOutputs,
    BatchNormActivationTensors,
) {
    let name = match residual {
        ApplyResidual::None => "batchnorm_relu",
        ApplyResidual::Add => "batchnorm_add_relu",
        ApplyResidual::DualScaleBias => "batchnorm_dual_scale_bias_add_relu",
    };
    let (mut g, inputs, o) = batchnorm_graph(name, dims);
    let (v, r, rsb) = residual_add(&mut g, o.y, dims, residual, DataType::Half);
    let a = g.relu(v);
    g.set_output(a, Some(DataType::Half)).expect("in graph");
    (
        g,
        inputs,
        o,
        BatchNormActivationTensors {
            residual: r,
            residual_scale_bias: rsb,
            a,
        },
    )
}

/// A NormForward (training) node with running statistics; its statistics are stored, its
/// normalized output `y` is left virtual for the caller to store or consume.
fn batchnorm_graph(name: &str, dims: [i64; 4]) -> (Graph, BatchNormInputs, BatchNormOutputs) {
    let mut g = Graph::new(name);
    let x = g.tensor(TensorAttrs::new("X", dims));
    let mut v = |name: &str| g.tensor(TensorAttrs::vector(name, dims[1]).dtype(DataType::Float));
    let (scale, bias, rm, rv) = (v("gamma"), v("beta"), v("running_mean"), v("running_var"));
    let inputs = BatchNormInputs {
        x,
        scale,
        bias,
        epsilon: g.tensor(TensorAttrs::scalar("epsilon", DataType::Float)),
        momentum: g.tensor(TensorAttrs::scalar("momentum", DataType::Float)),
        prev_running_mean: Some(rm),
        prev_running_var: Some(rv),
    };
    let o = g.batchnorm(inputs);
    for t in [o.mean, o.inv_variance]
        .into_iter()
        .chain(o.next_running_mean)
        .chain(o.next_running_var)
    {
        g.set_output(t, None).expect("in graph");
    }
    (g, inputs, o)
}

/// ReLU forward, stored: returns (graph, x, a). The unfused route's activation of a BN output
/// stored by [`batchnorm_forward`].
pub fn relu_forward(dims: [i64; 4]) -> (Graph, [TensorId; 2]) {
    let mut g = Graph::new("relu_forward");
    let x = g.tensor(TensorAttrs::new("X", dims));
    let a = g.relu(x);
    g.set_output(a, None).expect("in graph");
    (g, [x, a])
}

/// Unfused route: BN backward (dx, dγ, dβ).
pub fn batchnorm_backward(
    dims: [i64; 4],
) -> (Graph, BatchNormBackwardInputs, BatchNormBackwardOutputs) {
    let mut g = Graph::new("batchnorm_backward");
    let dy = g.tensor(TensorAttrs::new("dY", dims));
    let x = g.tensor(TensorAttrs::new("X", dims));
    let mut v = |name: &str| g.tensor(TensorAttrs::vector(name, dims[1]).dtype(DataType::Float));
    let (scale, mean, inv_variance) = (v("gamma"), v("mean"), v("inv_variance"));
    let inputs = BatchNormBackwardInputs {
        dy,
        x,
        scale,
        mean,
        inv_variance,
    };
    let o = g.batchnorm_backward(inputs);
    store_last_outputs(&mut g, None);
    (g, inputs, o)
}

/// Unfused route: dx = relu_bwd(dy, x) with the forward input stored: returns (graph, dy, x, dx).
pub fn relu_backward(dims: [i64; 4]) -> (Graph, [TensorId; 3]) {
    let mut g = Graph::new("relu_backward");
    let dy = g.tensor(TensorAttrs::new("dA", dims));
    let x = g.tensor(TensorAttrs::new("X", dims));
    let dx = g.relu_backward(dy, x);
    g.set_output(dx, None).expect("in graph");
    (g, [dy, x, dx])
}

/// Unfused route: y = x + b elementwise over `[N,C,H,W]` (a residual gradient join): returns
/// (graph, x, b, y).
pub fn add(dims: [i64; 4]) -> (Graph, [TensorId; 3]) {
    let mut g = Graph::new("add");
    let x = g.tensor(TensorAttrs::new("X", dims));
    let b = g.tensor(TensorAttrs::new("B", dims));
    let y = g.add(x, b);
    g.set_output(y, None).expect("in graph");
    (g, [x, b, y])
}

/// Real tensors of the BN-backward reduction graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbnReduceTensors {
    /// The BN's input (a conv's raw output), FP16.
    pub y: TensorId,
    /// Gradient w.r.t. the BN output, FP16.
    pub dz: TensorId,
    /// Saved batch mean (FP32 per channel).
    pub mean: TensorId,
    /// Saved inverse std (FP32 per channel).
    pub inv_std: TensorId,
    /// `Σ dz·x̂` per channel (FP32): dγ.
    pub dgamma: TensorId,
    /// `Σ dz` per channel (FP32): dβ.
    pub dbeta: TensorId,
}

/// Generic route: the BN's weight gradients by reduction over `[N,C,H,W]`:
/// `x̂ = (y − mean)·inv_std` (SUB, MUL, FP32 virtuals), `dγ = Σ dz·x̂` and `dβ = Σ dz` (two
/// ADD reductions to `[1,C,1,1]`, FP32). For channel counts where neither the fused
/// BN_BWD_WEIGHTS nor NormBackward has an engine (measured with cuDNN 9.28 on sm_90:
/// `GENERIC_POINTWISE_FUSION`, runtime compiled, for C = 12, 24, 63, 64).
pub fn dbn_reduce(dims: [i64; 4]) -> (Graph, DbnReduceTensors) {
    let c = dims[1];
    let mut g = Graph::new("dbn_reduce");
    let y = g.tensor(TensorAttrs::new("Y", dims));
    let dz = g.tensor(TensorAttrs::new("dZ", dims));
    let mut v = |name: &str| g.tensor(TensorAttrs::vector(name, c).dtype(DataType::Float));
    let (mean, inv_std) = (v("mean"), v("inv_std"));
    // SUB, not ADD with α2 = −1: the generic engines reject α2 ≠ 1 (docs/cudnn-graphs.md §9).
    let centered = g.sub(y, mean);
    let x_hat = g.mul(centered, inv_std);
    let prod = g.mul(dz, x_hat);
    let dgamma = g.reduce_sum_per_channel(prod, c);
    let dbeta = g.reduce_sum_per_channel(dz, c);
    for t in [dgamma, dbeta] {
        g.set_output(t, Some(DataType::Float)).expect("in graph");
    }
    (
        g,
        DbnReduceTensors {
            y,
            dz,
            mean,
            inv_std,
            dgamma,
            dbeta,
        },
    )
}

/// Per-channel `Σy` and `Σy²` of a stored conv output `[N,K,P,Q]` by two reductions (FP32
/// `[1,K,1,1]`): the statistics of a first conv whose fused conv + GenStats graph has only a
/// runtime-compiled engine (an input channel count that is not a multiple of 8, as a stem's 3,
/// measured with cuDNN 9.28 on sm_90). Returns (graph, y, sum, sq_sum).
pub fn channel_stats(dims: [i64; 4]) -> (Graph, [TensorId; 3]) {
    let k = dims[1];
    let mut g = Graph::new("channel_stats");
    let y = g.tensor(TensorAttrs::new("Y", dims));
    let sum = g.reduce_sum_per_channel(y, k);
    let squares = g.mul(y, y);
    let sq_sum = g.reduce_sum_per_channel(squares, k);
    for t in [sum, sq_sum] {
        g.set_output(t, Some(DataType::Float)).expect("in graph");
    }
    (g, [y, sum, sq_sum])
}

/// Real tensors of the dBN-coefficient graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbnCoefficientTensors {
    /// γ (FP32 parameter).
    pub gamma: TensorId,
    /// Saved inverse std.
    pub inv_std: TensorId,
    /// Saved batch mean.
    pub mean: TensorId,
    /// dγ from [`dbn_reduce`].
    pub dgamma: TensorId,
    /// dβ from [`dbn_reduce`].
    pub dbeta: TensorId,
    /// `−1/M` (M = N·H·W of the BN), a by-value FP32 scalar.
    pub neg_inv_count: TensorId,
    /// A = γ·inv_std (FP32).
    pub a: TensorId,
    /// B = −γ·inv_std²·dγ/M (FP32).
    pub b: TensorId,
    /// C = −γ·inv_std·dβ/M − B·mean (FP32).
    pub c: TensorId,
}

/// Generic route: the coefficients of `dy = A·dz + B·y + C` (the BN backward, see the CPU
/// reference's `bn` module) from dγ, dβ and the saved statistics, pointwise over `[1,C,1,1]`
/// vectors in FP32, in this order (each step one FP32 rounding):
/// `a = γ·inv_std`; `B = ((a·inv_std)·dγ)·(−1/M)`; `C = ((a·dβ)·(−1/M)) − B·mean`; `A = a`.
/// A and B are also consumed inside the graph, so they are stored through an identity.
pub fn dbn_coefficients(c: i64) -> (Graph, DbnCoefficientTensors) {
    let mut g = Graph::new("dbn_coefficients");
    let mut v = |name: &str| g.tensor(TensorAttrs::vector(name, c).dtype(DataType::Float));
    let (gamma, inv_std, mean, dgamma, dbeta) =
        (v("gamma"), v("inv_std"), v("mean"), v("dgamma"), v("dbeta"));
    let neg_inv_count = g.tensor(TensorAttrs::scalar("neg_inv_count", DataType::Float));
    let a = g.mul(gamma, inv_std);
    let a_is = g.mul(a, inv_std);
    let a_is_dg = g.mul(a_is, dgamma);
    let b = g.mul(a_is_dg, neg_inv_count);
    let a_db = g.mul(a, dbeta);
    let a_db_m = g.mul(a_db, neg_inv_count);
    let b_mean = g.mul(b, mean);
    let c_out = g.sub(a_db_m, b_mean);
    let a_out = g.identity(a);
    let b_out = g.identity(b);
    for t in [a_out, b_out, c_out] {
        g.set_output(t, Some(DataType::Float)).expect("in graph");
    }
    (
        g,
        DbnCoefficientTensors {
            gamma,
            inv_std,
            mean,
            dgamma,
            dbeta,
            neg_inv_count,
            a: a_out,
            b: b_out,
            c: c_out,
        },
    )
}
