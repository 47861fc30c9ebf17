//! Convolution forward (fprop), data gradient (dgrad) and filter gradient (wgrad), by im2col
//! and GEMM.
//!
//! All three are one pattern: gather rows of a "column" matrix from an NHWC tensor (each row
//! holds, for every filter tap `(r, s)`, the channels of the pixel that tap reads, or zeros),
//! then multiply with a filter matrix.
//!
//! | op | rows | gathered from | times |
//! |---|---|---|---|
//! | fprop `y = conv(x, w)` | output pixels `(n, p, q)` | `x`, pixel `(p*stride - pad + r*dil, ...)` | `wᵀ` `[r*s*c, k]` |
//! | dgrad `dx = convᵀ(dy, w)` | input pixels `(n, h, w)` | `dy`, pixel `p` with `p*stride = h + pad - r*dil` | `w` rearranged `[r*s*k, c]` |
//! | wgrad `dw = Σ dyᵀ · col(x)` | output pixels | `x`, as fprop | `dy` (left operand) |
//!
//! Where the gather reads a zero-padded copy of the source, a tile's product can read that
//! copy directly instead of gathering its column rows (`direct.rs`: the same bits, on CPUs
//! with FMA); the gather and the GEMM run the rest.
//!
//! dgrad is a gather too (no scatter-add), so every op parallelizes over row tiles without
//! write conflicts. wgrad sums the tiles in a fixed number of groups whose partial filters are
//! added in order, so its result does not depend on the thread count.
//!
//! Precision: inputs are widened to the arithmetic type (`f32` in FP16 mode, as the tensor cores
//! accumulate), the GEMMs accumulate in it, and the public ops round the result to the storage
//! type once, at the end (the GPU stores `y`, `dx`, `dw` as FP16).

use std::borrow::Cow;

use rayon::prelude::*;

use super::element::{Element, Mat, Real};
use super::error::Result;
use super::params::{check_len, ConvParams};

/// Rows of the column matrix per rayon task.
const TILE_ROWS: usize = 128;

/// Most partial filters wgrad sums (bounds its extra memory to this many copies of `dw`).
const WGRAD_GROUPS: usize = 8;

/// `y = conv(x, w)`: `x` NHWC `[n, h, w, c]`, `w` KRSC `[k, r, s, c]` → `y` NHWC
/// `[n, out_h, out_w, k]`, accumulated in `T::Acc` and rounded once to `T`.
pub fn conv_fprop<T: Element>(p: &ConvParams, x: &[T], w: &[T]) -> Result<Vec<T>> {
    p.validate()?;
    check_len("x", x, p.x_elems())?;
    check_len("w", w, p.w_elems())?;
    let y = fprop_acc(p, &T::widen_slice(x), &T::widen_slice(w))?;
    Ok(T::store_slice(&y))
}

/// `dx = ∂(Σ dy·y)/∂x` for `y = conv(x, w)`: `dy` NHWC `[n, out_h, out_w, k]`, `w` KRSC →
/// `dx` NHWC `[n, h, w, c]`, accumulated in `T::Acc` and rounded once to `T`.
pub fn conv_dgrad<T: Element>(p: &ConvParams, dy: &[T], w: &[T]) -> Result<Vec<T>> {
    conv_dgrad_into(p, dy, w, Vec::new())
}

/// [`conv_dgrad`] into `out`'s storage (any length; its contents are overwritten), returned as
/// `dx`: a caller that keeps its `dx` buffer from step to step allocates nothing.
pub fn conv_dgrad_into<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    out: Vec<T>,
) -> Result<Vec<T>> {
    dgrad_store(p, dy, w, None, out)
}

/// [`conv_dgrad_into`], with the padded copy of `dy` (stride 1) in `pad_buf` when given.
pub(crate) fn dgrad_store<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    pad_buf: Option<&mut PadBuf<T::Acc>>,
    mut out: Vec<T>,
) -> Result<Vec<T>> {
    p.validate()?;
    check_len("dy", dy, p.y_elems())?;
    check_len("w", w, p.w_elems())?;
    let w = T::widen_slice(w);
    out.resize(p.x_elems(), T::default());
    // Stride 1: `dy` widened straight into the gather's padded copy, and each tile stored
    // while in cache (the tiles of `dgrad_all_taps`, so the same values).
    let k = p.k;
    let fill = |first: usize, dst: &mut [T::Acc]| {
        T::widen_into(&dy[first * k..first * k + dst.len()], dst);
    };
    let dy_src = Src::Fill {
        pixels: p.n * p.out_h() * p.out_w(),
        fill: &fill,
    };
    let chunked = if out.is_empty() {
        Some(Vec::new())
    } else {
        dgrad_chunks(
            p,
            dy_src,
            &w,
            &mut out,
            TILE_ROWS,
            pad_buf,
            || (),
            |_, _, tile, dst| T::store_into(tile, dst),
        )?
    };
    if chunked.is_none() {
        // Strided: by phases, each image's `dy` widened and its `dx` stored in turn (the
        // values of `dgrad_phases`).
        let phases = phases_of(p, &w);
        phases_by_image(p, &phases, dy, T::widen_into, &mut out, T::store_into)?;
    }
    Ok(out)
}

