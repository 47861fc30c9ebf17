//! Nodes of a graph and their attributes.

use super::TensorId;

/// Padding, stride and dilation of a 2-D cross-correlation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvAttrs {
    /// Padding before (top, left).
    pub pre_padding: [i64; 2],
    /// Padding after (bottom, right).
    pub post_padding: [i64; 2],
    /// Filter strides (vertical, horizontal).
    pub stride: [i64; 2],
    /// Dilations (vertical, horizontal).
    pub dilation: [i64; 2],
}

impl Default for ConvAttrs {
    fn default() -> Self {
        ConvAttrs {
            pre_padding: [0, 0],
            post_padding: [0, 0],
            stride: [1, 1],
            dilation: [1, 1],
        }
    }
}

impl ConvAttrs {
    /// Symmetric padding `p` on both spatial dims.
    pub fn padding(mut self, p: i64) -> Self {
        self.pre_padding = [p, p];
        self.post_padding = [p, p];
        self
    }

    /// Stride `s` on both spatial dims.
    pub fn stride(mut self, s: i64) -> Self {
        self.stride = [s, s];
        self
    }

    /// Dilation `d` on both spatial dims.
    pub fn dilation(mut self, d: i64) -> Self {
        self.dilation = [d, d];
        self
    }

    /// Output extent of one spatial dim (cross-correlation), or None when it is < 1 or the
    /// arithmetic would overflow (checked: the values come from users).
    pub fn out_extent(&self, dim: usize, input: i64, filter: i64) -> Option<i64> {
        let span = self.dilation[dim]
            .checked_mul(filter.checked_sub(1)?)?
            .checked_add(1)?;
        let padded = input
            .checked_add(self.pre_padding[dim])?
            .checked_add(self.post_padding[dim])?;
        if self.stride[dim] <= 0 || padded < span {
            return None;
        }
        Some((padded - span) / self.stride[dim] + 1)
    }
}

/// Pointwise operations the graph supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PointwiseMode {
    /// y = α1·x + α2·b.
    Add,
    /// y = x − b.
    Sub,
    /// y = x · b.
    Mul,
    /// y = max(x, 0).
    ReluFwd,
    /// dx = dy where x > 0, else 0 (inputs: dy, x).
    ReluBwd,
    /// y = x > b (Boolean or numeric output).
    CmpGt,
    /// y = t ? x : b (inputs: x, b, t).
    BinarySelect,
    /// y = x, converting the element type (a cast).
    Identity,
}

impl PointwiseMode {
    /// Number of inputs the mode takes.
    pub fn arity(self) -> usize {
        match self {
            PointwiseMode::ReluFwd | PointwiseMode::Identity => 1,
            PointwiseMode::BinarySelect => 3,
            _ => 2,
        }
    }

    /// Short name for signatures and messages.
    pub fn name(self) -> &'static str {
        match self {
            PointwiseMode::Add => "add",
            PointwiseMode::Sub => "sub",
            PointwiseMode::Mul => "mul",
            PointwiseMode::ReluFwd => "relu_fwd",
            PointwiseMode::ReluBwd => "relu_bwd",
            PointwiseMode::CmpGt => "cmp_gt",
            PointwiseMode::BinarySelect => "binary_select",
            PointwiseMode::Identity => "identity",
        }
    }
}

/// Attributes of a pointwise node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PointwiseAttrs {
    /// The operation.
    pub mode: PointwiseMode,
    /// α1 (scales the first input of Add); 1 by default.
    pub alpha1: f32,
    /// α2 (scales the second input of Add); 1 by default.
    pub alpha2: f32,
}

impl PointwiseAttrs {
    /// A pointwise node of `mode` with α1 = α2 = 1.
    pub fn new(mode: PointwiseMode) -> Self {
        PointwiseAttrs {
            mode,
            alpha1: 1.0,
            alpha2: 1.0,
        }
    }

    /// Sets α1 and α2 (Add computes α1·x + α2·b).
    pub fn alphas(mut self, alpha1: f32, alpha2: f32) -> Self {
        self.alpha1 = alpha1;
        self.alpha2 = alpha2;
        self
    }
}

