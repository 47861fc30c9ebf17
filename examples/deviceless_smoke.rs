//! Builds and plans the forward conv + GenStats graph for every device-properties fixture,
//! without a GPU, and prints what cuDNN chose.
//!
//! `cargo run --release --example deviceless_smoke [devprops.json ...]`

#[macro_use]
mod out;

use clap::Parser;
use cudnn_cbr::fusion::probe::{self, ConvShape};
use cudnn_cbr::fusion::DeviceProps;
use std::path::PathBuf;
use std::process::ExitCode;

/// Plan the forward conv + GenStats graph for device-properties files, without a GPU.
#[derive(Debug, Parser)]
#[command(name = "deviceless_smoke")]
struct Args {
    /// Device-properties JSON files [default: the three fixtures in tests/fixtures/devprops].
    files: Vec<PathBuf>,
}

fn main() -> ExitCode {
    // Usage errors exit 2 and `--help` exits 0 (clap's conventions).
    let mut files = Args::parse().files;
    if files.is_empty() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/devprops");
        files = ["h200-sm90.json", "a100-sm80.json", "b200-sm100.json"]
            .iter()
            .map(|f| dir.join(f))
            .collect();
    }
    let lib = match cudnn_cbr::sys::library() {
        Ok(lib) => lib,
        Err(e) => {
            note!("error: {e}");
            note!("hint: run scripts/setup-test-deps.sh and `source .deps/env.sh`");
            return ExitCode::FAILURE;
        }
    };
    let (ma, mi, pa) = lib.version_triple();
    out!("cuDNN {ma}.{mi}.{pa} from {}", lib.path());
    let shape = ConvShape::RESNET_3X3;
    out!(
        "graph: conv_fprop + genstats, N={} C={} K={} {}x{} {}x{} pad {} stride {}, FP16 NHWC, FP32 stats",
        shape.n, shape.c, shape.k, shape.h, shape.w, shape.r, shape.s, shape.pad, shape.stride
    );
    out!(
        "{:<22} {:>8} {:>7} {:>7} {:>7}  {:<32} {:>10} {:>9}",
        "device",
        "reported",
        "usable",
        "chosen",
        "engine",
        "pattern",
        "workspace",
        "build ms"
    );
    let mut failed = false;
    for file in &files {
        let report = DeviceProps::from_file(file).and_then(|p| probe::conv_genstats(&p, shape));
        match report {
            Ok(r) => out!(
                "{:<22} {:>8} {:>7} {:>7} {:>7}  {:<32} {:>10} {:>9.1}",
                r.device,
                r.reported,
                r.usable,
                r.chosen,
                r.engine_index,
                r.pattern.as_deref().unwrap_or("?"),
                r.workspace,
                r.build_ms
            ),
            Err(e) => {
                failed = true;
                out!("{:<22} error: {e}", file.display());
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
