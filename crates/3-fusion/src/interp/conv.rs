//! Convolutions as cuDNN defines them (cross-correlation mode), written as plain loop nests
//! over logical N,C,H,W (activations) and K,C,R,S (filters) values:
//!
//! - fprop: `y[n,k,p,q] = Σ_{c,r,s} x[n,c,p·u − pad_h + r·dil_h, q·v − pad_w + s·dil_w]·w[k,c,r,s]`
//!   (terms outside the input are the zero padding);
//! - dgrad: `dx[n,c,h,w] = Σ_{k,r,s} dy[n,k,p,q]·w[k,c,r,s]` over the `(p,q)` whose fprop
//!   window put filter tap `(r,s)` on `(h,w)`;
//! - wgrad: `dw[k,c,r,s] = Σ_{n,p,q} dy[n,k,p,q]·x[n,c,h,w]`, same correspondence.
//!
//! Products of FP32 values are exact in `f64`, and the sums run in `f64`, rounded to FP32
//! once: the result does not depend on the summation order or the thread split.

use super::error::{node_err, Result};
use crate::graph::ConvAttrs;
use rayon::prelude::*;

/// The geometry of one conv node, checked against its tensors.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    r: usize,
    s: usize,
    p: usize,
    q: usize,
    pad: [i64; 2],
    stride: [i64; 2],
    dil: [i64; 2],
}

