//! The main job's training loop: a small ResNet-style CBR network on a synthetic dataset,
//! trained with the amp step (FP32 master weights, FP16 compute weights, fixed loss scaling,
//! SGD with momentum), on the CPU reference executor.
//!
//! `examples/train_cbr.rs` drives it from the command line; tests run it with fewer steps.
//! Every parameter lives in an [`amp`](crate::amp) memory plan: conv weights are read from
//! region A (FP16) and their FP16 wgrads written to G16; BN and FC parameters are read from W
//! and their FP32 gradients written to G. The step then casts, checks, applies SGD (skipping
//! on overflow) and updates the loss scale.

mod data;
mod net;

pub use data::Synthetic;
pub use net::{Net, NetLayer};

use crate::amp::plan::{MemoryPlanBuilder, ParamKind, Region};
use crate::amp::range::{softmax_xent_backward, SgdConfig};
use crate::amp::step::{AmpStep, CpuRegions, StepConfig};
use crate::amp::AmpError;
use cudnn_cbr_fusion::cbr::HostBuffer;
use half::f16;
use std::time::Instant;

/// What to train.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Images per step.
    pub batch: usize,
    /// Base channel width (the second stage has twice as many).
    pub width: usize,
    /// Seed of the dataset and the initial weights.
    pub seed: u64,
    /// Learning rate.
    pub lr: f32,
    /// Image size (height = width).
    pub hw: usize,
    /// Input channels.
    pub channels: usize,
    /// Classes.
    pub classes: usize,
    /// Run the fused route's ops (else the unfused route's).
    pub fused: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 200,
            batch: 32,
            width: 16,
            seed: 1,
            lr: 0.05,
            hw: 16,
            channels: 8,
            classes: 8,
            fused: true,
        }
    }
}

/// One progress report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Steps done.
    pub step: usize,
    /// Mean loss over the steps since the last report.
    pub loss: f32,
    /// Mean batch accuracy over the steps since the last report.
    pub accuracy: f32,
    /// Current loss scale.
    pub loss_scale: f32,
    /// Steps skipped for overflow so far.
    pub skipped: u32,
    /// Throughput since the start.
    pub images_per_sec: f64,
}

/// The outcome of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    /// Mean loss of the first 10 steps.
    pub first_loss: f32,
    /// Mean loss of the last 10 steps.
    pub last_loss: f32,
    /// Mean batch accuracy of the last 10 steps.
    pub last_accuracy: f32,
    /// Accuracy on 8 held-out batches (BN in training mode, batch statistics).
    pub held_out_accuracy: f32,
    /// Steps skipped for overflow.
    pub skipped: u32,
    /// Final loss scale.
    pub loss_scale: f32,
    /// Training throughput.
    pub images_per_sec: f64,
}

