//! Lowering: a validated [`Graph`] becomes a finalized cuDNN operation graph.
//!
//! Every tensor, convolution, pointwise, reduction and operation descriptor is created here and
//! kept alive by the [`OperationGraph`] that owns them. Uses only the safe
//! [`backend`](crate::backend) API.
//!
//! A graph planned for a live target is lowered with [`OperationGraph::for_target`], which
//! gives cuDNN the target's handle (`CUDNN_ATTR_OPERATIONGRAPH_HANDLE`) as
//! [`crate::target::device_binding`] says; [`OperationGraph::new`] lowers for a deviceless
//! target.

use crate::backend::Descriptor;
use crate::error::{Error, Result};
use crate::exec::HandleRef;
use crate::graph::{
    ConvAttrs, DataType, Graph, GraphSignature, Node, PointwiseMode, ReductionMode, TensorId,
};
use crate::target::Target;
use cudnn_fe_sys as sys;
use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendDescriptorType_t as K;

/// One real (non-virtual) tensor of a lowered graph, as execution needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealTensor {
    /// The graph tensor.
    pub id: TensorId,
    /// Its unique id in the cuDNN graph and the variant pack.
    pub uid: i64,
    /// Name, for error messages.
    pub name: String,
    /// Element type.
    pub dtype: DataType,
    /// Whether it is a host scalar passed by value.
    pub by_value: bool,
    /// Bytes it spans (largest offset + 1 element).
    pub bytes: usize,
}

/// A finalized cuDNN operation graph plus everything execution needs to know about it.
#[derive(Debug)]
pub struct OperationGraph {
    name: String,
    signature: GraphSignature,
    real: Vec<RealTensor>,
    desc: Descriptor,
    // Tensors, conv/pointwise descriptors and ops the graph refers to, kept alive with it.
    _parts: Vec<Descriptor>,
    /// The graph it was lowered from (the plans built from it keep it: the graph interpreter
    /// runs it on the simulated device).
    source: Box<Graph>,
    /// The handle set on the graph (a live target's), held so it outlives the graph (fields
    /// drop in order: this one last).
    handle: Option<HandleRef>,
}

impl OperationGraph {
    /// Validates and lowers `graph` for a deviceless target (no handle is set). For a live
    /// target use [`OperationGraph::for_target`]: planning refuses a graph lowered without
    /// the target's handle ([`Error::LoweredForOtherTarget`]).
    pub fn new(graph: &Graph) -> Result<Self> {
        let signature = graph.signature()?;
        lower(graph, signature, None)
    }

    /// Validates and lowers `graph` for `target`: with the handle of a live target set on the
    /// operation graph, none for a deviceless one ([`Target::binding`]).
    pub fn for_target(graph: &Graph, target: &Target) -> Result<Self> {
        let signature = graph.signature()?;
        let handle = target.graph_handle().cloned();
        if handle.is_some() {
            // The graph is finalized against the handle's device.
            target.make_current()?;
        }
        lower(graph, signature, handle)
    }

    /// Whether a handle was set on the graph (it was lowered for a live target).
    pub fn has_handle(&self) -> bool {
        self.handle.is_some()
    }

