//! The global gradient norm, for clipping by norm (PyTorch's `clip_grad_norm_`).
//!
//! The device sums in one fixed order, so the norm is deterministic run to run and this twin
//! is bit-exact with `amp_grad_sumsq` + `amp_grad_norm` (crates/3-amp/kernels/amp_norm.cu): the
//! reduction's geometry is fixed at [`s_layout::NORM_BLOCKS`] blocks of [`NORM_THREADS`]
//! threads, whatever the size of G.

use rayon::prelude::*;

use crate::range::scalars::{s_layout, Scalars};

/// Threads per block of the gradient-norm reduction.
pub const NORM_THREADS: usize = 256;

/// CPU twin of `amp_grad_sumsq` then `amp_grad_norm` over `g` (the FP32 gradients of a step,
/// still scaled by the loss scale and summed over `s.ranks` and `s.accum`).
///
/// Thread `t` of block `b` sums `g[i]²` for `i = b·256 + t + k·(32·256)`, `k = 0, 1, …` in
/// order; each block adds its 256 sums pairwise (`sum[t] += sum[t + h]` for
/// `h = 128, 64, …, 1`) into `s.norm_partials[b]`; then
/// `s.grad_norm = sqrt(Σ_b partials[b], added in order) / (loss_scale · ranks · accum)`
/// ([`Scalars::unscale_denominator`]), the norm of the gradients SGD applies. Every operation is one FP32 rounding. A
/// NaN or infinite gradient makes the norm NaN or infinite; the step is then skipped by the
/// overflow check anyway.
pub fn grad_norm(g: &[f32], s: &mut Scalars) {
    let stride = s_layout::NORM_BLOCKS * NORM_THREADS;
    // Each block's partial sum is its own (the device's blocks run independently too).
    s.norm_partials
        .par_iter_mut()
        .enumerate()
        .for_each(|(b, partial)| {
            let mut sums = [0.0f32; NORM_THREADS];
            for (t, acc) in sums.iter_mut().enumerate() {
                let mut i = b * NORM_THREADS + t;
                while i < g.len() {
                    *acc += g[i] * g[i];
                    i += stride;
                }
            }
            let mut half = NORM_THREADS / 2;
            while half > 0 {
                for t in 0..half {
                    sums[t] += sums[t + half];
                }
                half /= 2;
            }
            *partial = sums[0];
        });
    let sum = s.norm_partials.iter().fold(0.0f32, |acc, p| acc + p);
    s.grad_norm = sum.sqrt() / s.unscale_denominator();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_norm_is_the_unscaled_l2_norm_and_every_element_counts_once() {
        // Integers squared and summed exactly in FP32: the result is the exact norm.
        let n = 3 * s_layout::NORM_BLOCKS * NORM_THREADS + 17;
        let g: Vec<f32> = (0..n).map(|i| ((i % 7) as f32) - 3.0).collect();
        let exact: f64 = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let mut s = Scalars {
            loss_scale: 4.0,
            ..Scalars::default()
        };
        grad_norm(&g, &mut s);
        let partials: f64 = s.norm_partials.iter().map(|&p| f64::from(p)).sum();
        assert_eq!(partials, exact);
        assert_eq!(f64::from(s.grad_norm), exact.sqrt() as f32 as f64 / 4.0);
        // Over two ranks G holds sums: the norm is of their average.
        let mut two = Scalars { ranks: 2, ..s };
        grad_norm(&g, &mut two);
        assert_eq!(two.grad_norm, s.grad_norm / 2.0);
    }
}
