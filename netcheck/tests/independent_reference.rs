//! Self-tests of the independent candle reference (`tests/independent/`).
//!
//! - Gradients of every trainable parameter against central finite differences of the
//!   loss: this also validates candle 0.11's conv2d backward (stride 2 with padding, where
//!   the data gradient needs a transposed conv with output padding; 1×1 stride 2; C ≠ K).
//! - Forward values against a plain-loop forward pass written here (NHWC/KRSC directly),
//!   which pins the layouts and semantics that finite differences cannot see (a consistently
//!   mis-permuted weight would still have consistent gradients).
//! - Exported intermediate gradients against plain-loop backward formulas (conv weight and
//!   data gradients, BatchNorm backward, head).
//! - The max-pool tie rule and −∞ padding; errors instead of panics on bad input.

mod independent;

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use independent::{
    loss, max_pool2d, param_shapes, run, Named, RefBlock, RefBlockKind, RefNet, RefPool, RefRun,
    RefStem,
};

// ---------------------------------------------------------------------------------------
// Fixtures.

/// splitmix64: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * u
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn random_params(net: &RefNet, rng: &mut Rng) -> Named {
    let mut p = Named::new();
    for (name, dims) in param_shapes(net) {
        let len: usize = dims.iter().product();
        let (lo, hi) = if name.ends_with(".gamma") {
            (0.5, 1.5)
        } else if name.ends_with(".running_var") {
            (0.5, 2.0)
        } else if name.ends_with(".beta") || name == "fc.b" {
            (-0.5, 0.5)
        } else {
            (-1.0, 1.0)
        };
        p.insert(name, (0..len).map(|_| rng.uniform(lo, hi)).collect());
    }
    p
}

/// (a) stem 3×3/1 without pool, one basic block with projection, stride 2, C ≠ K.
fn net_a() -> RefNet {
    RefNet {
        in_channels: 3,
        hw: 8,
        stem: RefStem {
            out: 5,
            kernel: 3,
            stride: 1,
            pad: 1,
            max_pool: None,
        },
        stages: vec![vec![RefBlock {
            kind: RefBlockKind::Basic,
            in_ch: 5,
            width: 7,
            out: 9,
            stride: 2,
            projection: true,
        }]],
        classes: 4,
        epsilon: 1e-5,
        momentum: 0.1,
    }
}

/// (b) stem 5×5/2 with max-pool 3×3/2 pad 1; stage 0: identity bottleneck; stage 1:
/// projection bottleneck, stride 2.
fn net_b() -> RefNet {
    RefNet {
        in_channels: 3,
        hw: 9,
        stem: RefStem {
            out: 7,
            kernel: 5,
            stride: 2,
            pad: 2,
            max_pool: Some(RefPool {
                kernel: 3,
                stride: 2,
                pad: 1,
            }),
        },
        stages: vec![
            vec![RefBlock {
                kind: RefBlockKind::Bottleneck,
                in_ch: 7,
                width: 3,
                out: 7,
                stride: 1,
                projection: false,
            }],
            vec![RefBlock {
                kind: RefBlockKind::Bottleneck,
                in_ch: 7,
                width: 5,
                out: 9,
                stride: 2,
                projection: true,
            }],
        ],
        classes: 5,
        epsilon: 1e-3,
        momentum: 0.3,
    }
}

struct Case {
    net: RefNet,
    params: Named,
    images: Vec<f64>,
    labels: Vec<usize>,
}

fn case(net: RefNet, batch: usize, seed: u64) -> Case {
    let mut rng = Rng(seed);
    let params = random_params(&net, &mut rng);
    let images = (0..batch * net.hw * net.hw * net.in_channels)
        .map(|_| rng.uniform(-1.0, 1.0))
        .collect();
    let labels = (0..batch).map(|_| rng.below(net.classes)).collect();
    Case {
        net,
        params,
        images,
        labels,
    }
}

impl Case {
    fn run(&self) -> RefRun {
        run(&self.net, &self.params, &self.images, &self.labels).expect("reference run")
    }
}

// ---------------------------------------------------------------------------------------
// Finite differences.