    /// The address of the handle set on the graph, to match it with a target's.
    pub(crate) fn handle_addr(&self) -> Option<usize> {
        self.handle.as_ref().map(|h| h.raw() as usize)
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The canonical signature.
    pub fn signature(&self) -> &GraphSignature {
        &self.signature
    }

    /// Real tensors sorted by uid (the variant pack order).
    pub fn real_tensors(&self) -> &[RealTensor] {
        &self.real
    }

    /// The uid of a graph tensor, if it is real.
    pub fn uid_of(&self, t: TensorId) -> Option<i64> {
        self.real.iter().find(|r| r.id == t).map(|r| r.uid)
    }

    /// The finalized operation-graph descriptor.
    pub fn descriptor(&self) -> &Descriptor {
        &self.desc
    }

    /// The graph it was lowered from.
    pub fn source_graph(&self) -> &Graph {
        &self.source
    }
}

/// cuDNN's code for a data type.
pub fn cudnn_dtype(d: DataType) -> sys::cudnnDataType_t {
    use sys::cudnnDataType_t as D;
    match d {
        DataType::Half => D::CUDNN_DATA_HALF,
        DataType::BFloat16 => D::CUDNN_DATA_BFLOAT16,
        DataType::Float => D::CUDNN_DATA_FLOAT,
        DataType::Double => D::CUDNN_DATA_DOUBLE,
        DataType::Int32 => D::CUDNN_DATA_INT32,
        DataType::Int64 => D::CUDNN_DATA_INT64,
        DataType::Boolean => D::CUDNN_DATA_BOOLEAN,
    }
}

fn pointwise_mode(m: PointwiseMode) -> sys::cudnnPointwiseMode_t {
    use sys::cudnnPointwiseMode_t as P;
    match m {
        PointwiseMode::Add => P::CUDNN_POINTWISE_ADD,
        PointwiseMode::Sub => P::CUDNN_POINTWISE_SUB,
        PointwiseMode::Mul => P::CUDNN_POINTWISE_MUL,
        PointwiseMode::ReluFwd => P::CUDNN_POINTWISE_RELU_FWD,
        PointwiseMode::ReluBwd => P::CUDNN_POINTWISE_RELU_BWD,
        PointwiseMode::CmpGt => P::CUDNN_POINTWISE_CMP_GT,
        PointwiseMode::BinarySelect => P::CUDNN_POINTWISE_BINARY_SELECT,
        PointwiseMode::Identity => P::CUDNN_POINTWISE_IDENTITY,
    }
}

fn reduction_op(m: ReductionMode) -> sys::cudnnReduceTensorOp_t {
    use sys::cudnnReduceTensorOp_t as R;
    match m {
        ReductionMode::Add => R::CUDNN_REDUCE_TENSOR_ADD,
        ReductionMode::Max => R::CUDNN_REDUCE_TENSOR_MAX,
    }
}

/// Assigns uids: explicit ones stay, the rest count up from 1 skipping taken values.
fn assign_uids(graph: &Graph) -> Vec<i64> {
    let taken: std::collections::HashSet<i64> =
        graph.tensors().iter().filter_map(|a| a.uid).collect();
    let mut next = 1i64;
    graph
        .tensors()
        .iter()
        .map(|a| {
            a.uid.unwrap_or_else(|| {
                while taken.contains(&next) {
                    next += 1;
                }
                next += 1;
                next - 1
            })
        })
        .collect()
}

struct Lowering<'g> {
    graph: &'g Graph,
    compute: sys::cudnnDataType_t,
    tensors: Vec<Descriptor>,
    parts: Vec<Descriptor>,
    ops: Vec<Descriptor>,
}

