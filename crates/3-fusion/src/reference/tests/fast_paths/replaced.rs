//! The straightforward implementations the fast paths replaced: per-element maps, per-row
//! sums, per-tap gathers; the oracle of `super`'s bit-for-bit tests.

use super::*;

pub(super) fn old_map<U: Send>(
    len: usize,
    c: usize,
    f: impl Fn(usize, usize) -> U + Sync + Send,
) -> Vec<U> {
    (0..len)
        .into_par_iter()
        .with_min_len(4096)
        .map(|i| f(i, i % c))
        .collect()
}

pub(super) fn old_channel_sums<const V: usize>(
    rows: usize,
    c: usize,
    add_row: impl Fn(usize, &mut [[f64; V]]) + Sync + Send,
) -> Vec<[f64; V]> {
    let chunks = rows.div_ceil(512);
    let partials: Vec<Vec<[f64; V]>> = (0..chunks)
        .into_par_iter()
        .map(|chunk| {
            let mut acc = vec![[0.0; V]; c];
            for row in chunk * 512..((chunk + 1) * 512).min(rows) {
                add_row(row, &mut acc);
            }
            acc
        })
        .collect();
    let mut total = vec![[0.0; V]; c];
    for partial in &partials {
        for (t, p) in total.iter_mut().zip(partial) {
            for (tv, pv) in t.iter_mut().zip(p) {
                *tv += pv;
            }
        }
    }
    total
}

pub(super) fn old_bn_apply(
    y: &[f16],
    s: &[f16],
    b: &[f16],
    residual: Residual<'_, f16>,
    act: Activation,
) -> Vec<f16> {
    let c = s.len();
    let (s, b) = (f16::widen_slice(s), f16::widen_slice(b));
    let act = |v: f32| match act {
        Activation::Relu => v.relu(),
        Activation::Identity => v,
    };
    old_map(y.len(), c, |i, ch| {
        let main = y[i].to_acc() * s[ch] + b[ch];
        f16::from_acc(act(match residual {
            Residual::None => main,
            Residual::Add(r) => main + r[i].to_acc(),
            Residual::ScaleBias { r, scale, bias } => {
                main + (r[i].to_acc() * scale[ch].to_acc() + bias[ch].to_acc())
            }
        }))
    })
}

pub(super) fn old_genstats(shape: &Nhwc, y: &[f16]) -> (Vec<f32>, Vec<f32>) {
    let c = shape.c;
    let sums = old_channel_sums::<2>(shape.pixels(), c, |row, acc| {
        for (a, v) in acc.iter_mut().zip(&y[row * c..(row + 1) * c]) {
            let v = v.to_f64();
            a[0] += v;
            a[1] += v * v;
        }
    });
    (
        sums.iter().map(|s| s[0] as f32).collect(),
        sums.iter().map(|s| s[1] as f32).collect(),
    )
}

/// dγ, dβ, a, b, c as `BnBwdCoefficients::compute` computed them.
pub(super) fn old_coefficients(
    shape: &Nhwc,
    y: &[f16],
    dz: &[f16],
    mean: &[f32],
    inv_std: &[f32],
    gamma: &[f32],
) -> [Vec<f32>; 5] {
    let ch = shape.c;
    let sums = old_channel_sums::<2>(shape.pixels(), ch, |row, acc| {
        for k in 0..ch {
            let i = row * ch + k;
            let x_hat = (y[i].to_f64() - f64::from(mean[k])) * f64::from(inv_std[k]);
            let d = dz[i].to_f64();
            acc[k][0] += d * x_hat;
            acc[k][1] += d;
        }
    });
    let m = shape.pixels() as f64;
    let mut out: [Vec<f32>; 5] = Default::default();
    for (k, [dgamma, dbeta]) in sums.into_iter().enumerate() {
        let (g, is, mu) = (
            f64::from(gamma[k]),
            f64::from(inv_std[k]),
            f64::from(mean[k]),
        );
        let a = g * is;
        let b = -g * is * is * dgamma / m;
        let c = -g * is * dbeta / m - b * mu;
        for (o, v) in out.iter_mut().zip([dgamma, dbeta, a, b, c]) {
            o.push(v as f32);
        }
    }
    out
}

pub(super) fn old_dbn_apply(dz: &[f16], y: &[f16], a: &[f32], b: &[f32], c: &[f32]) -> Vec<f16> {
    old_map(dz.len(), a.len(), |i, ch| {
        f16::from_acc(dz[i].to_acc() * a[ch] + y[i].to_acc() * b[ch] + c[ch])
    })
}