/// Central differences with step h = 1e-6 in f64. The loss (≈ 1–2) is computed to
/// ~1e-15 absolute, so the rounding part of the difference quotient is about
/// 1e-15 / 2e-6 ≲ 1e-9 absolute (observed: ≤ 4e-10), and the truncation part is
/// O(h²·f‴) ~ 1e-12 relative. Hence |fd − autograd| ≤ 1e-6·max(|fd|, |autograd|) + 1e-8:
/// the absolute term covers the rounding floor with 25× margin for tiny entries (some are
/// exactly 0, e.g. a BN beta whose shift a following 1×1 conv + BN cancels), the relative
/// term leaves ≥ 5× margin on entries ≥ 1e-4 (observed worst ≈ 1.5e-7), while a real bug
/// (wrong stride/padding/transposition, a missing term) gives relative errors of order
/// one. Kinks (ReLU, max-pool switches) are not crossed for these fixed seeds:
/// pre-activations are O(1) and move by ~1e-6.
fn check_fd(c: &Case, per_tensor: usize) {
    const STEP: f64 = 1e-6;
    const RTOL: f64 = 1e-6;
    const ATOL: f64 = 1e-8;
    let r = c.run();
    let mut rng = Rng(0xFD);
    // Largest fraction of the tolerance used by any entry.
    let mut worst = 0.0f64;
    let mut checked = 0;
    for (name, dims) in param_shapes(&c.net) {
        if name.ends_with(".running_mean") || name.ends_with(".running_var") {
            continue;
        }
        let len: usize = dims.iter().product();
        let g = &r.grads[&name];
        assert_eq!(g.len(), len, "{name}: gradient length");
        let max_abs = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(
            max_abs > 1e-4,
            "{name}: gradient is (nearly) zero everywhere"
        );
        let mut idx: Vec<usize> = if len <= per_tensor {
            (0..len).collect()
        } else {
            (0..per_tensor).map(|_| rng.below(len)).collect()
        };
        idx.sort_unstable();
        idx.dedup();
        for i in idx {
            let mut p = c.params.clone();
            p.get_mut(&name).unwrap()[i] += STEP;
            let lp = loss(&c.net, &p, &c.images, &c.labels).unwrap();
            p.get_mut(&name).unwrap()[i] -= 2.0 * STEP;
            let lm = loss(&c.net, &p, &c.images, &c.labels).unwrap();
            let fd = (lp - lm) / (2.0 * STEP);
            let an = g[i];
            let tol = RTOL * fd.abs().max(an.abs()) + ATOL;
            let err = (fd - an).abs();
            assert!(
                err <= tol,
                "{name}[{i}]: finite difference {fd:.12e} vs autograd {an:.12e}"
            );
            worst = worst.max(err / tol);
            checked += 1;
        }
    }
    eprintln!("finite differences: {checked} entries, worst error {worst:.3} of tolerance");
}

#[test]
fn fd_stem_and_basic_projection_block() {
    let t = Instant::now();
    check_fd(&case(net_a(), 2, 1), 6);
    eprintln!("took {:?}", t.elapsed());
}

#[test]
fn fd_maxpool_stem_and_bottleneck_blocks() {
    let t = Instant::now();
    check_fd(&case(net_b(), 3, 2), 6);
    eprintln!("took {:?}", t.elapsed());
}

// ---------------------------------------------------------------------------------------
// Plain-loop forward, NHWC/KRSC, written from the spec.

#[derive(Clone)]
struct Act {
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    v: Vec<f64>,
}

impl Act {
    fn at(&self, n: usize, y: usize, x: usize, c: usize) -> f64 {
        self.v[((n * self.h + y) * self.w + x) * self.c + c]
    }
}

fn conv_loop(x: &Act, wt: &[f64], k: usize, r: usize, stride: usize, pad: usize) -> Act {
    // Square inputs only (as every test net here), like `for_each_tap`.
    let o = (x.h + 2 * pad - r) / stride + 1;
    let mut v = vec![0.0; x.n * o * o * k];
    for_each_tap(x, o, k, r, stride, pad, |xi, yi, wi| {
        v[yi] += wt[wi] * x.v[xi]
    });
    Act {
        n: x.n,
        h: o,
        w: o,
        c: k,
        v,
    }
}

struct BnHand {
    out: Act,
    mean: Vec<f64>,
    var: Vec<f64>,
    inv_std: Vec<f64>,
}

