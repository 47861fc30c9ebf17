//! Gradient accumulation through the classifier (`CpuClassifier::train_step` with
//! `StepConfig::with_accum(N)`): the gradient the step applies is the sum of the N
//! micro-batches' gradients, each from its own forward and backward pass (BN with that
//! micro-batch's statistics), data-parallel replicas accumulate as one classifier with
//! their whole batch, and a count other than N is a typed error. (The CUDA
//! classifier's accumulation: `tests/gpu_accumulation.rs`.)

mod common;

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::range::f16_to_f32;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::{
    amp::range::SgdConfig, amp::step::StepConfig, classifier::ClassifierError,
    classifier::CpuClassifier, net::compile, net::CompiledNet, net::Preset, net::RoutePolicy,
};
use half::f16;

const BATCH: usize = 4;
const HW: usize = 8;
const CLASSES: usize = 3;

fn net(kind: RouteKind) -> CompiledNet {
    let spec = Preset::Mini.spec(3, CLASSES, 4);
    compile(&spec, BATCH, HW, &RoutePolicy::Uniform(kind)).unwrap()
}

fn micro_batch(k: usize) -> (Vec<f16>, Vec<i32>) {
    common::micro_batch(k, BATCH, HW, CLASSES)
}

/// One micro-batch's FP32 gradient as the step sees it: G16 cast where G16 reaches (the conv
/// weights), plus G (BN and FC; zero at the conv slots).
fn gradient(model: &CpuClassifier) -> Vec<f32> {
    let ex = model.step().executor();
    let g = ex.f32_region(Region::G).unwrap();
    let g16 = ex.f16_region(Region::G16).unwrap();
    g.iter()
        .enumerate()
        .map(|(i, &x)| x + g16.get(i).map_or(0.0, |&h| f16_to_f32(h)))
        .collect()
}

/// The accumulated gradient equals the sum of N separate backward passes: bit for bit
/// against their FP32 sum in micro-batch order (the order the kernel adds in), and against
/// their exact sum in f64 within the bound of N − 1 FP32 additions,
/// `|fl(Σ) − Σ| ≤ γ_{N−1} · Σ|g_k|` with `γ_n = n·u / (1 − n·u)`, `u = 2^-24` (recursive
/// summation, Higham's "Accuracy and Stability of Numerical Algorithms", §4.2). On both
/// routes of the CPU executor.
#[test]
fn the_accumulated_gradient_is_the_sum_of_the_micro_batch_gradients() {
    const N: usize = 3;
    for kind in [RouteKind::Fused, RouteKind::Unfused] {
        let config = StepConfig::new(SgdConfig::new(0.05).with_momentum(0.9));
        let mut acc =
            CpuClassifier::new(net(kind), CLASSES, config.with_accum(N as u32), 9).unwrap();
        // The reference: the same weights, N separate passes, no update between them.
        let mut one = CpuClassifier::new(net(kind), CLASSES, config, 9).unwrap();
        let batches: Vec<(Vec<f16>, Vec<i32>)> = (0..N).map(micro_batch).collect();
        let mut grads = Vec::new();
        let mut want_metrics = Vec::new();
        for (images, labels) in &batches {
            one.step_mut().begin().unwrap();
            want_metrics.push(one.forward_backward(images, labels).unwrap());
            grads.push(gradient(&one));
        }
        let mut refs: Vec<(&[f16], &[i32])> = batches
            .iter()
            .map(|(i, l)| (i.as_slice(), l.as_slice()))
            .collect();
        let metrics = acc.train_step(&mut refs).unwrap();
        assert_eq!(metrics, want_metrics, "{kind:?}: per-micro-batch losses");
        // After the step G holds the sum SGD applied (the NaN/Inf check leaves it as is).
        let got = acc
            .step()
            .executor()
            .f32_region(Region::G)
            .unwrap()
            .to_vec();
        let f32_sum: Vec<f32> = (0..got.len())
            .map(|i| grads.iter().skip(1).fold(grads[0][i], |s, g| s + g[i]))
            .collect();
        assert!(got == f32_sum, "{kind:?}: not the FP32 sum in order");
        let u = f64::powi(2.0, -24);
        let gamma = (N - 1) as f64 * u / (1.0 - (N - 1) as f64 * u);
        let mut nonzero = 0;
        for (i, &x) in got.iter().enumerate() {
            let exact: f64 = grads.iter().map(|g| f64::from(g[i])).sum();
            let abs: f64 = grads.iter().map(|g| f64::from(g[i]).abs()).sum();
            assert!(
                (f64::from(x) - exact).abs() <= gamma * abs,
                "{kind:?}: element {i}: {x} vs {exact} (Σ|g| {abs})"
            );
            nonzero += usize::from(exact != 0.0);
        }
        assert!(
            nonzero > got.len() / 4,
            "{kind:?}: the gradients are mostly zero"
        );
        // GA is clear for the next step, and the step was applied once.
        let ex = acc.step().executor();
        assert!(ex.f32_region(Region::GA).unwrap().iter().all(|&x| x == 0.0));
        assert_eq!((ex.scalars().step, ex.scalars().accum), (1, N as u32));
    }
}

