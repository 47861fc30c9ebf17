//! The CPU reference executor of the training loop: the network's CBR layers on the reference
//! ops, the head on the [`cudnn_cbr::amp::range`] twins of the CUDA head kernels, the amp step on
//! [`CpuRegions`].

use super::{
    checkpoint, data, mean_metrics, net::compile_net, net::cpu_policy, summarize, ExecutorInfo,
    FaultDrill, MasterWeights, Progress, Session, StepTrace, TrainConfig, TrainError, TrainReport,
    Window, HELD_OUT_BATCHES,
};
use crate::checkpoint::TrainState;
use crate::curves::CurvePoint;
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::step::{AmpStep, CpuRegions};
use cudnn_cbr::classifier::{CpuClassifier, EvalWeights};
use cudnn_cbr::netops::head::HeadMetrics;
use half::f16;
use std::time::Instant;

/// The CPU executor, set up and ready to run.
#[derive(Debug)]
pub(crate) struct CpuTrainer {
    cfg: TrainConfig,
    data: std::sync::Arc<dyn data::Dataset>,
    /// The network, its head and the amp step (the library's classifier).
    model: CpuClassifier,
}

impl CpuTrainer {
    pub(crate) fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        cfg.check_host_memory(true)?;
        let data = data::open(cfg)?;
        // (The same initial weights as the CUDA executor's: `net::initial_weights` of the seed;
        // running variances start at 1, as in every framework: `CpuNet::new`.)
        let net = compile_net(cfg, &cpu_policy(cfg))?;
        let model =
            CpuClassifier::with_arena(net, cfg.classes, cfg.step_config(), cfg.seed, cfg.arena)?;
        Ok(CpuTrainer {
            cfg: *cfg,
            data,
            model,
        })
    }

    /// Restores a checkpoint's state ([`TrainState::load_into`]).
    pub(crate) fn load_state(&mut self, state: &TrainState) -> Result<(), TrainError> {
        state.load_into(&mut self.model)
    }

    pub(crate) fn run(
        mut self,
        every: usize,
        mut progress: impl FnMut(&Progress),
        executor: ExecutorInfo,
        session: &Session,
    ) -> Result<TrainReport, TrainError> {
        let cfg = self.cfg;
        let first = session.start;
        let start = Instant::now();
        let mut metrics = Vec::with_capacity(cfg.steps - first);
        let mut curve = Vec::with_capacity(cfg.steps - first);
        let mut window = Window::default();
        let (mut trace, mut skipped_before) = (Vec::new(), 0u32);
        // Step i trains on batches i·accum .. (i + 1)·accum (its micro-batches).
        let accum = cfg.accum.max(1);
        let images_per_step = cfg.batch * accum;
        let ends = self
            .data
            .train_len()
            .map(|n| data::epoch_ends(n, images_per_step, cfg.steps))
            .unwrap_or_default();
        let mut epochs = Vec::new();
        // Batches are made (and, for files, augmented) on a thread of their own while the
        // step runs; each is a pure function of its index, so the losses do not depend on it.
        let mut batches = data::Prefetch::spawn_range(
            self.data.clone(),
            cfg.batch,
            (first * accum) as u64..(cfg.steps * accum) as u64,
        );
        for i in first..cfg.steps {
            let poison = cfg.drill.and_then(|d| d.poisons(i));
            let model = &mut self.model;
            let batches = &mut batches;
            // The step runs on a worker of rayon's pool, so the reference ops' parallel loops
            // start there (their tasks are pushed to that worker's deque and stolen by the
            // others) instead of each being handed over from this thread, which would sleep
            // until it is done: one hand-over per step instead of one per loop.
            let m = rayon::scope(|_| -> Result<HeadMetrics, TrainError> {
                let mut each = Vec::with_capacity(accum);
                // One micro-batch in memory at a time (the producer keeps a few ahead).
                for k in 0..accum {
                    let (images, labels) = batches.next_batch().ok_or_else(|| {
                        let b = i * accum + k;
                        TrainError::Config(format!("the batch producer stopped before batch {b}"))
                    })?;
                    model.step_mut().begin()?;
                    each.push(model.forward_backward(&images, &labels)?);
                    let step = model.step_mut();
                    if let Some(h) = poison.filter(|&h| FaultDrill::micro_batch(h, accum) == k) {
                        poison_gradient(step.executor_mut(), h)?;
                    }
                    // The first accum − 1 micro-batches add into GA; the last one's finish
                    // adds it, then checks, updates and rescales once (amp::step).
                    if k + 1 < accum {
                        step.accumulate()?;
                    } else {
                        step.finish()?;
                    }
                }
                Ok(mean_metrics(&each))
            })?;
            let step = self.model.step_mut();
            if cfg.drill.is_some() {
                let s = step.executor().scalars();
                trace.push(StepTrace {
                    poisoned: poison.is_some(),
                    skipped: s.skipped > skipped_before,
                    loss_scale: s.loss_scale,
                    state_hash: state_hash(step.executor())?,
                });
                skipped_before = s.skipped;
            }
            metrics.push(m);
            window.add(m);
            let done = i + 1 - first;
            let s = self.model.step().executor().scalars();
            curve.push(CurvePoint {
                step: i + 1,
                loss: m.loss,
                accuracy: m.accuracy,
                loss_scale: s.loss_scale,
                lr: s.lr,
                images_per_sec: (done * images_per_step) as f64 / start.elapsed().as_secs_f64(),
            });
            if (i + 1) % every.max(1) == 0 || i + 1 == cfg.steps {
                let step = self.model.step_mut();
                step.request_scalars()?;
                let s = step.poll_scalars()?.unwrap_or_default();
                progress(&window.report(i + 1, done, images_per_step, start, s));
            }
            if let Some(path) = session.saves_after(i + 1, cfg.steps) {
                checkpoint::save(
                    path,
                    &cfg,
                    &TrainState::of(&self.model)?,
                    (i + 1) as u64,
                    &self.routes(),
                )?;
            }
            if let Some(e) = ends.iter().position(|&s| s == i + 1) {
                epochs.push(self.test_epoch(e + 1, i + 1)?);
            }
        }
        let images_per_sec =
            ((cfg.steps - first) * images_per_step) as f64 / start.elapsed().as_secs_f64();
        // Held-out batches, evaluation mode (running statistics; weights and statistics are
        // not touched), with the trained weights and, with an EMA, the EMA weights.
        let mut correct = [0usize; 2];
        for i in 0..HELD_OUT_BATCHES {
            let (images, labels) = self.data.held_out_batch(cfg.batch, i);
            for (c, w) in correct.iter_mut().zip(eval_weights(&cfg)) {
                let e = self.model.evaluate(&images, w)?;
                *c += e
                    .top1
                    .iter()
                    .zip(&labels)
                    .filter(|(&p, &l)| p as i32 == l)
                    .count();
            }
        }
        let n = (HELD_OUT_BATCHES as usize * cfg.batch) as f32;
        let held_out = [correct[0] as f32 / n, correct[1] as f32 / n];
        let mut r = report(
            self.model.step_mut(),
            &metrics,
            held_out[0],
            images_per_sec,
            executor,
            trace,
        )?;
        r.held_out_ema_accuracy = cfg.ema.map(|_| held_out[1]);
        r.start_step = first;
        r.curve = curve;
        r.epochs = epochs;
        Ok(r)
    }

    /// The whole test set in evaluation mode, with the trained and (with an EMA) the EMA
    /// weights, after epoch `epoch` ended at step `step`.
    fn test_epoch(&mut self, epoch: usize, step: usize) -> Result<crate::EpochEval, TrainError> {
        let cfg = self.cfg;
        let len = self.data.held_out_len().unwrap_or(0);
        let batches = data::test_batches(len, cfg.batch);
        let mut correct = [0usize; 2];
        for i in 0..batches {
            let (images, labels) = self.data.held_out_batch(cfg.batch, i);
            for (c, w) in correct.iter_mut().zip(eval_weights(&cfg)) {
                let e = self.model.evaluate(&images, w)?;
                *c += e
                    .top1
                    .iter()
                    .zip(&labels)
                    .filter(|(&p, &l)| p as i32 == l)
                    .count();
            }
        }
        let n = (batches as usize * cfg.batch).max(1) as f32;
        Ok(crate::EpochEval {
            epoch,
            step,
            accuracy: correct[0] as f32 / n,
            ema_accuracy: cfg.ema.map(|_| correct[1] as f32 / n),
        })
    }

    /// The route every layer runs (checkpoint metadata).
    fn routes(&self) -> String {
        format!(
            "cpu reference executor, {} route ops",
            if self.cfg.fused { "fused" } else { "unfused" }
        )
    }
}

