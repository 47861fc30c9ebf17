//! Plans every graph of a real network (default ResNet-50 at 224×224) for a GPU described by a
//! device-properties JSON file, without a GPU: the network compiled once on the fused route
//! with its fallbacks (per layer, and per prologue pair) and once on the unfused route. Prints
//! one row per distinct layer: its role in the block, shape, route, graphs with their engines,
//! and workspace, and whether it reads the previous BN through its prologue or a stored
//! activation; then `supported A/B fused (P/Q prologue pairs), C/B unfused`: A of B layers run
//! fused, P of the Q conv pairs inside blocks take the prologue (the others store the
//! activation between them), C layers have every unfused graph planned.
//!
//! ```text
//! cargo run --release --example deviceless_plans -- [--net NAME] [--props FILE] [--batch N]
//!     [--hw N] [--cache DIR] [--threads N] [--memory]
//! ```
//!
//! - `--net NAME`: `mini`, `resnet18`, `resnet34`, `resnet50` (default), `resnet101`.
//! - `--props FILE`: device-properties JSON (default: tests/fixtures/devprops/h200-sm90.json).
//! - `--batch N`, `--hw N`: batch size (default 32) and image size (default 224).
//! - `--cache DIR`: where built plans are persisted (default `target/plan-cache`); a second run
//!   restores them instead of running heuristics and cuDNN's runtime compilation again.
//! - `--threads N`: plan the network's distinct graphs on N threads first (default: one per
//!   core; 1 turns the parallel pass off), so cuDNN's compilations overlap.
//! - `--memory`: after the fused route's table, the device memory of one training step by kind
//!   (parameters, gradients, optimizer state, activations, their gradients, per-channel
//!   buffers, workspace, total), a line ending `network buffers X.X MB per image`, and the
//!   largest batch that fits the target's memory (`totalGlobalMem`).
//!
//! The first run compiles the runtime-compiled graphs (BN applies, ReLU/BN backward): 0.5–1.3 s
//! each; progress goes to stderr. Needs cuDNN ≥ 9.8 (run scripts/setup-test-deps.sh and
//! `source .deps/env.sh`); without it, prints the load error and exits non-zero.
//! tests/network_plans.rs plans ResNet-50 on the H200 fixture in CI.

#[macro_use]
mod out;

