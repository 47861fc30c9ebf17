//! Graph validation: every check that can be made before cuDNN sees the graph.

use super::infer::{broadcast, conv_output, node_name, output_dims};
use super::tensor::is_nhwc;
use super::{DataType, Graph, GraphError, Node, PointwiseMode, TensorId};
use std::collections::HashMap;

pub(crate) fn validate(g: &Graph) -> Result<(), GraphError> {
    if g.nodes().is_empty() {
        return Err(GraphError::EmptyGraph {
            graph: g.name().to_string(),
        });
    }
    for node in g.nodes() {
        let name = node_name(g, node);
        for t in node.inputs().into_iter().chain(node.outputs()) {
            if g.get(t).is_none() {
                return Err(GraphError::UnknownTensor {
                    node: name,
                    id: t.0,
                });
            }
        }
    }
    check_tensors(g)?;
    check_wiring(g)?;
    for node in g.nodes() {
        check_node(g, node)?;
    }
    Ok(())
}

fn check_tensors(g: &Graph) -> Result<(), GraphError> {
    let mut uids: HashMap<i64, &str> = HashMap::new();
    for (i, a) in g.tensors().iter().enumerate() {
        let t = TensorId(i as u32);
        if a.dims.is_empty() {
            // An output left without dims: report why inference could not give them.
            if let Some(cause) = g.infer_error() {
                return Err(cause.clone());
            }
            return Err(GraphError::MissingDims {
                tensor: a.name.clone(),
            });
        }
        if let Some((index, &value)) = a.dims.iter().enumerate().find(|(_, &d)| d <= 0) {
            return Err(GraphError::NonPositiveDim {
                tensor: a.name.clone(),
                index,
                value,
            });
        }
        let strides = g.strides(t).unwrap_or_default();
        if strides.len() != a.dims.len() {
            return Err(GraphError::StridesRank {
                tensor: a.name.clone(),
                dims: a.dims.len(),
                strides: strides.len(),
            });
        }
        if let Some((index, &value)) = strides.iter().enumerate().find(|(_, &s)| s <= 0) {
            return Err(GraphError::NonPositiveStride {
                tensor: a.name.clone(),
                index,
                value,
            });
        }
        // The furthest element's byte offset must fit in i64 (cuDNN's size type).
        let elem = g.dtype(t).map(DataType::size).unwrap_or(1) as i64;
        let span = a
            .dims
            .iter()
            .zip(&strides)
            .try_fold(1i64, |acc, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
            })
            .and_then(|n| n.checked_mul(elem));
        let count = a.dims.iter().try_fold(1i64, |acc, &d| acc.checked_mul(d));
        if span.is_none() || count.and_then(|c| c.checked_mul(elem)).is_none() {
            return Err(GraphError::SizeOverflow {
                tensor: a.name.clone(),
            });
        }
        if a.by_value {
            if a.dims.iter().any(|&d| d != 1) {
                return Err(GraphError::ByValueShape {
                    tensor: a.name.clone(),
                    dims: a.dims.clone(),
                });
            }
            if a.is_virtual {
                return Err(GraphError::VirtualByValue {
                    tensor: a.name.clone(),
                });
            }
        }
        if let Some(uid) = a.uid {
            if let Some(first) = uids.insert(uid, &a.name) {
                return Err(GraphError::DuplicateUid {
                    uid,
                    first: first.to_string(),
                    second: a.name.clone(),
                });
            }
        }
    }
    Ok(())
}

fn check_wiring(g: &Graph) -> Result<(), GraphError> {
    let n = g.tensors().len();
    let mut producer: Vec<Option<String>> = vec![None; n];
    let mut consumer: Vec<Option<String>> = vec![None; n];
    for node in g.nodes() {
        let name = node_name(g, node);
        let inputs = node.inputs();
        for t in &inputs {
            consumer[t.index()].get_or_insert_with(|| name.clone());
        }
        for t in node.outputs() {
            if inputs.contains(&t) {
                return Err(GraphError::InPlace {
                    node: name,
                    tensor: g.tname(t),
                });
            }
            if g.tensors()[t.index()].by_value {
                return Err(GraphError::ByValueOutput {
                    tensor: g.tname(t),
                    node: name,
                });
            }
            if let Some(first) = &producer[t.index()] {
                return Err(GraphError::MultipleProducers {
                    tensor: g.tname(t),
                    first: first.clone(),
                    second: name,
                });
            }
            producer[t.index()] = Some(name.clone());
        }
    }
    let mut any_real_output = false;
    for (i, a) in g.tensors().iter().enumerate() {
        match (&producer[i], &consumer[i]) {
            (None, None) => {
                return Err(GraphError::DanglingTensor {
                    tensor: a.name.clone(),
                })
            }
            (Some(p), None) if a.is_virtual => {
                return Err(GraphError::UnusedVirtual {
                    tensor: a.name.clone(),
                    node: p.clone(),
                })
            }
            (None, Some(c)) if a.is_virtual => {
                return Err(GraphError::VirtualInput {
                    tensor: a.name.clone(),
                    node: c.clone(),
                })
            }
            (Some(_), _) if !a.is_virtual => any_real_output = true,
            _ => {}
        }
    }
    if !any_real_output {
        return Err(GraphError::NoOutputs {
            graph: g.name().to_string(),
        });
    }
    Ok(())
}

