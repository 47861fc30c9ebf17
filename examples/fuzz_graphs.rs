//! Random graphs, layer configs, network specs (per-layer routes, heads of other class counts)
//! and mutated device-properties documents (valid and invalid, extreme values) against the
//! public API, planned deviceless: no case may panic; each invalid one is a typed error;
//! each valid one plans or says why not.
//!
//! ```sh
//! cargo run --release --example fuzz_graphs -- --cases 100000 [--seed N] [--props FILE] [--case HEX]
//! ```
//! Exits 1 when any case breaks the property, printing the first failures with their seeds.

#[macro_use]
mod out;

#[path = "../tests/fuzz/mod.rs"]
mod fuzz;

use clap::Parser;
use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::Target;
use std::process::ExitCode;

/// Random graphs, layer configs, network specs and device-properties documents against the
/// public API, planned deviceless.
#[derive(Debug, Parser)]
#[command(name = "fuzz_graphs")]
struct Args {
    /// Cases to run.
    #[arg(long, default_value_t = 10_000)]
    cases: usize,
    /// Generator seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Device-properties JSON.
    #[arg(long, default_value = "tests/fixtures/devprops/h200-sm90.json")]
    props: String,
    /// Rerun one case by the seed a failure printed (hex), panics not caught.
    #[arg(long, value_parser = parse_hex)]
    case: Option<u64>,
}

fn parse_hex(v: &str) -> Result<u64, String> {
    u64::from_str_radix(v.trim_start_matches("0x"), 16).map_err(|e| format!("`{v}`: {e}"))
}

fn main() -> ExitCode {
    // Usage errors exit 2 and `--help` exits 0 (clap's conventions).
    let Args {
        cases,
        seed,
        props,
        case: one_case,
    } = Args::parse();
    let target = match Target::deviceless_from_file(&props) {
        Ok(t) => Some(t),
        Err(e) => {
            note!("fuzz_graphs: no deviceless target ({e}); cases are validated but not planned");
            None
        }
    };
    let cache = PlanCache::new();
    if let Some(case) = one_case {
        // One case, panics not caught: its backtrace shows where.
        out!("{:?}", fuzz::run_case(case, target.as_ref(), &cache));
        return ExitCode::SUCCESS;
    }
    let start = std::time::Instant::now();
    let totals = fuzz::run(seed, cases, target.as_ref(), &cache, |t| {
        note!(
            "{:>8} cases, {} failures, {} distinct plans, {:.0} s",
            t.cases,
            t.failures(),
            cache.len(),
            start.elapsed().as_secs_f64()
        );
    });
    out!(
        "fuzz_graphs: {} cases (seed {seed}) in {:.1} s; {} distinct plans built\n{}",
        totals.cases,
        start.elapsed().as_secs_f64(),
        cache.len(),
        totals.table()
    );
    out!(
        "totals: rejected {} / planned {} / no engine {} / panicked {} / unexpected {}",
        totals.class("rejected"),
        totals.class("planned"),
        totals.class("no engine"),
        totals.class("panicked"),
        totals.class("unexpected")
    );
    if totals.failures() > 0 {
        note!("first failures:\n{}", totals.failures.join("\n"));
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
