//! Bad inputs: the five programs' command lines and environment.

use super::*;

/// As [`example_exits`], with `env` set for the program.
pub(super) fn example_env_exits(
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
    code: i32,
    needle: &str,
) -> Verdict {
    let out = Command::new(common::example(name))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(common::repo_root())
        .output()
        .expect("spawn the example");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(code),
        "{name} {args:?} {env:?}:\n{text}"
    );
    assert!(
        !text.contains("panicked at"),
        "{name} {args:?} panicked:\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{name} {args:?} {env:?} did not say `{needle}`:\n{text}"));
    if code == 0 {
        Verdict::Recovered(line.to_string())
    } else {
        Verdict::Typed(line.to_string())
    }
}

/// A FIFO for a program's file argument, made fresh.
pub(super) fn fifo_arg(tag: &str) -> String {
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("props.json");
    mkfifo(&fifo);
    fifo.display().to_string()
}

pub(super) const NO_DEVICE_ENV: [(&str, &str); 1] = [("CUDNN_CBR_DEVICE", "bogus")];

pub(super) fn program_rows() -> Vec<Row> {
    vec![
        ("train_cbr", "--lr=-1", || {
            example_exits(
                "train_cbr",
                &["--lr=-1", "--device", "cpu"],
                1,
                "invalid lr = -1",
            )
        }),
        ("train_cbr", "--lr nan", || {
            example_exits(
                "train_cbr",
                &["--lr", "nan", "--device", "cpu"],
                1,
                "invalid lr = NaN",
            )
        }),
        ("train_cbr", "--device tpu", || {
            example_exits(
                "train_cbr",
                &["--device", "tpu"],
                2,
                "device must be auto, cuda or cpu, got `tpu`",
            )
        }),
        ("train_cbr", "--cuda-graph sometimes", || {
            example_exits(
                "train_cbr",
                &["--cuda-graph", "sometimes"],
                2,
                "CUDA graph mode must be off, finish or step, got `sometimes`",
            )
        }),
        ("train_cbr", "--lr-schedule linear", || {
            example_exits(
                "train_cbr",
                &["--lr-schedule", "linear"],
                2,
                "the learning-rate schedule must be constant or cosine, got `linear`",
            )
        }),
        ("train_cbr", "--data imagenet", || {
            example_exits(
                "train_cbr",
                &["--data", "imagenet"],
                2,
                "data must be `synthetic` or `cifar10:DIR`",
            )
        }),
        (
            "train_cbr",
            "--data cifar10: a folder without the files",
            || {
                example_exits(
                    "train_cbr",
                    &["--data", "cifar10:/nonexistent", "--device", "cpu"],
                    1,
                    "CIFAR-10 file /nonexistent/data_batch_1.bin is missing",
                )
            },
        ),
        ("train_cbr", "--data cifar10: a file, not a folder", || {
            example_exits(
                "train_cbr",
                &["--data", "cifar10:/etc/passwd", "--device", "cpu"],
                1,
                "/etc/passwd/data_batch_1.bin",
            )
        }),
        ("train_cbr", "--ranks 0", || {
            example_exits(
                "train_cbr",
                &["--ranks", "0", "--device", "cpu"],
                1,
                "ranks must be in 1..=1024",
            )
        }),
        (
            "train_cbr",
            "--ranks 2 on a CIFAR-10 folder without its files",
            || {
                example_exits(
                    "train_cbr",
                    &[
                        "--ranks",
                        "2",
                        "--data",
                        "cifar10:/nonexistent-cifar",
                        "--device",
                        "cpu",
                    ],
                    1,
                    "/nonexistent-cifar/data_batch_1.bin",
                )
            },
        ),
        ("train_cbr", "--width 0", || {
            example_exits(
                "train_cbr",
                &["--width", "0", "--device", "cpu"],
                1,
                "width ≥ 1",
            )
        }),
        ("train_cbr", "--device cuda without a GPU", || {
            example_exits(
                "train_cbr",
                &["--device", "cuda", "--steps", "1"],
                1,
                "no usable CUDA device",
            )
        }),
        ("train_cbr", "CUDNN_CBR_DEVICE=bogus --device cuda", || {
            example_env_exits(
                "train_cbr",
                &["--device", "cuda", "--steps", "1"],
                &NO_DEVICE_ENV,
                1,
                "CUDNN_CBR_DEVICE is `bogus`; expected `sim`",
            )
        }),
        (
            "train_cbr",
            "CUDNN_CBR_DEVICE=bogus, device auto (falls back)",
            || {
                example_env_exits(
                    "train_cbr",
                    &["--steps", "1"],
                    &NO_DEVICE_ENV,
                    0,
                    "CUDNN_CBR_DEVICE is `bogus`",
                )
            },
        ),
        ("train_cbr", "RANK 5 of WORLD_SIZE 2", || {
            example_env_exits(
                "train_cbr",
                &["--device", "cpu", "--steps", "1"],
                &[("RANK", "5"), ("WORLD_SIZE", "2")],
                1,
                "rank is not below the world size 2",
            )
        }),
        ("train_cbr", "WORLD_SIZE=x", || {
            example_env_exits(
                "train_cbr",
                &["--device", "cpu", "--steps", "1"],
                &[("RANK", "0"), ("WORLD_SIZE", "x")],
                1,
                "WORLD_SIZE=\"x\": not a non-negative integer",
            )
        }),
        ("custom_trainer", "--help", || {
            example_exits("custom_trainer", &["--help"], 0, "Usage")
        }),
        ("custom_trainer", "--device tpu", || {
            example_exits(
                "custom_trainer",
                &["--device", "tpu"],
                2,
                "invalid value 'tpu'",
            )
        }),
        ("custom_trainer", "--steps abc", || {
            example_exits(
                "custom_trainer",
                &["--steps", "abc"],
                2,
                "`abc` is not a step count",
            )
        }),
        ("custom_trainer", "an unknown flag", || {
            example_exits(
                "custom_trainer",
                &["--bogus"],
                2,
                "unexpected argument '--bogus'",
            )
        }),
        ("custom_trainer", "--device cuda without a GPU", || {
            example_exits(
                "custom_trainer",
                &["--device", "cuda", "--steps", "1"],
                1,
                "--device cuda: no GPU",
            )
        }),
        (
            "custom_trainer",
            "CUDNN_CBR_DEVICE=bogus --device cuda",
            || {
                example_env_exits(
                    "custom_trainer",
                    &["--device", "cuda", "--steps", "1"],
                    &NO_DEVICE_ENV,
                    1,
                    "CUDNN_CBR_DEVICE is `bogus`",
                )
            },
        ),
        ("deviceless_plans", "--props /dev/null", || {
            example_exits(
                "deviceless_plans",
                &["--props", "/dev/null"],
                1,
                "is a character device, not a regular file",
            )
        }),
        ("deviceless_plans", "--props a folder", || {
            example_exits(
                "deviceless_plans",
                &["--props", "/etc"],
                1,
                "/etc: is a folder, not a regular file",
            )
        }),
        ("deviceless_plans", "--props a FIFO (was: a hang)", || {
            let fifo = fifo_arg("plans-fifo");
            example_exits(
                "deviceless_plans",
                &["--props", &fifo],
                1,
                "is a FIFO (named pipe), not a regular file",
            )
        }),
        (
            "deviceless_plans",
            "--props a file that is not JSON",
            || {
                example_exits(
                    "deviceless_plans",
                    &["--props", "Cargo.toml"],
                    1,
                    "(Cargo.toml): not valid JSON",
                )
            },
        ),
        ("deviceless_plans", "--props with warpSize 16", || {
            let dir = scratch("plans-warp");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("props.json");
            std::fs::write(
                &path,
                H200_JSON.replace("\"warpSize\": 32", "\"warpSize\": 16"),
            )
            .unwrap();
            let p = path.display().to_string();
            example_exits(
                "deviceless_plans",
                &["--props", &p],
                1,
                "`warpSize` must be 32 on every NVIDIA GPU, got 16",
            )
        }),
        ("deviceless_plans", "--threads abc", || {
            example_exits(
                "deviceless_plans",
                &["--threads", "abc"],
                2,
                "invalid value 'abc' for '--threads",
            )
        }),
        ("device_props", "--help", || {
            example_exits("device_props", &["--help"], 0, "Usage")
        }),
        ("device_props", "three positional arguments", || {
            example_exits(
                "device_props",
                &["a", "b", "c"],
                2,
                "unexpected argument 'c'",
            )
        }),
        ("device_props", "an unknown flag", || {
            example_exits(
                "device_props",
                &["--bogus"],
                2,
                "unexpected argument '--bogus'",
            )
        }),
        ("device_props", "no GPU", || {
            let out = scratch("device-props-out").display().to_string();
            example_exits("device_props", &[&out], 1, "device_props: no CUDA device")
        }),
        ("device_props", "CUDNN_CBR_DEVICE=bogus", || {
            let out = scratch("device-props-env").display().to_string();
            example_env_exits(
                "device_props",
                &[&out],
                &NO_DEVICE_ENV,
                1,
                "CUDNN_CBR_DEVICE is `bogus`",
            )
        }),
        ("fuzz_graphs", "--cases abc", || {
            example_exits(
                "fuzz_graphs",
                &["--cases", "abc"],
                2,
                "invalid value 'abc' for '--cases",
            )
        }),
        ("fuzz_graphs", "a --case beyond 64 bits", || {
            example_exits(
                "fuzz_graphs",
                &["--case", "123456789012345678901234"],
                2,
                "number too large",
            )
        }),
        (
            "fuzz_graphs",
            "--props that does not exist (validates only)",
            || {
                example_exits(
                    "fuzz_graphs",
                    &["--props", "/nonexistent.json", "--cases", "3"],
                    0,
                    "device-properties file /nonexistent.json: no such file",
                )
            },
        ),
        (
            "fuzz_graphs",
            "--props a FIFO (validates only; was: a hang)",
            || {
                let fifo = fifo_arg("fuzz-fifo");
                example_exits(
                    "fuzz_graphs",
                    &["--props", &fifo, "--cases", "3"],
                    0,
                    "is a FIFO (named pipe), not a regular file",
                )
            },
        ),
    ]
}
