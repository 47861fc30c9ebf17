//! Deterministic FP16 test values and square conv shapes, shared by the CPU benches
//! (`benches/reference.rs`, `benches/cpu_ops.rs`) through `#[path]`.

use cudnn_cbr::fusion::reference::ConvParams;
use half::f16;

/// A conv of `batch` square `hw`×`hw` images of `c` channels into `k`, with an `rs`×`rs`
/// filter, `pad` on every side and `stride` both ways.
pub fn square_conv(
    batch: usize,
    (c, hw, k): (usize, usize, usize),
    (rs, pad, stride): (usize, usize, usize),
) -> ConvParams {
    ConvParams::new(batch, c, hw, hw, k, rs, rs)
        .with_padding(pad, pad)
        .with_stride(stride, stride)
}

/// `len` values in [-1, 1) from an xorshift stream seeded by `seed`, rounded to FP16.
pub fn values(len: usize, seed: u64) -> Vec<f16> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f16::from_f32((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}
