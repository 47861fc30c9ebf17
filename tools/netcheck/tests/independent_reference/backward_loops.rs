//! Exported intermediate gradients against plain-loop backward formulas.

use super::*;

/// Conv geometry of every layer, from the spec: (name, kernel, stride, pad).
pub(super) fn conv_geometry(net: &RefNet) -> Vec<(String, usize, usize, usize)> {
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
pub(super) fn for_each_tap(
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
pub(super) fn bn_backward(
    y: &[f64],
    g: &[f64],
    mean: &[f64],
    inv_std: &[f64],
    gamma: &[f64],
) -> Vec<f64> {
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
pub(super) fn intermediate_gradients_match_plain_loops() {
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
