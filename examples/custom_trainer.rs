//! A third-party trainer linking cudnn-cbr: its own data and cudarc buffers, a small network
//! from the description, the amp step's begin and finish replayed from captured graphs while
//! a schedule changes the learning rate. On a GPU when there is one, else the CPU executor.
//!
//! `cargo run --release --example custom_trainer -- [--steps N] [--device auto|cuda|cpu]`
#[macro_use]
mod out;

use clap::Parser;
use cudnn_cbr::amp::cuda::CudaContext;
use cudnn_cbr::classifier::{CpuClassifier, CudaClassifier};
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::exec::Handle;
use cudnn_cbr::runtime::cuda_device;
use cudnn_cbr::{
    amp::range::SgdConfig, amp::step::StepConfig, fusion::cache::PlanCache, net::compile,
    net::NetSpec, net::Preset, net::RoutePolicy,
};
use half::f16;
use std::{error::Error, sync::Arc};

type Res<T> = Result<T, Box<dyn Error>>;
const BATCH: usize = 16;
const HW: usize = 16;
const CLASSES: usize = 4;
const SEED: u64 = 7;

#[derive(Parser)]
#[command(about = "A small trainer built on cudnn-cbr's public API")]
struct Args {
    /// Training steps (1 to 1,000,000: the loss of every step is kept for the summary).
    #[arg(long, default_value_t = 60, value_parser = parse_steps)]
    steps: usize,
    /// `auto`: a GPU when there is one; `cuda`: a GPU, or an error saying why there is none;
    /// `cpu`: the CPU executor.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cuda", "cpu"])]
    device: String,
}

/// `--steps`: at least one step (the summary compares the first loss with the last).
fn parse_steps(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|e| format!("`{s}` is not a step count: {e}"))?;
    if (1..=1_000_000).contains(&n) {
        Ok(n)
    } else {
        Err(format!("must be in 1..=1000000, got {n}"))
    }
}

/// Our data: class `c` lights up the image's `c`-th quadrant, on noise.
fn batch(step: usize) -> (Vec<f16>, Vec<i32>) {
    let mut s = step as u64 * 0x9e37_79b9 + 1;
    let mut noise = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % 1000) as f32 / 1000.0 - 0.5
    };
    let labels: Vec<i32> = (0..BATCH).map(|i| ((i + step) % CLASSES) as i32).collect();
    let mut images = Vec::with_capacity(BATCH * HW * HW * 3);
    for &l in &labels {
        for y in 0..HW {
            for x in 0..HW {
                let quadrant = (y >= HW / 2) as i32 * 2 + (x >= HW / 2) as i32;
                let v = if quadrant == l { 1.0 } else { 0.0 };
                images.extend((0..3).map(|_| f16::from_f32(v + 0.3 * noise())));
            }
        }
    }
    (images, labels)
}

/// Linear warm-up over 5 steps, then cosine decay to 10 %.
fn lr_at(step: usize, steps: usize) -> f32 {
    let peak = 0.1;
    if step < 5 {
        return peak * (step + 1) as f32 / 5.0;
    }
    let t = (step - 5) as f32 / (steps.saturating_sub(5).max(1)) as f32;
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f32::consts::PI * t).cos()))
}

fn main() -> Res<()> {
    let args = Args::parse();
    let spec = Preset::Mini.spec(3, CLASSES, 8);
    let config = StepConfig::new(SgdConfig::new(lr_at(0, args.steps)));
    let gpu = match args.device.as_str() {
        "cpu" => None,
        "cuda" => Some(cuda_device(0).map_err(|e| format!("--device cuda: no GPU ({e})"))?),
        _ => cuda_device(0)
            .map_err(|e| out!("custom_trainer: no GPU ({e}); the CPU executor trains"))
            .ok(),
    };
    let losses = match gpu {
        Some(ctx) => train_cuda(ctx, &spec, config, args.steps)?,
        None => train_cpu(&spec, config, args.steps)?,
    };
    let (first, last, n) = (losses[0], losses[losses.len() - 1], args.steps);
    out!("custom_trainer: loss {first:.4} -> {last:.4} over {n} steps");
    if last.partial_cmp(&first) != Some(std::cmp::Ordering::Less) {
        return Err("the loss did not fall".into());
    }
    Ok(())
}

/// The CPU executor: host slices in; the amp step's graphs are its CPU twins.
fn train_cpu(spec: &NetSpec, config: StepConfig, steps: usize) -> Res<Vec<f32>> {
    let net = compile(spec, BATCH, HW, &RoutePolicy::Uniform(RouteKind::Fused))?;
    let mut model = CpuClassifier::new(net, CLASSES, config, SEED)?;
    let begin = model.step_mut().capture_begin()?;
    let finish = model.step_mut().capture_finish()?;
    let mut losses = Vec::new();
    for i in 0..steps {
        let (images, labels) = batch(i);
        model.step_mut().replay(&begin)?;
        let m = model.forward_backward(&images, &labels)?;
        model.step_mut().set_lr(lr_at(i, steps))?; // read by the replayed update
        model.step_mut().replay(&finish)?;
        losses.push(m.loss);
        if i % 10 == 0 || i + 1 == steps {
            out!("step {i:>4}  lr {:.4}  loss {:.4}", lr_at(i, steps), m.loss);
        }
    }
    Ok(losses)
}

/// A GPU: our own cudarc stream and image buffer; plans for the live device, cached on disk.
fn train_cuda(
    ctx: Arc<CudaContext>,
    spec: &NetSpec,
    config: StepConfig,
    steps: usize,
) -> Res<Vec<f32>> {
    let stream = ctx.per_thread_stream();
    let handle = Handle::new(stream.clone())?;
    let target = handle.target()?;
    let cache = PlanCache::persistent("target/plan-cache")?;
    let net = compile(
        spec,
        BATCH,
        HW,
        &RoutePolicy::Planned {
            target: &target,
            cache: &cache,
        },
    )?;
    let mut model = CudaClassifier::new(net, handle, CLASSES, config, SEED)?;
    let mut images = stream.alloc_zeros::<f16>(BATCH * HW * HW * 3)?;
    let begin = model.step_mut().capture_begin()?;
    let finish = model.step_mut().capture_finish()?;
    let mut losses = Vec::new();
    for i in 0..steps {
        let (host, labels) = batch(i);
        stream.memcpy_htod(&host, &mut images)?;
        model.step_mut().replay(&begin)?;
        model.forward_backward(&mut images, &labels)?; // reads `images` in place
        model.step_mut().set_lr(lr_at(i, steps))?;
        model.step_mut().replay(&finish)?;
        if i % 10 == 0 || i + 1 == steps {
            let m = model.metrics_blocking()?; // the only waits for the GPU
            losses.push(m.loss);
            out!("step {i:>4}  lr {:.4}  loss {:.4}", lr_at(i, steps), m.loss);
        }
    }
    Ok(losses)
}
