//! The main job's fused conv ops on the CPU executor, on one thread and on two.
//!
//! For each conv of the main job's network (`train_cbr`'s `mini`: batch 32, 16×16×8 images,
//! width 16), times the three ops a training step runs through the layer, as the trainer calls
//! them (each with its `ConvScratch` kept from call to call): fprop with the BN-apply prologue
//! and GenStats, wgrad with the prologue, and dgrad (with dReLU and dBN where the conv has
//! stride 1). Best of 300 calls each, in one rayon pool of one thread and one of two, in rounds
//! that alternate the pools; one table with the times and the two-thread speed-up, measured in
//! one run. The outputs of
//! both pools must be the same bits (results do not depend on the thread count): the bench
//! checks that for every op.
//!
//! `cargo bench --bench cpu_ops` prints the table (a few seconds); under `cargo test` (no `--bench`
//! flag) it runs two small shapes a few times, with the same bit-for-bit check.

use cudnn_cbr::fusion::reference::{
    conv_dgrad_with, dgrad_drelu_dbn_with, fprop_genstats_with, wgrad_with_prologue_with,
    ConvInput, ConvParams, ConvScratch, ReluJoin, SavedBn,
};
use half::f16;
use std::time::Instant;

#[path = "../tests/common/values.rs"]
mod values;
use values::{square_conv, values};

/// The main job's convs (`crates/6-trainer/src`: the `mini` network at its defaults).
fn shapes(batch: usize) -> Vec<(&'static str, ConvParams)> {
    let sq = |c, hw, k, rs, pad, stride| square_conv(batch, (c, hw, k), (rs, pad, stride));
    vec![
        ("stem 3x3 8>16", sq(8, 16, 16, 3, 1, 1)),
        ("block1 3x3 16", sq(16, 16, 16, 3, 1, 1)),
        ("block2 3x3/2 32", sq(16, 16, 32, 3, 1, 2)),
        ("block2 3x3 32", sq(32, 8, 32, 3, 1, 1)),
        ("proj 1x1/2 32", sq(16, 16, 32, 1, 0, 2)),
    ]
}

/// The three ops' outputs (FP16 bits), for the thread-count check.
type Outputs = [Vec<u16>; 3];

/// Times the three ops of `p` (best of `runs` calls each, seconds) in the current rayon pool.
fn time_ops(p: &ConvParams, runs: usize) -> ([f64; 3], Outputs) {
    let x = values(p.x_elems(), 1);
    let w = values(p.w_elems(), 2);
    let dy = values(p.y_elems(), 3);
    let (scale, bias) = (values(p.c, 4), values(p.c, 5));
    let stats = |v: f32| vec![v; p.c];
    let (mean, inv_std, gamma, beta) = (stats(0.1), stats(1.3), stats(0.9), stats(0.05));
    let bn = SavedBn {
        mean: &mean,
        inv_std: &inv_std,
        gamma: &gamma,
        beta: &beta,
    };
    let input = || ConvInput::Prologue {
        y_prev: &x,
        scale: &scale,
        bias: &bias,
    };
    let mut scratch = ConvScratch::default();
    let best = |f: &mut dyn FnMut()| {
        (0..runs)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let bits = |v: &[f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
    let mut y = Vec::new();
    let fprop = best(&mut || {
        let out = fprop_genstats_with(p, input(), &w, &mut scratch, None, std::mem::take(&mut y));
        y = out.expect("valid conv parameters").y;
    });
    let mut dw = Vec::new();
    let wgrad = best(&mut || {
        let out =
            wgrad_with_prologue_with(p, input(), &dy, &mut scratch, None, std::mem::take(&mut dw));
        dw = out.expect("valid conv parameters");
    });
    let mut dx = Vec::new();
    let dgrad = best(&mut || {
        let out = std::mem::take(&mut dx);
        dx = if p.stride_h == 1 && p.stride_w == 1 {
            dgrad_drelu_dbn_with(p, &dy, &w, &x, &bn, &ReluJoin::default(), &mut scratch, out)
                .expect("valid conv parameters")
                .dz
        } else {
            conv_dgrad_with(p, &dy, &w, &mut scratch, out).expect("valid conv parameters")
        };
    });
    ([fprop, wgrad, dgrad], [bits(&y), bits(&dw), bits(&dx)])
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    // Rounds alternate the two pools (a burst of load from elsewhere on the machine then
    // slows some calls of both, not all calls of one); each op's time is its best call.
    let (list, rounds, runs) = if full {
        (shapes(32), 6, 50)
    } else {
        (shapes(2).into_iter().take(2).collect(), 2, 2)
    };
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .expect("a rayon pool")
    };
    let (one, two) = (pool(1), pool(2));
    println!(
        "The main job's conv ops on the CPU executor ({}), batch {}, best of {} calls \
         ({rounds} rounds alternating the pools); µs",
        cudnn_cbr::fusion::reference::cpu_paths(),
        list.first().map_or(0, |(_, p)| p.n),
        rounds * runs
    );
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  {:>6}",
        "conv", "fprop 1t", "wgrad 1t", "dgrad 1t", "fprop 2t", "wgrad 2t", "dgrad 2t", "2t/1t"
    );
    let (mut total1, mut total2) = (0.0, 0.0);
    for (label, p) in &list {
        let (mut t1, mut t2) = ([f64::INFINITY; 3], [f64::INFINITY; 3]);
        for _ in 0..rounds {
            let (r1, out1) = one.install(|| time_ops(p, runs));
            let (r2, out2) = two.install(|| time_ops(p, runs));
            for (op, (a, b)) in ["fprop", "wgrad", "dgrad"]
                .iter()
                .zip(out1.iter().zip(&out2))
            {
                assert!(a == b, "{label} {op}: one thread and two give other bits");
            }
            for i in 0..3 {
                t1[i] = t1[i].min(r1[i]);
                t2[i] = t2[i].min(r2[i]);
            }
        }
        let (s1, s2) = (t1.iter().sum::<f64>(), t2.iter().sum::<f64>());
        total1 += s1;
        total2 += s2;
        let us = |t: f64| t * 1e6;
        println!(
            "{label:<16} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}  {:>5.2}x",
            us(t1[0]),
            us(t1[1]),
            us(t1[2]),
            us(t2[0]),
            us(t2[1]),
            us(t2[2]),
            s1 / s2
        );
    }
    println!(
        "all ops: {:.0} µs on one thread, {:.0} µs on two ({:.2}x)",
        total1 * 1e6,
        total2 * 1e6,
        total1 / total2
    );
}
