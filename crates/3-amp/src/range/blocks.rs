//! How the CPU twins run over a whole region: in tasks of [`PER_TASK`] elements spread over
//! rayon's threads, each task in blocks of [`BLOCK`] elements whose FP16 side is converted
//! in one slice call (F16C where the CPU has it, through `half`).
//!
//! Every element goes through the same operations, in the same order, whatever the split:
//! results depend neither on the thread count nor on the block size. The conversions are the
//! ones [`super::cast`] defines one value at a time (round to nearest even; canonical NaN,
//! selected after the slice conversion, whose NaN payloads are the hardware's).

use half::f16;
use half::slice::HalfFloatSliceExt as _;
use rayon::prelude::*;

use super::cast::{F16_CANONICAL_NAN, F32_CANONICAL_NAN};

/// Elements per block: a block's FP32 values are still in L1 when they are converted.
pub(crate) const BLOCK: usize = 2048;

/// Elements per rayon task; a range of at most one task runs on the calling thread (a
/// fork-join costs more than a few tens of thousands of element updates).
pub(crate) const PER_TASK: usize = 32 * 1024;

/// `dst[i] = f32_to_f16(src[i])` (equal lengths).
pub(crate) fn narrow(src: &[f32], dst: &mut [f16]) {
    dst.convert_from_f32_slice(src);
    // The NaN pass as a select on the bits, which runs in vector lanes where a branch per
    // element did not.
    for (d, s) in dst.iter_mut().zip(src) {
        let bits = if s.is_nan() {
            F16_CANONICAL_NAN
        } else {
            d.to_bits()
        };
        *d = f16::from_bits(bits);
    }
}

/// `dst[i] = f16_to_f32(src[i])` (equal lengths).
pub(crate) fn widen(src: &[f16], dst: &mut [f32]) {
    src.convert_to_f32_slice(dst);
    // As in `narrow`; an FP16 NaN has all exponent bits set and a nonzero mantissa.
    for (d, s) in dst.iter_mut().zip(src) {
        let nan = s.to_bits() & 0x7fff > 0x7c00;
        let bits = if nan { F32_CANONICAL_NAN } else { d.to_bits() };
        *d = f32::from_bits(bits);
    }
}

/// The index ranges of a task's blocks of [`BLOCK`] elements (the last one shorter).
pub(crate) fn block_ranges(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len)
        .step_by(BLOCK)
        .map(move |start| start..(start + BLOCK).min(len))
}

/// Splits `v` into tasks of [`PER_TASK`] elements.
pub(crate) fn tasks_mut<T>(v: &mut [T]) -> Vec<&mut [T]> {
    v.chunks_mut(PER_TASK).collect()
}

/// Splits `v` into tasks of [`PER_TASK`] elements.
pub(crate) fn tasks<T>(v: &[T]) -> Vec<&[T]> {
    v.chunks(PER_TASK).collect()
}

/// Runs `f` on each task's items: on the calling thread for a single task, else in parallel.
pub(crate) fn run<I: Send, R: Send>(items: Vec<I>, f: impl Fn(I) -> R + Sync + Send) -> Vec<R> {
    if items.len() <= 1 {
        items.into_iter().map(f).collect()
    } else {
        items.into_par_iter().map(f).collect()
    }
}

/// `dst = narrow(src)` over a whole range, in parallel tasks.
pub(crate) fn narrow_all(src: &[f32], dst: &mut [f16]) {
    let items: Vec<_> = tasks(src).into_iter().zip(tasks_mut(dst)).collect();
    run(items, |(s, d)| narrow(s, d));
}

/// `dst = widen(src)` over a whole range, in parallel tasks.
pub(crate) fn widen_all(src: &[f16], dst: &mut [f32]) {
    let items: Vec<_> = tasks(src).into_iter().zip(tasks_mut(dst)).collect();
    run(items, |(s, d)| widen(s, d));
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::range::cast::{f16_to_f32, f32_to_f16};

    /// FP32 values that exercise every path of a conversion: both zeros, subnormals of both
    /// formats, the FP16 rounding boundaries (65504, the tie at 65520, just below it), ties
    /// to even, infinities and NaNs with payloads and signs, then pseudo-random bit patterns.
    pub(crate) fn awkward_f32(n: usize) -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0e-45,
            -6.0e-8,
            5.96e-8,
            2.98e-8,
            6.1e-5,
            65504.0,
            65519.996,
            65520.0,
            -65520.0,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7FC0_0001),
            f32::from_bits(0xFF80_0001),
            f32::from_bits(0x7F80_0001),
            f32::MAX,
            f32::MIN_POSITIVE,
        ];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        while v.len() < n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Mostly finite values of FP16's range; every 16th an arbitrary bit pattern.
            let bits = x as u32;
            v.push(if x.is_multiple_of(16) {
                f32::from_bits(bits)
            } else {
                (bits as i32 as f32) * 2.0f32.powi((x >> 40) as i32 % 24 - 36)
            });
        }
        v.truncate(n);
        v
    }

    #[test]
    fn the_slice_conversions_equal_the_one_value_definitions_bit_for_bit() {
        // Several tasks and a ragged end, so the parallel split and the 8-lane remainder of
        // the slice conversion both run.
        let n = 3 * PER_TASK + BLOCK + 13;
        let src = awkward_f32(n);
        let mut half = vec![f16::ZERO; n];
        narrow_all(&src, &mut half);
        for (i, (&h, &s)) in half.iter().zip(&src).enumerate() {
            assert_eq!(
                h.to_bits(),
                f32_to_f16(s).to_bits(),
                "narrow [{i}] of {s:e}"
            );
        }
        // Every FP16 bit pattern, NaNs with payloads included, widened.
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut wide = vec![0.0f32; all.len()];
        widen_all(&all, &mut wide);
        for (&w, &h) in wide.iter().zip(&all) {
            assert_eq!(
                w.to_bits(),
                f16_to_f32(h).to_bits(),
                "widen {:#06x}",
                h.to_bits()
            );
        }
    }
}
