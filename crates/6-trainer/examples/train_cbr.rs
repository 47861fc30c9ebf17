//! The main job: train a small ResNet-style network built only from CBR layers on a synthetic,
//! learnable dataset with the amp step (FP32 master weights, FP16 compute, fixed loss scaling
//! from 8192, SGD with momentum). Loss falls and accuracy rises well above chance.
//!
//! `cargo run --release -p cudnn-cbr-trainer --example train_cbr -- [--net
//!  mini|resnet18|resnet34|resnet50|resnet101] [--device auto|cuda|cpu] [--steps N] [--batch N]
//!  [--hw N] [--width N] [--seed N] [--lr X] [--lr-schedule constant|cosine] [--warmup N]
//!  [--unfused] [--cuda-graph off|finish|step]
//!  [--ranks N [--sync-bn]] [--data synthetic|cifar10:DIR] [--save PATH [--save-every N]]
//!  [--resume PATH [--evaluate]] [--log-dir DIR] [--clip-norm X] [--ema DECAY] [--accum N]`
//!  (`--help` lists them with their defaults)
//!
//! `--save PATH` writes a checkpoint (the whole training state, safetensors with torchvision's
//! names: `cudnn_cbr_trainer::checkpoint`) after the last step and every `--save-every` steps;
//! `--resume PATH` continues from one. `--steps` counts from the start of training, so
//! `--resume ck --steps 40` after a 20-step run saved with `--save ck` trains steps 21–40 and
//! ends with the same weights hash as 40 steps in one go. `--log-dir DIR` writes
//! `DIR/curves.csv` and `DIR/curves.svg` (per-step loss, accuracy, loss scale, learning rate,
//! throughput). The summary line ends with `weights hash <16 hex digits>`
//! (`MasterWeights::hash`).
//!
//! `--net` picks the network (default `mini`, the small net that learns in seconds on a CPU);
//! `--hw` sets the image size, so `--net resnet50 --hw 32 --batch 2 --steps 1` runs a real
//! ResNet-50 step on the CPU.
//!
//! `--device auto` (the default) trains on CUDA when a device, cuDNN and NVRTC are usable and
//! every layer has a cuDNN route, else on the CPU reference executor; the first line says
//! which and why. `--device cuda` fails with the reason instead of falling back.

