//! Tier 1: every range op's CPU twin against a naive definition, the flag-skip and clip
//! semantics, the loss-scale state machine, the S layout, and one whole step driven by a
//! memory plan over host copies of the regions.

use approx::assert_relative_eq;
use cudnn_cbr_amp::kernels::COMMON_HEADER;
use cudnn_cbr_amp::plan::{ByteRange, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{
    cast_f16_to_f32, check_and_clip, check_grads, check_nonfinite, ema_update, f32_to_f16,
    s_layout, sgd_step, softmax_xent_backward, update_loss_scale, zero_bytes, zero_f16, zero_f32,
    LossScalePolicy, OverflowPolicy, Scalars, ScaleUpdate, SgdConfig, StepOutcome,
    DEFAULT_INIT_SCALE, S_REGION_BYTES,
};
use cudnn_cbr_amp::RangeOpError;
use cudnn_cbr_runtime::DataType;
use half::f16;
use proptest::prelude::*;

/// The twin with `cfg`'s hyper-parameters written into S (where the step keeps them).
fn sgd(
    w: &mut [f32],
    m: Option<&mut [f32]>,
    g: &[f32],
    a: &mut [f16],
    s: &Scalars,
    cfg: &SgdConfig,
) -> Result<StepOutcome, RangeOpError> {
    sgd_step(w, m, g, a, &s.with_sgd(cfg), cfg.nesterov)
}

/// 64 cases to keep the suite fast; `PROPTEST_CASES=5000` for a stress run.
fn small_config() -> ProptestConfig {
    let default = ProptestConfig::default();
    ProptestConfig {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            default.cases
        } else {
            64
        },
        failure_persistence: None,
        ..default
    }
}

/// Finite values of mixed magnitudes, as gradients and weights tend to be.
fn finite_vec(len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![-1.0f32..1.0, -1e4f32..1e4, (-1e-6f32..1e-6), Just(0.0f32),],
        len,
    )
}

mod check_clip;
mod ema;
mod loss_scale;
mod loss_seed;
mod scalars;
mod sgd;
mod whole_step;
mod zero;
