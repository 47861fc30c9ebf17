//! Helpers shared by the netops integration tests (`mod common;` in each test file that uses
//! them): amp's test helpers (the splitmix64 test-data source, buffers in and out), and device
//! 0 with the network's kernels for the GPU tests.

// Each test file is its own crate and uses only some of these.
#![allow(dead_code)]

#[path = "../../../3-amp/tests/common/mod.rs"]
mod amp_common;

#[allow(unused_imports)] // (as above: each test file uses only some)
pub use amp_common::{download, f16_bytes, f32_bytes, upload, Rng};

use cudnn_cbr_amp::cuda::CudaStream;
use cudnn_cbr_netops::cuda::NetKernels;
use std::sync::Arc;

/// Device 0's stream and the network's kernels, or `None` after printing the one
/// `SKIP <test>: <reason>` line (no driver, no device, no NVRTC). Kernels that do not build
/// are a failure.
pub fn device(test: &str) -> Option<(Arc<CudaStream>, Arc<NetKernels>)> {
    amp_common::device_with(test, NetKernels::for_context)
}
