//! The simulated CUDA device's own primitives (tools/sim/, docs/simulator.md): barriers, warp
//! shuffles, atomics, dynamic shared memory, launch errors (tools/sim/tests/primitives.cu, run as a
//! C++ binary), and its binary16 arithmetic against the `half` crate, an independent
//! implementation of IEEE binary16 (round to nearest even).
//!
//! Needs a C++ compiler and the test dependencies' CUDA headers: the simulator is built (or
//! brought up to date) here, into `CUDNN_CBR_SIM_DIR` when set (.deps/sim from
//! scripts/setup-test-deps.sh). Prints one SKIP line per test where the sources or headers
//! are absent (a bundled binary elsewhere).

use std::io::Write;
use std::process::{Command, Stdio};

use half::f16;

mod sim;

fn run(dir: &std::path::Path, mode: &str, input: &[u8]) -> Vec<u8> {
    let mut child = Command::new(dir.join("primitives"))
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the primitives binary");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input).expect("write"));
    let out = child.wait_with_output().expect("run the primitives binary");
    writer.join().expect("writer");
    assert!(out.status.success(), "primitives {mode}: {:?}", out.status);
    out.stdout
}

/// The canonical NaN the GPU's conversions produce (cvt.rn.f16.f32 of any NaN).
const NAN16: u16 = 0x7fff;

fn expect_f16(x: f32) -> u16 {
    if x.is_nan() {
        NAN16
    } else {
        f16::from_f32(x).to_bits()
    }
}

#[test]
fn sim_primitives_pass_their_known_answers() {
    let Some(dir) = sim::built("sim_primitives_pass_their_known_answers") else {
        return;
    };
    let out = Command::new(dir.join("primitives"))
        .output()
        .expect("run the primitives binary");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the primitive checks failed");
    assert!(text.contains("all primitive checks passed"));
}

#[test]
fn sim_f32_to_f16_rounds_every_decision_like_ieee() {
    let Some(dir) = sim::built("sim_f32_to_f16_rounds_every_decision_like_ieee") else {
        return;
    };
    // Every rounding decision: for each finite binary16 value, the float just below, at and
    // just above the midpoint to its successor (ties go to even), plus the values themselves,
    // both signs; then the specials and a spread of arbitrary bit patterns.
    let mut inputs: Vec<f32> = Vec::new();
    for b in 0u16..0x7c00 {
        let lo = f16::from_bits(b).to_f32() as f64;
        let hi = f16::from_bits(b + 1).to_f32() as f64; // 0x7c00 is +inf: the overflow edge
        let hi = if hi.is_infinite() { 65536.0 } else { hi };
        let mid = ((lo + hi) / 2.0) as f32; // exact: the midpoint has at most 12 bits
        for x in [
            lo as f32,
            mid,
            f32::from_bits(mid.to_bits() - 1),
            f32::from_bits(mid.to_bits() + 1),
        ] {
            inputs.push(x);
            inputs.push(-x);
        }
    }
    inputs.extend([
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc0_1234),
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        65504.0,
        65519.996,
        65520.0,
        2f32.powi(-25),
        f32::from_bits(2f32.powi(-25).to_bits() + 1),
    ]);
    let mut z = 0x1234_5678_9abc_def0u64;
    for _ in 0..200_000 {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        inputs.push(f32::from_bits((z >> 32) as u32));
    }
    let bytes: Vec<u8> = inputs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let got = run(&dir, "f32-to-f16", &bytes);
    assert_eq!(got.len(), inputs.len() * 2);
    for (i, &x) in inputs.iter().enumerate() {
        let g = u16::from_le_bytes([got[2 * i], got[2 * i + 1]]);
        assert_eq!(g, expect_f16(x), "f16({x:e} = {:#010x})", x.to_bits());
    }
    // The edges by name, so a wrong oracle could not hide them.
    let one = |x: f32| {
        let g = run(&dir, "f32-to-f16", &x.to_le_bytes());
        u16::from_le_bytes([g[0], g[1]])
    };
    assert_eq!(
        one(1.0 + 2f32.powi(-11)),
        0x3c00,
        "a tie rounds to even (down)"
    );
    assert_eq!(
        one(1.0 + 3.0 * 2f32.powi(-11)),
        0x3c02,
        "a tie rounds to even (up)"
    );
    assert_eq!(
        one(65519.996),
        0x7bff,
        "below the overflow midpoint stays finite"
    );
    assert_eq!(
        one(65520.0),
        0x7c00,
        "the overflow midpoint goes to infinity"
    );
    assert_eq!(one(2f32.powi(-24)), 0x0001, "the smallest subnormal");
    assert_eq!(
        one(2f32.powi(-25)),
        0x0000,
        "half the smallest subnormal ties to zero"
    );
    assert_eq!(
        one(3.0 * 2f32.powi(-25)),
        0x0002,
        "1.5 subnormal quanta tie to even"
    );
    assert_eq!(one(-0.0), 0x8000, "negative zero keeps its sign");
    assert_eq!(one(f32::NAN), NAN16, "NaN is canonical");
}

#[test]
fn sim_f16_to_f32_is_exact_for_every_value() {
    let Some(dir) = sim::built("sim_f16_to_f32_is_exact_for_every_value") else {
        return;
    };
    let all: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
    let got = run(&dir, "f16-to-f32", &all);
    for b in 0..=u16::MAX {
        let i = b as usize * 4;
        let g = u32::from_le_bytes([got[i], got[i + 1], got[i + 2], got[i + 3]]);
        let h = f16::from_bits(b);
        let want = if h.is_nan() {
            0x7fff_ffff
        } else {
            h.to_f32().to_bits()
        };
        assert_eq!(g, want, "f32({b:#06x})");
    }
}

#[test]
fn sim_half_add_and_mul_round_once() {
    let Some(dir) = sim::built("sim_half_add_and_mul_round_once") else {
        return;
    };
    // The exact sum or product of two binary16 values is representable in binary64, so
    // rounding that once is the IEEE answer; `half` computes through f32, which is exact for
    // products but not for every sum, so the oracle here is f64 then one rounding.
    let mut z = 99u64;
    let mut pairs: Vec<u32> = Vec::new();
    for _ in 0..100_000 {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        pairs.push((z >> 32) as u32);
    }
    pairs.extend([
        0x3c00_3c00,
        0x7bff_7bff,
        0x0001_8001,
        0x7c00_fc00,
        0x0001_0001,
    ]);
    let bytes: Vec<u8> = pairs.iter().flat_map(|x| x.to_le_bytes()).collect();
    for (mode, op) in [
        ("hadd", (|a, b| a + b) as fn(f64, f64) -> f64),
        ("hmul", |a, b| a * b),
    ] {
        let got = run(&dir, mode, &bytes);
        for (i, &p) in pairs.iter().enumerate() {
            let a = f16::from_bits(p as u16);
            let b = f16::from_bits((p >> 16) as u16);
            let exact = op(a.to_f64(), b.to_f64());
            let want = if exact.is_nan() {
                NAN16
            } else {
                f16::from_f64(exact).to_bits()
            };
            let g = u16::from_le_bytes([got[2 * i], got[2 * i + 1]]);
            assert_eq!(
                g,
                want,
                "{mode}({:#06x}, {:#06x})",
                a.to_bits(),
                b.to_bits()
            );
        }
    }
}