/// `dw = ∂(Σ dy·y)/∂w` for `y = conv(x, w)`: `x` NHWC, `dy` NHWC `[n, out_h, out_w, k]` →
/// `dw` KRSC `[k, r, s, c]`, accumulated in `T::Acc` over all `n*out_h*out_w` output pixels and
/// rounded once to `T` (the GPU's wgrad writes FP16 `dw`).
pub fn conv_wgrad<T: Element>(p: &ConvParams, x: &[T], dy: &[T]) -> Result<Vec<T>> {
    p.validate()?;
    check_len("x", x, p.x_elems())?;
    check_len("dy", dy, p.y_elems())?;
    // `x` widened straight into the gather's padded copy (the same values as widening it
    // first).
    let c = p.c;
    let fill = |first: usize, dst: &mut [T::Acc]| {
        T::widen_into(&x[first * c..first * c + dst.len()], dst);
    };
    let x_src = Src::Fill {
        pixels: p.n * p.h * p.w,
        fill: &fill,
    };
    let dw = wgrad_src(p, x_src, &T::widen_slice(dy))?;
    Ok(T::store_slice(&dw))
}

/// fprop in the arithmetic type, unrounded. `p` validated, lengths checked.
pub(crate) fn fprop_acc<A: Real>(p: &ConvParams, x: &[A], w: &[A]) -> Result<Vec<A>> {
    let depth = p.r * p.s * p.c;
    // wᵀ as a [r*s*c, k] matrix: element (j, k) is w[k*depth + j].
    let w_t = Mat {
        data: w,
        row_stride: 1,
        col_stride: depth,
    };
    let rows = p.n * p.out_h() * p.out_w();
    gather_gemm(rows, x, p.c, p.r * p.s, PixelMap::fprop(p), w_t, p.k)
}

/// fprop by chunks of `chunk_rows` output pixels (a multiple of [`TILE_ROWS`]), the chunks in
/// parallel: each chunk's tiles are gathered and multiplied exactly as [`fprop_acc`] does (the
/// same tiles, so the same values), and each tile's result `[n_rows, k]` is handed with the
/// tile's rows of `out` (`k` values per pixel) to `sink(state, tile, out_rows)` while it is in
/// cache; `tile` is scratch the sink may overwrite. Returns the chunks' states (each from
/// `init`, then through its tiles in row order), in chunk order. `p` validated, lengths checked.
pub(crate) fn fprop_chunks<A, O, S, I, F>(
    p: &ConvParams,
    x: Src<'_, A>,
    w: &[A],
    out: &mut [O],
    chunk_rows: usize,
    init: I,
    sink: F,
) -> Result<Vec<S>>
where
    A: Real,
    O: Send,
    S: Send,
    I: Fn() -> S + Sync,
    F: Fn(&mut S, &mut [A], &mut [O]) + Sync,
{
    let (k, taps) = (p.k, p.r * p.s);
    let depth = taps * p.c;
    let w_t = Mat {
        data: w,
        row_stride: 1,
        col_stride: depth,
    };
    let gatherer = Gatherer::from_src(PixelMap::fprop(p), x, p.c, taps);
    let rows = p.n * p.out_h() * p.out_w();
    gemm_chunks(
        &gatherer,
        rows,
        depth,
        w_t,
        k,
        out,
        chunk_rows,
        init,
        |s, _, t, o| sink(s, t, o),
    )
}

/// Writes `x` in the padded layout the fprop (and wgrad) gather of `p` reads, into `out`
/// (resized; storage kept from an earlier call is reused, only the border zeroed): the
/// [`Src::Padded`] form of `x` for [`fprop_chunks`] and [`wgrad_src`], which then gather the
/// same column matrix as from `x` itself. `p` validated, lengths checked.
pub(crate) fn pad_fprop_input<A: Real>(p: &ConvParams, x: Src<'_, A>, out: &mut PadBuf<A>) {
    let taps = p.r * p.s;
    // An fprop map always has a padded layout.
    if let Some(layout) = Layout::of(PixelMap::fprop(p), p.c, taps) {
        match x {
            Src::Padded(v) => {
                out.clean = None;
                out.data.clear();
                out.data.extend_from_slice(v);
            }
            x => layout.fill(x, out),
        }
    }
}

/// dgrad of a stride-1 conv (see [`dgrad_all_taps`]) by chunks of `chunk_rows` input pixels,
/// as [`fprop_chunks`]: each tile `[n_rows, c]` of the unrounded dgrad is handed with its first
/// pixel and its rows of `out` (`c` values per pixel) to `sink(state, first, tile, out_rows)`.
/// The same tiles, so the same values, as [`dgrad_all_taps`]. `None` for a strided conv (see
/// [`dgrad_phases`]). `p` validated, lengths checked.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dgrad_chunks<A, O, S, I, F>(
    p: &ConvParams,
    dy: Src<'_, A>,
    w: &[A],
    out: &mut [O],
    chunk_rows: usize,
    pad_buf: Option<&mut PadBuf<A>>,
    init: I,
    sink: F,
) -> Result<Option<Vec<S>>>
where
    A: Real,
    O: Send,
    S: Send,
    I: Fn() -> S + Sync,
    F: Fn(&mut S, usize, &mut [A], &mut [O]) + Sync,
{
    if p.stride_h > 1 || p.stride_w > 1 {
        return Ok(None);
    }
    let taps = p.r * p.s;
    let w_r = dgrad_weights(p, w);
    let gatherer = Gatherer::from_src_in(PixelMap::dgrad(p), dy, p.k, taps, pad_buf);
    let (rows, w_r) = (p.n * p.h * p.w, Mat::row_major(&w_r, p.c));
    gemm_chunks(
        &gatherer,
        rows,
        taps * p.k,
        w_r,
        p.c,
        out,
        chunk_rows,
        init,
        sink,
    )
    .map(Some)
}