use clap::Parser;
use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::{
    compile, prewarm, CompiledNet, LayerRole, MemoryReport, NetLayer, Preset, RoutePolicy,
};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Plan every graph of a network for a GPU described by a device-properties file, without a
/// GPU.
#[derive(Debug, Parser)]
#[command(name = "deviceless_plans")]
struct Args {
    /// The network: mini, resnet18, resnet34, resnet50 or resnet101.
    #[arg(long, default_value = "resnet50")]
    net: Preset,
    /// Device-properties JSON [default: tests/fixtures/devprops/h200-sm90.json].
    #[arg(long)]
    props: Option<PathBuf>,
    /// Batch size.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Image height = width.
    #[arg(long, default_value_t = 224, value_parser = clap::value_parser!(u64).range(1..))]
    hw: u64,
    /// Plan-cache folder [default: target/plan-cache].
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Threads that plan distinct graphs at once before the layer-by-layer pass (0: one per
    /// core; 1: no parallel pass).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print the device memory of one training step on the fused route, by kind, and the
    /// largest batch that fits the target's memory.
    #[arg(long)]
    memory: bool,
}

/// The `--memory` report of `net` on `target` (a 1000-class head, as the network's).
fn print_memory(net: &CompiledNet, target: &Target) {
    let report = match MemoryReport::of(net, 1000) {
        Ok(r) => r,
        Err(e) => {
            out!("memory: cannot lay out the amp plan: {e}");
            return;
        }
    };
    out!("{report}");
    let device = target.props().total_memory();
    match report.largest_batch(device) {
        Some(b) => out!(
            "largest batch that fits {} ({:.1} GB): {b} (the arena and the input, output and \
             its gradient scale with the batch; the workspace is this batch's)",
            target.props().name(),
            device as f64 / 1e9
        ),
        None => out!(
            "not one image fits {} ({:.1} GB)",
            target.props().name(),
            device as f64 / 1e9
        ),
    }
}

/// One row per distinct layer of `net`, with why a layer is not fused, or takes no prologue,
/// on the fused route.
fn print_table(label: &str, net: &CompiledNet) {
    out!("{label}: {}", NetLayer::report_header());
    for l in net.distinct_layers() {
        out!("{label}: {}", l.report_row());
        if label == "fused" {
            if let Some(why) = l.layer.route().reason() {
                let why = why.lines().next().unwrap_or("");
                out!("{label}:   why not fused: {why}");
            }
            if let Some(why) = &l.stored_input_why {
                out!("{label}:   why no prologue: {why}");
            }
        }
    }
}

fn main() -> ExitCode {
    // Usage errors exit 2 and `--help` exits 0 (clap's conventions).
    let mut args = Args::parse();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let props = args
        .props
        .take()
        .unwrap_or_else(|| root.join("tests/fixtures/devprops/h200-sm90.json"));
    let cache_dir = args
        .cache
        .take()
        .unwrap_or_else(|| root.join("target/plan-cache"));
    let (batch, hw) = (args.batch as usize, args.hw as usize);
    let lib = match cudnn_cbr::sys::library() {
        Ok(lib) => lib,
        Err(e) => {
            note!("error: {e}");
            note!("hint: run scripts/setup-test-deps.sh and `source .deps/env.sh`");
            return ExitCode::FAILURE;
        }
    };
    let target = match Target::deviceless_from_file(&props) {
        Ok(t) => t,
        Err(e) => {
            note!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cache = match PlanCache::persistent(&cache_dir) {
        Ok(c) => c,
        Err(e) => {
            note!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let spec = args.net.spec(3, 1000, 16);
    let (ma, mi, pa) = lib.version_triple();
    out!(
        "{} plans: {} ({}), cuDNN {ma}.{mi}.{pa}, batch {}, {}x{}, plan cache {}",
        args.net,
        target.props().name(),
        props.display(),
        batch,
        hw,
        hw,
        cache_dir.display()
    );
    let start = Instant::now();
    if args.threads != 1 {
        let routes = [RouteKind::Fused, RouteKind::Unfused];
        match prewarm(&spec, batch, hw, &routes, &target, &cache, args.threads) {
            Ok(p) => note!(
                "prewarm: {}/{} distinct graphs planned on {} threads in {:.1} s",
                p.planned,
                p.graphs,
                p.threads,
                p.elapsed.as_secs_f64()
            ),
            Err(e) => note!("prewarm: {e}"),
        }
    }
    let mut counts = Vec::new();
    // (prologue pairs fused, pairs in the network) on the fused route.
    let mut pairs = (0, 0);
    for (label, policy) in [
        (
            "fused",
            RoutePolicy::Planned {
                target: &target,
                cache: &cache,
            },
        ),
        (
            "unfused",
            RoutePolicy::PlannedRoute {
                target: &target,
                cache: &cache,
                route: RouteKind::Unfused,
            },
        ),
    ] {
        let t = Instant::now();
        note!("planning {} on the {label} route…", args.net);
        match compile(&spec, batch, hw, &policy) {
            Ok(net) => {
                print_table(label, &net);
                let fused = net
                    .layers
                    .iter()
                    .filter(|l| l.layer.route().kind() == RouteKind::Fused)
                    .count();
                let n = net.layers.len();
                note!(
                    "{label}: {n} layers planned in {:.1} s",
                    t.elapsed().as_secs_f64()
                );
                if label == "fused" && args.memory {
                    print_memory(&net, &target);
                }
                if label == "fused" {
                    pairs = (
                        net.layers.iter().filter(|l| l.prev.is_some()).count(),
                        net.layers
                            .iter()
                            .filter(|l| matches!(l.role, LayerRole::Inner | LayerRole::Last))
                            .count(),
                    );
                }
                counts.push((if label == "fused" { fused } else { n }, n));
            }
            Err(e) => {
                out!("{label}: FAILED: {e}");
                let n = counts.first().map_or(0, |c| c.1);
                counts.push((0, n));
            }
        }
    }
    let stats = cache.stats();
    out!(
        "planned in {:.1} s: {} built, {} restored, {} cache hits",
        start.elapsed().as_secs_f64(),
        stats.built,
        stats.restored,
        stats.hits
    );
    let (f, u) = (counts[0], counts[1]);
    out!(
        "supported {}/{} fused ({}/{} prologue pairs), {}/{} unfused",
        f.0,
        f.1,
        pairs.0,
        pairs.1,
        u.0,
        u.1.max(f.1)
    );
    if f.1 == 0 {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
