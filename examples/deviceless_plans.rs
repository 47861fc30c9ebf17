//! Plans every CBR graph, fused and unfused, for every unique conv layer of ResNet-50 (224×224
//! input) on a GPU described by a device-properties JSON file, without a GPU, and prints a table:
//! layer, route, graph, engine configs (reported/usable), chosen engine, workspace, build ms.
//! The last line is `supported A/B fused, C/D unfused`: A of B layers have every fused graph
//! planned, C of D every unfused graph.
//!
//! ```text
//! cargo run --release --example deviceless_plans -- [--props FILE] [--batch N] [--json] [--cache DIR]
//! ```
//!
//! - `--props FILE`: device-properties JSON (default: tests/fixtures/devprops/h200-sm90.json).
//! - `--batch N`: batch size (default 32).
//! - `--json`: one JSON object per graph, then a summary object, instead of the table.
//! - `--cache DIR`: where built plans are persisted (default `target/plan-cache`); a second run
//!   restores them instead of running heuristics and cuDNN's runtime compilation again
//!   (restored plans show `restored` as engine and 0/0 engine configs).
//!
//! The first run compiles the runtime-compiled graphs (BN applies, ReLU/BN backward): 0.5–1.3 s
//! each, a few minutes in all; progress goes to stderr. Needs cuDNN ≥ 9.8 (run
//! scripts/setup-test-deps.sh and `source .deps/env.sh`); without it, prints the load error and
//! exits non-zero. Not run in CI: tests/deviceless_plans.rs plans a small subset there.

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::resnet50::{plan_layers, resnet50_layers, route_name, GraphRow};
use cudnn_cbr::fusion::Target;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "usage: deviceless_plans [--props FILE] [--batch N] [--json] [--cache DIR]\n\
     \x20 --props FILE  device-properties JSON (default: tests/fixtures/devprops/h200-sm90.json)\n\
     \x20 --batch N     batch size, a positive integer (default: 32)\n\
     \x20 --json        print JSON lines instead of the table\n\
     \x20 --cache DIR   plan-cache folder (default: target/plan-cache)";

#[derive(Debug)]
struct Args {
    props: PathBuf,
    batch: i64,
    json: bool,
    cache: PathBuf,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut parsed = Args {
        props: root.join("tests/fixtures/devprops/h200-sm90.json"),
        batch: 32,
        json: false,
        cache: root.join("target/plan-cache"),
    };
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| args.next().ok_or_else(|| format!("`{flag}` needs a value"));
        match arg.as_str() {
            "--props" => parsed.props = value("--props")?.into(),
            "--cache" => parsed.cache = value("--cache")?.into(),
            "--batch" => {
                let v = value("--batch")?;
                parsed.batch = match v.parse::<i64>() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("`--batch` needs a positive integer, got `{v}`")),
                };
            }
            "--json" => parsed.json = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(Some(parsed))
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let lib = match cudnn_cbr::sys::library() {
        Ok(lib) => lib,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("hint: run scripts/setup-test-deps.sh and `source .deps/env.sh`");
            return ExitCode::FAILURE;
        }
    };
    let target = match Target::deviceless_from_file(&args.props) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cache = match PlanCache::persistent(&args.cache) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let layers = resnet50_layers(args.batch);
    let (ma, mi, pa) = lib.version_triple();
    let about = format!(
        "ResNet-50 CBR plans: {} ({}), cuDNN {ma}.{mi}.{pa}, batch {}, {} layers, plan cache {}",
        target.props().name(),
        args.props.display(),
        args.batch,
        layers.len(),
        args.cache.display()
    );
    // With --json, stdout carries only JSON lines.
    if args.json {
        eprintln!("{about}");
    } else {
        println!("{about}");
        println!("{}", GraphRow::table_header());
    }

    let start = Instant::now();
    let mut stdout = std::io::stdout().lock();
    let report = plan_layers(
        &layers,
        &[true, false],
        &target,
        &cache,
        |row, done, total| {
            // Rows stream out as they are planned; progress for the slow ones goes to stderr.
            let line = if args.json {
                row.json_line()
            } else {
                row.table_line()
            };
            let _ = writeln!(stdout, "{line}");
            let _ = stdout.flush();
            if row.build_ms >= 100.0 {
                eprintln!(
                    "[{done}/{total}] {} {} {} {:.0} ms",
                    row.layer,
                    route_name(row.fused),
                    row.graph,
                    row.build_ms
                );
            }
        },
    );
    let stats = cache.stats();
    let elapsed = start.elapsed().as_secs_f64();
    if args.json {
        let _ = writeln!(stdout, "{}", report.summary.json_line());
    } else {
        let _ = writeln!(
            stdout,
            "{} graphs in {elapsed:.1} s: {} built, {} restored, {} cache hits",
            report.rows.len(),
            stats.built,
            stats.restored,
            stats.hits
        );
        let _ = writeln!(stdout, "{}", report.summary);
    }
    eprintln!(
        "done in {elapsed:.1} s ({} built, {} restored, {} hits)",
        stats.built, stats.restored, stats.hits
    );
    ExitCode::SUCCESS
}
