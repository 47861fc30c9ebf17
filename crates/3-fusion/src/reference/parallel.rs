//! How the reference ops split work over threads (rayon), deterministically.
//!
//! Results never depend on the number of threads: element-wise maps write each element once,
//! and reductions split the rows into chunks whose size depends only on the shape, then add the
//! chunks' partial sums in chunk order.

use std::ops::Range;

use rayon::prelude::*;

use super::element::{Element, Real};

/// Rows (pixels) per chunk of a per-channel reduction.
pub(crate) const ROWS_PER_CHUNK: usize = 512;

/// Elements (whole pixels) per block of the blocked maps: a block's inputs are widened into an
/// arithmetic-type scratch (F16C in FP16 mode) and its output stored from one, so the per-element
/// work is plain loops over channels.
const BLOCK_ELEMS: usize = 1024;

/// Fewest elements one rayon task of a blocked map handles (smaller tensors run inline: a
/// fork-join costs more than mapping a few thousand elements).
const MIN_ELEMS_PER_BLOCKED_TASK: usize = 16 * 1024;

/// Scratch of a blocked fill: room for this many arithmetic-type copies of one block (a map's
/// inputs and its results).
const BLOCK_INPUTS: usize = 4;

/// Fills `out` (an NHWC tensor with `c` channels) block by block: `f(first, scratch, block)`
/// writes `block = out[first..first + block.len()]` (whole pixels), with `scratch` of
/// [`BLOCK_INPUTS`]` * block.len()` arithmetic values to widen its inputs into. Each element is
/// written once, so the result does not depend on the thread count.
pub(crate) fn fill_blocks<T, F>(out: &mut [T], c: usize, f: F)
where
    T: Element,
    F: Fn(usize, &mut [T::Acc], &mut [T]) + Sync + Send,
{
    let block = (BLOCK_ELEMS / c).max(1) * c;
    let per_task = block * (MIN_ELEMS_PER_BLOCKED_TASK / block).max(1);
    let run = |task_first: usize, dst: &mut [T], scratch: &mut Vec<T::Acc>| {
        scratch.resize(BLOCK_INPUTS * block, T::Acc::ZERO);
        for (b, chunk) in dst.chunks_mut(block).enumerate() {
            let n = chunk.len();
            f(
                task_first + b * block,
                &mut scratch[..BLOCK_INPUTS * n],
                chunk,
            );
        }
    };
    if out.len() <= per_task {
        run(0, out, &mut Vec::new());
    } else {
        out.par_chunks_mut(per_task)
            .enumerate()
            .for_each_init(Vec::new, |scratch, (task, dst)| {
                run(task * per_task, dst, scratch)
            });
    }
}

/// An element-wise map over an NHWC tensor of `len` elements with `c` channels, computed in
/// the arithmetic type and stored once: `f(first, scratch, out)` fills `out` with the values of
/// elements `first..first + out.len()` (whole pixels), widening its inputs into `scratch`
/// (`3 * out.len()` values).
pub(crate) fn map_blocks<T, F>(len: usize, c: usize, f: F) -> Vec<T>
where
    T: Element,
    F: Fn(usize, &mut [T::Acc], &mut [T::Acc]) + Sync + Send,
{
    map_blocks_into(Vec::new(), len, c, f)
}

/// [`map_blocks`] into `out`'s storage (resized to `len`; every element is overwritten).
pub(crate) fn map_blocks_into<T, F>(mut out: Vec<T>, len: usize, c: usize, f: F) -> Vec<T>
where
    T: Element,
    F: Fn(usize, &mut [T::Acc], &mut [T::Acc]) + Sync + Send,
{
    out.resize(len, T::default());
    map_blocks_slice(&mut out, c, f);
    out
}

/// [`map_blocks`] over the elements of `out` (every element is overwritten).
pub(crate) fn map_blocks_slice<T, F>(out: &mut [T], c: usize, f: F)
where
    T: Element,
    F: Fn(usize, &mut [T::Acc], &mut [T::Acc]) + Sync + Send,
{
    map_blocks_lanes(out, c, |_, _| false, f);
}

/// [`map_blocks_slice`], each block offered first to `lanes(first, block)`, which fills it and
/// returns true where it has a vector path for it (the same values), false to leave it to `f`.
pub(crate) fn map_blocks_lanes<T, L, F>(out: &mut [T], c: usize, lanes: L, f: F)
where
    T: Element,
    L: Fn(usize, &mut [T]) -> bool + Sync + Send,
    F: Fn(usize, &mut [T::Acc], &mut [T::Acc]) + Sync + Send,
{
    fill_blocks(out, c, |first, scratch, dst: &mut [T]| {
        if lanes(first, dst) {
            return;
        }
        let n = dst.len();
        // The last third of the scratch holds the block's results before they are stored.
        let (ins, res) = scratch.split_at_mut((BLOCK_INPUTS - 1) * n);
        f(first, ins, &mut res[..n]);
        T::store_into(&res[..n], dst);
    });
}

/// Per-channel sums in `f64` over the `rows` pixels of an NHWC tensor with `c` channels.
///
/// The rows are split into chunks of a fixed size; `add_rows(rows, scratch, acc)` adds the
/// contributions of one chunk's `rows`, in row order, to `acc[channel][j]` for the `V` sums it
/// computes (with a scratch of its own kind to widen the chunk's inputs into), and the chunks'
/// partial sums are added in chunk order. Summing in `f64` makes the result's relative error
/// about `rows * 2^-53`, far below the FP32 rounding of the outputs, so the reference gives the
/// correctly rounded sum for any realistic size.
pub(crate) fn channel_sums<const V: usize, S, F>(
    rows: usize,
    c: usize,
    add_rows: F,
) -> Vec<[f64; V]>
where
    S: Default + Send,
    F: Fn(Range<usize>, &mut S, &mut [[f64; V]]) + Sync + Send,
{
    let chunks = rows.div_ceil(ROWS_PER_CHUNK);
    let chunk = |chunk: usize, scratch: &mut S| {
        let mut acc = vec![[0.0; V]; c];
        let end = ((chunk + 1) * ROWS_PER_CHUNK).min(rows);
        add_rows(chunk * ROWS_PER_CHUNK..end, scratch, &mut acc);
        acc
    };
    let partials: Vec<Vec<[f64; V]>> = if rows * c <= MIN_ELEMS_PER_BLOCKED_TASK {
        let mut scratch = S::default();
        (0..chunks).map(|i| chunk(i, &mut scratch)).collect()
    } else {
        (0..chunks)
            .into_par_iter()
            .map_init(S::default, |scratch, i| chunk(i, scratch))
            .collect()
    };
    add_partials(c, &partials)
}

/// The chunks' partial sums added in chunk order.
pub(crate) fn add_partials<const V: usize>(c: usize, partials: &[Vec<[f64; V]>]) -> Vec<[f64; V]> {
    let mut total = vec![[0.0; V]; c];
    for partial in partials {
        for (t, p) in total.iter_mut().zip(partial) {
            for (tv, pv) in t.iter_mut().zip(p) {
                *tv += pv;
            }
        }
    }
    total
}