/// `out [rows, cout] = col [rows, depth] · weights [depth, cout]` by chunks of `chunk_rows`
/// rows (a multiple of [`TILE_ROWS`]) in parallel, each by tiles of [`TILE_ROWS`] rows (the
/// tiles of [`gather_gemm`]) handed to `sink(state, first_row, tile, out_rows)`; returns the
/// chunks' states in chunk order.
#[allow(clippy::too_many_arguments)]
fn gemm_chunks<A, O, S, I, F>(
    gatherer: &Gatherer<'_, A>,
    rows: usize,
    depth: usize,
    weights: Mat<'_, A>,
    k: usize,
    out: &mut [O],
    chunk_rows: usize,
    init: I,
    sink: F,
) -> Result<Vec<S>>
where
    A: Real,
    O: Send,
    S: Send,
    I: Fn() -> S + Sync,
    F: Fn(&mut S, usize, &mut [A], &mut [O]) + Sync,
{
    if out.len() != rows * k || k == 0 || chunk_rows == 0 || !chunk_rows.is_multiple_of(TILE_ROWS) {
        return Err(super::error::ReferenceError::Internal {
            what: "gemm_chunks: output length or chunk size",
        });
    }
    let product = TileProduct::new(gatherer, depth, weights, k);
    out.par_chunks_mut(chunk_rows * k)
        .enumerate()
        .map_init(
            || (Scratch::default(), vec![A::ZERO; TILE_ROWS * k]),
            |(scratch, acc), (chunk, out_chunk)| {
                let mut state = init();
                for (tile, out_tile) in out_chunk.chunks_mut(TILE_ROWS * k).enumerate() {
                    let n_rows = out_tile.len() / k;
                    let first = chunk * chunk_rows + tile * TILE_ROWS;
                    let acc = &mut acc[..n_rows * k];
                    product.tile(first, n_rows, scratch, acc)?;
                    sink(&mut state, first, acc, out_tile);
                }
                Ok(state)
            },
        )
        .collect()
}

/// A tile's gathered column rows and their bases, kept from tile to tile.
#[derive(Debug, Default)]
struct Scratch<A> {
    col: Vec<A>,
    bases: Vec<usize>,
}

/// `tile [n_rows, cout] = col rows first.. · weights [depth, cout]`: straight from the padded
/// source where `direct.rs` runs the tile (the same bits), else by the gather and the GEMM.
struct TileProduct<'g, 'a, A: Real> {
    gatherer: &'g Gatherer<'a, A>,
    depth: usize,
    weights: Mat<'g, A>,
    cout: usize,
    /// Each column's offset from a row's base and `weights` row-major, where the tiles may
    /// go direct.
    direct: Option<(Vec<usize>, Cow<'g, [A]>)>,
}

impl<'g, 'a, A: Real> TileProduct<'g, 'a, A> {
    fn new(gatherer: &'g Gatherer<'a, A>, depth: usize, weights: Mat<'g, A>, cout: usize) -> Self {
        // The `gemm` crate's kernel path for this product (direct.rs): a reduced dimension of
        // 3..=512 (no blocks, no vector-vector case) and at least two output channels.
        let direct = (A::DIRECT && (3..=512).contains(&depth) && cout >= 2)
            .then(|| gatherer.column_offsets())
            .flatten()
            .filter(|eoff| eoff.len() == depth)
            .map(|eoff| (eoff, dense(weights, depth, cout)));
        TileProduct {
            gatherer,
            depth,
            weights,
            cout,
            direct,
        }
    }

    fn tile(&self, first: usize, n_rows: usize, s: &mut Scratch<A>, out: &mut [A]) -> Result<()> {
        // Tiles the crate would sum across lanes (m·n ≤ 256) or treat as a vector go its way.
        if let (Some((eoff, w)), Gatherer::Padded(g)) = (&self.direct, self.gatherer) {
            if n_rows >= 2 && n_rows * self.cout > 256 {
                g.bases(first, n_rows, &mut s.bases);
                if A::direct(&g.src[..], &s.bases, eoff, w, self.cout, out, false) {
                    return Ok(());
                }
            }
        }
        self.gatherer.gather(first, n_rows, &mut s.col);
        A::gemm(
            n_rows,
            self.depth,
            self.cout,
            Mat::row_major(&s.col, self.depth),
            self.weights,
            A::ZERO,
            out,
        )
    }
}

/// `m` (`rows x cols`) as a row-major slice: borrowed where it already is one.
fn dense<'m, A: Real>(m: Mat<'m, A>, rows: usize, cols: usize) -> Cow<'m, [A]> {
    if m.col_stride == 1 && m.row_stride == cols && m.data.len() >= rows * cols {
        return Cow::Borrowed(&m.data[..rows * cols]);
    }
    let mut out = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        out.extend((0..cols).map(|j| m.data[i * m.row_stride + j * m.col_stride]));
    }
    Cow::Owned(out)
}

/// dgrad in the arithmetic type, unrounded. `p` validated, lengths checked.
///
/// A strided conv goes by phases ([`dgrad_phases`]); a stride-1 conv by the gather over all
/// taps ([`dgrad_all_taps`]).
pub(crate) fn dgrad_acc<A: Real>(p: &ConvParams, dy: &[A], w: &[A]) -> Result<Vec<A>> {
    if p.stride_h > 1 || p.stride_w > 1 {
        dgrad_phases(p, dy, w)
    } else {
        dgrad_all_taps(p, dy, w)
    }
}

