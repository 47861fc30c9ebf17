//! Bad inputs: both examples' command lines.

use super::*;

/// The example exits with `code` (never a signal, never a panic) and says `needle`.
pub(super) fn example_exits(name: &str, args: &[&str], code: i32, needle: &str) -> Verdict {
    let (got, text) = common::run_example(name, args);
    assert_eq!(got, Some(code), "{name} {args:?}:\n{text}");
    assert!(
        !text.contains("panicked at"),
        "{name} {args:?} panicked:\n{text}"
    );
    assert!(
        text.contains(needle),
        "{name} {args:?} did not say `{needle}`:\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_default();
    if code == 0 {
        Verdict::Recovered(line.to_string())
    } else {
        Verdict::Typed(line.to_string())
    }
}

pub(super) fn example_rows() -> Vec<Row> {
    vec![
        ("train_cbr", "--help", || {
            example_exits("train_cbr", &["--help"], 0, "Usage")
        }),
        ("train_cbr", "an unknown flag", || {
            example_exits("train_cbr", &["--frobnicate"], 2, "frobnicate")
        }),
        ("train_cbr", "--width 4294967296", || {
            example_exits("train_cbr", &["--width", "4294967296"], 1, "width")
        }),
        ("train_cbr", "--batch 1099511627776", || {
            example_exits("train_cbr", &["--batch", "1099511627776"], 1, "beyond")
        }),
        ("train_cbr", "--steps not-a-number", || {
            example_exits("train_cbr", &["--steps", "many"], 2, "steps")
        }),
        ("train_cbr", "--net that does not exist", || {
            example_exits("train_cbr", &["--net", "resnet7"], 2, "resnet7")
        }),
        ("train_cbr", "--batch 0", || {
            example_exits("train_cbr", &["--batch", "0"], 1, "batch ≥ 2")
        }),
        ("deviceless_plans", "--help", || {
            example_exits("deviceless_plans", &["--help"], 0, "Usage")
        }),
        ("deviceless_plans", "--props that does not exist", || {
            example_exits(
                "deviceless_plans",
                &["--props", "/nonexistent.json"],
                1,
                "/nonexistent.json",
            )
        }),
        ("deviceless_plans", "--batch 0", || {
            example_exits("deviceless_plans", &["--batch", "0"], 2, "batch")
        }),
        ("deviceless_plans", "--net that does not exist", || {
            example_exits("deviceless_plans", &["--net", "resnet7"], 2, "resnet7")
        }),
        ("deviceless_plans", "a flag without its value", || {
            example_exits("deviceless_plans", &["--hw"], 2, "--hw")
        }),
        (
            "train_cbr",
            "--hw 2147483648 on the CPU (was: a panic)",
            || {
                example_exits(
                    "train_cbr",
                    &["--hw", "2147483648", "--device", "cpu"],
                    1,
                    "beyond 35184372088832",
                )
            },
        ),
        ("train_cbr", "--hw 2147483648 (was: a panic)", || {
            example_exits("train_cbr", &["--hw", "2147483648"], 1, "hw")
        }),
        ("train_cbr", "--steps 1099511627776 (was: an abort)", || {
            example_exits(
                "train_cbr",
                &["--steps", "1099511627776", "--device", "cpu"],
                1,
                "steps must be at most 16777216",
            )
        }),
        ("train_cbr", "--steps u64::MAX (was: an abort)", || {
            example_exits(
                "train_cbr",
                &["--steps", "18446744073709551615"],
                1,
                "steps must be at most 16777216",
            )
        }),
        ("deviceless_plans", "--hw 2147483648 (was: a panic)", || {
            example_exits(
                "deviceless_plans",
                &["--hw", "2147483648"],
                1,
                "beyond 35184372088832",
            )
        }),
        (
            "custom_trainer",
            "--steps 0 (was: an index out of bounds)",
            || {
                example_exits(
                    "custom_trainer",
                    &["--steps", "0", "--device", "cpu"],
                    2,
                    "must be in 1..=1000000, got 0",
                )
            },
        ),
        ("custom_trainer", "--steps u64::MAX", || {
            example_exits(
                "custom_trainer",
                &["--steps", "18446744073709551615", "--device", "cpu"],
                2,
                "must be in 1..=1000000",
            )
        }),
        ("fuzz_graphs", "--help", || {
            example_exits("fuzz_graphs", &["--help"], 0, "Usage")
        }),
        ("fuzz_graphs", "a --case that is not hex", || {
            example_exits("fuzz_graphs", &["--case", "xyz"], 2, "xyz")
        }),
    ]
}
