//! Shape inference: the dims each node's outputs get from its inputs.

use super::{ConvAttrs, Graph, GraphError, Node, ReductionAttrs, TensorId};

type Shapes = Vec<(TensorId, Vec<i64>)>;

/// A node's display name: `kind#index` (index in insertion order).
pub(crate) fn node_name(graph: &Graph, node: &Node) -> String {
    let idx = graph
        .nodes()
        .iter()
        .position(|n| std::ptr::eq(n, node))
        .unwrap_or(graph.nodes().len());
    format!("{}#{idx}", node.kind())
}

fn dims<'g>(graph: &'g Graph, node: &str, t: TensorId) -> Result<&'g [i64], GraphError> {
    graph
        .get(t)
        .map(|a| a.dims.as_slice())
        .ok_or(GraphError::UnknownTensor {
            node: node.to_string(),
            id: t.0,
        })
}

fn rank4(graph: &Graph, node: &str, t: TensorId) -> Result<[i64; 4], GraphError> {
    let d = dims(graph, node, t)?;
    <[i64; 4]>::try_from(d).map_err(|_| GraphError::Rank {
        node: node.to_string(),
        tensor: graph.tname(t),
        expected: 4,
        got: d.len(),
    })
}

/// Checks padding/stride/dilation values.
pub(crate) fn check_conv_attrs(node: &str, attrs: &ConvAttrs) -> Result<(), GraphError> {
    let bad = |reason: String| GraphError::ConvAttr {
        node: node.to_string(),
        reason,
    };
    if attrs.stride.iter().any(|&s| s <= 0) {
        return Err(bad(format!("stride {:?} must be positive", attrs.stride)));
    }
    if attrs.dilation.iter().any(|&d| d <= 0) {
        return Err(bad(format!(
            "dilation {:?} must be positive",
            attrs.dilation
        )));
    }
    if attrs
        .pre_padding
        .iter()
        .chain(&attrs.post_padding)
        .any(|&p| p < 0)
    {
        return Err(bad(format!(
            "padding {:?}/{:?} must not be negative",
            attrs.pre_padding, attrs.post_padding
        )));
    }
    Ok(())
}

/// The conv output `[N, K, P, Q]` for input `x` and filter `w`.
pub(crate) fn conv_output(
    graph: &Graph,
    node: &str,
    x: TensorId,
    w: TensorId,
    attrs: &ConvAttrs,
) -> Result<[i64; 4], GraphError> {
    let [n, c, h, wd] = rank4(graph, node, x)?;
    let [k, wc, r, s] = rank4(graph, node, w)?;
    check_conv_attrs(node, attrs)?;
    if wc != c {
        return Err(GraphError::ChannelMismatch {
            node: node.to_string(),
            tensor: graph.tname(w),
            expected: c,
            got: wc,
        });
    }
    let p = attrs
        .out_extent(0, h, r)
        .ok_or(GraphError::ConvOutputEmpty {
            node: node.to_string(),
            dim: "height",
            input: h,
            filter: r,
        })?;
    let q = attrs
        .out_extent(1, wd, s)
        .ok_or(GraphError::ConvOutputEmpty {
            node: node.to_string(),
            dim: "width",
            input: wd,
            filter: s,
        })?;
    Ok([n, k, p, q])
}

/// Broadcast shape of pointwise inputs: each dim equal to the widest or 1.
pub(crate) fn broadcast(
    graph: &Graph,
    node: &str,
    inputs: &[TensorId],
) -> Result<Vec<i64>, GraphError> {
    let mut out: Vec<i64> = Vec::new();
    for &t in inputs {
        let d = dims(graph, node, t)?;
        if out.is_empty() {
            out = d.to_vec();
            continue;
        }
        if d.len() != out.len() {
            return Err(GraphError::Rank {
                node: node.to_string(),
                tensor: graph.tname(t),
                expected: out.len(),
                got: d.len(),
            });
        }
        for (o, &v) in out.iter_mut().zip(d) {
            if *o == 1 {
                *o = v;
            } else if v != 1 && v != *o {
                return Err(GraphError::NotBroadcastable {
                    node: node.to_string(),
                    tensor: graph.tname(t),
                    dims: d.to_vec(),
                    to: out.clone(),
                });
            }
        }
    }
    Ok(out)
}

/// The output dims of a reduction of `x` into `y`: `attrs.output_dims`, which must have the
/// input's rank and each dim equal to the input's (kept) or 1 (reduced).
pub(crate) fn reduction_output(
    graph: &Graph,
    node: &str,
    x: TensorId,
    y: TensorId,
    attrs: &ReductionAttrs,
) -> Result<Vec<i64>, GraphError> {
    let input = dims(graph, node, x)?;
    let out = &attrs.output_dims;
    if out.len() != input.len() {
        return Err(GraphError::Rank {
            node: node.to_string(),
            tensor: graph.tname(y),
            expected: input.len(),
            got: out.len(),
        });
    }
    if out.iter().zip(input).any(|(&o, &i)| o != i && o != 1) {
        return Err(GraphError::ReductionDims {
            node: node.to_string(),
            tensor: graph.tname(y),
            input: input.to_vec(),
            output: out.clone(),
        });
    }
    Ok(out.clone())
}

fn channels(graph: &Graph, node: &str, t: TensorId) -> Result<i64, GraphError> {
    Ok(rank4(graph, node, t)?[1])
}

/// The dims of every output of `node` that can be derived from its inputs.
pub(crate) fn output_dims(graph: &Graph, node: &Node) -> Result<Shapes, GraphError> {
    let name = node_name(graph, node);
    let name = name.as_str();
    let vec_of = |c: i64, ts: &[TensorId]| ts.iter().map(|&t| (t, vec![1, c, 1, 1])).collect();
    Ok(match node {
        Node::ConvFprop { x, w, y, attrs } => {
            vec![(*y, conv_output(graph, name, *x, *w, attrs)?.to_vec())]
        }
        // dgrad/wgrad outputs are given by the caller (see Graph::conv_dgrad / conv_wgrad).
        Node::ConvDgrad { .. } | Node::ConvWgrad { .. } => Vec::new(),
        Node::Pointwise { inputs, y, .. } => vec![(*y, broadcast(graph, name, inputs)?)],
        Node::Reduction { x, y, attrs } => {
            vec![(*y, reduction_output(graph, name, *x, *y, attrs)?)]
        }
        // Every output of these three is per channel: `Node::outputs` lists them.
        Node::GenStats { x, .. } => vec_of(channels(graph, name, *x)?, &node.outputs()),
        Node::BnFinalize { inputs, .. } => {
            vec_of(channels(graph, name, inputs.sum)?, &node.outputs())
        }
        Node::DbnWeight { inputs, .. } => vec_of(channels(graph, name, inputs.x)?, &node.outputs()),
        Node::BatchNorm { inputs, outputs } => {
            let x = rank4(graph, name, inputs.x)?;
            let mut v: Shapes = vec_of(x[1], &[outputs.mean, outputs.inv_variance]);
            v.extend(
                outputs
                    .next_running_mean
                    .iter()
                    .chain(&outputs.next_running_var)
                    .map(|&t| (t, vec![1, x[1], 1, 1])),
            );
            v.push((outputs.y, x.to_vec()));
            v
        }
        Node::BatchNormBackward { inputs, outputs } => {
            let x = rank4(graph, name, inputs.x)?;
            let mut v: Shapes = vec_of(x[1], &[outputs.dscale, outputs.dbias]);
            v.push((outputs.dx, x.to_vec()));
            v
        }
    })
}