use clap::Parser;
use cudnn_cbr::classifier::CudaGraphMode;
use cudnn_cbr::net::{Arena, BlockKind, Preset};
use cudnn_cbr_trainer::{
    DataSource, Device, ExecutorKind, LrSchedule, Progress, TrainConfig, Trainer,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::process::ExitCode;

/// `println!` that ends the program quietly when its output is gone (a reader that closed the
/// pipe, as `train_cbr | head` does) instead of panicking on the failed write.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout().lock(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

/// `eprintln!` that never panics: a closed stderr (its reader gone, as with `… 2>&1 | head`)
/// is ignored (`cudnn_cbr::runtime::stderr::line`).
macro_rules! note {
    ($($arg:tt)*) => {
        cudnn_cbr::runtime::stderr::line(&format!($($arg)*))
    };
}

/// Train a small CBR ResNet on synthetic data (on CUDA when usable, else on the CPU reference
/// executor).
#[derive(Debug, Parser)]
#[command(name = "train_cbr")]
struct Args {
    /// The network: mini, resnet18, resnet34, resnet50 or resnet101.
    #[arg(long, default_value = "mini")]
    net: Preset,
    /// Where to train: auto, cuda or cpu.
    #[arg(long, default_value = "auto")]
    device: Device,
    /// Optimizer steps.
    #[arg(long, default_value_t = TrainConfig::default().steps)]
    steps: usize,
    /// Images per step.
    #[arg(long, default_value_t = TrainConfig::default().batch)]
    batch: usize,
    /// Image size (height = width).
    #[arg(long, default_value_t = TrainConfig::default().hw)]
    hw: usize,
    /// The mini network's base channel width.
    #[arg(long, default_value_t = TrainConfig::default().width)]
    width: usize,
    /// Seed of the dataset and the initial weights.
    #[arg(long, default_value_t = TrainConfig::default().seed)]
    seed: u64,
    /// Learning rate (the base rate of --lr-schedule).
    #[arg(long, default_value_t = TrainConfig::default().lr)]
    lr: f32,
    /// The learning rate over the steps after the warmup: constant, or cosine (half a cosine
    /// from --lr down to 0 at --steps).
    #[arg(long, default_value = "constant")]
    lr_schedule: LrSchedule,
    /// Steps of linear learning-rate warmup (lr·(i+1)/N for step i < N).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Run the unfused route's ops.
    #[arg(long)]
    unfused: bool,
    /// CUDA-graph use on the CUDA executor: off, finish or step.
    #[arg(long, default_value = "step")]
    cuda_graph: CudaGraphMode,
    /// Data-parallel ranks, run as CPU threads; --batch is then the per-rank batch and rank r
    /// trains on its shard of the same global batch.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Synchronized BN across the ranks (the global batch's statistics in every layer).
    #[arg(long)]
    sync_bn: bool,
    /// The training images: `synthetic`, or `cifar10:DIR` (the CIFAR-10 binary files in DIR;
    /// any executor, data-parallel too, each rank decoding its shard; 32x32 images, 10
    /// classes; the whole test set is
    /// evaluated after every epoch, and the held-out accuracy is on the first 8 batches of
    /// the test set).
    #[arg(long, default_value = "synthetic")]
    data: DataSource,
    /// Save a checkpoint (safetensors) here after the last step, and every --save-every steps.
    #[arg(long)]
    save: Option<std::path::PathBuf>,
    /// With --save: also save after every N steps (0: only at the end).
    #[arg(long, default_value_t = 0, requires = "save")]
    save_every: usize,
    /// Resume from this checkpoint (same network, batch, image size, seed and data); --steps
    /// counts from the start of training.
    #[arg(long)]
    resume: Option<std::path::PathBuf>,
    /// Evaluate instead of training (with --resume: the checkpoint's model, whatever its
    /// step): the held-out accuracy the summary measures and, on CIFAR-10, the whole test
    /// set's, trained and EMA weights.
    #[arg(long)]
    evaluate: bool,
    /// Write curves.csv and curves.svg (per-step loss, accuracy, loss scale, learning rate,
    /// throughput) into this folder.
    #[arg(long)]
    log_dir: Option<std::path::PathBuf>,
    /// Clip the gradients by their global norm (PyTorch's clip_grad_norm_ after unscale_),
    /// on the device, without a host sync.
    #[arg(long, value_name = "MAX_NORM")]
    clip_norm: Option<f32>,
    /// Keep an exponential moving average of the weights with this decay (updated in the
    /// step, skipped with it on overflow; every executor) and report the held-out accuracy
    /// with the EMA weights too.
    #[arg(long, value_name = "DECAY")]
    ema: Option<f32>,
    /// Gradient accumulation: N micro-batches of --batch images per optimizer step, each
    /// with its own forward and backward pass (BN with its statistics), their gradients
    /// summed in FP32; the overflow check, SGD and the loss-scale update once per step
    /// (1..=4096; 1: none).
    #[arg(long, value_name = "N", default_value_t = TrainConfig::default().accum)]
    accum: usize,
    /// The network buffers' layout: `shared` (buffers never alive together share one
    /// liveness-planned arena) or `separate` (one allocation each); same results.
    #[arg(long, value_enum, default_value = "shared")]
    arena: ArenaArg,
}

/// `--arena`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ArenaArg {
    Shared,
    Separate,
}

impl Args {
    fn config(&self) -> TrainConfig {
        // CIFAR-10 fixes the image size and class count; an explicit other --hw is refused
        // by the trainer (a typed error naming both).
        let (hw, classes) = match self.data {
            DataSource::Cifar10(_) if self.hw == TrainConfig::default().hw => (32, 10),
            DataSource::Cifar10(_) => (self.hw, 10),
            DataSource::Synthetic => (self.hw, TrainConfig::default().classes),
        };
        TrainConfig {
            classes,
            data: self.data,
            net: self.net,
            device: self.device,
            steps: self.steps,
            batch: self.batch,
            hw,
            width: self.width,
            seed: self.seed,
            lr: self.lr,
            lr_schedule: self.lr_schedule,
            warmup: self.warmup,
            fused: !self.unfused,
            cuda_graph: self.cuda_graph,
            ranks: self.ranks,
            sync_bn: self.sync_bn,
            clip_norm: self.clip_norm,
            ema: self.ema,
            accum: self.accum,
            arena: match self.arena {
                ArenaArg::Shared => Arena::Shared,
                ArenaArg::Separate => Arena::Separate,
            },
            ..TrainConfig::default()
        }
    }
}

