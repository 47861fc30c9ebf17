//! fusion's GPU tier on the simulated CUDA device: `tests/gpu_own_kernels.rs`,
//! `tests/gpu_cbr_parity.rs`, `tests/gpu_network.rs`, `tests/gpu_conv.rs`,
//! `tests/gpu_accumulation.rs`, `tests/classifier.rs` and `tests/classifier_backends.rs`
//! (included unchanged as modules) run again in a child of this binary with the simulator
//! selected (`CUDNN_CBR_DEVICE=sim`, its folder first on the loader path, docs/simulator.md).
//! There cuDNN plans are built deviceless for the simulator's device-properties document and
//! each plan execution runs the plan's graph in the graph interpreter (`fusion::interp`) over
//! the simulator's allocations, while our own kernels run their program text compiled for the
//! host; every test compares against the CPU executor. The child must pass every test and
//! print no SKIP line. Without the simulator selected the included tests print their SKIP
//! lines, as on any machine without a GPU.

// Each included file declares `mod common;`.
#![allow(clippy::duplicate_mod)]

#[path = "classifier.rs"]
mod classifier;
#[path = "classifier_backends.rs"]
mod classifier_backends;
#[path = "gpu_accumulation.rs"]
mod gpu_accumulation;
#[path = "gpu_cbr_parity.rs"]
mod gpu_cbr_parity;
#[path = "gpu_conv.rs"]
mod gpu_conv;
#[path = "gpu_network.rs"]
mod gpu_network;
#[path = "gpu_own_kernels.rs"]
mod gpu_own_kernels;
#[path = "../crates/3-amp/tests/sim/mod.rs"]
mod sim;

use std::process::Command;

/// Bad executions the simulated device must refuse with a typed error (they would corrupt
/// memory or be silently recorded on a real device, so they run only on the simulator).
mod planted {
    use cudarc::driver::DevicePtr;
    use cudnn_cbr::amp::cuda::{CaptureMode, GraphInstantiateFlags};
    use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
    use cudnn_cbr::fusion::exec::{Bindings, Handle, Workspace};
    use cudnn_cbr::fusion::lower::OperationGraph;
    use cudnn_cbr::fusion::plan::{build_plan, ExecutionPlan};
    use cudnn_cbr::fusion::Error;
    use cudnn_cbr::runtime::DataType;
    use half::f16;
    use std::sync::Arc;

    /// The simulated device's handle, or `None` after a SKIP line.
    fn simulated(test: &str) -> Option<(Arc<cudarc::driver::CudaContext>, Arc<Handle>)> {
        let ctx = match cudnn_cbr::runtime::cuda_device(0) {
            Ok(c) => c,
            Err(e) => {
                println!("SKIP {test}: {e}");
                return None;
            }
        };
        let handle = Handle::new(ctx.new_stream().expect("stream")).expect("handle");
        if !handle.is_simulated() {
            println!("SKIP {test}: runs only on the simulated device");
            return None;
        }
        Some((ctx, handle))
    }

    /// The conv fprop plan of [`shape`] for `handle`'s (deviceless) target, and its tensors.
    fn conv_fprop_plan(handle: &Arc<Handle>) -> (ExecutionPlan, graphs::ConvFpropTensors) {
        let target = handle.target().expect("target");
        let (graph, t) = graphs::conv_fprop(&shape(), false, false);
        let plan = build_plan(
            &OperationGraph::for_target(&graph, &target).unwrap(),
            &target,
        )
        .expect("plan");
        (plan, t)
    }

    fn shape() -> ConvShape {
        ConvShape {
            n: 1,
            c: 8,
            h: 4,
            w: 4,
            k: 8,
            r: 1,
            s: 1,
            pad: 0,
            stride: 1,
        }
    }

