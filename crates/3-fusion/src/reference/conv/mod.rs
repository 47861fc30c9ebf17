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

use rayon::prelude::*;

use super::element::{Element, Mat, Real};
use super::error::Result;
use super::params::{check_len, filled_vec, ConvParams};

mod gather;
mod phases;
mod tile;

pub(crate) use gather::{pad_fprop_input, PadBuf, Src};
use gather::{Gatherer, PixelMap};
pub(crate) use phases::dgrad_phases;
use phases::{phases_by_image, phases_of};
use tile::{Scratch, TileProduct};

/// Rows of the column matrix per rayon task.
const TILE_ROWS: usize = 128;

/// Most partial filters wgrad sums (bounds its extra memory to this many copies of `dw`).
const WGRAD_GROUPS: usize = 8;

/// Storage the conv ops reuse from call to call, rewritten by every call: the weights in the
/// arithmetic type and arranged for dgrad, wgrad's partial sums and its `dw`. Large buffers
/// allocated afresh on every call would be new pages every step (page faults and zeroing cost
/// more than the arithmetic for networks with many weights at small batches). One store per
/// thread ([`with_store`]), so it holds the largest layer's temporaries, not every layer's.
#[derive(Debug, Default)]
pub(crate) struct ConvStore<A> {
    /// The weights widened to the arithmetic type.
    pub(crate) w: Vec<A>,
    /// The weights as dgrad reads them ([`dgrad_weights_into`]).
    pub(crate) w_r: Vec<A>,
    /// The weights as fprop's direct tiles read them (`[r*s*c, k]`, [`fprop_chunks`]).
    pub(crate) w_t: Vec<A>,
    /// wgrad's partial `dwᵀ`, one per group of tiles.
    partials: Vec<Vec<A>>,
    /// wgrad's `dw` (KRSC).
    dw: Vec<A>,
}

thread_local! {
    /// This thread's stores, one per arithmetic type (`ConvStore<f32>`, `ConvStore<f64>`).
    static STORES: std::cell::RefCell<Vec<Box<dyn std::any::Any>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's [`ConvStore`] for `A`, or with a new one while the thread's
/// is in use (an op that rayon's work stealing ran on this thread while another op here waits
/// for its parallel part). Which store an op gets changes no value: every call rewrites what
/// it reads.
pub(crate) fn with_store<A: Real, R>(f: impl FnOnce(&mut ConvStore<A>) -> R) -> R {
    STORES.with(|cell| {
        let Ok(mut stores) = cell.try_borrow_mut() else {
            return f(&mut ConvStore::default());
        };
        let at = match stores.iter().position(|s| s.is::<ConvStore<A>>()) {
            Some(at) => at,
            None => {
                stores.push(Box::new(ConvStore::<A>::default()));
                stores.len() - 1
            }
        };
        match stores[at].downcast_mut::<ConvStore<A>>() {
            Some(store) => f(store),
            None => f(&mut ConvStore::default()),
        }
    })
}

impl<A> ConvStore<A> {
    /// The `dw` (KRSC) the last [`wgrad_src_in`] left.
    pub(crate) fn dw(&self) -> &[A] {
        &self.dw
    }
}

/// Fewest values one rayon task of a weight-sized pass moves (dgrad's arrangement):
/// a ResNet layer's millions of weights go over every thread, a small layer's inline.
const MIN_WEIGHTS_PER_TASK: usize = 32 * 1024;

/// `w` widened into `into`'s storage (resized): the values of [`Element::widen_slice`] (a
/// ResNet layer's millions of FP16 weights go over the threads: `convert.rs` splits long
/// conversions itself).
pub(crate) fn widen_weights<'s, T: Element>(w: &[T], into: &'s mut Vec<T::Acc>) -> &'s [T::Acc] {
    into.resize(w.len(), T::Acc::ZERO);
    T::widen_into(w, into);
    into
}

