//! The main job: train a small ResNet-style network built only from CBR layers on a synthetic,
//! learnable dataset with the amp step (FP32 master weights, FP16 compute, fixed loss scaling
//! from 8192, SGD with momentum). Loss falls and accuracy rises well above chance.
//!
//! `cargo run --release --example train_cbr -- [--device auto|cuda|cpu] [--steps N]
//!  [--batch N] [--width N] [--seed N] [--lr X] [--unfused]`

use cudnn_cbr::train::{train, Progress, TrainConfig};
use std::io::Write;
use std::process::ExitCode;

const USAGE: &str = "usage: train_cbr [--device auto|cuda|cpu] [--steps N] [--batch N] \
                     [--width N] [--seed N] [--lr X] [--unfused]";

fn parse() -> Result<(String, TrainConfig), String> {
    let mut cfg = TrainConfig::default();
    let mut device = "auto".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        let num = |v: String, name: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: `{v}` is not a whole number"))
        };
        match a.as_str() {
            "--device" => device = value("--device")?,
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
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    if !["auto", "cuda", "cpu"].contains(&device.as_str()) {
        return Err(format!(
            "--device must be auto, cuda or cpu, got `{device}`"
        ));
    }
    Ok((device, cfg))
}

/// Why the CUDA executor is not used, or None when it could be.
fn cuda_unavailable() -> Option<String> {
    if let Err(e) = cudnn_cbr::fusion::exec::cuda_device(0) {
        return Some(e.to_string());
    }
    if let Err(e) = cudnn_cbr::sys::library() {
        return Some(format!(
            "cuDNN not loadable: {}",
            e.to_string().lines().next().unwrap_or("")
        ));
    }
    None
}

fn main() -> ExitCode {
    let (device, cfg) = match parse() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let why_cpu = match (device.as_str(), cuda_unavailable()) {
        ("cpu", _) => "requested with --device cpu".to_string(),
        ("cuda", Some(why)) => {
            eprintln!("train_cbr: --device cuda, but {why}");
            return ExitCode::FAILURE;
        }
        (_, Some(why)) => why,
        // A GPU is there, but the network-level CUDA executor (GPU pooling/FC and the CUDA
        // amp step wired together) is not built yet: say so rather than pretend.
        ("cuda", None) => {
            eprintln!("train_cbr: the CUDA training path is not available yet; use --device cpu");
            return ExitCode::FAILURE;
        }
        (_, None) => "a GPU is present, but the CUDA training path is not available yet".into(),
    };
    println!(
        "train_cbr: device cpu (CPU reference executor; {why_cpu}); {} route ops",
        if cfg.fused { "fused" } else { "unfused" }
    );
    println!(
        "network: stem + 2 residual CBR stages (width {}, {}), {}x{}x{} synthetic images, {} classes, batch {}, {} steps, lr {}",
        cfg.width,
        2 * cfg.width,
        cfg.hw,
        cfg.hw,
        cfg.channels,
        cfg.classes,
        cfg.batch,
        cfg.steps,
        cfg.lr
    );
    let every = (cfg.steps / 20).clamp(1, 25);
    let result = train(&cfg, every, |p: &Progress| {
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
                "train_cbr summary: loss {:.4} -> {:.4}, train accuracy {:.1}% (last 10 steps), held-out accuracy {:.1}% (chance {:.1}%), skipped {} steps, loss scale {}, {:.0} img/s on cpu",
                r.first_loss,
                r.last_loss,
                r.last_accuracy * 100.0,
                r.held_out_accuracy * 100.0,
                100.0 / cfg.classes as f32,
                r.skipped,
                r.loss_scale,
                r.images_per_sec
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("train_cbr: {e}");
            ExitCode::FAILURE
        }
    }
}