fn bn_loop(y: &Act, gamma: &[f64], beta: &[f64], eps: f64) -> BnHand {
    let m = (y.n * y.h * y.w) as f64;
    let mut mean = vec![0.0; y.c];
    for (i, v) in y.v.iter().enumerate() {
        mean[i % y.c] += v / m;
    }
    let mut var = vec![0.0; y.c];
    for (i, v) in y.v.iter().enumerate() {
        var[i % y.c] += (v - mean[i % y.c]).powi(2) / m;
    }
    let inv_std: Vec<f64> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let mut out = y.clone();
    for (i, v) in out.v.iter_mut().enumerate() {
        let c = i % y.c;
        *v = gamma[c] * (*v - mean[c]) * inv_std[c] + beta[c];
    }
    BnHand {
        out,
        mean,
        var,
        inv_std,
    }
}

fn relu_loop(mut a: Act) -> Act {
    for v in &mut a.v {
        *v = v.max(0.0);
    }
    a
}

fn pool_loop(x: &Act, p: &RefPool) -> Act {
    let oh = (x.h + 2 * p.pad - p.kernel) / p.stride + 1;
    let ow = (x.w + 2 * p.pad - p.kernel) / p.stride + 1;
    let mut v = Vec::new();
    for n in 0..x.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for c in 0..x.c {
                    let mut best = f64::NEG_INFINITY;
                    for ky in 0..p.kernel {
                        for kx in 0..p.kernel {
                            let iy = (oy * p.stride + ky) as isize - p.pad as isize;
                            let ix = (ox * p.stride + kx) as isize - p.pad as isize;
                            if iy >= 0 && ix >= 0 && iy < x.h as isize && ix < x.w as isize {
                                best = best.max(x.at(n, iy as usize, ix as usize, c));
                            }
                        }
                    }
                    v.push(best);
                }
            }
        }
    }
    Act {
        n: x.n,
        h: oh,
        w: ow,
        c: x.c,
        v,
    }
}

/// Hand forward of the whole net: every key of `run`'s forward map it can produce.
fn hand_forward(c: &Case) -> Named {
    let net = &c.net;
    let p = &c.params;
    let mut f = Named::new();
    let conv_bn = |f: &mut Named, name: &str, x: &Act, k: usize, r: usize, s: usize, pad| {
        let y = conv_loop(x, &p[&format!("{name}.w")], k, r, s, pad);
        let bn = bn_loop(
            &y,
            &p[&format!("{name}.gamma")],
            &p[&format!("{name}.beta")],
            net.epsilon,
        );
        let m = (y.n * y.h * y.w) as f64;
        let mom = net.momentum;
        let rm = &p[&format!("{name}.running_mean")];
        let rv = &p[&format!("{name}.running_var")];
        f.insert(
            format!("{name}.running_mean_next"),
            (0..k)
                .map(|i| (1.0 - mom) * rm[i] + mom * bn.mean[i])
                .collect(),
        );
        f.insert(
            format!("{name}.running_var_next"),
            (0..k)
                .map(|i| (1.0 - mom) * rv[i] + mom * bn.var[i] * m / (m - 1.0))
                .collect(),
        );
        f.insert(format!("{name}.x"), x.v.clone());
        f.insert(format!("{name}.y"), y.v.clone());
        f.insert(format!("{name}.mean"), bn.mean.clone());
        f.insert(format!("{name}.var"), bn.var.clone());
        f.insert(format!("{name}.inv_std"), bn.inv_std.clone());
        bn.out
    };
    let n = c.labels.len();
    let x = Act {
        n,
        h: net.hw,
        w: net.hw,
        c: net.in_channels,
        v: c.images.clone(),
    };
    let s = &net.stem;
    let out = relu_loop(conv_bn(
        &mut f, "stem", &x, s.out, s.kernel, s.stride, s.pad,
    ));
    f.insert("stem.out".into(), out.v.clone());
    let mut cur = match &s.max_pool {
        Some(pool) => {
            let pooled = pool_loop(&out, pool);
            f.insert("stem.pool".into(), pooled.v.clone());
            pooled
        }
        None => out,
    };
    for (i, stage) in net.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            let l = format!("s{i}.b{j}");
            let last = match b.kind {
                RefBlockKind::Basic => {
                    let h = relu_loop(conv_bn(
                        &mut f,
                        &format!("{l}.conv1"),
                        &cur,
                        b.width,
                        3,
                        b.stride,
                        1,
                    ));
                    conv_bn(&mut f, &format!("{l}.conv2"), &h, b.out, 3, 1, 1)
                }
                RefBlockKind::Bottleneck => {
                    let h = relu_loop(conv_bn(
                        &mut f,
                        &format!("{l}.conv1"),
                        &cur,
                        b.width,
                        1,
                        1,
                        0,
                    ));
                    let h = relu_loop(conv_bn(
                        &mut f,
                        &format!("{l}.conv2"),
                        &h,
                        b.width,
                        3,
                        b.stride,
                        1,
                    ));
                    conv_bn(&mut f, &format!("{l}.conv3"), &h, b.out, 1, 1, 0)
                }
            };
            let short = if b.projection {
                conv_bn(&mut f, &format!("{l}.down"), &cur, b.out, 1, b.stride, 0)
            } else {
                cur.clone()
            };
            let mut o = last;
            for (v, s) in o.v.iter_mut().zip(&short.v) {
                *v = (*v + s).max(0.0);
            }
            f.insert(format!("{l}.out"), o.v.clone());
            cur = o;
        }
    }
    let hw = (cur.h * cur.w) as f64;
    let mut pooled = vec![0.0; n * cur.c];
    for (i, v) in cur.v.iter().enumerate() {
        let img = i / (cur.h * cur.w * cur.c);
        pooled[img * cur.c + i % cur.c] += v / hw;
    }
    let (fw, fb) = (&p["fc.w"], &p["fc.b"]);
    let mut logits = vec![0.0; n * net.classes];
    for img in 0..n {
        for k in 0..net.classes {
            logits[img * net.classes + k] = fb[k]
                + (0..cur.c)
                    .map(|ch| fw[k * cur.c + ch] * pooled[img * cur.c + ch])
                    .sum::<f64>();
        }
    }
    f.insert("pooled".into(), pooled);
    f.insert(
        "loss".into(),
        vec![hand_loss(&logits, &c.labels, net.classes)],
    );
    f.insert("logits".into(), logits);
    f
}