/// A [`Src::Fill`]'s `fill` that widens `src` (pixels of `per_pixel` values) straight into the
/// gather's padded copy: the same values as widening `src` first.
pub(crate) fn widen_fill<T: Element>(
    src: &[T],
    per_pixel: usize,
) -> impl Fn(usize, &mut [T::Acc]) + Sync + '_ {
    move |first, dst| T::widen_into(&src[first * per_pixel..][..dst.len()], dst)
}

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
    p.validate()?;
    filled_vec(out, p.x_elems(), |out| {
        dgrad_store(p, dy, w, None, &mut ConvStore::default(), out)
    })
}

/// [`conv_dgrad_into`] into `out` (`dx`'s `x_elems` values, overwritten), with the padded copy
/// of `dy` (stride 1) in `pad_buf` when given and the weights' copies in `store`.
pub(crate) fn dgrad_store<T: Element>(
    p: &ConvParams,
    dy: &[T],
    w: &[T],
    pad_buf: Option<&mut PadBuf<T::Acc>>,
    store: &mut ConvStore<T::Acc>,
    out: &mut [T],
) -> Result<()> {
    p.validate()?;
    check_len("dy", dy, p.y_elems())?;
    check_len("w", w, p.w_elems())?;
    check_len("dx", out, p.x_elems())?;
    let w = widen_weights(w, &mut store.w);
    // Stride 1: `dy` widened straight into the gather's padded copy, and each tile stored
    // while in cache (the tiles of `dgrad_all_taps`, so the same values).
    let fill = widen_fill(dy, p.k);
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
            w,
            out,
            TILE_ROWS,
            pad_buf,
            &mut store.w_r,
            || (),
            |_, _, tile, dst| T::store_into(tile, dst),
        )?
    };
    if chunked.is_none() {
        // Strided: by phases, each image's `dy` widened and its `dx` stored in turn (the
        // values of `dgrad_phases`).
        let phases = phases_of(p, w);
        phases_by_image(p, &phases, dy, T::widen_into, out, T::store_into)?;
    }
    Ok(())
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
    let fill = widen_fill(x, p.c);
    let x_src = Src::Fill {
        pixels: p.n * p.h * p.w,
        fill: &fill,
    };
    // `dy` widened tile by tile, while in cache (the same values as widening it first).
    let dy_fill = widen_fill(dy, p.k);
    let dy_src = Src::Fill {
        pixels: p.n * p.out_h() * p.out_w(),
        fill: &dy_fill,
    };
    let dw = wgrad_src(p, x_src, dy_src)?;
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
/// `init`, then through its tiles in row order), in chunk order. The weights' arrangement for
/// the direct tiles goes into `w_t`'s storage. `p` validated, lengths checked.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fprop_chunks<A, O, S, I, F>(
    p: &ConvParams,
    x: Src<'_, A>,
    w: &[A],
    w_t: &mut Vec<A>,
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
    // wᵀ as a [r*s*c, k] matrix: element (j, k) is w[k*depth + j].
    let w_view = Mat {
        data: w,
        row_stride: 1,
        col_stride: depth,
    };
    let gatherer = Gatherer::from_src(PixelMap::fprop(p), x, p.c, taps);
    let rows = p.n * p.out_h() * p.out_w();
    gemm_chunks(
        TileProduct::new(&gatherer, depth, w_view, k, w_t),
        rows,
        out,
        chunk_rows,
        init,
        |s, _, t, o| sink(s, t, o),
    )
}

