//! Random graphs, layer configs and network specs (valid and invalid, extreme values) against
//! the public API, planned deviceless: no case may panic; each invalid one is a typed error;
//! each valid one plans or says why not.
//!
//! ```sh
//! cargo run --release --example fuzz_graphs -- --cases 100000 [--seed N] [--props FILE]
//! ```
//! Exits 1 when any case breaks the property, printing the first failures with their seeds.

#[path = "../tests/fuzz/mod.rs"]
mod fuzz;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::Target;
use std::process::ExitCode;

const USAGE: &str = "usage: fuzz_graphs [--cases N] [--seed N] [--props FILE] [--case HEX]\n\
     \x20 --cases N     cases to run (default 10000)\n\
     \x20 --seed N      generator seed (default 1)\n\
     \x20 --props FILE  device-properties JSON (default: tests/fixtures/devprops/h200-sm90.json)\n\
     \x20 --case HEX    rerun one case by the seed a failure printed, panics not caught";

fn main() -> ExitCode {
    let mut cases = 10_000usize;
    let mut seed = 1u64;
    let mut props = "tests/fixtures/devprops/h200-sm90.json".to_string();
    let mut one_case: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let parsed = match arg.as_str() {
            "--cases" => value("--cases")
                .and_then(|v| v.parse().map_err(|e| format!("--cases {v}: {e}")))
                .map(|v| cases = v),
            "--seed" => value("--seed")
                .and_then(|v| v.parse().map_err(|e| format!("--seed {v}: {e}")))
                .map(|v| seed = v),
            "--props" => value("--props").map(|v| props = v),
            "--case" => value("--case")
                .and_then(|v| {
                    u64::from_str_radix(v.trim_start_matches("0x"), 16)
                        .map_err(|e| format!("--case {v}: {e}"))
                })
                .map(|v| one_case = Some(v)),
            "--help" | "-h" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => Err(format!("unknown argument `{other}`")),
        };
        if let Err(e) = parsed {
            eprintln!("fuzz_graphs: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    let target = match Target::deviceless_from_file(&props) {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!(
                "fuzz_graphs: no deviceless target ({e}); cases are validated but not planned"
            );
            None
        }
    };
    let cache = PlanCache::new();
    if let Some(case) = one_case {
        // One case, panics not caught: its backtrace shows where.
        println!("{:?}", fuzz::run_case(case, target.as_ref(), &cache));
        return ExitCode::SUCCESS;
    }
    let start = std::time::Instant::now();
    let totals = fuzz::run(seed, cases, target.as_ref(), &cache, |t| {
        eprintln!(
            "{:>8} cases, {} failures, {} distinct plans, {:.0} s",
            t.cases,
            t.failures(),
            cache.len(),
            start.elapsed().as_secs_f64()
        );
    });
    println!(
        "fuzz_graphs: {} cases (seed {seed}) in {:.1} s; {} distinct plans built\n{}",
        totals.cases,
        start.elapsed().as_secs_f64(),
        cache.len(),
        totals.table()
    );
    println!(
        "totals: rejected {} / planned {} / no engine {} / panicked {} / unexpected {}",
        totals.class("rejected"),
        totals.class("planned"),
        totals.class("no engine"),
        totals.class("panicked"),
        totals.class("unexpected")
    );
    if totals.failures() > 0 {
        eprintln!("first failures:\n{}", totals.failures.join("\n"));
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
