//! The CPU reference executor's convolutions against the bare GEMM they are built on.
//!
//! For ResNet-like conv shapes at a small batch, times `conv_fprop`, `conv_dgrad` and
//! `conv_wgrad` in FP16 mode (`half::f16` storage, `f32` arithmetic; median of a few runs), and a
//! bare `f32` GEMM of the same M×N×K with the same operand layouts through the same path the
//! reference uses (ndarray's `general_mat_mul`), split by rows over as many threads as rayon
//! uses. One table, measured in one run: GFLOP/s of each and the conv/GEMM ratio.
//!
//! | op | M | N | K | conv FLOPs |
//! |---|---|---|---|---|
//! | fprop | N·P·Q | K | R·S·C | 2·N·P·Q·K·R·S·C |
//! | dgrad | N·H·W | C | R·S·K | the same |
//! | wgrad | K | R·S·C | N·P·Q | the same |
//!
//! Conv GFLOP/s counts the conv's FLOPs; GEMM GFLOP/s counts 2·M·N·K. The ratio therefore
//! includes everything the reference adds to its GEMM: widening the FP16 inputs, the im2col
//! gather, tiling (128 rows per task; wgrad's per-tile GEMMs have an inner dimension of 128)
//! and the FP16 store. For a strided dgrad the reference's GEMM does stride² times the conv's
//! FLOPs (its gather reads zeros where no output pixel maps), which bounds that ratio by
//! 1/stride².
//!
//! `cargo bench --bench reference` prints the table (about a minute on 2 cores); under
//! `cargo test` (no `--bench` flag) it runs one tiny shape once as a smoke test.

use cudnn_cbr::fusion::reference::{conv_dgrad, conv_fprop, conv_wgrad, ConvParams};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis};
use std::hint::black_box;
use std::time::Instant;

/// ResNet-like shapes: (label, params).
fn shapes(batch: usize) -> Vec<(&'static str, ConvParams)> {
    let sq = |c, hw, k, rs, pad, stride| square_conv(batch, (c, hw, k), (rs, pad, stride));
    vec![
        ("stem 7x7 s2", sq(3, 224, 64, 7, 3, 2)),
        ("l1 3x3", sq(64, 56, 64, 3, 1, 1)),
        ("l1 1x1 64>256", sq(64, 56, 256, 1, 0, 1)),
        ("l2 3x3 s2", sq(128, 56, 128, 3, 1, 2)),
        ("l2 3x3", sq(128, 28, 128, 3, 1, 1)),
        ("l3 1x1 1024>256", sq(1024, 14, 256, 1, 0, 1)),
        ("l4 3x3", sq(512, 7, 512, 3, 1, 1)),
    ]
}

#[path = "../tests/common/values.rs"]
mod values;
use values::{square_conv, values};

/// Median wall times in seconds of `f` and `g` over `runs` calls each, after one warm-up call
/// each. The calls alternate, so both see the same machine load.
fn median_pair(runs: usize, mut f: impl FnMut(), mut g: impl FnMut()) -> (f64, f64) {
    let time = |h: &mut dyn FnMut()| {
        let t = Instant::now();
        h();
        t.elapsed().as_secs_f64()
    };
    f();
    g();
    let (mut tf, mut tg): (Vec<f64>, Vec<f64>) =
        (0..runs).map(|_| (time(&mut f), time(&mut g))).unzip();
    tf.sort_by(f64::total_cmp);
    tg.sort_by(f64::total_cmp);
    (tf[runs / 2], tg[runs / 2])
}

/// Threads the bare GEMM uses: what rayon uses (`RAYON_NUM_THREADS`, else every core).
fn threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `c = a · b` through ndarray's `general_mat_mul`, rows of `a` and `c` split over `threads`.
fn gemm(a: ArrayView2<'_, f32>, b: ArrayView2<'_, f32>, c: &mut Array2<f32>, threads: usize) {
    let rows = a.nrows().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (a_part, mut c_part) in a
            .axis_chunks_iter(Axis(0), rows)
            .zip(c.axis_chunks_iter_mut(Axis(0), rows))
        {
            scope.spawn(move || gemm_part(a_part, b, &mut c_part));
        }
    });
}

fn gemm_part(a: ArrayView2<'_, f32>, b: ArrayView2<'_, f32>, c: &mut ArrayViewMut2<'_, f32>) {
    general_mat_mul(1.0, &a, &b, 0.0, c);
}

/// A row-major `[rows, cols]` f32 matrix of deterministic values.
fn matrix(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
    let data = values(rows * cols, seed)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    Array2::from_shape_vec((rows, cols), data).expect("rows * cols values")
}

