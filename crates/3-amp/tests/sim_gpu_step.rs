//! amp's GPU tier (tests/gpu_range_kernels.rs, tests/gpu_step.rs and tests/gpu_accum.rs, unchanged)
//! on the simulated CUDA device: this binary holds those tests as modules `gpu_range_kernels`,
//! `gpu_step` and `gpu_accum` and runs itself again with the simulator selected
//! (`CUDNN_CBR_DEVICE=sim`, its folder first on the loader path, docs/simulator.md), so the range
//! kernels' own program text runs through the unchanged `amp` CUDA path (NVRTC, module load,
//! `CudaRegions`, `AmpStep`, graph capture and replay). Without the simulator selected the included
//! tests print their SKIP lines, as on any machine without a GPU.

// gpu_accum.rs, gpu_range_kernels.rs and gpu_step.rs each declare `mod common;`; they are
// included unchanged.
#![allow(clippy::duplicate_mod)]

#[path = "gpu_accum.rs"]
mod gpu_accum;
#[path = "gpu_range_kernels.rs"]
mod gpu_range_kernels;
#[path = "gpu_step.rs"]
mod gpu_step;
mod sim;

/// A planted write past the end of a buffer, which ends the process: run on its own by the
/// main test below (`CUDNN_CBR_SIM_OOB_CHILD=1`), which expects the crash and its message.
mod oob {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;

    #[test]
    fn a_write_past_the_end_faults_on_the_guard_page() {
        if std::env::var_os("CUDNN_CBR_SIM_OOB_CHILD").is_none() {
            println!("SKIP oob: run in a process of its own by the simulator test (it crashes)");
            return;
        }
        let ctx = cudnn_cbr_runtime::cuda_device(0).expect("the simulated device");
        let flags = cudnn_cbr_runtime::rtc::cubin_flags("sm_90", None);
        let src = super::planted::FILL;
        let cubin = cudnn_cbr_runtime::rtc::compile_cubin("fill.cu", src, &flags).expect("NVRTC");
        let module = ctx.load_module(Ptx::from_binary(cubin)).expect("load");
        let f = module.load_function("fill").expect("fill");
        let stream = ctx.default_stream();
        // 1024 floats (4096 bytes, a whole number of the simulator's 256-byte granules) and a
        // count one too many: the last thread writes the first byte past the buffer.
        let mut buf = stream.alloc_zeros::<f32>(1024).expect("alloc");
        let n = 1025u32;
        let mut l = stream.launch_builder(&f);
        l.arg(&mut buf).arg(&n);
        // SAFETY: not sound on purpose: this process runs only on the simulated device, whose
        // guard page stops the write past the end (the test expects the process to die).
        let _ = unsafe { l.launch(LaunchConfig::for_num_elems(1025)) };
        let _ = stream.synchronize();
        println!("the write past the end was not caught");
    }
}

/// Planted bugs the simulated device must show (each test SKIPs without a device).
mod planted {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;

