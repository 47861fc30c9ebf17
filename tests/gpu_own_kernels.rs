//! Tier 4 (GPU): our element-wise kernels on the device. A two-layer chain (the second layer
//! takes the first's BN as its prologue and ends with a BN apply plus a residual) runs two
//! training passes with our kernels (an output accumulated instead of overwritten differs on
//! the second). Each kernel's output of the last pass is compared bit for bit with the CPU
//! reference op evaluated on the very inputs the GPU used (both compute in FP32 in the same op
//! order and round to FP16 once). Independently, the CPU executor runs the same two passes
//! from the same initial buffers, and every buffer of the two runs is compared at the end.
//! The same passes with cuDNN's graphs are then compared with ours. Prints one SKIP line where
//! there is no usable CUDA device or cuDNN.

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::graphs::ApplyResidual;
use cudnn_cbr::fusion::cbr::kernels::Pointwise;
use cudnn_cbr::fusion::cbr::{
    CbrConfig, CbrLayer, ConvShape, HostBuffer, HostBuffers, OwnedDeviceBuffers, Pass, RouteKind,
};
use cudnn_cbr::fusion::exec::Handle;
use cudnn_cbr::fusion::reference::{self as r, Activation, Nhwc, Residual};
use half::f16;

fn random(n: usize, seed: &mut u64, scale: f32, base: f32) -> Vec<f32> {
    (0..n)
        .map(|_| base + common::uniform(seed) * scale)
        .collect()
}

fn half(v: Vec<f32>) -> HostBuffer {
    HostBuffer::F16(v.into_iter().map(f16::from_f32).collect())
}

/// The layers' buffers (layer 1, layer 2).
type Downloaded = (HostBuffers, HostBuffers);

/// Forward + backward passes on each side before comparing.
const PASSES: usize = 2;

/// The chain planned on the device's target, its initial buffers, and the GPU's buffers after
/// [`PASSES`] passes from them.
struct Chain {
    l1: CbrLayer,
    l2: CbrLayer,
    start: Downloaded,
    gpu: Downloaded,
}

/// The initial buffers of both layers (the same for the GPU and the CPU runs): input, weights,
/// BN parameters, the residual and the upstream gradient; everything else zero.
fn initial(l1: &CbrLayer, l2: &CbrLayer, (s1, s2): (ConvShape, ConvShape)) -> Downloaded {
    let mut seed = 7u64;
    let mut h1 = HostBuffers::zeros(l1.buffers());
    let mut h2 = HostBuffers::zeros(l2.buffers());
    let x_elems = (s1.n * s1.c * s1.h * s1.w) as usize;
    let y2_elems = (s2.n * s2.k * s2.p() * s2.q()) as usize;
    h1.set("x", half(random(x_elems, &mut seed, 1.0, 0.0)));
    for (h, s) in [(&mut h1, s1), (&mut h2, s2)] {
        let w = random((s.k * s.c * s.r * s.s) as usize, &mut seed, 0.25, 0.0);
        h.set("w", half(w));
        let k = s.k as usize;
        h.set("gamma", HostBuffer::F32(random(k, &mut seed, 0.2, 1.0)));
        h.set("beta", HostBuffer::F32(random(k, &mut seed, 0.2, 0.0)));
        h.set("running_var", HostBuffer::F32(vec![1.0; k]));
    }
    h2.set("residual", half(random(y2_elems, &mut seed, 1.0, 0.0)));
    h2.set("da", half(random(y2_elems, &mut seed, 1.0, 0.0)));
    (h1, h2)
}