/// Per-node checks: ranks, channels, shapes, layouts and element types.
struct Check<'g> {
    g: &'g Graph,
    node: String,
}

impl Check<'_> {
    fn dims(&self, t: TensorId) -> Vec<i64> {
        self.g.get(t).map(|a| a.dims.clone()).unwrap_or_default()
    }

    fn rank4(&self, t: TensorId) -> Result<[i64; 4], GraphError> {
        let d = self.dims(t);
        <[i64; 4]>::try_from(d.as_slice()).map_err(|_| GraphError::Rank {
            node: self.node.clone(),
            tensor: self.g.tname(t),
            expected: 4,
            got: d.len(),
        })
    }

    fn nhwc(&self, t: TensorId) -> Result<(), GraphError> {
        let d = self.rank4(t)?;
        let s = self.g.strides(t).unwrap_or_default();
        if !is_nhwc(&d, &s) {
            return Err(GraphError::NotNhwc {
                node: self.node.clone(),
                tensor: self.g.tname(t),
                expected: super::nhwc_strides(d).to_vec(),
                got: s,
            });
        }
        Ok(())
    }

    fn shape(&self, t: TensorId, expected: &[i64]) -> Result<(), GraphError> {
        let got = self.dims(t);
        if got != expected {
            return Err(GraphError::ShapeMismatch {
                node: self.node.clone(),
                tensor: self.g.tname(t),
                expected: expected.to_vec(),
                got,
            });
        }
        Ok(())
    }

    fn per_channel(&self, t: TensorId, c: i64) -> Result<(), GraphError> {
        let dims = self.dims(t);
        if dims != [1, c, 1, 1] {
            return Err(GraphError::NotPerChannel {
                node: self.node.clone(),
                tensor: self.g.tname(t),
                channels: c,
                dims,
            });
        }
        Ok(())
    }

    fn dtype_in(&self, t: TensorId, allowed: &[DataType]) -> Result<(), GraphError> {
        let got = self.g.dtype(t).unwrap_or(DataType::Float);
        if !allowed.contains(&got) {
            return Err(GraphError::WrongDtype {
                node: self.node.clone(),
                tensor: self.g.tname(t),
                expected: allowed
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join(" or "),
                got: got.name().to_string(),
            });
        }
        Ok(())
    }

    fn scalar(&self, t: TensorId, allowed: &[DataType]) -> Result<(), GraphError> {
        if !self.g.get(t).is_some_and(|a| a.by_value) {
            return Err(GraphError::ScalarRequired {
                node: self.node.clone(),
                tensor: self.g.tname(t),
            });
        }
        self.dtype_in(t, allowed)
    }

    fn channels_equal(&self, t: TensorId, got: i64, expected: i64) -> Result<(), GraphError> {
        if got != expected {
            return Err(GraphError::ChannelMismatch {
                node: self.node.clone(),
                tensor: self.g.tname(t),
                expected,
                got,
            });
        }
        Ok(())
    }
}

const STATS: &[DataType] = &[DataType::Float];
const HOST_REAL: &[DataType] = &[DataType::Float, DataType::Double];
const REDUCIBLE: &[DataType] = &[DataType::Half, DataType::BFloat16, DataType::Float];

