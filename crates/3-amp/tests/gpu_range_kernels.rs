//! Tier 4 (GPU): every range kernel against its CPU twin on random data, bit for bit (the
//! softmax seed within one FP16 ulp). The whole step and CUDA-graph replay: `gpu_step.rs`.
//!
//! Each test first opens device 0 and compiles the kernels through the crate's typed-error
//! path; where that says the machine cannot run them (no driver, no device, no NVRTC) the test
//! prints exactly one line `SKIP <test>: <reason>` and returns. It never fakes a result.

use std::sync::Arc;

use cudnn_cbr_amp::cuda::{CudaSlice, CudaStream, DevRange, DevRangeMut};
use cudnn_cbr_amp::plan::ByteRange;
use cudnn_cbr_amp::range::{
    self, LossScalePolicy, OverflowPolicy, Scalars, ScaleGrowth, SgdConfig,
};
use half::f16;

mod common;
use common::{device, download, f16_bytes, f32_bytes, upload, Rng};

// ---------------------------------------------------------------- device and data

/// Test data beyond [`Rng`]'s uniform values (an inherent impl: `Rng` is this crate's).
impl Rng {
    /// Mixed magnitudes plus the values that break conversions: NaNs with payloads, ±Inf,
    /// FP32 subnormals, FP16 subnormals, the FP16 overflow boundary, signed zeros.
    fn nasty_f32(&mut self) -> f32 {
        match self.below(16) {
            0 => f32::from_bits(0x7f80_0000 | (self.next_u64() as u32 & 0x007f_ffff) | 1),
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => f32::from_bits(self.next_u64() as u32 & 0x807f_ffff),
            4 => 6.0e-8 * self.unit(),
            5 => 65504.0 + 32.0 * self.unit(),
            6 => -0.0,
            7 => 1e5 * self.unit(),
            _ => f32::from_bits(self.next_u64() as u32) % 1e4,
        }
    }

    fn finite_f32(&mut self, scale: f32) -> f32 {
        match self.below(8) {
            0 => 0.0,
            1 => 1e-6 * self.unit(),
            _ => scale * self.unit(),
        }
    }
}

