//! Tier 4 (GPU): the network-head kernels (`crates/4-netops/kernels/net_head.cu`) against their CPU twins
//! on random data, bit for bit (every sum has a fixed order on both sides), including the FC
//! layer with its parameters in a memory plan's regions and the metrics log.
//!
//! Each test opens device 0 and compiles the kernels through the crate's typed-error path;
//! where the machine cannot run them it prints one `SKIP <test>: <reason>` line and returns.

use std::sync::Arc;

use cudnn_cbr_amp::cuda::{AmpKernels, CudaRegions, CudaSlice, CudaStream, DevRange, DevRangeMut};
use cudnn_cbr_amp::plan::{ByteRange, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::Scalars;
use cudnn_cbr_netops::cuda::RegionsFc;
use cudnn_cbr_netops::head::{self, metrics_log_bytes, HeadShape};
use cudnn_cbr_netops::pool;
use half::f16;

mod common;
use common::{device, download, f16_bytes, f32_bytes, upload, Rng};

fn bi32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn zeros(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<u8> {
    stream.alloc_zeros::<u8>(n).expect("alloc")
}
fn bits32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
fn bits16(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

const SHAPES: [HeadShape; 3] = [
    HeadShape::new(32, 64, 32, 8),
    HeadShape::new(3, 7, 5, 11),
    HeadShape::new(64, 196, 64, 16),
];

#[test]
fn gpu_pooling_and_fc_match_their_twins_bit_for_bit() {
    let Some((st, k)) = device("gpu_pooling_and_fc_match_their_twins_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(11);
    for s in SHAPES {
        let a = rng.f16s(s.activation_elems(), 4.0);
        let w = rng.f32s(s.weight_elems(), 0.5);
        let bias = rng.f32s(s.classes, 0.5);
        let g = rng.f16s(s.logits_elems(), 500.0);
        // CPU twins.
        let mut pooled = vec![0.0; s.pooled_elems()];
        head::gap_forward(&s, &a, &mut pooled).unwrap();
        let mut logits = vec![f16::ZERO; s.logits_elems()];
        head::fc_forward(&s, &pooled, &w, &bias, &mut logits).unwrap();
        let (mut dw, mut db, mut dx) = (
            vec![0.0; s.weight_elems()],
            vec![0.0; s.classes],
            vec![0.0; s.pooled_elems()],
        );
        head::fc_backward(&s, &g, &pooled, &w, &mut dw, &mut db, &mut dx).unwrap();
        let mut da = vec![f16::ZERO; s.activation_elems()];
        head::gap_backward(&s, &dx, &mut da).unwrap();
        // Device.
        let a_d = upload(&st, &f16_bytes(&a));
        let w_d = upload(&st, &f32_bytes(&w));
        let b_d = upload(&st, &f32_bytes(&bias));
        let g_d = upload(&st, &f16_bytes(&g));
        let mut pooled_d = zeros(&st, 4 * s.pooled_elems());
        let mut logits_d = zeros(&st, 2 * s.logits_elems());
        let (mut dw_d, mut db_d, mut dx_d) = (
            zeros(&st, 4 * s.weight_elems()),
            zeros(&st, 4 * s.classes),
            zeros(&st, 4 * s.pooled_elems()),
        );
        let mut da_d = zeros(&st, 2 * s.activation_elems());
        k.gap_forward(
            &st,
            &s,
            DevRange::whole(&a_d),
            DevRangeMut::whole(&mut pooled_d),
        )
        .unwrap();
        k.fc_forward(
            &st,
            &s,
            DevRange::whole(&pooled_d),
            DevRange::whole(&w_d),
            DevRange::whole(&b_d),
            DevRangeMut::whole(&mut logits_d),
        )
        .unwrap();
        k.fc_backward(
            &st,
            &s,
            DevRange::whole(&g_d),
            DevRange::whole(&pooled_d),
            DevRange::whole(&w_d),
            DevRangeMut::whole(&mut dw_d),
            DevRangeMut::whole(&mut db_d),
            DevRangeMut::whole(&mut dx_d),
        )
        .unwrap();
        k.gap_backward(
            &st,
            &s,
            DevRange::whole(&dx_d),
            DevRangeMut::whole(&mut da_d),
        )
        .unwrap();
        assert_eq!(
            bits32(&download(&st, &pooled_d)),
            bits32(&f32_bytes(&pooled)),
            "pooled {s:?}"
        );
        assert_eq!(
            bits16(&download(&st, &logits_d)),
            bits16(&f16_bytes(&logits)),
            "logits {s:?}"
        );
        assert_eq!(
            bits32(&download(&st, &dw_d)),
            bits32(&f32_bytes(&dw)),
            "dw {s:?}"
        );
        assert_eq!(
            bits32(&download(&st, &db_d)),
            bits32(&f32_bytes(&db)),
            "db {s:?}"
        );
        assert_eq!(
            bits32(&download(&st, &dx_d)),
            bits32(&f32_bytes(&dx)),
            "dx {s:?}"
        );
        assert_eq!(
            bits16(&download(&st, &da_d)),
            bits16(&f16_bytes(&da)),
            "da {s:?}"
        );
    }
}

#[test]
fn gpu_add_matches_its_twin_on_both_paths() {
    let Some((st, k)) = device("gpu_add_matches_its_twin_on_both_paths") else {
        return;
    };
    let mut rng = Rng(12);
    for n in [1usize, 7, 8, 9, 4099, 1 << 20] {
        // Offset 0: 16-byte vector path; offset 2 bytes: scalar path.
        for off in [0usize, 2] {
            let a = rng.f16s(n, 40000.0);
            let b = rng.f16s(n, 40000.0);
            let mut want = vec![f16::ZERO; n];
            head::add_f16(&a, &b, &mut want).unwrap();
            let pad = |v: &[f16]| {
                let mut bytes = vec![0u8; off];
                bytes.extend(f16_bytes(v));
                bytes
            };
            let a_d = upload(&st, &pad(&a));
            let b_d = upload(&st, &pad(&b));
            let mut o_d = zeros(&st, off + 2 * n);
            let r = ByteRange::new(off, off + 2 * n);
            k.add_f16(
                &st,
                DevRange::new(&a_d, r).unwrap(),
                DevRange::new(&b_d, r).unwrap(),
                DevRangeMut::new(&mut o_d, r).unwrap(),
            )
            .unwrap();
            assert_eq!(
                bits16(&download(&st, &o_d)[off..]),
                bits16(&f16_bytes(&want)),
                "n {n} offset {off}"
            );
        }
    }
}

#[test]
fn gpu_seed_and_metrics_log_match_their_twins() {
    let Some((st, k)) = device("gpu_seed_and_metrics_log_match_their_twins") else {
        return;
    };
    // The loss seed is amp's kernel: its loss rows feed the metrics.
    let amp = AmpKernels::for_context(st.context()).unwrap();
    let mut rng = Rng(13);
    let (batch, classes, capacity) = (32usize, 8usize, 3usize);
    let scalars = Scalars::default();
    let s_d = upload(&st, &scalars.to_bytes());
    let mut log_d = zeros(&st, metrics_log_bytes(capacity));
    let mut log = vec![0u8; metrics_log_bytes(capacity)];
    for step in 0..5 {
        let mut logits = rng.f16s(batch * classes, 3.0);
        // A tie exercises the argmax rule (the last maximum wins).
        logits[classes] = logits[classes + 3];
        let labels: Vec<i32> = (0..batch)
            .map(|r| {
                if r == 5 {
                    -100
                } else {
                    (r * 7 + step) as i32 % classes as i32
                }
            })
            .collect();
        let x_d = upload(&st, &f16_bytes(&logits));
        let y_d = upload(&st, &bi32(&labels));
        let mut d_d = zeros(&st, 2 * batch * classes);
        let mut l_d = zeros(&st, 4 * batch);
        amp.softmax_xent_backward_range(
            &st,
            classes,
            DevRange::whole(&x_d),
            DevRange::whole(&y_d),
            DevRange::whole(&s_d),
            DevRangeMut::whole(&mut d_d),
            Some(DevRangeMut::whole(&mut l_d)),
        )
        .unwrap();
        let loss_rows: Vec<f32> = download(&st, &l_d)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // The seed is the existing kernel (its twin agrees within one FP16 ulp, see
        // crates/3-amp/tests/gpu_range_kernels.rs); here: the byte-range launch gives the typed
        // launch's bytes.
        let x_t = st.clone_htod(&logits).unwrap();
        let y_t = st.clone_htod(&labels).unwrap();
        let mut d_t = st.alloc_zeros::<f16>(batch * classes).unwrap();
        let mut l_t = st.alloc_zeros::<f32>(batch).unwrap();
        amp.softmax_xent_backward(
            &st,
            &x_t,
            &y_t,
            classes,
            DevRange::whole(&s_d),
            &mut d_t,
            Some(&mut l_t),
        )
        .unwrap();
        assert_eq!(
            bits16(&download(&st, &d_d)),
            bits16(&f16_bytes(&st.clone_dtoh(&d_t).unwrap()))
        );
        assert_eq!(
            bits32(&f32_bytes(&loss_rows)),
            bits32(&f32_bytes(&st.clone_dtoh(&l_t).unwrap()))
        );
        // Metrics from the device's loss rows, appended on both sides.
        k.head_metrics(
            &st,
            classes,
            DevRange::whole(&x_d),
            DevRange::whole(&y_d),
            Some(DevRange::whole(&l_d)),
            DevRangeMut::whole(&mut log_d),
        )
        .unwrap();
        let m = head::head_metrics(&logits, &labels, Some(&loss_rows), classes).unwrap();
        head::metrics_log_append(&mut log, m).unwrap();
        assert_eq!(download(&st, &log_d), log, "step {step}");
        // Without losses, and with a NaN logit (the largest value in the total order).
        let mut nan = logits.clone();
        nan[2 * classes + 1] = f16::NAN;
        let n_d = upload(&st, &f16_bytes(&nan));
        k.head_metrics(
            &st,
            classes,
            DevRange::whole(&n_d),
            DevRange::whole(&y_d),
            None,
            DevRangeMut::whole(&mut log_d),
        )
        .unwrap();
        let m = head::head_metrics(&nan, &labels, None, classes).unwrap();
        head::metrics_log_append(&mut log, m).unwrap();
        assert_eq!(download(&st, &log_d), log, "step {step}, NaN logit");
    }
    let read = head::metrics_log_read(&log).unwrap();
    assert_eq!((read.count, read.entries.len()), (10, capacity));
}

#[test]
fn gpu_fc_in_the_regions_writes_g_and_reads_w() {
    let Some((st, _k)) = device("gpu_fc_in_the_regions_writes_g_and_reads_w") else {
        return;
    };
    let s = HeadShape::new(16, 4, 32, 8);
    let mut b = MemoryPlanBuilder::new();
    let bucket = b.bucket("all").unwrap();
    b.add("conv.w", ParamKind::ConvWeight, &[8, 3, 3, 8], bucket)
        .unwrap();
    b.add(
        "fc.w",
        ParamKind::FcWeight,
        &[s.classes, s.features],
        bucket,
    )
    .unwrap();
    b.add("fc.b", ParamKind::FcBias, &[s.classes], bucket)
        .unwrap();
    let mut regions = CudaRegions::new(b.finalize().unwrap(), st.clone()).unwrap();
    let mut rng = Rng(14);
    let w = rng.f32s(s.weight_elems(), 0.5);
    let bias = rng.f32s(s.classes, 0.5);
    regions.upload_f32(Region::W, "fc.w", &w).unwrap();
    regions.upload_f32(Region::W, "fc.b", &bias).unwrap();
    let x = rng.f32s(s.pooled_elems(), 1.0);
    let g = rng.f16s(s.logits_elems(), 100.0);
    let x_d = upload(&st, &f32_bytes(&x));
    let g_d = upload(&st, &f16_bytes(&g));
    let mut logits_d = zeros(&st, 2 * s.logits_elems());
    let mut dx_d = zeros(&st, 4 * s.pooled_elems());
    regions
        .fc_forward(
            "fc.w",
            "fc.b",
            &s,
            DevRange::whole(&x_d),
            DevRangeMut::whole(&mut logits_d),
        )
        .unwrap();
    regions
        .fc_backward(
            "fc.w",
            "fc.b",
            &s,
            DevRange::whole(&g_d),
            DevRange::whole(&x_d),
            DevRangeMut::whole(&mut dx_d),
        )
        .unwrap();
    let mut logits = vec![f16::ZERO; s.logits_elems()];
    head::fc_forward(&s, &x, &w, &bias, &mut logits).unwrap();
    let (mut dw, mut db, mut dx) = (
        vec![0.0; s.weight_elems()],
        vec![0.0; s.classes],
        vec![0.0; s.pooled_elems()],
    );
    head::fc_backward(&s, &g, &x, &w, &mut dw, &mut db, &mut dx).unwrap();
    assert_eq!(
        bits16(&download(&st, &logits_d)),
        bits16(&f16_bytes(&logits))
    );
    assert_eq!(bits32(&download(&st, &dx_d)), bits32(&f32_bytes(&dx)));
    assert_eq!(
        bits32(&f32_bytes(
            &regions.download_f32(Region::G, "fc.w").unwrap()
        )),
        bits32(&f32_bytes(&dw))
    );
    assert_eq!(
        bits32(&f32_bytes(
            &regions.download_f32(Region::G, "fc.b").unwrap()
        )),
        bits32(&f32_bytes(&db))
    );
    // Nothing else of G was touched.
    assert!(regions
        .download_f32(Region::G, "conv.w")
        .unwrap()
        .iter()
        .all(|v| *v == 0.0));
    // A parameter of the wrong size is a typed error, not a launch.
    let bad = HeadShape::new(16, 4, 31, 8);
    assert!(regions
        .fc_forward(
            "fc.w",
            "fc.b",
            &bad,
            DevRange::whole(&x_d),
            DevRangeMut::whole(&mut logits_d)
        )
        .is_err());
}

#[test]
fn gpu_max_pool_matches_its_twin_bit_for_bit() {
    let Some((st, k)) = device("gpu_max_pool_matches_its_twin_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(23);
    let shapes = [
        // The ResNet stem's 3×3/2 pad 1 (overlapping windows), odd and even sizes.
        pool::PoolShape {
            batch: 4,
            h: 17,
            w: 16,
            channels: 8,
            kernel: 3,
            stride: 2,
            pad: 1,
        },
        pool::PoolShape {
            batch: 2,
            h: 112,
            w: 112,
            channels: 64,
            kernel: 3,
            stride: 2,
            pad: 1,
        },
        // Non-overlapping.
        pool::PoolShape {
            batch: 3,
            h: 6,
            w: 6,
            channels: 5,
            kernel: 2,
            stride: 2,
            pad: 0,
        },
    ];
    for s in shapes {
        // Half the inputs are exact zeros (as after a ReLU): ties everywhere.
        let x: Vec<f16> = rng
            .f16s(s.input_elems(), 2.0)
            .into_iter()
            .map(|v| if v.to_f32() < 0.0 { f16::ZERO } else { v })
            .collect();
        let dy = rng.f16s(s.output_elems(), 3.0);
        let mut y = vec![f16::ZERO; s.output_elems()];
        pool::max_pool_forward(&s, &x, &mut y).unwrap();
        let mut dx = vec![f16::ZERO; s.input_elems()];
        pool::max_pool_backward(&s, &x, &dy, &mut dx).unwrap();
        let x_d = upload(&st, &f16_bytes(&x));
        let dy_d = upload(&st, &f16_bytes(&dy));
        let mut y_d = zeros(&st, 2 * s.output_elems());
        let mut dx_d = zeros(&st, 2 * s.input_elems());
        k.max_pool_forward(&st, &s, DevRange::whole(&x_d), DevRangeMut::whole(&mut y_d))
            .unwrap();
        k.max_pool_backward(
            &st,
            &s,
            DevRange::whole(&x_d),
            DevRange::whole(&dy_d),
            DevRangeMut::whole(&mut dx_d),
        )
        .unwrap();
        assert_eq!(
            bits16(&download(&st, &y_d)),
            bits16(&f16_bytes(&y)),
            "{s:?} forward"
        );
        assert_eq!(
            bits16(&download(&st, &dx_d)),
            bits16(&f16_bytes(&dx)),
            "{s:?} backward"
        );
    }
}
