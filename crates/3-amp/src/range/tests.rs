//! The blocked, threaded twins (`blocks.rs`) against their definitions one element at a time
//! (the loops below, as the twins were written before they ran in blocks), bit for bit, over
//! several tasks and a ragged end, on values that reach every rounding and NaN path.
//!
//! FP32 results compare bit for bit except that any NaN equals any NaN: where both operands
//! of an addition are NaNs, which payload survives depends on the order the compiler gives
//! the operands (x86 keeps the first), and scalar and vector code may differ. No payload
//! reaches a run: SGD and EMA skip a step whose gradients hold a NaN, and every FP16 result
//! (and every cast) selects the canonical NaN explicitly, which is compared exactly.

use half::f16;

use super::blocks::tests::awkward_f32;
use super::blocks::{BLOCK, PER_TASK};
use super::*;

const N: usize = 2 * PER_TASK + BLOCK + 29;

/// `got` equals `want` element by element: FP32 bits, any NaN for a NaN (module docs).
fn same32(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        assert!(
            ok,
            "{what}[{i}]: {g:e} ({:#x}), want {w:e} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// `got` equals `want` bit for bit.
fn same16(what: &str, got: &[f16], want: &[f16]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]");
    }
}

/// Finite values of gradient size (the update's inputs), with a few infinities and NaNs.
fn values(seed: usize, scale: f32) -> Vec<f32> {
    let mut v = awkward_f32(N + seed);
    v.drain(..seed);
    for x in v.iter_mut() {
        if x.is_finite() && x.abs() > 1.0e4 {
            *x = (*x * 1.0e-4) % 7.0;
        }
        *x *= scale;
    }
    v
}

/// [`sgd_step`]'s formula, one element at a time.
fn sgd_definition(
    w: &mut [f32],
    mut m: Option<&mut [f32]>,
    g: &[f32],
    a: &mut [f16],
    s: &Scalars,
    nesterov: bool,
) {
    let cfg = s.sgd(nesterov);
    let inv = s.unscale() * s.clip_factor();
    for i in 0..w.len() {
        let wi = w[i];
        let mut gi = g[i] * inv;
        if cfg.weight_decay != 0.0 {
            gi += cfg.weight_decay * wi;
        }
        let d = match m.as_deref_mut() {
            Some(m) if cfg.momentum != 0.0 => {
                let mi = cfg.momentum * m[i] + gi;
                m[i] = mi;
                if cfg.nesterov {
                    gi + cfg.momentum * mi
                } else {
                    mi
                }
            }
            _ => gi,
        };
        let wn = wi - cfg.lr * d;
        w[i] = wn;
        a[i] = f32_to_f16(wn);
    }
}

#[test]
fn sgd_in_blocks_equals_its_definition_bit_for_bit() {
    let cases = [
        (0.9, 5e-4, 0.0, false),
        (0.0, 0.0, 0.0, false),
        (0.9, 0.0, 0.5, true),
    ];
    for (momentum, weight_decay, clip, nesterov) in cases {
        let s = Scalars {
            loss_scale: 8192.0,
            lr: 0.05,
            momentum,
            weight_decay,
            clip_norm: clip,
            grad_norm: 3.0,
            ..Scalars::default()
        };
        let (w0, m0, g) = (values(1, 1.0), values(2, 0.1), values(3, 8192.0));
        let (mut w, mut m, mut a) = (w0.clone(), m0.clone(), vec![f16::ZERO; N]);
        let (mut wd, mut md, mut ad) = (w0, m0, vec![f16::ZERO; N]);
        let out = sgd_step(&mut w, Some(&mut m), &g, &mut a, &s, nesterov).unwrap();
        assert_eq!(out, StepOutcome::Applied);
        sgd_definition(&mut wd, Some(&mut md), &g, &mut ad, &s, nesterov);
        let case = format!("momentum {momentum}, decay {weight_decay}, clip {clip}, {nesterov}");
        same32(&format!("W, {case}"), &w, &wd);
        same32(&format!("M, {case}"), &m, &md);
        same16(&format!("A, {case}"), &a, &ad);
    }
}

#[test]
fn ema_in_blocks_equals_its_definition_bit_for_bit() {
    let (e0, w) = (values(4, 1.0), values(5, 1.0));
    let (mut e, mut e16) = (e0.clone(), vec![f16::ZERO; N]);
    ema_update(&mut e, &mut e16, &w, &Scalars::default(), 0.999).unwrap();
    let take = 1.0f32 - 0.999;
    let want: Vec<f32> = (0..N).map(|i| 0.999 * e0[i] + take * w[i]).collect();
    same32("E", &e, &want);
    let want16: Vec<f16> = want.iter().map(|&x| f32_to_f16(x)).collect();
    same16("E16", &e16, &want16);
}

#[test]
fn accumulation_in_blocks_equals_its_definition_bit_for_bit() {
    // G16 ends inside a block of the second task, as it ends at the last conv parameter.
    let g16: Vec<f16> = values(6, 1.0)[..PER_TASK + 1000]
        .iter()
        .map(|&x| f32_to_f16(x))
        .collect();
    for drain in [false, true] {
        let (g0, acc0) = (values(7, 1.0), values(8, 1.0));
        let (mut g, mut acc) = (g0.clone(), acc0.clone());
        accum_grads(&g16, &mut g, &mut acc, drain).unwrap();
        let (mut want_g, mut want_acc) = (g0.clone(), acc0.clone());
        for i in 0..N {
            let mut x = g0[i];
            if let Some(&h) = g16.get(i) {
                x += f16_to_f32(h);
            }
            let mut sum = acc0[i] + x;
            if sum.is_nan() {
                sum = f32::from_bits(F32_CANONICAL_NAN);
            }
            if drain {
                (want_g[i], want_acc[i]) = (sum, 0.0);
            } else {
                want_acc[i] = sum;
            }
        }
        // The sums select the canonical NaN: exact bits here.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&g) == bits(&want_g), "G, drain {drain}");
        assert!(bits(&acc) == bits(&want_acc), "acc, drain {drain}");
    }
}

#[test]
fn the_checks_in_tasks_see_every_element() {
    // One NaN or infinity anywhere, the last element of a task or of the range included, sets
    // the flag; clipping counts every clipped element across tasks.
    for at in [0, PER_TASK - 1, PER_TASK, N - 1] {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut g = vec![1.0f32; N];
            g[at] = bad;
            let mut s = Scalars::default();
            assert!(check_nonfinite(&g, &mut s).overflow, "{bad} at {at}");
            assert_eq!(s.overflow, 1);
        }
    }
    let mut g = values(9, 1.0);
    let g0 = g.clone();
    let mut s = Scalars::default();
    let out = check_and_clip(&mut g, 2.0, &mut s).unwrap();
    let clipped = g0.iter().filter(|x| !x.is_nan() && x.abs() > 2.0).count();
    assert_eq!(out.clipped, clipped);
    assert_eq!(out.overflow, g0.iter().any(|x| x.is_nan()));
    for (x, x0) in g.iter().zip(&g0) {
        let want = if !x0.is_nan() && x0.abs() > 2.0 {
            2.0f32.copysign(*x0)
        } else {
            *x0
        };
        assert_eq!(x.to_bits(), want.to_bits());
    }
}