fn check_node(g: &Graph, node: &Node) -> Result<(), GraphError> {
    let c = Check {
        g,
        node: node_name(g, node),
    };
    // Outputs must have the dims their inputs imply.
    for (t, dims) in output_dims(g, node)? {
        c.shape(t, &dims)?;
    }
    match node {
        Node::ConvFprop { x, w, y, .. } => {
            for t in [*x, *w, *y] {
                c.nhwc(t)?;
            }
        }
        Node::ConvDgrad { dy, w, dx, attrs } => {
            let [k, _, _, _] = c.rank4(*w)?;
            let [_, dyc, _, _] = c.rank4(*dy)?;
            c.channels_equal(*dy, dyc, k)?;
            let expect = conv_output(g, &c.node, *dx, *w, attrs)?;
            c.shape(*dy, &expect)?;
            for t in [*dy, *w, *dx] {
                c.nhwc(t)?;
            }
        }
        Node::ConvWgrad { x, dy, dw, attrs } => {
            let [k, _, _, _] = c.rank4(*dw)?;
            let [_, dyc, _, _] = c.rank4(*dy)?;
            c.channels_equal(*dy, dyc, k)?;
            let expect = conv_output(g, &c.node, *x, *dw, attrs)?;
            c.shape(*dy, &expect)?;
            for t in [*x, *dy, *dw] {
                c.nhwc(t)?;
            }
        }
        Node::Pointwise { attrs, inputs, y } => {
            let mode = attrs.mode;
            if inputs.len() != mode.arity() {
                return Err(GraphError::Arity {
                    node: c.node.clone(),
                    mode: mode.name(),
                    expected: mode.arity(),
                    got: inputs.len(),
                });
            }
            if mode != PointwiseMode::Add && (attrs.alpha1 != 1.0 || attrs.alpha2 != 1.0) {
                return Err(GraphError::AlphaUnsupported {
                    node: c.node.clone(),
                    mode: mode.name(),
                    alpha1: attrs.alpha1,
                    alpha2: attrs.alpha2,
                });
            }
            let out = broadcast(g, &c.node, inputs)?;
            c.shape(*y, &out)?;
            if mode == PointwiseMode::BinarySelect {
                c.dtype_in(inputs[2], &[DataType::Boolean])?;
            }
            if mode == PointwiseMode::ReluBwd {
                c.shape(inputs[0], &out)?;
            }
        }
        Node::Reduction { x, y, .. } => {
            // Dims were checked with the outputs above; the values must be numbers.
            for t in [*x, *y] {
                c.dtype_in(t, REDUCIBLE)?;
            }
        }
        Node::GenStats { x, sum, sq_sum } => {
            c.nhwc(*x)?;
            c.dtype_in(*sum, STATS)?;
            c.dtype_in(*sq_sum, STATS)?;
        }
        Node::BnFinalize {
            inputs: i,
            outputs: o,
        } => {
            let ch = c.rank4(i.sum)?[1];
            for t in [
                i.sum,
                i.sq_sum,
                i.scale,
                i.bias,
                i.prev_running_mean,
                i.prev_running_var,
            ] {
                c.per_channel(t, ch)?;
                c.dtype_in(t, STATS)?;
            }
            for t in [
                o.saved_mean,
                o.saved_inv_std,
                o.updated_running_mean,
                o.updated_running_var,
            ] {
                c.dtype_in(t, STATS)?;
            }
            for t in [o.eq_scale, o.eq_bias] {
                c.dtype_in(t, &[DataType::Half, DataType::Float])?;
            }
            c.scalar(i.epsilon, HOST_REAL)?;
            c.scalar(i.momentum, HOST_REAL)?;
            c.scalar(i.accum_count, &[DataType::Int64])?;
        }
        Node::DbnWeight {
            inputs: i,
            outputs: o,
        } => {
            c.nhwc(i.x)?;
            let x = c.rank4(i.x)?;
            c.shape(i.dy, &x)?;
            for t in [i.mean, i.inv_std, i.scale] {
                c.per_channel(t, x[1])?;
                c.dtype_in(t, STATS)?;
            }
            for t in [o.dscale, o.dbias, o.eq_dy_scale, o.eq_x_scale, o.eq_bias] {
                c.dtype_in(t, STATS)?;
            }
        }
        Node::BatchNorm {
            inputs: i,
            outputs: o,
        } => {
            c.nhwc(i.x)?;
            let x = c.rank4(i.x)?;
            if i.prev_running_mean.is_some() != i.prev_running_var.is_some() {
                return Err(GraphError::RunningStatsPair {
                    node: c.node.clone(),
                });
            }
            for t in [
                Some(i.scale),
                Some(i.bias),
                i.prev_running_mean,
                i.prev_running_var,
            ]
            .into_iter()
            .flatten()
            {
                c.per_channel(t, x[1])?;
                c.dtype_in(t, STATS)?;
            }
            c.scalar(i.epsilon, HOST_REAL)?;
            c.scalar(i.momentum, HOST_REAL)?;
            c.dtype_in(o.mean, STATS)?;
            c.dtype_in(o.inv_variance, STATS)?;
        }
        Node::BatchNormBackward { inputs: i, .. } => {
            c.nhwc(i.x)?;
            let x = c.rank4(i.x)?;
            c.shape(i.dy, &x)?;
            for t in [i.scale, i.mean, i.inv_variance] {
                c.per_channel(t, x[1])?;
                c.dtype_in(t, STATS)?;
            }
        }
    }
    Ok(())
}
