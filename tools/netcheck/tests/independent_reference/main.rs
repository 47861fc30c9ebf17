//! Self-tests of the independent candle reference (`tests/independent/`).
//!
//! - Gradients of every trainable parameter against central finite differences of the
//!   loss: this also validates candle 0.11's conv2d backward (stride 2 with padding, where
//!   the data gradient needs a transposed conv with output padding; 1×1 stride 2; C ≠ K).
//! - Forward values against a plain-loop forward pass written here (NHWC/KRSC directly),
//!   which pins the layouts and semantics that finite differences cannot see (a consistently
//!   mis-permuted weight would still have consistent gradients).
//! - Exported intermediate gradients against plain-loop backward formulas (conv weight and
//!   data gradients, BatchNorm backward, head).
//! - The max-pool tie rule and −∞ padding; errors instead of panics on bad input.

mod backward_loops;
mod errors;
mod finite_differences;
mod forward_loops;
#[path = "../independent/mod.rs"]
mod independent;
mod max_pool;

use backward_loops::*;
use forward_loops::*;

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use independent::{
    loss, max_pool2d, param_shapes, run, Named, RefBlock, RefBlockKind, RefNet, RefPool, RefRun,
    RefStem,
};

// ---------------------------------------------------------------------------------------
// Fixtures.

/// splitmix64: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * u
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn random_params(net: &RefNet, rng: &mut Rng) -> Named {
    let mut p = Named::new();
    for (name, dims) in param_shapes(net) {
        let len: usize = dims.iter().product();
        let (lo, hi) = if name.ends_with(".gamma") {
            (0.5, 1.5)
        } else if name.ends_with(".running_var") {
            (0.5, 2.0)
        } else if name.ends_with(".beta") || name == "fc.b" {
            (-0.5, 0.5)
        } else {
            (-1.0, 1.0)
        };
        p.insert(name, (0..len).map(|_| rng.uniform(lo, hi)).collect());
    }
    p
}

/// (a) stem 3×3/1 without pool, one basic block with projection, stride 2, C ≠ K.
fn net_a() -> RefNet {
    RefNet {
        in_channels: 3,
        hw: 8,
        stem: RefStem {
            out: 5,
            kernel: 3,
            stride: 1,
            pad: 1,
            max_pool: None,
        },
        stages: vec![vec![RefBlock {
            kind: RefBlockKind::Basic,
            in_ch: 5,
            width: 7,
            out: 9,
            stride: 2,
            projection: true,
        }]],
        classes: 4,
        epsilon: 1e-5,
        momentum: 0.1,
    }
}

/// (b) stem 5×5/2 with max-pool 3×3/2 pad 1; stage 0: identity bottleneck; stage 1:
/// projection bottleneck, stride 2.
fn net_b() -> RefNet {
    RefNet {
        in_channels: 3,
        hw: 9,
        stem: RefStem {
            out: 7,
            kernel: 5,
            stride: 2,
            pad: 2,
            max_pool: Some(RefPool {
                kernel: 3,
                stride: 2,
                pad: 1,
            }),
        },
        stages: vec![
            vec![RefBlock {
                kind: RefBlockKind::Bottleneck,
                in_ch: 7,
                width: 3,
                out: 7,
                stride: 1,
                projection: false,
            }],
            vec![RefBlock {
                kind: RefBlockKind::Bottleneck,
                in_ch: 7,
                width: 5,
                out: 9,
                stride: 2,
                projection: true,
            }],
        ],
        classes: 5,
        epsilon: 1e-3,
        momentum: 0.3,
    }
}

struct Case {
    net: RefNet,
    params: Named,
    images: Vec<f64>,
    labels: Vec<usize>,
}

fn case(net: RefNet, batch: usize, seed: u64) -> Case {
    let mut rng = Rng(seed);
    let params = random_params(&net, &mut rng);
    let images = (0..batch * net.hw * net.hw * net.in_channels)
        .map(|_| rng.uniform(-1.0, 1.0))
        .collect();
    let labels = (0..batch).map(|_| rng.below(net.classes)).collect();
    Case {
        net,
        params,
        images,
        labels,
    }
}

impl Case {
    fn run(&self) -> RefRun {
        run(&self.net, &self.params, &self.images, &self.labels).expect("reference run")
    }
}
