//! Deterministic FP16 test values, shared by the CPU benches (`benches/reference.rs`,
//! `benches/cpu_ops.rs`) through `#[path]`.

use half::f16;

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
