//! Tier 1: the sync-free step on the CPU executor.
//!
//! - Overflow injection: 50 steps with NaN/Inf planted at chosen steps skip exactly those
//!   steps, leave W, M, A, E and E16 bit-identical across each skipped step, and move the
//!   loss scale exactly as the fixed policy (8192, 4096, … floored at 1) or the growth rule
//!   says (the expected traces come from a few lines of arithmetic here, not from the crate).
//! - Underflow: why the loss scale exists — small gradients stored in FP16 survive with it
//!   and are lost (rounded away or to nothing) without it.
//! - The schedule: which ranges `finish` covers, in which order; capture/replay equals eager;
//!   stale and foreign graphs are refused; bad configurations are typed errors.

use std::collections::BTreeSet;

use cudnn_cbr_amp::plan::{ByteRange, MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{
    f32_to_f16, LossScalePolicy, OverflowPolicy, Scalars, ScaleGrowth, SgdConfig,
    DEFAULT_INIT_SCALE,
};
use cudnn_cbr_amp::step::{AmpExecutor, AmpStep, CpuRegions, RangeOp, StepConfig};
use cudnn_cbr_amp::{AmpError, ExecError, PlanError, RangeOpError};
use half::f16;

mod clip_norm;
#[path = "../common/mod.rs"]
mod common;
mod overflow;
mod schedule;
mod underflow;
use common::Rng;

// ---------------------------------------------------------------- helpers

/// Two buckets, conv/BN/FC parameters, momentum and EMA regions.
fn small_plan(ema: bool) -> MemoryPlan {
    let mut b = MemoryPlanBuilder::new().with_ema(ema);
    let first = b.bucket("first").unwrap();
    let deep = b.bucket("deep").unwrap();
    b.add("conv1.w", ParamKind::ConvWeight, &[8, 3, 3, 3], first)
        .unwrap();
    b.add("bn1.gamma", ParamKind::BnGamma, &[8], first).unwrap();
    b.add("bn1.beta", ParamKind::BnBeta, &[8], first).unwrap();
    b.add("conv2.w", ParamKind::ConvWeight, &[16, 3, 3, 8], deep)
        .unwrap();
    b.add("bn2.gamma", ParamKind::BnGamma, &[16], deep).unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 16], deep).unwrap();
    b.add("fc.b", ParamKind::FcBias, &[10], deep).unwrap();
    b.finalize().unwrap()
}

/// Random master weights in every parameter's data (padding stays zero).
fn random_weights(regions: &mut CpuRegions, rng: &mut Rng) {
    let names: Vec<String> = regions
        .plan()
        .params()
        .iter()
        .map(|p| p.name().to_owned())
        .collect();
    for name in names {
        for w in regions.param_f32_mut(&name, Region::W).unwrap() {
            *w = 0.5 * rng.unit();
        }
    }
}

/// Where a poisoned step plants its bad value.
#[derive(Debug, Clone, Copy)]
enum Poison {
    /// +Inf in a conv wgrad (FP16, G16): the typical FP16 overflow.
    F16Inf,
    /// -Inf in an FC gradient written FP32 straight into G.
    F32NegInf,
    /// NaN in a BN gradient (FP32, G).
    F32Nan,
}

/// What backward would write at loss scale `scale`: conv wgrads FP16 into G16, the other
/// gradients FP32 into G, all multiplied by the scale; plus the poison, if any.
fn write_grads(regions: &mut CpuRegions, rng: &mut Rng, scale: f32, poison: Option<Poison>) {
    let params: Vec<(String, ParamKind)> = regions
        .plan()
        .params()
        .iter()
        .map(|p| (p.name().to_owned(), p.kind()))
        .collect();
    for (name, kind) in &params {
        if *kind == ParamKind::ConvWeight {
            for g in regions.param_f16_mut(name, Region::G16).unwrap() {
                *g = f32_to_f16(scale * rng.unit());
            }
        } else {
            for g in regions.param_f32_mut(name, Region::G).unwrap() {
                *g = scale * rng.unit();
            }
        }
    }
    match poison {
        None => {}
        Some(Poison::F16Inf) => {
            regions.param_f16_mut("conv2.w", Region::G16).unwrap()[17] = f16::INFINITY
        }
        Some(Poison::F32NegInf) => {
            regions.param_f32_mut("fc.w", Region::G).unwrap()[3] = f32::NEG_INFINITY
        }
        Some(Poison::F32Nan) => {
            regions.param_f32_mut("bn1.gamma", Region::G).unwrap()[0] = f32::NAN
        }
    }
}

