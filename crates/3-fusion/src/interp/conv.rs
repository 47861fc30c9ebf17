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
use std::ops::Range;

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

    /// The output positions along dim `d` (0: rows, 1: columns) whose window puts tap `t`
    /// inside the input: a contiguous range, since the input position grows with the output's.
    fn outputs_of_tap(&self, d: usize, t: usize) -> Range<usize> {
        let extent = if d == 0 { self.p } else { self.q };
        let inside = |o: &usize| self.input_pos(d, *o, t).is_some();
        match ((0..extent).find(inside), (0..extent).rev().find(inside)) {
            (Some(first), Some(last)) => first..last + 1,
            _ => 0..0,
        }
    }

    /// `(first input column, column stride)` that output columns `q` read with tap `s`:
    /// column `first + q·stride` for each `q` of [`Self::outputs_of_tap`]`(1, s)`.
    fn column_map(&self, s: usize, first_q: usize) -> (usize, usize) {
        let stride = self.stride[1] as usize;
        let first = self
            .input_pos(1, first_q, s)
            .expect("the first output of a tap's range reads inside the input");
        (first, stride)
    }

    /// y = fprop(x, w), `[N,K,P,Q]`.
    ///
    /// Each output sums its terms in the definition's order (c, then r, then s); the loops
    /// run that order for a whole output row at once, so the innermost loop walks contiguous
    /// columns (the interpreter is the simulated device's arithmetic: its speed is the
    /// simulator's).
    pub fn fprop(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let g = *self;
        let (x, w) = (widen(x), widen(w));
        let taps: Vec<Range<usize>> = (0..g.s).map(|s| g.outputs_of_tap(1, s)).collect();
        let mut y = vec![0f32; g.n * g.k * g.p * g.q];
        // One (image, output channel) plane per task.
        y.par_chunks_mut(g.p * g.q)
            .enumerate()
            .for_each(|(plane, out)| {
                let (n, k) = (plane / g.k, plane % g.k);
                let mut acc = vec![0f64; g.q];
                for (p, out_row) in out.chunks_mut(g.q).enumerate() {
                    acc.fill(0.0);
                    for c in 0..g.c {
                        for r in 0..g.r {
                            let Some(h) = g.input_pos(0, p, r) else {
                                continue;
                            };
                            let x_row = &x[g.xi(n, c, h, 0)..][..g.w];
                            for (s, qs) in taps.iter().enumerate() {
                                if qs.is_empty() {
                                    continue;
                                }
                                let wv = w[g.wi(k, c, r, s)];
                                let (first, stride) = g.column_map(s, qs.start);
                                let xs = x_row[first..].iter().step_by(stride);
                                for (a, xv) in acc[qs.clone()].iter_mut().zip(xs) {
                                    *a += xv * wv;
                                }
                            }
                        }
                    }
                    for (o, a) in out_row.iter_mut().zip(&acc) {
                        *o = *a as f32;
                    }
                }
            });
        y
    }

    /// dx = dgrad(dy, w), `[N,C,H,W]`.
    ///
    /// Each input position sums its terms in the definition's order (r, then s, then k),
    /// over the `(p, q)` whose window put tap `(r, s)` on it; a whole row at once, as in
    /// [`Self::fprop`]. For a tap `s`, output column `q` of its range touches input column
    /// `first + q·stride` and no other, so each position gets at most one term per tap.
    pub fn dgrad(&self, dy: &[f32], w: &[f32]) -> Vec<f32> {
        let g = *self;
        let (dy, w) = (widen(dy), widen(w));
        let taps: Vec<Range<usize>> = (0..g.s).map(|s| g.outputs_of_tap(1, s)).collect();
        let mut dx = vec![0f32; g.n * g.c * g.h * g.w];
        dx.par_chunks_mut(g.h * g.w)
            .enumerate()
            .for_each(|(plane, out)| {
                let (n, c) = (plane / g.c, plane % g.c);
                let mut acc = vec![0f64; g.w];
                for (h, out_row) in out.chunks_mut(g.w).enumerate() {
                    acc.fill(0.0);
                    for r in 0..g.r {
                        let Some(p) = g.output_pos(0, h, r) else {
                            continue;
                        };
                        for (s, qs) in taps.iter().enumerate() {
                            if qs.is_empty() {
                                continue;
                            }
                            let (first, stride) = g.column_map(s, qs.start);
                            for k in 0..g.k {
                                let wv = w[g.wi(k, c, r, s)];
                                let dy_row = &dy[g.yi(n, k, p, 0)..][..g.q];
                                let targets = acc[first..].iter_mut().step_by(stride);
                                for (a, dv) in targets.zip(&dy_row[qs.clone()]) {
                                    *a += dv * wv;
                                }
                            }
                        }
                    }
                    for (o, a) in out_row.iter_mut().zip(&acc) {
                        *o = *a as f32;
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
    ///
    /// Each filter value sums its terms in the definition's order (n, then p, then q); the
    /// loops run that order for all input channels at once, over x with its channels
    /// innermost, so the innermost loop walks contiguous values.
    pub fn wgrad(&self, x: &[f32], dy: &[f32]) -> Vec<f32> {
        let g = *self;
        let dy = widen(dy);
        // x as [N,H,W,C].
        let mut xt = vec![0f64; x.len()];
        for n in 0..g.n {
            for c in 0..g.c {
                for h in 0..g.h {
                    for wx in 0..g.w {
                        xt[((n * g.h + h) * g.w + wx) * g.c + c] = f64::from(x[g.xi(n, c, h, wx)]);
                    }
                }
            }
        }
        let taps: Vec<Range<usize>> = (0..g.s).map(|s| g.outputs_of_tap(1, s)).collect();
        let mut dw = vec![0f32; g.k * g.c * g.r * g.s];
        dw.par_chunks_mut(g.c * g.r * g.s)
            .enumerate()
            .for_each(|(k, out)| {
                let mut acc = vec![0f64; g.c];
                for r in 0..g.r {
                    for (s, qs) in taps.iter().enumerate() {
                        acc.fill(0.0);
                        if !qs.is_empty() {
                            let (first, stride) = g.column_map(s, qs.start);
                            for n in 0..g.n {
                                for p in 0..g.p {
                                    let Some(h) = g.input_pos(0, p, r) else {
                                        continue;
                                    };
                                    let dy_row = &dy[g.yi(n, k, p, 0)..][..g.q];
                                    for (i, dv) in dy_row[qs.clone()].iter().enumerate() {
                                        let wx = first + i * stride;
                                        let x_pix = &xt[((n * g.h + h) * g.w + wx) * g.c..][..g.c];
                                        for (a, xv) in acc.iter_mut().zip(x_pix) {
                                            *a += dv * xv;
                                        }
                                    }
                                }
                            }
                        }
                        for (c, a) in acc.iter().enumerate() {
                            out[(c * g.r + r) * g.s + s] = *a as f32;
                        }
                    }
                }
            });
        dw
    }
}

/// FP32 values as `f64` (exact).
fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definitions in the module docs as plain loop nests, one output at a time, each
    /// summing in the same order as the row-at-a-time loops above: the two must agree bit
    /// for bit.
    impl Geometry {
        fn fprop_by_definition(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
            let g = *self;
            let mut y = vec![0f32; g.n * g.k * g.p * g.q];
            for (n, k, p, q) in boxed(g.n, g.k, g.p, g.q) {
                let mut acc = 0f64;
                for c in 0..g.c {
                    for r in 0..g.r {
                        for s in 0..g.s {
                            if let (Some(h), Some(wx)) =
                                (g.input_pos(0, p, r), g.input_pos(1, q, s))
                            {
                                acc += f64::from(x[g.xi(n, c, h, wx)])
                                    * f64::from(w[g.wi(k, c, r, s)]);
                            }
                        }
                    }
                }
                y[g.yi(n, k, p, q)] = acc as f32;
            }
            y
        }

        fn dgrad_by_definition(&self, dy: &[f32], w: &[f32]) -> Vec<f32> {
            let g = *self;
            let mut dx = vec![0f32; g.n * g.c * g.h * g.w];
            for (n, c, h, wx) in boxed(g.n, g.c, g.h, g.w) {
                let mut acc = 0f64;
                for r in 0..g.r {
                    for s in 0..g.s {
                        if let (Some(p), Some(q)) = (g.output_pos(0, h, r), g.output_pos(1, wx, s))
                        {
                            for k in 0..g.k {
                                acc += f64::from(dy[g.yi(n, k, p, q)])
                                    * f64::from(w[g.wi(k, c, r, s)]);
                            }
                        }
                    }
                }
                dx[g.xi(n, c, h, wx)] = acc as f32;
            }
            dx
        }

        fn wgrad_by_definition(&self, x: &[f32], dy: &[f32]) -> Vec<f32> {
            let g = *self;
            let mut dw = vec![0f32; g.k * g.c * g.r * g.s];
            for (k, c, r, s) in boxed(g.k, g.c, g.r, g.s) {
                let mut acc = 0f64;
                for n in 0..g.n {
                    for p in 0..g.p {
                        for q in 0..g.q {
                            if let (Some(h), Some(wx)) =
                                (g.input_pos(0, p, r), g.input_pos(1, q, s))
                            {
                                acc += f64::from(dy[g.yi(n, k, p, q)])
                                    * f64::from(x[g.xi(n, c, h, wx)]);
                            }
                        }
                    }
                }
                dw[g.wi(k, c, r, s)] = acc as f32;
            }
            dw
        }
    }

    /// Every index of a 4-D box, last fastest.
    fn boxed(a: usize, b: usize, c: usize, d: usize) -> Vec<(usize, usize, usize, usize)> {
        let mut all = Vec::with_capacity(a * b * c * d);
        for i in 0..a {
            for j in 0..b {
                for k in 0..c {
                    for l in 0..d {
                        all.push((i, j, k, l));
                    }
                }
            }
        }
        all
    }

    fn values(len: usize, seed: &mut u64) -> Vec<f32> {
        (0..len)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn the_row_loops_equal_the_definitions_bit_for_bit() {
        let mut seed = 11;
        // (stride, dilation, pre-padding, post-padding, filter size): unit and wide strides,
        // dilation, asymmetric padding, padding wider than a tap reaches (whole rows and
        // columns of outputs read only padding), a 1×1 filter.
        for (stride, dil, pre, post, r) in [
            ([1, 1], [1, 1], [1, 1], [1, 1], 3),
            ([2, 3], [1, 1], [1, 0], [0, 1], 3),
            ([2, 3], [2, 2], [2, 1], [1, 2], 3),
            ([1, 2], [1, 3], [4, 5], [4, 3], 2),
            ([3, 4], [1, 1], [0, 0], [0, 0], 1),
            ([1, 1], [2, 1], [0, 2], [3, 0], 5),
        ] {
            let attrs = ConvAttrs {
                pre_padding: pre,
                post_padding: post,
                stride,
                dilation: dil,
            };
            let (n, c, h, w, k) = (2, 3, 9, 8, 4);
            let p = attrs.out_extent(0, h, r).unwrap() as usize;
            let q = attrs.out_extent(1, w, r).unwrap() as usize;
            let (h, w, r) = (h as usize, w as usize, r as usize);
            let g =
                Geometry::new((0, "t"), [n, c, h, w], [k, c, r, r], [n, k, p, q], &attrs).unwrap();
            let x = values(n * c * h * w, &mut seed);
            let wt = values(k * c * r * r, &mut seed);
            let dy = values(n * k * p * q, &mut seed);
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(
                bits(g.fprop(&x, &wt)),
                bits(g.fprop_by_definition(&x, &wt)),
                "fprop {attrs:?}"
            );
            assert_eq!(
                bits(g.dgrad(&dy, &wt)),
                bits(g.dgrad_by_definition(&dy, &wt)),
                "dgrad {attrs:?}"
            );
            assert_eq!(
                bits(g.wgrad(&x, &dy)),
                bits(g.wgrad_by_definition(&x, &dy)),
                "wgrad {attrs:?}"
            );
        }
    }
}
