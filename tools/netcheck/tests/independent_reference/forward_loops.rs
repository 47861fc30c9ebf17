//! Plain-loop forward, NHWC/KRSC, written from the spec.

use super::*;

#[derive(Clone)]
pub(super) struct Act {
    pub(super) n: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) c: usize,
    pub(super) v: Vec<f64>,
}

impl Act {
    fn at(&self, n: usize, y: usize, x: usize, c: usize) -> f64 {
        self.v[((n * self.h + y) * self.w + x) * self.c + c]
    }
}

pub(super) fn conv_loop(x: &Act, wt: &[f64], k: usize, r: usize, stride: usize, pad: usize) -> Act {
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

pub(super) struct BnHand {
    pub(super) out: Act,
    pub(super) mean: Vec<f64>,
    pub(super) var: Vec<f64>,
    pub(super) inv_std: Vec<f64>,
}

pub(super) fn bn_loop(y: &Act, gamma: &[f64], beta: &[f64], eps: f64) -> BnHand {
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

pub(super) fn relu_loop(mut a: Act) -> Act {
    for v in &mut a.v {
        *v = v.max(0.0);
    }
    a
}

pub(super) fn pool_loop(x: &Act, p: &RefPool) -> Act {
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
pub(super) fn hand_forward(c: &Case) -> Named {
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
pub(super) fn hand_loss(logits: &[f64], labels: &[usize], classes: usize) -> f64 {
    let mut total = 0.0;
    for (row, &l) in logits.chunks_exact(classes).zip(labels) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln();
        total += lse - row[l];
    }
    total / labels.len() as f64
}

pub(super) fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g:.15e}, want {w:.15e}"
        );
    }
}

/// Keys the brief requires in `forward` and `grads`.
pub(super) fn required_keys(net: &RefNet) -> (Vec<String>, Vec<String>) {
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
pub(super) fn forward_matches_plain_loops() {
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
