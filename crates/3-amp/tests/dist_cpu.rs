//! The CPU step's collectives over the in-process data-parallel group: the gradient
//! all-reduce, the weights' broadcast and the shared overflow verdict (the group itself is
//! tested in crates/2-dist/tests/cpu_group.rs).

use std::sync::Arc;
use std::thread;

use cudnn_cbr_amp::dist::grads::{all_reduce_gradients, all_reduce_overflow, broadcast_weights};
use cudnn_cbr_amp::plan::{MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{Scalars, SgdConfig};
use cudnn_cbr_amp::step::{AmpStep, CpuRegions, StepConfig};
use cudnn_cbr_amp::AmpError;
use cudnn_cbr_dist::cpu::{CpuComm, CpuGroup};
use cudnn_cbr_dist::Communicator;
use half::f16;

/// Runs `f(comm)` on every rank of a fresh group, each on its own thread; results by rank.
fn on_ranks<R: Send>(comms: Vec<CpuComm>, f: impl Fn(CpuComm) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Two buckets: conv + BN in `first`, conv + BN + FC in `deep`.
fn plan() -> Arc<MemoryPlan> {
    let mut b = MemoryPlanBuilder::new();
    let first = b.bucket("first").unwrap();
    let deep = b.bucket("deep").unwrap();
    b.add("c1.w", ParamKind::ConvWeight, &[4, 3, 3, 2], first)
        .unwrap();
    b.add("c1.gamma", ParamKind::BnGamma, &[4], first).unwrap();
    b.add("c2.w", ParamKind::ConvWeight, &[3, 1, 1, 4], deep)
        .unwrap();
    b.add("c2.beta", ParamKind::BnBeta, &[3], deep).unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[2, 3], deep).unwrap();
    b.add("fc.b", ParamKind::FcBias, &[2], deep).unwrap();
    Arc::new(b.finalize().unwrap())
}

/// Rank `r`'s gradients: conv weights in G16, the rest in G, each element distinct.
fn fill_grads(regions: &mut CpuRegions, r: usize) {
    let plan = regions.plan_arc().clone();
    for p in plan.params() {
        let v = |i: usize| (r * 1000 + p.plan_index() * 37 + i) as f32 * 0.125;
        if p.kind() == ParamKind::ConvWeight {
            for (i, x) in regions
                .param_f16_mut(p.name(), Region::G16)
                .unwrap()
                .iter_mut()
                .enumerate()
            {
                *x = f16::from_f32(v(i));
            }
        } else {
            for (i, x) in regions
                .param_f32_mut(p.name(), Region::G)
                .unwrap()
                .iter_mut()
                .enumerate()
            {
                *x = v(i);
            }
        }
    }
}

#[test]
fn the_gradient_all_reduce_sums_every_parameter_and_nothing_else() {
    let plan = plan();
    let ranks = 3;
    let out = on_ranks(CpuGroup::ranks(ranks).unwrap(), |mut c| {
        let mut regions = CpuRegions::new(plan.clone()).unwrap();
        fill_grads(&mut regions, c.rank());
        // The conv slots of G hold stale values the cast will overwrite: not sent.
        regions.param_f32_mut("c2.w", Region::G).unwrap()[0] = c.rank() as f32;
        all_reduce_gradients(&mut regions, &mut c).unwrap();
        regions
    });
    let mut expected: Vec<CpuRegions> = (0..ranks)
        .map(|r| {
            let mut g = CpuRegions::new(plan.clone()).unwrap();
            fill_grads(&mut g, r);
            g
        })
        .collect();
    let sum = expected.remove(0);
    for p in plan.params() {
        if p.kind() == ParamKind::ConvWeight {
            let want: Vec<f32> = (0..p.elems())
                .map(|i| {
                    let mut acc = sum.param_f16(p.name(), Region::G16).unwrap()[i];
                    for e in &expected {
                        acc = f16::from_f32(
                            acc.to_f32() + e.param_f16(p.name(), Region::G16).unwrap()[i].to_f32(),
                        );
                    }
                    acc.to_f32()
                })
                .collect();
            for (r, regions) in out.iter().enumerate() {
                let got: Vec<f32> = regions
                    .param_f16(p.name(), Region::G16)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                assert_eq!(got, want, "{} on rank {r}", p.name());
            }
        } else {
            let want: Vec<f32> = (0..p.elems())
                .map(|i| {
                    let mut acc = sum.param_f32(p.name(), Region::G).unwrap()[i];
                    for e in &expected {
                        acc += e.param_f32(p.name(), Region::G).unwrap()[i];
                    }
                    acc
                })
                .collect();
            for regions in &out {
                assert_eq!(
                    regions.param_f32(p.name(), Region::G).unwrap(),
                    &want[..],
                    "{}",
                    p.name()
                );
            }
        }
    }
    for (r, regions) in out.iter().enumerate() {
        assert_eq!(
            regions.param_f32("c2.w", Region::G).unwrap()[0],
            r as f32,
            "G's conv slots stay local"
        );
    }
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    let plan = plan();
    let out = on_ranks(CpuGroup::ranks(2).unwrap(), |mut c| {
        let mut regions = CpuRegions::new(plan.clone()).unwrap();
        for (i, w) in regions
            .f32_region_mut(Region::W)
            .unwrap()
            .iter_mut()
            .enumerate()
        {
            *w = (i % 7) as f32 * 0.1 + c.rank() as f32; // ranks start apart
        }
        broadcast_weights(&mut regions, &mut c).unwrap();
        let mut step = AmpStep::new(regions, StepConfig::new(SgdConfig::new(0.1))).unwrap();
        step.init_weights().unwrap();
        step.set_ranks(2).unwrap();
        let w0 = step.executor().f32_region(Region::W).unwrap().to_vec();
        step.begin().unwrap();
        fill_grads(step.executor_mut(), c.rank());
        // Only rank 1 overflows, and its gradients are not summed into rank 0's here: the
        // shared flag alone must make rank 0 skip.
        if c.rank() == 1 {
            step.executor_mut()
                .param_f32_mut("fc.b", Region::G)
                .unwrap()[1] = f32::NAN;
        }
        step.finish_with(|r| all_reduce_overflow(r, &mut c))
            .unwrap();
        let s = step.executor().scalars();
        (
            w0,
            step.executor().f32_region(Region::W).unwrap().to_vec(),
            s,
        )
    });
    assert_eq!(out[0].0, out[1].0, "rank 0's weights were broadcast");
    for (w0, w1, s) in out {
        assert_eq!(w0, w1, "the step was skipped");
        assert_eq!(s.skipped, 1);
        assert_eq!(s.loss_scale, 4096.0);
    }
}

#[test]
fn ranks_in_s_average_the_sums_in_the_unscale() {
    let s = Scalars::default();
    assert_eq!(s.ranks, 1);
    assert_eq!(s.unscale().to_bits(), (1.0f32 / 8192.0).to_bits());
    let zero = Scalars { ranks: 0, ..s };
    assert_eq!(
        zero.unscale().to_bits(),
        s.unscale().to_bits(),
        "0 reads as one rank"
    );
    let four = Scalars { ranks: 4, ..s };
    assert_eq!(four.unscale(), 1.0 / 32768.0);
    assert_eq!(Scalars::from_bytes(&four.to_bytes()).unwrap().ranks, 4);
    // set_ranks: 0 is refused; the SGD step of a 2-rank sum equals one rank's mean.
    let mut step = AmpStep::new(
        CpuRegions::new(plan()).unwrap(),
        StepConfig::new(SgdConfig::new(1.0)),
    )
    .unwrap();
    assert!(matches!(step.set_ranks(0), Err(AmpError::RangeOp(_))));
    step.set_ranks(2).unwrap();
    step.begin().unwrap();
    step.executor_mut()
        .param_f32_mut("fc.b", Region::G)
        .unwrap()[0] = 2.0 * 8192.0 * 0.25;
    step.finish().unwrap();
    assert_eq!(
        step.executor().param_f32("fc.b", Region::W).unwrap()[0],
        -0.25
    );
}