/// The replaced column gather and GEMM of the convolutions (per-tap pixel closures).
pub(super) fn old_gather(
    src: &[f32],
    cin: usize,
    taps: usize,
    first: usize,
    n_rows: usize,
    pixel: &(impl Fn(usize, usize) -> Option<usize> + Sync),
) -> Vec<f32> {
    let mut col = vec![0f32; n_rows * taps * cin];
    for (i, row) in col.chunks_exact_mut(taps * cin).enumerate() {
        for (tap, dst) in row.chunks_exact_mut(cin).enumerate() {
            if let Some(pix) = pixel(first + i, tap) {
                dst.copy_from_slice(&src[pix * cin..][..cin]);
            }
        }
    }
    col
}

pub(super) fn old_fprop_pixel(p: ConvParams) -> impl Fn(usize, usize) -> Option<usize> + Sync {
    move |row, tap| {
        let (out_h, out_w) = (p.out_h(), p.out_w());
        let (n, rem) = (row / (out_h * out_w), row % (out_h * out_w));
        let (op, oq) = (rem / out_w, rem % out_w);
        let ih = (op * p.stride_h + (tap / p.s) * p.dil_h).checked_sub(p.pad_h)?;
        let iw = (oq * p.stride_w + (tap % p.s) * p.dil_w).checked_sub(p.pad_w)?;
        (ih < p.h && iw < p.w).then_some((n * p.h + ih) * p.w + iw)
    }
}

pub(super) fn old_dgrad_pixel(p: ConvParams) -> impl Fn(usize, usize) -> Option<usize> + Sync {
    move |row, tap| {
        let (out_h, out_w) = (p.out_h(), p.out_w());
        let (n, rem) = (row / (p.h * p.w), row % (p.h * p.w));
        let (ih, iw) = (rem / p.w, rem % p.w);
        let th = (ih + p.pad_h).checked_sub((tap / p.s) * p.dil_h)?;
        let tw = (iw + p.pad_w).checked_sub((tap % p.s) * p.dil_w)?;
        if th % p.stride_h != 0 || tw % p.stride_w != 0 {
            return None;
        }
        let (op, oq) = (th / p.stride_h, tw / p.stride_w);
        (op < out_h && oq < out_w).then_some((n * out_h + op) * out_w + oq)
    }
}

pub(super) fn old_gather_gemm(
    rows: usize,
    src: &[f32],
    cin: usize,
    taps: usize,
    pixel: impl Fn(usize, usize) -> Option<usize> + Sync,
    weights: Mat<'_, f32>,
    cout: usize,
) -> Vec<f32> {
    let depth = taps * cin;
    let mut out = vec![0f32; rows * cout];
    for (tile, out_tile) in out.chunks_mut(128 * cout).enumerate() {
        let n_rows = out_tile.len() / cout;
        let col = old_gather(src, cin, taps, tile * 128, n_rows, &pixel);
        f32::gemm(
            n_rows,
            depth,
            cout,
            Mat::row_major(&col, depth),
            weights,
            0.0,
            out_tile,
        )
        .unwrap();
    }
    out
}

pub(super) fn old_fprop(p: &ConvParams, x: &[f32], w: &[f32]) -> Vec<f32> {
    let depth = p.r * p.s * p.c;
    let w_t = Mat {
        data: w,
        row_stride: 1,
        col_stride: depth,
    };
    let rows = p.n * p.out_h() * p.out_w();
    old_gather_gemm(rows, x, p.c, p.r * p.s, old_fprop_pixel(*p), w_t, p.k)
}

pub(super) fn old_dgrad(p: &ConvParams, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let taps = p.r * p.s;
    let mut w_r = vec![0f32; taps * p.k * p.c];
    for (k, filter) in w.chunks_exact(taps * p.c).enumerate() {
        for (tap, weights) in filter.chunks_exact(p.c).enumerate() {
            w_r[(tap * p.k + k) * p.c..][..p.c].copy_from_slice(weights);
        }
    }
    let rows = p.n * p.h * p.w;
    let w_r = Mat::row_major(&w_r, p.c);
    old_gather_gemm(rows, dy, p.k, taps, old_dgrad_pixel(*p), w_r, p.c)
}

