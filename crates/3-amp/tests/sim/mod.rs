//! The simulated device's build folder for the sim_* tests: `CUDNN_CBR_SIM_DIR` when set, else
//! a folder under the test target (or the temporary folder), built there by tools/sim/build.sh
//! (which rebuilds only what is stale).

#![allow(dead_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root: the working directory's when it holds tools/sim/ (a bundled binary runs
/// from a copy of the repository elsewhere), else where the test was built.
pub fn repo() -> Option<PathBuf> {
    [
        PathBuf::from("."),
        PathBuf::from("../.."),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
    ]
    .into_iter()
    .find(|r| r.join("tools/sim/build.sh").is_file())
}

/// Where the CUDA headers the simulated driver is built against live, if anywhere.
fn cuda_include(repo: &Path) -> Option<PathBuf> {
    std::env::var_os("CUDNN_CBR_CUDA_INCLUDE")
        .map(PathBuf::from)
        .into_iter()
        .chain(Some(repo.join(".deps/include")))
        .find(|d| d.join("cuda.h").is_file())
}

/// A folder holding the built simulator, or `None` after printing `SKIP <test>: <reason>`
/// where it cannot be built (no tools/sim/ sources or CUDA headers: a bundled binary on a machine
/// without the test dependencies). A build that fails is a test failure.
pub fn built(test: &str) -> Option<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = DIR.get_or_init(|| {
        let repo = repo().ok_or("the tools/sim/ sources are not here")?;
        let include = cuda_include(&repo).ok_or(
            "no CUDA headers (cuda.h) for the simulated driver: run scripts/setup-test-deps.sh",
        )?;
        let dir = std::env::var_os("CUDNN_CBR_SIM_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let t = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
                let base = if t.is_dir() { t } else { std::env::temp_dir() };
                base.join("cudnn-cbr-sim")
            });
        let status = Command::new("bash")
            .arg(repo.join("tools/sim/build.sh"))
            .arg(&dir)
            .env("CUDNN_CBR_CUDA_INCLUDE", include)
            .status()
            .expect("run tools/sim/build.sh");
        assert!(
            status.success(),
            "tools/sim/build.sh {} failed",
            dir.display()
        );
        Ok(dir)
    });
    match r {
        Ok(d) => Some(d.clone()),
        Err(why) => {
            println!("SKIP {test}: {why}");
            None
        }
    }
}

/// Whether the simulated device is selected in this process (`CUDNN_CBR_DEVICE=sim`): a
/// sim_* test's child run, or a run under `scripts/sim-env.sh`.
pub fn selected() -> bool {
    std::env::var_os("CUDNN_CBR_DEVICE").is_some_and(|d| d == "sim")
}

/// `cmd` set to run on the simulated device built in `dir`: the simulator selected, its
/// folder first on the loader path (its driver and NVRTC) and NCCL's (`NCCL_LIB_DIR`, so that
/// dist opens the simulated NCCL, not a real one found elsewhere), its own kernel and
/// host-code caches (as `scripts/sim-env.sh`).
pub fn select<'a>(cmd: &'a mut Command, dir: &Path) -> &'a mut Command {
    let mut path = OsString::from(dir);
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    cmd.env("CUDNN_CBR_DEVICE", "sim")
        .env("LD_LIBRARY_PATH", path)
        .env("NCCL_LIB_DIR", dir)
        .env("CUDNN_CBR_KERNEL_CACHE", dir.join("kernel-cache"))
        .env("CUDNN_CBR_SIM_CACHE", dir.join("host-cache"))
}

/// This test binary again, on the simulated device built in `dir` ([`select`]); eager, or
/// in the adversarial stream order with `adversarial`.
pub fn child(dir: &Path, adversarial: bool) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("this test binary"));
    select(&mut c, dir);
    if adversarial {
        c.env("CUDNN_CBR_SIM_ADVERSARIAL", "1");
    } else {
        c.env_remove("CUDNN_CBR_SIM_ADVERSARIAL");
    }
    c
}

/// What a child run gave: whether it succeeded, its stdout and its stderr.
pub struct Ran {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` to its end and prints its output under `what`.
pub fn run(what: &str, cmd: &mut Command) -> Ran {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let ran = Ran {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    println!("{what} ({}):\n{}\n{}", out.status, ran.stdout, ran.stderr);
    ran
}
