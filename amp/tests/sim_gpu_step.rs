//! amp's GPU tier (tests/gpu_step.rs and tests/gpu_head.rs, unchanged) on the simulated CUDA
//! device: this binary holds those tests as modules `gpu_step` and `gpu_head` and runs itself
//! again with the simulator selected (`CUDNN_CBR_DEVICE=sim`, its folder first on the loader
//! path, docs/simulator.md), so the
//! range kernels' own program text runs through the unchanged `amp` CUDA path (NVRTC, module
//! load, `CudaRegions`, `AmpStep`, graph capture and replay). Without the simulator selected
//! the included tests print their SKIP lines, as on any machine without a GPU.

#[path = "gpu_head.rs"]
mod gpu_head;
#[path = "gpu_step.rs"]
mod gpu_step;
mod sim;

/// Planted bugs the simulated device must show (each test SKIPs without a device).
mod planted {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;

    const FILL: &str = "extern \"C\" __global__ void fill(float* out, unsigned n) {\n\
        const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
        if (i < n) out[i] = 1.0f;\n}\n";

    /// Launches `fill` over 1000 floats with `blocks` × `threads`; the buffer afterwards, or
    /// the launch error.
    fn fill(test: &str, blocks: u32, threads: u32) -> Option<Result<Vec<f32>, String>> {
        let ctx = match cudnn_cbr_amp::cuda::cuda_device(0) {
            Ok(c) => c,
            Err(e) => {
                println!("SKIP {test}: {e}");
                return None;
            }
        };
        let flags = cudnn_cbr_amp::kernels::cubin_flags("sm_90", None);
        let cubin = cudnn_cbr_fusion::rtc::compile_cubin("fill.cu", FILL, &flags).expect("NVRTC");
        let module = ctx.load_module(Ptx::from_binary(cubin)).expect("load");
        let f = module.load_function("fill").expect("fill");
        let stream = ctx.default_stream();
        let mut buf = stream.alloc_zeros::<f32>(1000).expect("alloc");
        let n = 1000u32;
        let mut b = stream.launch_builder(&f);
        b.arg(&mut buf).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `fill` takes (float*, unsigned), pushed in that order; it writes at most
        // n = 1000 floats of `buf`, which holds 1000.
        if let Err(e) = unsafe { b.launch(cfg) } {
            return Some(Err(e.to_string()));
        }
        Some(Ok(stream.clone_dtoh(&buf).expect("download")))
    }

    #[test]
    fn a_grid_one_block_short_leaves_the_tail_unwritten() {
        let Some(full) = fill("a_grid_one_block_short", 4, 256) else {
            return;
        };
        assert!(full.expect("launch").iter().all(|&x| x == 1.0));
        let short = fill("a_grid_one_block_short", 3, 256)
            .unwrap()
            .expect("launch");
        let missing: Vec<usize> = (0..1000).filter(|&i| short[i] != 1.0).collect();
        assert_eq!(
            missing,
            (768..1000).collect::<Vec<_>>(),
            "exactly the last block's elements"
        );
    }

    #[test]
    fn a_block_of_1025_threads_is_refused() {
        let Some(r) = fill("a_block_of_1025_threads", 1, 1025) else {
            return;
        };
        assert!(r.is_err(), "a 1025-thread block launched");
    }
}

use std::process::Command;

#[test]
fn sim_gpu_step_tests_pass_on_the_simulated_device() {
    if std::env::var_os("CUDNN_CBR_DEVICE").is_some_and(|d| d == "sim") {
        return; // the child run: only the included tests run there (filtered below)
    }
    let dir = sim::built();
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "gpu_step::",
            "gpu_head::",
            "planted::",
            "--test-threads",
            "2",
        ])
        .env("CUDNN_CBR_DEVICE", "sim")
        .env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()))
        .env("CUDNN_CBR_KERNEL_CACHE", dir.join("kernel-cache"))
        .env("CUDNN_CBR_SIM_CACHE", dir.join("host-cache"))
        .output()
        .expect("run the GPU tests under the simulator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "the GPU tests failed on the simulator"
    );
    assert!(
        !stdout.contains("SKIP"),
        "a GPU test skipped on the simulator"
    );
    let tests = include_str!("gpu_step.rs").matches("#[test]").count()
        + include_str!("gpu_head.rs").matches("#[test]").count()
        + 2; // the planted bugs
    assert!(
        tests >= 16,
        "gpu_step.rs and gpu_head.rs have {tests} tests"
    );
    assert!(
        stdout.contains(&format!("test result: ok. {tests} passed")),
        "expected all {tests} GPU tests to pass"
    );
}