/// One phase of a strided dgrad: the input rows `ih` with `(ih + pad_h) % stride_h == a`,
/// columns likewise for `b`, and the filter taps that reach them (`r·dil_h ≡ a`, `s·dil_w ≡ b`
/// modulo the stride): every other tap reads between the strided output pixels.
#[derive(Debug)]
struct Phase<A> {
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
fn phases_of<A: Real>(p: &ConvParams, w: &[A]) -> Vec<Phase<A>> {
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
fn phases_by_image<A, S, O, W, F>(
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

/// dgrad by the gather over all `r·s` taps (each input pixel's column row holds, per tap, the
/// output pixel it reads or zeros). `p` validated, lengths checked.
pub(crate) fn dgrad_all_taps<A: Real>(p: &ConvParams, dy: &[A], w: &[A]) -> Result<Vec<A>> {
    let taps = p.r * p.s;
    let w_r = dgrad_weights(p, w);
    let rows = p.n * p.h * p.w;
    gather_gemm(
        rows,
        dy,
        p.k,
        taps,
        PixelMap::dgrad(p),
        Mat::row_major(&w_r, p.c),
        p.c,
    )
}

/// `w` rearranged for dgrad as `[r*s, k, c]`: row `tap*k + k'` holds the `c` weights of filter
/// `k'` at that tap.
fn dgrad_weights<A: Real>(p: &ConvParams, w: &[A]) -> Vec<A> {
    let taps = p.r * p.s;
    let mut w_r = vec![A::ZERO; taps * p.k * p.c];
    for (k, filter) in w.chunks_exact(taps * p.c).enumerate() {
        for (tap, weights) in filter.chunks_exact(p.c).enumerate() {
            w_r[(tap * p.k + k) * p.c..][..p.c].copy_from_slice(weights);
        }
    }
    w_r
}

/// wgrad in the arithmetic type, unrounded. `p` validated, lengths checked.
#[cfg(test)]
pub(crate) fn wgrad_acc<A: Real>(p: &ConvParams, x: &[A], dy: &[A]) -> Result<Vec<A>> {
    wgrad_src(p, Src::Acc(x), dy)
}

/// [`wgrad_acc`] from any [`Src`].
pub(crate) fn wgrad_src<A: Real>(p: &ConvParams, x: Src<'_, A>, dy: &[A]) -> Result<Vec<A>> {
    let (k, taps) = (p.k, p.r * p.s);
    let depth = taps * p.c;
    let rows = p.n * p.out_h() * p.out_w();
    let tiles = rows.div_ceil(TILE_ROWS);
    let tiles_per_group = tiles.div_ceil(WGRAD_GROUPS);
    let groups = tiles.div_ceil(tiles_per_group);
    let gatherer = Gatherer::from_src(PixelMap::fprop(p), x, p.c, taps);
    // Straight from the padded source where direct.rs runs the tile (the `gemm` crate's kernel
    // path: at least two output channels and two filter columns, and 3..=512 rows per tile,
    // checked per tile below), the same bits as the gather and the GEMM.
    let direct = match &gatherer {
        Gatherer::Padded(g) if A::DIRECT && k >= 2 && depth >= 2 => gatherer
            .column_offsets()
            .filter(|eoff| eoff.len() == depth)
            .map(|eoff| (g, eoff)),
        _ => None,
    };
    let partials = (0..groups)
        .into_par_iter()
        // Column rows and bases per rayon job, reused by its groups.
        .map_init(Scratch::default, |scratch, group| {
            // dwᵀ [depth, k]: the GEMM's long side is the filter depth, not the few output
            // channels (the faster orientation for the skinny shapes).
            let mut dw_t = vec![A::ZERO; depth * k];
            let last_tile = ((group + 1) * tiles_per_group).min(tiles);
            for tile in group * tiles_per_group..last_tile {
                let first = tile * TILE_ROWS;
                let n_rows = TILE_ROWS.min(rows - first);
                let dy_rows = &dy[first * k..(first + n_rows) * k];
                if let Some((g, eoff)) = &direct {
                    if (3..=512).contains(&n_rows) {
                        g.bases(first, n_rows, &mut scratch.bases);
                        if A::direct(
                            &g.src[..],
                            eoff,
                            &scratch.bases,
                            dy_rows,
                            k,
                            &mut dw_t,
                            true,
                        ) {
                            continue;
                        }
                    }
                }
                let col = &mut scratch.col;
                gatherer.gather(first, n_rows, col);
                // colᵀ of this tile as a [depth, n_rows] matrix.
                let col_t = Mat {
                    data: col,
                    row_stride: 1,
                    col_stride: depth,
                };
                A::gemm(
                    depth,
                    n_rows,
                    k,
                    col_t,
                    Mat::row_major(dy_rows, k),
                    A::ONE,
                    &mut dw_t,
                )?;
            }
            Ok(dw_t)
        })
        .collect::<Result<Vec<Vec<A>>>>()?;
    let mut partials = partials.into_iter();
    let mut dw_t = partials.next().unwrap_or_else(|| vec![A::ZERO; depth * k]);
    for partial in partials {
        for (d, v) in dw_t.iter_mut().zip(partial) {
            *d += v;
        }
    }
    // KRSC: element (kk, j) of dw is element (j, kk) of dwᵀ.
    let mut dw = vec![A::ZERO; k * depth];
    for (j, row) in dw_t.chunks_exact(k).enumerate() {
        for (kk, &v) in row.iter().enumerate() {
            dw[kk * depth + j] = v;
        }
    }
    Ok(dw)
}

/// Marks a filter tap that reads padding (zeros) in [`PixelMap::row`].
const NO_PIXEL: usize = usize::MAX;

/// Where each column row reads each filter tap `tap = r*s_dim + s`.
#[derive(Debug, Clone, Copy)]
enum PixelMap {
    /// fprop's (and wgrad's) rows: output pixels `(n, p, q)`, reading input pixel
    /// `(n, p*stride_h - pad_h + r*dil_h, q*stride_w - pad_w + s*dil_w)`.
    Fprop(ConvParams),
    /// dgrad's rows: input pixels `(n, ih, iw)`, reading the output pixel `(op, oq)` with
    /// `op*stride_h = ih + pad_h - r*dil_h` (and the same for `w`), where there is one.
    Dgrad(ConvParams),
}

impl PixelMap {
    fn fprop(p: &ConvParams) -> Self {
        PixelMap::Fprop(*p)
    }

    fn dgrad(p: &ConvParams) -> Self {
        PixelMap::Dgrad(*p)
    }

    /// The row space: (batch, rows, columns) of the pixels the column rows stand for.
    fn dims(&self) -> (usize, usize) {
        match self {
            PixelMap::Fprop(p) => (p.out_h(), p.out_w()),
            PixelMap::Dgrad(p) => (p.h, p.w),
        }
    }

    /// Column row `row`'s pixel `(n, i, j)` in the row space.
    fn coords(&self, row: usize) -> [usize; 3] {
        let (h, w) = self.dims();
        let (n, rem) = (row / (h * w), row % (h * w));
        [n, rem / w, rem % w]
    }

    /// The next row's pixel after `at`.
    fn advance(&self, at: &mut [usize; 3]) {
        let (h, w) = self.dims();
        at[2] += 1;
        if at[2] == w {
            at[2] = 0;
            at[1] += 1;
            if at[1] == h {
                at[1] = 0;
                at[0] += 1;
            }
        }
    }

    /// For the column row of pixel `at` ([`PixelMap::coords`]), the flat source pixel of every
    /// tap, or [`NO_PIXEL`].
    fn row(&self, at: [usize; 3], out: &mut [usize]) {
        if self.interior(at, out) {
            return;
        }
        self.row_general(at, out);
    }

    /// [`PixelMap::row`] for a row none of whose taps falls outside the source (or, in
    /// dgrad, between the strided output pixels): every tap's pixel is the row's first plus a
    /// fixed offset. Returns false, leaving `out` as it was, for other rows.
    fn interior(&self, [n, op, oq]: [usize; 3], out: &mut [usize]) -> bool {
        match *self {
            PixelMap::Fprop(p) => {
                let (Some(ih), Some(iw)) = (
                    (op * p.stride_h).checked_sub(p.pad_h),
                    (oq * p.stride_w).checked_sub(p.pad_w),
                ) else {
                    return false;
                };
                if ih + (p.r - 1) * p.dil_h >= p.h || iw + (p.s - 1) * p.dil_w >= p.w {
                    return false;
                }
                let base = (n * p.h + ih) * p.w + iw;
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let row_base = base + r * p.dil_h * p.w;
                    for (s, t) in taps.iter_mut().enumerate() {
                        *t = row_base + s * p.dil_w;
                    }
                }
                true
            }
            PixelMap::Dgrad(p) => {
                if p.stride_h != 1 || p.stride_w != 1 {
                    return false;
                }
                let (out_h, out_w) = (p.out_h(), p.out_w());
                let (ih, iw) = (op, oq);
                // Tap (r, s) reads output pixel (ih + pad_h - r·dil_h, iw + pad_w - s·dil_w).
                let (th, tw) = (ih + p.pad_h, iw + p.pad_w);
                if th < (p.r - 1) * p.dil_h
                    || tw < (p.s - 1) * p.dil_w
                    || th >= out_h
                    || tw >= out_w
                {
                    return false;
                }
                let base = (n * out_h + th) * out_w + tw;
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let row_base = base - r * p.dil_h * out_w;
                    for (s, t) in taps.iter_mut().enumerate() {
                        *t = row_base - s * p.dil_w;
                    }
                }
                true
            }
        }
    }

    /// [`PixelMap::row`] for any row.
    fn row_general(&self, [n, i, j]: [usize; 3], out: &mut [usize]) {
        // Rows and columns of the filter are independent: find each tap row's source row and
        // each tap column's source column once, then combine.
        let mut cols = [NO_PIXEL; 16];
        let mut cols_vec;
        let (p, s) = match self {
            PixelMap::Fprop(p) | PixelMap::Dgrad(p) => (*p, p.s),
        };
        let cols: &mut [usize] = if s <= cols.len() {
            &mut cols[..s]
        } else {
            cols_vec = vec![NO_PIXEL; s];
            &mut cols_vec
        };
        match *self {
            PixelMap::Fprop(_) => {
                let (op, oq) = (i, j);
                for (s, c) in cols.iter_mut().enumerate() {
                    *c = (oq * p.stride_w + s * p.dil_w)
                        .checked_sub(p.pad_w)
                        .filter(|&iw| iw < p.w)
                        .unwrap_or(NO_PIXEL);
                }
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let ih = (op * p.stride_h + r * p.dil_h)
                        .checked_sub(p.pad_h)
                        .filter(|&ih| ih < p.h);
                    for (t, &iw) in taps.iter_mut().zip(cols.iter()) {
                        *t = match ih {
                            Some(ih) if iw != NO_PIXEL => (n * p.h + ih) * p.w + iw,
                            _ => NO_PIXEL,
                        };
                    }
                }
            }
            PixelMap::Dgrad(_) => {
                let (out_h, out_w) = (p.out_h(), p.out_w());
                let (ih, iw) = (i, j);
                let along =
                    |i: usize, pad: usize, t: usize, dil: usize, stride: usize, o: usize| {
                        (i + pad)
                            .checked_sub(t * dil)
                            .filter(|th| th % stride == 0)
                            .map(|th| th / stride)
                            .filter(|&op| op < o)
                    };
                for (s, c) in cols.iter_mut().enumerate() {
                    *c = along(iw, p.pad_w, s, p.dil_w, p.stride_w, out_w).unwrap_or(NO_PIXEL);
                }
                for (r, taps) in out.chunks_exact_mut(p.s).enumerate() {
                    let op = along(ih, p.pad_h, r, p.dil_h, p.stride_h, out_h);
                    for (t, &oq) in taps.iter_mut().zip(cols.iter()) {
                        *t = match op {
                            Some(op) if oq != NO_PIXEL => (n * out_h + op) * out_w + oq,
                            _ => NO_PIXEL,
                        };
                    }
                }
            }
        }
    }
}