/// Errors of the training loop.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The amp layer refused something.
    #[error(transparent)]
    Amp(#[from] AmpError),
    /// The memory plan refused a registration.
    #[error(transparent)]
    Plan(#[from] crate::amp::PlanError),
    /// A CBR layer failed.
    #[error(transparent)]
    Fusion(#[from] cudnn_cbr_fusion::Error),
    /// The configuration cannot work.
    #[error("bad training configuration: {0}")]
    Config(String),
}

/// Trains and reports; `progress` is called every `every` steps.
pub fn train(
    cfg: &TrainConfig,
    every: usize,
    mut progress: impl FnMut(&Progress),
) -> Result<TrainReport, TrainError> {
    if cfg.steps == 0 || cfg.batch < 2 || cfg.width == 0 || cfg.hw < 4 || cfg.hw % 2 != 0 {
        return Err(TrainError::Config(format!(
            "steps ≥ 1, batch ≥ 2, width ≥ 1 and an even image size ≥ 4 are needed, got {cfg:?}"
        )));
    }
    let data = Synthetic::new(cfg.hw, cfg.channels, cfg.classes, cfg.seed);
    let mut net = Net::new(cfg.batch, cfg.hw, cfg.channels, cfg.width, cfg.fused);

    // The memory plan: every parameter in every region it lives in.
    let mut b = MemoryPlanBuilder::new();
    let first = b.bucket("first")?;
    let deep = b.bucket("deep")?;
    let names: Vec<&'static str> = net.layers.iter().map(|l| l.name).collect();
    let mut param = |name: String, kind, shape: &[usize], bucket| b.add(&name, kind, shape, bucket);
    for (i, l) in net.layers.iter().enumerate() {
        let s = l.layer.config().shape;
        let bucket = if i < 3 { first } else { deep };
        let (k, c, r) = (s.k as usize, s.c as usize, s.r as usize);
        param(
            format!("{}.w", l.name),
            ParamKind::ConvWeight,
            &[k, r, r, c],
            bucket,
        )?;
        param(
            format!("{}.gamma", l.name),
            ParamKind::BnGamma,
            &[k],
            bucket,
        )?;
        param(format!("{}.beta", l.name), ParamKind::BnBeta, &[k], bucket)?;
    }
    param(
        "fc.w".into(),
        ParamKind::FcWeight,
        &[cfg.classes, net.features],
        deep,
    )?;
    param("fc.b".into(), ParamKind::FcBias, &[cfg.classes], deep)?;
    let plan = b.finalize()?;

    // Initial master weights in W: He-uniform convs, γ = 1, β = 0, small FC.
    let mut regions = CpuRegions::new(plan);
    let mut rng = cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for (i, name) in names.iter().enumerate() {
        let s = net.layers[i].layer.config().shape;
        let bound = (6.0 / (s.c * s.r * s.s) as f32).sqrt();
        for v in regions.param_f32_mut(&format!("{name}.w"), Region::W)? {
            *v = bound * data::uniform(&mut rng);
        }
        regions
            .param_f32_mut(&format!("{name}.gamma"), Region::W)?
            .fill(1.0);
        // Running variance starts at 1, as in every framework.
        net.layers[i]
            .bufs
            .set("running_var", HostBuffer::F32(vec![1.0; s.k as usize]));
    }
    let fc_bound = 1.0 / (net.features as f32).sqrt();
    for v in regions.param_f32_mut("fc.w", Region::W)? {
        *v = fc_bound * data::uniform(&mut rng);
    }
    let sgd = SgdConfig {
        lr: cfg.lr,
        momentum: 0.9,
        weight_decay: 5e-4,
        nesterov: false,
    };
    let mut step = AmpStep::new(regions, StepConfig::new(sgd))?;
    step.init_weights()?;

    let start = Instant::now();
    let (mut losses, mut accs) = (Vec::new(), Vec::new());
    let (mut window_loss, mut window_acc, mut window_n) = (0f32, 0f32, 0usize);
    for i in 0..cfg.steps {
        let (images, labels) = data.batch(cfg.batch, i as u64, 0);
        step.begin()?;
        let (loss, acc) = train_step(&mut net, &mut step, &names, cfg, &images, &labels)?;
        step.finish()?;
        losses.push(loss);
        accs.push(acc);
        window_loss += loss;
        window_acc += acc;
        window_n += 1;
        if (i + 1) % every.max(1) == 0 || i + 1 == cfg.steps {
            step.request_scalars()?;
            let s = step.poll_scalars()?.unwrap_or_default();
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
    // Held-out batches, forward only (the weights are not touched).
    let mut correct = 0usize;
    let held = 8;
    for i in 0..held {
        let (images, labels) = data.batch(cfg.batch, i, 1);
        load_weights(&mut net, &step, &names)?;
        let logits = logits(&mut net, &step, cfg, &images)?;
        correct += count_correct(&logits, &labels, cfg.classes);
    }
    step.request_scalars()?;
    let s = step.poll_scalars()?.unwrap_or_default();
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len().max(1) as f32;
    let head = &losses[..losses.len().min(10)];
    let tail = &losses[losses.len().saturating_sub(10)..];
    Ok(TrainReport {
        first_loss: mean(head),
        last_loss: mean(tail),
        last_accuracy: mean(&accs[accs.len().saturating_sub(10)..]),
        held_out_accuracy: correct as f32 / (held as usize * cfg.batch) as f32,
        skipped: s.skipped,
        loss_scale: s.loss_scale,
        images_per_sec,
    })
}

/// Conv weights from A (FP16), BN parameters from W (FP32) into the layers' buffers.
fn load_weights(
    net: &mut Net,
    step: &AmpStep<CpuRegions>,
    names: &[&'static str],
) -> Result<(), TrainError> {
    let regions = step.executor();
    for (l, name) in net.layers.iter_mut().zip(names) {
        let w = regions.param_f16(&format!("{name}.w"), Region::A)?.to_vec();
        l.bufs.set("w", HostBuffer::F16(w));
        for p in ["gamma", "beta"] {
            let v = regions
                .param_f32(&format!("{name}.{p}"), Region::W)?
                .to_vec();
            l.bufs.set(
                if p == "gamma" { "gamma" } else { "beta" },
                HostBuffer::F32(v),
            );
        }
    }
    Ok(())
}

/// Forward through the net and the FC layer: FP16 logits `[N, classes]`.
fn logits(
    net: &mut Net,
    step: &AmpStep<CpuRegions>,
    cfg: &TrainConfig,
    images: &[f16],
) -> Result<Vec<f16>, TrainError> {
    let pooled = net.forward(images)?;
    let (w, b) = (
        step.executor().param_f32("fc.w", Region::W)?,
        step.executor().param_f32("fc.b", Region::W)?,
    );
    let f = net.features;
    Ok(pooled
        .chunks_exact(f)
        .flat_map(|x| {
            (0..cfg.classes).map(move |k| {
                let dot: f32 = w[k * f..(k + 1) * f]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum();
                f16::from_f32(dot + b[k])
            })
        })
        .collect())
}

fn count_correct(logits: &[f16], labels: &[i32], classes: usize) -> usize {
    logits
        .chunks_exact(classes)
        .zip(labels)
        .filter(|(row, &label)| {
            let best = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.to_f32().total_cmp(&b.1.to_f32()))
                .map(|(k, _)| k as i32);
            best == Some(label)
        })
        .count()
}

/// One forward + backward; gradients land in G16 (conv) and G (BN, FC). Returns (loss, acc).
fn train_step(
    net: &mut Net,
    step: &mut AmpStep<CpuRegions>,
    names: &[&'static str],
    cfg: &TrainConfig,
    images: &[f16],
    labels: &[i32],
) -> Result<(f32, f32), TrainError> {
    load_weights(net, step, names)?;
    let logits = logits(net, step, cfg, images)?;
    let acc = count_correct(&logits, labels, cfg.classes) as f32 / labels.len() as f32;
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
    let loss = loss_rows.iter().sum::<f32>() / labels.len() as f32;
    // FC backward in FP32: dW = dlogitsᵀ·x, db = Σ dlogits, dx = dlogits·W.
    let pooled = net.pooled().to_vec();
    let f = net.features;
    let w = step.executor().param_f32("fc.w", Region::W)?.to_vec();
    let mut dw = vec![0f32; cfg.classes * f];
    let mut db = vec![0f32; cfg.classes];
    let mut dpooled = vec![0f32; pooled.len()];
    for ((g, x), dx) in dlogits
        .chunks_exact(cfg.classes)
        .zip(pooled.chunks_exact(f))
        .zip(dpooled.chunks_exact_mut(f))
    {
        for k in 0..cfg.classes {
            let gk = g[k].to_f32();
            db[k] += gk;
            for j in 0..f {
                dw[k * f + j] += gk * x[j];
                dx[j] += gk * w[k * f + j];
            }
        }
    }
    let regions = step.executor_mut();
    regions
        .param_f32_mut("fc.w", Region::G)?
        .copy_from_slice(&dw);
    regions
        .param_f32_mut("fc.b", Region::G)?
        .copy_from_slice(&db);
    net.backward(&dpooled)?;
    for (l, name) in net.layers.iter().zip(names) {
        let dw = l.bufs.f16("dw")?;
        regions
            .param_f16_mut(&format!("{name}.w"), Region::G16)?
            .copy_from_slice(dw);
        for p in ["gamma", "beta"] {
            let g = l.bufs.f32(&format!("d{p}"))?;
            regions
                .param_f32_mut(&format!("{name}.{p}"), Region::G)?
                .copy_from_slice(g);
        }
    }
    Ok((loss, acc))
}
