//! dgrad of a strided conv by phases: each input pixel reads only the taps that land on an
//! output pixel, so its GEMMs are shallower than the gather over all taps. Each phase's product
//! reads the image's `dy` through a zero border, straight from it on the direct tiles
//! (`direct.rs`, the GEMM's bits) or gathered into a column matrix for the GEMM.

use rayon::prelude::*;

use super::super::element::{Mat, Real};
use super::super::error::Result;
use super::super::params::ConvParams;
use super::tile::gemm_kernel_path;

/// One phase of a strided dgrad: the input rows `ih` with `(ih + pad_h) % stride_h == a`,
/// columns likewise for `b`, and the filter taps that reach them (`r·dil_h ≡ a`, `s·dil_w ≡ b`
/// modulo the stride): every other tap reads between the strided output pixels.
///
/// Its column matrix (a row per input pixel, a column per tap and output channel) is read from
/// the image's padded `dy` ([`DyPad`]): element `(row, t·k + k')` is `dy[bases[row] +
/// offsets[t·k + k']]`, a zero of the border where the tap falls outside `dy`.
#[derive(Debug)]
pub(super) struct Phase<A> {
    /// Each input pixel's base in the padded `dy`, in pixel order (`ih`, then `iw`).
    bases: Vec<usize>,
    /// Each column's offset from a base.
    offsets: Vec<usize>,
    /// The input pixels `(ih, iw)`, in the order of `bases`.
    pixels: Vec<(usize, usize)>,
    /// The weights of the taps as a `[taps·k, c]` matrix (row `t·k + k'` holds filter `k'`'s
    /// `c` weights at the phase's tap `t`).
    w: Vec<A>,
}

/// One image's `dy` (`out_h × out_w` pixels of `k` channels) with a zero border, as the
/// phases read it: `top` rows and `left` columns before it, zeros after it up to `hp × wp`
/// pixels. Input pixel `ih` of a phase sits at `u = (ih + pad_h) / stride_h` and its tap `r` at
/// `v = r·dil_h / stride_h` (both rounded down), so it reads output row `u − v`, padded row
/// `u − v + top`: `top` is the largest `v`, `hp` past the largest `u`.
#[derive(Debug, Clone, Copy)]
pub(super) struct DyPad {
    hp: usize,
    wp: usize,
    top: usize,
    left: usize,
}

impl DyPad {
    fn of(p: &ConvParams) -> Self {
        let (top, left) = (
            (p.r - 1) * p.dil_h / p.stride_h,
            (p.s - 1) * p.dil_w / p.stride_w,
        );
        let (u_end, v_end) = (
            (p.h - 1 + p.pad_h) / p.stride_h + 1,
            (p.w - 1 + p.pad_w) / p.stride_w + 1,
        );
        DyPad {
            hp: top + u_end.max(p.out_h()),
            wp: left + v_end.max(p.out_w()),
            top,
            left,
        }
    }

    fn elems(&self, k: usize) -> usize {
        self.hp * self.wp * k
    }

    /// Writes image `dy_n` (`out_h` rows of `out_w·k`) into `out`, resized, with a zero
    /// border, each row widened by `widen`.
    fn fill<A: Real, S>(
        &self,
        p: &ConvParams,
        dy_n: &[S],
        widen: impl Fn(&[S], &mut [A]),
        out: &mut Vec<A>,
    ) {
        let (k, out_w) = (p.k, p.out_w());
        out.clear();
        out.resize(self.elems(k), A::ZERO);
        if out_w * k == 0 {
            return;
        }
        for (op, src) in dy_n.chunks_exact(out_w * k).enumerate() {
            let at = ((op + self.top) * self.wp + self.left) * k;
            widen(src, &mut out[at..at + out_w * k]);
        }
    }
}

/// dgrad of a strided conv by phases (see [`Phase`]): a stride-2 3×3 conv's input pixels read
/// 1, 2, 2 or 4 of the 9 taps by phase, so its GEMMs are a quarter as deep as the gather over
/// all taps, whose other taps only add zeros. The same products are summed over fewer terms (the
/// GEMM's order may differ from [`dgrad_all_taps`]'s in the last bits). Images in parallel.
/// `p` validated, lengths checked.
pub(crate) fn dgrad_phases<A: Real>(p: &ConvParams, dy: &[A], w: &[A]) -> Result<Vec<A>> {
    let phases = phases_of(p, w);
    let c = p.c;
    let image = p.h * p.w * c;
    let mut dx = vec![A::ZERO; p.n * image];
    phases_by_image(
        p,
        &phases,
        dy,
        |src, dst| dst.copy_from_slice(src),
        &mut dx,
        |img, dst| dst.copy_from_slice(img),
    )?;
    Ok(dx)
}

