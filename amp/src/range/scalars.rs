//! [`Scalars`]: the S region, on the host.
//!
//! S is one 256-byte slot, little-endian like every CUDA device. The CUDA side declares the
//! same layout as `struct AmpScalars` in `kernels/amp_common.cuh`, with `static_assert`s on
//! each offset, so a drift between the two fails the NVRTC compile test.
//!
//! | offset | type | field            | written by                           |
//! |-------:|------|------------------|--------------------------------------|
//! |      0 | f32  | `loss_scale`     | loss-scale update                    |
//! |      4 | u32  | `overflow`       | check (sets to 1), update (clears)   |
//! |      8 | u32  | `growth_tracker` | loss-scale update                    |
//! |     12 | u32  | `step`           | loss-scale update (applied steps)    |
//! |     16 | u32  | `skipped`        | loss-scale update (skipped steps)    |
//! | 20–255 | —    | reserved, zero   | nobody                               |

use crate::error::RangeOpError;
use crate::range::scale::LossScalePolicy;

/// Size of the S region in bytes (one slot).
pub const S_REGION_BYTES: usize = 256;

/// Byte offsets of the fields of the S region.
pub mod s_layout {
    /// `f32` current loss scale.
    pub const LOSS_SCALE: usize = 0;
    /// `u32` overflow flag of the current step: 0 clear, nonzero found NaN/Inf.
    pub const OVERFLOW: usize = 4;
    /// `u32` applied steps since the scale last changed (drives growth).
    pub const GROWTH_TRACKER: usize = 8;
    /// `u32` applied (not skipped) optimizer steps, wrapping.
    pub const STEP: usize = 12;
    /// `u32` skipped steps (overflow), wrapping.
    pub const SKIPPED: usize = 16;
    /// Bytes in use; the rest of the slot is reserved and kept zero.
    pub const USED: usize = 20;
}

/// Host mirror of the S region: what the device scalars hold between kernels.
///
/// The CPU range ops read and write it exactly as the kernels read and write S.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scalars {
    /// Current loss scale (the loss gradient seed is multiplied by it).
    pub loss_scale: f32,
    /// Overflow flag of the current step: set by the check, cleared by the scale update.
    pub overflow: u32,
    /// Applied steps since the scale last changed.
    pub growth_tracker: u32,
    /// Applied optimizer steps (wrapping).
    pub step: u32,
    /// Skipped optimizer steps (wrapping).
    pub skipped: u32,
}

impl Scalars {
    /// Fresh scalars for `policy`: scale at its initial value, flag clear, counters zero.
    pub fn new(policy: &LossScalePolicy) -> Self {
        Scalars {
            loss_scale: policy.init_scale,
            overflow: 0,
            growth_tracker: 0,
            step: 0,
            skipped: 0,
        }
    }

    /// Whether the overflow flag is set (the optimizer and EMA will skip).
    pub fn overflowed(&self) -> bool {
        self.overflow != 0
    }

    /// The S region's byte image, to upload once at start (reserved bytes zero).
    pub fn to_bytes(&self) -> [u8; S_REGION_BYTES] {
        let mut out = [0u8; S_REGION_BYTES];
        let mut put = |at: usize, b: [u8; 4]| out[at..at + 4].copy_from_slice(&b);
        put(s_layout::LOSS_SCALE, self.loss_scale.to_le_bytes());
        put(s_layout::OVERFLOW, self.overflow.to_le_bytes());
        put(s_layout::GROWTH_TRACKER, self.growth_tracker.to_le_bytes());
        put(s_layout::STEP, self.step.to_le_bytes());
        put(s_layout::SKIPPED, self.skipped.to_le_bytes());
        out
    }

    /// Reads scalars back from an S region image (at least [`s_layout::USED`] bytes).
    ///
    /// # Errors
    /// [`RangeOpError::ScalarsTooShort`] when `bytes` is too short.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, RangeOpError> {
        if bytes.len() < s_layout::USED {
            return Err(RangeOpError::ScalarsTooShort {
                got: bytes.len(),
                needed: s_layout::USED,
            });
        }
        let word = |at: usize| [bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]];
        Ok(Scalars {
            loss_scale: f32::from_le_bytes(word(s_layout::LOSS_SCALE)),
            overflow: u32::from_le_bytes(word(s_layout::OVERFLOW)),
            growth_tracker: u32::from_le_bytes(word(s_layout::GROWTH_TRACKER)),
            step: u32::from_le_bytes(word(s_layout::STEP)),
            skipped: u32::from_le_bytes(word(s_layout::SKIPPED)),
        })
    }
}

impl Default for Scalars {
    /// Scalars for the default (fixed, 8192) policy.
    fn default() -> Self {
        Scalars::new(&LossScalePolicy::default())
    }
}