impl Lowering<'_> {
    fn t(&self, id: TensorId) -> &Descriptor {
        &self.tensors[id.index()]
    }

    fn conv_desc(&mut self, attrs: &ConvAttrs) -> Result<usize> {
        let mut conv = Descriptor::new(K::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
        conv.set_one(A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, 2i64)?
            .set_one(A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE, self.compute)?
            .set_one(
                A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
            )?
            .set(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, &attrs.dilation)?
            .set(A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &attrs.stride)?
            .set(A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &attrs.pre_padding)?
            .set(A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &attrs.post_padding)?;
        conv.finalize()?;
        self.parts.push(conv);
        Ok(self.parts.len() - 1)
    }

    fn op(&mut self, kind: sys::cudnnBackendDescriptorType_t) -> Result<Descriptor> {
        Descriptor::new(kind)
    }

    fn lower_node(&mut self, node: &Node) -> Result<()> {
        use crate::graph::Node as N;
        let mut op;
        match node {
            N::ConvFprop { x, w, y, attrs } => {
                let c = self.conv_desc(attrs)?;
                op = self.op(K::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
                op.set_descriptors(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[self.t(*x)])?
                    .set_descriptors(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[self.t(*w)])?
                    .set_descriptors(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, &[self.t(*y)])?
                    .set_descriptors(
                        A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                        &[&self.parts[c]],
                    )?
                    .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, 1.0f32)?
                    .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, 0.0f32)?;
            }
            N::ConvDgrad { dy, w, dx, attrs } => {
                let c = self.conv_desc(attrs)?;
                op = self.op(K::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR)?;
                op.set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                    &[self.t(*dy)],
                )?
                .set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                    &[self.t(*w)],
                )?
                .set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                    &[self.t(*dx)],
                )?
                .set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                    &[&self.parts[c]],
                )?
                .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, 1.0f32)?
                .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, 0.0f32)?;
            }
            N::ConvWgrad { x, dy, dw, attrs } => {
                let c = self.conv_desc(attrs)?;
                op = self.op(K::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR)?;
                op.set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                    &[self.t(*x)],
                )?
                .set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                    &[self.t(*dy)],
                )?
                .set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                    &[self.t(*dw)],
                )?
                .set_descriptors(
                    A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                    &[&self.parts[c]],
                )?
                .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, 1.0f32)?
                .set_one(A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, 0.0f32)?;
            }
            N::Pointwise { attrs, inputs, y } => {
                let mut pw = Descriptor::new(K::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
                pw.set_one(A::CUDNN_ATTR_POINTWISE_MODE, pointwise_mode(attrs.mode))?
                    .set_one(A::CUDNN_ATTR_POINTWISE_MATH_PREC, self.compute)?;
                pw.finalize()?;
                op = self.op(K::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
                op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
                if attrs.mode == PointwiseMode::ReluBwd {
                    op.set_descriptors(
                        A::CUDNN_ATTR_OPERATION_POINTWISE_DYDESC,
                        &[self.t(inputs[0])],
                    )?
                    .set_descriptors(
                        A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
                        &[self.t(inputs[1])],
                    )?
                    .set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_DXDESC, &[self.t(*y)])?;
                } else {
                    op.set_descriptors(
                        A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
                        &[self.t(inputs[0])],
                    )?;
                    if let Some(b) = inputs.get(1) {
                        op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[self.t(*b)])?;
                    }
                    if let Some(t) = inputs.get(2) {
                        op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[self.t(*t)])?;
                    }
                    op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[self.t(*y)])?;
                }
                // Alphas only when they differ from cuDNN's default of 1: generic engines
                // reject α2 ≠ 1 (docs/cudnn-graphs.md §9).
                if attrs.alpha1 != 1.0 {
                    op.set_one(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, attrs.alpha1)?;
                }
                if attrs.alpha2 != 1.0 {
                    op.set_one(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, attrs.alpha2)?;
                }
                self.parts.push(pw);
            }
            N::Reduction { x, y, attrs } => {
                // The reduced dims are implied by the output tensor's dims (1 = reduced).
                let mut red = Descriptor::new(K::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
                red.set_one(A::CUDNN_ATTR_REDUCTION_OPERATOR, reduction_op(attrs.mode))?
                    .set_one(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, self.compute)?;
                red.finalize()?;
                op = self.op(K::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
                op.set_descriptors(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[self.t(*x)])?
                    .set_descriptors(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[self.t(*y)])?
                    .set_descriptors(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&red])?;
                self.parts.push(red);
            }
            N::GenStats { x, sum, sq_sum } => {
                op = self.op(K::CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR)?;
                op.set_one(
                    A::CUDNN_ATTR_OPERATION_GENSTATS_MODE,
                    sys::cudnnGenStatsMode_t::CUDNN_GENSTATS_SUM_SQSUM,
                )?
                .set_one(A::CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC, self.compute)?
                .set_descriptors(A::CUDNN_ATTR_OPERATION_GENSTATS_XDESC, &[self.t(*x)])?
                .set_descriptors(A::CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, &[self.t(*sum)])?
                .set_descriptors(
                    A::CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC,
                    &[self.t(*sq_sum)],
                )?;
            }
            N::BnFinalize {
                inputs: i,
                outputs: o,
            } => {
                op = self.op(K::CUDNN_BACKEND_OPERATION_BN_FINALIZE_STATISTICS_DESCRIPTOR)?;
                op.set_one(
                    A::CUDNN_ATTR_OPERATION_BN_FINALIZE_STATS_MODE,
                    sys::cudnnBnFinalizeStatsMode_t::CUDNN_BN_FINALIZE_STATISTICS_TRAINING,
                )?
                .set_one(A::CUDNN_ATTR_OPERATION_BN_FINALIZE_MATH_PREC, self.compute)?;
                for (name, t) in [
                    (A::CUDNN_ATTR_OPERATION_BN_FINALIZE_Y_SUM_DESC, i.sum),
                    (A::CUDNN_ATTR_OPERATION_BN_FINALIZE_Y_SQ_SUM_DESC, i.sq_sum),
                    (A::CUDNN_ATTR_OPERATION_BN_FINALIZE_SCALE_DESC, i.scale),
                    (A::CUDNN_ATTR_OPERATION_BN_FINALIZE_BIAS_DESC, i.bias),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_PREV_RUNNING_MEAN_DESC,
                        i.prev_running_mean,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_PREV_RUNNING_VAR_DESC,
                        i.prev_running_var,
                    ),
                    (A::CUDNN_ATTR_OPERATION_BN_FINALIZE_EPSILON_DESC, i.epsilon),
                    // The header spells it "AVERATE".
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_EXP_AVERATE_FACTOR_DESC,
                        i.momentum,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_ACCUM_COUNT_DESC,
                        i.accum_count,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_EQ_SCALE_DESC,
                        o.eq_scale,
                    ),
                    (A::CUDNN_ATTR_OPERATION_BN_FINALIZE_EQ_BIAS_DESC, o.eq_bias),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_SAVED_MEAN_DESC,
                        o.saved_mean,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_SAVED_INV_STD_DESC,
                        o.saved_inv_std,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_UPDATED_RUNNING_MEAN_DESC,
                        o.updated_running_mean,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_FINALIZE_UPDATED_RUNNING_VAR_DESC,
                        o.updated_running_var,
                    ),
                ] {
                    op.set_descriptors(name, &[self.t(t)])?;
                }
            }
            N::DbnWeight {
                inputs: i,
                outputs: o,
            } => {
                op = self.op(K::CUDNN_BACKEND_OPERATION_BN_BWD_WEIGHTS_DESCRIPTOR)?;
                op.set_one(
                    A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_MATH_PREC,
                    self.compute,
                )?;
                for (name, t) in [
                    (A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_X_DESC, i.x),
                    (A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_MEAN_DESC, i.mean),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_INVSTD_DESC,
                        i.inv_std,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_BN_SCALE_DESC,
                        i.scale,
                    ),
                    (A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DY_DESC, i.dy),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DBN_SCALE_DESC,
                        o.dscale,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DBN_BIAS_DESC,
                        o.dbias,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_DY_SCALE_DESC,
                        o.eq_dy_scale,
                    ),
                    (
                        A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_X_SCALE_DESC,
                        o.eq_x_scale,
                    ),
                    (A::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_BIAS, o.eq_bias),
                ] {
                    op.set_descriptors(name, &[self.t(t)])?;
                }
            }
            N::BatchNorm {
                inputs: i,
                outputs: o,
            } => {
                op = self.op(K::CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR)?;
                op.set_one(
                    A::CUDNN_ATTR_OPERATION_NORM_FWD_MODE,
                    sys::cudnnBackendNormMode_t::CUDNN_BATCH_NORM,
                )?
                .set_one(
                    A::CUDNN_ATTR_OPERATION_NORM_FWD_PHASE,
                    sys::cudnnBackendNormFwdPhase_t::CUDNN_NORM_FWD_TRAINING,
                )?;
                let mut pairs = vec![
                    (A::CUDNN_ATTR_OPERATION_NORM_FWD_XDESC, i.x),
                    (A::CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC, i.scale),
                    (A::CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC, i.bias),
                    (A::CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC, i.epsilon),
                    (
                        A::CUDNN_ATTR_OPERATION_NORM_FWD_EXP_AVG_FACTOR_DESC,
                        i.momentum,
                    ),
                    (A::CUDNN_ATTR_OPERATION_NORM_FWD_YDESC, o.y),
                    (A::CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC, o.mean),
                    (
                        A::CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC,
                        o.inv_variance,
                    ),
                ];
                if let (Some(rm), Some(rv), Some(nm), Some(nv)) = (
                    i.prev_running_mean,
                    i.prev_running_var,
                    o.next_running_mean,
                    o.next_running_var,
                ) {
                    pairs.extend([
                        (A::CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_MEAN_DESC, rm),
                        (A::CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_VAR_DESC, rv),
                        (
                            A::CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_MEAN_DESC,
                            nm,
                        ),
                        (A::CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_VAR_DESC, nv),
                    ]);
                }
                for (name, t) in pairs {
                    op.set_descriptors(name, &[self.t(t)])?;
                }
            }
            N::BatchNormBackward {
                inputs: i,
                outputs: o,
            } => {
                op = self.op(K::CUDNN_BACKEND_OPERATION_NORM_BACKWARD_DESCRIPTOR)?;
                op.set_one(
                    A::CUDNN_ATTR_OPERATION_NORM_BWD_MODE,
                    sys::cudnnBackendNormMode_t::CUDNN_BATCH_NORM,
                )?;
                for (name, t) in [
                    (A::CUDNN_ATTR_OPERATION_NORM_BWD_XDESC, i.x),
                    (A::CUDNN_ATTR_OPERATION_NORM_BWD_DYDESC, i.dy),
                    (A::CUDNN_ATTR_OPERATION_NORM_BWD_SCALE_DESC, i.scale),
                    (A::CUDNN_ATTR_OPERATION_NORM_BWD_MEAN_DESC, i.mean),
                    (
                        A::CUDNN_ATTR_OPERATION_NORM_BWD_INV_VARIANCE_DESC,
                        i.inv_variance,
                    ),
                    (A::CUDNN_ATTR_OPERATION_NORM_BWD_DXDESC, o.dx),
                    (A::CUDNN_ATTR_OPERATION_NORM_BWD_DSCALE_DESC, o.dscale),
                    (A::CUDNN_ATTR_OPERATION_NORM_BWD_DBIAS_DESC, o.dbias),
                ] {
                    op.set_descriptors(name, &[self.t(t)])?;
                }
            }
        }
        op.finalize()?;
        self.ops.push(op);
        Ok(())
    }
}

