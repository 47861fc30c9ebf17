//! Bad inputs: graph builder.

use super::*;

pub(super) fn conv_graph(x: [i64; 4], w: [i64; 4], attrs: ConvAttrs) -> Graph {
    let mut g = Graph::new("g");
    let x = g.tensor(TensorAttrs::new("X", x));
    let w = g.tensor(TensorAttrs::new("W", w));
    let y = g.conv_fprop(x, w, attrs);
    g.set_output(y, None).unwrap();
    g
}

pub(super) fn graph_err(g: Graph) -> GraphError {
    g.validate().expect_err("the graph must be rejected")
}

pub(super) fn graph_rows() -> Vec<Row> {
    vec![
        ("graph", "empty graph", || {
            let e = graph_err(Graph::new("g"));
            assert!(matches!(e, GraphError::EmptyGraph { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "zero batch", || {
            let e = graph_err(conv_graph([0, 8, 8, 8], [8, 8, 3, 3], ConvAttrs::default()));
            assert!(
                matches!(e, GraphError::NonPositiveDim { value: 0, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "negative filter dim", || {
            let e = graph_err(conv_graph(
                [2, 8, 8, 8],
                [-8, 8, 3, 3],
                ConvAttrs::default(),
            ));
            assert!(
                matches!(e, GraphError::NonPositiveDim { value: -8, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "conv input of rank 3", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8]));
            let w = g.tensor(TensorAttrs::new("W", [8, 8, 3, 3]));
            let y = g.conv_fprop(x, w, ConvAttrs::default());
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::Rank { got: 3, .. }), "{e:?}");
            typed(e)
        }),
        (
            "graph",
            "filter channels differ from the input's (the cause, not 'no dims')",
            || {
                let e = graph_err(conv_graph([2, 8, 8, 8], [8, 4, 3, 3], ConvAttrs::default()));
                assert!(
                    matches!(
                        e,
                        GraphError::ChannelMismatch {
                            expected: 8,
                            got: 4,
                            ..
                        }
                    ),
                    "{e:?}"
                );
                typed(e)
            },
        ),
        ("graph", "stride 0 (the cause, not 'no dims')", || {
            let a = ConvAttrs {
                stride: [0, 1],
                ..ConvAttrs::default()
            };
            let e = graph_err(conv_graph([2, 8, 8, 8], [8, 8, 3, 3], a));
            assert!(matches!(&e, GraphError::ConvAttr { .. }), "{e:?}");
            assert!(e.to_string().contains("stride"), "{e}");
            typed(e)
        }),
        (
            "graph",
            "kernel larger than its input (the cause, not 'no dims')",
            || {
                let e = graph_err(conv_graph([2, 8, 4, 4], [8, 8, 7, 7], ConvAttrs::default()));
                assert!(matches!(e, GraphError::ConvOutputEmpty { .. }), "{e:?}");
                typed(e)
            },
        ),
        ("graph", "negative padding", || {
            let e = graph_err(conv_graph(
                [2, 8, 8, 8],
                [8, 8, 3, 3],
                ConvAttrs::default().padding(-1),
            ));
            assert!(matches!(e, GraphError::ConvAttr { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "strides of the wrong rank", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]).strides([1, 2]));
            let y = g.relu(x);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::StridesRank { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a negative stride", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]).strides([512, 1, -64, 8]));
            let y = g.relu(x);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(
                matches!(e, GraphError::NonPositiveStride { value: -64, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "a tensor of 2^62 elements", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [1 << 40, 1 << 22, 1, 1]));
            let y = g.relu(x);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::SizeOverflow { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "two tensors with one uid", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]).uid(5));
            let b = g.tensor(TensorAttrs::vector("B", 8).uid(5));
            let y = g.add(x, b);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(
                matches!(e, GraphError::DuplicateUid { uid: 5, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "a by-value tensor that is not a scalar", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let mut s = TensorAttrs::vector("S", 8);
            s.by_value = true;
            let s = g.tensor(s);
            let y = g.mul(x, s);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::ByValueShape { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a tensor id from another graph", || {
            let mut other = Graph::new("other");
            let mut t = other.tensor(TensorAttrs::new("O", [1, 1, 1, 1]));
            for _ in 0..5 {
                t = other.relu(t);
            }
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let y = g.add(x, t);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::UnknownTensor { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "set_output on a foreign id", || {
            let mut g = Graph::new("g");
            let mut other = Graph::new("other");
            let mut t = other.tensor(TensorAttrs::new("O", [1, 1, 1, 1]));
            for _ in 0..3 {
                t = other.relu(t);
            }
            let e = g.set_output(t, None).unwrap_err();
            assert!(matches!(e, GraphError::UnknownTensor { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "operands that do not broadcast", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let b = g.tensor(TensorAttrs::vector("B", 5));
            let y = g.add(x, b);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::NotBroadcastable { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a reduction to dims the input cannot give", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let y = g.reduce(x, ReductionAttrs::new(ReductionMode::Add, [1, 3, 1, 1]));
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::ReductionDims { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a select with too few inputs", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let y = g.pointwise(&[x], PointwiseAttrs::new(PointwiseMode::BinarySelect));
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(e.to_string().contains("input"), "{e}");
            typed(e)
        }),
    ]
}
