//! The CPU reference executor of the training loop: the network's CBR layers on the reference
//! ops, the head on the [`cudnn_cbr::amp::range`] twins of the CUDA head kernels, the amp step on
//! [`CpuRegions`].

use super::{
    data, plan_and_initial_weights, summarize, ExecutorInfo, MasterWeights, Net, Progress,
    StepTrace, TrainConfig, TrainError, TrainReport, HELD_OUT_BATCHES,
};
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::range::{self, softmax_xent_backward, HeadMetrics};
use cudnn_cbr::amp::step::{AmpStep, CpuRegions, StepConfig};
use cudnn_cbr::amp::AmpError;
use half::f16;
use std::time::Instant;

/// The CPU executor, set up and ready to run.
#[derive(Debug)]
pub(crate) struct CpuTrainer {
    cfg: TrainConfig,
    data: data::Synthetic,
    net: Net,
    step: AmpStep<CpuRegions>,
}

impl CpuTrainer {
    pub(crate) fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        cfg.check_host_memory(true)?;
        let data = data::Synthetic::new(cfg.hw, cfg.channels, cfg.classes, cfg.seed);
        let net = Net::new(cfg)?;
        let (plan, init) = plan_and_initial_weights(cfg)?;
        let mut regions = CpuRegions::new(plan)?;
        for (name, values) in init {
            regions
                .param_f32_mut(&name, Region::W)?
                .copy_from_slice(&values);
        }
        // (Running variances start at 1, as in every framework: `CpuNet::new`.)
        let mut step = AmpStep::new(regions, StepConfig::new(cfg.sgd()))?;
        step.init_weights()?;
        Ok(CpuTrainer {
            cfg: *cfg,
            data,
            net,
            step,
        })
    }

    pub(crate) fn run(
        mut self,
        every: usize,
        mut progress: impl FnMut(&Progress),
        executor: ExecutorInfo,
    ) -> Result<TrainReport, TrainError> {
        let cfg = self.cfg;
        let start = Instant::now();
        let mut metrics = Vec::with_capacity(cfg.steps);
        let (mut window_loss, mut window_acc, mut window_n) = (0f32, 0f32, 0usize);
        let (mut trace, mut skipped_before) = (Vec::new(), 0u32);
        for i in 0..cfg.steps {
            let (images, labels) = self.data.batch(cfg.batch, i as u64, 0);
            self.step.begin()?;
            let m = train_step(&mut self.net, &mut self.step, &cfg, &images, &labels)?;
            let poison = cfg.drill.and_then(|d| d.poisons(i));
            if let Some(h) = poison {
                poison_gradient(self.step.executor_mut(), h)?;
            }
            self.step.finish()?;
            if cfg.drill.is_some() {
                let s = self.step.executor().scalars();
                trace.push(StepTrace {
                    poisoned: poison.is_some(),
                    skipped: s.skipped > skipped_before,
                    loss_scale: s.loss_scale,
                    state_hash: state_hash(self.step.executor())?,
                });
                skipped_before = s.skipped;
            }
            metrics.push(m);
            window_loss += m.loss;
            window_acc += m.accuracy;
            window_n += 1;
            if (i + 1) % every.max(1) == 0 || i + 1 == cfg.steps {
                self.step.request_scalars()?;
                let s = self.step.poll_scalars()?.unwrap_or_default();
                progress(&Progress {
                    step: i + 1,
                    loss: window_loss / window_n as f32,
                    accuracy: window_acc / window_n as f32,
                    loss_scale: s.loss_scale,
                    skipped: s.skipped,
                    images_per_sec: ((i + 1) * cfg.batch) as f64 / start.elapsed().as_secs_f64(),
                });
                (window_loss, window_acc, window_n) = (0.0, 0.0, 0);
            }
        }
        let images_per_sec = (cfg.steps * cfg.batch) as f64 / start.elapsed().as_secs_f64();
        // Held-out batches, forward only (the weights are not touched: loaded once).
        load_weights(&mut self.net, &self.step)?;
        let mut correct = 0usize;
        for i in 0..HELD_OUT_BATCHES {
            let (images, labels) = self.data.batch(cfg.batch, i, 1);
            let logits = logits(&mut self.net, &self.step, &images)?;
            let m =
                range::head_metrics(&logits, &labels, None, cfg.classes).map_err(AmpError::from)?;
            // accuracy = correct / batch exactly (batch < 2^24), so this recovers the count.
            correct += (m.accuracy * cfg.batch as f32).round() as usize;
        }
        self.step.request_scalars()?;
        let s = self.step.poll_scalars()?.unwrap_or_default();
        let (first_loss, last_loss, last_accuracy, step_losses) = summarize(&metrics);
        let regions = self.step.executor();
        let weights = MasterWeights::read(regions.plan_arc(), |p| {
            regions.param_f32(p.name(), Region::W).map(<[f32]>::to_vec)
        })?;
        Ok(TrainReport {
            first_loss,
            last_loss,
            last_accuracy,
            held_out_accuracy: correct as f32 / (HELD_OUT_BATCHES as usize * cfg.batch) as f32,
            skipped: s.skipped,
            loss_scale: s.loss_scale,
            images_per_sec,
            step_losses,
            weights,
            executor,
            trace,
        })
    }
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
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for region in [Region::W, Region::M, Region::E] {
        if !regions.plan_arc().has_region(region) {
            continue;
        }
        for byte in regions.region_bytes(region)? {
            h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    Ok(h)
}

/// The conv layers' names.
fn layer_names(net: &Net) -> Vec<String> {
    net.compiled()
        .layers
        .iter()
        .map(|l| l.name.clone())
        .collect()
}

/// Conv weights from A (FP16), BN parameters from W (FP32) into the layers' buffers.
fn load_weights(net: &mut Net, step: &AmpStep<CpuRegions>) -> Result<(), TrainError> {
    let regions = step.executor();
    for name in layer_names(net) {
        let key = format!("{name}.w");
        let w = regions.param_f16(&key, Region::A)?.to_vec();
        net.buffers().set_half(&key, w)?;
        for p in ["gamma", "beta"] {
            let key = format!("{name}.{p}");
            let v = regions.param_f32(&key, Region::W)?.to_vec();
            net.buffers().set_float(&key, v)?;
        }
    }
    Ok(())
}

/// Forward through the net and the FC layer (FP32 weights from W): FP16 logits
/// `[N, classes]`.
fn logits(
    net: &mut Net,
    step: &AmpStep<CpuRegions>,
    images: &[f16],
) -> Result<Vec<f16>, TrainError> {
    let pooled = net.forward(images)?;
    let shape = net.head_shape();
    let mut logits = vec![f16::ZERO; shape.logits_elems()];
    range::fc_forward(
        &shape,
        &pooled,
        step.executor().param_f32("fc.w", Region::W)?,
        step.executor().param_f32("fc.b", Region::W)?,
        &mut logits,
    )
    .map_err(AmpError::from)?;
    Ok(logits)
}

/// One forward + backward; gradients land in G16 (conv) and G (BN, FC). Returns the step's
/// loss and accuracy.
fn train_step(
    net: &mut Net,
    step: &mut AmpStep<CpuRegions>,
    cfg: &TrainConfig,
    images: &[f16],
    labels: &[i32],
) -> Result<HeadMetrics, TrainError> {
    load_weights(net, step)?;
    let logits = logits(net, step, images)?;
    // The scaled loss gradient: scale / batch · (softmax − onehot), FP16.
    let scalars = step.executor().scalars();
    let mut dlogits = vec![f16::ZERO; logits.len()];
    let mut loss_rows = vec![0f32; labels.len()];
    softmax_xent_backward(
        &logits,
        labels,
        cfg.classes,
        &scalars,
        &mut dlogits,
        Some(&mut loss_rows),
    )
    .map_err(AmpError::from)?;
    let metrics = range::head_metrics(&logits, labels, Some(&loss_rows), cfg.classes)
        .map_err(AmpError::from)?;
    // FC backward in FP32: dW = dlogitsᵀ·x, db = Σ dlogits, dx = dlogits·W.
    let shape = net.head_shape();
    let pooled = net.pooled();
    let mut dw = vec![0f32; shape.weight_elems()];
    let mut db = vec![0f32; cfg.classes];
    let mut dpooled = vec![0f32; pooled.len()];
    range::fc_backward(
        &shape,
        &dlogits,
        pooled,
        step.executor().param_f32("fc.w", Region::W)?,
        &mut dw,
        &mut db,
        &mut dpooled,
    )
    .map_err(AmpError::from)?;
    let regions = step.executor_mut();
    regions
        .param_f32_mut("fc.w", Region::G)?
        .copy_from_slice(&dw);
    regions
        .param_f32_mut("fc.b", Region::G)?
        .copy_from_slice(&db);
    net.backward(&dpooled)?;
    for name in layer_names(net) {
        let dw = net.buffers().half(&format!("{name}.dw"))?;
        regions
            .param_f16_mut(&format!("{name}.w"), Region::G16)?
            .copy_from_slice(dw);
        for p in ["gamma", "beta"] {
            let g = net.buffers().float(&format!("{name}.d{p}"))?;
            regions
                .param_f32_mut(&format!("{name}.{p}"), Region::G)?
                .copy_from_slice(g);
        }
    }
    Ok(metrics)
}
