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
//! dgrad is a gather too (no scatter-add), so every op parallelizes over row tiles without
//! write conflicts. wgrad sums the tiles in a fixed number of groups whose partial filters are
//! added in order, so its result does not depend on the thread count.
//!
//! Precision: inputs are widened to the arithmetic type (`f32` in FP16 mode, as the tensor cores
//! accumulate), the GEMMs accumulate in it, and the public ops round the result to the storage
//! type once, at the end (the GPU stores `y`, `dx`, `dw` as FP16).

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
    p.validate()?;
    check_len("dy", dy, p.y_elems())?;
    check_len("w", w, p.w_elems())?;
    let dx = dgrad_acc(p, &T::widen_slice(dy), &T::widen_slice(w))?;
    Ok(T::store_slice(&dx))
}

/// `dw = ∂(Σ dy·y)/∂w` for `y = conv(x, w)`: `x` NHWC, `dy` NHWC `[n, out_h, out_w, k]` →
/// `dw` KRSC `[k, r, s, c]`, accumulated in `T::Acc` over all `n*out_h*out_w` output pixels and
/// rounded once to `T` (the GPU's wgrad writes FP16 `dw`).
pub fn conv_wgrad<T: Element>(p: &ConvParams, x: &[T], dy: &[T]) -> Result<Vec<T>> {
    p.validate()?;
    check_len("x", x, p.x_elems())?;
    check_len("dy", dy, p.y_elems())?;
    let dw = wgrad_acc(p, &T::widen_slice(x), &T::widen_slice(dy))?;
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
    gather_gemm(rows, x, p.c, p.r * p.s, fprop_pixel(p), w_t, p.k)
}

/// dgrad in the arithmetic type, unrounded. `p` validated, lengths checked.
pub(crate) fn dgrad_acc<A: Real>(p: &ConvParams, dy: &[A], w: &[A]) -> Result<Vec<A>> {
    let taps = p.r * p.s;
    // w rearranged as [r*s, k, c]: row (tap*k + k) holds the c weights of filter k at that tap.
    let mut w_r = vec![A::ZERO; taps * p.k * p.c];
    for (k, filter) in w.chunks_exact(taps * p.c).enumerate() {
        for (tap, weights) in filter.chunks_exact(p.c).enumerate() {
            w_r[(tap * p.k + k) * p.c..][..p.c].copy_from_slice(weights);
        }
    }
    let rows = p.n * p.h * p.w;
    gather_gemm(
        rows,
        dy,
        p.k,
        taps,
        dgrad_pixel(p),
        Mat::row_major(&w_r, p.c),
        p.c,
    )
}

/// wgrad in the arithmetic type, unrounded. `p` validated, lengths checked.
pub(crate) fn wgrad_acc<A: Real>(p: &ConvParams, x: &[A], dy: &[A]) -> Result<Vec<A>> {
    let (k, taps) = (p.k, p.r * p.s);
    let depth = taps * p.c;
    let rows = p.n * p.out_h() * p.out_w();
    let tiles = rows.div_ceil(TILE_ROWS);
    let tiles_per_group = tiles.div_ceil(WGRAD_GROUPS);
    let groups = tiles.div_ceil(tiles_per_group);
    let pixel = fprop_pixel(p);
    let partials = (0..groups)
        .into_par_iter()
        .map(|group| {
            let mut dw = vec![A::ZERO; k * depth];
            let mut col = Vec::new();
            let last_tile = ((group + 1) * tiles_per_group).min(tiles);
            for tile in group * tiles_per_group..last_tile {
                let first = tile * TILE_ROWS;
                let n_rows = TILE_ROWS.min(rows - first);
                gather(x, p.c, taps, first, n_rows, &pixel, &mut col);
                // dyᵀ of this tile as a [k, n_rows] matrix.
                let dy_t = Mat {
                    data: &dy[first * k..(first + n_rows) * k],
                    row_stride: 1,
                    col_stride: k,
                };
                A::gemm(
                    k,
                    n_rows,
                    depth,
                    dy_t,
                    Mat::row_major(&col, depth),
                    A::ONE,
                    &mut dw,
                )?;
            }
            Ok(dw)
        })
        .collect::<Result<Vec<Vec<A>>>>()?;
    let mut partials = partials.into_iter();
    let mut dw = partials.next().unwrap_or_else(|| vec![A::ZERO; k * depth]);
    for partial in partials {
        for (d, v) in dw.iter_mut().zip(partial) {
            *d += v;
        }
    }
    Ok(dw)
}