/// The bytes of the regions a skipped step must not touch.
fn optimizer_state(regions: &CpuRegions) -> Vec<(Region, Vec<u8>)> {
    [Region::W, Region::M, Region::A, Region::E, Region::E16]
        .into_iter()
        .filter(|&r| regions.plan().has_region(r))
        .map(|r| (r, regions.region_bytes(r).unwrap()))
        .collect()
}

fn all_bytes(regions: &CpuRegions) -> Vec<(Region, Vec<u8>)> {
    Region::ALL
        .into_iter()
        .filter(|&r| regions.plan().has_region(r))
        .map(|r| (r, regions.region_bytes(r).unwrap()))
        .collect()
}

/// What the run observed.
struct Run {
    /// Loss scale in effect at each step (read before it).
    trace: Vec<f32>,
    /// Steps whose `skipped` counter went up.
    skipped: BTreeSet<usize>,
    /// The scalars after the last step.
    last: Scalars,
}

/// 50 steps with the given poisoned steps; asserts the bit-identity of skipped steps and
/// that applied steps do move the weights.
fn run_50(config: StepConfig, poisoned: &[(usize, Poison)]) -> Run {
    let mut regions = CpuRegions::new(small_plan(config.ema_decay.is_some())).unwrap();
    let mut rng = Rng(0x5EED);
    random_weights(&mut regions, &mut rng);
    let mut step = AmpStep::new(regions, config).unwrap();
    step.init_weights().unwrap();
    let mut trace = Vec::new();
    let mut skipped = BTreeSet::new();
    step.request_scalars().unwrap();
    let mut before = step.poll_scalars().unwrap().expect("CPU snapshots at once");
    for t in 0..50 {
        let poison = poisoned.iter().find(|(s, _)| *s == t).map(|&(_, p)| p);
        trace.push(before.loss_scale);
        let state = optimizer_state(step.executor());
        step.begin().unwrap();
        write_grads(step.executor_mut(), &mut rng, before.loss_scale, poison);
        step.finish().unwrap();
        step.request_scalars().unwrap();
        let after = step.poll_scalars().unwrap().unwrap();
        assert_eq!(after.overflow, 0, "the update clears the flag (step {t})");
        if after.skipped == before.skipped + 1 {
            skipped.insert(t);
            assert_eq!(
                after.step, before.step,
                "a skipped step is not counted (step {t})"
            );
            for ((region, was), (_, now)) in state.iter().zip(optimizer_state(step.executor())) {
                assert!(
                    *was == now,
                    "step {t} was skipped but changed region {region}"
                );
            }
        } else {
            assert_eq!(after.skipped, before.skipped, "step {t}");
            assert_eq!(after.step, before.step + 1, "step {t}");
            let now = optimizer_state(step.executor());
            assert_ne!(state[0].1, now[0].1, "applied step {t} left W unchanged");
        }
        // The compute copy always equals the master weights rounded.
        let ex = step.executor();
        let w = ex.f32_region(Region::W).unwrap();
        let a = ex.f16_region(Region::A).unwrap();
        assert!(
            w.iter()
                .zip(a)
                .all(|(w, a)| f32_to_f16(*w).to_bits() == a.to_bits()),
            "A != f16(W) after step {t}"
        );
        before = after;
    }
    Run {
        trace,
        skipped,
        last: before,
    }
}

fn poison_schedule(steps: &[usize]) -> Vec<(usize, Poison)> {
    let kinds = [Poison::F16Inf, Poison::F32NegInf, Poison::F32Nan];
    steps
        .iter()
        .enumerate()
        .map(|(i, &s)| (s, kinds[i % kinds.len()]))
        .collect()
}