/// The report of a CPU run from its amp step (scalars, master weights W) and per-step
/// metrics; both CPU executors end with it.
pub(crate) fn report(
    step: &mut AmpStep<CpuRegions>,
    metrics: &[HeadMetrics],
    held_out_accuracy: f32,
    images_per_sec: f64,
    executor: ExecutorInfo,
    trace: Vec<StepTrace>,
) -> Result<TrainReport, TrainError> {
    step.request_scalars()?;
    let s = step.poll_scalars()?.unwrap_or_default();
    let (first_loss, last_loss, last_accuracy, step_losses) = summarize(metrics);
    let regions = step.executor();
    let weights = MasterWeights::read(regions.plan_arc(), |p| {
        regions.param_f32(p.name(), Region::W).map(<[f32]>::to_vec)
    })?;
    Ok(TrainReport {
        first_loss,
        last_loss,
        last_accuracy,
        held_out_accuracy,
        held_out_eval_mode: true,
        held_out_ema_accuracy: None,
        skipped: s.skipped,
        loss_scale: s.loss_scale,
        images_per_sec,
        step_losses,
        weights,
        executor,
        trace,
        start_step: 0,
        curve: Vec::new(),
        epochs: Vec::new(),
    })
}

/// The weights the held-out batches are evaluated with: the trained ones, then the EMA's
/// when the run keeps one.
pub(crate) fn eval_weights(cfg: &TrainConfig) -> impl Iterator<Item = EvalWeights> {
    std::iter::once(EvalWeights::Trained).chain(cfg.ema.map(|_| EvalWeights::Ema))
}

