//! The graph description: tensors and nodes in plain Rust, no FFI.
//!
//! 1. [`Graph::new`] with a [`PrecisionContext`] (FP16 I/O, FP32 intermediates and compute by
//!    default).
//! 2. Declare inputs with [`Graph::tensor`] ([`TensorAttrs`]: dims in N,C,H,W order, NHWC-packed
//!    strides by default, per-channel vectors, by-value scalars).
//! 3. Add nodes; each returns its outputs as new **virtual** tensors with inferred dims.
//! 4. Mark what must be stored with [`Graph::set_output`].
//! 5. [`Graph::validate`] checks everything before any cuDNN call, with typed errors that name
//!    the tensor and node; [`Graph::signature`] gives the canonical key plans are cached under.

mod error;
mod infer;
mod node;
mod signature;
mod tensor;
mod validate;

pub use error::GraphError;
pub use node::{
    BatchNormBackwardInputs, BatchNormBackwardOutputs, BatchNormInputs, BatchNormOutputs,
    BnFinalizeInputs, BnFinalizeOutputs, ConvAttrs, DbnWeightInputs, DbnWeightOutputs, Node,
    PointwiseAttrs, PointwiseMode, ReductionAttrs, ReductionMode,
};
pub use signature::{fnv1a, GraphSignature};
// The element type has one public path, `cudnn_cbr_runtime::DataType`; this crate's modules name
// it from here.
pub(crate) use tensor::DataType;
pub use tensor::{nhwc_strides, packed_strides, vector_dims, PrecisionContext, TensorAttrs};

/// A tensor of one graph: a `Copy` index into the graph's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub(crate) u32);

impl TensorId {
    /// The arena index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// How an output's element type defaults when the user sets none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DtypeClass {
    /// Activations: io when real, intermediate when virtual.
    Data,
    /// Statistics and per-channel results: compute type when real.
    Stat,
}

/// A graph under construction.
#[derive(Debug, Clone)]
pub struct Graph {
    name: String,
    precision: PrecisionContext,
    tensors: Vec<TensorAttrs>,
    classes: Vec<DtypeClass>,
    nodes: Vec<Node>,
    /// Why shape inference left an output without dims (the first such node): validation
    /// reports this cause rather than the missing dims it led to.
    infer_error: Option<GraphError>,
}

impl Graph {
    /// An empty graph; `name` appears in errors and reports (never in the signature).
    pub fn new(name: impl Into<String>) -> Self {
        Graph {
            name: name.into(),
            precision: PrecisionContext::default(),
            tensors: Vec::new(),
            classes: Vec::new(),
            nodes: Vec::new(),
            infer_error: None,
        }
    }

