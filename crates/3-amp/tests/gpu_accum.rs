//! Tier 4 (GPU): gradient accumulation (`amp_accum_grads`) on CUDA against the CPU executor,
//! bit for bit: its twin over nasty values, and whole accumulated steps (3 micro-batches, an
//! overflow in one of them) eager and replayed from captured graphs. SKIPs without a device
//! (`common::device`).

use std::sync::Arc;

use cudnn_cbr_amp::cuda::CudaRegions;
use cudnn_cbr_amp::plan::{MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{f32_to_f16, SgdConfig};
use cudnn_cbr_amp::step::{AmpExecutor, AmpStep, CpuRegions, StepConfig};
use half::f16;

mod common;
use common::{device, Rng};

/// Two buckets (G16 has a hole where bn1 sits), with momentum, EMA and GA.
fn plan() -> MemoryPlan {
    let mut b = MemoryPlanBuilder::new().with_ema(true);
    let first = b.bucket("first").unwrap();
    let deep = b.bucket("deep").unwrap();
    b.add("conv1.w", ParamKind::ConvWeight, &[32, 3, 3, 3], first)
        .unwrap();
    b.add("bn1.gamma", ParamKind::BnGamma, &[32], first)
        .unwrap();
    b.add("bn1.beta", ParamKind::BnBeta, &[32], first).unwrap();
    b.add("conv2.w", ParamKind::ConvWeight, &[64, 3, 3, 32], deep)
        .unwrap();
    b.add("bn2.gamma", ParamKind::BnGamma, &[64], deep).unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 64], deep).unwrap();
    b.add("fc.b", ParamKind::FcBias, &[10], deep).unwrap();
    b.finalize().unwrap().with_grad_accumulator().unwrap()
}

const MICRO: u32 = 3;

fn config() -> StepConfig {
    StepConfig::new(
        SgdConfig::new(0.05)
            .with_momentum(0.9)
            .with_weight_decay(1e-3),
    )
    .with_ema(0.99)
    .with_clip_norm(10.0)
    .with_accum(MICRO)
}

/// One micro-batch's gradients at `scale` (conv FP16, the rest FP32), the same on both
/// executors; `poison` puts +Inf into conv2's.
struct Grads {
    conv: Vec<(String, Vec<f16>)>,
    direct: Vec<(String, Vec<f32>)>,
}

fn grads(plan: &MemoryPlan, rng: &mut Rng, scale: f32, poison: bool) -> Grads {
    let mut out = Grads {
        conv: Vec::new(),
        direct: Vec::new(),
    };
    for p in plan.params() {
        if p.kind() == ParamKind::ConvWeight {
            let mut v: Vec<f16> = (0..p.elems())
                .map(|_| f32_to_f16(scale * rng.unit()))
                .collect();
            if poison && p.name() == "conv2.w" {
                v[5] = f16::INFINITY;
            }
            out.conv.push((p.name().to_owned(), v));
        } else {
            let v = (0..p.elems()).map(|_| scale * rng.unit()).collect();
            out.direct.push((p.name().to_owned(), v));
        }
    }
    out
}

fn all_bytes_cpu(ex: &CpuRegions) -> Vec<(Region, Vec<u8>)> {
    Region::ALL
        .into_iter()
        .filter(|&r| ex.plan().has_region(r))
        .map(|r| (r, ex.region_bytes(r).unwrap()))
        .collect()
}

fn all_bytes_cuda(ex: &CudaRegions) -> Vec<(Region, Vec<u8>)> {
    Region::ALL
        .into_iter()
        .filter(|&r| ex.plan().has_region(r))
        .map(|r| (r, ex.download_region_bytes(r).unwrap()))
        .collect()
}

