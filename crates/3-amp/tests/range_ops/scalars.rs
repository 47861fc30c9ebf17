//! S region.

use super::*;

#[test]
pub(super) fn scalars_round_trip_through_the_s_image() {
    let s = Scalars {
        loss_scale: 1024.0,
        overflow: 1,
        growth_tracker: 7,
        step: 123_456,
        skipped: u32::MAX,
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 5e-4,
        ranks: 3,
        clip_norm: 1.5,
        grad_norm: 0.25,
        accum: 7,
        norm_partials: std::array::from_fn(|k| k as f32 + 0.5),
    };
    let bytes = s.to_bytes();
    assert_eq!(bytes.len(), S_REGION_BYTES);
    let partials = s_layout::NORM_PARTIALS..s_layout::NORM_PARTIALS + 4 * s_layout::NORM_BLOCKS;
    assert!(
        bytes[s_layout::ACCUM + 4..partials.start]
            .iter()
            .chain(&bytes[partials.end..])
            .all(|&b| b == 0),
        "reserved bytes are zero"
    );
    assert_eq!(&bytes[s_layout::CLIP_NORM..][..4], &1.5f32.to_le_bytes());
    assert_eq!(&bytes[s_layout::GRAD_NORM..][..4], &0.25f32.to_le_bytes());
    assert_eq!(
        &bytes[partials.start + 4 * 31..][..4],
        &31.5f32.to_le_bytes()
    );
    assert_eq!(&bytes[s_layout::LOSS_SCALE..][..4], &1024f32.to_le_bytes());
    assert_eq!(&bytes[s_layout::STEP..][..4], &123_456u32.to_le_bytes());
    assert_eq!(&bytes[s_layout::LR..][..4], &0.05f32.to_le_bytes());
    assert_eq!(
        &bytes[s_layout::WEIGHT_DECAY..][..4],
        &5e-4f32.to_le_bytes()
    );
    assert_eq!(Scalars::from_bytes(&bytes).unwrap(), s);
    assert_eq!(&bytes[s_layout::RANKS..][..4], &3u32.to_le_bytes());
    assert_eq!(&bytes[s_layout::ACCUM..][..4], &7u32.to_le_bytes());
    // An image that ends before ACCUM (as S images written before the field existed) reads
    // one micro-batch.
    let short = Scalars::from_bytes(&bytes[..s_layout::USED]).unwrap();
    assert_eq!((short.accum, short.unscale()), (0, 1.0 / (1024.0 * 3.0)));
    assert_eq!(
        Scalars::from_bytes(&bytes[..43]).unwrap_err(),
        RangeOpError::ScalarsTooShort {
            got: 43,
            needed: 44
        }
    );
    let fresh = Scalars::default();
    assert_eq!(fresh.loss_scale, DEFAULT_INIT_SCALE);
    assert!(!fresh.overflowed());
}

#[test]
pub(super) fn s_layout_matches_the_cuda_struct() {
    // The header static_asserts each offset; make sure they are the Rust offsets.
    for (field, offset) in [
        ("loss_scale", s_layout::LOSS_SCALE),
        ("overflow", s_layout::OVERFLOW),
        ("growth_tracker", s_layout::GROWTH_TRACKER),
        ("step", s_layout::STEP),
        ("skipped", s_layout::SKIPPED),
        ("clip_norm", s_layout::CLIP_NORM),
        ("grad_norm", s_layout::GRAD_NORM),
        ("accum", s_layout::ACCUM),
        ("norm_partials", s_layout::NORM_PARTIALS),
    ] {
        let assert = format!("__builtin_offsetof(AmpScalars, {field}) == {offset},");
        assert!(COMMON_HEADER.contains(&assert), "missing `{assert}`");
    }
    // The struct ends with the partial sums of the gradient norm.
    let size = s_layout::NORM_PARTIALS + 4 * s_layout::NORM_BLOCKS;
    assert!(COMMON_HEADER.contains(&format!("sizeof(AmpScalars) == {size}")));
    assert!(COMMON_HEADER.contains(&format!(
        "#define AMP_NORM_BLOCKS {}",
        s_layout::NORM_BLOCKS
    )));
}
