//! Tier 4 (GPU): a two-layer CBR chain on the GPU (fused and unfused routes) against the CPU
//! reference executor on identical inputs, every buffer compared. Prints one SKIP line where
//! there is no usable CUDA device or cuDNN.

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::graphs::ApplyResidual;
use cudnn_cbr::fusion::cbr::{
    CbrConfig, CbrLayer, HostBuffer, HostBuffers, OwnedDeviceBuffers, Pass,
};
mod common;

use cudnn_cbr::fusion::exec::Handle;
use half::f16;

fn fill(n: usize, seed: &mut u64, scale: f32, base: f32) -> Vec<f32> {
    (0..n)
        .map(|_| base + common::uniform(seed) * scale)
        .collect()
}

fn inputs(layer: &CbrLayer, seed: u64, first: bool) -> HostBuffers {
    let mut b = HostBuffers::zeros(layer.buffers());
    let mut s = seed;
    let sh = layer.config().shape;
    let half = |v: Vec<f32>| HostBuffer::F16(v.into_iter().map(f16::from_f32).collect());
    if first {
        b.set(
            "x",
            half(fill((sh.n * sh.c * sh.h * sh.w) as usize, &mut s, 1.0, 0.0)),
        );
    }
    b.set(
        "w",
        half(fill(
            (sh.k * sh.c * sh.r * sh.s) as usize,
            &mut s,
            0.25,
            0.0,
        )),
    );
    b.set(
        "gamma",
        HostBuffer::F32(fill(sh.k as usize, &mut s, 0.2, 1.0)),
    );
    b.set(
        "beta",
        HostBuffer::F32(fill(sh.k as usize, &mut s, 0.2, 0.0)),
    );
    b.set("running_var", HostBuffer::F32(vec![1.0; sh.k as usize]));
    b
}

/// Forward + backward passes per side before comparing.
const PASSES: usize = 2;

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn two_layer_chain_matches_the_cpu_reference_on_both_routes() {
    let Some(ctx) = common::gpu_or_skip("two_layer_chain_matches_the_cpu_reference") else {
        return;
    };
    let stream = ctx.default_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let target = handle.target().unwrap();
    let cache = PlanCache::new();
    let shapes = common::gpu_shapes::parity_pairs();
    for (s1, s2) in shapes {
        for fused in [true, false] {
            let c1 = CbrConfig::first(s1);
            let c2 = CbrConfig::new(s2).with_apply(ApplyResidual::None);
            let (l1, l2) = if fused {
                (
                    CbrLayer::plan(c1, &target, &cache).unwrap(),
                    CbrLayer::plan(c2, &target, &cache).unwrap(),
                )
            } else {
                // Force the unfused route through the same plan cache.
                let t = &target;
                let build = |c: CbrConfig| -> CbrLayer {
                    CbrLayer::plan_route(c, t, &cache, false).unwrap()
                };
                (build(c1), build(c2))
            };
            let route = l2.route().name();
            // CPU reference run.
            let (mut h1, mut h2) = (inputs(&l1, 1, true), inputs(&l2, 2, false));
            h2.set(
                "da",
                HostBuffer::F16(
                    fill((s2.n * s2.k * s2.p() * s2.q()) as usize, &mut 3, 1.0, 0.0)
                        .into_iter()
                        .map(f16::from_f32)
                        .collect(),
                ),
            );
            let (g1_in, g2_in) = (h1.clone(), h2.clone());
            // Two training passes on each side: an engine that accumulated into an output
            // (statistics, dγ/dβ) instead of overwriting it would differ on the second.
            for _ in 0..PASSES {
                l1.run_cpu(Pass::Forward, &mut h1, None).unwrap();
                l2.run_cpu(Pass::Forward, &mut h2, Some(&mut h1)).unwrap();
                l2.run_cpu(Pass::Backward, &mut h2, Some(&mut h1)).unwrap();
                l1.run_cpu(Pass::Backward, &mut h1, None).unwrap();
            }
            // GPU run on the same inputs.
            let mut d1 = OwnedDeviceBuffers::alloc(l1.buffers(), &stream).unwrap();
            let mut d2 = OwnedDeviceBuffers::alloc(l2.buffers(), &stream).unwrap();
            for (name, buf) in g1_in.iter() {
                d1.upload(name, buf, &stream).unwrap();
            }
            for (name, buf) in g2_in.iter() {
                d2.upload(name, buf, &stream).unwrap();
            }
            for _ in 0..PASSES {
                // Each pass borrows the buffers it binds (layer 2 also layer 1's, as `prev`).
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
            for (layer, specs, dev, host) in [
                ("l1", l1.buffers(), &d1, &h1),
                ("l2", l2.buffers(), &d2, &h2),
            ] {
                for spec in specs {
                    let gpu = dev.download(spec, &stream).unwrap().to_f32();
                    let cpu = host.get(spec.name).unwrap().to_f32();
                    let err = rel_l2(&gpu, &cpu);
                    println!(
                        "{route} {} {layer}.{:<14} rel L2 {err:.2e}",
                        s2.label(),
                        spec.name
                    );
                    // FP16 stores on both sides with FP32 accumulation in different orders:
                    // forward values agree to a few 2^-11; gradients go through 2–3 more FP16
                    // stores and near-zero ReLU decisions, so 2e-2 (measured values are recorded
                    // in the GPU check's log).
                    let tol = if spec.name.starts_with('d') {
                        2e-2
                    } else {
                        5e-3
                    };
                    assert!(err <= tol, "{route} {layer}.{}: {err:.2e}", spec.name);
                }
            }
        }
    }
}