fn run(pointwise: Pointwise, shapes: (ConvShape, ConvShape)) -> Option<Chain> {
    let ctx = common::gpu_or_skip("gpu_own_kernels")?;
    let stream = ctx.default_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let target = handle.target().unwrap();
    let cache = PlanCache::new();
    let (s1, s2) = shapes;
    let plan = |c: CbrConfig| {
        CbrLayer::plan_route_with(c, &target, &cache, RouteKind::Fused, pointwise).unwrap()
    };
    let l1 = plan(CbrConfig::first(s1));
    let l2 = plan(CbrConfig::new(s2).with_apply(ApplyResidual::Add));
    let start = initial(&l1, &l2, shapes);
    let mut d1 = OwnedDeviceBuffers::alloc(l1.buffers(), &stream).unwrap();
    let mut d2 = OwnedDeviceBuffers::alloc(l2.buffers(), &stream).unwrap();
    for (d, h) in [(&mut d1, &start.0), (&mut d2, &start.1)] {
        for (name, buf) in h.iter() {
            d.upload(name, buf, &stream).unwrap();
        }
    }
    for _ in 0..PASSES {
        let mut io1 = d1.io(None).unwrap();
        l1.run_gpu(Pass::Forward, &handle, &mut io1).unwrap();
        drop(io1);
        let mut io2 = d2.io(Some(&mut d1)).unwrap();
        l2.run_gpu(Pass::Forward, &handle, &mut io2).unwrap();
        l2.run_gpu(Pass::Backward, &handle, &mut io2).unwrap();
        drop(io2);
        l1.run_gpu(Pass::Backward, &handle, &mut d1.io(None).unwrap())
            .unwrap();
    }
    stream.synchronize().unwrap();
    let download = |l: &CbrLayer, d: &OwnedDeviceBuffers| {
        let mut h = HostBuffers::zeros(l.buffers());
        for spec in l.buffers() {
            h.set(spec.name, d.download(spec, &stream).unwrap());
        }
        h
    };
    let gpu = (download(&l1, &d1), download(&l2, &d2));
    Some(Chain { l1, l2, start, gpu })
}

/// The CPU executor's [`PASSES`] passes over the chain from `start` (no GPU value enters).
fn cpu_passes(l1: &CbrLayer, l2: &CbrLayer, start: &Downloaded) -> Downloaded {
    let (mut h1, mut h2) = start.clone();
    for _ in 0..PASSES {
        l1.run_cpu(Pass::Forward, &mut h1, None).unwrap();
        l2.run_cpu(Pass::Forward, &mut h2, Some(&mut h1)).unwrap();
        l2.run_cpu(Pass::Backward, &mut h2, Some(&mut h1)).unwrap();
        l1.run_cpu(Pass::Backward, &mut h1, None).unwrap();
    }
    (h1, h2)
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn f16s<'a>(h: &'a HostBuffers, name: &str) -> &'a [f16] {
    match h.get(name) {
        Some(HostBuffer::F16(v)) => v,
        other => panic!("{name}: expected FP16, got {other:?}"),
    }
}

fn f32s<'a>(h: &'a HostBuffers, name: &str) -> &'a [f32] {
    match h.get(name) {
        Some(HostBuffer::F32(v)) => v,
        other => panic!("{name}: expected FP32, got {other:?}"),
    }
}