/// Micro-batches handed over one at a time (`train_micro_batch`, what a loop that makes them
/// on the fly calls) are the step `train_step` makes of them, bit for bit; its hook sees each
/// micro-batch's own gradient before it is added, and a hook that poisons it makes the step
/// skip; a micro-batch index past the step's count is a typed error before anything runs.
#[test]
fn micro_batches_one_at_a_time_are_the_whole_step() {
    const N: usize = 3;
    let config = StepConfig::new(SgdConfig::new(0.05).with_momentum(0.9)).with_accum(N as u32);
    let batches: Vec<(Vec<f16>, Vec<i32>)> = (0..N).map(micro_batch).collect();
    let mut whole = CpuClassifier::new(net(RouteKind::Fused), CLASSES, config, 9).unwrap();
    let mut refs: Vec<(&[f16], &[i32])> = batches
        .iter()
        .map(|(i, l)| (i.as_slice(), l.as_slice()))
        .collect();
    let want = whole.train_step(&mut refs).unwrap();
    let mut single = CpuClassifier::new(net(RouteKind::Fused), CLASSES, config, 9).unwrap();
    // The reference gradients of each micro-batch alone, from the same initial weights.
    let mut alone = CpuClassifier::new(net(RouteKind::Fused), CLASSES, config, 9).unwrap();
    let mut got = Vec::new();
    for (k, (images, labels)) in batches.iter().enumerate() {
        alone.step_mut().begin().unwrap();
        alone.forward_backward(images, labels).unwrap();
        let want_grad = alone
            .step()
            .executor()
            .f32_region(Region::G)
            .unwrap()
            .to_vec();
        let mut seen = None;
        got.push(
            single
                .train_micro_batch(k, images, labels, |regions| {
                    seen = Some(regions.f32_region(Region::G)?.to_vec());
                    Ok(())
                })
                .unwrap(),
        );
        assert!(
            seen == Some(want_grad),
            "micro-batch {k}: the hook's gradient"
        );
    }
    assert_eq!(got, want, "per-micro-batch metrics");
    let bytes = |c: &CpuClassifier| c.step().executor().region_bytes(Region::W).unwrap();
    assert!(bytes(&single) == bytes(&whole), "the master weights differ");
    assert_eq!(single.step().executor().scalars().step, 1);

    let e = single
        .train_micro_batch(N, &batches[0].0, &batches[0].1, |_| Ok(()))
        .unwrap_err();
    assert!(
        matches!(&e, ClassifierError::Input(m) if m.contains("accumulates 3")),
        "{e}"
    );
    assert_eq!(single.step().executor().scalars().step, 1, "nothing ran");

    // A NaN planted by the hook in the last micro-batch's gradient: the step is skipped.
    for (k, (images, labels)) in batches.iter().enumerate() {
        single
            .train_micro_batch(k, images, labels, |regions| {
                if k + 1 == N {
                    regions.f32_region_mut(Region::G)?[0] = f32::NAN;
                }
                Ok(())
            })
            .unwrap();
    }
    let s = single.step().executor().scalars();
    assert_eq!(
        (s.step, s.skipped),
        (1, 1),
        "the poisoned step was not skipped"
    );
}

#[test]
fn a_micro_batch_count_other_than_the_steps_is_a_typed_error() {
    let config = StepConfig::new(SgdConfig::new(0.05)).with_accum(2);
    let kind = RouteKind::Fused;
    let mut model = CpuClassifier::new(net(kind), CLASSES, config, 1).unwrap();
    let (images, labels) = micro_batch(0);
    for count in [0, 1, 3] {
        let mut mbs = vec![(images.as_slice(), labels.as_slice()); count];
        let e = model.train_step(&mut mbs).unwrap_err();
        assert!(
            matches!(&e, ClassifierError::Input(m) if m.contains("accumulates 2")),
            "{count}: {e}"
        );
    }
    assert_eq!(model.step().executor().scalars().step, 0, "nothing ran");
    for bad in [0, 5000] {
        let e = CpuClassifier::new(net(kind), CLASSES, config.with_accum(bad), 1).unwrap_err();
        assert!(e.to_string().contains("accum"), "{bad}: {e}");
    }
}

