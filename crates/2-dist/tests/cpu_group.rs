//! The in-process data-parallel group: results, order, failures (a peer that leaves, panics
//! or goes silent: an error, never a hang).

use std::thread;
use std::time::{Duration, Instant};

use cudnn_cbr_dist::cpu::{CpuComm, CpuGroup};
use cudnn_cbr_dist::{Collective, Communicator, DistError, ReduceOp};
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
