//! The interpreter's ops against known answers and identities, and its memory handling
//! (strided layouts, untouched gaps, the raw-address path).

// The raw-address entry point is unsafe to call.
#![allow(unsafe_code)]
use super::conv::Geometry;
use super::memory::{Allocation, HostMemory, MemoryMap};
use super::tensor::Value;
use super::{bn, execute, execute_host, pointwise, InterpError, Options, VariantPack};
use crate::graph::{
    ConvAttrs, DataType, Graph, PointwiseAttrs, PointwiseMode, ReductionMode, TensorAttrs,
};
use crate::lower::real_tensor_layout;
use half::f16;

const NODE: (usize, &str) = (0, "test");

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn random(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n).map(|_| lcg(seed)).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

#[test]
fn a_padded_3x3_conv_of_ones_counts_the_taps_inside_the_input() {
    let attrs = ConvAttrs::default().padding(1);
    let g = Geometry::new(NODE, [1, 1, 3, 3], [1, 1, 3, 3], [1, 1, 3, 3], &attrs).unwrap();
    let y = g.fprop(&[1.0; 9], &[1.0; 9]);
    assert_eq!(y, vec![4.0, 6.0, 4.0, 6.0, 9.0, 6.0, 4.0, 6.0, 4.0]);
    // Output dims that do not follow from the geometry are refused, not indexed past.
    assert!(Geometry::new(NODE, [1, 1, 3, 3], [1, 1, 3, 3], [1, 1, 2, 3], &attrs).is_err());
    assert!(Geometry::new(NODE, [1, 2, 3, 3], [1, 1, 3, 3], [1, 1, 3, 3], &attrs).is_err());
}

#[test]
fn a_1x1_conv_is_a_matrix_product_over_channels() {
    let (c, k) = (3, 2);
    let x: Vec<f32> = (0..c * 4).map(|v| v as f32).collect(); // [1, 3, 2, 2]
    let w = vec![1.0, 0.0, -1.0, 0.5, 0.5, 0.5]; // [2, 3, 1, 1]
    let g = Geometry::new(
        NODE,
        [1, c, 2, 2],
        [k, c, 1, 1],
        [1, k, 2, 2],
        &ConvAttrs::default(),
    )
    .unwrap();
    let y = g.fprop(&x, &w);
    for pix in 0..4 {
        let xs: Vec<f32> = (0..c).map(|ch| x[ch * 4 + pix]).collect();
        assert_eq!(y[pix], xs[0] - xs[2]);
        assert_eq!(y[4 + pix], 0.5 * (xs[0] + xs[1] + xs[2]));
    }
}

/// dgrad and wgrad are the adjoints of fprop: ⟨fprop(x, w), dy⟩ = ⟨x, dgrad(dy, w)⟩ =
/// ⟨w, wgrad(x, dy)⟩, for strides, dilations and asymmetric padding. Each side is an exact
/// f64 sum of FP32 roundings of exact sums: they agree to FP32 rounding (1e-6 relative).
#[test]
fn dgrad_and_wgrad_are_the_adjoints_of_fprop() {
    let mut seed = 5;
    for (stride, dil, pre, post, r) in [
        (1, 1, [1, 1], [1, 1], 3),
        (2, 1, [1, 0], [0, 1], 3),
        (2, 2, [2, 1], [1, 2], 3),
        (3, 1, [0, 0], [0, 0], 1),
    ] {
        let attrs = ConvAttrs {
            pre_padding: pre,
            post_padding: post,
            stride: [stride, stride + 1],
            dilation: [dil, dil],
        };
        let (n, c, h, w, k) = (2, 3, 9, 8, 4);
        let p = attrs.out_extent(0, h, r).unwrap() as usize;
        let q = attrs.out_extent(1, w, r).unwrap() as usize;
        let (n, c, h, w, k, r) = (n, c, h as usize, w as usize, k, r as usize);
        let g = Geometry::new(NODE, [n, c, h, w], [k, c, r, r], [n, k, p, q], &attrs).unwrap();
        let x = random(n * c * h * w, &mut seed);
        let wt = random(k * c * r * r, &mut seed);
        let dy = random(n * k * p * q, &mut seed);
        let lhs = dot(&g.fprop(&x, &wt), &dy);
        let via_dgrad = dot(&x, &g.dgrad(&dy, &wt));
        let via_wgrad = dot(&wt, &g.wgrad(&x, &dy));
        let scale = lhs.abs().max(1.0);
        assert!(
            (lhs - via_dgrad).abs() <= 1e-5 * scale,
            "{attrs:?}: {lhs} vs {via_dgrad}"
        );
        assert!(
            (lhs - via_wgrad).abs() <= 1e-5 * scale,
            "{attrs:?}: {lhs} vs {via_wgrad}"
        );
    }
}