/// Gathers rows of a column matrix (see [`gather`]) from a source tensor with `cin` channels.
#[derive(Debug)]
enum Gatherer<'a, A: Clone> {
    /// Through a zero-padded copy of the source, in which every tap of every row reads the
    /// pixel at a fixed offset from the row's base pixel: no bounds checks, and runs of taps
    /// that read consecutive pixels (a filter row of fprop) are copied at once. The column
    /// matrix is the same as [`gather`]'s (padding reads `+0`, as its zero fill).
    Padded(Padded<'a, A>),
    /// By [`PixelMap::row`] per row (dgrad of a strided conv, or padding past the filter).
    General {
        src: Cow<'a, [A]>,
        cin: usize,
        taps: usize,
        map: PixelMap,
    },
}

/// See [`Gatherer::Padded`].
#[derive(Debug)]
struct Padded<'a, A: Clone> {
    /// The source, NHWC `[n, hp, wp, cin]` with its zero border.
    src: Cow<'a, [A]>,
    layout: Layout,
}

/// The geometry of a [`Gatherer::Padded`] source.
#[derive(Debug, Clone, PartialEq)]
struct Layout {
    cin: usize,
    taps: usize,
    /// Images of the source.
    n: usize,
    /// Height and width of the padded source.
    hp: usize,
    wp: usize,
    /// Zero rows above and zero columns left of the source in its padded copy.
    top: usize,
    left: usize,
    /// Height and width of the source.
    h: usize,
    w: usize,
    /// The row space's height and width (as [`PixelMap::dims`]).
    dims: (usize, usize),
    /// Padded pixels the base moves per row-space step down and across.
    step: (usize, usize),
    /// `(first tap, taps, pixel offset from the base)` of each run of taps reading consecutive
    /// pixels, in tap order.
    runs: Vec<(usize, usize, usize)>,
}