fn assert_same(a: &[(Region, Vec<u8>)], b: &[(Region, Vec<u8>)], what: &str) {
    assert_eq!(a.len(), b.len());
    for ((r, x), (_, y)) in a.iter().zip(b) {
        let first = x.iter().zip(y).position(|(p, q)| p != q);
        assert!(
            first.is_none(),
            "{what}: region {r} differs at byte {first:?}"
        );
    }
}

/// 6 accumulated steps of 3 micro-batches on the CPU, on CUDA eagerly, and on CUDA from
/// captured begin / accumulate / finish graphs; step 2's second micro-batch overflows. Every
/// region (GA and S included) equal after each step, bit for bit.
#[test]
fn gpu_an_accumulated_step_equals_the_cpu_step_bit_for_bit() {
    let Some((stream, _k)) = device("gpu_an_accumulated_step_equals_the_cpu_step_bit_for_bit")
    else {
        return;
    };
    let plan = Arc::new(plan());
    let mut rng = Rng(21);
    let w0: Vec<(String, Vec<f32>)> = plan
        .params()
        .iter()
        .map(|p| (p.name().to_owned(), rng.f32s(p.elems(), 0.5)))
        .collect();
    let mut cpu = CpuRegions::new(plan.clone()).unwrap();
    let ctx = stream.context().clone();
    let mut eager = CudaRegions::new(plan.clone(), stream).unwrap();
    let mut graphed = CudaRegions::new(plan.clone(), ctx.new_stream().unwrap()).unwrap();
    for (name, v) in &w0 {
        cpu.param_f32_mut(name, Region::W)
            .unwrap()
            .copy_from_slice(v);
        eager.upload_f32(Region::W, name, v).unwrap();
        graphed.upload_f32(Region::W, name, v).unwrap();
    }
    let mut cpu = AmpStep::new(cpu, config()).unwrap();
    let mut eager = AmpStep::new(eager, config()).unwrap();
    let mut graphed = AmpStep::new(graphed, config()).unwrap();
    cpu.init_weights().unwrap();
    eager.init_weights().unwrap();
    graphed.init_weights().unwrap();
    let begin = graphed.capture_begin().unwrap();
    let accumulate = graphed.capture_accumulate().unwrap();
    let finish = graphed.capture_finish().unwrap();
    for t in 0..6 {
        let scale = cpu.executor().scalars().loss_scale;
        for k in 0..MICRO {
            let g = grads(&plan, &mut rng, scale, t == 2 && k == 1);
            let last = k + 1 == MICRO;
            cpu.begin().unwrap();
            for (name, v) in &g.conv {
                let ex = cpu.executor_mut();
                ex.param_f16_mut(name, Region::G16)
                    .unwrap()
                    .copy_from_slice(v);
            }
            for (name, v) in &g.direct {
                let ex = cpu.executor_mut();
                ex.param_f32_mut(name, Region::G)
                    .unwrap()
                    .copy_from_slice(v);
            }
            eager.begin().unwrap();
            graphed.replay(&begin).unwrap();
            for ex in [eager.executor_mut(), graphed.executor_mut()] {
                for (name, v) in &g.conv {
                    ex.upload_f16(Region::G16, name, v).unwrap();
                }
                for (name, v) in &g.direct {
                    ex.upload_f32(Region::G, name, v).unwrap();
                }
            }
            if last {
                cpu.finish().unwrap();
                eager.finish().unwrap();
                graphed.replay(&finish).unwrap();
            } else {
                cpu.accumulate().unwrap();
                eager.accumulate().unwrap();
                graphed.replay(&accumulate).unwrap();
            }
            let want = all_bytes_cpu(cpu.executor());
            let what = format!("step {t} micro-batch {k}");
            assert_same(&all_bytes_cuda(eager.executor()), &want, &what);
            assert_same(&all_bytes_cuda(graphed.executor()), &want, &what);
        }
    }
    let s = eager.executor().read_scalars_blocking().unwrap();
    assert_eq!((s.step, s.skipped, s.accum), (5, 1, MICRO));
}