/// Reduction operators the graph supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReductionMode {
    /// y = Σ x over the reduced dims.
    Add,
    /// y = max x over the reduced dims.
    Max,
}

impl ReductionMode {
    /// Short name for signatures and messages.
    pub fn name(self) -> &'static str {
        match self {
            ReductionMode::Add => "add",
            ReductionMode::Max => "max",
        }
    }
}

/// Attributes of a reduction node: the operator and the output's dims, each equal to the
/// input's (kept) or 1 (reduced), e.g. `[1, C, 1, 1]` for a per-channel sum of `[N, C, H, W]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReductionAttrs {
    /// The operator.
    pub mode: ReductionMode,
    /// The output's dims (same rank as the input).
    pub output_dims: Vec<i64>,
}

impl ReductionAttrs {
    /// A reduction of `mode` to `output_dims`.
    pub fn new(mode: ReductionMode, output_dims: impl Into<Vec<i64>>) -> Self {
        ReductionAttrs {
            mode,
            output_dims: output_dims.into(),
        }
    }

    /// A per-channel reduction of a 4-D tensor with `c` channels: output `[1, C, 1, 1]`.
    pub fn per_channel(mode: ReductionMode, c: i64) -> Self {
        Self::new(mode, [1, c, 1, 1])
    }
}

/// Inputs of BN finalize (all per-channel FP32 except the by-value scalars).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BnFinalizeInputs {
    /// Σ y per channel (from GenStats).
    pub sum: TensorId,
    /// Σ y² per channel.
    pub sq_sum: TensorId,
    /// γ.
    pub scale: TensorId,
    /// β.
    pub bias: TensorId,
    /// Running mean before the update.
    pub prev_running_mean: TensorId,
    /// Running variance before the update.
    pub prev_running_var: TensorId,
    /// ε, by value (f32 or f64).
    pub epsilon: TensorId,
    /// Weight of the new batch statistic in the running update, by value (f32 or f64).
    pub momentum: TensorId,
    /// Elements per channel (N·P·Q), by value, INT64.
    pub accum_count: TensorId,
}

/// Outputs of BN finalize.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BnFinalizeOutputs {
    /// Equivalent scale γ·invstd (FP16 so the next conv's prologue can use it).
    pub eq_scale: TensorId,
    /// Equivalent bias β − mean·γ·invstd.
    pub eq_bias: TensorId,
    /// Batch mean.
    pub saved_mean: TensorId,
    /// Batch 1/sqrt(var + ε).
    pub saved_inv_std: TensorId,
    /// Running mean after the update.
    pub updated_running_mean: TensorId,
    /// Running variance after the update.
    pub updated_running_var: TensorId,
}

/// Inputs of the BN backward-weights node (dBN weight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DbnWeightInputs {
    /// The BN's input (previous conv's raw output).
    pub x: TensorId,
    /// Saved batch mean.
    pub mean: TensorId,
    /// Saved inverse standard deviation.
    pub inv_std: TensorId,
    /// γ.
    pub scale: TensorId,
    /// Gradient w.r.t. the BN output.
    pub dy: TensorId,
}

/// Outputs of the dBN weight node: dγ, dβ and the coefficients of dx = A·dy + B·x + C.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DbnWeightOutputs {
    /// dγ.
    pub dscale: TensorId,
    /// dβ.
    pub dbias: TensorId,
    /// A (multiplies dy).
    pub eq_dy_scale: TensorId,
    /// B (multiplies x).
    pub eq_x_scale: TensorId,
    /// C.
    pub eq_bias: TensorId,
}

/// Inputs of the plain batch-norm forward (training) node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchNormInputs {
    /// Input activations.
    pub x: TensorId,
    /// γ.
    pub scale: TensorId,
    /// β.
    pub bias: TensorId,
    /// ε, by value.
    pub epsilon: TensorId,
    /// Running-update weight of the new batch, by value.
    pub momentum: TensorId,
    /// Running mean before the update (optional).
    pub prev_running_mean: Option<TensorId>,
    /// Running variance before the update (optional).
    pub prev_running_var: Option<TensorId>,
}