/// Where fprop's (and wgrad's) column row `row` (output pixel `(n, p, q)`) reads filter tap
/// `tap = r*s_dim + s`: the input pixel index `(n*h + ih)*w + iw`, or `None` in the padding.
fn fprop_pixel(p: &ConvParams) -> impl Fn(usize, usize) -> Option<usize> + Sync + Send {
    let ConvParams {
        h,
        w,
        s,
        pad_h,
        pad_w,
        stride_h,
        stride_w,
        dil_h,
        dil_w,
        ..
    } = *p;
    let (out_h, out_w) = (p.out_h(), p.out_w());
    move |row, tap| {
        let (n, rem) = (row / (out_h * out_w), row % (out_h * out_w));
        let (op, oq) = (rem / out_w, rem % out_w);
        let ih = (op * stride_h + (tap / s) * dil_h).checked_sub(pad_h)?;
        let iw = (oq * stride_w + (tap % s) * dil_w).checked_sub(pad_w)?;
        (ih < h && iw < w).then_some((n * h + ih) * w + iw)
    }
}

/// Where dgrad's column row `row` (input pixel `(n, ih, iw)`) reads filter tap `(r, s)`: the
/// output pixel `(op, oq)` with `op*stride_h = ih + pad_h - r*dil_h` (and the same for `w`),
/// or `None` where no output pixel reads `(ih, iw)` through that tap.
fn dgrad_pixel(p: &ConvParams) -> impl Fn(usize, usize) -> Option<usize> + Sync + Send {
    let ConvParams {
        h,
        w,
        s,
        pad_h,
        pad_w,
        stride_h,
        stride_w,
        dil_h,
        dil_w,
        ..
    } = *p;
    let (out_h, out_w) = (p.out_h(), p.out_w());
    move |row, tap| {
        let (n, rem) = (row / (h * w), row % (h * w));
        let (ih, iw) = (rem / w, rem % w);
        let th = (ih + pad_h).checked_sub((tap / s) * dil_h)?;
        let tw = (iw + pad_w).checked_sub((tap % s) * dil_w)?;
        if th % stride_h != 0 || tw % stride_w != 0 {
            return None;
        }
        let (op, oq) = (th / stride_h, tw / stride_w);
        (op < out_h && oq < out_w).then_some((n * out_h + op) * out_w + oq)
    }
}

/// Fills `col` with rows `first..first + n_rows` of the column matrix `[rows, taps*cin]`:
/// row `i`, tap `t` holds the `cin` values of `src`'s pixel `pixel(i, t)`, or zeros.
fn gather<A: Real>(
    src: &[A],
    cin: usize,
    taps: usize,
    first: usize,
    n_rows: usize,
    pixel: &(impl Fn(usize, usize) -> Option<usize> + Sync),
    col: &mut Vec<A>,
) {
    col.clear();
    col.resize(n_rows * taps * cin, A::ZERO);
    for (i, row) in col.chunks_exact_mut(taps * cin).enumerate() {
        for (tap, dst) in row.chunks_exact_mut(cin).enumerate() {
            if let Some(pix) = pixel(first + i, tap) {
                dst.copy_from_slice(&src[pix * cin..][..cin]);
            }
        }
    }
}

/// `out [rows, cout] = col [rows, taps*cin] · weights [taps*cin, cout]`, with `col` gathered
/// tile by tile (see [`gather`]) and the tiles run in parallel.
fn gather_gemm<A: Real>(
    rows: usize,
    src: &[A],
    cin: usize,
    taps: usize,
    pixel: impl Fn(usize, usize) -> Option<usize> + Sync + Send,
    weights: Mat<'_, A>,
    cout: usize,
) -> Result<Vec<A>> {
    let depth = taps * cin;
    let mut out = vec![A::ZERO; rows * cout];
    out.par_chunks_mut(TILE_ROWS * cout)
        .enumerate()
        .try_for_each_init(Vec::new, |col, (tile, out_tile)| {
            let n_rows = out_tile.len() / cout;
            gather(src, cin, taps, tile * TILE_ROWS, n_rows, &pixel, col);
            A::gemm(
                n_rows,
                depth,
                cout,
                Mat::row_major(col, depth),
                weights,
                A::ZERO,
                out_tile,
            )
        })?;
    Ok(out)
}
