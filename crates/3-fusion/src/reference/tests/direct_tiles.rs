//! The conv tiles straight from the padded source (`direct.rs`) against the gather and the
//! GEMM they replace: the same bits, at every instruction-set level this CPU has, on shapes
//! whose tiles take the direct path, fall back to the gather (reductions under 3, tiles of at
//! most 256 outputs or two rows), or mix both (tail tiles), with output channels that leave
//! vector remainders (7 = scalar columns only, 24 = 16 + 8, 40 = 32 + 8), and reductions
//! deeper than 512 in blocks (`direct::reduction_blocks`); and a strided dgrad's phases, read
//! from the image's padded `dy` (`conv/phases.rs`).

use super::fast_paths::conv_shapes;
use super::util::Rng;
use crate::reference::conv::{dgrad_all_taps, dgrad_phases, fprop_acc, wgrad_acc};
use crate::reference::simd::forced;
use crate::reference::ConvParams;
use crate::reference::CpuSimd;

fn shapes() -> Vec<ConvParams> {
    // The fast paths' conv shapes (the mini network's among them), then tails and fallbacks.
    let mut shapes = conv_shapes();
    shapes.extend([
        // Remainders: 297 rows (a 41-row tail tile), 7 output channels.
        ConvParams::new(3, 5, 9, 11, 7, 3, 3).with_padding(1, 1),
        ConvParams::new(2, 8, 16, 16, 40, 3, 3).with_padding(1, 1),
        ConvParams::new(5, 8, 7, 7, 24, 3, 3).with_padding(1, 1),
        // 130 rows: a 2-row tail tile (the gather's, in every op).
        ConvParams::new(1, 16, 10, 13, 16, 3, 3).with_padding(1, 1),
        // A 576-deep reduction in 36-row tiles of 16 outputs (512 deep, then 64).
        ConvParams::new(1, 64, 6, 6, 16, 3, 3).with_padding(1, 1),
        // A 1-deep reduction; 25-row products of at most 256 outputs.
        ConvParams::new(2, 1, 8, 8, 8, 1, 1),
        ConvParams::new(1, 4, 5, 5, 3, 3, 3).with_padding(1, 1),
        // Strided, for the phases: stride 3 by 2 with a dilation (taps of 1 to 4 per phase,
        // 24 = 16 + 8 input channels); a 1×1 stride-2 projection (a quarter of the pixels).
        ConvParams::new(2, 24, 13, 11, 20, 3, 3)
            .with_padding(1, 2)
            .with_stride(3, 2)
            .with_dilation(2, 1),
        ConvParams::new(2, 48, 9, 9, 32, 1, 1).with_stride(2, 2),
    ]);
    shapes
}

/// Reductions deeper than 512 in tiles past 64×64 outputs: blocks of equal depth (fprop 576
/// = 288 + 288 in 128-row tiles, 512 + 64 in the 34-row tail; 1152 = 3 × 384; 2304 = 5 × ~461;
/// dgrad 648 = 2 × 324; the strided dgrad's four-tap phase 640 deep: 2 × 320 in 81 rows of 72,
/// 512 + 128 in 36 rows of 40).
fn deep_shapes() -> Vec<ConvParams> {
    let strided = |c, hw, k| {
        ConvParams::new(1, c, hw, hw, k, 3, 3)
            .with_padding(1, 1)
            .with_stride(2, 2)
    };
    vec![
        strided(72, 18, 160),
        strided(40, 12, 160),
        ConvParams::new(2, 64, 9, 9, 64, 3, 3).with_padding(1, 1),
        ConvParams::new(1, 128, 12, 12, 40, 3, 3).with_padding(1, 1),
        ConvParams::new(1, 256, 10, 10, 72, 3, 3).with_padding(1, 1),
    ]
}

/// Whether the `gemm` crate blocks reductions as the direct tiles do on this CPU: it sizes
/// its blocks from the L1 data cache (512 deep for the usual 32 KiB 8-way one; 1024 for a
/// 48 KiB 12-way one), the tiles always as for 32 KiB 8-way (direct.rs).
fn gemm_blocks_as_the_tiles_do() -> bool {
    // Its FMA kernels' 16×6 microtiles, f32, a reduction of 8 blocks of 512.
    gemm_common::cache::kernel_params(128, 64, 4096, 16, 6, 4).kc
        == crate::reference::direct::BLOCK_DEPTH
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn direct_tiles_match_the_gather_and_gemm_bit_for_bit_at_every_level() {
    let _held = forced::HELD.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(0xD1);
    let same_blocks = gemm_blocks_as_the_tiles_do();
    if !same_blocks {
        eprintln!(
            "the gemm crate blocks reductions by this CPU's L1 geometry unlike the direct tiles: \
             reductions over 512 compared across levels only"
        );
    }
    let deep = deep_shapes();
    for p in shapes().into_iter().chain(deep.iter().copied()) {
        p.validate().unwrap();
        // FP32 operands (not widened FP16, whose products are exact in FP32): a product
        // rounded apart from its sum, or a sum in another order, changes bits.
        let x = rng.floats(p.x_elems(), -2.0, 2.0);
        let w = rng.floats(p.w_elems(), -2.0, 2.0);
        let dy = rng.floats(p.y_elems(), -2.0, 2.0);
        let run = |level| {
            forced::set(Some(level));
            let strided = p.stride_h > 1 || p.stride_w > 1;
            let out = (
                fprop_acc(&p, &x, &w).unwrap(),
                dgrad_all_taps(&p, &dy, &w).unwrap(),
                wgrad_acc(&p, &x, &dy).unwrap(),
                strided.then(|| dgrad_phases(&p, &dy, &w).unwrap()),
            );
            forced::set(None);
            out
        };
        // Where gemm's blocks differ from the tiles', the widest level against AVX2 (each also
        // against the sum written out, direct.rs's tests).
        let want = if same_blocks || !deep.contains(&p) {
            run(CpuSimd::Portable)
        } else {
            run(CpuSimd::Avx2)
        };
        for level in [CpuSimd::Avx2, CpuSimd::Avx512] {
            let got = run(level);
            assert_eq!(bits(&got.0), bits(&want.0), "fprop {level:?} {p:?}");
            assert_eq!(bits(&got.1), bits(&want.1), "dgrad {level:?} {p:?}");
            assert_eq!(bits(&got.2), bits(&want.2), "wgrad {level:?} {p:?}");
            let phases = |v: &Option<Vec<f32>>| v.as_deref().map(bits);
            assert_eq!(phases(&got.3), phases(&want.3), "phases {level:?} {p:?}");
        }
    }
}