impl Layout {
    /// The padded layout of `map`'s source, or `None` where the gather goes by
    /// [`PixelMap::row`] (dgrad of a strided conv, or padding past the filter's reach).
    fn of(map: PixelMap, cin: usize, taps: usize) -> Option<Layout> {
        // (images, padded height, width, top and left border, source height, width, steps)
        let (n, hp, wp, top, left, h, w, step) = match map {
            PixelMap::Fprop(p) => (
                p.n,
                p.h + 2 * p.pad_h,
                p.w + 2 * p.pad_w,
                p.pad_h,
                p.pad_w,
                p.h,
                p.w,
                (p.stride_h, p.stride_w),
            ),
            PixelMap::Dgrad(p) => {
                let (reach_h, reach_w) = ((p.r - 1) * p.dil_h, (p.s - 1) * p.dil_w);
                if p.stride_h != 1 || p.stride_w != 1 || p.pad_h > reach_h || p.pad_w > reach_w {
                    return None;
                }
                (
                    p.n,
                    p.h + reach_h,
                    p.w + reach_w,
                    reach_h - p.pad_h,
                    reach_w - p.pad_w,
                    p.out_h(),
                    p.out_w(),
                    (1, 1),
                )
            }
        };
        let p = match map {
            PixelMap::Fprop(p) | PixelMap::Dgrad(p) => p,
        };
        // Tap (r, s) reads, relative to the row's base pixel: fprop (r·dil_h, s·dil_w);
        // dgrad ((r_max − r)·dil_h, (s_max − s)·dil_w) (see `PixelMap::interior`).
        let offset = |r: usize, s: usize| match map {
            PixelMap::Fprop(_) => r * p.dil_h * wp + s * p.dil_w,
            PixelMap::Dgrad(_) => (p.r - 1 - r) * p.dil_h * wp + (p.s - 1 - s) * p.dil_w,
        };
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for t in 0..taps {
            let off = offset(t / p.s, t % p.s);
            match runs.last_mut() {
                Some((_, len, start)) if *start + *len == off => *len += 1,
                _ => runs.push((t, 1, off)),
            }
        }
        Some(Layout {
            cin,
            taps,
            n,
            hp,
            wp,
            top,
            left,
            h,
            w,
            dims: map.dims(),
            step,
            runs,
        })
    }

    /// Whether the padded copy is the source itself (no zero border).
    fn borderless(&self) -> bool {
        self.top == 0 && self.left == 0 && self.hp == self.h && self.wp == self.w
    }

    /// Elements of the padded copy.
    fn elems(&self) -> usize {
        self.n * self.hp * self.wp * self.cin
    }

