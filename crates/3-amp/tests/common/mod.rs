//! Helpers shared by the amp integration tests (`mod common;` in each test file that uses
//! them): the splitmix64 test-data source, and device 0 with its kernels for the GPU tests.

// Each test file is its own crate and uses only some of these.
#![allow(dead_code)]

use std::sync::Arc;

use cudnn_cbr_amp::cuda::{AmpKernels, CudaContext, CudaSlice, CudaStream};
use cudnn_cbr_amp::AmpError;
use half::f16;

/// splitmix64: a fixed, dependency-free source of test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `n` values uniform in [-scale, scale).
    pub fn f32s(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.unit()).collect()
    }

    /// `n` values uniform in [-scale, scale), rounded to FP16.
    pub fn f16s(&mut self, n: usize, scale: f32) -> Vec<f16> {
        (0..n).map(|_| f16::from_f32(scale * self.unit())).collect()
    }
}

/// Device 0's stream and amp's kernels, or `None` after printing the one `SKIP <test>:
/// <reason>` line (no driver, no device, no NVRTC). Kernels that do not build are a failure.
pub fn device(test: &str) -> Option<(Arc<CudaStream>, Arc<AmpKernels>)> {
    device_with(test, AmpKernels::for_context)
}

/// [`device`] with the kernels `load` loads into device 0's context (netops' tests load the
/// network's kernels through this file too).
pub fn device_with<K>(
    test: &str,
    load: impl FnOnce(&Arc<CudaContext>) -> Result<Arc<K>, AmpError>,
) -> Option<(Arc<CudaStream>, Arc<K>)> {
    let ctx = match cudnn_cbr_runtime::cuda_device(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("SKIP {test}: {e}");
            return None;
        }
    };
    let kernels = match load(&ctx) {
        Ok(k) => k,
        Err(e) if e.is_unavailable() => {
            println!("SKIP {test}: {e}");
            return None;
        }
        Err(e) => panic!("{test}: the kernels do not build: {e}"),
    };
    let stream = ctx.new_stream().expect("a new stream");
    Some((stream, kernels))
}

/// Little-endian bytes of FP32 values.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes of FP16 values.
pub fn f16_bytes(v: &[f16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A new device buffer holding `bytes`.
pub fn upload(stream: &Arc<CudaStream>, bytes: &[u8]) -> CudaSlice<u8> {
    stream.clone_htod(bytes).expect("upload")
}

/// A device buffer's bytes (waits for the stream).
pub fn download(stream: &Arc<CudaStream>, buf: &CudaSlice<u8>) -> Vec<u8> {
    stream.clone_dtoh(buf).expect("download")
}
