//! Our own kernels for a layer's element-wise steps: the BN apply with its residual forms,
//! the ReLU backward, the dBN apply, the per-channel statistics of a stored conv output, and
//! a BN backward's weight gradients and dBN-apply coefficients (`kernel_source.cu`).
//!
//! cuDNN runs these as runtime-compiled pointwise graphs: NVRTC once per *shape*, about
//! 0.5–0.9 s each on 2 cores, which is most of a network's cold planning time. Ours take the
//! shape as arguments, so one module is compiled once per *architecture* (and kept in the
//! disk [`cudnn_cbr_runtime::kernel_cache`]). They compute what the cuDNN graphs and the CPU
//! reference ops compute, in the same op order with one FP16 rounding per output, and run wherever a
//! planned layer has such a step ([`Pointwise::Own`], the default). [`Pointwise::Cudnn`]
//! (`CUDNN_CBR_POINTWISE=cudnn`) plans cuDNN's graphs instead: the parity reference.

mod launch;
mod module;
mod step;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;

pub use launch::{
    bn_eval_launch, check_args, dbn_coefficients_launch, BnEvalBuffers, KernelArg, Launch,
};
pub(crate) use launch::{launch_bn_eval, launch_dbn_coefficients};
pub use module::{arch_for, compile, compile_uncached, prepare, Compiled};
pub use step::KernelStep;

use super::graphs::ApplyResidual;
use crate::error::{Error, Result};
use crate::graph::{DataType, Graph};

/// The CUDA source of every kernel here.
pub const SOURCE: &str = include_str!("../kernel_source.cu");

/// The variable that chooses who runs the element-wise steps ([`Pointwise::from_env`]).
pub const POINTWISE_ENV: &str = "CUDNN_CBR_POINTWISE";

/// Who runs a layer's element-wise steps on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Pointwise {
    /// Our kernels (compiled once per architecture) where a step has one; cuDNN's graphs for
    /// the rest, and for all of them where NVRTC cannot be loaded or the architecture has no
    /// machine-code target here.
    #[default]
    Own,
    /// cuDNN's runtime-compiled graphs everywhere (the parity reference).
    Cudnn,
}

impl Pointwise {
    /// From [`POINTWISE_ENV`]: `cudnn`, or `own` / unset / empty for [`Pointwise::Own`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the variable for any other value.
    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var(POINTWISE_ENV).ok().as_deref())
    }

    /// As [`Pointwise::from_env`], from the variable's value.
    ///
    /// # Errors
    /// As [`Pointwise::from_env`].
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("" | "own") => Ok(Pointwise::Own),
            Some("cudnn") => Ok(Pointwise::Cudnn),
            Some(other) => Err(Error::InvalidConfig {
                layer: "every layer".into(),
                field: POINTWISE_ENV.into(),
                problem: format!("is `{other}`; expected `own` or `cudnn`"),
            }),
        }
    }
}

/// One of our element-wise kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OwnKernel {
    /// `a = relu(y·s + b [+ r | + r·s2 + b2])`: the graphs of [`super::graphs::apply`].
    Apply(ApplyResidual),
    /// `dx = dy` where `x > 0`, else 0: [`super::graphs::relu_backward`].
    ReluBackward,
    /// `dy_prev = dz·A + y_prev·B + C`: [`super::graphs::dbn_apply`].
    DbnApply,
    /// Per-channel `Σy` and `Σy²` in FP32: [`super::graphs::channel_stats`].
    ChannelStats,
    /// A BN's `dγ = Σ dz·x̂` and `dβ = Σ dz` in FP32: [`super::graphs::dbn_reduce`].
    DbnReduce,
    /// The dBN-apply coefficients A, B, C from `dγ`, `dβ`: [`super::graphs::dbn_coefficients`].
    DbnCoefficients,
    /// Evaluation-mode BN of the unfused route, `((y − μ)·inv_std)·γ + β` in FP32 from the
    /// running statistics, then the layer's residual and ReLU (or neither, for `y_bn`): no
    /// graph of its own; launched directly by [`bn_eval_launch`].
    BnEval,
}

/// What [`OwnKernel::BnEval`] writes after the BN: the unfused route's BN output `y_bn` (no
/// ReLU), or its activation with each residual form (the [`ApplyResidual`] of the layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnEvalOutput {
    /// `y_bn = bn(y)`.
    BnOnly,
    /// `a = relu(bn(y) [+ r | + r·s2 + b2])`.
    Activation(ApplyResidual),
}

impl BnEvalOutput {
    /// The kernel's `mode` argument.
    fn mode(self) -> i32 {
        match self {
            BnEvalOutput::BnOnly => 0,
            BnEvalOutput::Activation(ApplyResidual::None) => 1,
            BnEvalOutput::Activation(ApplyResidual::Add) => 2,
            BnEvalOutput::Activation(ApplyResidual::DualScaleBias) => 3,
        }
    }
}

/// A kernel argument: a graph tensor (by name), the element type the kernel reads, and its
/// size: the full tensor, one value per channel, or one by-value FP32 scalar.
struct Param {
    name: &'static str,
    dtype: DataType,
    size: Size,
}

#[derive(Clone, Copy, PartialEq)]
enum Size {
    Full,
    PerChannel,
    Scalar,
}

