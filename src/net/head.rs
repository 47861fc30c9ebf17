//! The network head in exact arithmetic: global average pool, FC, mean softmax cross-entropy,
//! and their gradients. All in `f64`; the f64-mode network runs (and the tests against an
//! independent reference) use it. The training loop's FP16 head is amp's
//! [`range`](crate::amp::range) twins of the CUDA head kernels. Test scaffolding, built only
//! with the crate's `testing` feature.

use cudnn_cbr_fusion::{Error, Result};

/// The head's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadDims {
    /// Batch.
    pub n: usize,
    /// Pixels per image of the pooled activation.
    pub pixels: usize,
    /// Channels (features).
    pub features: usize,
    /// Classes.
    pub classes: usize,
}

/// Everything the head computes for one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadPass {
    /// Pooled features `[N, features]`.
    pub pooled: Vec<f64>,
    /// Logits `[N, classes]`.
    pub logits: Vec<f64>,
    /// Mean softmax cross-entropy.
    pub loss: f64,
    /// `∂loss/∂logits`, times the loss scale.
    pub dlogits: Vec<f64>,
    /// `∂/∂fc.w` `[classes, features]`.
    pub dfc_w: Vec<f64>,
    /// `∂/∂fc.b` `[classes]`.
    pub dfc_b: Vec<f64>,
    /// `∂/∂pooled`.
    pub dpooled: Vec<f64>,
    /// `∂/∂a`, the activation's gradient `[N, pixels, features]`.
    pub da: Vec<f64>,
}

fn check(name: &str, len: usize, want: usize) -> Result<()> {
    if len == want {
        Ok(())
    } else {
        Err(Error::Buffer {
            name: name.into(),
            problem: format!("has {len} elements, expected {want}"),
        })
    }
}

/// The head's forward and backward on the activation `a` (NHWC, `[N, pixels, features]`),
/// FC weight `[classes, features]` and bias, integer labels, with the gradients scaled by
/// `scale` (the loss scale; 1 for the true gradient).
pub fn run(
    d: HeadDims,
    a: &[f64],
    fc_w: &[f64],
    fc_b: &[f64],
    labels: &[usize],
    scale: f64,
) -> Result<HeadPass> {
    check("a", a.len(), d.n * d.pixels * d.features)?;
    check("fc.w", fc_w.len(), d.classes * d.features)?;
    check("fc.b", fc_b.len(), d.classes)?;
    check("labels", labels.len(), d.n)?;
    if let Some(&bad) = labels.iter().find(|&&l| l >= d.classes) {
        return Err(Error::Buffer {
            name: "labels".into(),
            problem: format!("holds class {bad}, but there are {} classes", d.classes),
        });
    }
    let (f, k) = (d.features, d.classes);
    let mut pooled = vec![0f64; d.n * f];
    for (img, p) in a.chunks_exact(d.pixels * f).zip(pooled.chunks_exact_mut(f)) {
        for px in img.chunks_exact(f) {
            for (acc, v) in p.iter_mut().zip(px) {
                *acc += v;
            }
        }
        for v in p.iter_mut() {
            *v /= d.pixels as f64;
        }
    }
    let mut logits = vec![0f64; d.n * k];
    for (p, l) in pooled.chunks_exact(f).zip(logits.chunks_exact_mut(k)) {
        for (j, out) in l.iter_mut().enumerate() {
            *out = fc_b[j]
                + p.iter()
                    .zip(&fc_w[j * f..(j + 1) * f])
                    .map(|(x, w)| x * w)
                    .sum::<f64>();
        }
    }
    let mut loss = 0f64;
    let mut dlogits = vec![0f64; d.n * k];
    for ((l, dl), &label) in logits
        .chunks_exact(k)
        .zip(dlogits.chunks_exact_mut(k))
        .zip(labels)
    {
        let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = l.iter().map(|v| (v - max).exp()).sum();
        let lse = max + sum.ln();
        loss += lse - l[label];
        for (j, g) in dl.iter_mut().enumerate() {
            let p = (l[j] - lse).exp();
            *g = (p - if j == label { 1.0 } else { 0.0 }) * scale / d.n as f64;
        }
    }
    loss /= d.n as f64;
    let mut dfc_w = vec![0f64; k * f];
    let mut dfc_b = vec![0f64; k];
    let mut dpooled = vec![0f64; d.n * f];
    for ((dl, p), dp) in dlogits
        .chunks_exact(k)
        .zip(pooled.chunks_exact(f))
        .zip(dpooled.chunks_exact_mut(f))
    {
        for j in 0..k {
            dfc_b[j] += dl[j];
            for c in 0..f {
                dfc_w[j * f + c] += dl[j] * p[c];
                dp[c] += dl[j] * fc_w[j * f + c];
            }
        }
    }
    let mut da = vec![0f64; a.len()];
    for (img, dp) in da
        .chunks_exact_mut(d.pixels * f)
        .zip(dpooled.chunks_exact(f))
    {
        for px in img.chunks_exact_mut(f) {
            for (v, g) in px.iter_mut().zip(dp) {
                *v = g / d.pixels as f64;
            }
        }
    }
    Ok(HeadPass {
        pooled,
        logits,
        loss,
        dlogits,
        dfc_w,
        dfc_b,
        dpooled,
        da,
    })
}
