//! Casts between FP32 and FP16 regions (W→A, E→E16, G16→G).
//!
//! Rounding is IEEE round-to-nearest-even, the device's `__float2half_rn`: subnormal results
//! are kept (no flush to zero), values from 65520 up (the midpoint between 65504 and the next
//! power of two, which ties to even) become Inf.
//!
//! NaNs come out canonical: FP16 `0x7FFF`, FP32 `0x7FFF_FFFF`. The hardware conversion's
//! NaN payload is not something we want two executors to agree on by luck, so both sides
//! select the canonical NaN explicitly; a NaN is still a NaN for the overflow check.

use half::f16;

use super::blocks;
use crate::error::RangeOpError;

/// The FP16 NaN every cast produces (`CUDART_NAN_FP16`).
pub const F16_CANONICAL_NAN: u16 = 0x7FFF;
/// The FP32 NaN every cast produces (`CUDART_NAN_F`).
pub const F32_CANONICAL_NAN: u32 = 0x7FFF_FFFF;

/// One FP32→FP16 conversion as the kernels do it: RNE, canonical NaN.
pub fn f32_to_f16(x: f32) -> f16 {
    if x.is_nan() {
        f16::from_bits(F16_CANONICAL_NAN)
    } else {
        // `half` rounds to nearest even, in software or with F16C.
        f16::from_f32(x)
    }
}

/// One FP16→FP32 conversion as the kernels do it: exact, canonical NaN.
pub fn f16_to_f32(x: f16) -> f32 {
    if x.is_nan() {
        f32::from_bits(F32_CANONICAL_NAN)
    } else {
        x.to_f32()
    }
}

/// [`RangeOpError::LengthMismatch`] unless slice `what` of range op `op` has `expected`
/// elements: the length check of every host twin (netops' too).
///
/// # Errors
/// [`RangeOpError::LengthMismatch`] naming `op`, `what` and both lengths.
pub fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), RangeOpError> {
    if expected == got {
        Ok(())
    } else {
        Err(RangeOpError::LengthMismatch {
            op,
            what,
            expected,
            got,
        })
    }
}

/// CPU twin of `amp_cast_f32_to_f16`: `dst[i] = f32_to_f16(src[i])` (in blocks over
/// rayon's threads, `blocks.rs`).
///
/// # Errors
/// [`RangeOpError::LengthMismatch`] when the slices differ in length.
pub fn cast_f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<(), RangeOpError> {
    check_len("cast_f32_to_f16", "dst", src.len(), dst.len())?;
    blocks::narrow_all(src, dst);
    Ok(())
}

/// CPU twin of `amp_cast_f16_to_f32`: `dst[i] = f16_to_f32(src[i])` (in blocks over
/// rayon's threads, `blocks.rs`).
///
/// # Errors
/// [`RangeOpError::LengthMismatch`] when the slices differ in length.
pub fn cast_f16_to_f32(src: &[f16], dst: &mut [f32]) -> Result<(), RangeOpError> {
    check_len("cast_f16_to_f32", "dst", src.len(), dst.len())?;
    blocks::widen_all(src, dst);
    Ok(())
}