    /// Writes the padded copy of `src` (not [`Src::Padded`]) into `out`, resized to
    /// [`Layout::elems`]: each source row copied (or filled) straight into place, and the
    /// border zeroed unless `out` already holds this layout's zero border (storage kept from
    /// an earlier call is reused without clearing it first).
    fn fill<A: Real>(&self, src: Src<'_, A>, out: &mut PadBuf<A>) {
        let cin = self.cin;
        let (hp, wp, top, left, h, w) = (self.hp, self.wp, self.top, self.left, self.h, self.w);
        // Only this function writes a `PadBuf`, and it leaves the border of `clean` zero.
        let clean = out.clean.as_ref() == Some(self) && out.data.len() == self.elems();
        out.clean = None;
        let data = &mut out.data;
        data.resize(self.elems(), A::ZERO);
        let image = hp * wp * cin;
        if image == 0 {
            return;
        }
        if h * w * cin == 0 {
            data.fill(A::ZERO);
            out.clean = Some(self.clone());
            return;
        }
        data.par_chunks_mut(image)
            .enumerate()
            .for_each(|(img, out)| {
                let (above, rest) = out.split_at_mut(top * wp * cin);
                let (rows, below) = rest.split_at_mut(h * wp * cin);
                if !clean {
                    above.fill(A::ZERO);
                    below.fill(A::ZERO);
                }
                for (row, line) in rows.chunks_exact_mut(wp * cin).enumerate() {
                    let (before, line) = line.split_at_mut(left * cin);
                    let (dst, after) = line.split_at_mut(w * cin);
                    if !clean {
                        before.fill(A::ZERO);
                        after.fill(A::ZERO);
                    }
                    let first = (img * h + row) * w;
                    match src {
                        // (`Src::Padded` is used as it is, never refilled: see `from_src_in`.)
                        Src::Acc(v) | Src::Padded(v) => {
                            dst.copy_from_slice(&v[first * cin..][..w * cin])
                        }
                        Src::Fill { fill, .. } => fill(first, dst),
                    }
                }
            });
        out.clean = Some(self.clone());
    }
}

/// Storage for a padded copy kept from call to call ([`Layout::fill`]), with the layout whose
/// zero border it holds, if any (a refill of the same layout then rewrites only the interior).
#[derive(Debug, Default)]
pub(crate) struct PadBuf<A> {
    /// The padded copy.
    pub(crate) data: Vec<A>,
    clean: Option<Layout>,
}

/// A conv's source tensor as the gather reads it, in the arithmetic type.
#[derive(Clone, Copy)]
pub(crate) enum Src<'a, A> {
    /// Already in the arithmetic type.
    Acc(&'a [A]),
    /// Computed on the way into the gather's padded copy: `fill(first, dst)` writes the values
    /// of the `dst.len() / cin` consecutive pixels from flat pixel `first` (the source has
    /// `pixels` pixels).
    Fill {
        pixels: usize,
        fill: &'a (dyn Fn(usize, &mut [A]) + Sync),
    },
    /// An fprop (or wgrad) source already in its gather's padded layout, as
    /// [`pad_fprop_input`] wrote it for the same conv shape.
    Padded(&'a [A]),
}

impl<A> std::fmt::Debug for Src<'_, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Src::Acc(v) => write!(f, "Src::Acc({} values)", v.len()),
            Src::Fill { pixels, .. } => write!(f, "Src::Fill({pixels} pixels)"),
            Src::Padded(v) => write!(f, "Src::Padded({} values)", v.len()),
        }
    }
}

impl<'a, A: Real> Src<'a, A> {
    /// The whole tensor (`cin` channels) in the arithmetic type.
    fn materialize(self, cin: usize) -> Cow<'a, [A]> {
        match self {
            // Only fprop sources come padded, and fprop always gathers through the padded
            // layout (`Layout::of`): never reached.
            Src::Acc(v) | Src::Padded(v) => Cow::Borrowed(v),
            Src::Fill { pixels, fill } => {
                let mut v = vec![A::ZERO; pixels * cin];
                if !v.is_empty() {
                    fill(0, &mut v);
                }
                Cow::Owned(v)
            }
        }
    }
}

impl<'a, A: Real> Gatherer<'a, A> {
    fn new(map: PixelMap, src: &'a [A], cin: usize, taps: usize) -> Self {
        Self::from_src(map, Src::Acc(src), cin, taps)
    }

    fn from_src(map: PixelMap, src: Src<'a, A>, cin: usize, taps: usize) -> Self {
        Self::from_src_in(map, src, cin, taps, None)
    }

    /// [`Gatherer::from_src`], writing a padded copy (where one is made) into `buf` when given
    /// (storage kept for reuse) instead of a new vector.
    fn from_src_in(
        map: PixelMap,
        src: Src<'a, A>,
        cin: usize,
        taps: usize,
        buf: Option<&'a mut PadBuf<A>>,
    ) -> Self {
        let Some(layout) = Layout::of(map, cin, taps) else {
            return Gatherer::General {
                src: src.materialize(cin),
                cin,
                taps,
                map,
            };
        };
        let src = match src {
            // Already in the padded layout (an fprop source: its layout always exists).
            Src::Padded(v) => Cow::Borrowed(v),
            // No border: the source itself.
            Src::Acc(v) if layout.borderless() => Cow::Borrowed(v),
            src => match buf {
                Some(buf) => {
                    layout.fill(src, buf);
                    Cow::Borrowed(&buf.data[..])
                }
                None => {
                    let mut padded = PadBuf::default();
                    layout.fill(src, &mut padded);
                    Cow::Owned(padded.data)
                }
            },
        };
        Gatherer::Padded(Padded { src, layout })
    }

    /// For the padded gather: each column's element offset from its row's base element
    /// ([`Padded::bases`]), so element `(row, d)` of the column matrix is
    /// `src[base(row) + offset(d)]`. `None` for the general gather.
    fn column_offsets(&self) -> Option<Vec<usize>> {
        let Gatherer::Padded(g) = self else {
            return None;
        };
        let cin = g.layout.cin;
        let mut eoff = vec![0; g.layout.taps * cin];
        for &(t, len, off) in &g.layout.runs {
            let run = &mut eoff[t * cin..(t + len) * cin];
            for (i, e) in run.iter_mut().enumerate() {
                *e = off * cin + i;
            }
        }
        Some(eoff)
    }