/// The phases of a strided dgrad (see [`Phase`]), with their weights from `w` (KRSC).
pub(super) fn phases_of<A: Real>(p: &ConvParams, w: &[A]) -> Vec<Phase<A>> {
    let (c, k) = (p.c, p.k);
    let pad = DyPad::of(p);
    let mut phases = Vec::with_capacity(p.stride_h * p.stride_w);
    for a in 0..p.stride_h {
        for b in 0..p.stride_w {
            let ihs = (0..p.h).filter(|ih| (ih + p.pad_h) % p.stride_h == a);
            let iws: Vec<usize> = (0..p.w)
                .filter(|iw| (iw + p.pad_w) % p.stride_w == b)
                .collect();
            let pixels: Vec<(usize, usize)> = ihs
                .flat_map(|ih| iws.iter().map(move |&iw| (ih, iw)))
                .collect();
            let bases = pixels
                .iter()
                .map(|&(ih, iw)| {
                    ((ih + p.pad_h) / p.stride_h * pad.wp + (iw + p.pad_w) / p.stride_w) * k
                })
                .collect();
            let mut taps = Vec::new();
            for r in (0..p.r).filter(|r| (r * p.dil_h) % p.stride_h == a) {
                for s in (0..p.s).filter(|s| (s * p.dil_w) % p.stride_w == b) {
                    taps.push((r, s));
                }
            }
            let mut offsets = Vec::with_capacity(taps.len() * k);
            let mut wp = vec![A::ZERO; taps.len() * k * c];
            for (t, &(r, s)) in taps.iter().enumerate() {
                // At most `top` and `left` (`DyPad`), so the offset is not negative.
                let (v, v2) = (r * p.dil_h / p.stride_h, s * p.dil_w / p.stride_w);
                let tap = ((pad.top - v) * pad.wp + pad.left - v2) * k;
                offsets.extend((0..k).map(|kk| tap + kk));
                for kk in 0..k {
                    let src = ((kk * p.r + r) * p.s + s) * c;
                    wp[(t * k + kk) * c..][..c].copy_from_slice(&w[src..src + c]);
                }
            }
            phases.push(Phase {
                bases,
                offsets,
                pixels,
                w: wp,
            });
        }
    }
    phases
}

/// The image loop of [`dgrad_phases`] over `dy` of any element type `S` (each image's part
/// widened by `widen` into a buffer of the arithmetic type): each image's `dx` is made in a
/// buffer of its own and handed to `sink(image_dx, out_image)` with its part of `out`.
pub(super) fn phases_by_image<A, S, O, W, F>(
    p: &ConvParams,
    phases: &[Phase<A>],
    dy: &[S],
    widen: W,
    out: &mut [O],
    sink: F,
) -> Result<()>
where
    A: Real,
    S: Sync,
    O: Send,
    W: Fn(&[S], &mut [A]) + Sync,
    F: Fn(&[A], &mut [O]) + Sync,
{
    let (c, k) = (p.c, p.k);
    let (out_h, out_w) = (p.out_h(), p.out_w());
    let image = p.h * p.w * c;
    if image == 0 {
        return Ok(());
    }
    let pad = DyPad::of(p);
    out.par_chunks_mut(image).enumerate().try_for_each_init(
        || (Vec::new(), Vec::new(), Vec::new(), Vec::new()),
        |(col, res, dy_n, dx_n), (n, out_n)| {
            let len = out_h * out_w * k;
            pad.fill(p, &dy[n * len..(n + 1) * len], &widen, dy_n);
            // Pixels no tap reaches keep a zero gradient.
            dx_n.clear();
            dx_n.resize(image, A::ZERO);
            for ph in phases {
                let (rows, depth) = (ph.bases.len(), ph.offsets.len());
                if rows == 0 || depth == 0 {
                    continue;
                }
                res.resize(rows * c, A::ZERO);
                let res = &mut res[..rows * c];
                // Straight from the padded `dy` where the tiles give the GEMM's bits (and take
                // the product: see `direct::product`), else gathered and multiplied.
                if !(gemm_kernel_path(rows, depth, c)
                    && A::direct(dy_n, &ph.bases, &ph.offsets, &ph.w, c, res, false))
                {
                    col.clear();
                    // Each tap's columns are `k` consecutive values.
                    for &base in &ph.bases {
                        for tap in ph.offsets.chunks_exact(k) {
                            col.extend_from_slice(&dy_n[base + tap[0]..][..k]);
                        }
                    }
                    A::gemm(
                        rows,
                        depth,
                        c,
                        Mat::row_major(col, depth),
                        Mat::row_major(&ph.w, c),
                        A::ZERO,
                        res,
                    )?;
                }
                for (&(ih, iw), v) in ph.pixels.iter().zip(res.chunks_exact(c)) {
                    dx_n[(ih * p.w + iw) * c..][..c].copy_from_slice(v);
                }
            }
            sink(dx_n, out_n);
            Ok(())
        },
    )
}