/// The operands of the bare GEMM of one conv op, in the reference's layouts.
struct GemmCase {
    a: Array2<f32>,
    /// Whether the GEMM reads `a` transposed (wgrad's dyᵀ).
    a_t: bool,
    b: Array2<f32>,
    /// Whether the GEMM reads `b` transposed (fprop's wᵀ).
    b_t: bool,
    c: Array2<f32>,
}

impl GemmCase {
    /// The GEMM of `op` on `p`:
    /// - fprop: col `[NPQ, RSC]` · wᵀ, `w` being `[K, RSC]`;
    /// - dgrad: col `[NHW, RSK]` · `w` rearranged `[RSK, C]`;
    /// - wgrad: dyᵀ, `dy` being `[NPQ, K]`, · col `[NPQ, RSC]`;
    ///
    /// every stored matrix row-major.
    fn new(op: &str, p: &ConvParams) -> Self {
        let (npq, nhw, taps) = (p.n * p.out_h() * p.out_w(), p.n * p.h * p.w, p.r * p.s);
        let (a, a_t, b, b_t, c) = match op {
            "fprop" => (
                matrix(npq, taps * p.c, 1),
                false,
                matrix(p.k, taps * p.c, 2),
                true,
                (npq, p.k),
            ),
            "dgrad" => (
                matrix(nhw, taps * p.k, 3),
                false,
                matrix(taps * p.k, p.c, 4),
                false,
                (nhw, p.c),
            ),
            _ => (
                matrix(npq, p.k, 5),
                true,
                matrix(npq, taps * p.c, 6),
                false,
                (p.k, taps * p.c),
            ),
        };
        GemmCase {
            a,
            a_t,
            b,
            b_t,
            c: Array2::zeros(c),
        }
    }

    /// `[M, N, K]`.
    fn dims(&self) -> [usize; 3] {
        let (m, n) = self.c.dim();
        let k = if self.a_t {
            self.a.nrows()
        } else {
            self.a.ncols()
        };
        [m, n, k]
    }

    fn run(&mut self, threads: usize) {
        let a = if self.a_t { self.a.t() } else { self.a.view() };
        let b = if self.b_t { self.b.t() } else { self.b.view() };
        gemm(a, b, &mut self.c, threads);
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (batch, runs) = if full { (4, 7) } else { (1, 1) };
    let list = if full {
        shapes(batch)
    } else {
        vec![(
            "tiny 3x3",
            ConvParams::new(1, 16, 8, 8, 16, 3, 3).with_padding(1, 1),
        )]
    };
    let threads = threads();
    println!(
        "CPU reference conv (FP16 storage, f32 GEMM) vs bare f32 GEMM (ndarray general_mat_mul, \
         {threads} threads), batch {batch}, median of {runs}"
    );
    println!(
        "{:<16} {:<6} {:>6} {:>5} {:>5} {:>7} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "shape",
        "op",
        "M",
        "N",
        "K",
        "GFLOP",
        "conv ms",
        "conv GF/s",
        "GEMM ms",
        "GEMM GF/s",
        "ratio"
    );
    for (label, p) in list {
        let x = values(p.x_elems(), 11);
        let w = values(p.w_elems(), 12);
        let dy = values(p.y_elems(), 13);
        let flops = 2.0 * (p.n * p.out_h() * p.out_w() * p.k * p.r * p.s * p.c) as f64;
        for op in ["fprop", "dgrad", "wgrad"] {
            let mut case = GemmCase::new(op, &p);
            let [m, n, k] = case.dims();
            let (conv, gemm) = median_pair(
                runs,
                || {
                    let out = match op {
                        "fprop" => conv_fprop(&p, &x, &w),
                        "dgrad" => conv_dgrad(&p, &dy, &w),
                        _ => conv_wgrad(&p, &x, &dy),
                    };
                    black_box(out.expect("valid conv parameters"));
                },
                || case.run(threads),
            );
            let gemm_flops = 2.0 * (m * n * k) as f64;
            let (conv_rate, gemm_rate) = (flops / conv / 1e9, gemm_flops / gemm / 1e9);
            println!(
                "{label:<16} {op:<6} {m:>6} {n:>5} {k:>5} {:>7.3} {:>10.2} {conv_rate:>10.1} {:>10.2} \
                 {gemm_rate:>10.1} {:>8.2}",
                flops / 1e9,
                conv * 1e3,
                gemm * 1e3,
                conv_rate / gemm_rate
            );
        }
    }
}
