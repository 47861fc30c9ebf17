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

use std::time::Instant;

use cudnn_cbr_amp::kernels::{self, CudaArch};

mod nvrtc;
use nvrtc::{environment, unavailable};

#[test]
fn every_kernel_compiles_for_every_arch() {
    nvrtc::every_kernel_compiles_for_every_arch(&kernels::ALL, kernels::signature);
}

#[test]
fn the_launch_module_compiles_every_source_without_a_device() {
    if let Err(reason) = environment() {
        return unavailable(&reason);
    }
    let found = cudnn_cbr_amp::cuda::cuda_include_dir().expect("include dir from the env");
    assert!(found.join("cuda_fp16.h").is_file());
    let ptx = cudnn_cbr_amp::cuda::compile_ptx(&kernels::ALL, CudaArch::Sm90)
        .unwrap_or_else(|e| panic!("{e}"));
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
        let cubins =
            cudnn_cbr_amp::cuda::compile_cubin(&kernels::ALL, sm).unwrap_or_else(|e| panic!("{e}"));
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
        let r = cudnn_cbr_amp::cuda::compile_cubin_cached("amp", &kernels::ALL, sm, Some(&cache))
            .unwrap();
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
