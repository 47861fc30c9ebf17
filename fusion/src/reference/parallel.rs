//! How the reference ops split work over threads (rayon), deterministically.
//!
//! Results never depend on the number of threads: element-wise maps write each element once,
//! and reductions split the rows into chunks whose size depends only on the shape, then add the
//! chunks' partial sums in chunk order.

use rayon::prelude::*;

/// Fewest elements one rayon task of an element-wise map handles.
const MIN_ELEMS_PER_TASK: usize = 4096;

/// Rows (pixels) per chunk of a per-channel reduction.
const ROWS_PER_CHUNK: usize = 512;

/// `out[i] = f(i, i % c)` for `i` in `0..len`: an element-wise map over an NHWC tensor with `c`
/// channels, where `f` gets the flat index and the channel. `c` must be positive.
pub(crate) fn map_channels<U, F>(len: usize, c: usize, f: F) -> Vec<U>
where
    U: Send,
    F: Fn(usize, usize) -> U + Sync + Send,
{
    (0..len)
        .into_par_iter()
        .with_min_len(MIN_ELEMS_PER_TASK)
        .map(|i| f(i, i % c))
        .collect()
}

/// Per-channel sums in `f64` over the `rows` pixels of an NHWC tensor with `c` channels.
///
/// `add_row(row, acc)` adds row `row`'s contributions to `acc[channel][j]` for the `V` sums it
/// computes. Summing in `f64` makes the result's relative error about `rows * 2^-53`, far below
/// the FP32 rounding of the outputs, so the reference gives the correctly rounded sum for any
/// realistic size.
pub(crate) fn channel_sums<const V: usize, F>(rows: usize, c: usize, add_row: F) -> Vec<[f64; V]>
where
    F: Fn(usize, &mut [[f64; V]]) + Sync + Send,
{
    let chunks = rows.div_ceil(ROWS_PER_CHUNK);
    let partials: Vec<Vec<[f64; V]>> = (0..chunks)
        .into_par_iter()
        .map(|chunk| {
            let mut acc = vec![[0.0; V]; c];
            let end = ((chunk + 1) * ROWS_PER_CHUNK).min(rows);
            for row in chunk * ROWS_PER_CHUNK..end {
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