/// Mean softmax cross-entropy from logits, by hand.
fn hand_loss(logits: &[f64], labels: &[usize], classes: usize) -> f64 {
    let mut total = 0.0;
    for (row, &l) in logits.chunks_exact(classes).zip(labels) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln();
        total += lse - row[l];
    }
    total / labels.len() as f64
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g:.15e}, want {w:.15e}"
        );
    }
}

/// Keys the brief requires in `forward` and `grads`.
fn required_keys(net: &RefNet) -> (Vec<String>, Vec<String>) {
    let mut fwd = vec![
        "stem.out".to_string(),
        "pooled".into(),
        "logits".into(),
        "loss".into(),
    ];
    let mut grd = vec![
        "fc.w".to_string(),
        "fc.b".into(),
        "stem.out".into(),
        "pooled".into(),
        "logits".into(),
    ];
    if net.stem.max_pool.is_some() {
        fwd.push("stem.pool".into());
    }
    for (name, _) in param_shapes(net) {
        if let Some(l) = name.strip_suffix(".w").filter(|l| *l != "fc") {
            for k in [
                "y",
                "mean",
                "inv_std",
                "running_mean_next",
                "running_var_next",
            ] {
                fwd.push(format!("{l}.{k}"));
            }
            for k in ["w", "gamma", "beta", "y"] {
                grd.push(format!("{l}.{k}"));
            }
        }
    }
    for (i, stage) in net.stages.iter().enumerate() {
        for j in 0..stage.len() {
            fwd.push(format!("s{i}.b{j}.out"));
            grd.push(format!("s{i}.b{j}.out"));
        }
    }
    (fwd, grd)
}