/// Outputs of the plain batch-norm forward node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchNormOutputs {
    /// Normalized output.
    pub y: TensorId,
    /// Batch mean.
    pub mean: TensorId,
    /// Batch inverse variance (cuDNN's name; 1/sqrt(var+ε)).
    pub inv_variance: TensorId,
    /// Updated running mean (when running stats are given).
    pub next_running_mean: Option<TensorId>,
    /// Updated running variance (when running stats are given).
    pub next_running_var: Option<TensorId>,
}

/// Inputs of the plain batch-norm backward node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchNormBackwardInputs {
    /// Gradient w.r.t. the BN output.
    pub dy: TensorId,
    /// The BN's input.
    pub x: TensorId,
    /// γ.
    pub scale: TensorId,
    /// Saved batch mean.
    pub mean: TensorId,
    /// Saved inverse variance.
    pub inv_variance: TensorId,
}

/// Outputs of the plain batch-norm backward node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchNormBackwardOutputs {
    /// Gradient w.r.t. the BN input.
    pub dx: TensorId,
    /// dγ.
    pub dscale: TensorId,
    /// dβ.
    pub dbias: TensorId,
}

/// One operation of a graph.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// y = conv(x, w).
    ConvFprop {
        /// Input.
        x: TensorId,
        /// Filter.
        w: TensorId,
        /// Output.
        y: TensorId,
        /// Geometry.
        attrs: ConvAttrs,
    },
    /// dx = conv_dgrad(dy, w).
    ConvDgrad {
        /// Incoming gradient.
        dy: TensorId,
        /// Filter.
        w: TensorId,
        /// Output gradient.
        dx: TensorId,
        /// Geometry.
        attrs: ConvAttrs,
    },
    /// dw = conv_wgrad(x, dy).
    ConvWgrad {
        /// Forward input.
        x: TensorId,
        /// Incoming gradient.
        dy: TensorId,
        /// Filter gradient.
        dw: TensorId,
        /// Geometry.
        attrs: ConvAttrs,
    },
    /// An elementwise op with broadcasting of per-channel vectors.
    Pointwise {
        /// Mode and alphas.
        attrs: PointwiseAttrs,
        /// 1–3 inputs in the mode's order.
        inputs: Vec<TensorId>,
        /// Output.
        y: TensorId,
    },
    /// A reduction of `x` to the dims in `attrs` (each kept or collapsed to 1).
    Reduction {
        /// Input.
        x: TensorId,
        /// Output, with `attrs.output_dims`.
        y: TensorId,
        /// Operator and output dims.
        attrs: ReductionAttrs,
    },
    /// Per-channel Σx and Σx².
    GenStats {
        /// Input.
        x: TensorId,
        /// Σx.
        sum: TensorId,
        /// Σx².
        sq_sum: TensorId,
    },
    /// BN finalize: statistics → equivalent scale/bias, saved stats, running stats.
    BnFinalize {
        /// Inputs.
        inputs: BnFinalizeInputs,
        /// Outputs.
        outputs: BnFinalizeOutputs,
    },
    /// BN backward weights.
    DbnWeight {
        /// Inputs.
        inputs: DbnWeightInputs,
        /// Outputs.
        outputs: DbnWeightOutputs,
    },
    /// Plain batch-norm forward, training phase.
    BatchNorm {
        /// Inputs.
        inputs: BatchNormInputs,
        /// Outputs.
        outputs: BatchNormOutputs,
    },
    /// Plain batch-norm backward.
    BatchNormBackward {
        /// Inputs.
        inputs: BatchNormBackwardInputs,
        /// Outputs.
        outputs: BatchNormBackwardOutputs,
    },
}

