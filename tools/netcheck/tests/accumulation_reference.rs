//! Gradient accumulation in exact arithmetic: the CPU executor (`CpuNet<f64>`, every route)
//! runs a step's N micro-batches in sequence on one network, as a step with `--accum N`
//! does, and the sum of its N backward passes' parameter gradients is compared with the sum
//! of the independent reference's gradients for each micro-batch (candle's autograd, f64,
//! tests/independent: BN in training mode with that micro-batch's own statistics). The
//! running statistics after the N passes are compared with the reference's N updates in
//! sequence. The same sum differs from one pass over the N micro-batches as one batch (BN
//! over the whole batch): the test sees the BN semantics.

mod independent;

use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::head::{self, HeadDims};
use cudnn_cbr::net::{
    compile, BlockKind, BlockSpec, CpuNet, NetSpec, PoolSpec, RoutePolicy, StemSpec,
};
use independent::{Named, RefBlock, RefBlockKind, RefNet, RefPool, RefStem};

const EPS: f64 = 1e-5;
const MOMENTUM: f64 = 0.1;
/// Micro-batches per step, and images per micro-batch.
const N: usize = 3;
const BATCH: usize = 2;
const HW: usize = 8;

/// A basic-block network: stem, an identity block, a strided projection block.
fn spec() -> NetSpec {
    NetSpec {
        name: "accum".into(),
        in_channels: 3,
        stem: StemSpec {
            out: 5,
            kernel: 3,
            stride: 1,
            pad: 1,
            max_pool: Some(PoolSpec {
                kernel: 3,
                stride: 2,
                pad: 1,
            }),
        },
        stages: vec![
            vec![BlockSpec::new(BlockKind::Basic, 5, 5, 5, 1)],
            vec![BlockSpec::new(BlockKind::Basic, 5, 7, 7, 2)],
        ],
        classes: 4,
    }
}

/// The same network in the reference's own description (fields only).
fn to_ref(spec: &NetSpec) -> RefNet {
    RefNet {
        in_channels: spec.in_channels,
        hw: HW,
        stem: RefStem {
            out: spec.stem.out,
            kernel: spec.stem.kernel,
            stride: spec.stem.stride,
            pad: spec.stem.pad,
            max_pool: spec.stem.max_pool.map(|p| RefPool {
                kernel: p.kernel,
                stride: p.stride,
                pad: p.pad,
            }),
        },
        stages: spec
            .stages
            .iter()
            .map(|s| {
                s.iter()
                    .map(|b| RefBlock {
                        kind: match b.kind {
                            BlockKind::Basic => RefBlockKind::Basic,
                            BlockKind::Bottleneck => RefBlockKind::Bottleneck,
                        },
                        in_ch: b.in_ch,
                        width: b.width,
                        out: b.out,
                        stride: b.stride,
                        projection: b.projection,
                    })
                    .collect()
            })
            .collect(),
        classes: spec.classes,
        epsilon: EPS,
        momentum: MOMENTUM,
    }
}

/// splitmix64 → [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

fn params(r: &RefNet, rng: &mut Rng) -> Named {
    let mut p = Named::new();
    for (name, dims) in independent::param_shapes(r) {
        let n: usize = dims.iter().product();
        let v: Vec<f64> = if name.ends_with("gamma") || name.ends_with("running_var") {
            (0..n).map(|_| 1.0 + 0.3 * rng.next()).collect()
        } else if name.ends_with(".w") && name != "fc.w" {
            let b = (3.0 / dims[1..].iter().product::<usize>() as f64).sqrt();
            (0..n).map(|_| b * rng.next()).collect()
        } else {
            (0..n).map(|_| 0.2 * rng.next()).collect()
        };
        p.insert(name, v);
    }
    p
}

/// Micro-batch `k`: images NHWC and labels.
fn micro_batch(r: &RefNet, k: usize) -> (Vec<f64>, Vec<usize>) {
    let mut rng = Rng(0xACC0 + k as u64);
    let images = (0..BATCH * HW * HW * r.in_channels)
        .map(|_| rng.next())
        .collect();
    let labels = (0..BATCH).map(|i| (i + 2 * k) % r.classes).collect();
    (images, labels)
}

/// The trainable parameters' names (what a step accumulates), and each layer's name.
fn trainable(spec: &NetSpec) -> (Vec<String>, Vec<String>) {
    let net = compile(spec, BATCH, HW, &RoutePolicy::Uniform(RouteKind::Fused)).unwrap();
    let layers: Vec<String> = net.layers.iter().map(|l| l.name.clone()).collect();
    let mut names: Vec<String> = layers
        .iter()
        .flat_map(|l| ["w", "gamma", "beta"].map(|p| format!("{l}.{p}")))
        .collect();
    names.extend(["fc.w".to_string(), "fc.b".to_string()]);
    (names, layers)
}