#[test]
fn forward_matches_plain_loops() {
    for c in [case(net_a(), 2, 11), case(net_b(), 3, 12)] {
        let r = c.run();
        let hand = hand_forward(&c);
        let (fwd, grd) = required_keys(&c.net);
        for k in &fwd {
            assert!(r.forward.contains_key(k), "forward lacks {k}");
            assert!(hand.contains_key(k), "hand forward lacks {k}");
        }
        for k in &grd {
            assert!(r.grads.contains_key(k), "grads lack {k}");
            assert_eq!(
                r.grads[k].len(),
                r.forward.get(k).or(c.params.get(k)).unwrap().len(),
                "{k}: gradient length"
            );
        }
        for (k, want) in &hand {
            assert_close(k, &r.forward[k], want, 1e-10);
        }
        // The loss against the reference's own logits, by hand.
        let l = hand_loss(&r.forward["logits"], &c.labels, c.net.classes);
        assert!((r.forward["loss"][0] - l).abs() <= 1e-13 * l.abs().max(1.0));
        // The forward-only loss is the same value.
        let l2 = loss(&c.net, &c.params, &c.images, &c.labels).unwrap();
        assert_eq!(l2, r.forward["loss"][0]);
    }
}

// ---------------------------------------------------------------------------------------
// Exported intermediate gradients against plain-loop backward formulas.

/// Conv geometry of every layer, from the spec: (name, kernel, stride, pad).
fn conv_geometry(net: &RefNet) -> Vec<(String, usize, usize, usize)> {
    let s = &net.stem;
    let mut v = vec![("stem".to_string(), s.kernel, s.stride, s.pad)];
    for (i, stage) in net.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            let l = format!("s{i}.b{j}");
            match b.kind {
                RefBlockKind::Basic => {
                    v.push((format!("{l}.conv1"), 3, b.stride, 1));
                    v.push((format!("{l}.conv2"), 3, 1, 1));
                }
                RefBlockKind::Bottleneck => {
                    v.push((format!("{l}.conv1"), 1, 1, 0));
                    v.push((format!("{l}.conv2"), 3, b.stride, 1));
                    v.push((format!("{l}.conv3"), 1, 1, 0));
                }
            }
            if b.projection {
                v.push((format!("{l}.down"), 1, b.stride, 0));
            }
        }
    }
    v
}

