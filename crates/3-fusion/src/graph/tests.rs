//! Graph description tests: shape inference, the table of bad graphs, signature stability.

use super::*;

/// conv(x, w) → y (stored) + genstats → sum, sq_sum (stored).
fn conv_genstats(
    n: i64,
    c: i64,
    hw: i64,
    k: i64,
    rs: i64,
    pad: i64,
    stride: i64,
) -> (Graph, TensorId) {
    let mut g = Graph::new("conv_genstats");
    let x = g.tensor(TensorAttrs::new("X", [n, c, hw, hw]));
    let w = g.tensor(TensorAttrs::new("W", [k, c, rs, rs]));
    let y = g.conv_fprop(x, w, ConvAttrs::default().padding(pad).stride(stride));
    g.set_output(y, None).unwrap();
    let (s, sq) = g.genstats(y);
    g.set_output(s, Some(DataType::Float)).unwrap();
    g.set_output(sq, Some(DataType::Float)).unwrap();
    (g, y)
}

/// The BN finalize graph for C channels.
fn finalize(c: i64) -> Graph {
    let mut g = Graph::new("bn_finalize");
    let v =
        |g: &mut Graph, name: &str| g.tensor(TensorAttrs::vector(name, c).dtype(DataType::Float));
    let inputs = BnFinalizeInputs {
        sum: v(&mut g, "sum"),
        sq_sum: v(&mut g, "sq_sum"),
        scale: v(&mut g, "gamma"),
        bias: v(&mut g, "beta"),
        prev_running_mean: v(&mut g, "rm"),
        prev_running_var: v(&mut g, "rv"),
        epsilon: g.tensor(TensorAttrs::scalar("eps", DataType::Double)),
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
        g.set_output(t, None).unwrap();
    }
    g
}

#[test]
fn conv_output_shapes_are_inferred() {
    let (g, y) = conv_genstats(32, 64, 56, 64, 3, 1, 1);
    assert_eq!(g.get(y).unwrap().dims, vec![32, 64, 56, 56]);
    let (g, y) = conv_genstats(8, 64, 56, 128, 3, 1, 2);
    assert_eq!(g.get(y).unwrap().dims, vec![8, 128, 28, 28]);
    let (g, y) = conv_genstats(2, 16, 7, 32, 1, 0, 1);
    assert_eq!(g.get(y).unwrap().dims, vec![2, 32, 7, 7]);
    // Dilation 2, 3x3, pad 2 keeps the size.
    let mut g = Graph::new("dilated");
    let x = g.tensor(TensorAttrs::new("X", [1, 4, 9, 9]));
    let w = g.tensor(TensorAttrs::new("W", [4, 4, 3, 3]));
    let y = g.conv_fprop(x, w, ConvAttrs::default().padding(2).dilation(2));
    assert_eq!(g.get(y).unwrap().dims, vec![1, 4, 9, 9]);
    g.set_output(y, None).unwrap();
    g.validate().unwrap();
}

#[test]
fn dtypes_follow_the_precision_context() {
    let (mut g, y) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
    g.validate().unwrap();
    assert_eq!(g.dtype(y), Some(DataType::Half));
    let sum = g.nodes()[1].outputs()[0];
    assert_eq!(g.dtype(sum), Some(DataType::Float));
    assert_eq!(g.get(sum).unwrap().dims, vec![1, 8, 1, 1]);
    // A virtual output takes the intermediate type.
    g.get_mut(y).unwrap().is_virtual = true;
    assert_eq!(g.dtype(y), Some(DataType::Float));
    let f = finalize(16);
    f.validate().unwrap();
    let o = f.nodes()[0].outputs();
    assert_eq!(
        f.dtype(o[0]),
        Some(DataType::Half),
        "eq_scale defaults to FP16"
    );
    assert_eq!(f.dtype(o[2]), Some(DataType::Float), "saved mean is FP32");
}