    /// Fills `col` with rows `first..first + n_rows` of the column matrix (see [`gather`]).
    fn gather(&self, first: usize, n_rows: usize, col: &mut Vec<A>) {
        match self {
            Gatherer::General {
                src,
                cin,
                taps,
                map,
            } => gather(src, *cin, *taps, first, n_rows, map, col),
            Gatherer::Padded(g) => g.gather(first, n_rows, col),
        }
    }
}

impl<A: Real> Padded<'_, A> {
    fn gather(&self, first: usize, n_rows: usize, col: &mut Vec<A>) {
        let l = &self.layout;
        let (cin, width) = (l.cin, l.taps * l.cin);
        // Every element is written below; resizing only grows the buffer.
        col.resize(n_rows * width, A::ZERO);
        if width == 0 {
            return;
        }
        let mut rows = col.chunks_exact_mut(width);
        self.walk(first, n_rows, |base| {
            let Some(row) = rows.next() else { return };
            for &(t, len, off) in &l.runs {
                let at = (base + off) * cin;
                copy_pixels(
                    &mut row[t * cin..(t + len) * cin],
                    &self.src[at..at + len * cin],
                );
            }
        });
    }

    /// The element index in the padded source of each of rows `first..first + n_rows`' base
    /// pixel (the pixel its first tap reads, before the run offsets), into `out`.
    fn bases(&self, first: usize, n_rows: usize, out: &mut Vec<usize>) {
        out.clear();
        let cin = self.layout.cin;
        self.walk(first, n_rows, |base| out.push(base * cin));
    }

    /// Calls `row(base)` with the base pixel of each of rows `first..first + n_rows`, in order.
    fn walk(&self, first: usize, n_rows: usize, mut row: impl FnMut(usize)) {
        let l = &self.layout;
        let (h, w) = l.dims;
        if h * w == 0 {
            return;
        }
        let (sh, sw) = l.step;
        let base_of = |n: usize, i: usize, j: usize| (n * l.hp + i * sh) * l.wp + j * sw;
        let (mut n, mut i, mut j) = (first / (h * w), first % (h * w) / w, first % w);
        let mut base = base_of(n, i, j);
        for _ in 0..n_rows {
            row(base);
            j += 1;
            base += sw;
            if j == w {
                j = 0;
                i += 1;
                if i == h {
                    i = 0;
                    n += 1;
                }
                base = base_of(n, i, j);
            }
        }
    }
}

/// Fills `col` with rows `first..first + n_rows` of the column matrix `[rows, taps*cin]`: row
/// `i`, tap `t` holds the `cin` values of `src`'s pixel for that tap ([`PixelMap::row`]), or
/// zeros.
fn gather<A: Real>(
    src: &[A],
    cin: usize,
    taps: usize,
    first: usize,
    n_rows: usize,
    map: &PixelMap,
    col: &mut Vec<A>,
) {
    // Every element is written below (a copy or zeros); resizing only grows the buffer.
    col.resize(n_rows * taps * cin, A::ZERO);
    let mut pixels = vec![NO_PIXEL; taps];
    let mut at = map.coords(first);
    for row in col.chunks_exact_mut(taps * cin) {
        map.row(at, &mut pixels);
        map.advance(&mut at);
        // Runs of taps that read consecutive pixels (a filter row in fprop) are one copy.
        let mut t = 0;
        while t < taps {
            let pix = pixels[t];
            let mut run = 1;
            if pix != NO_PIXEL {
                while t + run < taps && pixels[t + run] == pix + run {
                    run += 1;
                }
            }
            let dst = &mut row[t * cin..(t + run) * cin];
            if pix == NO_PIXEL {
                dst.fill(A::ZERO);
            } else {
                copy_pixels(dst, &src[pix * cin..(pix + run) * cin]);
            }
            t += run;
        }
    }
}

/// `dst.copy_from_slice(src)`, inlined for a single pixel of the usual channel counts.
#[inline]
fn copy_pixels<A: Real>(dst: &mut [A], src: &[A]) {
    fn fixed<A: Copy, const N: usize>(dst: &mut [A], src: &[A]) -> bool {
        match (<&mut [A; N]>::try_from(dst), <&[A; N]>::try_from(src)) {
            (Ok(d), Ok(s)) => {
                *d = *s;
                true
            }
            _ => false,
        }
    }
    let done = match src.len() {
        8 => fixed::<A, 8>(dst, src),
        16 => fixed::<A, 16>(dst, src),
        24 => fixed::<A, 24>(dst, src),
        32 => fixed::<A, 32>(dst, src),
        48 => fixed::<A, 48>(dst, src),
        96 => fixed::<A, 96>(dst, src),
        _ => false,
    };
    if !done {
        dst.copy_from_slice(src);
    }
}

/// `out [rows, cout] = col [rows, taps*cin] · weights [taps*cin, cout]`, with `col` gathered
/// tile by tile (see [`gather`]) and the tiles run in parallel.
fn gather_gemm<A: Real>(
    rows: usize,
    src: &[A],
    cin: usize,
    taps: usize,
    map: PixelMap,
    weights: Mat<'_, A>,
    cout: usize,
) -> Result<Vec<A>> {
    let gatherer = Gatherer::new(map, src, cin, taps);
    let product = TileProduct::new(&gatherer, taps * cin, weights, cout);
    let mut out = vec![A::ZERO; rows * cout];
    out.par_chunks_mut(TILE_ROWS * cout)
        .enumerate()
        .try_for_each_init(Scratch::default, |scratch, (tile, out_tile)| {
            let n_rows = out_tile.len() / cout;
            product.tile(tile * TILE_ROWS, n_rows, scratch, out_tile)
        })?;
    Ok(out)
}