    /// An output bound (raw) with more bytes than its allocation has: the interpreter refuses
    /// it before writing, and the error names the plan and the tensor.
    #[test]
    fn an_output_past_its_allocation_is_refused_naming_the_plan_and_tensor() {
        let test = "an_output_past_its_allocation_is_refused";
        let Some((_ctx, handle)) = simulated(test) else {
            return;
        };
        let stream = handle.stream().clone();
        let sh = shape();
        let (plan, t) = conv_fprop_plan(&handle);
        let elems = |n: i64| vec![f16::from_f32(0.5); n as usize];
        let mut x = stream
            .clone_htod(&elems(sh.n * sh.c * sh.h * sh.w))
            .unwrap();
        let mut w = stream.clone_htod(&elems(sh.k * sh.c)).unwrap();
        let y_len = (sh.n * sh.k * sh.p() * sh.q()) as usize;
        let short = stream.alloc_zeros::<f16>(y_len / 2).unwrap();
        let (y_ptr, _guard) = short.device_ptr(&stream);
        let mut b = Bindings::new(&plan);
        b.bind(t.x, &mut x, &stream).unwrap();
        b.bind(t.w, &mut w, &stream).unwrap();
        // SAFETY: the execution is refused before anything is written (the point of the test);
        // the buffer outlives the call.
        unsafe { b.bind_raw(t.y, y_ptr, y_len * 2, DataType::Half) }.unwrap();
        let err = plan.execute(&handle, &b, Workspace::Pooled).unwrap_err();
        let text = err.to_string();
        println!("{text}");
        assert!(
            matches!(&err, Error::Simulator { plan, .. } if plan == "conv_fprop"),
            "{err:?}"
        );
        assert!(
            text.contains("tensor uid") && text.contains("past the end of its allocation"),
            "{text}"
        );
    }

    /// Three slots of one arena allocation (x, w, y, each at a 256-byte boundary, as an arena
    /// lays them out) with y's slot planted one FP16 element late, refused by the bindings'
    /// 16-byte check (on any device), and then, aligned, over w's last eight elements,
    /// refused by the simulated device as an output overlapping an input; each error names
    /// the plan and y, and comes before anything is written. The same slots at their true
    /// offsets execute.
    #[test]
    fn an_arena_slot_off_by_one_element_is_refused() {
        let test = "an_arena_slot_off_by_one_element_is_refused";
        let Some((_ctx, handle)) = simulated(test) else {
            return;
        };
        let stream = handle.stream().clone();
        let sh = shape();
        let (plan, t) = conv_fprop_plan(&handle);
        let bytes = |n: i64| n as usize * 2;
        let round = |b: usize| b.div_ceil(256) * 256;
        let (x_len, w_len) = (bytes(sh.n * sh.c * sh.h * sh.w), bytes(sh.k * sh.c));
        let y_len = bytes(sh.n * sh.k * sh.p() * sh.q());
        let (x_at, w_at) = (0, round(x_len));
        let y_at = w_at + round(w_len);
        let arena = stream.alloc_zeros::<u8>(y_at + round(y_len) + 256).unwrap();
        let (base, _guard) = arena.device_ptr(&stream);
        let run = |y_offset: usize| {
            let mut b = Bindings::new(&plan);
            // SAFETY: every slot lies inside `arena`, which outlives the call; a planted slot
            // is refused before anything is written (the point of the test).
            unsafe {
                b.bind_raw(t.x, base + x_at as u64, x_len, DataType::Half)
                    .unwrap();
                b.bind_raw(t.w, base + w_at as u64, w_len, DataType::Half)
                    .unwrap();
                b.bind_raw(t.y, base + y_offset as u64, y_len, DataType::Half)
                    .unwrap();
            }
            plan.execute(&handle, &b, Workspace::Pooled)
        };
        run(y_at).expect("the slots at their true offsets");
        stream.synchronize().unwrap();
        for (offset, simulator, needle) in [
            (y_at + 2, false, "is not 16-byte aligned"),
            (w_at + w_len - 16, true, "overlaps tensor uid"),
        ] {
            let err = run(offset).unwrap_err();
            let text = err.to_string();
            println!("y at arena offset {offset}: {text}");
            let caught = if simulator {
                matches!(&err, Error::Simulator { plan, .. } if plan == "conv_fprop")
            } else {
                matches!(&err, Error::Binding { graph, .. } if graph == "conv_fprop")
            };
            assert!(caught, "{err:?}");
            assert!(
                text.contains(needle) && text.contains("conv_fprop#0.y"),
                "{text}"
            );
        }
    }