impl Node {
    /// Short kind name for signatures and messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Node::ConvFprop { .. } => "conv_fprop",
            Node::ConvDgrad { .. } => "conv_dgrad",
            Node::ConvWgrad { .. } => "conv_wgrad",
            Node::Pointwise { .. } => "pointwise",
            Node::Reduction { .. } => "reduction",
            Node::GenStats { .. } => "genstats",
            Node::BnFinalize { .. } => "bn_finalize",
            Node::DbnWeight { .. } => "dbn_weight",
            Node::BatchNorm { .. } => "batchnorm",
            Node::BatchNormBackward { .. } => "batchnorm_backward",
        }
    }

    /// Input tensors, in a fixed order.
    pub fn inputs(&self) -> Vec<TensorId> {
        match self {
            Node::ConvFprop { x, w, .. } => vec![*x, *w],
            Node::ConvDgrad { dy, w, .. } => vec![*dy, *w],
            Node::ConvWgrad { x, dy, .. } => vec![*x, *dy],
            Node::Pointwise { inputs, .. } => inputs.clone(),
            Node::Reduction { x, .. } => vec![*x],
            Node::GenStats { x, .. } => vec![*x],
            Node::BnFinalize { inputs: i, .. } => vec![
                i.sum,
                i.sq_sum,
                i.scale,
                i.bias,
                i.prev_running_mean,
                i.prev_running_var,
                i.epsilon,
                i.momentum,
                i.accum_count,
            ],
            Node::DbnWeight { inputs: i, .. } => vec![i.x, i.mean, i.inv_std, i.scale, i.dy],
            Node::BatchNorm { inputs: i, .. } => {
                let mut v = vec![i.x, i.scale, i.bias, i.epsilon, i.momentum];
                v.extend(i.prev_running_mean);
                v.extend(i.prev_running_var);
                v
            }
            Node::BatchNormBackward { inputs: i, .. } => {
                vec![i.dy, i.x, i.scale, i.mean, i.inv_variance]
            }
        }
    }

    /// Output tensors, in a fixed order.
    pub fn outputs(&self) -> Vec<TensorId> {
        match self {
            Node::ConvFprop { y, .. } => vec![*y],
            Node::ConvDgrad { dx, .. } => vec![*dx],
            Node::ConvWgrad { dw, .. } => vec![*dw],
            Node::Pointwise { y, .. } => vec![*y],
            Node::Reduction { y, .. } => vec![*y],
            Node::GenStats { sum, sq_sum, .. } => vec![*sum, *sq_sum],
            Node::BnFinalize { outputs: o, .. } => vec![
                o.eq_scale,
                o.eq_bias,
                o.saved_mean,
                o.saved_inv_std,
                o.updated_running_mean,
                o.updated_running_var,
            ],
            Node::DbnWeight { outputs: o, .. } => {
                vec![o.dscale, o.dbias, o.eq_dy_scale, o.eq_x_scale, o.eq_bias]
            }
            Node::BatchNorm { outputs: o, .. } => {
                let mut v = vec![o.y, o.mean, o.inv_variance];
                v.extend(o.next_running_mean);
                v.extend(o.next_running_var);
                v
            }
            Node::BatchNormBackward { outputs: o, .. } => vec![o.dx, o.dscale, o.dbias],
        }
    }

    /// The attributes that enter the signature (geometry, mode, alphas).
    pub(crate) fn attr_signature(&self) -> String {
        match self {
            Node::ConvFprop { attrs, .. }
            | Node::ConvDgrad { attrs, .. }
            | Node::ConvWgrad { attrs, .. } => format!(
                "pad{:?}{:?}s{:?}d{:?}",
                attrs.pre_padding, attrs.post_padding, attrs.stride, attrs.dilation
            ),
            Node::Pointwise { attrs, .. } => format!(
                "{}a{:08x}b{:08x}",
                attrs.mode.name(),
                attrs.alpha1.to_bits(),
                attrs.alpha2.to_bits()
            ),
            // The output dims are in the output tensor's signature already.
            Node::Reduction { attrs, .. } => attrs.mode.name().to_string(),
            _ => String::new(),
        }
    }
}