fn add_into(sum: &mut Named, name: &str, g: &[f64]) {
    let s = sum
        .entry(name.to_string())
        .or_insert_with(|| vec![0.0; g.len()]);
    s.iter_mut().zip(g).for_each(|(a, b)| *a += b);
}

/// ‖a − b‖∞ / ‖b‖∞.
fn rel_inf(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let max_b = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / max_b
}

/// Our side: one `CpuNet<f64>` running the micro-batches in sequence; the summed gradients
/// and the running statistics after the last pass.
fn ours(spec: &NetSpec, route: RouteKind, p: &Named, batches: &[(Vec<f64>, Vec<usize>)]) -> Named {
    let (names, layers) = trainable(spec);
    let net = compile(spec, BATCH, HW, &RoutePolicy::Uniform(route)).unwrap();
    let dims = HeadDims {
        n: BATCH,
        pixels: net.out_hw * net.out_hw,
        features: net.features,
        classes: spec.classes,
    };
    let mut cpu: CpuNet<f64> = CpuNet::new(net);
    for l in &layers {
        cpu.set_half(&format!("{l}.w"), p[&format!("{l}.w")].clone())
            .unwrap();
        for q in ["gamma", "beta", "running_mean", "running_var"] {
            let k = format!("{l}.{q}");
            cpu.set_float(&k, p[&k].clone()).unwrap();
        }
    }
    let mut sum = Named::new();
    for (images, labels) in batches {
        cpu.forward(images).unwrap();
        let h = head::run(dims, cpu.output(), &p["fc.w"], &p["fc.b"], labels, 1.0).unwrap();
        cpu.backward(h.da.clone()).unwrap();
        add_into(&mut sum, "fc.w", &h.dfc_w);
        add_into(&mut sum, "fc.b", &h.dfc_b);
        for name in names.iter().filter(|n| !n.starts_with("fc.")) {
            let (l, q) = name.rsplit_once('.').unwrap();
            add_into(&mut sum, name, &cpu.values(&format!("{l}.d{q}")).unwrap());
        }
    }
    for l in &layers {
        for q in ["running_mean", "running_var"] {
            let k = format!("{l}.{q}");
            sum.insert(k.clone(), cpu.values(&k).unwrap());
        }
    }
    sum
}

#[test]
fn f64_accumulated_gradients_equal_the_reference_summed_over_micro_batches() {
    let spec = spec();
    let r = to_ref(&spec);
    let p = params(&r, &mut Rng(5));
    let batches: Vec<(Vec<f64>, Vec<usize>)> = (0..N).map(|k| micro_batch(&r, k)).collect();
    let (names, layers) = trainable(&spec);
    // The reference: each micro-batch its own step (its own BN statistics), the running
    // statistics carried from one to the next, the gradients summed.
    let mut theirs = Named::new();
    let mut state = p.clone();
    for (images, labels) in &batches {
        let run = independent::run(&r, &state, images, labels).unwrap();
        for name in &names {
            add_into(&mut theirs, name, &run.grads[name]);
        }
        for l in &layers {
            for q in ["running_mean", "running_var"] {
                state.insert(
                    format!("{l}.{q}"),
                    run.forward[&format!("{l}.{q}_next")].clone(),
                );
            }
        }
    }
    for l in &layers {
        for q in ["running_mean", "running_var"] {
            let k = format!("{l}.{q}");
            theirs.insert(k.clone(), state[&k].clone());
        }
    }
    let mut worst = (0f64, String::new());
    for route in RouteKind::ALL {
        let o = ours(&spec, route, &p, &batches);
        assert_eq!(o.len(), theirs.len());
        for (key, want) in &theirs {
            let e = rel_inf(&o[key], want);
            // Exact arithmetic on both sides, summed in different orders: round-off only,
            // the bound the single-pass comparison (network_reference.rs) uses.
            assert!(e <= 1e-10, "{route:?}: {key}: ∞-norm relative error {e:e}");
            if e > worst.0 {
                worst = (e, format!("{route:?} {key}"));
            }
        }
    }
    // One pass over the N micro-batches as one batch normalizes over all of them: another
    // gradient, far outside the tolerance above.
    let all_images: Vec<f64> = batches.iter().flat_map(|b| b.0.clone()).collect();
    let all_labels: Vec<usize> = batches.iter().flat_map(|b| b.1.clone()).collect();
    let whole = independent::run(&r, &p, &all_images, &all_labels).unwrap();
    // The whole batch's loss is the mean over N·BATCH images; N times it is comparable
    // with the sum of the micro-batches' means.
    let scaled: Vec<f64> = whole.grads["stem.w"].iter().map(|g| g * N as f64).collect();
    let apart = rel_inf(&scaled, &theirs["stem.w"]);
    assert!(
        apart > 1e-3,
        "whole-batch BN gives the same gradient: {apart:e}"
    );
    println!(
        "{N} micro-batches of {BATCH}, every route: worst ∞-norm relative error {:.2e} ({}); \
         whole-batch BN differs by {apart:.2e}",
        worst.0, worst.1
    );
}
