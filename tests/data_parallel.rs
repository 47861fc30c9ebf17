//! Data-parallel training on the CPU executor: N ranks × batch B against one rank × batch N·B
//! (exact f64, and the FP16 classifier), local BN's mean gradient, an overflow on one rank,
//! and a failing rank (an error on every rank, never a hang).

use std::time::{Duration, Instant};

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::AmpError;
use cudnn_cbr::dist::{
    Collective, CommBnSync, Communicator, CpuComm, CpuGroup, CpuReplica, DistError, ReduceOp,
};
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::head::{self, HeadDims};
use cudnn_cbr::net::{compile, initial_weights, CompiledNet, CpuNet, NetSpec, Preset, RoutePolicy};
use cudnn_cbr::{
    amp::range::SgdConfig, amp::step::StepConfig, classifier::ClassifierError,
    classifier::CpuClassifier,
};
use half::f16;

const HW: usize = 8;
const CHANNELS: usize = 3;
const CLASSES: usize = 4;

fn spec() -> NetSpec {
    Preset::Mini.spec(CHANNELS, CLASSES, 4)
}

fn net(batch: usize, route: RouteKind) -> CompiledNet {
    compile(&spec(), batch, HW, &RoutePolicy::Uniform(route)).unwrap()
}

/// A deterministic global batch: images in [-1, 1), labels in 0..CLASSES.
fn global_batch(n: usize, step: u64) -> (Vec<f64>, Vec<usize>) {
    let mut s = 0x5eed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let images = (0..n * HW * HW * CHANNELS)
        .map(|_| f64::from(cudnn_cbr::net::uniform(&mut s)) * 2.0 - 1.0)
        .collect();
    let labels = (0..n)
        .map(|_| (cudnn_cbr::net::splitmix(&mut s) % CLASSES as u64) as usize)
        .collect();
    (images, labels)
}