impl Geometry {
    /// From x `[N,C,H,W]`, w `[K,C,R,S]` and y `[N,K,P,Q]` dims; `node` names errors.
    pub fn new(
        node: (usize, &'static str),
        x: [usize; 4],
        w: [usize; 4],
        y: [usize; 4],
        attrs: &ConvAttrs,
    ) -> Result<Self> {
        let err = |m: String| node_err(node.0, node.1, m);
        let [n, c, h, wd] = x;
        let [k, wc, r, s] = w;
        if wc != c {
            return Err(err(format!(
                "filter has {wc} input channels, the input {c}"
            )));
        }
        if attrs.stride.iter().any(|&v| v < 1) || attrs.dilation.iter().any(|&v| v < 1) {
            return Err(err(format!(
                "stride {:?} and dilation {:?} must be positive",
                attrs.stride, attrs.dilation
            )));
        }
        if attrs
            .pre_padding
            .iter()
            .chain(&attrs.post_padding)
            .any(|&v| v < 0)
        {
            return Err(err("negative padding".into()));
        }
        let p = attrs.out_extent(0, h as i64, r as i64);
        let q = attrs.out_extent(1, wd as i64, s as i64);
        let expected = [Some(n as i64), Some(k as i64), p, q];
        let got = y.map(|v| Some(v as i64));
        if expected != got {
            return Err(err(format!(
                "output dims {y:?} do not match input {x:?}, filter {w:?} and {attrs:?} \
                 (expected {expected:?})"
            )));
        }
        Ok(Geometry {
            n,
            c,
            h,
            w: wd,
            k,
            r,
            s,
            p: y[2],
            q: y[3],
            pad: attrs.pre_padding,
            stride: attrs.stride,
            dil: attrs.dilation,
        })
    }

    /// The input row (or column, `d` = 1) that output position `o` reads with filter tap `t`.
    fn input_pos(&self, d: usize, o: usize, t: usize) -> Option<usize> {
        let limit = if d == 0 { self.h } else { self.w };
        let i = o as i64 * self.stride[d] - self.pad[d] + t as i64 * self.dil[d];
        (0..limit as i64).contains(&i).then_some(i as usize)
    }

    fn xi(&self, n: usize, c: usize, h: usize, w: usize) -> usize {
        ((n * self.c + c) * self.h + h) * self.w + w
    }
    fn wi(&self, k: usize, c: usize, r: usize, s: usize) -> usize {
        ((k * self.c + c) * self.r + r) * self.s + s
    }
    fn yi(&self, n: usize, k: usize, p: usize, q: usize) -> usize {
        ((n * self.k + k) * self.p + p) * self.q + q
    }

    /// y = fprop(x, w), `[N,K,P,Q]`.
    pub fn fprop(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let g = *self;
        let mut y = vec![0f32; g.n * g.k * g.p * g.q];
        // One (image, output channel) plane per task.
        y.par_chunks_mut(g.p * g.q)
            .enumerate()
            .for_each(|(plane, out)| {
                let (n, k) = (plane / g.k, plane % g.k);
                for p in 0..g.p {
                    for q in 0..g.q {
                        let mut acc = 0f64;
                        for c in 0..g.c {
                            for r in 0..g.r {
                                let Some(h) = g.input_pos(0, p, r) else {
                                    continue;
                                };
                                for s in 0..g.s {
                                    let Some(wx) = g.input_pos(1, q, s) else {
                                        continue;
                                    };
                                    acc += f64::from(x[g.xi(n, c, h, wx)])
                                        * f64::from(w[g.wi(k, c, r, s)]);
                                }
                            }
                        }
                        out[p * g.q + q] = acc as f32;
                    }
                }
            });
        y
    }

    /// dx = dgrad(dy, w), `[N,C,H,W]`.
    pub fn dgrad(&self, dy: &[f32], w: &[f32]) -> Vec<f32> {
        let g = *self;
        let mut dx = vec![0f32; g.n * g.c * g.h * g.w];
        dx.par_chunks_mut(g.h * g.w)
            .enumerate()
            .for_each(|(plane, out)| {
                let (n, c) = (plane / g.c, plane % g.c);
                for h in 0..g.h {
                    for wx in 0..g.w {
                        let mut acc = 0f64;
                        for r in 0..g.r {
                            let Some(p) = g.output_pos(0, h, r) else {
                                continue;
                            };
                            for s in 0..g.s {
                                let Some(q) = g.output_pos(1, wx, s) else {
                                    continue;
                                };
                                for k in 0..g.k {
                                    acc += f64::from(dy[g.yi(n, k, p, q)])
                                        * f64::from(w[g.wi(k, c, r, s)]);
                                }
                            }
                        }
                        out[h * g.w + wx] = acc as f32;
                    }
                }
            });
        dx
    }

    /// The output position whose window puts tap `t` on input position `i` (dim `d`), if any.
    fn output_pos(&self, d: usize, i: usize, t: usize) -> Option<usize> {
        let limit = if d == 0 { self.p } else { self.q };
        let num = i as i64 + self.pad[d] - t as i64 * self.dil[d];
        if num < 0 || num % self.stride[d] != 0 {
            return None;
        }
        let o = num / self.stride[d];
        (o < limit as i64).then_some(o as usize)
    }

    /// dw = wgrad(x, dy), `[K,C,R,S]`.
    pub fn wgrad(&self, x: &[f32], dy: &[f32]) -> Vec<f32> {
        let g = *self;
        let mut dw = vec![0f32; g.k * g.c * g.r * g.s];
        dw.par_chunks_mut(g.c * g.r * g.s)
            .enumerate()
            .for_each(|(k, out)| {
                for c in 0..g.c {
                    for r in 0..g.r {
                        for s in 0..g.s {
                            let mut acc = 0f64;
                            for n in 0..g.n {
                                for p in 0..g.p {
                                    let Some(h) = g.input_pos(0, p, r) else {
                                        continue;
                                    };
                                    for q in 0..g.q {
                                        let Some(wx) = g.input_pos(1, q, s) else {
                                            continue;
                                        };
                                        acc += f64::from(dy[g.yi(n, k, p, q)])
                                            * f64::from(x[g.xi(n, c, h, wx)]);
                                    }
                                }
                            }
                            out[(c * g.r + r) * g.s + s] = acc as f32;
                        }
                    }
                }
            });
        dw
    }
}