/// `--evaluate`: loads the checkpoint when given, evaluates and prints one line (rank 0).
fn evaluate(mut trainer: Trainer, checkpoint: Option<&std::path::Path>) -> ExitCode {
    let mut from = "the initial weights".to_string();
    if let Some(path) = checkpoint {
        match trainer.load_checkpoint(path) {
            Ok(step) => from = format!("{} (step {step})", path.display()),
            Err(e) => {
                note!("train_cbr: --resume {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    let pct = |a: f32| format!("{:.1}%", 100.0 * a);
    match trainer.evaluate() {
        Ok(_) if trainer.process_rank().0 != 0 => ExitCode::SUCCESS,
        Ok(e) => {
            let ema = |a: Option<f32>| a.map(|a| format!(", EMA {}", pct(a))).unwrap_or_default();
            let test = e
                .test_set
                .map(|(t, m)| format!("; test set {}{}", pct(t), ema(m)))
                .unwrap_or_default();
            out!(
                "train_cbr evaluation of {from}: held-out accuracy {}{} (eval mode){test}",
                pct(e.held_out_accuracy),
                ema(e.held_out_ema_accuracy)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            note!("train_cbr: --evaluate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    // Usage errors exit 2 and `--help` exits 0 (clap's conventions).
    let args = Args::parse();
    let cfg = args.config();
    let mut trainer = match Trainer::new(&cfg) {
        Ok(t) => t,
        Err(e) => {
            note!("train_cbr: --device {}: {e}", cfg.device.name());
            return ExitCode::FAILURE;
        }
    };
    trainer.record_curve(args.log_dir.is_some());
    if let Some(path) = &args.save {
        if let Err(e) = trainer.save_to(path, args.save_every) {
            note!("train_cbr: --save: {e}");
            return ExitCode::FAILURE;
        }
    }
    if args.evaluate {
        return evaluate(trainer, args.resume.as_deref());
    }
    let mut resumed = 0;
    if let Some(path) = &args.resume {
        match trainer.resume(path) {
            Ok(step) => resumed = step,
            Err(e) => {
                note!("train_cbr: --resume {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    let info = trainer.executor().clone();
    // Under a launcher (one process per GPU) only rank 0 reports.
    let (rank, _) = trainer.process_rank();
    if rank != 0 {
        return match trainer.run(usize::MAX, |_| {}) {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                note!("train_cbr (rank {rank}): {e}");
                ExitCode::FAILURE
            }
        };
    }
    let kind = match info.kind {
        ExecutorKind::Cpu => "cpu",
        ExecutorKind::Cuda => "cuda",
    };
    out!(
        "train_cbr: device {kind} ({}); {}",
        info.reason,
        info.detail
    );
    let spec = cfg.net.spec(cfg.channels, cfg.classes, cfg.width);
    let blocks: Vec<usize> = spec.stages.iter().map(Vec::len).collect();
    let block_kind = match spec.stages.iter().flatten().next().map(|b| b.kind) {
        Some(BlockKind::Bottleneck) => "bottleneck",
        _ => "basic",
    };
    out!(
        "network: {} (stem {}x{}/{} to {} channels{}, {block_kind} blocks per stage {blocks:?}), {}x{}x{} {} images, {} classes, batch {}, {} steps, lr {}",
        cfg.net,
        spec.stem.kernel,
        spec.stem.kernel,
        spec.stem.stride,
        spec.stem.out,
        if spec.stem.max_pool.is_some() { " + max-pool" } else { "" },
        cfg.hw,
        cfg.hw,
        cfg.channels,
        cfg.data,
        cfg.classes,
        if cfg.data_parallel() {
            format!("{} ranks x {}", cfg.ranks, cfg.batch)
        } else if cfg.accum > 1 {
            format!("{} micro-batches x {}", cfg.accum, cfg.batch)
        } else {
            cfg.batch.to_string()
        },
        cfg.steps,
        if cfg.schedules_lr() {
            format!("{} ({}, warmup {})", cfg.lr, cfg.lr_schedule, cfg.warmup)
        } else {
            cfg.lr.to_string()
        }
    );
    if let Some(path) = &args.resume {
        out!(
            "train_cbr: resumed from {} at step {resumed}",
            path.display()
        );
    }
    let every = (cfg.steps / 20).clamp(1, 25);
    // A progress bar on a terminal; plain lines otherwise, so logs stay readable.
    let bar = std::io::stdout().is_terminal().then(|| {
        let bar = ProgressBar::new(cfg.steps as u64);
        bar.set_style(
            ProgressStyle::with_template("[{bar:30}] step {pos:>5}/{len} | {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#>."),
        );
        bar
    });
    let result = trainer.run(every, |p: &Progress| {
        let line = format!(
            "loss {:.4} | acc {:5.1}% | scale {:>6} | skipped {} | {:.0} img/s",
            p.loss,
            p.accuracy * 100.0,
            p.loss_scale,
            p.skipped,
            p.images_per_sec
        );
        match &bar {
            Some(bar) => {
                bar.set_position(p.step as u64);
                bar.set_message(line);
            }
            None => out!("step {:>5}/{} | {line}", p.step, cfg.steps),
        }
    });
    if let Some(bar) = &bar {
        bar.finish();
    }
    match result {
        Ok(r) => {
            // The test set after each epoch (data with epochs: CIFAR-10).
            for e in &r.epochs {
                let ema = e
                    .ema_accuracy
                    .map(|a| format!(", EMA {:.1}%", a * 100.0))
                    .unwrap_or_default();
                out!(
                    "train_cbr: epoch {} (step {}): test accuracy {:.1}% (eval mode){ema}",
                    e.epoch,
                    e.step,
                    e.accuracy * 100.0
                );
            }
            // The held-out accuracies: BN mode, then the EMA weights' when kept.
            let mode = if r.held_out_eval_mode {
                "eval mode"
            } else {
                "train-mode BN"
            };
            let ema = r
                .held_out_ema_accuracy
                .map(|a| format!(", EMA held-out accuracy {:.1}% (eval mode)", a * 100.0))
                .unwrap_or_default();
            out!(
                "train_cbr summary: loss {:.4} -> {:.4}, train accuracy {:.1}% (last 10 steps), held-out accuracy {:.1}% ({mode}){ema} (chance {:.1}%), skipped {} steps, loss scale {}, {:.0} img/s on {kind}, weights hash {:016x}",
                r.first_loss,
                r.last_loss,
                r.last_accuracy * 100.0,
                r.held_out_accuracy * 100.0,
                100.0 / cfg.classes as f32,
                r.skipped,
                r.loss_scale,
                r.images_per_sec,
                r.weights_hash()
            );
            if r.executor.kind == ExecutorKind::Cuda {
                out!("train_cbr: {}", r.executor.detail);
            }
            // Each step's loss, for comparing runs (a resumed run's start at its step).
            let losses: Vec<String> = r.step_losses.iter().map(|l| format!("{l:?}")).collect();
            out!(
                "train_cbr: step losses from step {}: {}",
                r.start_step + 1,
                losses.join(" ")
            );
            if let Some(dir) = &args.log_dir {
                match cudnn_cbr_trainer::curves::write(dir, &r.curve) {
                    Ok((csv, svg)) => {
                        out!(
                            "train_cbr: curves in {} and {}",
                            csv.display(),
                            svg.display()
                        )
                    }
                    Err(e) => {
                        note!("train_cbr: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            if let Some(path) = &args.save {
                out!("train_cbr: checkpoint saved to {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            note!("train_cbr: {e}");
            ExitCode::FAILURE
        }
    }
}
