//! The fuzz property in CI: a few thousand random graphs, layer configs, network specs and
//! device-properties documents (valid and invalid, extreme values included) against the public API, planned deviceless
//! for the H200 fixture. `cargo run --release --example fuzz_graphs -- --cases N` runs any
//! number of them.

mod common;
#[path = "fuzz/mod.rs"]
mod fuzz;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::Target;

/// Cases in CI: enough for every template and fault to occur many times (each is drawn with
/// probability ≥ 1/100), bounded by the distinct valid graphs cuDNN compiles once each. Run
/// as two halves with their own seeds, which the test harness runs side by side (planning is
/// single-threaded: two halves take about half the time on two cores).
const CI_CASES: usize = 2000;

#[test]
fn random_inputs_never_panic_and_every_valid_one_plans_or_says_why() {
    fuzz_half("random_inputs_never_panic", 0x5EED_CB12);
}

#[test]
fn random_inputs_never_panic_second_half() {
    fuzz_half("random_inputs_never_panic_second_half", 0x5EED_CB13);
}

/// `CI_CASES / 2` cases from `seed`, planned for the H200 fixture with a cache of their own.
fn fuzz_half(test: &str, seed: u64) {
    let Some(_) = common::cudnn_or_skip(test) else {
        return;
    };
    let cases = CI_CASES / 2;
    let props = common::repo_root().join("tests/fixtures/devprops/h200-sm90.json");
    let target = Target::deviceless_from_file(&props).unwrap();
    let cache = PlanCache::new();
    let start = std::time::Instant::now();
    let totals = fuzz::run(seed, cases, Some(&target), &cache, |t| {
        println!(
            "{test}: {} cases, {} failures so far",
            t.cases,
            t.failures()
        );
    });
    println!(
        "{test}: {} cases in {:.1} s, {} distinct plans\n{}",
        totals.cases,
        start.elapsed().as_secs_f64(),
        cache.len(),
        totals.table()
    );
    assert_eq!(
        totals.failures(),
        0,
        "failures:\n{}",
        totals.failures.join("\n")
    );
    // The generator must really reach every class, or the property says little.
    for class in ["rejected", "planned"] {
        assert!(
            totals.class(class) >= cases / 20,
            "too few `{class}` cases:\n{}",
            totals.table()
        );
    }
}

#[test]
fn the_generator_is_deterministic_and_runs_without_cudnn() {
    let cache = PlanCache::new();
    let a = fuzz::run(7, 500, None, &cache, |_| {});
    let b = fuzz::run(7, 500, None, &cache, |_| {});
    assert_eq!(a.by_outcome, b.by_outcome);
    assert_eq!(a.failures(), 0, "{}", a.failures.join("\n"));
}