    pub(super) const FILL: &str = "extern \"C\" __global__ void fill(float* out, unsigned n) {\n\
        const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
        if (i < n) out[i] = 1.0f;\n}\n";

    /// Launches `fill` over 1000 floats with `blocks` × `threads`; the buffer afterwards, or
    /// the launch error.
    fn fill(test: &str, blocks: u32, threads: u32) -> Option<Result<Vec<f32>, String>> {
        let ctx = match cudnn_cbr_runtime::cuda_device(0) {
            Ok(c) => c,
            Err(e) => {
                println!("SKIP {test}: {e}");
                return None;
            }
        };
        let flags = cudnn_cbr_runtime::rtc::cubin_flags("sm_90", None);
        let cubin = cudnn_cbr_runtime::rtc::compile_cubin("fill.cu", FILL, &flags).expect("NVRTC");
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

    /// Whether the simulated device is selected; else prints the SKIP line (these bugs would
    /// corrupt a real device's memory or race on it).
    fn on_sim(test: &str) -> bool {
        let sim = std::env::var_os("CUDNN_CBR_DEVICE").is_some_and(|d| d == "sim");
        if !sim {
            println!("SKIP {test}: a planted bug run only on the simulated device (CUDNN_CBR_DEVICE=sim)");
        }
        sim
    }

    #[test]
    fn a_freed_pointer_argument_and_a_sync_during_capture_are_refused() {
        let test = "a_freed_pointer_argument";
        if !on_sim(test) {
            return;
        }
        let ctx = cudnn_cbr_runtime::cuda_device(0).expect("the simulated device");
        let flags = cudnn_cbr_runtime::rtc::cubin_flags("sm_90", None);
        let cubin = cudnn_cbr_runtime::rtc::compile_cubin("fill.cu", FILL, &flags).expect("NVRTC");
        let module = ctx.load_module(Ptx::from_binary(cubin)).expect("load");
        let f = module.load_function("fill").expect("fill");
        let stream = ctx.new_stream().expect("stream");
        // SAFETY: a plain allocation and its release; nothing else holds the pointer.
        let p = unsafe { cudarc::driver::result::malloc_sync(4000) }.expect("alloc");
        // SAFETY: as above.
        unsafe { cudarc::driver::result::free_sync(p) }.expect("free");
        let n = 1000u32;
        let mut l = stream.launch_builder(&f);
        l.arg(&p).arg(&n);
        // SAFETY: the simulated device checks every pointer argument before it runs anything
        // (`on_sim` above): this launch is refused, which is what the test asserts.
        let r = unsafe { l.launch(LaunchConfig::for_num_elems(1000)) };
        assert!(r.is_err(), "a kernel launched with a freed pointer");
        // A synchronize inside a thread-local capture is refused and spoils the capture.
        stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .expect("begin");
        assert!(
            stream.synchronize().is_err(),
            "a synchronize during capture"
        );
        let end = stream.end_capture(
            cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        assert!(end.is_err(), "a capture that saw a synchronize ended well");
    }

    /// A second stream joins a capture through an event and rejoins it: its kernel is part of
    /// the graph (nothing runs while capturing), and a replay runs it.
    #[test]
    fn a_stream_that_joins_a_capture_is_recorded_into_its_graph() {
        let test = "a_stream_that_joins_a_capture";
        let ctx = match cudnn_cbr_runtime::cuda_device(0) {
            Ok(c) => c,
            Err(e) => {
                println!("SKIP {test}: {e}");
                return;
            }
        };
        // SAFETY: the test orders its two streams itself, with the events below.
        unsafe { ctx.disable_event_tracking() };
        let (a, b) = (ctx.new_stream().expect("a"), ctx.new_stream().expect("b"));
        let flags = cudnn_cbr_runtime::rtc::cubin_flags("sm_90", None);
        let cubin = cudnn_cbr_runtime::rtc::compile_cubin("fill.cu", FILL, &flags).expect("NVRTC");
        let module = ctx.load_module(Ptx::from_binary(cubin)).expect("load");
        let f = module.load_function("fill").expect("fill");
        let mut buf = a.alloc_zeros::<f32>(1000).expect("alloc");
        a.synchronize().expect("zeroed");
        let n = 1000u32;
        a.begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        .expect("begin");
        b.join(&a).expect("b joins the capture");
        let mut l = b.launch_builder(&f);
        l.arg(&mut buf).arg(&n);
        // SAFETY: `fill` takes (float*, unsigned) in that order and writes the 1000 floats of
        // `buf`; the launch is captured, run by the replay below.
        unsafe { l.launch(LaunchConfig::for_num_elems(1000)) }.expect("captured launch");
        a.join(&b).expect("b rejoins");
        let graph = a
            .end_capture(
                cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .expect("end")
            .expect("a graph");
        let before = a.clone_dtoh(&buf).expect("read");
        assert!(before.iter().all(|&x| x == 0.0), "a captured kernel ran");
        graph.launch().expect("replay");
        let after = a.clone_dtoh(&buf).expect("read");
        assert!(
            after.iter().all(|&x| x == 1.0),
            "the replay did not run the joined kernel"
        );
    }

    /// Stream `b` reads what stream `a` wrote, without and then with an event join. Eager
    /// execution hides the missing join; the adversarial mode runs `b` first and shows it.
    #[test]
    fn a_missing_event_join_reads_stale_data_in_the_adversarial_mode() {
        let test = "a_missing_event_join";
        if !on_sim(test) {
            return;
        }
        let ctx = match cudnn_cbr_runtime::cuda_device(0) {
            Ok(c) => c,
            Err(e) => {
                println!("SKIP {test}: {e}");
                return;
            }
        };
        // SAFETY: buffers made after this do not order their own uses across streams; this
        // test orders (or, on purpose, fails to order) its two streams itself, and reads the
        // buffer only through copies that complete before they return.
        unsafe { ctx.disable_event_tracking() };
        let (a, b) = (ctx.new_stream().expect("a"), ctx.new_stream().expect("b"));
        let flags = cudnn_cbr_runtime::rtc::cubin_flags("sm_90", None);
        let cubin = cudnn_cbr_runtime::rtc::compile_cubin("fill.cu", FILL, &flags).expect("NVRTC");
        let module = ctx.load_module(Ptx::from_binary(cubin)).expect("load");
        let f = module.load_function("fill").expect("fill");
        let mut buf = a.alloc_zeros::<f32>(1000).expect("alloc");
        a.synchronize().expect("zeroed");
        let n = 1000u32;
        let mut l = a.launch_builder(&f);
        l.arg(&mut buf).arg(&n);
        // SAFETY: `fill` takes (float*, unsigned) in that order and writes 1000 floats of the
        // 1000 `buf` holds.
        unsafe { l.launch(LaunchConfig::for_num_elems(1000)) }.expect("launch");
        let unjoined = b.clone_dtoh(&buf).expect("read without a join");
        b.join(&a).expect("join");
        let joined = b.clone_dtoh(&buf).expect("read after the join");
        assert!(
            joined.iter().all(|&x| x == 1.0),
            "the joined read sees the fill"
        );
        let adversarial = std::env::var_os("CUDNN_CBR_SIM_ADVERSARIAL").is_some_and(|v| v == "1");
        let want = if adversarial { 0.0 } else { 1.0 };
        assert!(
            unjoined.iter().all(|&x| x == want),
            "without the join (adversarial: {adversarial}) the read sees {want}: {:?}",
            &unjoined[..4]
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

#[test]
fn sim_gpu_step_tests_pass_on_the_simulated_device() {
    if sim::selected() {
        return; // the child run: only the included tests run there (filtered below)
    }
    let Some(dir) = sim::built("sim_gpu_step_tests_pass_on_the_simulated_device") else {
        return;
    };
    let filters = [
        "gpu_range_kernels::",
        "gpu_step::",
        "gpu_accum::",
        "planted::",
        "--test-threads",
        "2",
        // Passing tests' output too, so that a SKIP line cannot go unseen.
        "--show-output",
    ];
    let out = sim::child(&dir, false)
        .args(filters)
        .output()
        .expect("run the GPU tests under the simulator");
    // The adversarial stream order: the planted missing join must show, and nothing else may
    // change (amp orders its streams with joins).
    let adv = sim::run("adversarial mode", sim::child(&dir, true).args(filters));
    assert!(adv.ok, "the GPU tests failed in the adversarial mode");
    let adv_out = adv.stdout;
    assert!(
        !adv_out.contains("SKIP"),
        "a GPU test skipped on the simulator (adversarial mode)"
    );
    // On the loader path but not selected, the simulated driver says "no device", as the
    // no-driver stand-in does: the GPU tests skip.
    let off = sim::child(&dir, false)
        .args([
            "gpu_range_kernels::gpu_zero",
            "--test-threads",
            "1",
            "--nocapture",
        ])
        .env_remove("CUDNN_CBR_DEVICE")
        .output()
        .expect("run a GPU test with the simulator unselected");
    let off_out = String::from_utf8_lossy(&off.stdout);
    assert!(off.status.success(), "{off_out}");
    assert!(
        off_out.contains("SKIP gpu_zero_matches_its_twin")
            && off_out.contains("CUDA_ERROR_NO_DEVICE"),
        "the unselected simulator answered as a device: {off_out}"
    );

    // The planted write past the end: the process must die with the simulator's message.
    let crash = sim::child(&dir, false)
        .args(["oob::", "--test-threads", "1"])
        .env("CUDNN_CBR_SIM_OOB_CHILD", "1")
        .output()
        .expect("run the planted write past the end");
    let crash_err = String::from_utf8_lossy(&crash.stderr);
    println!("write past the end:\n{crash_err}");
    assert!(
        !crash.status.success(),
        "the write past the end was not caught"
    );
    assert!(
        crash_err.contains("fill accessed") && crash_err.contains("0 bytes past the end"),
        "the fault names the kernel and the allocation"
    );
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
    let tests = include_str!("gpu_range_kernels.rs")
        .matches("#[test]")
        .count()
        + include_str!("gpu_step.rs").matches("#[test]").count()
        + include_str!("gpu_accum.rs").matches("#[test]").count()
        + 5; // the planted bugs, the joined capture
    assert!(
        tests >= 15,
        "gpu_range_kernels.rs, gpu_step.rs and gpu_accum.rs have {tests} tests"
    );
    assert!(
        adv_out.contains(&format!("test result: ok. {tests} passed")),
        "expected all {tests} GPU tests to pass in the adversarial mode"
    );
    assert!(
        stdout.contains(&format!("test result: ok. {tests} passed")),
        "expected all {tests} GPU tests to pass"
    );
}
