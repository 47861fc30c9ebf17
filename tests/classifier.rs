//! The classifier a trainer links (`cudnn_cbr::classifier`): a learning-rate schedule under
//! replay of captured begin/finish graphs equals the eager step, bad batches are typed errors,
//! evaluation reads the running statistics (and the EMA weights where asked; a list of batches
//! counts each one's top-1), and (GPU tier) the CUDA classifier follows the CPU one.

mod common;

use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::{
    amp::range::SgdConfig, amp::step::StepConfig, classifier::ClassifierError,
    classifier::CpuClassifier, classifier::EvalWeights, net::compile, net::CompiledNet,
    net::Preset, net::RoutePolicy,
};
use half::f16;

const BATCH: usize = 4;
const HW: usize = 8;
const CLASSES: usize = 3;

fn net() -> CompiledNet {
    let spec = Preset::Mini.spec(3, CLASSES, 4);
    compile(&spec, BATCH, HW, &RoutePolicy::Uniform(RouteKind::Fused)).unwrap()
}

fn batch(step: usize) -> (Vec<f16>, Vec<i32>) {
    let mut s = 0x1234 + step as u64;
    let images = (0..BATCH * HW * HW * 3)
        .map(|_| f16::from_f32(common::uniform(&mut s)))
        .collect();
    let labels = (0..BATCH).map(|i| ((i + step) % CLASSES) as i32).collect();
    (images, labels)
}

fn schedule(step: usize) -> f32 {
    0.08 / (1.0 + step as f32)
}

/// Master weights after `steps` steps, the step replayed from graphs or run eagerly, with the
/// learning rate of `lr` set before each finish.
fn train(replay: bool, steps: usize, lr: impl Fn(usize) -> f32) -> Vec<u8> {
    let config = StepConfig::new(SgdConfig::new(lr(0)));
    let mut model = CpuClassifier::new(net(), CLASSES, config, 3).unwrap();
    let graphs = replay.then(|| {
        let s = model.step_mut();
        (s.capture_begin().unwrap(), s.capture_finish().unwrap())
    });
    for i in 0..steps {
        let (images, labels) = batch(i);
        match &graphs {
            Some((begin, _)) => model.step_mut().replay(begin).unwrap(),
            None => model.step_mut().begin().unwrap(),
        }
        model.forward_backward(&images, &labels).unwrap();
        model.step_mut().set_lr(lr(i)).unwrap();
        match &graphs {
            Some((_, finish)) => model.step_mut().replay(finish).unwrap(),
            None => model.step_mut().finish().unwrap(),
        }
    }
    model.step().executor().region_bytes(Region::W).unwrap()
}

#[test]
fn a_schedule_under_replayed_graphs_equals_the_eager_step_bit_for_bit() {
    let replayed = train(true, 6, schedule);
    let eager = train(false, 6, schedule);
    assert_eq!(replayed, eager);
    // The schedule reached the update: a constant rate gives other weights.
    let constant = train(true, 6, |_| schedule(0));
    assert_ne!(replayed, constant);
}

#[test]
fn bad_batches_are_typed_errors_naming_the_problem() {
    let config = StepConfig::new(SgdConfig::new(0.1));
    let mut model = CpuClassifier::new(net(), CLASSES, config, 3).unwrap();
    let (images, labels) = batch(0);
    let cases: [(&[f16], Vec<i32>, &str); 3] = [
        (&images[1..], labels.clone(), "the network reads"),
        (&images, labels[1..].to_vec(), "labels for a batch of"),
        (&images, vec![0, 1, 2, 3], "label 3 is outside 0..3"),
    ];
    for (x, l, needle) in cases {
        match model.forward_backward(x, &l) {
            Err(e @ ClassifierError::Input(_)) => assert!(e.to_string().contains(needle), "{e}"),
            other => panic!("expected an input error naming `{needle}`, got {other:?}"),
        }
    }
    // And the model still trains afterwards.
    model.step_mut().begin().unwrap();
    let m = model.forward_backward(&images, &labels).unwrap();
    assert!(m.loss.is_finite() && m.loss > 0.0);
}

#[test]
fn the_cuda_classifier_follows_the_cpu_one() {
    let Some(ctx) = common::gpu_or_skip("the_cuda_classifier_follows_the_cpu_one") else {
        return;
    };
    use cudnn_cbr::{classifier::CudaClassifier, fusion::exec::Handle};
    let stream = ctx.per_thread_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let on_gpu = common::planned_mini(&handle, BATCH, HW, CLASSES);
    let config = StepConfig::new(SgdConfig::new(0.05));
    let mut gpu = CudaClassifier::new(on_gpu, handle, CLASSES, config, 3).unwrap();
    let mut cpu = CpuClassifier::new(net(), CLASSES, config, 3).unwrap();
    let mut x = stream.alloc_zeros::<f16>(BATCH * HW * HW * 3).unwrap();
    for i in 0..4 {
        let (images, labels) = batch(i);
        stream.memcpy_htod(&images, &mut x).unwrap();
        gpu.step_mut().begin().unwrap();
        gpu.forward_backward(&mut x, &labels).unwrap();
        gpu.step_mut().finish().unwrap();
        cpu.step_mut().begin().unwrap();
        let want = cpu.forward_backward(&images, &labels).unwrap();
        cpu.step_mut().finish().unwrap();
        let got = gpu.metrics_blocking().unwrap();
        // FP16 storage on both sides, different summation orders (cuDNN's kernels vs the
        // reference ops): the loss agrees to about 1e-3 relative per step; 2e-2 leaves room
        // for four steps of drift.
        let rel = (got.loss - want.loss).abs() / want.loss.abs().max(1e-3);
        assert!(
            rel < 2e-2,
            "step {i}: GPU loss {} vs CPU {}",
            got.loss,
            want.loss
        );
    }
}

