//! amp's NCCL tier (tests/gpu_nccl.rs, unchanged) on the simulated CUDA device and its
//! simulated NCCL (tools/sim/nccl.cc, docs/simulator.md): this binary holds those tests as module
//! `gpu_nccl` and runs itself again with the simulator selected, eagerly and in the
//! adversarial stream order, so the unchanged `NcclComm` path (libnccl found by dist's own
//! loader, communicators, collectives enqueued on their streams, aborts, the init timeout)
//! runs without a GPU. The simulator has one device, so the one test that needs two GPUs
//! still prints its SKIP line, and only that one.
//!
//! Module `ranks` runs several ranks in this process (a thread each, dist's `NcclComm` on the
//! simulated device; NCCL refuses two ranks on one real GPU, so it SKIPs off the simulator),
//! with a planted missing join; `tools/sim/tests/nccl.cc` (`nccl-check`, built by tools/sim/build.sh)
//! checks the simulated NCCL's element types, ops, captures and refusals.

#[path = "gpu_nccl.rs"]
mod gpu_nccl;
mod sim;

/// Ranks of one communicator as threads of this process, on the simulated device.
mod ranks {
    use cudarc::driver::DevicePtr;
    use cudnn_cbr_amp::cuda::{CudaContext, CudaStream};
    use cudnn_cbr_dist::nccl::{NcclComm, NcclId};
    use cudnn_cbr_dist::{Collective, ReduceOp};
    use cudnn_cbr_runtime::cuda_device;
    use half::f16;
    use std::sync::Arc;

    /// The simulated device, or `None` after the SKIP line (several ranks on one real GPU
    /// are refused by NCCL).
    fn on_sim(test: &str) -> Option<Arc<CudaContext>> {
        if !super::sim::selected() {
            println!("SKIP {test}: several ranks on one device run only on the simulated device (CUDNN_CBR_DEVICE=sim)");
            return None;
        }
        Some(cuda_device(0).expect("the simulated device"))
    }

