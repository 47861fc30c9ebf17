//! Gradient accumulation over micro-batches: the CPU twin of `amp_accum_grads`
//! (`crates/3-amp/kernels/amp_cast.cu`).
//!
//! A step over N micro-batches zeroes G and G16 before each micro-batch's backward pass (BN
//! and FC gradients are written into G, not added), then adds that micro-batch's gradient into
//! the FP32 accumulator GA; the last micro-batch's pass *drains*: it writes the sum into G and
//! zeroes GA, so the overflow check, the norm and SGD of the step read G as with one batch.

use half::f16;

use super::blocks;
use crate::error::RangeOpError;
use crate::range::cast::{check_len, F32_CANONICAL_NAN};

/// CPU twin of `amp_accum_grads`: for every `i < g.len()`,
/// `x = g[i] + f16_to_f32(g16[i])` (only `x = g[i]` where `i ≥ g16.len()`: G16 ends at the
/// last conv parameter), `sum = acc[i] + x` (each addition one FP32 rounding, a NaN made
/// canonical); then `acc[i] = sum`, or with `drain` `g[i] = sum` and `acc[i] = 0`.
///
/// Adding G and G16 element by element is exact because the step zeroes both before the
/// backward pass and each parameter's gradient is written into exactly one of them (conv
/// weights into G16, the rest into G), so one of the two terms is always zero.
///
/// # Errors
/// [`RangeOpError::LengthMismatch`] when `acc` is not as long as `g`, or `g16` is longer.
pub fn accum_grads(
    g16: &[f16],
    g: &mut [f32],
    acc: &mut [f32],
    drain: bool,
) -> Result<(), RangeOpError> {
    check_len("accum_grads", "acc", g.len(), acc.len())?;
    if g16.len() > g.len() {
        return Err(RangeOpError::LengthMismatch {
            op: "accum_grads",
            what: "g16 (at most as long as g)",
            expected: g.len(),
            got: g16.len(),
        });
    }
    // G16's tasks line up with G's (the same task length from index 0); the last ones may
    // be shorter or missing, where G16 ends.
    let g16s = blocks::tasks(g16);
    let items: Vec<_> = blocks::tasks_mut(g)
        .into_iter()
        .zip(blocks::tasks_mut(acc))
        .enumerate()
        .map(|(t, (g, acc))| (g, acc, g16s.get(t).copied().unwrap_or_default()))
        .collect();
    blocks::run(items, |(g, acc, g16)| {
        let mut wide = vec![0.0f32; blocks::BLOCK];
        for r in blocks::block_ranges(g.len()) {
            // This block's G16 values, widened (`f16_to_f32`); none past G16's end.
            let g16 = &g16[g16.len().min(r.start)..g16.len().min(r.end)];
            let covered = g16.len();
            blocks::widen(g16, &mut wide[..covered]);
            let (g, acc) = (&mut g[r.clone()], &mut acc[r]);
            for (i, (gi, ai)) in g.iter_mut().zip(acc.iter_mut()).enumerate() {
                let mut x = *gi;
                if i < covered {
                    x += wide[i];
                }
                let mut sum = *ai + x;
                if sum.is_nan() {
                    sum = f32::from_bits(F32_CANONICAL_NAN);
                }
                if drain {
                    *gi = sum;
                    *ai = 0.0;
                } else {
                    *ai = sum;
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_add_up_and_the_drain_clears_the_accumulator() {
        // Two micro-batches over 5 elements, G16 covering the first 3 (conv), G the rest.
        let mut acc = vec![0.0f32; 5];
        let micro = [
            ([1.5f32, -2.0, 0.25], [0.0f32, 0.0, 0.0, 4.0, -1.0]),
            ([0.5f32, 1.0, -0.25], [0.0f32, 0.0, 0.0, 2.0, 8.0]),
        ];
        for (k, (conv, rest)) in micro.iter().enumerate() {
            let g16: Vec<f16> = conv.iter().map(|&x| f16::from_f32(x)).collect();
            let mut g = rest.to_vec();
            accum_grads(&g16, &mut g, &mut acc, k == 1).unwrap();
            if k == 1 {
                assert_eq!(g, vec![2.0, -1.0, 0.0, 6.0, 7.0]);
                assert_eq!(acc, vec![0.0; 5]);
            } else {
                assert_eq!(acc, vec![1.5, -2.0, 0.25, 4.0, -1.0]);
            }
        }
        // Inf and NaN propagate (canonical NaN), so the step's check sees them.
        let mut g = vec![0.0f32, f32::INFINITY];
        let mut acc = vec![f32::from_bits(0x7FC0_0001), 1.0];
        accum_grads(&[], &mut g, &mut acc, true).unwrap();
        assert_eq!(g[0].to_bits(), F32_CANONICAL_NAN);
        assert_eq!(g[1], f32::INFINITY);
        let e = accum_grads(&[f16::ZERO; 3], &mut [0.0; 2], &mut [0.0; 2], false).unwrap_err();
        assert!(matches!(e, RangeOpError::LengthMismatch { .. }), "{e:?}");
    }
}