/// Exact f64 training of the network + head with plain SGD; with a communicator the
/// gradients are summed over the ranks and divided by their number, and with `bn` the BN is
/// synchronized. Returns every parameter after `steps` steps, by name.
fn train_f64(
    route: RouteKind,
    batch: usize,
    steps: u64,
    mut comm: Option<CpuComm>,
    bn: Option<CpuComm>,
) -> Vec<(String, Vec<f64>)> {
    let (rank, ranks) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
    let compiled = net(batch, route);
    let init = initial_weights(&compiled, CLASSES, 7);
    let dims = HeadDims {
        n: batch,
        pixels: compiled.out_hw * compiled.out_hw,
        features: compiled.features,
        classes: CLASSES,
    };
    let layers: Vec<String> = compiled.layers.iter().map(|l| l.name.clone()).collect();
    let mut params: Vec<(String, Vec<f64>)> = init
        .into_iter()
        .map(|(n, v)| (n, v.into_iter().map(f64::from).collect()))
        .collect();
    // β and the FC bias start at zero (initial_weights leaves them to the region's zeros).
    for l in &layers {
        let k = params
            .iter()
            .find(|(n, _)| *n == format!("{l}.gamma"))
            .unwrap()
            .1
            .len();
        params.push((format!("{l}.beta"), vec![0.0; k]));
    }
    params.push(("fc.b".into(), vec![0.0; CLASSES]));
    let mut net = CpuNet::<f64>::new(compiled);
    if let Some(bn) = bn {
        net.set_bn_sync(Box::new(CommBnSync(bn)));
    }
    let per = HW * HW * CHANNELS;
    for step in 0..steps {
        let (images, labels) = global_batch(batch * ranks, step);
        let images = &images[rank * batch * per..(rank + 1) * batch * per];
        let labels = &labels[rank * batch..(rank + 1) * batch];
        let get = |name: &str| params.iter().find(|(n, _)| n == name).unwrap().1.clone();
        for l in &layers {
            net.set_half(&format!("{l}.w"), get(&format!("{l}.w")))
                .unwrap();
            net.set_float(&format!("{l}.gamma"), get(&format!("{l}.gamma")))
                .unwrap();
            net.set_float(&format!("{l}.beta"), get(&format!("{l}.beta")))
                .unwrap();
        }
        net.forward(images).unwrap();
        let h = head::run(dims, net.output(), &get("fc.w"), &get("fc.b"), labels, 1.0).unwrap();
        net.backward(h.da.clone()).unwrap();
        let mut grads: Vec<Vec<f64>> = Vec::new();
        for (name, _) in &params {
            grads.push(match name.as_str() {
                "fc.w" => h.dfc_w.clone(),
                "fc.b" => h.dfc_b.clone(),
                n if n.ends_with(".w") => net.values(&format!("{}.dw", &n[..n.len() - 2])).unwrap(),
                n => {
                    let (layer, p) = n.rsplit_once('.').unwrap();
                    net.values(&format!("{layer}.d{p}")).unwrap()
                }
            });
        }
        if let Some(c) = comm.as_mut() {
            for g in &mut grads {
                c.all_reduce(&mut g[..], ReduceOp::Sum).unwrap();
                g.iter_mut().for_each(|x| *x /= ranks as f64);
            }
        }
        for ((_, w), g) in params.iter_mut().zip(&grads) {
            for (w, g) in w.iter_mut().zip(g) {
                *w -= 0.1 * g;
            }
        }
    }
    params
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = a
        .iter()
        .chain(b)
        .fold(0f64, |m, x| m.max(x.abs()))
        .max(1e-300);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Synchronized BN makes N ranks × B the same training as one rank × N·B, every weight after
/// several steps. Exact arithmetic: only the order of the sums differs (rank by rank instead
/// of over one batch), so the bound is 1e-12 relative (f64 carries 1e-16; three steps of
/// forward and backward through the network amplify it by far less than 1e4).
#[test]
fn synchronized_bn_ranks_equal_one_rank_with_the_whole_batch_in_f64() {
    for route in [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic] {
        let (ranks, batch, steps) = (3, 2, 3);
        let one = train_f64(route, ranks * batch, steps, None, None);
        let grads = CpuGroup::ranks(ranks).unwrap();
        let bn = CpuGroup::ranks(ranks).unwrap();
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = grads
                .into_iter()
                .zip(bn)
                .map(|(g, b)| s.spawn(move || train_f64(route, batch, steps, Some(g), Some(b))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut worst = 0f64;
        for (name, w) in &one {
            for (r, params) in out.iter().enumerate() {
                let got = &params.iter().find(|(n, _)| n == name).unwrap().1;
                let rel = max_rel(w, got);
                assert!(rel <= 1e-12, "{route:?} {name} on rank {r}: {rel:e}");
                worst = worst.max(rel);
                assert_eq!(
                    got,
                    &out[0].iter().find(|(n, _)| n == name).unwrap().1,
                    "ranks agree bit for bit"
                );
            }
        }
        println!(
            "{route:?}: {ranks} ranks x {batch} vs 1 x {}: worst weight rel diff {worst:.2e}",
            ranks * batch
        );
        // Local BN is a different training: the check above can fail.
        let grads = CpuGroup::ranks(ranks).unwrap();
        let local: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = grads
                .into_iter()
                .map(|g| s.spawn(move || train_f64(route, batch, steps, Some(g), None)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let diff = one
            .iter()
            .map(|(n, w)| max_rel(w, &local[0].iter().find(|(m, _)| m == n).unwrap().1))
            .fold(0f64, f64::max);
        assert!(
            diff > 1e-6,
            "{route:?}: local BN should differ, got {diff:e}"
        );
    }
}

fn to_f16(v: &[f64]) -> Vec<f16> {
    v.iter().map(|&x| f16::from_f64(x)).collect()
}

fn labels_i32(v: &[usize]) -> Vec<i32> {
    v.iter().map(|&l| l as i32).collect()
}

/// The classifier with SGD as the main job runs it (momentum, weight decay).
fn classifier(batch: usize) -> CpuClassifier {
    classifier_with(
        batch,
        StepConfig::new(
            SgdConfig::new(0.1)
                .with_momentum(0.9)
                .with_weight_decay(5e-4),
        ),
    )
}

fn classifier_with(batch: usize, cfg: StepConfig) -> CpuClassifier {
    CpuClassifier::new(net(batch, RouteKind::Fused), CLASSES, cfg, 7).unwrap()
}

fn master(model: &CpuClassifier) -> Vec<f32> {
    model
        .step()
        .executor()
        .f32_region(Region::W)
        .unwrap()
        .to_vec()
}

/// The FP16 classifier: 2 ranks × 4 with synchronized BN against 1 rank × 8, plain SGD,
/// weight updates after 4 steps, both measured against the exact f64 training of the same
/// network (above). FP16 storage rounds differently on the two runs (the ranks' FP16 wgrads
/// are summed in FP16, statistics in another order), so neither equals the other bit for
/// bit; the bound is that data parallelism adds no error of its own: the ranks' distance to
/// the exact run stays within twice the single run's FP16 error, while local BN, a different
/// training, is far off.
#[test]
fn synchronized_bn_replicas_train_like_one_classifier_with_the_whole_batch() {
    let (ranks, batch, steps) = (2, 4, 4);
    let per = HW * HW * CHANNELS;
    let plain = || StepConfig::new(SgdConfig::new(0.1));
    let mut one = classifier_with(ranks * batch, plain());
    let w0 = master(&one);
    for step in 0..steps {
        let (images, labels) = global_batch(ranks * batch, step);
        one.step_mut().begin().unwrap();
        one.forward_backward(&to_f16(&images), &labels_i32(&labels))
            .unwrap();
        one.step_mut().finish().unwrap();
    }
    let run = |sync: bool| -> Vec<Vec<f32>> {
        let grads = CpuGroup::ranks(ranks).unwrap();
        let mut bn: Vec<Option<CpuComm>> = match sync {
            true => CpuGroup::ranks(ranks)
                .unwrap()
                .into_iter()
                .map(Some)
                .collect(),
            false => vec![None, None],
        };
        std::thread::scope(|s| {
            let hs: Vec<_> = grads
                .into_iter()
                .zip(bn.drain(..))
                .map(|(g, b)| {
                    s.spawn(move || {
                        let r = g.rank();
                        let model = classifier_with(batch, plain());
                        let mut rep = CpuReplica::new(model, g, b).unwrap();
                        for step in 0..steps {
                            let (images, labels) = global_batch(ranks * batch, step);
                            let im = to_f16(&images[r * batch * per..(r + 1) * batch * per]);
                            let lb = labels_i32(&labels[r * batch..(r + 1) * batch]);
                            rep.step(&im, &lb).unwrap();
                        }
                        master(rep.model())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    // The exact updates, laid out as W.
    let plan = one.step().executor().plan_arc().clone();
    let exact_params = train_f64(RouteKind::Fused, ranks * batch, steps, None, None);
    let mut exact = vec![0f64; w0.len()];
    for p in plan.params() {
        let at = plan.view(p.name(), Region::W).unwrap().elem_offset();
        let v = &exact_params.iter().find(|(n, _)| n == p.name()).unwrap().1;
        for (i, x) in v.iter().enumerate() {
            exact[at + i] = x - f64::from(w0[at + i]);
        }
    }
    let delta =
        |w: &[f32]| -> Vec<f64> { w.iter().zip(&w0).map(|(a, b)| f64::from(a - b)).collect() };
    let l2 = |a: &[f64], b: &[f64]| {
        let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let n: f64 = b.iter().map(|y| y * y).sum();
        (d / n).sqrt()
    };
    let e_one = l2(&delta(&master(&one)), &exact);
    let synced = run(true);
    assert_eq!(synced[0], synced[1], "every rank holds the same weights");
    let e_sync = l2(&delta(&synced[0]), &exact);
    let e_local = l2(&delta(&run(false)[0]), &exact);
    println!(
        "FP16 update rel L2 vs exact f64: 1 rank x {}: {e_one:.2e}; {ranks} ranks x {batch}: \
         synchronized BN {e_sync:.2e}, local BN {e_local:.2e}",
        ranks * batch
    );
    assert!(e_one < 0.1, "the FP16 executor itself: {e_one:e}");
    assert!(
        e_sync <= 2.0 * e_one,
        "synchronized {e_sync:e} vs one rank {e_one:e}"
    );
    assert!(
        e_local > 4.0 * e_sync,
        "local BN {e_local:e} vs synchronized {e_sync:e}"
    );
}

/// Local BN: the applied update is the mean of what each rank's shard alone would apply
/// (one step, momentum buffer empty: Δw = lr·(mean of the unscaled gradients + wd·w)).
#[test]
fn local_bn_applies_the_mean_of_the_ranks_gradients() {
    let (ranks, batch) = (2, 4);
    let per = HW * HW * CHANNELS;
    let (images, labels) = global_batch(ranks * batch, 0);
    let shard = |r: usize| {
        (
            to_f16(&images[r * batch * per..(r + 1) * batch * per]),
            labels_i32(&labels[r * batch..(r + 1) * batch]),
        )
    };
    // Each shard's gradient, unscaled, in f64, from a classifier of its own.
    let mut mean = Vec::new();
    for r in 0..ranks {
        let mut m = classifier(batch);
        m.step_mut().begin().unwrap();
        let (im, lb) = shard(r);
        m.forward_backward(&im, &lb).unwrap();
        let regions = m.step().executor();
        let plan = regions.plan_arc().clone();
        let mut g = vec![0f64; plan.region_len(Region::W) / 4];
        for p in plan.params() {
            let at = plan.view(p.name(), Region::W).unwrap().elem_offset();
            let vals: Vec<f64> = if plan.lives_in(p, Region::G16) {
                regions
                    .param_f16(p.name(), Region::G16)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_f64())
                    .collect()
            } else {
                regions
                    .param_f32(p.name(), Region::G)
                    .unwrap()
                    .iter()
                    .map(|&x| f64::from(x))
                    .collect()
            };
            for (i, v) in vals.into_iter().enumerate() {
                g[at + i] += v / 8192.0 / ranks as f64;
            }
        }
        mean.push(g);
    }
    let mean: Vec<f64> = mean[0].iter().zip(&mean[1]).map(|(a, b)| a + b).collect();
    let w0 = master(&classifier(batch));
    let grads = CpuGroup::ranks(ranks).unwrap();
    let w1: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = grads
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let (im, lb) = shard(g.rank());
                    let mut rep = CpuReplica::new(classifier(batch), g, None).unwrap();
                    rep.step(&im, &lb).unwrap();
                    master(rep.model())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let model = classifier(batch);
    let plan = model.step().executor().plan_arc().clone();
    let mut worst = 0f64;
    for p in plan.params() {
        let at = plan.view(p.name(), Region::W).unwrap().elem_offset();
        let wd = if p.kind().decays() { 5e-4 } else { 0.0 };
        for i in at..at + p.elems() {
            let want = 0.1 * (mean[i] + wd * f64::from(w0[i]));
            let got = f64::from(w0[i] - w1[0][i]);
            // The FP16 sum of the ranks' FP16 wgrads rounds once more (2^-11 relative), and
            // w0 - w1 loses bits to the weight's magnitude in f32: 1e-3 of the update, plus
            // an absolute floor of a few f32 ulps of the weight.
            let tol = 1e-3 * want.abs() + 4.0 * f64::from(f32::EPSILON) * f64::from(w0[i].abs());
            assert!(
                (got - want).abs() <= tol,
                "{} [{}]: got {got:e}, want {want:e}",
                p.name(),
                i - at
            );
            worst = worst.max((got - want).abs() / want.abs().max(1e-30));
        }
    }
    assert_eq!(w1[0], w1[1]);
    println!("local BN: applied update vs mean of the ranks' gradients, worst rel {worst:.2e}");
}

/// An overflow on one rank (NaN images: its loss and gradients are NaN) skips the step on
/// every rank: weights untouched, loss scale halved, one skipped step, on both.
#[test]
fn an_overflow_on_one_rank_skips_the_step_everywhere() {
    let (ranks, batch) = (2, 4);
    let per = HW * HW * CHANNELS;
    let grads = CpuGroup::ranks(ranks).unwrap();
    let out: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = grads
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let r = g.rank();
                    let mut rep = CpuReplica::new(classifier(batch), g, None).unwrap();
                    let w0 = master(rep.model());
                    let (images, labels) = global_batch(ranks * batch, 0);
                    let mut im = to_f16(&images[r * batch * per..(r + 1) * batch * per]);
                    if r == 1 {
                        im[5] = f16::NAN;
                    }
                    rep.step(&im, &labels_i32(&labels[r * batch..(r + 1) * batch]))
                        .unwrap();
                    let s = rep.model().step().executor().scalars();
                    (w0, master(rep.model()), s)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (w0, w1, s)) in out.into_iter().enumerate() {
        assert_eq!(w0, w1, "rank {r} skipped");
        assert_eq!((s.skipped, s.loss_scale), (1, 4096.0), "rank {r}");
    }
}

/// A rank whose step fails (a batch of the wrong size) makes every rank return an error
/// promptly: the failing one its own, the others "rank 1 failed".
#[test]
fn a_failing_rank_is_an_error_on_every_rank_not_a_hang() {
    let (ranks, batch) = (3, 4);
    let per = HW * HW * CHANNELS;
    let start = Instant::now();
    let grads = CpuGroup::ranks_with_timeout(ranks, Duration::from_secs(60)).unwrap();
    let out: Vec<Result<(), ClassifierError>> = std::thread::scope(|s| {
        let hs: Vec<_> = grads
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let r = g.rank();
                    let mut rep = CpuReplica::new(classifier(batch), g, None)?;
                    let n = if r == 1 { batch - 1 } else { batch };
                    for _ in 0..3 {
                        rep.step(&vec![f16::ZERO; n * per], &vec![0; batch])?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(out[1], Err(ClassifierError::Input(_))),
        "{:?}",
        out[1]
    );
    for r in [0, 2] {
        match &out[r] {
            Err(ClassifierError::Amp(AmpError::Dist(DistError::PeerFailed {
                rank: 1, ..
            }))) => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

/// Ranks whose networks differ (4 and 5 classes; the same spec on other routes, whose
/// parameters have the same sizes) fail together when the group forms, each naming both
/// networks: nobody trains, nobody hangs.
#[test]
fn ranks_of_different_networks_all_fail_when_the_group_forms() {
    let cases: [(usize, RouteKind, &str, &str); 2] = [
        (5, RouteKind::Fused, "classes 4 ", "classes 5 "),
        (4, RouteKind::Unfused, "routes f*", "routes u*"),
    ];
    for (classes, route, a, b) in cases {
        let start = Instant::now();
        let grads = CpuGroup::ranks_with_timeout(2, Duration::from_secs(60)).unwrap();
        let out: Vec<Result<CpuReplica, ClassifierError>> = std::thread::scope(|s| {
            let hs: Vec<_> = grads
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let (classes, route) = if g.rank() == 0 {
                            (CLASSES, RouteKind::Fused)
                        } else {
                            (classes, route)
                        };
                        let spec = Preset::Mini.spec(CHANNELS, classes, 4);
                        let net = compile(&spec, 4, HW, &RoutePolicy::Uniform(route)).unwrap();
                        let cfg = StepConfig::new(SgdConfig::new(0.1));
                        let model = CpuClassifier::new(net, classes, cfg, 7).unwrap();
                        CpuReplica::new(model, g, None)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:?}",
            start.elapsed()
        );
        for (r, o) in out.iter().enumerate() {
            match o {
                Err(ClassifierError::Amp(AmpError::Dist(
                    e @ DistError::ModelMismatch {
                        me,
                        rank_a: 0,
                        rank_b: 1,
                        hash_a,
                        hash_b,
                        ..
                    },
                ))) => {
                    assert_eq!(*me, r);
                    assert_ne!(hash_a, hash_b);
                    let text = e.to_string();
                    assert!(text.contains(a) && text.contains(b), "{text}");
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
    }
}