    /// Runs `f(rank, stream, comm)` on `world` threads, one rank each (NCCL's init blocks
    /// until every rank has joined); their results in rank order.
    fn ranks<T: Send>(
        ctx: &Arc<CudaContext>,
        world: usize,
        f: impl Fn(usize, &Arc<CudaStream>, &mut NcclComm) -> T + Sync,
    ) -> Vec<T> {
        let id = NcclId::generate().expect("an id from the simulated NCCL");
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || {
                        let stream = ctx.new_stream().unwrap();
                        let link = ctx.new_stream().unwrap();
                        let mut comm = NcclComm::new(link, rank, world, &id).unwrap();
                        let out = f(rank, &stream, &mut comm);
                        comm.check_async().unwrap();
                        comm.destroy().unwrap();
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn three_ranks_sum_f16_like_nccl_take_the_max_and_broadcast() {
        const TEST: &str = "three_ranks_sum_f16_like_nccl_take_the_max_and_broadcast";
        let Some(ctx) = on_sim(TEST) else {
            return;
        };
        // FP16 values (multiples of 1/64 up to ±32: their sums round), and element 0 holding
        // 2048, 1, 1: each add rounded to FP16 (NCCL's __hadd) gives 2048, the exact sum
        // rounded once would give 2050.
        let h = |rank: usize, i: usize| {
            if i == 0 {
                return f16::from_f32(if rank == 0 { 2048.0 } else { 1.0 });
            }
            let z = (i * 7919 + rank * 104_729) % 4096;
            f16::from_f32((z as f32 - 2048.0) / 64.0 * (1 + rank % 2) as f32)
        };
        let outs = ranks(&ctx, 3, |rank, stream, comm| {
            let mine: Vec<f16> = (0..1000).map(|i| h(rank, i)).collect();
            let mut sum = stream.clone_htod(&mine).unwrap();
            comm.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
            let floats: Vec<f32> = (0..100)
                .map(|i| ((i * 31 + rank * 17) % 50) as f32)
                .collect();
            let mut max = stream.clone_htod(&floats).unwrap();
            comm.all_reduce(&mut max, ReduceOp::Max).unwrap();
            let mut from_2 = stream.clone_htod(&[rank as f32 * 10.0; 64]).unwrap();
            comm.broadcast(&mut from_2, 2).unwrap();
            (
                stream.clone_dtoh(&sum).unwrap(),
                stream.clone_dtoh(&max).unwrap(),
                stream.clone_dtoh(&from_2).unwrap(),
            )
        });
        for (rank, (sum, max, from_2)) in outs.iter().enumerate() {
            for (i, got) in sum.iter().enumerate() {
                let want = (1..3).fold(h(0, i), |acc, r| {
                    f16::from_f32(acc.to_f32() + h(r, i).to_f32())
                });
                assert_eq!(got.to_bits(), want.to_bits(), "rank {rank} f16 sum {i}");
            }
            assert_eq!(sum[0], f16::from_f32(2048.0));
            for (i, got) in max.iter().enumerate() {
                let want = (0..3).map(|r| ((i * 31 + r * 17) % 50) as f32);
                assert_eq!(*got, want.fold(f32::MIN, f32::max), "rank {rank} max {i}");
            }
            assert!(from_2.iter().all(|&x| x == 20.0), "rank {rank} broadcast");
        }
        println!("{TEST}: 3 ranks summed 1000 halves (each add rounded), maxed and broadcast");
    }

    /// Rank 0 reads its summed buffer on another stream without joining the communicator's
    /// stream: the adversarial order runs the read before the collective (the rank's own
    /// value); eagerly, and after the join, the sum.
    #[test]
    fn a_read_without_joining_the_communicator_stream_is_stale_in_the_adversarial_mode() {
        const TEST: &str =
            "a_read_without_joining_the_communicator_stream_is_stale_in_the_adversarial_mode";
        let Some(ctx) = on_sim(TEST) else {
            return;
        };
        let outs = ranks(&ctx, 2, |rank, stream, comm| {
            let mut buf = stream.clone_htod(&[rank as f32 + 1.0; 256]).unwrap();
            let (ptr, read) = buf.device_ptr(stream);
            drop(read);
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            let mut unjoined = vec![0f32; 256];
            // SAFETY: `ptr` addresses the 256 floats of `buf`, alive (borrowed below) until
            // the stream is synchronized; the copy is into a pageable host buffer, so it has
            // completed when the call returns. Not ordered after the collective on purpose.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(&mut unjoined, ptr, stream.cu_stream())
            }
            .unwrap();
            stream.synchronize().unwrap();
            stream.join(comm.stream()).unwrap();
            let joined = stream.clone_dtoh(&buf).unwrap();
            (unjoined, joined)
        });
        let adversarial = std::env::var_os("CUDNN_CBR_SIM_ADVERSARIAL").is_some_and(|v| v == "1");
        for (rank, (unjoined, joined)) in outs.iter().enumerate() {
            assert!(joined.iter().all(|&x| x == 3.0), "rank {rank} joined read");
            let want = if adversarial { rank as f32 + 1.0 } else { 3.0 };
            assert!(
                unjoined.iter().all(|&x| x == want),
                "rank {rank}: without the join (adversarial: {adversarial}) the read sees \
                 {want}: {:?}",
                &unjoined[..4]
            );
        }
        println!(
            "{TEST}: unjoined reads saw {:?}",
            [outs[0].0[0], outs[1].0[0]]
        );
    }
}

/// gpu_nccl.rs's tests, and the only SKIP allowed on the simulator.
const TESTS: usize = 2; // the `ranks` tests
const NEEDS_TWO_GPUS: &str =
    "SKIP gpu_nccl_sums_across_every_gpu_like_the_cpu_group: needs two GPUs, this machine has 1";

#[test]
fn sim_gpu_nccl_tests_pass_on_the_simulated_device() {
    if sim::selected() {
        return; // the child run: only the included tests run there (filtered below)
    }
    let Some(dir) = sim::built("sim_gpu_nccl_tests_pass_on_the_simulated_device") else {
        return;
    };
    let start = std::time::Instant::now();
    let tests = include_str!("gpu_nccl.rs").matches("#[test]").count() + TESTS;
    assert!(tests >= 8, "gpu_nccl.rs has {} tests", tests - TESTS);
    for adversarial in [false, true] {
        // The simulated NCCL's own checks, several ranks in one process.
        let mut check = std::process::Command::new(dir.join("nccl-check"));
        check.env("CUDNN_CBR_DEVICE", "sim");
        if adversarial {
            check.env("CUDNN_CBR_SIM_ADVERSARIAL", "1");
        } else {
            check.env_remove("CUDNN_CBR_SIM_ADVERSARIAL");
        }
        let ran = sim::run(
            &format!("nccl-check (adversarial: {adversarial})"),
            &mut check,
        );
        assert!(ran.ok, "the simulated NCCL's checks failed");
        assert!(ran.stdout.contains("all simulated NCCL checks passed"));
        // Every check of tools/sim/tests/nccl.cc ran (each prints one `ok` line).
        let checks = include_str!("../../../tools/sim/tests/nccl.cc")
            .matches("printf(\"ok ")
            .count();
        let oks = ran.stdout.lines().filter(|l| l.starts_with("ok ")).count();
        assert!(checks >= 8, "tools/sim/tests/nccl.cc has {checks} checks");
        assert_eq!(oks, checks, "the simulated NCCL's checks that ran");
        // The planted receive buffer 4 bytes past its allocation is refused, naming it.
        assert!(
            ran.stdout
                .contains("planted: ncclAllReduce (rank 0 of 2): recvbuff: 4100 bytes at 0x")
                && ran.stdout.contains("of 4096 bytes (4 bytes past its end)"),
            "the receive buffer past its allocation was not named"
        );

        // gpu_nccl.rs and the in-process ranks, unchanged NcclComm on the simulated NCCL.
        let what = format!("gpu_nccl.rs on the simulator (adversarial: {adversarial})");
        let ran = sim::run(
            &what,
            sim::child(&dir, adversarial).args([
                "gpu_nccl::",
                "ranks::",
                "--test-threads",
                "2",
                "--show-output",
            ]),
        );
        assert!(ran.ok, "{what} failed");
        assert!(
            ran.stdout
                .contains(&format!("test result: ok. {tests} passed")),
            "{what}: expected all {tests} tests to pass"
        );
        let skips: Vec<&str> = ran
            .stdout
            .lines()
            .filter(|l| l.starts_with("SKIP"))
            .collect();
        assert_eq!(skips, [NEEDS_TWO_GPUS], "{what}: the SKIP lines");
        assert!(
            ran.stdout.contains("(NCCL 22703)"),
            "{what}: the simulated NCCL was not the one opened"
        );
    }
    println!(
        "sim_gpu_nccl: both stream orders in {:.1} s",
        start.elapsed().as_secs_f64()
    );
}
