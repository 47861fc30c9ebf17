//! The NVRTC checks shared by amp's and netops' `nvrtc_compile` tests (`mod nvrtc;` there):
//! whether this machine can run them, and every source of a kernel family compiled for every
//! architecture with its PTX checked against the launch module's signatures.

use std::path::Path;
use std::time::{Duration, Instant};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError};
use cudnn_cbr_amp::kernels::{self, CudaArch, KernelSource, ParamType, CUDA_INCLUDE_ENV};

/// Skips (prints why) or, in CI, fails.
pub fn unavailable(reason: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("nvrtc_compile must run in CI but cannot: {reason}");
    }
    println!("SKIP nvrtc_compile: {reason}");
}

fn nvrtc_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen NVRTC under its known names and closes
    // it again. Loading runs the library's initialisers; NVRTC's do not touch this process's
    // state. We call it precisely so that cudarc does not panic on a missing library later.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Why the test cannot run here, if it cannot; otherwise the include directory.
pub fn environment() -> Result<String, String> {
    if !nvrtc_library_present() {
        return Err(
            "NVRTC library (libnvrtc.so.13) not found on the loader path; \
                    run `source .deps/env.sh` or set LD_LIBRARY_PATH"
                .to_owned(),
        );
    }
    let Some(dir) = kernels::cuda_include_dir() else {
        return Err(format!(
            "{CUDA_INCLUDE_ENV} is not set (the directory holding cuda_fp16.h)"
        ));
    };
    if !Path::new(&dir).join("cuda_fp16.h").is_file() {
        return Err(format!(
            "{CUDA_INCLUDE_ENV}={} has no cuda_fp16.h",
            dir.display()
        ));
    }
    dir.into_os_string()
        .into_string()
        .map_err(|d| format!("{CUDA_INCLUDE_ENV}={d:?} is not UTF-8"))
}

fn describe(e: &CompileError) -> String {
    match e {
        CompileError::CompileError {
            nvrtc,
            options,
            log,
        } => format!(
            "{nvrtc:?} with options {options:?}\n{}",
            log.to_string_lossy()
        ),
        other => format!("{other:?}"),
    }
}

/// Every source of `sources` compiles with NVRTC for every architecture, and the PTX defines
/// each entry point with exactly the parameter types of `signature`: the test body of both
/// crates' `every_kernel_compiles_for_every_arch`.
pub fn every_kernel_compiles_for_every_arch(
    sources: &[KernelSource],
    signature: fn(&str) -> Option<&'static [ParamType]>,
) {
    let include = match environment() {
        Ok(dir) => dir,
        Err(reason) => return unavailable(&reason),
    };
    let mut failures = Vec::new();
    let mut report = Vec::new();
    for arch in CudaArch::ALL {
        let started = Instant::now();
        for &k in sources {
            let opts = kernels::compile_options(&k, arch, Some(&include));
            let ptx = match compile_ptx_with_opts(k.program(), opts) {
                Ok(ptx) => ptx.to_src(),
                Err(e) => {
                    failures.push(format!(
                        "{} for {}: {}",
                        k.file,
                        arch.sm_name(),
                        describe(&e)
                    ));
                    continue;
                }
            };
            if let Some(dir) = std::env::var_os("AMP_PTX_DUMP_DIR") {
                let path = Path::new(&dir).join(format!("{}.{}.ptx", k.file, arch.sm_name()));
                if let Err(e) = std::fs::write(&path, &ptx) {
                    failures.push(format!("cannot write {}: {e}", path.display()));
                }
            }
            let target = format!(".target {}", arch.ptx_target());
            if !ptx.contains(&target) {
                failures.push(format!(
                    "{} for {}: PTX lacks `{target}`",
                    k.file,
                    arch.sm_name()
                ));
            }
            for e in k.entry_points {
                let Some(at) = ptx.find(&format!(".entry {e}(")) else {
                    failures.push(format!(
                        "{} for {}: PTX lacks entry `{e}`",
                        k.file,
                        arch.sm_name()
                    ));
                    continue;
                };
                // The launch module passes exactly `signature(e)`: it must be the
                // PTX's parameter list, type by type.
                let decl = &ptx[at..];
                let decl = &decl[..decl.find(')').unwrap_or(decl.len())];
                let params: Vec<&str> = decl
                    .lines()
                    .filter_map(|l| l.trim().strip_prefix(".param "))
                    .filter_map(|l| l.split_whitespace().next())
                    .collect();
                let expected: Vec<&str> = signature(e)
                    .unwrap_or(&[])
                    .iter()
                    .map(|t| t.ptx())
                    .collect();
                if params != expected {
                    failures.push(format!(
                        "{} for {}: `{e}` takes {params:?} in PTX, the launch module passes \
                         {expected:?}",
                        k.file,
                        arch.sm_name()
                    ));
                }
            }
        }
        report.push((arch, started.elapsed()));
    }
    for (arch, took) in &report {
        println!(
            "nvrtc_compile: {} sources for {} in {:.2} s",
            sources.len(),
            arch.sm_name(),
            Duration::as_secs_f64(took)
        );
    }
    assert!(
        failures.is_empty(),
        "NVRTC failures:\n{}",
        failures.join("\n\n")
    );
}