fn bits(v: &[f16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Elements that differ, and the largest difference in units of the FP16 spacing at the
/// reference value.
fn compare(ours: &[f16], reference: &[f16]) -> (usize, f32) {
    let mut differ = 0;
    let mut worst = 0f32;
    for (a, b) in ours.iter().zip(reference) {
        if a.to_bits() != b.to_bits() {
            differ += 1;
            let ulp = (b.to_f32().abs().max(6.1e-5) * 2f32.powi(-10)).max(f32::MIN_POSITIVE);
            worst = worst.max((a.to_f32() - b.to_f32()).abs() / ulp);
        }
    }
    (differ, worst)
}

#[test]
fn our_kernels_match_the_reference_ops_bit_for_bit_and_cudnn_within_an_ulp() {
    // 64 channels: the 16-byte path; 24 channels after a 3-channel first conv: the
    // element-by-element path, and the first layer's statistics on our kernel (its conv +
    // GenStats graph would be runtime-compiled, so the fused route splits it).
    let cases = common::gpu_shapes::own_kernels_pairs();
    for shapes in cases {
        let Some(chain) = run(Pointwise::Own, shapes) else {
            return;
        };
        let Chain {
            l1,
            l2,
            start,
            gpu: (h1, h2),
        } = chain;
        let (s1, s2) = shapes;
        let y2 = Nhwc::new(
            s2.n as usize,
            s2.p() as usize,
            s2.q() as usize,
            s2.k as usize,
        );
        let y1 = Nhwc::new(
            s1.n as usize,
            s1.p() as usize,
            s1.q() as usize,
            s1.k as usize,
        );
        let apply = r::bn_apply(
            &y2,
            f16s(&h2, "y"),
            f16s(&h2, "eq_scale"),
            f16s(&h2, "eq_bias"),
            Residual::Add(f16s(&h2, "residual")),
            Activation::Relu,
        )
        .unwrap();
        assert_eq!(bits(f16s(&h2, "a")), bits(&apply), "apply {}", s2.label());
        let relu = r::relu_bwd(&y2, f16s(&h2, "da"), f16s(&h2, "a")).unwrap();
        assert_eq!(bits(f16s(&h2, "dpre")), bits(&relu), "relu backward");
        let dbn = r::dbn_apply(
            &y1,
            f16s(&h2, "dz_prev"),
            f16s(&h1, "y"),
            f32s(&h2, "dbn_a"),
            f32s(&h2, "dbn_b"),
            f32s(&h2, "dbn_c"),
        )
        .unwrap();
        assert_eq!(bits(f16s(&h1, "dy")), bits(&dbn), "dBN apply");
        // The split first layer's statistics (our kernel): FP32 sums in the GPU's order
        // against the reference's, from the same FP16 y. Each sum's rounding error is at most (terms · 2^-24) of the sum of
        // magnitudes; 1e-5 of it allows 160+ terms per channel on this shape's 162.
        let stats = r::genstats(&y1, f16s(&h1, "y")).unwrap();
        let magnitude = r::genstats(
            &y1,
            &f16s(&h1, "y")
                .iter()
                .map(|v| f16::from_f32(v.to_f32().abs()))
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let split = s1.c % 8 != 0;
        for (name, gpu, cpu, scale) in [
            ("sum", f32s(&h1, "sum"), &stats.sum, &magnitude.sum),
            (
                "sq_sum",
                f32s(&h1, "sq_sum"),
                &stats.sqsum,
                &magnitude.sqsum,
            ),
        ]
        .into_iter()
        .filter(|_| split)
        {
            for k in 0..gpu.len() {
                let err = (gpu[k] - cpu[k]).abs();
                assert!(
                    err <= 1e-5 * scale[k].max(1e-30),
                    "{name}[{k}]: {} vs {} ({err:e})",
                    gpu[k],
                    cpu[k]
                );
            }
        }
        // The activation's BN backward on the fused route: dγ, dβ by our reduction (FP32 sums
        // in the GPU's order; bound as for the statistics above), the coefficients in the
        // dbn_coefficients graph's FP32 op order (bit for bit: no contraction), then the dBN
        // apply (bit for bit).
        let (dpre, y) = (f16s(&h2, "dpre"), f16s(&h2, "y"));
        let (mean, inv_std) = (f32s(&h2, "saved_mean"), f32s(&h2, "saved_inv_std"));
        let k2 = s2.k as usize;
        for k in 0..k2 {
            let (mut dg, mut db, mut scale) = (0f64, 0f64, 0f64);
            for (d, v) in dpre.iter().zip(y).skip(k).step_by(k2) {
                let x_hat = (v.to_f32() - mean[k]) * inv_std[k];
                dg += f64::from(d.to_f32() * x_hat);
                db += f64::from(d.to_f32());
                scale += f64::from((d.to_f32() * x_hat).abs()) + f64::from(d.to_f32().abs());
            }
            let (gdg, gdb) = (f32s(&h2, "dgamma")[k], f32s(&h2, "dbeta")[k]);
            let bound = 1e-5 * scale.max(1e-30);
            assert!(
                (f64::from(gdg) - dg).abs() <= bound,
                "dgamma[{k}]: {gdg} vs {dg}"
            );
            assert!(
                (f64::from(gdb) - db).abs() <= bound,
                "dbeta[{k}]: {gdb} vs {db}"
            );
            let gamma = f32s(&h2, "gamma")[k];
            let m = (s2.n * s2.p() * s2.q()) as f64;
            let nm = (-1.0 / m) as f32;
            let a = gamma * inv_std[k];
            let b = ((a * inv_std[k]) * gdg) * nm;
            let c = ((a * gdb) * nm) - b * mean[k];
            let got = [
                f32s(&h2, "apply_dbn_a")[k],
                f32s(&h2, "apply_dbn_b")[k],
                f32s(&h2, "apply_dbn_c")[k],
            ];
            assert_eq!(
                got.map(f32::to_bits),
                [a, b, c].map(f32::to_bits),
                "coefficients[{k}]"
            );
        }
        let dy2 = r::dbn_apply(
            &y2,
            dpre,
            y,
            f32s(&h2, "apply_dbn_a"),
            f32s(&h2, "apply_dbn_b"),
            f32s(&h2, "apply_dbn_c"),
        )
        .unwrap();
        assert_eq!(
            bits(f16s(&h2, "dy")),
            bits(&dy2),
            "the activation's dBN apply"
        );
        println!(
            "{} -> {}: our kernels equal the reference ops",
            s1.label(),
            s2.label()
        );

        // The CPU executor on its own: the same two passes from the same initial buffers,
        // every buffer compared at the end. FP16 stores on both sides with FP32 accumulation
        // in different orders (cuDNN's convolutions): forward values agree to a few 2^-11;
        // gradients go through 2–3 more FP16 stores and near-zero ReLU decisions, so 2e-2
        // (the bounds of tests/gpu_cbr_parity.rs). An output accumulated across the passes
        // is off by its whole size (relative 1 or more).
        let (c1, c2) = cpu_passes(&l1, &l2, &start);
        for (layer, specs, gpu, cpu) in [
            ("l1", l1.buffers(), &h1, &c1),
            ("l2", l2.buffers(), &h2, &c2),
        ] {
            for spec in specs {
                let g = gpu.get(spec.name).unwrap().to_f32();
                let c = cpu.get(spec.name).unwrap().to_f32();
                let err = rel_l2(&g, &c);
                println!(
                    "{} {layer}.{:<16} GPU vs CPU rel L2 {err:.2e}",
                    s2.label(),
                    spec.name
                );
                let gradient = spec.name.starts_with('d') || spec.name.contains("dbn");
                let tol = if gradient { 2e-2 } else { 5e-3 };
                assert!(
                    err <= tol,
                    "{layer}.{}: GPU vs CPU {err:.2e} > {tol:e}",
                    spec.name
                );
            }
        }

        // cuDNN's graphs on the same inputs: everything before the first element-wise step is
        // the same plan, so `a` compares directly. cuDNN may contract y·s + b into one
        // multiply-add (one rounding fewer), which moves an FP16 result by at most one unit.
        let cudnn = run(Pointwise::Cudnn, shapes).expect("the device is still there");
        let c2 = &cudnn.gpu.1;
        let (differ, worst) = compare(f16s(&h2, "a"), f16s(c2, "a"));
        println!("apply vs cuDNN: {differ} elements differ, at most {worst:.2} FP16 units");
        assert!(
            worst <= 1.0,
            "apply differs from cuDNN by {worst} FP16 units"
        );
        assert_eq!(bits(f16s(&h2, "dpre")), bits(f16s(c2, "dpre")));
    }
}

/// The unfused route's evaluation-mode BN (`cbr_bn_eval`, in place of its training-mode
/// NormForward) on the device against its formula evaluated on the host over the very `y` the
/// device's conv wrote: `((y − μ)·inv_std)·γ + β` in FP32 with the running statistics'
/// `μ` and `inv_std` from `bn_eval_finalize` (what the CPU executor's evaluation computes),
/// then the layer's residual form and ReLU, or the BN output alone (`y_bn`), rounded once.
/// Both compute in FP32 in the same op order without contraction: bit for bit. The running
/// statistics keep their bits.
#[test]
fn the_unfused_routes_eval_bn_matches_its_formula_bit_for_bit() {
    let Some(ctx) =
        common::gpu_or_skip("the_unfused_routes_eval_bn_matches_its_formula_bit_for_bit")
    else {
        return;
    };
    let stream = ctx.default_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let target = handle.target().unwrap();
    let cache = PlanCache::new();
    let mut seed = 23u64;
    let mut cases = 0;
    // 64 channels (16-byte accesses). cuDNN's NormForward has no engine where the channels
    // are not a multiple of 8, so no unfused layer evaluates element by element; that path of
    // `elementwise` is the other kernels' (their 20-channel layers above).
    for k in [64] {
        let shape = ConvShape::square(2, 16, 8, k, 3, 1, 1);
        // (The dual scale-bias form has no unfused route: its training-mode NormForward with
        // the dual residual has no engine, so no layer evaluates it this way.)
        let forms = [None, Some(ApplyResidual::None), Some(ApplyResidual::Add)];
        for apply in forms {
            let config = match apply {
                Some(a) => CbrConfig::first(shape).with_apply(a),
                None => CbrConfig::first(shape),
            };
            let layer = CbrLayer::plan_route(config, &target, &cache, RouteKind::Unfused)
                .unwrap_or_else(|e| panic!("{k} channels, {apply:?}: {e}"));
            let mut h = HostBuffers::zeros(layer.buffers());
            let ku = k as usize;
            let y_elems = (shape.n * shape.p() * shape.q() * shape.k) as usize;
            let x_elems = (shape.n * shape.c * shape.h * shape.w) as usize;
            h.set("x", half(random(x_elems, &mut seed, 1.0, 0.0)));
            h.set("w", half(random(16 * 9 * ku, &mut seed, 0.25, 0.0)));
            h.set("gamma", HostBuffer::F32(random(ku, &mut seed, 0.2, 1.0)));
            h.set("beta", HostBuffer::F32(random(ku, &mut seed, 0.2, 0.0)));
            h.set(
                "running_mean",
                HostBuffer::F32(random(ku, &mut seed, 0.5, 0.0)),
            );
            h.set(
                "running_var",
                HostBuffer::F32(random(ku, &mut seed, 0.5, 1.0)),
            );
            if apply.is_some_and(|a| a != ApplyResidual::None) {
                h.set("residual", half(random(y_elems, &mut seed, 1.0, 0.0)));
            }
            if apply == Some(ApplyResidual::DualScaleBias) {
                h.set("residual_scale", half(random(ku, &mut seed, 0.2, 1.0)));
                h.set("residual_bias", half(random(ku, &mut seed, 0.2, 0.0)));
            }
            let mut d = OwnedDeviceBuffers::alloc(layer.buffers(), &stream).unwrap();
            for (name, buf) in h.iter() {
                d.upload(name, buf, &stream).unwrap();
            }
            layer
                .run_gpu(Pass::Eval, &handle, &mut d.io(None).unwrap())
                .unwrap();
            stream.synchronize().unwrap();
            let mut g = HostBuffers::zeros(layer.buffers());
            for spec in layer.buffers() {
                g.set(spec.name, d.download(spec, &stream).unwrap());
            }
            for stat in ["running_mean", "running_var"] {
                assert_eq!(f32s(&g, stat), f32s(&h, stat), "{stat} was written");
            }
            let bn = r::BnParams {
                epsilon: config.epsilon,
                momentum: config.momentum,
            };
            let (gamma, beta) = (f32s(&h, "gamma"), f32s(&h, "beta"));
            let coef: r::BnFinalized<f16> = r::bn_eval_finalize(
                gamma,
                beta,
                f32s(&h, "running_mean"),
                f32s(&h, "running_var"),
                &bn,
            )
            .unwrap();
            let y = f16s(&g, "y");
            let want: Vec<f16> = (0..y_elems)
                .map(|i| {
                    let c = i % ku;
                    let v = (y[i].to_f32() - coef.saved_mean[c]) * coef.saved_inv_std[c] * gamma[c]
                        + beta[c];
                    let v = match apply {
                        None => return f16::from_f32(v),
                        Some(ApplyResidual::None) => v,
                        Some(ApplyResidual::Add) => v + f16s(&h, "residual")[i].to_f32(),
                        Some(ApplyResidual::DualScaleBias) => {
                            v + (f16s(&h, "residual")[i].to_f32()
                                * f16s(&h, "residual_scale")[c].to_f32()
                                + f16s(&h, "residual_bias")[c].to_f32())
                        }
                    };
                    f16::from_f32(if v > 0.0 { v } else { 0.0 })
                })
                .collect();
            let out = if apply.is_some() { "a" } else { "y_bn" };
            let (differ, worst) = compare(f16s(&g, out), &want);
            println!("cbr_bn_eval {k} channels, {apply:?} → {out}: {differ} elements differ (worst {worst} ulp)");
            assert_eq!(bits(f16s(&g, out)), bits(&want), "{k} channels, {apply:?}");
            assert!(want.iter().any(|v| v.to_f32() != 0.0));
            cases += 1;
        }
    }
    assert_eq!(cases, 3);
}
