//! Training-time augmentation and shuffling, deterministic from a seed.
//!
//! The random numbers come from SplitMix64 (Steele, Lea and Flood's finalizer over a
//! counter, the generator `cudnn_cbr::net::splitmix` also uses): every draw is a pure
//! function of the seed and of what it is for (the epoch for a shuffle; the batch index and
//! the place in the batch for a crop), never of a generator's history, so batches come out
//! the same on any thread, in any order, and batch `k` can be made without making batches
//! `0..k`. A draw in `0..bound` is the high half of the 128-bit product `draw × bound`
//! (Lemire's multiply-shift), whose bias (under `bound / 2^64`) is far below anything a
//! training run can tell.

/// Padding on each side before the random crop.
pub const PAD: usize = 4;
/// Image side (the crop's size).
const HW: usize = crate::cifar::HW;

/// SplitMix64's finalizer: a well-spread hash of `z`.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A draw in `0..bound` from the 64-bit `h`.
fn below(h: u64, bound: u64) -> u64 {
    ((u128::from(h) * u128::from(bound)) >> 64) as u64
}

// Domain separators, so a shuffle's and a crop's draws of the same numbers differ.
const SHUFFLE: u64 = 0x5348_5546_464c_4531;
const CROP: u64 = 0x4352_4f50_464c_4950;

/// One image's augmentation: the crop's offset into the image padded by [`PAD`] on each side
/// (`0..=2·PAD` each way), then a horizontal flip of the crop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crop {
    /// Rows skipped at the top of the padded image.
    pub dy: usize,
    /// Columns skipped at the left of the padded image.
    pub dx: usize,
    /// Mirror the crop left to right.
    pub flip: bool,
}

impl Crop {
    /// The centred crop, unflipped: the image itself.
    pub const IDENTITY: Crop = Crop {
        dy: PAD,
        dx: PAD,
        flip: false,
    };

    /// The image pixel that output pixel `(y, x)` shows, or `None` for the padding.
    pub fn source(self, y: usize, x: usize) -> Option<(usize, usize)> {
        let x = if self.flip { HW - 1 - x } else { x };
        let (py, px) = (y + self.dy, x + self.dx);
        let inside = |p: usize| (PAD..PAD + HW).contains(&p);
        (inside(py) && inside(px)).then(|| (py - PAD, px - PAD))
    }
}

/// The crop of image `slot` of training batch `index` under `seed`: offsets uniform in
/// `0..=2·PAD`, flip with probability 1/2.
pub fn crop_for(seed: u64, index: u64, slot: usize) -> Crop {
    let h = mix(mix(seed ^ CROP) ^ mix(index).rotate_left(17) ^ slot as u64);
    let span = 2 * PAD as u64 + 1;
    Crop {
        dy: below(h, span) as usize,
        dx: below(mix(h), span) as usize,
        flip: mix(h ^ 1) >> 63 == 1,
    }
}

/// The order of the `n` training records in `epoch` under `seed`: a Fisher–Yates shuffle.
pub fn epoch_permutation(seed: u64, epoch: u64, n: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    let base = mix(seed ^ SHUFFLE) ^ mix(epoch);
    for i in (1..n).rev() {
        let j = below(mix(base ^ i as u64), i as u64 + 1) as usize;
        p.swap(i, j);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crops_cover_every_offset_and_both_flips() {
        let crops: Vec<Crop> = (0..2000).map(|j| crop_for(7, 3, j)).collect();
        for d in 0..=2 * PAD {
            assert!(crops.iter().any(|c| c.dy == d), "dy {d} never drawn");
            assert!(crops.iter().any(|c| c.dx == d), "dx {d} never drawn");
        }
        let flips = crops.iter().filter(|c| c.flip).count();
        // 1000 expected; ±150 is over 6 standard deviations.
        assert!((850..1150).contains(&flips), "{flips} flips of 2000");
    }

    #[test]
    fn a_permutation_holds_every_record_once() {
        let mut p = epoch_permutation(1, 0, 1000);
        assert_ne!(p, (0..1000).collect::<Vec<_>>());
        assert_ne!(p, epoch_permutation(1, 1, 1000));
        p.sort_unstable();
        assert_eq!(p, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn the_identity_crop_maps_each_pixel_to_itself() {
        assert_eq!(Crop::IDENTITY.source(5, 9), Some((5, 9)));
        let c = Crop {
            dy: 0,
            dx: 8,
            flip: true,
        };
        // Output row 0 is padded row 0 (padding); output (4, 0) flips to column 31, padded
        // column 39: padding too; (4, 4) is column 27 + 8 − 4 = 31 of row 0.
        assert_eq!(c.source(0, 0), None);
        assert_eq!(c.source(4, 0), None);
        assert_eq!(c.source(4, 4), Some((0, 31)));
    }
}