#[test]
fn retype_rewrites_explicit_and_context_dtypes_only() {
    // y = x·s + b: x and y take FP16 from the context, `s` is FP16 explicitly (as the BN
    // prologue's scale), `b` FP32 explicitly, the product an FP32 virtual.
    let mut g = Graph::new("retype");
    let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
    let s = g.tensor(TensorAttrs::vector("s", 8).dtype(DataType::Half));
    let b = g.tensor(TensorAttrs::vector("b", 8).dtype(DataType::Float));
    let v = g.mul(x, s);
    let y = g.add(v, b);
    g.set_output(y, None).unwrap();
    let original = g.signature().unwrap();
    assert_eq!(g.retype(DataType::Half, DataType::BFloat16), 3);
    for t in [x, s, y] {
        assert_eq!(g.dtype(t), Some(DataType::BFloat16), "{}", g.tname(t));
    }
    for t in [b, v] {
        assert_eq!(g.dtype(t), Some(DataType::Float), "{}", g.tname(t));
    }
    assert_eq!(g.precision().io, DataType::BFloat16);
    assert_eq!(g.precision().compute, DataType::Float);
    assert_ne!(
        g.signature().unwrap(),
        original,
        "the key sees the new type"
    );
    // Nothing of the old type is left, and the way back restores the same key.
    assert_eq!(g.retype(DataType::Half, DataType::BFloat16), 0);
    assert_eq!(g.retype(DataType::BFloat16, DataType::Half), 3);
    assert_eq!(g.signature().unwrap(), original);
}

#[test]
fn the_cbr_prologue_graph_validates() {
    let mut g = Graph::new("scale_bias_relu_conv_genstats");
    let x = g.tensor(TensorAttrs::new("X", [4, 16, 8, 8]));
    let s = g.tensor(TensorAttrs::vector("S", 16));
    let b = g.tensor(TensorAttrs::vector("B", 16));
    let w = g.tensor(TensorAttrs::new("W", [32, 16, 3, 3]));
    let v1 = g.mul(x, s);
    let v2 = g.add(v1, b);
    let v3 = g.relu(v2);
    let y = g.conv_fprop(v3, w, ConvAttrs::default().padding(1));
    g.set_output(y, None).unwrap();
    let (sum, sq) = g.genstats(y);
    g.set_output(sum, None).unwrap();
    g.set_output(sq, None).unwrap();
    g.validate().unwrap();
    assert_eq!(g.get(v3).unwrap().dims, vec![4, 16, 8, 8]);
    assert_eq!(g.get(sum).unwrap().dims, vec![1, 32, 1, 1]);
}

type Mutator = fn() -> Graph;