/// dgrad of a stride-1 conv (see [`dgrad_all_taps`]) by chunks of `chunk_rows` input pixels,
/// as [`fprop_chunks`]: each tile `[n_rows, c]` of the unrounded dgrad is handed with its first
/// pixel and its rows of `out` (`c` values per pixel) to `sink(state, first, tile, out_rows)`.
/// The same tiles, so the same values, as [`dgrad_all_taps`]. `None` for a strided conv (see
/// [`dgrad_phases`]). The weights' dgrad arrangement goes into `w_r`'s storage. `p`
/// validated, lengths checked.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dgrad_chunks<A, O, S, I, F>(
    p: &ConvParams,
    dy: Src<'_, A>,
    w: &[A],
    out: &mut [O],
    chunk_rows: usize,
    pad_buf: Option<&mut PadBuf<A>>,
    w_r: &mut Vec<A>,
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
    dgrad_weights_into(p, w, w_r);
    let gatherer = Gatherer::from_src_in(PixelMap::dgrad(p), dy, p.k, taps, pad_buf);
    let (rows, w_r) = (p.n * p.h * p.w, Mat::row_major(w_r, p.c));
    // Row-major already: the tiles borrow it, and `dense` stays empty.
    let mut dense = Vec::new();
    let product = TileProduct::new(&gatherer, taps * p.k, w_r, p.c, &mut dense);
    gemm_chunks(product, rows, out, chunk_rows, init, sink).map(Some)
}

/// `out [rows, cout] = col [rows, depth] · weights [depth, cout]` (`product`'s) by chunks of
/// `chunk_rows` rows (a multiple of [`TILE_ROWS`]) in parallel, each by tiles of [`TILE_ROWS`]
/// rows (the tiles of [`gather_gemm`]) handed to `sink(state, first_row, tile, out_rows)`;
/// returns the chunks' states in chunk order.
fn gemm_chunks<A, O, S, I, F>(
    product: TileProduct<'_, '_, A>,
    rows: usize,
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
    let k = product.cout();
    if out.len() != rows * k || k == 0 || chunk_rows == 0 || !chunk_rows.is_multiple_of(TILE_ROWS) {
        return Err(super::error::ReferenceError::Internal {
            what: "gemm_chunks: output length or chunk size",
        });
    }
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
    let mut w_r = Vec::new();
    dgrad_weights_into(p, w, &mut w_r);
    w_r
}

/// [`dgrad_weights`] into `w_r`'s storage (resized; every element is overwritten).
fn dgrad_weights_into<A: Real>(p: &ConvParams, w: &[A], w_r: &mut Vec<A>) {
    let taps = p.r * p.s;
    w_r.resize(taps * p.k * p.c, A::ZERO);
    if p.c == 0 {
        return;
    }
    // Row `tap*k + k'` of `w_r` is row `k'*taps + tap` of `w` (both rows of `c`).
    w_r.par_chunks_mut(p.c)
        .with_min_len(MIN_WEIGHTS_PER_TASK.div_ceil(p.c))
        .enumerate()
        .for_each(|(row, dst)| {
            let (tap, k) = (row / p.k, row % p.k);
            dst.copy_from_slice(&w[(k * taps + tap) * p.c..][..p.c]);
        });
}

/// wgrad in the arithmetic type, unrounded. `p` validated, lengths checked.
#[cfg(test)]
pub(crate) fn wgrad_acc<A: Real>(p: &ConvParams, x: &[A], dy: &[A]) -> Result<Vec<A>> {
    wgrad_src(p, Src::Acc(x), Src::Acc(dy))
}

/// [`wgrad_acc`] from any [`Src`] of `x` and `dy` (see [`wgrad_src_in`]).
pub(crate) fn wgrad_src<A: Real>(p: &ConvParams, x: Src<'_, A>, dy: Src<'_, A>) -> Result<Vec<A>> {
    let mut store = ConvStore::default();
    wgrad_src_in(p, x, dy, &mut store)?;
    Ok(store.dw)
}

