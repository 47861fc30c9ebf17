//! dgrad of a strided conv by phases: each input pixel reads only the taps that land on an
//! output pixel, so its GEMMs are shallower than the gather over all taps.

use rayon::prelude::*;

use super::super::element::{Mat, Real};
use super::super::error::Result;
use super::super::params::ConvParams;

/// One phase of a strided dgrad: the input rows `ih` with `(ih + pad_h) % stride_h == a`,
/// columns likewise for `b`, and the filter taps that reach them (`r·dil_h ≡ a`, `s·dil_w ≡ b`
/// modulo the stride): every other tap reads between the strided output pixels.
#[derive(Debug)]
pub(super) struct Phase<A> {
    ihs: Vec<usize>,
    iws: Vec<usize>,
    /// `(r, s)` of the taps that reach this phase, in tap order.
    taps: Vec<(usize, usize)>,
    /// The weights of those taps as a `[taps·k, c]` matrix (row `t·k + k'` holds filter `k'`'s
    /// `c` weights at tap `taps[t]`).
    w: Vec<A>,
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
            let mut wp = vec![A::ZERO; taps.len() * k * c];
            for (t, &(r, s)) in taps.iter().enumerate() {
                for kk in 0..k {
                    let src = ((kk * p.r + r) * p.s + s) * c;
                    wp[(t * k + kk) * c..][..c].copy_from_slice(&w[src..src + c]);
                }
            }
            phases.push(Phase {
                ihs,
                iws,
                taps,
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
    out.par_chunks_mut(image).enumerate().try_for_each_init(
        || (Vec::new(), Vec::new(), Vec::new(), Vec::new()),
        |(col, res, dy_n, dx_n), (n, out_n)| {
            let len = out_h * out_w * k;
            dy_n.resize(len, A::ZERO);
            widen(&dy[n * len..(n + 1) * len], &mut dy_n[..len]);
            // Pixels no tap reaches keep a zero gradient.
            dx_n.clear();
            dx_n.resize(image, A::ZERO);
            for ph in phases {
                let (rows, depth) = (ph.ihs.len() * ph.iws.len(), ph.taps.len() * k);
                if rows == 0 || depth == 0 {
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
                                _ => col.resize(col.len() + k, A::ZERO),
                            }
                        }
                    }
                }
                res.resize(rows * c, A::ZERO);
                A::gemm(
                    rows,
                    depth,
                    c,
                    Mat::row_major(col, depth),
                    Mat::row_major(&ph.w, c),
                    A::ZERO,
                    &mut res[..rows * c],
                )?;
                let mut src = res.chunks_exact(c);
                for &ih in &ph.ihs {
                    for &iw in &ph.iws {
                        if let Some(v) = src.next() {
                            dx_n[(ih * p.w + iw) * c..][..c].copy_from_slice(v);
                        }
                    }
                }
            }
            sink(dx_n, out_n);
            Ok(())
        },
    )
}