/// Walks every (output element, kernel tap, input channel) triple of a conv with a square
/// `o×o` output, `k` output channels and an `r×r` kernel, calling `f(x index, y index,
/// w index)` (NHWC, NHWC, KRSC flat indices); padding taps are skipped.
fn for_each_tap(
    x: &Act,
    o: usize,
    k: usize,
    r: usize,
    stride: usize,
    pad: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    let (oh, ow) = (o, o);
    for n in 0..x.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ry in 0..r {
                    for sx in 0..r {
                        let iy = (oy * stride + ry) as isize - pad as isize;
                        let ix = (ox * stride + sx) as isize - pad as isize;
                        if iy < 0 || ix < 0 || iy >= x.h as isize || ix >= x.w as isize {
                            continue;
                        }
                        for ko in 0..k {
                            for ci in 0..x.c {
                                f(
                                    ((n * x.h + iy as usize) * x.w + ix as usize) * x.c + ci,
                                    ((n * oh + oy) * ow + ox) * k + ko,
                                    ((ko * r + ry) * r + sx) * x.c + ci,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// d loss / d (BN input y) from d loss / d (BN output), by the closed-form BN backward.
fn bn_backward(y: &[f64], g: &[f64], mean: &[f64], inv_std: &[f64], gamma: &[f64]) -> Vec<f64> {
    let c = mean.len();
    let m = (y.len() / c) as f64;
    let xhat = |i: usize| (y[i] - mean[i % c]) * inv_std[i % c];
    let mut sum_g = vec![0.0; c];
    let mut sum_gx = vec![0.0; c];
    for i in 0..y.len() {
        sum_g[i % c] += g[i];
        sum_gx[i % c] += g[i] * xhat(i);
    }
    (0..y.len())
        .map(|i| {
            let ch = i % c;
            gamma[ch] * inv_std[ch] / m * (m * g[i] - sum_g[ch] - xhat(i) * sum_gx[ch])
        })
        .collect()
}

#[test]
fn intermediate_gradients_match_plain_loops() {
    for c in [case(net_a(), 2, 21), case(net_b(), 3, 22)] {
        let r = c.run();
        let (f, g, p) = (&r.forward, &r.grads, &c.params);
        let n = c.labels.len();
        let classes = c.net.classes;

        // Head: dlogits = (softmax − onehot)/N; fc grads; dpooled; d last out.
        let logits = &f["logits"];
        let mut dlogits = vec![0.0; logits.len()];
        for (img, row) in logits.chunks_exact(classes).enumerate() {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
            for k in 0..classes {
                let onehot = if c.labels[img] == k { 1.0 } else { 0.0 };
                dlogits[img * classes + k] = (((row[k] - m).exp() / z) - onehot) / n as f64;
            }
        }
        assert_close("d logits", &g["logits"], &dlogits, 1e-12);
        let pooled = &f["pooled"];
        let feat = pooled.len() / n;
        let mut dfw = vec![0.0; classes * feat];
        let mut dfb = vec![0.0; classes];
        let mut dpooled = vec![0.0; n * feat];
        for img in 0..n {
            for k in 0..classes {
                let d = dlogits[img * classes + k];
                dfb[k] += d;
                for ch in 0..feat {
                    dfw[k * feat + ch] += d * pooled[img * feat + ch];
                    dpooled[img * feat + ch] += d * p["fc.w"][k * feat + ch];
                }
            }
        }
        assert_close("d fc.w", &g["fc.w"], &dfw, 1e-12);
        assert_close("d fc.b", &g["fc.b"], &dfb, 1e-12);
        assert_close("d pooled", &g["pooled"], &dpooled, 1e-12);
        let last_stage = c.net.stages.len() - 1;
        let last_block = c.net.stages[last_stage].len() - 1;
        let last = format!("s{last_stage}.b{last_block}");
        let dout = &g[&format!("{last}.out")];
        let hw = dout.len() / (n * feat);
        let want: Vec<f64> = (0..dout.len())
            .map(|i| dpooled[(i / (hw * feat)) * feat + i % feat] / hw as f64)
            .collect();
        assert_close("d last out", dout, &want, 1e-12);

        // Last block: d(BN_last out) = d(down BN out) = dout · [out > 0]; BN backward
        // gives d y of the last main conv and of down; gamma/beta grads by hand.
        let out = &f[&format!("{last}.out")];
        let gbn: Vec<f64> = dout
            .iter()
            .zip(out)
            .map(|(d, o)| if *o > 0.0 { *d } else { 0.0 })
            .collect();
        let last_conv = match c.net.stages[last_stage][last_block].kind {
            RefBlockKind::Basic => "conv2",
            RefBlockKind::Bottleneck => "conv3",
        };
        for l in [format!("{last}.{last_conv}"), format!("{last}.down")] {
            let y = &f[&format!("{l}.y")];
            let (mean, inv_std) = (&f[&format!("{l}.mean")], &f[&format!("{l}.inv_std")]);
            let gamma = &p[&format!("{l}.gamma")];
            let ch = mean.len();
            let mut dgamma = vec![0.0; ch];
            let mut dbeta = vec![0.0; ch];
            for i in 0..y.len() {
                dbeta[i % ch] += gbn[i];
                dgamma[i % ch] += gbn[i] * (y[i] - mean[i % ch]) * inv_std[i % ch];
            }
            assert_close(
                &format!("d {l}.beta"),
                &g[&format!("{l}.beta")],
                &dbeta,
                1e-11,
            );
            assert_close(
                &format!("d {l}.gamma"),
                &g[&format!("{l}.gamma")],
                &dgamma,
                1e-11,
            );
            let dy = bn_backward(y, &gbn, mean, inv_std, gamma);
            assert_close(&format!("d {l}.y"), &g[&format!("{l}.y")], &dy, 1e-11);
        }

        // Stem: d y from d stem.out through ReLU and BN.
        let so = &f["stem.out"];
        let gs: Vec<f64> = g["stem.out"]
            .iter()
            .zip(so)
            .map(|(d, o)| if *o > 0.0 { *d } else { 0.0 })
            .collect();
        let dy = bn_backward(
            &f["stem.y"],
            &gs,
            &f["stem.mean"],
            &f["stem.inv_std"],
            &p["stem.gamma"],
        );
        assert_close("d stem.y", &g["stem.y"], &dy, 1e-11);

        // Every conv: dW = Σ dY ⊗ X (weight gradient from the exported y gradient).
        let mut data_grads: Named = Named::new();
        for (l, r_, stride, pad) in conv_geometry(&c.net) {
            let xv = &f[&format!("{l}.x")];
            let yv = &f[&format!("{l}.y")];
            let w = &p[&format!("{l}.w")];
            let k = c.params[&format!("{l}.gamma")].len();
            let cin = w.len() / (k * r_ * r_);
            let xh = ((xv.len() / (n * cin)) as f64).sqrt().round() as usize;
            let oh = ((yv.len() / (n * k)) as f64).sqrt().round() as usize;
            let x = Act {
                n,
                h: xh,
                w: xh,
                c: cin,
                v: xv.clone(),
            };
            let dyv = &g[&format!("{l}.y")];
            let mut dw = vec![0.0; w.len()];
            let mut dx = vec![0.0; xv.len()];
            for_each_tap(&x, oh, k, r_, stride, pad, |xi, yi, wi| {
                dw[wi] += dyv[yi] * xv[xi];
                dx[xi] += dyv[yi] * w[wi];
            });
            assert_close(&format!("d {l}.w"), &g[&format!("{l}.w")], &dw, 1e-11);
            data_grads.insert(l, dx);
        }

        // Data gradients (candle: transposed conv with output padding): for a block whose
        // input is stem.out (net a, no pool), d stem.out = dX(conv1) + dX(down).
        if c.net.stem.max_pool.is_none() {
            let b = &c.net.stages[0][0];
            assert!(b.projection);
            let want: Vec<f64> = data_grads["s0.b0.conv1"]
                .iter()
                .zip(&data_grads["s0.b0.down"])
                .map(|(a, b)| a + b)
                .collect();
            assert_close("d stem.out", &g["stem.out"], &want, 1e-11);
        }
        // Inside blocks: d (conv2 input) = dX(conv2) restricted by ReLU mask, and BN
        // backward must then give conv1's d y.
        for (i, stage) in c.net.stages.iter().enumerate() {
            for (j, _) in stage.iter().enumerate() {
                let l = format!("s{i}.b{j}");
                let (a, b) = (format!("{l}.conv1"), format!("{l}.conv2"));
                let act = &f[&format!("{b}.x")];
                let gin: Vec<f64> = data_grads[&b]
                    .iter()
                    .zip(act)
                    .map(|(d, o)| if *o > 0.0 { *d } else { 0.0 })
                    .collect();
                let dy = bn_backward(
                    &f[&format!("{a}.y")],
                    &gin,
                    &f[&format!("{a}.mean")],
                    &f[&format!("{a}.inv_std")],
                    &p[&format!("{a}.gamma")],
                );
                assert_close(&format!("d {a}.y"), &g[&format!("{a}.y")], &dy, 1e-10);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Max-pool op.

#[test]
fn max_pool_tie_rule_and_negative_infinity_padding() {
    let dev = Device::Cpu;
    // One 4×4 plane, 3×3 / 2 / pad 1 → 2×2 windows:
    // (0,0): rows 0–1, cols 0–1   (1,0): rows 1–3, cols 0–1
    // (0,1): rows 0–1, cols 1–3   (1,1): rows 1–3, cols 1–3
    #[rustfmt::skip]
    let x = vec![
        0.0, 0.0, 2.0, 2.0,
        0.0, 0.0, 1.0, 2.0,
        5.0, 0.0, 0.0, 0.0,
        5.0, 0.0, 0.0, 0.0,
    ];
    let xv = Var::from_vec(x, (1, 1, 4, 4), &dev).unwrap();
    let pool = RefPool {
        kernel: 3,
        stride: 2,
        pad: 1,
    };
    let y = max_pool2d(xv.as_tensor(), &pool).unwrap();
    assert_eq!(
        y.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        vec![0.0, 2.0, 5.0, 2.0]
    );
    let wts = Tensor::from_vec(vec![1.0, 10.0, 100.0, 1000.0], (1, 1, 2, 2), &dev).unwrap();
    let grads = (y * wts).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = grads
        .get(xv.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    // (0,0): all zeros → first element (0,0). (0,1): 2.0 at (0,2) before (0,3) and (1,3).
    // (1,0): 5.0 at (2,0) before (3,0). (1,1): 2.0 at (1,3) is the only 2 in rows 1–3.
    #[rustfmt::skip]
    let want = vec![
        1.0, 0.0, 10.0, 0.0,
        0.0, 0.0, 0.0, 1000.0,
        100.0, 0.0, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ];
    assert_eq!(dx, want);

    // Padding never wins: all-negative input keeps negative maxima.
    let neg = Tensor::from_vec(vec![-3.0, -2.0, -4.0, -1.0], (1, 1, 2, 2), &dev).unwrap();
    let y = max_pool2d(&neg, &pool).unwrap();
    assert_eq!(
        y.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        vec![-1.0]
    );
}

// ---------------------------------------------------------------------------------------
// Errors, never panics.

#[test]
fn bad_input_gives_errors() {
    let c = case(net_b(), 2, 31);
    let call = |net: &RefNet, p: &Named, im: &[f64], lab: &[usize]| run(net, p, im, lab).err();

    let mut p = c.params.clone();
    p.remove("s1.b0.down.gamma");
    let e = call(&c.net, &p, &c.images, &c.labels).expect("missing parameter must fail");
    assert!(e.contains("s1.b0.down.gamma"), "{e}");
    assert!(loss(&c.net, &p, &c.images, &c.labels).is_err());

    let mut p = c.params.clone();
    p.get_mut("stem.w").unwrap().pop();
    let e = call(&c.net, &p, &c.images, &c.labels).expect("short parameter must fail");
    assert!(e.contains("stem.w"), "{e}");

    let e = call(&c.net, &c.params, &c.images[1..], &c.labels).expect("short images");
    assert!(e.contains("images"), "{e}");
    let e = call(&c.net, &c.params, &c.images, &[0, 5]).expect("label out of range");
    assert!(e.contains("label"), "{e}");
    assert!(call(&c.net, &c.params, &[], &[]).is_some());

    let mut net = c.net.clone();
    net.stages[1][0].in_ch = 8;
    let e = call(&net, &c.params, &c.images, &c.labels).expect("channel mismatch");
    assert!(e.contains("s1.b0"), "{e}");
    let mut net = c.net.clone();
    net.stages[1][0].projection = false;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());
    let mut net = c.net.clone();
    net.stem.max_pool.as_mut().unwrap().pad = 3;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());
    let mut net = c.net.clone();
    net.stem.stride = 0;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());
    let mut net = c.net.clone();
    net.stem.kernel = 30;
    assert!(call(&net, &c.params, &c.images, &c.labels).is_some());

    // A single value per channel in training-mode BN (batch 1, 1×1 after the strides).
    let one = case(
        RefNet {
            hw: 1,
            stem: RefStem {
                out: 2,
                kernel: 1,
                stride: 1,
                pad: 0,
                max_pool: None,
            },
            stages: vec![],
            ..net_a()
        },
        1,
        32,
    );
    let e = one.run_err();
    assert!(e.contains("BatchNorm"), "{e}");
}

impl Case {
    fn run_err(&self) -> String {
        run(&self.net, &self.params, &self.images, &self.labels).expect_err("must fail")
    }
}

#[test]
fn net_without_blocks_and_param_shapes() {
    let net = RefNet {
        stages: vec![],
        ..net_a()
    };
    let shapes = param_shapes(&net);
    let names: Vec<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "stem.w",
            "stem.gamma",
            "stem.beta",
            "stem.running_mean",
            "stem.running_var",
            "fc.w",
            "fc.b"
        ]
    );
    assert_eq!(shapes[0].1, vec![5, 3, 3, 3]);
    assert_eq!(shapes[5].1, vec![4, 5]);
    let c = case(net, 2, 41);
    let r = c.run();
    let hand = hand_forward(&c);
    assert_close("logits", &r.forward["logits"], &hand["logits"], 1e-10);
    let shapes_b = param_shapes(&net_b());
    let w = |n: &str| shapes_b.iter().find(|(m, _)| m == n).unwrap().1.clone();
    assert_eq!(w("stem.w"), vec![7, 5, 5, 3]);
    assert_eq!(w("s0.b0.conv1.w"), vec![3, 1, 1, 7]);
    assert_eq!(w("s1.b0.conv2.w"), vec![5, 3, 3, 5]);
    assert_eq!(w("s1.b0.conv3.w"), vec![9, 1, 1, 5]);
    assert_eq!(w("s1.b0.down.w"), vec![9, 1, 1, 7]);
    assert_eq!(w("fc.w"), vec![5, 9]);
}
