//! GPU tier of gradient accumulation through the classifier: `CudaClassifier::train_step`
//! follows `CpuClassifier::train_step`, and the engine's captured micro-batch and step graphs
//! replay its eager steps bit for bit. SKIPs without a device; `tests/sim_gpu_fusion.rs` runs
//! it on the simulated device.

mod common;

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::{
    amp::range::SgdConfig, amp::step::StepConfig, classifier::CpuClassifier, net::compile,
    net::CompiledNet, net::Preset, net::RoutePolicy,
};
use half::f16;

const BATCH: usize = 4;
const HW: usize = 8;
const CLASSES: usize = 3;

fn net(kind: RouteKind) -> CompiledNet {
    let spec = Preset::Mini.spec(3, CLASSES, 4);
    compile(&spec, BATCH, HW, &RoutePolicy::Uniform(kind)).unwrap()
}

fn micro_batch(k: usize) -> (Vec<f16>, Vec<i32>) {
    common::micro_batch(k, BATCH, HW, CLASSES)
}

/// `CudaClassifier::train_step` over 2 micro-batches follows `CpuClassifier::train_step`,
/// step by step, and leaves the accumulator clear after each step.
#[test]
fn gpu_the_cuda_classifier_accumulates_as_the_cpu_one() {
    const TEST: &str = "gpu_the_cuda_classifier_accumulates_as_the_cpu_one";
    let Some(ctx) = common::gpu_or_skip(TEST) else {
        return;
    };
    use cudnn_cbr::{classifier::CudaClassifier, fusion::exec::Handle};
    let stream = ctx.per_thread_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let on_gpu = common::planned_mini(&handle, BATCH, HW, CLASSES);
    let config = StepConfig::new(SgdConfig::new(0.05).with_momentum(0.9)).with_accum(2);
    let mut gpu = CudaClassifier::new(on_gpu, handle, CLASSES, config, 3).unwrap();
    let mut cpu = CpuClassifier::new(net(RouteKind::Fused), CLASSES, config, 3).unwrap();
    let mut x0 = stream.alloc_zeros::<f16>(BATCH * HW * HW * 3).unwrap();
    let mut x1 = stream.alloc_zeros::<f16>(BATCH * HW * HW * 3).unwrap();
    for step in 0..3 {
        let (a, b) = (micro_batch(2 * step), micro_batch(2 * step + 1));
        stream.memcpy_htod(&a.0, &mut x0).unwrap();
        stream.memcpy_htod(&b.0, &mut x1).unwrap();
        gpu.train_step(&mut [(&mut x0, a.1.as_slice()), (&mut x1, b.1.as_slice())])
            .unwrap();
        let want = cpu
            .train_step(&mut [
                (a.0.as_slice(), a.1.as_slice()),
                (b.0.as_slice(), b.1.as_slice()),
            ])
            .unwrap();
        // The metrics buffer holds the last micro-batch's. FP16 storage on both sides and
        // different summation orders (cuDNN's kernels vs the reference ops): about 1e-3
        // relative per step, as tests/classifier.rs; 2e-2 leaves room for three steps.
        let got = gpu.metrics_blocking().unwrap();
        let rel = (got.loss - want[1].loss).abs() / want[1].loss.abs().max(1e-3);
        assert!(
            rel < 2e-2,
            "step {step}: GPU {} vs CPU {}",
            got.loss,
            want[1].loss
        );
    }
    let s = gpu.step().executor().read_scalars_blocking().unwrap();
    assert_eq!((s.step, s.accum), (3, 2));
    let ga = gpu
        .step()
        .executor()
        .download_region_bytes(Region::GA)
        .unwrap();
    assert!(ga.iter().all(|&b| b == 0), "GA is clear after each step");
}

/// The GPU engine through the library's API alone: after the warm-up, a step of 2
/// micro-batches captured (the micro-batch graph and the whole-step graph) and replayed from
/// the engine's fixed buffers leaves the same bits as eager steps on the same batches (every
/// region, the running statistics and the device-side metrics log), and the asynchronous
/// readback returns that log.
#[test]
fn gpu_the_engines_replayed_steps_equal_its_eager_steps() {
    const TEST: &str = "gpu_the_engines_replayed_steps_equal_its_eager_steps";
    if common::gpu_or_skip(TEST).is_none() {
        return;
    }
    use cudnn_cbr::classifier::{open_device, CudaGraphMode, GraphState, WARMUP_STEPS};
    use cudnn_cbr::classifier::{CudaClassifier, EngineConfig};
    // The per-thread stream of a context object of its own: capture is sound on it.
    let handle = open_device(None).unwrap();
    let net = common::planned_mini(&handle, BATCH, HW, CLASSES);
    let config = StepConfig::new(SgdConfig::new(0.05).with_momentum(0.9)).with_accum(2);
    let steps = WARMUP_STEPS + 2;
    let engine = EngineConfig {
        log_entries: 2 * steps,
        ..EngineConfig::default()
    };
    let mut model = CudaClassifier::with_engine(net, handle, CLASSES, config, 3, engine).unwrap();
    let run = |model: &mut CudaClassifier, step: usize, eager: bool| {
        for k in 0..2 {
            let (images, labels) = micro_batch(2 * step + k);
            model.upload_batch(&images, &labels).unwrap();
            match (eager, k) {
                (false, _) => model.run_micro_step(k == 1).unwrap(),
                (true, 0) => {
                    model.run_forward_backward().unwrap();
                    model.run_accumulate(false).unwrap();
                }
                (true, _) => model.run_step_eager().unwrap(),
            }
        }
    };
    for step in 0..WARMUP_STEPS {
        run(&mut model, step, false);
    }
    let warm = model.snapshot().unwrap();
    for step in WARMUP_STEPS..steps {
        run(&mut model, step, true);
    }
    let eager = model.snapshot().unwrap();
    model.restore(&warm).unwrap();
    model.capture(CudaGraphMode::Step).unwrap();
    assert_eq!(*model.graph_state(), GraphState::Step);
    for step in WARMUP_STEPS..steps {
        run(&mut model, step, false);
    }
    let replayed = model.snapshot().unwrap();
    assert!(eager == replayed, "{:?}", replayed.max_abs_diff(&eager));
    let (log, _) = model.wait_readback().unwrap();
    assert_eq!(log.count as usize, 2 * steps);
    assert!(log.entries.iter().all(|m| m.loss.is_finite()));
}
