//! The in-process data-parallel group and the CPU step's collectives: results, order,
//! failures (a peer that leaves, panics or goes silent: an error, never a hang).

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use cudnn_cbr_amp::dist::cpu::{CpuComm, CpuGroup};
use cudnn_cbr_amp::dist::grads::{all_reduce_gradients, all_reduce_overflow, broadcast_weights};
use cudnn_cbr_amp::dist::{Collective, Communicator, DistError, ReduceOp};
use cudnn_cbr_amp::plan::{MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{Scalars, SgdConfig};
use cudnn_cbr_amp::step::{AmpStep, CpuRegions, StepConfig};
use cudnn_cbr_amp::AmpError;
use half::f16;

/// Runs `f(comm)` on every rank of a fresh group, each on its own thread; results by rank.
fn on_ranks<R: Send>(comms: Vec<CpuComm>, f: impl Fn(CpuComm) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn all_reduce_sums_in_rank_order_and_every_rank_gets_the_same_bits() {
    // Values whose f32 sum depends on the order: (1e8 + 1) - 1e8 + ... .
    let inputs = [vec![1e8f32, 0.5], vec![1.0, 0.25], vec![-1e8, 1e-8]];
    let mut expected = inputs[0].clone();
    for v in &inputs[1..] {
        for (e, x) in expected.iter_mut().zip(v) {
            *e += x;
        }
    }
    for _ in 0..5 {
        let out = on_ranks(CpuGroup::ranks(3).unwrap(), |mut c| {
            let mut v = inputs[c.rank()].clone();
            c.all_reduce(&mut v[..], ReduceOp::Sum).unwrap();
            v
        });
        for v in &out {
            assert_eq!(
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                expected.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "rank order 0, 1, 2 whatever thread arrives last"
            );
        }
    }
}

#[test]
fn max_broadcast_and_fp16_sums() {
    let out = on_ranks(CpuGroup::ranks(4).unwrap(), |mut c| {
        let r = c.rank();
        let mut flag = [u32::from(r == 2)];
        c.all_reduce(&mut flag[..], ReduceOp::Max).unwrap();
        let mut w = vec![r as f32; 3];
        c.broadcast(&mut w[..], 1).unwrap();
        // FP16 sum rounded after each addition: 2048 + 1 = 2048 in FP16 (ulp 2), four times.
        let mut h = [f16::from_f32(if r == 0 { 2048.0 } else { 1.0 })];
        c.all_reduce(&mut h[..], ReduceOp::Sum).unwrap();
        let mut d = [r as f64 * 0.5];
        c.all_reduce(&mut d[..], ReduceOp::Sum).unwrap();
        (flag[0], w, h[0].to_f32(), d[0])
    });
    for (flag, w, h, d) in out {
        assert_eq!(flag, 1);
        assert_eq!(w, vec![1.0; 3]);
        assert_eq!(
            h, 2048.0,
            "each partial sum rounded to FP16, as NCCL adds FP16"
        );
        assert_eq!(d, 3.0);
    }
}

#[test]
fn a_rank_that_leaves_fails_the_others_at_once() {
    let start = Instant::now();
    let out = on_ranks(CpuGroup::ranks(3).unwrap(), |mut c| {
        if c.rank() == 2 {
            c.fail("out of memory");
            return Ok(());
        }
        let mut v = [1.0f32];
        c.all_reduce(&mut v[..], ReduceOp::Sum)
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "no waiting for the timeout"
    );
    for r in [0, 1] {
        match &out[r] {
            Err(DistError::PeerFailed {
                rank: 2,
                me,
                reason,
                ..
            }) => {
                assert_eq!(*me, r);
                assert!(reason.contains("out of memory"), "{reason}");
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_dropped_or_panicking_rank_fails_the_others() {
    let comms = CpuGroup::ranks(2).unwrap();
    let out = thread::scope(|s| {
        let mut it = comms.into_iter();
        let (mut c0, c1) = (it.next().unwrap(), it.next().unwrap());
        let h = s.spawn(move || {
            let _c = c1;
            panic!("rank 1 dies");
        });
        assert!(h.join().is_err());
        let mut v = [0f32; 4];
        c0.all_reduce(&mut v[..], ReduceOp::Sum)
    });
    match out {
        Err(DistError::PeerFailed {
            rank: 1, reason, ..
        }) => {
            assert!(reason.contains("panicked"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_silent_rank_is_a_timeout_on_every_waiting_rank() {
    let timeout = Duration::from_millis(300);
    let comms = CpuGroup::ranks_with_timeout(3, timeout).unwrap();
    let start = Instant::now();
    let out = thread::scope(|s| {
        let mut hs = Vec::new();
        let mut silent = None;
        for c in comms {
            if c.rank() == 1 {
                silent = Some(c); // alive but never calls
                continue;
            }
            hs.push(s.spawn(move || {
                let mut c = c;
                let mut v = [1u32];
                c.all_reduce(&mut v[..], ReduceOp::Max)
            }));
        }
        let out: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        drop(silent);
        out
    });
    assert!(start.elapsed() < timeout * 10, "{:?}", start.elapsed());
    for r in out {
        match r {
            Err(DistError::Timeout { missing, .. }) => assert_eq!(missing, vec![1]),
            // The second waiter may see the first one's timeout as a failed group.
            Err(DistError::PeerFailed { reason, .. }) => assert!(reason.contains("timed out")),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn mismatched_collectives_are_an_error_on_every_rank() {
    let out = on_ranks(
        CpuGroup::ranks_with_timeout(2, Duration::from_secs(5)).unwrap(),
        |mut c| {
            let mut v = vec![0f32; 2 + c.rank()];
            c.all_reduce(&mut v[..], ReduceOp::Sum)
        },
    );
    for (r, res) in out.into_iter().enumerate() {
        match res {
            Err(DistError::Mismatch {
                me, mine, theirs, ..
            }) => {
                assert_eq!(me, r);
                assert!(mine.contains(&format!("[{}]", 2 + r)), "{mine}");
                assert!(theirs.contains(&format!("[{}]", 3 - r)), "{theirs}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn bad_groups_and_roots_are_typed_errors() {
    assert_eq!(CpuGroup::ranks(0).unwrap_err(), DistError::EmptyGroup);
    let mut c = CpuGroup::ranks(1).unwrap().pop().unwrap();
    let mut v = [1f32];
    assert!(matches!(
        c.broadcast(&mut v[..], 1),
        Err(DistError::InvalidRank {
            rank: 1,
            world: 1,
            ..
        })
    ));
    // One rank: collectives are the identity.
    c.all_reduce(&mut v[..], ReduceOp::Sum).unwrap();
    assert_eq!(v, [1.0]);
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