pub(super) fn old_wgrad(p: &ConvParams, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let (k, taps) = (p.k, p.r * p.s);
    let depth = taps * p.c;
    let rows = p.n * p.out_h() * p.out_w();
    let tiles = rows.div_ceil(128);
    let tiles_per_group = tiles.div_ceil(8);
    let groups = tiles.div_ceil(tiles_per_group);
    let pixel = old_fprop_pixel(*p);
    let mut total: Option<Vec<f32>> = None;
    for group in 0..groups {
        let mut dw = vec![0f32; k * depth];
        for tile in group * tiles_per_group..((group + 1) * tiles_per_group).min(tiles) {
            let first = tile * 128;
            let n_rows = 128.min(rows - first);
            let col = old_gather(x, p.c, taps, first, n_rows, &pixel);
            let dy_t = Mat {
                data: &dy[first * k..(first + n_rows) * k],
                row_stride: 1,
                col_stride: k,
            };
            f32::gemm(
                k,
                n_rows,
                depth,
                dy_t,
                Mat::row_major(&col, depth),
                1.0,
                &mut dw,
            )
            .unwrap();
        }
        match &mut total {
            None => total = Some(dw),
            Some(t) => t.iter_mut().zip(dw).for_each(|(t, v)| *t += v),
        }
    }
    total.unwrap()
}

/// One phase of the replaced strided dgrad.
struct OldPhase {
    ihs: Vec<usize>,
    iws: Vec<usize>,
    taps: Vec<(usize, usize)>,
    w: Vec<f32>,
}

/// The strided dgrad by phases as it was: the whole `dx` in FP32, images in parallel.
pub(super) fn old_dgrad_phases(p: &ConvParams, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let (c, k) = (p.c, p.k);
    let (out_h, out_w) = (p.out_h(), p.out_w());
    let mut phases = Vec::with_capacity(p.stride_h * p.stride_w);
    for a in 0..p.stride_h {
        for b in 0..p.stride_w {
            let ihs: Vec<usize> = (0..p.h)
                .filter(|ih| (ih + p.pad_h) % p.stride_h == a)
                .collect();
            let iws: Vec<usize> = (0..p.w)
                .filter(|iw| (iw + p.pad_w) % p.stride_w == b)
                .collect();
            let mut taps = Vec::new();
            for r in (0..p.r).filter(|r| (r * p.dil_h) % p.stride_h == a) {
                for s in (0..p.s).filter(|s| (s * p.dil_w) % p.stride_w == b) {
                    taps.push((r, s));
                }
            }
            let mut wp = vec![0.0; taps.len() * k * c];
            for (t, &(r, s)) in taps.iter().enumerate() {
                for kk in 0..k {
                    let src = ((kk * p.r + r) * p.s + s) * c;
                    wp[(t * k + kk) * c..][..c].copy_from_slice(&w[src..src + c]);
                }
            }
            phases.push(OldPhase {
                ihs,
                iws,
                taps,
                w: wp,
            });
        }
    }
    let image = p.h * p.w * c;
    let mut dx = vec![0.0; p.n * image];
    if image == 0 {
        return dx;
    }
    dx.par_chunks_mut(image).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(col, out), (n, dx_n)| {
            let dy_n = &dy[n * out_h * out_w * k..(n + 1) * out_h * out_w * k];
            for ph in &phases {
                let (rows, depth) = (ph.ihs.len() * ph.iws.len(), ph.taps.len() * k);
                if rows == 0 || depth == 0 {
                    // No tap reaches these pixels: their gradient stays zero.
                    continue;
                }
                col.clear();
                for &ih in &ph.ihs {
                    for &iw in &ph.iws {
                        for &(r, s) in &ph.taps {
                            // (ih + pad_h - r·dil_h) is a multiple of stride_h here.
                            let op = (ih + p.pad_h)
                                .checked_sub(r * p.dil_h)
                                .map(|t| t / p.stride_h)
                                .filter(|&op| op < out_h);
                            let oq = (iw + p.pad_w)
                                .checked_sub(s * p.dil_w)
                                .map(|t| t / p.stride_w)
                                .filter(|&oq| oq < out_w);
                            match (op, oq) {
                                (Some(op), Some(oq)) => {
                                    col.extend_from_slice(&dy_n[(op * out_w + oq) * k..][..k])
                                }
                                _ => col.resize(col.len() + k, 0.0),
                            }
                        }
                    }
                }
                out.resize(rows * c, 0.0);
                f32::gemm(
                    rows,
                    depth,
                    c,
                    Mat::row_major(col, depth),
                    Mat::row_major(&ph.w, c),
                    0.0,
                    &mut out[..rows * c],
                )
                .unwrap();
                let mut src = out.chunks_exact(c);
                for &ih in &ph.ihs {
                    for &iw in &ph.iws {
                        if let Some(v) = src.next() {
                            dx_n[(ih * p.w + iw) * c..][..c].copy_from_slice(v);
                        }
                    }
                }
            }
        },
    );
    dx
}