/// Data-parallel accumulation (`CpuReplica::train_step`): 2 ranks × 4 with synchronized BN
/// and 2 micro-batches per step train like one classifier × 8 with 2 micro-batches. SGD
/// divides the sums over ranks and micro-batches by `loss_scale · 2 · 2` against
/// `loss_scale · 2`. FP16 storage rounds differently on the two sides (the ranks' FP16
/// wgrads are summed in FP16, the statistics in another order: each a 2^-11 relative
/// rounding), so the updates agree to that noise, not bit for bit: measured 4.3e-4 relative
/// L2 after 3 steps, bounded at 5e-3; a missing `· ranks` or `· N` in the unscale would
/// double the update (100%). Every rank ends with the same weights, bit for bit.
#[test]
fn data_parallel_replicas_accumulate_like_one_classifier() {
    use cudnn_cbr::dist::{Communicator, CpuGroup, CpuReplica};
    let (ranks, batch, steps) = (2usize, 4usize, 3usize);
    let config = StepConfig::new(SgdConfig::new(0.1)).with_accum(2);
    let spec = Preset::Mini.spec(3, CLASSES, 4);
    let net_of = |b: usize| compile(&spec, b, HW, &RoutePolicy::Uniform(RouteKind::Fused)).unwrap();
    let per = HW * HW * 3;
    // Micro-batch k of step t: the global batch of both ranks' shards.
    let global = |t: usize, k: usize| {
        let (a, la) = micro_batch(2 * (2 * t + k));
        let (b, lb) = micro_batch(2 * (2 * t + k) + 1);
        ([a, b].concat(), [la, lb].concat())
    };
    let mut one = CpuClassifier::new(net_of(ranks * batch), CLASSES, config, 5).unwrap();
    let w0 = one
        .step()
        .executor()
        .f32_region(Region::W)
        .unwrap()
        .to_vec();
    for t in 0..steps {
        let (m0, m1) = (global(t, 0), global(t, 1));
        one.train_step(&mut [(&m0.0, &m0.1), (&m1.0, &m1.1)])
            .unwrap();
    }
    let grads = CpuGroup::ranks(ranks).unwrap();
    let bn = CpuGroup::ranks(ranks).unwrap();
    let finals: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = grads
            .into_iter()
            .zip(bn)
            .map(|(g, b)| {
                s.spawn(move || {
                    let r = g.rank();
                    let model = CpuClassifier::new(net_of(batch), CLASSES, config, 5).unwrap();
                    let mut rep = CpuReplica::new(model, g, Some(b)).unwrap();
                    // A count other than the step's is refused before anything is exchanged.
                    let (x, l) = global(0, 0);
                    let shard = (
                        &x[r * batch * per..][..batch * per],
                        &l[r * batch..][..batch],
                    );
                    let e = rep.train_step(&[shard]).unwrap_err();
                    assert!(e.to_string().contains("accumulates 2"), "{e}");
                    for t in 0..steps {
                        let (m0, m1) = (global(t, 0), global(t, 1));
                        let s0 = (
                            &m0.0[r * batch * per..][..batch * per],
                            &m0.1[r * batch..][..batch],
                        );
                        let s1 = (
                            &m1.0[r * batch * per..][..batch * per],
                            &m1.1[r * batch..][..batch],
                        );
                        rep.train_step(&[s0, s1]).unwrap();
                    }
                    rep.model()
                        .step()
                        .executor()
                        .f32_region(Region::W)
                        .unwrap()
                        .to_vec()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(finals[0], finals[1], "every rank holds the same weights");
    let w1 = one.step().executor().f32_region(Region::W).unwrap();
    let (mut d, mut n) = (0f64, 0f64);
    for ((a, b), w) in finals[0].iter().zip(w1).zip(&w0) {
        let (da, db) = (f64::from(a - w), f64::from(b - w));
        d += (da - db) * (da - db);
        n += db * db;
    }
    let rel = (d / n).sqrt();
    println!(
        "2 ranks x {batch} x 2 micro-batches vs 1 x {} x 2: update rel L2 {rel:.2e}",
        ranks * batch
    );
    assert!(rel < 5e-3, "{rel:e}");
}