/// The real tensors of a validated graph with their uids, sorted by uid: what a variant pack
/// needs. Pure Rust (no cuDNN call).
pub fn real_tensor_layout(graph: &Graph) -> Vec<RealTensor> {
    real_tensors(graph, &assign_uids(graph))
}

fn real_tensors(graph: &Graph, uids: &[i64]) -> Vec<RealTensor> {
    let mut real: Vec<RealTensor> = graph
        .tensors()
        .iter()
        .enumerate()
        .filter(|(_, a)| !a.is_virtual)
        .map(|(i, a)| {
            let id = TensorId(i as u32);
            let dtype = graph.dtype(id).unwrap_or(DataType::Float);
            let strides = graph.strides(id).unwrap_or_default();
            let span: i64 = a
                .dims
                .iter()
                .zip(&strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<i64>()
                + 1;
            RealTensor {
                id,
                uid: uids[i],
                name: a.name.clone(),
                dtype,
                by_value: a.by_value,
                bytes: span as usize * dtype.size(),
            }
        })
        .collect();
    real.sort_by_key(|r| r.uid);
    real
}

fn lower(
    graph: &Graph,
    signature: GraphSignature,
    handle: Option<HandleRef>,
) -> Result<OperationGraph> {
    let uids = assign_uids(graph);
    let mut tensors = Vec::with_capacity(graph.tensors().len());
    for (i, a) in graph.tensors().iter().enumerate() {
        let id = TensorId(i as u32);
        let dtype = graph.dtype(id).unwrap_or(DataType::Float);
        let strides = graph.strides(id).unwrap_or_default();
        let mut t = Descriptor::new(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        t.set_one(A::CUDNN_ATTR_TENSOR_DATA_TYPE, cudnn_dtype(dtype))?
            .set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &a.dims)?
            .set(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?
            .set_one(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, uids[i])?
            .set_one(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16i64)?;
        if a.is_virtual {
            t.set_one(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, true)?;
        }
        if a.by_value {
            t.set_one(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        t.finalize()
            .map_err(|e| with_context(e, &format!("tensor `{}`", a.name)))?;
        tensors.push(t);
    }
    let real = real_tensors(graph, &uids);
    let mut l = Lowering {
        graph,
        compute: cudnn_dtype(graph.precision().compute),
        tensors,
        parts: Vec::new(),
        ops: Vec::new(),
    };
    for (idx, node) in graph.nodes().iter().enumerate() {
        l.lower_node(node).map_err(|e| {
            with_context(
                e,
                &format!("graph `{}`, {}#{idx}", l.graph.name(), node.kind()),
            )
        })?;
    }
    let mut desc = Descriptor::new(K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    let ops: Vec<&Descriptor> = l.ops.iter().collect();
    desc.set_descriptors(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?;
    if let Some(h) = &handle {
        desc.set_one(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, h.raw())?;
    }
    desc.finalize()
        .map_err(|e| with_context(e, &format!("graph `{}`", graph.name())))?;
    let mut parts = l.tensors;
    parts.extend(l.parts);
    parts.extend(l.ops);
    Ok(OperationGraph {
        name: graph.name().to_string(),
        signature,
        real,
        desc,
        _parts: parts,
        source: Box::new(graph.clone()),
        handle,
    })
}

/// Prefixes a cuDNN error's step with where in the graph it happened.
fn with_context(e: Error, ctx: &str) -> Error {
    match e {
        Error::Cudnn { what, source } => Error::Cudnn {
            what: format!("{ctx}: {what}"),
            source,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cbr::{graphs, ConvShape};
    use crate::test_support;

    #[test]
    fn a_graph_lowered_for_a_deviceless_target_has_no_handle_and_plans() {
        if !test_support::cudnn_or_skip(
            "a_graph_lowered_for_a_deviceless_target_has_no_handle_and_plans",
        ) {
            return;
        }
        let target = test_support::h200();
        let (graph, _) =
            graphs::conv_fprop(&ConvShape::square(4, 32, 16, 48, 3, 1, 1), false, false);
        let op = OperationGraph::for_target(&graph, &target).unwrap();
        assert!(!op.has_handle());
        assert_eq!(op.handle_addr(), None);
        let plan = crate::plan::build_plan(&op, &target).unwrap();
        assert_eq!(plan.target_identity(), target.identity());
        // `new` lowers the same way for a deviceless target.
        assert!(!OperationGraph::new(&graph).unwrap().has_handle());
    }
}