fn to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn to_f16(b: &[u8]) -> Vec<f16> {
    b.chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits16(v: &[f16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Element counts: tiny, one vector group ± 1, odd, many blocks.
const SIZES: [usize; 6] = [1, 7, 8, 9, 4099, 65541];

/// Byte offsets into the buffers: 16-aligned (vector path) and 4-aligned only (scalar path).
const OFFSETS: [usize; 2] = [0, 4];

/// More 8-element groups than a full grid has threads (132 SMs × 8 blocks × 256 threads on
/// an H200 is 270 336), so every thread runs its grid-stride loop several times.
const BIG: usize = (1 << 22) + 3;

/// (elements, byte offset) cases: every size at every offset, plus `BIG` aligned.
fn cases() -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = SIZES
        .iter()
        .flat_map(|&n| OFFSETS.iter().map(move |&o| (n, o)))
        .collect();
    v.push((BIG, 0));
    v
}

// ---------------------------------------------------------------- kernels vs twins

#[test]
fn gpu_cast_kernels_match_their_twins_bit_for_bit() {
    let Some((stream, k)) = device("gpu_cast_kernels_match_their_twins_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(1);
    for (n, off) in cases() {
        let src: Vec<f32> = (0..n).map(|_| rng.nasty_f32()).collect();
        let mut sbytes = vec![0u8; off];
        sbytes.extend(f32_bytes(&src));
        let sbuf = upload(&stream, &sbytes);
        let mut dbuf = upload(&stream, &vec![0xAB; off / 2 + 2 * n]);
        k.cast_f32_to_f16(
            &stream,
            DevRange::new(&sbuf, ByteRange::new(off, off + 4 * n)).unwrap(),
            DevRangeMut::new(&mut dbuf, ByteRange::new(off / 2, off / 2 + 2 * n)).unwrap(),
        )
        .unwrap();
        let got = to_f16(&download(&stream, &dbuf)[off / 2..]);
        let mut want = vec![f16::ZERO; n];
        range::cast_f32_to_f16(&src, &mut want).unwrap();
        assert_eq!(bits16(&got), bits16(&want), "f32->f16 n={n} off={off}");
    }
    // FP16 -> FP32: every bit pattern, aligned and not.
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    for off in [0usize, 2] {
        let mut sbytes = vec![0u8; off];
        sbytes.extend(f16_bytes(&all));
        let sbuf = upload(&stream, &sbytes);
        let mut dbuf = upload(&stream, &vec![0u8; 2 * off + 4 * all.len()]);
        k.cast_f16_to_f32(
            &stream,
            DevRange::new(&sbuf, ByteRange::new(off, off + 2 * all.len())).unwrap(),
            DevRangeMut::new(&mut dbuf, ByteRange::new(2 * off, 2 * off + 4 * all.len())).unwrap(),
        )
        .unwrap();
        let got = to_f32(&download(&stream, &dbuf)[2 * off..]);
        let mut want = vec![0f32; all.len()];
        range::cast_f16_to_f32(&all, &mut want).unwrap();
        assert_eq!(bits32(&got), bits32(&want), "f16->f32 off={off}");
    }
}

#[test]
fn gpu_zero_matches_its_twin() {
    let Some((stream, k)) = device("gpu_zero_matches_its_twin") else {
        return;
    };
    let mut rng = Rng(2);
    let len = 70_000;
    let bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    for r in [
        ByteRange::new(0, len),
        ByteRange::new(3, 3),
        ByteRange::new(5, 40_001),
        ByteRange::new(16, 64),
    ] {
        let mut buf = upload(&stream, &bytes);
        k.zero(&stream, DevRangeMut::new(&mut buf, r).unwrap())
            .unwrap();
        let mut want = bytes.clone();
        range::zero_bytes(&mut want[r.start..r.end]);
        assert!(download(&stream, &buf) == want, "zero {r:?}");
    }
}

/// An S image in a device buffer.
fn s_buf(stream: &Arc<CudaStream>, s: &Scalars) -> CudaSlice<u8> {
    upload(stream, &s.to_bytes())
}

fn s_of(stream: &Arc<CudaStream>, buf: &CudaSlice<u8>) -> Scalars {
    Scalars::from_bytes(&download(stream, buf)).unwrap()
}

#[test]
fn gpu_check_kernels_match_their_twins() {
    let Some((stream, k)) = device("gpu_check_kernels_match_their_twins") else {
        return;
    };
    let mut rng = Rng(3);
    for (n, off) in cases() {
        for plant in [
            None,
            Some(f32::NAN),
            Some(f32::INFINITY),
            Some(-f32::INFINITY),
        ] {
            let mut g: Vec<f32> = (0..n).map(|_| rng.finite_f32(1e5)).collect();
            if let Some(v) = plant {
                let at = rng.below(n);
                g[at] = v;
            }
            let mut gb = vec![0u8; off];
            gb.extend(f32_bytes(&g));
            let range = ByteRange::new(off, off + 4 * n);
            for policy in [
                OverflowPolicy::NanOrInf,
                OverflowPolicy::ClipInf { bound: 3e4 },
            ] {
                let mut gbuf = upload(&stream, &gb);
                let mut sbuf = s_buf(&stream, &Scalars::default());
                k.check(
                    &stream,
                    policy,
                    DevRangeMut::new(&mut gbuf, range).unwrap(),
                    DevRangeMut::whole(&mut sbuf),
                )
                .unwrap();
                let mut want_g = g.clone();
                let mut want_s = Scalars::default();
                range::check_grads(&mut want_g, policy, &mut want_s).unwrap();
                let got_g = to_f32(&download(&stream, &gbuf)[off..]);
                assert_eq!(
                    bits32(&got_g),
                    bits32(&want_g),
                    "{policy:?} n={n} off={off} plant={plant:?}"
                );
                assert_eq!(
                    s_of(&stream, &sbuf).overflowed(),
                    want_s.overflowed(),
                    "{policy:?} n={n} off={off} plant={plant:?}"
                );
            }
        }
    }
    // The check only ever sets the flag: a clean range leaves a set flag set.
    let mut g = upload(&stream, &f32_bytes(&[1.0; 64]));
    let mut sbuf = s_buf(
        &stream,
        &Scalars {
            overflow: 1,
            ..Scalars::default()
        },
    );
    k.check(
        &stream,
        OverflowPolicy::NanOrInf,
        DevRangeMut::whole(&mut g),
        DevRangeMut::whole(&mut sbuf),
    )
    .unwrap();
    assert!(s_of(&stream, &sbuf).overflowed());
}

#[test]
fn gpu_loss_scale_update_matches_its_twin() {
    let Some((stream, k)) = device("gpu_loss_scale_update_matches_its_twin") else {
        return;
    };
    let growth = LossScalePolicy {
        init_scale: 1024.0,
        growth: Some(ScaleGrowth {
            interval: 3,
            factor: 2.0,
            max_scale: 4096.0,
        }),
    };
    for policy in [LossScalePolicy::default(), growth] {
        for start in [
            Scalars::default(),
            Scalars {
                loss_scale: 1.5,
                overflow: 1,
                ..Scalars::default()
            },
            Scalars {
                loss_scale: 4096.0,
                growth_tracker: 2,
                step: u32::MAX,
                ..Scalars::default()
            },
            Scalars {
                loss_scale: 3000.0,
                growth_tracker: 2,
                skipped: u32::MAX,
                overflow: 7,
                ..Scalars::default()
            },
        ] {
            let mut sbuf = s_buf(&stream, &start);
            let mut want = start;
            for round in 0..5 {
                if round == 3 {
                    // Plant an overflow mid-way, on both sides.
                    want.overflow = 1;
                    stream
                        .memcpy_htod(&want.to_bytes(), &mut sbuf)
                        .expect("write S");
                }
                k.loss_scale_update(&stream, DevRangeMut::whole(&mut sbuf), &policy)
                    .unwrap();
                range::update_loss_scale(&mut want, &policy).unwrap();
                let got = download(&stream, &sbuf);
                assert_eq!(
                    got,
                    want.to_bytes().to_vec(),
                    "{policy:?} from {start:?} round {round}"
                );
            }
        }
    }
}

#[test]
fn gpu_sgd_and_ema_match_their_twins_bit_for_bit() {
    let Some((stream, k)) = device("gpu_sgd_and_ema_match_their_twins_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(4);
    let configs = [
        SgdConfig::new(0.1),
        SgdConfig::new(0.05).with_momentum(0.9),
        SgdConfig::new(0.05)
            .with_momentum(0.875)
            .with_nesterov(true),
        SgdConfig::new(0.01)
            .with_momentum(0.9)
            .with_weight_decay(5e-4),
    ];
    for (n, off) in cases() {
        // The big case once, with momentum and decay; the small ones with everything.
        let (cfgs, flags): (&[SgdConfig], &[u32]) = if n == BIG {
            (&configs[3..], &[0])
        } else {
            (&configs, &[0, 1])
        };
        for &cfg in cfgs {
            for &flag in flags {
                let w: Vec<f32> = (0..n).map(|_| rng.finite_f32(1.0)).collect();
                let m: Vec<f32> = (0..n).map(|_| rng.finite_f32(0.1)).collect();
                let g: Vec<f32> = (0..n).map(|_| rng.finite_f32(3000.0)).collect();
                // The hyper-parameters live in S, where the kernel reads them.
                let s = Scalars {
                    loss_scale: 1024.0,
                    overflow: flag,
                    ..Scalars::default()
                }
                .with_sgd(&cfg);
                let pad = |b: Vec<u8>, by: usize| {
                    let mut v = vec![0u8; by];
                    v.extend(b);
                    v
                };
                let r32 = ByteRange::new(off, off + 4 * n);
                let r16 = ByteRange::new(off / 2, off / 2 + 2 * n);
                let mut wb = upload(&stream, &pad(f32_bytes(&w), off));
                let mut mb = upload(&stream, &pad(f32_bytes(&m), off));
                let gb = upload(&stream, &pad(f32_bytes(&g), off));
                let mut ab = upload(&stream, &vec![0x55; off / 2 + 2 * n]);
                let sb = s_buf(&stream, &s);
                let use_m = cfg.momentum != 0.0;
                k.sgd_step(
                    &stream,
                    DevRangeMut::new(&mut wb, r32).unwrap(),
                    if use_m {
                        Some(DevRangeMut::new(&mut mb, r32).unwrap())
                    } else {
                        None
                    },
                    DevRange::new(&gb, r32).unwrap(),
                    DevRangeMut::new(&mut ab, r16).unwrap(),
                    DevRange::whole(&sb),
                    cfg.nesterov,
                    true,
                )
                .unwrap();
                let (mut ww, mut wm) = (w.clone(), m.clone());
                let mut wa = to_f16(&vec![0x55; 2 * n]);
                range::sgd_step(
                    &mut ww,
                    use_m.then_some(&mut wm[..]),
                    &g,
                    &mut wa,
                    &s,
                    cfg.nesterov,
                )
                .unwrap();
                let what = format!("{cfg:?} n={n} off={off} flag={flag}");
                assert_eq!(
                    bits32(&to_f32(&download(&stream, &wb)[off..])),
                    bits32(&ww),
                    "W {what}"
                );
                assert_eq!(
                    bits32(&to_f32(&download(&stream, &mb)[off..])),
                    bits32(&wm),
                    "M {what}"
                );
                assert_eq!(
                    bits16(&to_f16(&download(&stream, &ab)[off / 2..])),
                    bits16(&wa),
                    "A {what}"
                );

                // EMA of the new weights into E/E16.
                let e: Vec<f32> = (0..n).map(|_| rng.finite_f32(1.0)).collect();
                let mut eb = upload(&stream, &pad(f32_bytes(&e), off));
                let mut hb = upload(&stream, &vec![0u8; off / 2 + 2 * n]);
                let decay = 0.999f32;
                k.ema_update(
                    &stream,
                    DevRangeMut::new(&mut eb, r32).unwrap(),
                    DevRangeMut::new(&mut hb, r16).unwrap(),
                    DevRange::new(&wb, r32).unwrap(),
                    DevRange::whole(&sb),
                    decay,
                )
                .unwrap();
                let mut we = e.clone();
                let mut wh = vec![f16::ZERO; n];
                range::ema_update(&mut we, &mut wh, &ww, &s, decay).unwrap();
                assert_eq!(
                    bits32(&to_f32(&download(&stream, &eb)[off..])),
                    bits32(&we),
                    "E {what}"
                );
                assert_eq!(
                    bits16(&to_f16(&download(&stream, &hb)[off / 2..])),
                    bits16(&wh),
                    "E16 {what}"
                );
            }
        }
    }
}

/// The spacing of FP16 values at magnitude `x` (2^-24 in the subnormal range).
fn ulp16(x: f32) -> f32 {
    if x < f32::powi(2.0, -14) {
        f32::powi(2.0, -24)
    } else {
        f32::powi(2.0, x.log2().floor() as i32 - 10)
    }
}

#[test]
fn gpu_softmax_seed_is_within_one_fp16_ulp_of_its_twin() {
    let Some((stream, k)) = device("gpu_softmax_seed_is_within_one_fp16_ulp_of_its_twin") else {
        return;
    };
    let mut rng = Rng(5);
    for (batch, classes) in [(1usize, 1usize), (3, 10), (32, 1000), (5, 4097)] {
        let logits: Vec<f16> = (0..batch * classes)
            .map(|_| f16::from_f32(8.0 * rng.unit()))
            .collect();
        let labels: Vec<i32> = (0..batch)
            .map(|r| {
                if r == 1 {
                    -100
                } else {
                    rng.below(classes) as i32
                }
            })
            .collect();
        let s = Scalars {
            loss_scale: 512.0,
            ..Scalars::default()
        };
        let xb = stream.clone_htod(&logits).unwrap();
        let lb = stream.clone_htod(&labels).unwrap();
        let mut db = stream.alloc_zeros::<f16>(batch * classes).unwrap();
        let mut lossb = stream.alloc_zeros::<f32>(batch).unwrap();
        let sb = s_buf(&stream, &s);
        k.softmax_xent_backward(
            &stream,
            &xb,
            &lb,
            classes,
            DevRange::whole(&sb),
            &mut db,
            Some(&mut lossb),
        )
        .unwrap();
        let got = stream.clone_dtoh(&db).unwrap();
        let got_loss = stream.clone_dtoh(&lossb).unwrap();
        let mut want = vec![f16::ZERO; batch * classes];
        let mut want_loss = vec![0f32; batch];
        range::softmax_xent_backward(
            &logits,
            &labels,
            classes,
            &s,
            &mut want,
            Some(&mut want_loss),
        )
        .unwrap();
        let coef = s.loss_scale / batch as f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // At most one FP16 step apart (the twin's documented tolerance). The label's
            // entry, coef * (p - 1), also inherits the absolute error of p from the
            // differently ordered sum (~1e-6): allow that on top.
            let (gi, wi) = (g.to_f32(), w.to_f32());
            let (row, col) = (i / classes, i % classes);
            let is_label = usize::try_from(labels[row]).is_ok_and(|l| l == col);
            let slack = if is_label { coef * 4e-6 } else { 0.0 };
            let close = (gi - wi).abs() <= ulp16(gi.abs().max(wi.abs())) + slack;
            assert!(
                close,
                "batch={batch} classes={classes} [{i}]: {gi:e} vs {wi:e}"
            );
        }
        for (r, (g, w)) in got_loss.iter().zip(&want_loss).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "loss[{r}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn gpu_grad_norm_matches_its_twin_bit_for_bit() {
    let Some((stream, k)) = device("gpu_grad_norm_matches_its_twin_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(9);
    for (n, off) in cases() {
        for ranks in [1, 3] {
            let g: Vec<f32> = (0..n).map(|_| rng.finite_f32(3000.0)).collect();
            let mut want = Scalars {
                loss_scale: 1024.0,
                ranks,
                ..Scalars::default()
            };
            let mut bytes = vec![0u8; off];
            bytes.extend(f32_bytes(&g));
            let gb = upload(&stream, &bytes);
            let mut sb = s_buf(&stream, &want);
            let r32 = ByteRange::new(off, off + 4 * n);
            k.grad_norm(
                &stream,
                DevRange::new(&gb, r32).unwrap(),
                DevRangeMut::whole(&mut sb),
            )
            .unwrap();
            range::grad_norm(&g, &mut want);
            assert_eq!(
                download(&stream, &sb),
                want.to_bytes().to_vec(),
                "n={n} off={off} ranks={ranks}"
            );
            assert!(want.grad_norm > 0.0 || n == 0);
        }
    }
}