#[test]
fn pointwise_modes_broadcast_per_channel_vectors_and_apply_alphas() {
    let x = Value::new(vec![1, 2, 1, 2], vec![1.0, -2.0, 3.0, -4.0]);
    let v = Value::new(vec![1, 2, 1, 1], vec![10.0, 20.0]);
    let run = |mode, a1, a2, ins: &[&Value]| {
        let attrs = PointwiseAttrs::new(mode).alphas(a1, a2);
        pointwise::pointwise(NODE, &attrs, ins, &[1, 2, 1, 2]).unwrap()
    };
    assert_eq!(
        run(PointwiseMode::Add, 1.0, -1.0, &[&x, &v]),
        [-9.0, -12.0, -17.0, -24.0]
    );
    assert_eq!(
        run(PointwiseMode::Mul, 1.0, 1.0, &[&x, &v]),
        [10.0, -20.0, 60.0, -80.0]
    );
    assert_eq!(
        run(PointwiseMode::Sub, 1.0, 1.0, &[&x, &v]),
        [-9.0, -12.0, -17.0, -24.0]
    );
    assert_eq!(
        run(PointwiseMode::ReluFwd, 1.0, 1.0, &[&x]),
        [1.0, 0.0, 3.0, 0.0]
    );
    // ReLU backward (dy, x): dy where x > 0.
    assert_eq!(
        run(PointwiseMode::ReluBwd, 1.0, 1.0, &[&v_full(), &x]),
        [5.0, 0.0, 7.0, 0.0]
    );
    let mask = run(
        PointwiseMode::CmpGt,
        1.0,
        1.0,
        &[&x, &Value::new(vec![1; 4], vec![0.0])],
    );
    assert_eq!(mask, [1.0, 0.0, 1.0, 0.0]);
    let mask = Value::new(vec![1, 2, 1, 2], mask);
    assert_eq!(
        run(PointwiseMode::BinarySelect, 1.0, 1.0, &[&x, &v, &mask]),
        [1.0, 10.0, 3.0, 20.0]
    );
    // Dims that do not broadcast are an error, not a wrong index.
    let bad = Value::new(vec![1, 3, 1, 1], vec![0.0; 3]);
    let attrs = PointwiseAttrs::new(PointwiseMode::Add);
    assert!(pointwise::pointwise(NODE, &attrs, &[&x, &bad], &[1, 2, 1, 2]).is_err());
}

fn v_full() -> Value {
    Value::new(vec![1, 2, 1, 2], vec![5.0, 6.0, 7.0, 8.0])
}

#[test]
fn reductions_keep_the_dims_of_their_output() {
    // [1, 2, 1, 3]: channel 0 = 1, 2, 3; channel 1 = -1, 5, 0.
    let x = Value::new(vec![1, 2, 1, 3], vec![1.0, 2.0, 3.0, -1.0, 5.0, 0.0]);
    let sum = pointwise::reduce(NODE, ReductionMode::Add, &x, &[1, 2, 1, 1]).unwrap();
    assert_eq!(sum, [6.0, 4.0]);
    let max = pointwise::reduce(NODE, ReductionMode::Max, &x, &[1, 1, 1, 3]).unwrap();
    assert_eq!(max, [1.0, 5.0, 3.0]);
    assert!(pointwise::reduce(NODE, ReductionMode::Add, &x, &[1, 2, 1, 2]).is_err());
}