/// Trains `steps` steps with an EMA of `decay`.
fn trained_with_ema(decay: f32, steps: usize) -> CpuClassifier {
    let config = StepConfig::new(SgdConfig::new(0.05)).with_ema(decay);
    let mut model = CpuClassifier::new(net(), CLASSES, config, 3).unwrap();
    for i in 0..steps {
        let (images, labels) = batch(i);
        model.step_mut().begin().unwrap();
        model.forward_backward(&images, &labels).unwrap();
        model.step_mut().finish().unwrap();
    }
    model
}

#[test]
fn evaluation_reads_the_running_statistics_and_writes_none() {
    let mut model = trained_with_ema(0.5, 3);
    let (images, labels) = batch(7);
    let stats = model.running_stats().unwrap();
    let weights = model.step().executor().region_bytes(Region::W).unwrap();
    let e = model.evaluate(&images, EvalWeights::Trained).unwrap();
    let again = model.evaluate(&images, EvalWeights::Trained).unwrap();
    // Nothing statistical is written: the running statistics (and the weights) are bit for
    // bit what they were, and a second evaluation is the first.
    assert_eq!(model.running_stats().unwrap(), stats);
    assert_eq!(
        model.step().executor().region_bytes(Region::W).unwrap(),
        weights
    );
    assert_eq!(e, again);
    assert_eq!(e.logits.len(), BATCH * CLASSES);
    assert_eq!(e.top1.len(), BATCH);
    assert!(e.top1.iter().all(|&c| c < CLASSES));
    let acc = e.accuracy(&labels);
    assert!((0.0..=1.0).contains(&acc));
    // Training-mode BN (batch statistics) is another function of the batch: the logits
    // differ, and that forward updates the running statistics.
    let train_mode = model.logits(&images).unwrap();
    assert_ne!(train_mode, e.logits);
    assert_ne!(model.running_stats().unwrap(), stats);
    // Evaluation follows the running statistics: after the training-mode forward moved
    // them, the same images evaluate to other logits.
    let moved = model.evaluate(&images, EvalWeights::Trained).unwrap();
    assert_ne!(moved.logits, e.logits);
}

#[test]
fn ema_weights_are_evaluated_from_the_ema_regions() {
    // Decay 0: e = w after every applied step, so E16 = f16(E) = f16(W) = A and the EMA
    // weights evaluate bit for bit as the trained ones.
    let mut zero = trained_with_ema(0.0, 3);
    let (images, _) = batch(9);
    let t = zero.evaluate(&images, EvalWeights::Trained).unwrap();
    let e = zero.evaluate(&images, EvalWeights::Ema).unwrap();
    assert_eq!(t, e);
    // Decay 0.99: the EMA has barely left the initial weights after 3 steps, so its logits
    // are not the trained weights' ones.
    let mut slow = trained_with_ema(0.99, 3);
    let t = slow.evaluate(&images, EvalWeights::Trained).unwrap();
    let e = slow.evaluate(&images, EvalWeights::Ema).unwrap();
    assert_ne!(t.logits, e.logits);
    // Without an EMA in the step, asking for its weights is a typed error.
    let config = StepConfig::new(SgdConfig::new(0.05));
    let mut plain = CpuClassifier::new(net(), CLASSES, config, 3).unwrap();
    let err = plain.evaluate(&images, EvalWeights::Ema).unwrap_err();
    assert!(
        matches!(&err, ClassifierError::Input(m) if m.contains("EMA")),
        "{err}"
    );
    // A batch of the wrong size too.
    let err = plain
        .evaluate(&images[1..], EvalWeights::Trained)
        .unwrap_err();
    assert!(matches!(err, ClassifierError::Input(_)), "{err}");
}

#[test]
fn evaluating_a_list_of_batches_counts_each_batch_s_top1() {
    // The accuracies over several batches are the correct top-1 counts of `evaluate` over all
    // their images, per weights; the EMA's only where the step keeps one.
    let mut model = trained_with_ema(0.9, 3);
    let batches: Vec<_> = (10..13).map(batch).collect();
    let count = |model: &mut CpuClassifier, w: EvalWeights| -> usize {
        batches
            .iter()
            .map(|(images, labels)| {
                let e = model.evaluate(images, w).unwrap();
                e.top1
                    .iter()
                    .zip(labels)
                    .filter(|(&p, &l)| p as i32 == l)
                    .count()
            })
            .sum()
    };
    let n = (batches.len() * BATCH) as f32;
    let (trained, ema) = (
        count(&mut model, EvalWeights::Trained),
        count(&mut model, EvalWeights::Ema),
    );
    let acc = model.evaluate_batches(&batches).unwrap();
    assert_eq!(acc.trained, trained as f32 / n);
    assert_eq!(acc.ema, Some(ema as f32 / n));
    assert!(acc.eval_mode);
    let config = StepConfig::new(SgdConfig::new(0.05));
    let mut plain = CpuClassifier::new(net(), CLASSES, config, 3).unwrap();
    let acc = plain.evaluate_batches(&batches).unwrap();
    assert_eq!(acc.ema, None);
    // No batches: no images, accuracy 0 rather than NaN.
    assert_eq!(plain.evaluate_batches(&[]).unwrap().trained, 0.0);
}