/// [`wgrad_src`] in `store`'s storage: `dw` (KRSC) is left in it and returned. `dy` is
/// [`Src::Acc`] (`rows · k` values) or [`Src::Fill`] (`rows` pixels of `k` values, filled a
/// tile's rows at a time into the task's scratch, so they are read while in cache); a padded
/// `dy` is refused.
pub(crate) fn wgrad_src_in<'s, A: Real>(
    p: &ConvParams,
    x: Src<'_, A>,
    dy: Src<'_, A>,
    store: &'s mut ConvStore<A>,
) -> Result<&'s [A]> {
    let (k, taps) = (p.k, p.r * p.s);
    let depth = taps * p.c;
    let rows = p.n * p.out_h() * p.out_w();
    let fits = match dy {
        Src::Acc(d) => rows.checked_mul(k) == Some(d.len()),
        Src::Fill { pixels, .. } => pixels == rows,
        Src::Padded(_) => false,
    };
    if !fits {
        return Err(super::error::ReferenceError::Internal {
            what: "wgrad's dy does not hold the conv's output pixels",
        });
    }
    let tiles = rows.div_ceil(TILE_ROWS);
    let tiles_per_group = tiles.div_ceil(WGRAD_GROUPS);
    let groups = tiles.div_ceil(tiles_per_group);
    let gatherer = Gatherer::from_src(PixelMap::fprop(p), x, p.c, taps);
    // Straight from the padded source where direct.rs runs the tile (the `gemm` crate's kernel
    // path: at least two output channels and two filter columns, and at least 3 rows per
    // tile, checked per tile below), the same bits as the gather and the GEMM.
    let direct = match &gatherer {
        Gatherer::Padded(g) if A::DIRECT && k >= 2 && depth >= 2 => Some((g, g.column_offsets())),
        _ => None,
    };
    let partials = &mut store.partials;
    partials.resize_with(groups.max(1), Vec::new);
    partials
        .par_iter_mut()
        .take(groups)
        .enumerate()
        // Column rows and bases per rayon job, reused by its groups.
        .try_for_each_init(Scratch::default, |scratch, (group, dw_t)| {
            // dwᵀ [depth, k]: the GEMM's long side is the filter depth, not the few output
            // channels (the faster orientation for the skinny shapes).
            dw_t.clear();
            dw_t.resize(depth * k, A::ZERO);
            let dw_t = &mut dw_t[..];
            let last_tile = ((group + 1) * tiles_per_group).min(tiles);
            for tile in group * tiles_per_group..last_tile {
                let first = tile * TILE_ROWS;
                let n_rows = TILE_ROWS.min(rows - first);
                let dy_rows: &[A] = match dy {
                    Src::Acc(d) => &d[first * k..(first + n_rows) * k],
                    Src::Fill { fill, .. } => {
                        scratch.rows.resize(n_rows * k, A::ZERO);
                        fill(first, &mut scratch.rows[..n_rows * k]);
                        &scratch.rows[..n_rows * k]
                    }
                    // Refused above.
                    Src::Padded(_) => &[],
                };
                if let Some((g, eoff)) = &direct {
                    if n_rows >= 3 {
                        g.bases(first, n_rows, &mut scratch.bases);
                        if A::direct(&g.src[..], eoff, &scratch.bases, dy_rows, k, dw_t, true) {
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
                    dw_t,
                )?;
            }
            Ok(())
        })?;
    // No tiles: no group ran, and `dw` is zero.
    if groups == 0 {
        partials[0].clear();
        partials[0].resize(depth * k, A::ZERO);
    }
    // The groups' partial sums added in group order.
    let (dw_t, rest) = partials
        .split_first_mut()
        .expect("at least one partial (resized above)");
    for partial in &rest[..groups.saturating_sub(1)] {
        for (d, &v) in dw_t.iter_mut().zip(partial) {
            *d += v;
        }
    }
    // KRSC: element (kk, j) of dw is element (j, kk) of dwᵀ.
    let dw = &mut store.dw;
    dw.resize(k * depth, A::ZERO);
    super::transpose::transpose(dw_t, depth, k, dw);
    Ok(dw)
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
    let mut dense = Vec::new();
    let product = TileProduct::new(&gatherer, taps * cin, weights, cout, &mut dense);
    let mut out = vec![A::ZERO; rows * cout];
    out.par_chunks_mut(TILE_ROWS * cout)
        .enumerate()
        .try_for_each_init(Scratch::default, |scratch, (tile, out_tile)| {
            let n_rows = out_tile.len() / cout;
            product.tile(tile * TILE_ROWS, n_rows, scratch, out_tile)
        })?;
    Ok(out)
}