#[test]
fn bn_finalize_of_known_sums() {
    // One channel over 1, 2, 3, 4: mean 2.5, biased variance 1.25, unbiased 5/3.
    let f = bn::finalize(
        NODE,
        &bn::FinalizeIn {
            sum: &[10.0],
            sq_sum: &[30.0],
            gamma: &[2.0],
            beta: &[1.0],
            running_mean: &[0.0],
            running_var: &[1.0],
            eps: 0.75,
            factor: 0.5,
            count: 4.0,
        },
    )
    .unwrap();
    assert_eq!(f.mean, [2.5]);
    assert_eq!(f.inv_std, [1.0 / 2.0f32.sqrt()]);
    assert_eq!(f.eq_scale, [2.0 / 2.0f32.sqrt()]);
    assert_eq!(f.eq_bias, [1.0 - 2.5 * (2.0 / 2.0f32.sqrt())]);
    assert_eq!(f.running_mean, [1.25]);
    assert!((f.running_var[0] - (0.5 + 0.5 * 5.0 / 3.0)).abs() < 1e-6);
    // A count below 2 is refused (the unbiased variance divides by count − 1).
    let bad = bn::FinalizeIn {
        count: 1.0,
        sum: &[1.0],
        sq_sum: &[1.0],
        gamma: &[1.0],
        beta: &[0.0],
        running_mean: &[0.0],
        running_var: &[1.0],
        eps: 1e-5,
        factor: 0.1,
    };
    assert!(bn::finalize(NODE, &bad).is_err());
}

/// The BN backward's identities: per channel Σdx = 0 and Σdx·x̂ = 0 (the normalized output
/// does not change with a shift or a scale of its input; the second holds up to ε/σ², so ε is
/// tiny here), and dγ, dβ as summed directly.
#[test]
fn norm_backward_satisfies_the_bn_backward_identities() {
    let mut seed = 9;
    let (n, c, hw) = (2, 3, 16);
    let x = Value::new(vec![n, c, 4, 4], random(n * c * hw, &mut seed));
    let dy = Value::new(vec![n, c, 4, 4], random(n * c * hw, &mut seed));
    let gamma = Value::new(vec![1, c, 1, 1], vec![0.5, 1.0, 2.0]);
    let beta = Value::new(vec![1, c, 1, 1], vec![0.0; 3]);
    let [_, mean, inv, _, _] = bn::norm_forward(NODE, &x, &gamma, &beta, 1e-10, 0.1, None).unwrap();
    let mean_v = Value::new(vec![1, c, 1, 1], mean.clone());
    let inv_v = Value::new(vec![1, c, 1, 1], inv.clone());
    let [dx, dg, db] = bn::norm_backward(NODE, &dy, &x, &gamma, &mean_v, &inv_v).unwrap();
    let [dg2, db2, a, b, cc] = bn::dbn_weight(NODE, &x, &mean_v, &inv_v, &gamma, &dy).unwrap();
    assert_eq!((dg.clone(), db.clone()), (dg2, db2));
    for ch in 0..c {
        let idx: Vec<usize> = (0..n * c * hw).filter(|i| (i / hw) % c == ch).collect();
        let s: f64 = idx.iter().map(|&i| f64::from(dx[i])).sum();
        let sx: f64 = idx
            .iter()
            .map(|&i| f64::from(dx[i]) * f64::from((x.data[i] - mean[ch]) * inv[ch]))
            .sum();
        let mag: f64 = idx.iter().map(|&i| f64::from(dx[i].abs())).sum();
        // FP32 per-element arithmetic: each term is off by a few FP32 roundings.
        assert!(
            s.abs() <= 1e-5 * mag && sx.abs() <= 1e-5 * mag,
            "{ch}: {s} {sx}"
        );
        // dx = A·dy + B·x + C, dBN weight's coefficients, to FP32 rounding.
        for &i in &idx {
            let lin = a[ch] * dy.data[i] + b[ch] * x.data[i] + cc[ch];
            assert!(
                (lin - dx[i]).abs() <= 1e-5 * (1.0 + dx[i].abs()),
                "{lin} vs {}",
                dx[i]
            );
        }
    }
}

/// An add graph over `[1, 3, 2, 2]` with x NCHW-packed and y NHWC with a padded row pitch.
fn strided_add() -> (Graph, [i64; 3], usize) {
    let mut g = Graph::new("strided_add");
    let x = g.tensor(TensorAttrs::new("X", [1, 3, 2, 2]).nchw());
    let b = g.tensor(TensorAttrs::vector("B", 3).dtype(DataType::Float));
    let y = g.add(x, b);
    // NHWC with a row pitch of 3 pixels (one padding pixel per row).
    let y_strides = [18, 1, 9, 3];
    g.get_mut(y).unwrap().strides = y_strides.to_vec();
    g.set_output(y, None).unwrap();
    let layout = real_tensor_layout(&g);
    let uid = |t| layout.iter().find(|r| r.id == t).unwrap().uid;
    let y_bytes = layout.iter().find(|r| r.id == y).unwrap().bytes;
    (g, [uid(x), uid(b), uid(y)], y_bytes)
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| f16::from_f32(*x).to_le_bytes())
        .collect()
}

