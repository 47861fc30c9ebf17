//! Tier 3: every source of the network's own kernels compiles with NVRTC for sm_80, sm_90 and
//! sm_100, and the PTX defines every entry point the launch module will look up, with exactly
//! the parameter types it passes (`kernels::signature`); also the machine code (cubins for
//! sm_90 and sm_80) the device loads first.
//!
//! Needs what amp's `nvrtc_compile` needs (`source .deps/env.sh`); without it the tests print
//! one `SKIP nvrtc_compile: <reason>` line, or fail when `CI` is set.

use cudnn_cbr_amp::kernels::CudaArch;
use cudnn_cbr_netops::kernels;

/// The checks shared with amp's `nvrtc_compile`.
#[path = "../../3-amp/tests/nvrtc/mod.rs"]
mod nvrtc;
use nvrtc::{environment, unavailable};

#[test]
fn every_kernel_compiles_for_every_arch() {
    nvrtc::every_kernel_compiles_for_every_arch(&kernels::ALL, kernels::signature);
}

#[test]
fn every_source_compiles_to_ptx_and_machine_code_without_a_device() {
    if let Err(reason) = environment() {
        return unavailable(&reason);
    }
    let ptx = cudnn_cbr_amp::cuda::compile_ptx(&kernels::ALL, CudaArch::Sm90)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ptx.len(), kernels::ALL.len());
    for (source, text) in &ptx {
        assert!(text.contains(".target sm_90"), "{}", source.file);
        for e in source.entry_points {
            assert!(text.contains(&format!(".entry {e}(")), "{e}");
        }
    }
    let cubins = cudnn_cbr_amp::cuda::compile_cubin(&kernels::ALL, "sm_90")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cubins.len(), kernels::ALL.len());
    for (source, cubin) in &cubins {
        assert_eq!(&cubin[..4], b"\x7fELF", "{}: not an ELF image", source.file);
        for e in source.entry_points {
            let named = cubin.windows(e.len()).any(|w| w == e.as_bytes());
            assert!(named, "{}: no symbol `{e}`", source.file);
        }
    }
}