/// Each entry: (what is wrong, a graph with that fault, a check on the error).
#[allow(clippy::type_complexity)]
fn bad_graphs() -> Vec<(&'static str, Mutator, fn(&GraphError) -> bool)> {
    vec![
        (
            "empty graph",
            || Graph::new("empty"),
            |e| matches!(e, GraphError::EmptyGraph { graph } if graph == "empty"),
        ),
        (
            "zero batch",
            || conv_genstats(0, 8, 8, 8, 3, 1, 1).0,
            |e| matches!(e, GraphError::NonPositiveDim { tensor, index: 0, value: 0 } if tensor == "X"),
        ),
        (
            "negative channels in filter",
            || {
                let (mut g, _) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
                g.get_mut(TensorId(1)).unwrap().dims[0] = -4;
                g
            },
            |e| matches!(e, GraphError::NonPositiveDim { tensor, .. } if tensor == "W"),
        ),
        (
            "x rank 3",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 8]));
                let w = g.tensor(TensorAttrs::new("W", [8, 8, 3, 3]));
                let y = g.conv_fprop(x, w, ConvAttrs::default());
                g.set_output(y, None).unwrap();
                g
            },
            |e| {
                matches!(e, GraphError::MissingDims { tensor } if tensor.contains("conv_fprop"))
                    || matches!(e, GraphError::Rank { tensor, expected: 4, got: 3, .. } if tensor == "X")
            },
        ),
        (
            "filter channels differ from input",
            || conv_genstats_wc(8, 4),
            |e| matches!(e, GraphError::ChannelMismatch { tensor, expected: 8, got: 4, .. } if tensor == "W"),
        ),
        (
            "stride 0",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
                let w = g.tensor(TensorAttrs::new("W", [8, 8, 3, 3]));
                let y = g.conv_fprop(x, w, ConvAttrs::default().stride(0));
                g.get_mut(y).unwrap().dims = vec![2, 8, 8, 8];
                g.set_output(y, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::ConvAttr { reason, node } if reason.contains("stride") && node == "conv_fprop#0"),
        ),
        (
            "negative padding",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
                let w = g.tensor(TensorAttrs::new("W", [8, 8, 3, 3]));
                let y = g.conv_fprop(x, w, ConvAttrs::default().padding(-1));
                g.get_mut(y).unwrap().dims = vec![2, 8, 8, 8];
                g.set_output(y, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::ConvAttr { reason, .. } if reason.contains("padding")),
        ),
        (
            "filter larger than input",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 2, 2]));
                let w = g.tensor(TensorAttrs::new("W", [8, 8, 5, 5]));
                let y = g.conv_fprop(x, w, ConvAttrs::default());
                g.get_mut(y).unwrap().dims = vec![2, 8, 1, 1];
                g.set_output(y, None).unwrap();
                g
            },
            |e| {
                matches!(
                    e,
                    GraphError::ConvOutputEmpty {
                        dim: "height",
                        input: 2,
                        filter: 5,
                        ..
                    }
                )
            },
        ),
        (
            "NCHW input to a conv",
            || {
                let (mut g, _) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
                let x = g.get_mut(TensorId(0)).unwrap();
                *x = x.clone().nchw();
                g
            },
            |e| matches!(e, GraphError::NotNhwc { tensor, .. } if tensor == "X"),
        ),
        (
            "strides of the wrong rank",
            || {
                let (mut g, _) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
                g.get_mut(TensorId(0)).unwrap().strides = vec![1, 2, 3];
                g
            },
            |e| matches!(e, GraphError::StridesRank { tensor, dims: 4, strides: 3 } if tensor == "X"),
        ),
        (
            "zero stride",
            || {
                let (mut g, _) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
                g.get_mut(TensorId(0)).unwrap().strides = vec![512, 0, 64, 8];
                g
            },
            |e| matches!(e, GraphError::NonPositiveStride { tensor, index: 1, value: 0 } if tensor == "X"),
        ),
        (
            "size overflows i64",
            || conv_genstats(1 << 40, 1 << 12, 1 << 6, 8, 1, 0, 1).0,
            |e| matches!(e, GraphError::SizeOverflow { tensor } if tensor == "X"),
        ),
        (
            "duplicate uid",
            || {
                let (mut g, _) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
                g.get_mut(TensorId(0)).unwrap().uid = Some(7);
                g.get_mut(TensorId(1)).unwrap().uid = Some(7);
                g
            },
            |e| matches!(e, GraphError::DuplicateUid { uid: 7, first, second } if first == "X" && second == "W"),
        ),
        (
            "dangling tensor",
            || {
                let (mut g, _) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
                g.tensor(TensorAttrs::new("orphan", [1, 8, 1, 1]));
                g
            },
            |e| matches!(e, GraphError::DanglingTensor { tensor } if tensor == "orphan"),
        ),
        (
            "unused virtual output",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let a = g.relu(x);
                g.set_output(a, None).unwrap();
                let _lost = g.relu(x);
                g
            },
            |e| matches!(e, GraphError::UnusedVirtual { node, .. } if node == "pointwise#1"),
        ),
        (
            "virtual input with no producer",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]).virtual_());
                let a = g.relu(x);
                g.set_output(a, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::VirtualInput { tensor, .. } if tensor == "X"),
        ),
        (
            "nothing stored",
            || {
                let mut g = Graph::new("nothing");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let a = g.relu(x);
                let b = g.relu(a);
                let w = g.tensor(TensorAttrs::new("W", [8, 8, 1, 1]));
                let _ = (b, w);
                g
            },
            |e| {
                matches!(
                    e,
                    GraphError::UnusedVirtual { .. }
                        | GraphError::DanglingTensor { .. }
                        | GraphError::NoOutputs { .. }
                )
            },
        ),
        (
            "no real output at all",
            || {
                let mut g = Graph::new("novirt");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let a = g.relu(x);
                let s = g.tensor(TensorAttrs::vector("S", 8));
                let b = g.mul(a, s);
                let _ = g.relu(b);
                let last = g.nodes().len() - 1;
                let y = g.nodes()[last].outputs()[0];
                let n = Node::GenStats {
                    x: y,
                    sum: TensorId(0),
                    sq_sum: TensorId(0),
                };
                let _ = n;
                g
            },
            |e| matches!(e, GraphError::UnusedVirtual { .. }),
        ),
        (
            "wrong pointwise arity",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let y = g.pointwise(&[x], PointwiseAttrs::new(PointwiseMode::Add));
                g.set_output(y, None).unwrap();
                g
            },
            |e| {
                matches!(
                    e,
                    GraphError::Arity {
                        mode: "add",
                        expected: 2,
                        got: 1,
                        ..
                    }
                )
            },
        ),
        (
            "vector that does not broadcast",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let s = g.tensor(TensorAttrs::vector("S", 6));
                let y = g.mul(x, s);
                g.get_mut(y).unwrap().dims = vec![2, 8, 4, 4];
                g.set_output(y, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::NotBroadcastable { tensor, .. } if tensor == "S"),
        ),
        (
            "pointwise rank mismatch",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let s = g.tensor(TensorAttrs::new("S", [8]));
                let y = g.mul(x, s);
                g.get_mut(y).unwrap().dims = vec![2, 8, 4, 4];
                g.set_output(y, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::Rank { tensor, expected: 4, got: 1, .. } if tensor == "S"),
        ),
        (
            "alpha on mul",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let s = g.tensor(TensorAttrs::vector("S", 8));
                let y = g.pointwise(
                    &[x, s],
                    PointwiseAttrs::new(PointwiseMode::Mul).alphas(1.0, -1.0),
                );
                g.set_output(y, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::AlphaUnsupported { mode: "mul", .. }),
        ),
        (
            "select with a non-boolean mask",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let b = g.tensor(TensorAttrs::new("B", [2, 8, 4, 4]));
                let m = g.tensor(TensorAttrs::new("M", [2, 8, 4, 4]));
                let y = g.select(x, b, m);
                g.set_output(y, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::WrongDtype { tensor, expected, .. } if tensor == "M" && expected == "bool"),
        ),
        (
            "genstats into FP16 sums",
            || {
                let (mut g, _) = conv_genstats(2, 8, 8, 8, 3, 1, 1);
                let sum = g.nodes()[1].outputs()[0];
                g.get_mut(sum).unwrap().dtype = Some(DataType::Half);
                g
            },
            |e| matches!(e, GraphError::WrongDtype { node, expected, got, .. } if node == "genstats#1" && expected == "f32" && got == "f16"),
        ),
        (
            "finalize count as INT32",
            || {
                let mut g = finalize(8);
                let count = g.nodes()[0].inputs()[8];
                g.get_mut(count).unwrap().dtype = Some(DataType::Int32);
                g
            },
            |e| matches!(e, GraphError::WrongDtype { tensor, expected, .. } if tensor == "count" && expected == "i64"),
        ),
        (
            "finalize epsilon not by value",
            || {
                let mut g = finalize(8);
                let eps = g.nodes()[0].inputs()[6];
                g.get_mut(eps).unwrap().by_value = false;
                g
            },
            |e| matches!(e, GraphError::ScalarRequired { tensor, .. } if tensor == "eps"),
        ),
        (
            "finalize vector with the wrong channel count",
            || {
                let mut g = finalize(8);
                let gamma = g.nodes()[0].inputs()[2];
                g.get_mut(gamma).unwrap().dims = vec![1, 4, 1, 1];
                g
            },
            |e| matches!(e, GraphError::NotPerChannel { tensor, channels: 8, .. } if tensor == "gamma"),
        ),
        (
            "by-value scalar that is not one element",
            || {
                let mut g = finalize(8);
                let eps = g.nodes()[0].inputs()[6];
                g.get_mut(eps).unwrap().dims = vec![1, 2, 1, 1];
                g.get_mut(eps).unwrap().strides = vec![2, 1, 1, 1];
                g
            },
            |e| matches!(e, GraphError::ByValueShape { tensor, .. } if tensor == "eps"),
        ),
        (
            "virtual by-value scalar",
            || {
                let mut g = finalize(8);
                let eps = g.nodes()[0].inputs()[6];
                g.get_mut(eps).unwrap().is_virtual = true;
                g
            },
            |e| matches!(e, GraphError::VirtualByValue { tensor } if tensor == "eps"),
        ),
        (
            "by-value tensor as an output",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let y = g.relu(x);
                let a = g.get_mut(y).unwrap();
                a.by_value = true;
                a.dims = vec![1, 1, 1, 1];
                a.strides = vec![1, 1, 1, 1];
                g.set_output(y, None).unwrap();
                let mut g2 = Graph::new("g2");
                let x2 = g2.tensor(TensorAttrs::new("X", [1, 1, 1, 1]));
                let y2 = g2.relu(x2);
                g2.get_mut(y2).unwrap().by_value = true;
                g2.set_output(y2, None).unwrap();
                g2
            },
            |e| matches!(e, GraphError::ByValueOutput { node, .. } if node == "pointwise#0"),
        ),
        (
            "foreign tensor id",
            || {
                let mut g = Graph::new("g");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let y = g.relu(x);
                g.set_output(y, None).unwrap();
                let _ = g.relu(TensorId(99));
                g
            },
            |e| matches!(e, GraphError::UnknownTensor { id: 99, .. }),
        ),
        (
            "running mean without variance",
            || {
                let mut g = Graph::new("bn");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let v = |g: &mut Graph, n: &str| {
                    g.tensor(TensorAttrs::vector(n, 8).dtype(DataType::Float))
                };
                let inputs = BatchNormInputs {
                    x,
                    scale: v(&mut g, "gamma"),
                    bias: v(&mut g, "beta"),
                    epsilon: g.tensor(TensorAttrs::scalar("eps", DataType::Float)),
                    momentum: g.tensor(TensorAttrs::scalar("m", DataType::Float)),
                    prev_running_mean: Some(v(&mut g, "rm")),
                    prev_running_var: None,
                };
                let o = g.batchnorm(inputs);
                for t in [
                    Some(o.y),
                    Some(o.mean),
                    Some(o.inv_variance),
                    o.next_running_mean,
                    o.next_running_var,
                ]
                .into_iter()
                .flatten()
                {
                    g.set_output(t, None).unwrap();
                }
                g
            },
            |e| matches!(e, GraphError::RunningStatsPair { node } if node == "batchnorm#0"),
        ),
        (
            "dgrad with a dy of the wrong size",
            || {
                let mut g = Graph::new("dgrad");
                let dy = g.tensor(TensorAttrs::new("dY", [2, 8, 7, 7]));
                let w = g.tensor(TensorAttrs::new("W", [8, 4, 3, 3]));
                let dx = g.conv_dgrad(dy, w, ConvAttrs::default().padding(1), [2, 4, 8, 8]);
                g.set_output(dx, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::ShapeMismatch { tensor, expected, .. } if tensor == "dY" && expected == &vec![2, 8, 8, 8]),
        ),
        (
            "wgrad whose dy channels differ from K",
            || {
                let mut g = Graph::new("wgrad");
                let x = g.tensor(TensorAttrs::new("X", [2, 4, 8, 8]));
                let dy = g.tensor(TensorAttrs::new("dY", [2, 6, 8, 8]));
                let dw = g.conv_wgrad(x, dy, ConvAttrs::default().padding(1), [8, 4, 3, 3]);
                g.set_output(dw, None).unwrap();
                g
            },
            |e| matches!(e, GraphError::ChannelMismatch { tensor, expected: 8, got: 6, .. } if tensor == "dY"),
        ),
        (
            "dbn weight with a dy of another shape",
            || {
                let mut g = Graph::new("dbn");
                let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
                let dy = g.tensor(TensorAttrs::new("dY", [2, 8, 4, 5]));
                let v = |g: &mut Graph, n: &str| {
                    g.tensor(TensorAttrs::vector(n, 8).dtype(DataType::Float))
                };
                let inputs = DbnWeightInputs {
                    x,
                    dy,
                    mean: v(&mut g, "mean"),
                    inv_std: v(&mut g, "inv_std"),
                    scale: v(&mut g, "gamma"),
                };
                let o = g.dbn_weight(inputs);
                for t in [o.dscale, o.dbias, o.eq_dy_scale, o.eq_x_scale, o.eq_bias] {
                    g.set_output(t, None).unwrap();
                }
                g
            },
            |e| matches!(e, GraphError::ShapeMismatch { tensor, .. } if tensor == "dY"),
        ),
        (
            "reduction to a dim that is neither kept nor 1",
            || {
                let mut g = Graph::new("reduce");
                let x = g.tensor(TensorAttrs::new("dZ", [2, 8, 4, 4]));
                let y = g.reduce(x, ReductionAttrs::new(ReductionMode::Add, [1, 4, 1, 1]));
                g.set_output(y, None).unwrap();
                g
            },
            |e| {
                matches!(e, GraphError::ReductionDims { node, tensor, input, output }
                    if node == "reduction#0" && tensor == "reduction#0.y"
                        && input == &vec![2, 8, 4, 4] && output == &vec![1, 4, 1, 1])
            },
        ),
        (
            "reduction to another rank",
            || {
                let mut g = Graph::new("reduce");
                let x = g.tensor(TensorAttrs::new("dZ", [2, 8, 4, 4]));
                let y = g.reduce(x, ReductionAttrs::new(ReductionMode::Add, [1, 8]));
                g.set_output(y, None).unwrap();
                g
            },
            |e| {
                matches!(e, GraphError::Rank { node, tensor, expected: 4, got: 2 }
                    if node == "reduction#0" && tensor == "reduction#0.y")
            },
        ),
        (
            "reduction output edited to other dims",
            || {
                let mut g = Graph::new("reduce");
                let x = g.tensor(TensorAttrs::new("dZ", [2, 8, 4, 4]));
                let y = g.reduce_sum_per_channel(x, 8);
                g.set_output(y, None).unwrap();
                g.get_mut(y).unwrap().dims = vec![1, 8, 4, 1];
                g
            },
            |e| {
                matches!(e, GraphError::ShapeMismatch { node, tensor, expected, .. }
                    if node == "reduction#0" && tensor == "reduction#0.y" && expected == &vec![1, 8, 1, 1])
            },
        ),
        (
            "reduction of a boolean mask",
            || {
                let mut g = Graph::new("reduce");
                let x = g.tensor(TensorAttrs::new("mask", [2, 8, 4, 4]).dtype(DataType::Boolean));
                let y = g.reduce_sum_per_channel(x, 8);
                g.set_output(y, None).unwrap();
                g
            },
            |e| {
                matches!(e, GraphError::WrongDtype { node, tensor, got, .. }
                    if node == "reduction#0" && tensor == "mask" && got == "bool")
            },
        ),
    ]
}

