//! A compiled network's parameters in the amp memory plan, and their initial values: what a
//! trainer needs to put a [`CompiledNet`] under the amp step.
//!
//! Every conv layer `{layer}` has `{layer}.w` (KRSC, [`ParamKind::ConvWeight`]),
//! `{layer}.gamma` and `{layer}.beta`; the head has `fc.w` (`[classes, features]`) and `fc.b`.
//! [`crate::net::cuda::param_slot`] maps the network's parameter buffers to these slots (the
//! names from one table, `src/net/layer_params.rs`).

use super::compile::{BufferRole, CompiledNet};
use super::layer_params::LayerParam;
use super::liveness::lifetimes;
use crate::amp::plan::{MemoryPlan, MemoryPlanBuilder, ParamKind};
use crate::amp::PlanError;

/// The memory plan of `net`'s parameters and an FC head of `classes` outputs: every conv's
/// weight, γ and β (the stem and the first stage in bucket `first`, the rest in `deep`, so the
/// deep layers' gradients form their own bucket), then the FC weight and bias.
///
/// # Errors
/// A [`PlanError`] naming the parameter, or [`PlanError::HeadClasses`] when `classes` is not
/// the spec's.
pub fn memory_plan(net: &CompiledNet, classes: usize) -> Result<MemoryPlan, PlanError> {
    memory_plan_of(net, classes, PlanContents::default())
}

/// What a network's memory plan holds besides its parameters ([`memory_plan_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanContents {
    /// The EMA regions E and E16 ([`memory_plan_with_ema`]).
    pub ema: bool,
    /// The network's step-long buffers in the liveness-planned tensor arena
    /// ([`memory_plan_with_buffers`]).
    pub buffers: bool,
}

/// The memory plan of `net`'s parameters and an FC head of `classes` outputs, with what
/// `contents` asks for.
///
/// # Errors
/// As [`memory_plan`] and [`memory_plan_with_buffers`].
pub fn memory_plan_of(
    net: &CompiledNet,
    classes: usize,
    contents: PlanContents,
) -> Result<MemoryPlan, PlanError> {
    let mut b = builder(net, classes)?.with_ema(contents.ema);
    if contents.buffers {
        let live = lifetimes(net).map_err(|e| PlanError::Invariant {
            name: net.spec.name.clone(),
            what: format!("buffer lifetimes: {e}"),
        })?;
        for (id, buf) in net.buffers.iter().enumerate() {
            if in_arena(net, id) {
                b.add_tensor_live(&buf.name, buf.dtype, buf.elems, live[id])?;
            }
        }
    }
    b.finalize()
}

/// [`memory_plan`] with the EMA regions E (FP32) and E16 (FP16) allocated: the plan of a step
/// with an EMA of the weights ([`crate::amp::step::StepConfig::with_ema`]).
///
/// # Errors
/// As [`memory_plan`].
pub fn memory_plan_with_ema(net: &CompiledNet, classes: usize) -> Result<MemoryPlan, PlanError> {
    memory_plan_of(
        net,
        classes,
        PlanContents {
            ema: true,
            buffers: false,
        },
    )
}

/// The builder of [`memory_plan`], its parameters registered.
fn builder(net: &CompiledNet, classes: usize) -> Result<MemoryPlanBuilder, PlanError> {
    if classes != net.spec.classes {
        return Err(PlanError::HeadClasses {
            net: net.spec.name.clone(),
            spec: net.spec.classes,
            head: classes,
        });
    }
    let mut b = MemoryPlanBuilder::new();
    let first = b.bucket("first")?;
    let deep = b.bucket("deep")?;
    for (name, s) in net.conv_shapes() {
        let bucket = if name == "stem" || name.starts_with("s0.") {
            first
        } else {
            deep
        };
        let (k, c, r) = (s.k as usize, s.c as usize, s.r as usize);
        for p in LayerParam::ALL {
            let (kind, dims) = match p {
                LayerParam::Weight => (ParamKind::ConvWeight, vec![k, r, r, c]),
                LayerParam::Gamma => (ParamKind::BnGamma, vec![k]),
                LayerParam::Beta => (ParamKind::BnBeta, vec![k]),
            };
            b.add(&p.name(&name), kind, &dims, bucket)?;
        }
    }
    b.add("fc.w", ParamKind::FcWeight, &[classes, net.features], deep)?;
    b.add("fc.b", ParamKind::FcBias, &[classes], deep)?;
    Ok(b)
}

/// [`memory_plan`] with the network's step-long buffers in the plan's tensor arena
/// (activations, their gradients, batch statistics and coefficients), each registered with its
/// lifetime over the training step ([`super::liveness::lifetimes`]) so that buffers never
/// alive together share bytes. The input, the output and its gradient (the caller's and the
/// head's) and the running statistics (kept from step to step, read by checkpoints) stay
/// allocations of the network's own. A [`crate::net::CudaNet`] made with this plan allocates
/// only those; its passes borrow the rest from the amp regions.
///
/// # Errors
/// As [`memory_plan`]; [`PlanError::Invariant`] naming a buffer a layer's graph binds but the
/// compiled network lacks (a compiler defect).
pub fn memory_plan_with_buffers(
    net: &CompiledNet,
    classes: usize,
) -> Result<MemoryPlan, PlanError> {
    memory_plan_of(
        net,
        classes,
        PlanContents {
            ema: false,
            buffers: true,
        },
    )
}

/// Whether [`memory_plan_with_buffers`] puts buffer `id` in the tensor arena.
pub fn in_arena(net: &CompiledNet, id: usize) -> bool {
    let head_facing = [net.input, net.output, net.output_grad].contains(&id);
    let own = matches!(
        net.buffers[id].role,
        BufferRole::Param | BufferRole::ParamGrad | BufferRole::Running
    );
    !head_facing && !own
}

/// Initial master weights for [`memory_plan`]'s FP32 region W, as (parameter, values):
/// He-uniform convs, γ = 1 (β and the FC bias stay at the region's zeros), a uniform FC
/// weight in ±1/√features. One random stream from `seed`, in this order, so every executor
/// starts from the same weights.
pub fn initial_weights(net: &CompiledNet, classes: usize, seed: u64) -> Vec<(String, Vec<f32>)> {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let shapes = net.conv_shapes();
    let mut out = Vec::with_capacity(2 * shapes.len() + 1);
    for (name, s) in shapes {
        let bound = (6.0 / (s.c * s.r * s.s) as f32).sqrt();
        let n = (s.k * s.c * s.r * s.s) as usize;
        out.push((
            LayerParam::Weight.name(&name),
            (0..n).map(|_| bound * uniform(&mut rng)).collect(),
        ));
        out.push((LayerParam::Gamma.name(&name), vec![1.0; s.k as usize]));
    }
    let fc_bound = 1.0 / (net.features as f32).sqrt();
    out.push((
        "fc.w".into(),
        (0..classes * net.features)
            .map(|_| fc_bound * uniform(&mut rng))
            .collect(),
    ));
    out
}

/// splitmix64: small, fast, deterministic (the initializer's random stream).
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in [-1, 1) from [`splitmix`].
pub fn uniform(state: &mut u64) -> f32 {
    ((splitmix(state) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}