#[test]
fn strided_tensors_are_read_and_written_through_their_strides() {
    let (g, [ux, ub, uy], y_bytes) = strided_add();
    let mut mem = HostMemory::new();
    // x[c][h][w] = 10·c + 2·h + w, NCHW.
    let xs: Vec<f32> = (0..12).map(|i| (10 * (i / 4) + i % 4) as f32).collect();
    let x = mem.alloc_from(&f16_bytes(&xs));
    let b = mem.alloc_from(&[1.0f32, 2.0, 3.0].map(f32::to_le_bytes).concat());
    let y = mem.alloc_from(&vec![0xab; y_bytes]);
    let pack = VariantPack {
        pointers: &[(ux, x), (ub, b), (uy, y)],
        scalars: &[],
    };
    execute_host(&g, &pack, &mut mem, &Options::default()).unwrap();
    let out = mem.read_bytes(y, y_bytes).unwrap();
    for h in 0..2 {
        for pix in 0..3 {
            for c in 0..3 {
                let at = (h * 9 + pix * 3 + c) * 2;
                if at >= out.len() {
                    continue; // The last row's padding pixel is past the tensor's extent.
                }
                let v = f16::from_le_bytes([out[at], out[at + 1]]).to_f32();
                if pix == 2 {
                    // The row's padding pixel keeps its bytes.
                    assert_eq!([out[at], out[at + 1]], [0xab, 0xab]);
                } else {
                    assert_eq!(v, (10 * c + 2 * h + pix) as f32 + (c + 1) as f32);
                }
            }
        }
    }
}

/// A map over one `Vec<u8>` the test owns, for the raw-address entry point.
struct OneAllocation(Allocation);

impl MemoryMap for OneAllocation {
    fn allocation(&self, addr: u64) -> Option<Allocation> {
        self.0.contains(addr, 0).then_some(self.0)
    }
}

#[test]
fn the_raw_address_path_checks_and_runs_like_the_host_path() {
    let (g, [ux, ub, uy], y_bytes) = strided_add();
    let mut storage = vec![0u8; 512];
    let base = (storage.as_mut_ptr() as u64).next_multiple_of(16);
    let off = (base - storage.as_ptr() as u64) as usize;
    let xs: Vec<f32> = (0..12).map(|i| i as f32).collect();
    storage[off..off + 24].copy_from_slice(&f16_bytes(&xs));
    storage[off + 32..off + 44].copy_from_slice(&[0.5f32, 0.5, 0.5].map(f32::to_le_bytes).concat());
    let map = OneAllocation(Allocation {
        base,
        len: (storage.len() - off) as u64,
    });
    let pack = VariantPack {
        pointers: &[(ux, base), (ub, base + 32), (uy, base + 64)],
        scalars: &[],
    };
    // SAFETY: the map's one allocation lies inside `storage`, which lives and is not
    // otherwise touched until the call returns.
    unsafe { execute(&g, &pack, &map, &Options::default()) }.unwrap();
    let y0 = f16::from_le_bytes([storage[off + 64], storage[off + 65]]).to_f32();
    assert_eq!(y0, 0.5); // x[c=0, h=0, w=0] = 0, plus 0.5.
                         // Past the allocation's end: refused before anything is touched.
                         // The last 16-aligned address with fewer bytes left than y spans.
    let end = base + (map.0.len - 16) / 16 * 16;
    assert!(base + map.0.len - end < y_bytes as u64);
    let pack = VariantPack {
        pointers: &[(ux, base), (ub, base + 32), (uy, end)],
        scalars: &[],
    };
    // SAFETY: as above.
    let e = unsafe { execute(&g, &pack, &map, &Options::default()) }.unwrap_err();
    assert!(
        matches!(e, InterpError::OutOfBounds { uid, .. } if uid == uy),
        "{e}"
    );
}