    /// Sets the precision context.
    pub fn with_precision(mut self, precision: PrecisionContext) -> Self {
        self.precision = precision;
        self
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The precision context.
    pub fn precision(&self) -> PrecisionContext {
        self.precision
    }

    /// Declares a tensor (a graph input, or any tensor the user describes fully).
    pub fn tensor(&mut self, attrs: TensorAttrs) -> TensorId {
        self.push(attrs, DtypeClass::Data)
    }

    fn push(&mut self, attrs: TensorAttrs, class: DtypeClass) -> TensorId {
        let id = TensorId(self.tensors.len() as u32);
        self.tensors.push(attrs);
        self.classes.push(class);
        id
    }

    /// A new virtual output of the node about to be added, named `kind#index.role`.
    fn output(&mut self, kind: &str, role: &str, class: DtypeClass) -> TensorId {
        let name = format!("{kind}#{}.{role}", self.nodes.len());
        self.push(
            TensorAttrs {
                is_virtual: true,
                ..TensorAttrs::new(name, Vec::<i64>::new())
            },
            class,
        )
    }

    /// A tensor's attributes, or None for an id from another graph.
    pub fn get(&self, t: TensorId) -> Option<&TensorAttrs> {
        self.tensors.get(t.index())
    }

    /// A tensor's attributes for editing (e.g. to set an output's dtype or strides).
    pub fn get_mut(&mut self, t: TensorId) -> Option<&mut TensorAttrs> {
        self.tensors.get_mut(t.index())
    }

    /// All tensors, indexed by [`TensorId::index`].
    pub fn tensors(&self) -> &[TensorAttrs] {
        &self.tensors
    }

    /// All nodes in insertion order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Rewrites every tensor of element type `from` to `to`: explicit dtypes, and the precision
    /// context's fields (so tensors that take their type from the context follow). Returns
    /// how many tensors' [`dtype`](Graph::dtype) changed. Lets a caller probe an existing
    /// graph in another I/O precision (e.g. FP16 → BF16) without a second builder.
    pub fn retype(&mut self, from: DataType, to: DataType) -> usize {
        let before: Vec<_> = (0..self.tensors.len() as u32)
            .map(|i| self.dtype(TensorId(i)))
            .collect();
        for attrs in &mut self.tensors {
            if attrs.dtype == Some(from) {
                attrs.dtype = Some(to);
            }
        }
        for field in [
            &mut self.precision.io,
            &mut self.precision.intermediate,
            &mut self.precision.compute,
        ] {
            if *field == from {
                *field = to;
            }
        }
        before
            .iter()
            .enumerate()
            .filter(|&(i, &d)| self.dtype(TensorId(i as u32)) != d)
            .count()
    }

    /// Marks a tensor as stored (real), optionally with an explicit element type.
    /// Ids from another graph are reported by [`Graph::validate`]-style errors.
    pub fn set_output(&mut self, t: TensorId, dtype: Option<DataType>) -> Result<(), GraphError> {
        let attrs = self
            .tensors
            .get_mut(t.index())
            .ok_or(GraphError::UnknownTensor {
                node: "set_output".into(),
                id: t.0,
            })?;
        attrs.is_virtual = false;
        if dtype.is_some() {
            attrs.dtype = dtype;
        }
        Ok(())
    }

    /// The element type a tensor will have: its own, else the precision context's.
    pub fn dtype(&self, t: TensorId) -> Option<DataType> {
        let attrs = self.get(t)?;
        Some(attrs.dtype.unwrap_or(if attrs.is_virtual {
            self.precision.intermediate
        } else {
            match self.classes[t.index()] {
                DtypeClass::Data => self.precision.io,
                DtypeClass::Stat => self.precision.compute,
            }
        }))
    }

    /// The strides a tensor will have: its own, else NHWC-packed (4-D) or row-major.
    pub fn strides(&self, t: TensorId) -> Option<Vec<i64>> {
        let attrs = self.get(t)?;
        Some(if attrs.strides.is_empty() {
            tensor::default_strides(&attrs.dims)
        } else {
            attrs.strides.clone()
        })
    }

    fn add_node(&mut self, node: Node) {
        self.nodes.push(node);
        // Fill in output dims where the inputs allow; validate() reports what does not.
        let idx = self.nodes.len() - 1;
        match infer::output_dims(self, &self.nodes[idx]) {
            Ok(shapes) => {
                for (t, dims) in shapes {
                    if self.tensors[t.index()].dims.is_empty() {
                        self.tensors[t.index()].dims = dims;
                    }
                }
            }
            Err(e) => {
                let undetermined = self.nodes[idx].outputs().into_iter().any(|t| {
                    self.tensors
                        .get(t.index())
                        .is_some_and(|a| a.dims.is_empty())
                });
                if undetermined && self.infer_error.is_none() {
                    self.infer_error = Some(e);
                }
            }
        }
    }

    /// The first shape-inference failure that left an output without dims.
    pub(crate) fn infer_error(&self) -> Option<&GraphError> {
        self.infer_error.as_ref()
    }

    /// y = conv(x, w): a cross-correlation; y is `[N, K, P, Q]`.
    pub fn conv_fprop(&mut self, x: TensorId, w: TensorId, attrs: ConvAttrs) -> TensorId {
        let y = self.output("conv_fprop", "y", DtypeClass::Data);
        self.add_node(Node::ConvFprop { x, w, y, attrs });
        y
    }

    /// dx = conv_dgrad(dy, w); `dx_dims` is the forward input's shape (not derivable when the
    /// stride drops rows).
    pub fn conv_dgrad(
        &mut self,
        dy: TensorId,
        w: TensorId,
        attrs: ConvAttrs,
        dx_dims: [i64; 4],
    ) -> TensorId {
        let dx = self.output("conv_dgrad", "dx", DtypeClass::Data);
        self.tensors[dx.index()].dims = dx_dims.to_vec();
        self.add_node(Node::ConvDgrad { dy, w, dx, attrs });
        dx
    }

    /// dw = conv_wgrad(x, dy); `dw_dims` is the filter's shape `[K, C, R, S]`.
    pub fn conv_wgrad(
        &mut self,
        x: TensorId,
        dy: TensorId,
        attrs: ConvAttrs,
        dw_dims: [i64; 4],
    ) -> TensorId {
        let dw = self.output("conv_wgrad", "dw", DtypeClass::Data);
        self.tensors[dw.index()].dims = dw_dims.to_vec();
        self.add_node(Node::ConvWgrad { x, dy, dw, attrs });
        dw
    }

    /// A pointwise node over 1–3 inputs (per-channel vectors broadcast).
    pub fn pointwise(&mut self, inputs: &[TensorId], attrs: PointwiseAttrs) -> TensorId {
        let y = self.output(attrs.mode.name(), "y", DtypeClass::Data);
        if attrs.mode == PointwiseMode::CmpGt {
            self.tensors[y.index()].dtype = Some(DataType::Boolean);
        }
        self.add_node(Node::Pointwise {
            attrs,
            inputs: inputs.to_vec(),
            y,
        });
        y
    }

    /// x + b.
    pub fn add(&mut self, x: TensorId, b: TensorId) -> TensorId {
        self.pointwise(&[x, b], PointwiseAttrs::new(PointwiseMode::Add))
    }

    /// x − b.
    pub fn sub(&mut self, x: TensorId, b: TensorId) -> TensorId {
        self.pointwise(&[x, b], PointwiseAttrs::new(PointwiseMode::Sub))
    }

    /// x · b.
    pub fn mul(&mut self, x: TensorId, b: TensorId) -> TensorId {
        self.pointwise(&[x, b], PointwiseAttrs::new(PointwiseMode::Mul))
    }

    /// max(x, 0).
    pub fn relu(&mut self, x: TensorId) -> TensorId {
        self.pointwise(&[x], PointwiseAttrs::new(PointwiseMode::ReluFwd))
    }

    /// ReLU backward: dy where x > 0.
    pub fn relu_backward(&mut self, dy: TensorId, x: TensorId) -> TensorId {
        self.pointwise(&[dy, x], PointwiseAttrs::new(PointwiseMode::ReluBwd))
    }

    /// x > b (Boolean output by default).
    pub fn cmp_gt(&mut self, x: TensorId, b: TensorId) -> TensorId {
        self.pointwise(&[x, b], PointwiseAttrs::new(PointwiseMode::CmpGt))
    }

    /// mask ? x : b.
    pub fn select(&mut self, x: TensorId, b: TensorId, mask: TensorId) -> TensorId {
        self.pointwise(
            &[x, b, mask],
            PointwiseAttrs::new(PointwiseMode::BinarySelect),
        )
    }

    /// y = x with another element type (set the output's dtype).
    pub fn identity(&mut self, x: TensorId) -> TensorId {
        self.pointwise(&[x], PointwiseAttrs::new(PointwiseMode::Identity))
    }

    /// y = reduce(x) to `attrs.output_dims` (each dim kept or collapsed to 1), e.g. the
    /// per-channel sum `[1, C, 1, 1]` of an `[N, C, H, W]` tensor. A stored output defaults to
    /// the compute type (FP32), like other statistics.
    pub fn reduce(&mut self, x: TensorId, attrs: ReductionAttrs) -> TensorId {
        let y = self.output("reduction", "y", DtypeClass::Stat);
        // The output's dims are the requested ones; validate() checks them against the input.
        self.tensors[y.index()].dims = attrs.output_dims.clone();
        self.add_node(Node::Reduction { x, y, attrs });
        y
    }

    /// Σ x per channel of a 4-D tensor with `c` channels: `[1, C, 1, 1]`.
    pub fn reduce_sum_per_channel(&mut self, x: TensorId, c: i64) -> TensorId {
        self.reduce(x, ReductionAttrs::per_channel(ReductionMode::Add, c))
    }

    /// Per-channel Σx and Σx² of a 4-D tensor; returns (sum, sq_sum).
    pub fn genstats(&mut self, x: TensorId) -> (TensorId, TensorId) {
        let sum = self.output("genstats", "sum", DtypeClass::Stat);
        let sq_sum = self.output("genstats", "sq_sum", DtypeClass::Stat);
        self.add_node(Node::GenStats { x, sum, sq_sum });
        (sum, sq_sum)
    }

    /// BN finalize. eq_scale/eq_bias default to the io type (FP16), the rest to compute type.
    pub fn bn_finalize(&mut self, inputs: BnFinalizeInputs) -> BnFinalizeOutputs {
        let outputs = BnFinalizeOutputs {
            eq_scale: self.output("bn_finalize", "eq_scale", DtypeClass::Data),
            eq_bias: self.output("bn_finalize", "eq_bias", DtypeClass::Data),
            saved_mean: self.output("bn_finalize", "saved_mean", DtypeClass::Stat),
            saved_inv_std: self.output("bn_finalize", "saved_inv_std", DtypeClass::Stat),
            updated_running_mean: self.output("bn_finalize", "running_mean", DtypeClass::Stat),
            updated_running_var: self.output("bn_finalize", "running_var", DtypeClass::Stat),
        };
        self.add_node(Node::BnFinalize { inputs, outputs });
        outputs
    }

    /// BN backward weights: dγ, dβ and the dx = A·dy + B·x + C coefficients.
    pub fn dbn_weight(&mut self, inputs: DbnWeightInputs) -> DbnWeightOutputs {
        let outputs = DbnWeightOutputs {
            dscale: self.output("dbn_weight", "dscale", DtypeClass::Stat),
            dbias: self.output("dbn_weight", "dbias", DtypeClass::Stat),
            eq_dy_scale: self.output("dbn_weight", "eq_dy_scale", DtypeClass::Stat),
            eq_x_scale: self.output("dbn_weight", "eq_x_scale", DtypeClass::Stat),
            eq_bias: self.output("dbn_weight", "eq_bias", DtypeClass::Stat),
        };
        self.add_node(Node::DbnWeight { inputs, outputs });
        outputs
    }

    /// Plain batch-norm forward (training).
    pub fn batchnorm(&mut self, inputs: BatchNormInputs) -> BatchNormOutputs {
        let running = inputs.prev_running_mean.is_some() || inputs.prev_running_var.is_some();
        let outputs = BatchNormOutputs {
            y: self.output("batchnorm", "y", DtypeClass::Data),
            mean: self.output("batchnorm", "mean", DtypeClass::Stat),
            inv_variance: self.output("batchnorm", "inv_variance", DtypeClass::Stat),
            next_running_mean: running
                .then(|| self.output("batchnorm", "running_mean", DtypeClass::Stat)),
            next_running_var: running
                .then(|| self.output("batchnorm", "running_var", DtypeClass::Stat)),
        };
        self.add_node(Node::BatchNorm { inputs, outputs });
        outputs
    }

    /// Plain batch-norm backward.
    pub fn batchnorm_backward(
        &mut self,
        inputs: BatchNormBackwardInputs,
    ) -> BatchNormBackwardOutputs {
        let outputs = BatchNormBackwardOutputs {
            dx: self.output("batchnorm_backward", "dx", DtypeClass::Data),
            dscale: self.output("batchnorm_backward", "dscale", DtypeClass::Stat),
            dbias: self.output("batchnorm_backward", "dbias", DtypeClass::Stat),
        };
        self.add_node(Node::BatchNormBackward { inputs, outputs });
        outputs
    }

    /// Checks the whole graph; see [`GraphError`] for everything it catches.
    pub fn validate(&self) -> Result<(), GraphError> {
        validate::validate(self)
    }

    /// The canonical signature (structure, shapes, strides, dtypes, node attributes; not
    /// names or uids). Validates first.
    pub fn signature(&self) -> Result<GraphSignature, GraphError> {
        self.validate()?;
        Ok(signature::signature(self))
    }

    /// The tensor's display name for messages.
    pub(crate) fn tname(&self, t: TensorId) -> String {
        self.get(t)
            .map(|a| a.name.clone())
            .unwrap_or_else(|| format!("<unknown tensor {}>", t.0))
    }
}

#[cfg(test)]
mod tests;