const fn full(name: &'static str) -> Param {
    Param {
        name,
        dtype: DataType::Half,
        size: Size::Full,
    }
}

const fn vector(name: &'static str, dtype: DataType) -> Param {
    Param {
        name,
        dtype,
        size: Size::PerChannel,
    }
}

const fn scalar(name: &'static str) -> Param {
    Param {
        name,
        dtype: DataType::Float,
        size: Size::Scalar,
    }
}

impl OwnKernel {
    /// Every kernel.
    pub const ALL: [OwnKernel; 9] = [
        OwnKernel::Apply(ApplyResidual::None),
        OwnKernel::Apply(ApplyResidual::Add),
        OwnKernel::Apply(ApplyResidual::DualScaleBias),
        OwnKernel::ReluBackward,
        OwnKernel::DbnApply,
        OwnKernel::ChannelStats,
        OwnKernel::DbnReduce,
        OwnKernel::DbnCoefficients,
        OwnKernel::BnEval,
    ];

    /// The kernel that computes `graph`, by the graph's name (the builders in
    /// [`super::graphs`] name each form), or `None`.
    pub fn for_graph(graph: &Graph) -> Option<Self> {
        Some(match graph.name() {
            "scale_bias_relu" => OwnKernel::Apply(ApplyResidual::None),
            "scale_bias_add_relu" => OwnKernel::Apply(ApplyResidual::Add),
            "dual_scale_bias_add_relu" => OwnKernel::Apply(ApplyResidual::DualScaleBias),
            "relu_backward" => OwnKernel::ReluBackward,
            "dbn_apply" => OwnKernel::DbnApply,
            "channel_stats" => OwnKernel::ChannelStats,
            "dbn_reduce" => OwnKernel::DbnReduce,
            "dbn_coefficients" => OwnKernel::DbnCoefficients,
            _ => return None,
        })
    }

    /// Whether it reduces over the tensor into per-channel sums (shared-memory accumulators,
    /// added into its outputs).
    fn reduces(self) -> bool {
        matches!(self, OwnKernel::ChannelStats | OwnKernel::DbnReduce)
    }

    /// The kernel's entry point in [`SOURCE`].
    pub fn entry(self) -> &'static str {
        match self {
            OwnKernel::Apply(ApplyResidual::None) => "cbr_apply_relu",
            OwnKernel::Apply(ApplyResidual::Add) => "cbr_apply_add_relu",
            OwnKernel::Apply(ApplyResidual::DualScaleBias) => "cbr_apply_dual_relu",
            OwnKernel::ReluBackward => "cbr_relu_backward",
            OwnKernel::DbnApply => "cbr_dbn_apply",
            OwnKernel::ChannelStats => "cbr_channel_stats",
            OwnKernel::DbnReduce => "cbr_dbn_reduce",
            OwnKernel::DbnCoefficients => "cbr_dbn_coefficients",
            OwnKernel::BnEval => "cbr_bn_eval",
        }
    }

    /// The inputs in the kernel's argument order (the output follows them).
    fn params(self) -> &'static [Param] {
        const H: DataType = DataType::Half;
        const F: DataType = DataType::Float;
        const APPLY: &[Param] = &[full("Y"), vector("scale", H), vector("bias", H)];
        const APPLY_ADD: &[Param] = &[full("Y"), full("R"), vector("scale", H), vector("bias", H)];
        const APPLY_DUAL: &[Param] = &[
            full("Y"),
            full("R"),
            vector("scale", H),
            vector("bias", H),
            vector("scale2", H),
            vector("bias2", H),
        ];
        const RELU_BACKWARD: &[Param] = &[full("dA"), full("X")];
        const STATS: &[Param] = &[full("Y")];
        const DBN_REDUCE: &[Param] = &[
            full("Y"),
            full("dZ"),
            vector("mean", F),
            vector("inv_std", F),
        ];
        const DBN_COEFFICIENTS: &[Param] = &[
            vector("gamma", F),
            vector("inv_std", F),
            vector("mean", F),
            vector("dgamma", F),
            vector("dbeta", F),
            scalar("neg_inv_count"),
        ];
        const DBN_APPLY: &[Param] = &[
            full("dZ"),
            full("Yprev"),
            vector("A", F),
            vector("B", F),
            vector("C", F),
        ];
        const BN_EVAL: &[Param] = &[
            full("Y"),
            full("R"),
            vector("mean", F),
            vector("inv_std", F),
            vector("gamma", F),
            vector("beta", F),
            vector("scale2", H),
            vector("bias2", H),
        ];
        match self {
            OwnKernel::Apply(ApplyResidual::None) => APPLY,
            OwnKernel::Apply(ApplyResidual::Add) => APPLY_ADD,
            OwnKernel::Apply(ApplyResidual::DualScaleBias) => APPLY_DUAL,
            OwnKernel::ReluBackward => RELU_BACKWARD,
            OwnKernel::DbnApply => DBN_APPLY,
            OwnKernel::ChannelStats => STATS,
            OwnKernel::DbnReduce => DBN_REDUCE,
            OwnKernel::DbnCoefficients => DBN_COEFFICIENTS,
            OwnKernel::BnEval => BN_EVAL,
        }
    }
}

fn kernel_error(kernel: OwnKernel, problem: String) -> Error {
    Error::Kernel {
        kernel: kernel.entry().into(),
        problem,
    }
}
