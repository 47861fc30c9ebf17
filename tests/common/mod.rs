//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

pub mod gpu_shapes;

/// The repository root: the working directory when it is one (cargo runs tests there; a
/// bundled binary on the GPU machine runs from a copy of the repository at another path,
/// scripts/gpu-check.sh), else where the test was built.
pub fn repo_root() -> PathBuf {
    if std::path::Path::new("tests/fixtures").is_dir() {
        PathBuf::from(".")
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }
}

/// The device-properties fixtures shipped in tests/fixtures/devprops, as (label, path).
pub fn devprops_fixtures() -> Vec<(&'static str, PathBuf)> {
    let dir = repo_root().join("tests/fixtures/devprops");
    vec![
        ("H200 sm_90", dir.join("h200-sm90.json")),
        ("A100 sm_80", dir.join("a100-sm80.json")),
        ("B200 sm_100", dir.join("b200-sm100.json")),
    ]
}

/// cuDNN for a tier-2 (deviceless) test. Without it: under CI the test fails (CI must really
/// run tier 2); elsewhere it prints one SKIP line naming what is missing and returns None.
pub fn cudnn_or_skip(test: &str) -> Option<&'static cudnn_cbr::sys::Library> {
    match cudnn_cbr::sys::library() {
        Ok(lib) => Some(lib),
        Err(e) => {
            if std::env::var_os("CI").is_some() {
                panic!("{test}: cuDNN is required when CI is set, but it could not be loaded: {e}");
            }
            println!("SKIP {test}: cuDNN not loadable ({}); run scripts/setup-test-deps.sh and source .deps/env.sh",
                e.to_string().lines().next().unwrap_or_default());
            None
        }
    }
}

/// A CUDA device with a loadable cuDNN for a tier-4 test, or `None` after printing the test's
/// one SKIP line (GPU tests never fail for lack of a GPU, in CI or elsewhere).
pub fn gpu_or_skip(test: &str) -> Option<std::sync::Arc<cudarc::driver::CudaContext>> {
    let ctx = match cudnn_cbr::runtime::cuda_device(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("SKIP {test}: {e}");
            return None;
        }
    };
    if let Err(e) = cudnn_cbr::sys::library() {
        println!("SKIP {test}: cuDNN not loadable: {e}");
        return None;
    }
    Some(ctx)
}

/// A CUDA device for a test that runs `ranks` launched NCCL ranks as threads of this process
/// (rank `r` on GPU `r` modulo the GPUs present): the simulated device, whose NCCL ranks are
/// threads on its one device, or a machine with `ranks` GPUs (NCCL refuses two ranks of a
/// communicator on one GPU). Otherwise `false` after the test's one SKIP line.
pub fn nccl_ranks_or_skip(test: &str, ranks: usize) -> bool {
    let Some(ctx) = gpu_or_skip(test) else {
        return false;
    };
    let stream = ctx.new_stream().expect("a stream on the device");
    let handle = cudnn_cbr::fusion::exec::Handle::new(stream).expect("a cuDNN handle");
    let gpus = cudnn_cbr::runtime::cuda_device_count().unwrap_or(0);
    if handle.is_simulated() || gpus >= ranks {
        return true;
    }
    println!(
        "SKIP {test}: {ranks} NCCL ranks need {ranks} GPUs ({gpus} here) or the simulated \
         device (CUDNN_CBR_DEVICE=sim)"
    );
    false
}

/// Deterministic test data: splitmix64 mapped to `[-1, 1)`.
pub fn uniform(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// An example binary: beside the test binary's folder (`target/<profile>/examples`), or in
/// the GPU-check bundle (`example-NAME` beside `test-bad_inputs`).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let candidates = [
        dir.join("../examples").join(name),
        dir.join(format!("example-{name}")),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "example `{name}` is not built (looked at {candidates:?}); `cargo build --workspace --examples` builds it"
            )
        })
}

pub fn run_example(name: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(example(name))
        .args(args)
        .current_dir(repo_root())
        .output()
        .expect("spawn the example");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// The mini network (3 input channels, width 4) with every layer on a cuDNN route planned for
/// `handle`'s device: the GPU classifier tests' model.
pub fn planned_mini(
    handle: &std::sync::Arc<cudnn_cbr::fusion::exec::Handle>,
    batch: usize,
    hw: usize,
    classes: usize,
) -> cudnn_cbr::net::CompiledNet {
    let target = handle.target().expect("the device's planning target");
    let cache = cudnn_cbr::fusion::cache::PlanCache::new();
    let spec = cudnn_cbr::net::Preset::Mini.spec(3, classes, 4);
    let policy = cudnn_cbr::net::RoutePolicy::Planned {
        target: &target,
        cache: &cache,
    };
    cudnn_cbr::net::compile(&spec, batch, hw, &policy).expect("compile the planned mini network")
}

/// Micro-batch `k` of the accumulation tests: `batch` images of `hw`×`hw`×3 from a seeded
/// uniform stream, labels `(i·7 + k) mod classes`.
pub fn micro_batch(
    k: usize,
    batch: usize,
    hw: usize,
    classes: usize,
) -> (Vec<half::f16>, Vec<i32>) {
    let mut s = 0x51ab + k as u64;
    let images = (0..batch * hw * hw * 3)
        .map(|_| half::f16::from_f32(uniform(&mut s)))
        .collect();
    let labels = (0..batch).map(|i| ((i * 7 + k) % classes) as i32).collect();
    (images, labels)
}