    /// A plan executed while its stream captures a CUDA graph is recorded as a host node of
    /// the graph (nothing runs at capture), and each replay runs it in stream order over the
    /// bound buffers' contents at that time: y = Σ_c x·w over 8 channels, 8·0.5·0.5 = 2 after
    /// the first replay, 8·1·0.5 = 4 after x is overwritten and the graph replayed (exact in
    /// FP16).
    #[test]
    fn a_plan_execution_during_capture_is_recorded_and_replayed_in_order() {
        let test = "a_plan_execution_during_capture_is_recorded";
        let Some((ctx, handle)) = simulated(test) else {
            return;
        };
        let sh = shape();
        let (plan, t) = conv_fprop_plan(&handle);
        let stream = handle.stream().clone();
        let elems = |n: i64, v: f32| vec![f16::from_f32(v); n as usize];
        let nx = sh.n * sh.c * sh.h * sh.w;
        let mut x = stream.clone_htod(&elems(nx, 0.5)).unwrap();
        let mut w = stream.clone_htod(&elems(sh.k * sh.c, 0.5)).unwrap();
        let mut y = stream
            .alloc_zeros::<f16>((sh.n * sh.k * sh.p() * sh.q()) as usize)
            .unwrap();
        stream.synchronize().unwrap();
        // Event waits on work outside a capture cannot be captured.
        // SAFETY: nothing else uses the context's streams concurrently in this test.
        unsafe { ctx.disable_event_tracking() };
        stream
            .begin_capture(CaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let mut b = Bindings::new(&plan);
        b.bind(t.x, &mut x, &stream).unwrap();
        b.bind(t.w, &mut w, &stream).unwrap();
        b.bind(t.y, &mut y, &stream).unwrap();
        let recorded = plan.execute(&handle, &b, Workspace::Pooled);
        drop(b);
        let cuda_graph = stream
            .end_capture(GraphInstantiateFlags(0))
            .expect("the capture is valid")
            .expect("a graph");
        recorded.expect("recorded into the capture");
        let y_now = |y: &cudarc::driver::CudaSlice<f16>| {
            let v = stream.clone_dtoh(y).unwrap();
            v.iter().map(|h| h.to_f32()).collect::<Vec<f32>>()
        };
        assert!(
            y_now(&y).iter().all(|&v| v == 0.0),
            "nothing runs at capture"
        );
        cuda_graph.launch().expect("replay");
        assert!(y_now(&y).iter().all(|&v| v == 2.0), "{:?}", y_now(&y));
        stream.memcpy_htod(&elems(nx, 1.0), &mut x).unwrap();
        cuda_graph.launch().expect("replay");
        assert!(y_now(&y).iter().all(|&v| v == 4.0), "{:?}", y_now(&y));
        handle.replay_failure().expect("no replay failed");
        drop(cuda_graph); // frees the recorded variant pack with the graph
    }

    /// Set in the child that runs [`a_failure_at_replay_faults_the_context_and_is_kept`]
    /// alone: the fault it plants leaves the whole context unusable.
    pub const FAULT_CHILD: &str = "CUDNN_CBR_SIM_FAULT_CHILD";

    /// A buffer freed between the capture and the replay: the replayed plan execution fails
    /// (its input is no longer mapped), the simulated context faults (the next synchronize
    /// fails) and the next call on the handle returns the failure, naming plan and tensor.
    /// Runs only in its own child (the parent's `a_replay_failure_is_not_lost` checks it).
    #[test]
    fn a_failure_at_replay_faults_the_context_and_is_kept() {
        if std::env::var_os(FAULT_CHILD).is_none() {
            return;
        }
        let test = "a_failure_at_replay_faults_the_context_and_is_kept";
        let Some((ctx, handle)) = simulated(test) else {
            return;
        };
        let sh = shape();
        let (plan, t) = conv_fprop_plan(&handle);
        let stream = handle.stream().clone();
        let elems = |n: i64| vec![f16::from_f32(0.5); n as usize];
        let mut x = stream
            .clone_htod(&elems(sh.n * sh.c * sh.h * sh.w))
            .unwrap();
        let mut w = stream.clone_htod(&elems(sh.k * sh.c)).unwrap();
        let mut y = stream
            .alloc_zeros::<f16>((sh.n * sh.k * sh.p() * sh.q()) as usize)
            .unwrap();
        stream.synchronize().unwrap();
        // SAFETY: nothing else uses the context's streams concurrently in this test.
        unsafe { ctx.disable_event_tracking() };
        stream
            .begin_capture(CaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let mut b = Bindings::new(&plan);
        b.bind(t.x, &mut x, &stream).unwrap();
        b.bind(t.w, &mut w, &stream).unwrap();
        b.bind(t.y, &mut y, &stream).unwrap();
        let recorded = plan.execute(&handle, &b, Workspace::Pooled);
        let mut again = Bindings::new(&plan);
        drop(b);
        let cuda_graph = stream
            .end_capture(GraphInstantiateFlags(0))
            .expect("the capture is valid")
            .expect("a graph");
        recorded.expect("recorded");
        drop(x); // the planted bug: the graph still names x
        let _ = cuda_graph.launch();
        let synced = stream.synchronize();
        println!("synchronize after the replay: {synced:?}");
        assert!(
            synced.is_err(),
            "the faulted context must fail the synchronize"
        );
        let kept = handle.replay_failure().unwrap_err();
        println!("kept: {kept}");
        assert!(
            matches!(&kept, Error::Simulator { plan, problem }
                if plan == "conv_fprop" && problem.contains("tensor uid")),
            "{kept:?}"
        );
        again.bind(t.w, &mut w, &stream).unwrap();
        let next = plan
            .execute(&handle, &again, Workspace::Pooled)
            .unwrap_err();
        assert_eq!(next.to_string(), kept.to_string());
        println!("REPLAY FAILURE KEPT");
        drop(cuda_graph); // frees the recorded pack (destruction is not refused)
    }
}

/// fusion's own kernels (crates/3-fusion/src/cbr/kernel_source.cu, compiled by fusion's own
/// `kernels::compile`, which goes through NVRTC) launched directly, without cuDNN, against
/// their formulas evaluated here. SKIPs without a device.
mod fusion_kernels {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;
    use half::f16;

    fn cfg(blocks: u32, shared: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: shared,
        }
    }

    #[test]
    fn apply_relu_and_channel_stats_match_their_formulas() {
        let test = "fusion_kernels";
        let ctx = match cudnn_cbr::runtime::cuda_device(0) {
            Ok(c) => c,
            Err(e) => {
                println!("SKIP {test}: {e}");
                return;
            }
        };
        let compiled = cudnn_cbr::fusion::cbr::kernels::compile("sm_90").expect("compile");
        let module = ctx
            .load_module(Ptx::from_binary(compiled.cubin.clone()))
            .expect("load");
        let stream = ctx.default_stream();
        let (c, pixels) = (16usize, 75usize);
        let n = c * pixels;
        let mut z = 7u64;
        let mut next = || {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Multiples of 1/8 in [-4, 4): exact in FP16, and sums of a few thousand of them
            // (and of their squares, multiples of 1/64 below 16) are exact in FP32, so the
            // channel sums do not depend on the order the atomics land in.
            f16::from_f32(((z >> 33) % 64) as f32 / 8.0 - 4.0)
        };
        let y: Vec<f16> = (0..n).map(|_| next()).collect();
        let sc: Vec<f16> = (0..c).map(|_| next()).collect();
        let bi: Vec<f16> = (0..c).map(|_| next()).collect();
        let bits = |v: &[f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
        let y_d = stream.clone_htod(&bits(&y)).expect("y");
        let s_d = stream.clone_htod(&bits(&sc)).expect("s");
        let b_d = stream.clone_htod(&bits(&bi)).expect("b");
        let want: Vec<u16> = (0..n)
            .map(|e| {
                let k = e % c;
                let v = y[e].to_f32() * sc[k].to_f32() + bi[k].to_f32();
                f16::from_f32(if v > 0.0 { v } else { 0.0 }).to_bits()
            })
            .collect();
        let apply = module
            .load_function("cbr_apply_relu")
            .expect("cbr_apply_relu");
        for vec in [1i32, 0] {
            let mut out = stream.alloc_zeros::<u16>(n).expect("out");
            let (n64, c32) = (n as u64, c as u32);
            let mut l = stream.launch_builder(&apply);
            l.arg(&y_d)
                .arg(&s_d)
                .arg(&b_d)
                .arg(&mut out)
                .arg(&n64)
                .arg(&c32)
                .arg(&vec);
            // SAFETY: (y, s, b, out, n, c, vec) as kernel_source.cu declares them; y and out
            // hold n halves, s and b hold c; c % 8 == 0 and the buffers are 256-byte aligned,
            // as the vector path needs.
            unsafe { l.launch(cfg(2, 0)) }.expect("launch cbr_apply_relu");
            assert_eq!(stream.clone_dtoh(&out).expect("out"), want, "vec = {vec}");
        }
        let stats = module
            .load_function("cbr_channel_stats")
            .expect("cbr_channel_stats");
        let mut sum = stream.alloc_zeros::<f32>(c).expect("sum");
        let mut sq = stream.alloc_zeros::<f32>(c).expect("sq");
        let (n64, c32, vec) = (n as u64, c as u32, 0i32);
        let mut l = stream.launch_builder(&stats);
        l.arg(&y_d)
            .arg(&mut sum)
            .arg(&mut sq)
            .arg(&n64)
            .arg(&c32)
            .arg(&vec);
        // SAFETY: (y, sum, sq, n, c, vec) as declared; sum and sq hold c floats, zeroed; the
        // dynamic shared memory holds the 2·c floats the kernel accumulates in.
        unsafe { l.launch(cfg(3, 2 * c as u32 * 4)) }.expect("launch cbr_channel_stats");
        let (mut ws, mut wq) = (vec![0f32; c], vec![0f32; c]);
        for (e, v) in y.iter().enumerate() {
            ws[e % c] += v.to_f32();
            wq[e % c] += v.to_f32() * v.to_f32();
        }
        assert_eq!(stream.clone_dtoh(&sum).expect("sum"), ws, "channel sums");
        assert_eq!(
            stream.clone_dtoh(&sq).expect("sq"),
            wq,
            "channel sums of squares"
        );
    }
}

/// The included modules' tests, counted from their sources.
fn included_tests() -> usize {
    [
        include_str!("classifier.rs"),
        include_str!("classifier_backends.rs"),
        include_str!("gpu_accumulation.rs"),
        include_str!("gpu_cbr_parity.rs"),
        include_str!("gpu_conv.rs"),
        include_str!("gpu_network.rs"),
        include_str!("gpu_own_kernels.rs"),
    ]
    .iter()
    .map(|s| s.matches("#[test]").count())
    .sum::<usize>()
        + 4 // the planted tests (the replay fault returns at once there)
        + 1 // fusion's kernels launched directly
}

/// Runs the included tests in a child with the simulator in `dir` selected (in the
/// adversarial stream order when asked) and asserts they all passed without a SKIP.
fn run_on_the_simulator(dir: &std::path::Path, adversarial: bool) {
    let mode = if adversarial { "adversarial" } else { "eager" };
    let mut child = sim::child(dir, adversarial);
    child.args([
        "classifier::",
        "classifier_backends::",
        "gpu_accumulation::",
        "gpu_cbr_parity::",
        "gpu_conv::",
        "gpu_network::",
        "gpu_own_kernels::",
        "planted::",
        "fusion_kernels::",
        "--test-threads",
        "1",
        // Passing tests' output too, so that a SKIP line cannot go unseen.
        "--show-output",
    ]);
    let out = child
        .output()
        .expect("run fusion's GPU tests under the simulator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{mode} stream order:\n{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "fusion's GPU tests failed on the simulator ({mode})"
    );
    assert!(
        !stdout.contains("SKIP"),
        "a GPU test skipped on the simulator ({mode})"
    );
    let tests = included_tests();
    assert!(tests >= 5, "the included files have {tests} tests");
    assert!(
        stdout.contains(&format!("test result: ok. {tests} passed")),
        "expected all {tests} GPU tests to pass ({mode})"
    );
}

/// The replay fault planted in `planted::a_failure_at_replay_faults_the_context_and_is_kept`,
/// in a child of its own: it passes, and the simulated driver named the plan and the tensor
/// on stderr.
#[test]
fn a_replay_failure_is_not_lost() {
    if std::env::var_os("CUDNN_CBR_DEVICE").is_some() {
        return;
    }
    let Some(dir) = sim::built("a_replay_failure_is_not_lost") else {
        return;
    };
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "planted::a_failure_at_replay_faults_the_context_and_is_kept",
            "--exact",
            "--nocapture",
        ])
        .env(planted::FAULT_CHILD, "1")
        .env("CUDNN_CBR_DEVICE", "sim")
        .env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()))
        .env("CUDNN_CBR_KERNEL_CACHE", dir.join("kernel-cache"))
        .env("CUDNN_CBR_SIM_CACHE", dir.join("host-cache"))
        .output()
        .expect("run the planted replay fault");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "the planted replay fault's test failed"
    );
    assert!(stdout.contains("REPLAY FAILURE KEPT"), "it did not run");
    assert!(
        stderr.contains("fault in enqueued work: replay of plan `conv_fprop`")
            && stderr.contains("tensor uid"),
        "the driver did not name the plan and tensor"
    );
}

/// Eagerly and in the adversarial stream order (each stream's work deferred until something
/// needs it: a missing event join would read stale data), every included test passes.
#[test]
fn fusion_gpu_tests_pass_on_the_simulated_device() {
    if std::env::var_os("CUDNN_CBR_DEVICE").is_some() {
        // The child run itself (this test is filtered out there), or a run that already
        // selected a device: the included tests are what runs.
        return;
    }
    let Some(dir) = sim::built("fusion_gpu_tests_pass_on_the_simulated_device") else {
        return;
    };
    run_on_the_simulator(&dir, false);
    run_on_the_simulator(&dir, true);
}
