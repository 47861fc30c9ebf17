//! The main job: train a small ResNet-style network built only from CBR layers on a synthetic,
//! learnable dataset with the amp step (FP32 master weights, FP16 compute, fixed loss scaling
//! from 8192, SGD with momentum). Loss falls and accuracy rises well above chance.
//!
//! `cargo run --release --example train_cbr -- [--net mini|resnet18|resnet34|resnet50|resnet101]
//!  [--device auto|cuda|cpu] [--steps N] [--batch N] [--hw N] [--width N] [--seed N] [--lr X]
//!  [--unfused] [--cuda-graph off|finish|step]`
//!
//! `--net` picks the network (default `mini`, the small net that learns in seconds on a CPU);
//! `--hw` sets the image size, so `--net resnet50 --hw 32 --batch 2 --steps 1` runs a real
//! ResNet-50 step on the CPU.
//!
//! `--device auto` (the default) trains on CUDA when a device, cuDNN and NVRTC are usable and
//! every layer has a cuDNN route, else on the CPU reference executor; the first line says
//! which and why. `--device cuda` fails with the reason instead of falling back.

use cudnn_cbr::net::BlockKind;
use cudnn_cbr::train::{Device, ExecutorKind, Progress, TrainConfig, Trainer};
use std::io::Write;
use std::process::ExitCode;

const USAGE: &str = "usage: train_cbr [--net mini|resnet18|resnet34|resnet50|resnet101] \
                     [--device auto|cuda|cpu] [--steps N] [--batch N] [--hw N] [--width N] \
                     [--seed N] [--lr X] [--unfused] [--cuda-graph off|finish|step]";

/// What the command line asks for: a run, or the usage text.
enum Parsed {
    Run(TrainConfig),
    Help,
}

fn parse() -> Result<Parsed, String> {
    let mut cfg = TrainConfig {
        device: Device::Auto,
        ..TrainConfig::default()
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        let num = |v: String, name: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: `{v}` is not a whole number"))
        };
        match a.as_str() {
            "--device" => {
                cfg.device = value("--device")?
                    .parse()
                    .map_err(|e| format!("--device: {e}"))?
            }
            "--cuda-graph" => {
                cfg.cuda_graph = value("--cuda-graph")?
                    .parse()
                    .map_err(|e| format!("--cuda-graph: {e}"))?
            }
            "--net" => cfg.net = value("--net")?.parse().map_err(|e| format!("--net: {e}"))?,
            "--hw" => cfg.hw = num(value("--hw")?, "--hw")? as usize,
            "--steps" => cfg.steps = num(value("--steps")?, "--steps")? as usize,
            "--batch" => cfg.batch = num(value("--batch")?, "--batch")? as usize,
            "--width" => cfg.width = num(value("--width")?, "--width")? as usize,
            "--seed" => cfg.seed = num(value("--seed")?, "--seed")?,
            "--lr" => {
                let v = value("--lr")?;
                cfg.lr = v
                    .parse()
                    .map_err(|_| format!("--lr: `{v}` is not a number"))?;
            }
            "--unfused" => cfg.fused = false,
            "-h" | "--help" => return Ok(Parsed::Help),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    Ok(Parsed::Run(cfg))
}

fn main() -> ExitCode {
    let cfg = match parse() {
        Ok(Parsed::Run(x)) => x,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let trainer = match Trainer::new(&cfg) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("train_cbr: --device {}: {e}", cfg.device.name());
            return ExitCode::FAILURE;
        }
    };
    let info = trainer.executor().clone();
    let kind = match info.kind {
        ExecutorKind::Cpu => "cpu",
        ExecutorKind::Cuda => "cuda",
    };
    println!(
        "train_cbr: device {kind} ({}); {}",
        info.reason, info.detail
    );
    let spec = cfg.net.spec(cfg.channels, cfg.classes, cfg.width);
    let blocks: Vec<usize> = spec.stages.iter().map(Vec::len).collect();
    let block_kind = match spec.stages.iter().flatten().next().map(|b| b.kind) {
        Some(BlockKind::Bottleneck) => "bottleneck",
        _ => "basic",
    };
    println!(
        "network: {} (stem {}x{}/{} to {} channels{}, {block_kind} blocks per stage {blocks:?}), {}x{}x{} synthetic images, {} classes, batch {}, {} steps, lr {}",
        cfg.net,
        spec.stem.kernel,
        spec.stem.kernel,
        spec.stem.stride,
        spec.stem.out,
        if spec.stem.max_pool.is_some() { " + max-pool" } else { "" },
        cfg.hw,
        cfg.hw,
        cfg.channels,
        cfg.classes,
        cfg.batch,
        cfg.steps,
        cfg.lr
    );
    let every = (cfg.steps / 20).clamp(1, 25);
    let result = trainer.run(every, |p: &Progress| {
        let done = p.step * 30 / cfg.steps;
        println!(
            "[{}{}] step {:>5}/{} | loss {:.4} | acc {:5.1}% | scale {:>6} | skipped {} | {:.0} img/s",
            "#".repeat(done),
            ".".repeat(30 - done),
            p.step,
            cfg.steps,
            p.loss,
            p.accuracy * 100.0,
            p.loss_scale,
            p.skipped,
            p.images_per_sec
        );
        let _ = std::io::stdout().flush();
    });
    match result {
        Ok(r) => {
            println!(
                "train_cbr summary: loss {:.4} -> {:.4}, train accuracy {:.1}% (last 10 steps), held-out accuracy {:.1}% (chance {:.1}%), skipped {} steps, loss scale {}, {:.0} img/s on {kind}",
                r.first_loss,
                r.last_loss,
                r.last_accuracy * 100.0,
                r.held_out_accuracy * 100.0,
                100.0 / cfg.classes as f32,
                r.skipped,
                r.loss_scale,
                r.images_per_sec
            );
            if r.executor.kind == ExecutorKind::Cuda {
                println!("train_cbr: {}", r.executor.detail);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("train_cbr: {e}");
            ExitCode::FAILURE
        }
    }
}