fn conv_genstats_wc(c: i64, wc: i64) -> Graph {
    let mut g = Graph::new("g");
    let x = g.tensor(TensorAttrs::new("X", [2, c, 8, 8]));
    let w = g.tensor(TensorAttrs::new("W", [8, wc, 3, 3]));
    let y = g.conv_fprop(x, w, ConvAttrs::default().padding(1));
    g.get_mut(y).unwrap().dims = vec![2, 8, 8, 8];
    g.set_output(y, None).unwrap();
    g
}

#[test]
fn every_bad_graph_gets_its_own_error() {
    let table = bad_graphs();
    assert!(table.len() >= 25, "only {} bad graphs", table.len());
    for (what, make, check) in table {
        let g = make();
        let err = g.validate().expect_err(what);
        assert!(check(&err), "{what}: unexpected error {err:?}");
        // Messages are for people: they must not be empty.
        assert!(!err.to_string().is_empty());
    }
}

/// The generic route's BN-backward reduction: x̂ = (y − mean)·inv_std; Σ dz·x̂ and Σ dz.
#[test]
fn a_pointwise_chain_into_per_channel_reductions_validates() {
    let mut g = Graph::new("dbn_reduce");
    let y = g.tensor(TensorAttrs::new("Y", [4, 6, 5, 5]));
    let dz = g.tensor(TensorAttrs::new("dZ", [4, 6, 5, 5]));
    let mean = g.tensor(TensorAttrs::vector("mean", 6).dtype(DataType::Float));
    let inv_std = g.tensor(TensorAttrs::vector("inv_std", 6).dtype(DataType::Float));
    let centered = g.sub(y, mean);
    let x_hat = g.mul(centered, inv_std);
    let prod = g.mul(dz, x_hat);
    let dgamma = g.reduce_sum_per_channel(prod, 6);
    let dbeta = g.reduce(dz, ReductionAttrs::new(ReductionMode::Max, [1, 6, 1, 1]));
    g.set_output(dgamma, None).unwrap();
    g.set_output(dbeta, None).unwrap();
    g.validate().unwrap();
    assert_eq!(g.get(dgamma).unwrap().dims, vec![1, 6, 1, 1]);
    assert_eq!(
        g.dtype(dgamma),
        Some(DataType::Float),
        "stored sums are FP32"
    );
    assert_eq!(g.dtype(prod), Some(DataType::Float));
    // Reducing every dim, or none, is a valid shape too.
    let mut g = Graph::new("total");
    let x = g.tensor(TensorAttrs::new("X", [2, 3, 4, 5]));
    let t = g.reduce(x, ReductionAttrs::new(ReductionMode::Add, [1, 1, 1, 1]));
    g.set_output(t, None).unwrap();
    g.validate().unwrap();
    // The operator and the output dims enter the signature.
    let sig = |mode: ReductionMode, dims: [i64; 4]| {
        let mut g = Graph::new("r");
        let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
        let y = g.reduce(x, ReductionAttrs::new(mode, dims));
        g.set_output(y, None).unwrap();
        g.signature().unwrap()
    };
    let add = sig(ReductionMode::Add, [1, 8, 1, 1]);
    assert_eq!(add, sig(ReductionMode::Add, [1, 8, 1, 1]));
    assert_ne!(add, sig(ReductionMode::Max, [1, 8, 1, 1]));
    assert_ne!(add, sig(ReductionMode::Add, [2, 8, 1, 1]));
    assert!(add.text().contains("reduction[add]"), "{}", add.text());
}