/// Overwrites one gradient element (chosen by `h`) with NaN, +Inf or −Inf: in G16 (the conv
/// weights' FP16 gradients) or G (the FP32 gradients of BN and FC parameters).
fn poison_gradient(regions: &mut CpuRegions, h: u64) -> Result<(), TrainError> {
    let value = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(h % 3) as usize];
    let plan = regions.plan_arc().clone();
    let params = plan.params();
    let p = &params[(h / 3) as usize % params.len()];
    let at = (h >> 32) as usize % p.elems();
    if regions.plan_arc().lives_in(p, Region::G16) {
        regions.param_f16_mut(p.name(), Region::G16)?[at] = f16::from_f32(value);
    } else {
        regions.param_f32_mut(p.name(), Region::G)?[at] = value;
    }
    Ok(())
}

/// FNV-1a over the bytes of W, M and E (those the plan has).
fn state_hash(regions: &CpuRegions) -> Result<u64, TrainError> {
    let mut h = crate::FNV_OFFSET;
    for region in [Region::W, Region::M, Region::E] {
        if !regions.plan_arc().has_region(region) {
            continue;
        }
        for byte in regions.region_bytes(region)? {
            h = (h ^ u64::from(byte)).wrapping_mul(crate::FNV_PRIME);
        }
    }
    Ok(h)
}
