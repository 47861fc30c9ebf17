//! Tier 3: every AMP kernel source compiles with NVRTC for sm_80, sm_90 and sm_100, and the
//! PTX defines every entry point the launch module will look up, with exactly the parameter
//! types the launch module passes (`kernels::signature`).
//!
//! Needs `libnvrtc.so.13` on the loader path and `CUDNN_CBR_CUDA_INCLUDE` pointing at the
//! CUDA headers (`source .deps/env.sh` sets both). Without them the test prints one
//! `SKIP nvrtc_compile: <reason>` line, or fails when `CI` is set: in CI tier 3 must run.
//!
//! Also the machine-code path (cubins for sm_90 and sm_80) the device loads first.
//!
//! Set `AMP_PTX_DUMP_DIR` to keep the PTX (`<file>.<sm>.ptx`) for inspection.

use std::path::Path;
use std::time::{Duration, Instant};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError};
use cudnn_cbr_amp::kernels::{self, CudaArch, CUDA_INCLUDE_ENV};

/// Skips (prints why) or, in CI, fails.
fn unavailable(reason: &str) {
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
fn environment() -> Result<String, String> {
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

#[test]
fn every_kernel_compiles_for_every_arch() {
    let include = match environment() {
        Ok(dir) => dir,
        Err(reason) => return unavailable(&reason),
    };
    let mut failures = Vec::new();
    let mut report = Vec::new();
    for arch in CudaArch::ALL {
        let started = Instant::now();
        for k in kernels::ALL {
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
                // The launch module passes exactly `kernels::signature(e)`: it must be the
                // PTX's parameter list, type by type.
                let decl = &ptx[at..];
                let decl = &decl[..decl.find(')').unwrap_or(decl.len())];
                let params: Vec<&str> = decl
                    .lines()
                    .filter_map(|l| l.trim().strip_prefix(".param "))
                    .filter_map(|l| l.split_whitespace().next())
                    .collect();
                let expected: Vec<&str> = kernels::signature(e)
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
            kernels::ALL.len(),
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

#[test]
fn the_launch_module_compiles_every_source_without_a_device() {
    if let Err(reason) = environment() {
        return unavailable(&reason);
    }
    let found = cudnn_cbr_amp::cuda::cuda_include_dir().expect("include dir from the env");
    assert!(found.join("cuda_fp16.h").is_file());
    let ptx = cudnn_cbr_amp::cuda::compile_ptx(CudaArch::Sm90).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ptx.len(), kernels::ALL.len());
    for (source, text) in &ptx {
        assert!(text.contains(".target sm_90"), "{}", source.file);
        for e in source.entry_points {
            assert!(text.contains(&format!(".entry {e}(")), "{e}");
        }
    }
}

/// The machine-code path the device loads first: an ELF cubin per source for the H200's
/// sm_90 (and A100's sm_80), naming every entry point, with the same flags as the PTX.
#[test]
fn every_source_compiles_to_machine_code_without_a_device() {
    if let Err(reason) = environment() {
        return unavailable(&reason);
    }
    for (major, minor) in [(9, 0), (8, 0)] {
        let sm = cudnn_cbr_runtime::rtc::real_arch(major, minor).expect("a listed architecture");
        let cubins = cudnn_cbr_amp::cuda::compile_cubin(sm).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cubins.len(), kernels::ALL.len());
        for (source, cubin) in &cubins {
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "{} for {sm}: not an ELF image",
                source.file
            );
            for e in source.entry_points {
                let named = cubin.windows(e.len()).any(|w| w == e.as_bytes());
                assert!(named, "{} for {sm}: no symbol `{e}`", source.file);
            }
        }
        println!("nvrtc_compile: {} cubins for {sm}", cubins.len());
    }
}

/// The disk cache of the machine code: the first build compiles and stores, the second loads
/// the same bytes without NVRTC compiling anything, another architecture is another entry.
/// (The times printed are for the note, not asserted.)
#[test]
fn machine_code_comes_back_from_the_kernel_cache() {
    use cudnn_cbr_runtime::kernel_cache::{CacheOutcome, KernelCache};
    if let Err(reason) = environment() {
        return unavailable(&reason);
    }
    let dir = std::env::temp_dir().join(format!("cbr-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = KernelCache::at(&dir);
    let timed = |sm| {
        let t = Instant::now();
        let r = cudnn_cbr_amp::cuda::compile_cubin_cached(sm, Some(&cache)).unwrap();
        (r, t.elapsed())
    };
    let ((cold, first), t_cold) = timed("sm_90");
    assert_eq!(first, CacheOutcome::Stored);
    let ((warm, second), t_warm) = timed("sm_90");
    assert_eq!(second, CacheOutcome::Hit);
    assert_eq!(cold.len(), kernels::ALL.len());
    for ((s1, c1), (s2, c2)) in cold.iter().zip(&warm) {
        assert_eq!(s1.file, s2.file);
        assert_eq!(c1, c2, "{}: the cached cubin differs", s1.file);
    }
    let ((_, other), _) = timed("sm_80");
    assert_eq!(
        other,
        CacheOutcome::Stored,
        "another architecture, another entry"
    );
    println!(
        "nvrtc_compile: amp machine code for sm_90 compiled in {:.2} s, from the kernel cache in {:.1} ms",
        t_cold.as_secs_f64(),
        t_warm.as_secs_f64() * 1e3
    );
    let _ = std::fs::remove_dir_all(&dir);
}