#[test]
fn signatures_are_stable_and_sensitive() {
    let (a, _) = conv_genstats(32, 64, 56, 64, 3, 1, 1);
    let (b, _) = conv_genstats(32, 64, 56, 64, 3, 1, 1);
    let sa = a.signature().unwrap();
    assert_eq!(sa, b.signature().unwrap(), "same graph twice → same key");
    // Names and uids do not matter.
    let (mut c, _) = conv_genstats(32, 64, 56, 64, 3, 1, 1);
    c.get_mut(TensorId(0)).unwrap().name = "input".into();
    c.get_mut(TensorId(0)).unwrap().uid = Some(1234);
    assert_eq!(sa, c.signature().unwrap());
    // Every attribute change gives another key.
    let variants: Vec<(&str, Graph)> = vec![
        ("batch", conv_genstats(16, 64, 56, 64, 3, 1, 1).0),
        ("channels", conv_genstats(32, 32, 56, 64, 3, 1, 1).0),
        ("spatial", conv_genstats(32, 64, 28, 64, 3, 1, 1).0),
        ("filters", conv_genstats(32, 64, 56, 128, 3, 1, 1).0),
        ("kernel", conv_genstats(32, 64, 56, 64, 1, 1, 1).0),
        ("padding", conv_genstats(32, 64, 56, 64, 3, 0, 1).0),
        ("stride", conv_genstats(32, 64, 56, 64, 3, 1, 2).0),
        ("dtype", {
            let (mut g, y) = conv_genstats(32, 64, 56, 64, 3, 1, 1);
            g.get_mut(y).unwrap().dtype = Some(DataType::Float);
            g
        }),
        (
            "precision",
            conv_genstats(32, 64, 56, 64, 3, 1, 1)
                .0
                .with_precision(PrecisionContext {
                    compute: DataType::Half,
                    ..PrecisionContext::default()
                }),
        ),
        ("strides", {
            let (mut g, _) = conv_genstats(32, 64, 56, 64, 3, 1, 1);
            // A padded row pitch: same dims, other strides.
            g.get_mut(TensorId(0)).unwrap().strides = vec![64 * 56 * 64, 1, 64 * 64, 64];
            g
        }),
    ];
    let mut seen = vec![sa.clone()];
    for (what, g) in variants {
        let s = g.signature().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(!seen.contains(&s), "{what}: key did not change");
        seen.push(s);
    }
    // Pointwise attributes count too.
    let pw = |alpha2: f32| {
        let mut g = Graph::new("pw");
        let x = g.tensor(TensorAttrs::new("X", [2, 8, 4, 4]));
        let b = g.tensor(TensorAttrs::vector("B", 8));
        let y = g.pointwise(
            &[x, b],
            PointwiseAttrs::new(PointwiseMode::Add).alphas(1.0, alpha2),
        );
        g.set_output(y, None).unwrap();
        g.signature().unwrap()
    };
    assert_eq!(pw(1.0), pw(1.0));
    assert_ne!(pw(1.0), pw(-1.0));
}
