//! Tier 4 (GPU): the data-parallel step's collectives on NCCL. A one-rank NCCL group must
//! leave a step bit for bit as it is without a communicator; with two or more GPUs, the
//! ranks' summed gradients must equal the CPU group's sums.
//!
//! Without a device, NVRTC or NCCL each test prints one `SKIP <test>: <reason>` line.

use std::sync::Arc;

use cudnn_cbr_amp::cuda::{dist_grads, CudaRegions, CudaStream};
use cudnn_cbr_amp::dist::nccl::{NcclComm, NcclId};
use cudnn_cbr_amp::dist::{Collective, ReduceOp};
use cudnn_cbr_amp::plan::{MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::SgdConfig;
use cudnn_cbr_amp::step::{AmpStep, StepConfig};
use cudnn_cbr_fusion::cbr::DeviceBnSync;
use half::f16;

mod common;
use common::{device, Rng};

fn plan() -> Arc<MemoryPlan> {
    let mut b = MemoryPlanBuilder::new();
    let first = b.bucket("first").unwrap();
    let deep = b.bucket("deep").unwrap();
    b.add("c1.w", ParamKind::ConvWeight, &[16, 3, 3, 8], first)
        .unwrap();
    b.add("c1.gamma", ParamKind::BnGamma, &[16], first).unwrap();
    b.add("c2.w", ParamKind::ConvWeight, &[32, 1, 1, 16], deep)
        .unwrap();
    b.add("c2.beta", ParamKind::BnBeta, &[32], deep).unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 32], deep).unwrap();
    b.add("fc.b", ParamKind::FcBias, &[10], deep).unwrap();
    Arc::new(b.finalize().unwrap())
}

/// A step over fresh regions with the same weights and gradients; `comm` runs the
/// collectives of a data-parallel step around it. Returns W, A and S after the step.
fn step(stream: &Arc<CudaStream>, comm: Option<&mut NcclComm>) -> Vec<Vec<u8>> {
    step_with(stream, comm, false)
}

/// [`step`]; with `per_bucket`, the gradients summed one bucket at a time (each after the
/// regions' stream, as an overlapped backward releases them) and then joined.
fn step_with(
    stream: &Arc<CudaStream>,
    comm: Option<&mut NcclComm>,
    per_bucket: bool,
) -> Vec<Vec<u8>> {
    let plan = plan();
    let mut regions = CudaRegions::new(plan.clone(), stream.clone()).unwrap();
    let mut rng = Rng(42);
    for p in plan.params() {
        regions
            .upload_f32(Region::W, p.name(), &rng.f32s(p.elems(), 0.5))
            .unwrap();
    }
    let mut step = AmpStep::new(
        regions,
        StepConfig::new(SgdConfig::new(0.1).with_momentum(0.9)),
    )
    .unwrap();
    step.init_weights().unwrap();
    step.begin().unwrap();
    for p in plan.params() {
        let r = step.executor_mut();
        if p.kind() == ParamKind::ConvWeight {
            let g: Vec<f16> = rng.f16s(p.elems(), 4096.0);
            r.upload_f16(Region::G16, p.name(), &g).unwrap();
        } else {
            r.upload_f32(Region::G, p.name(), &rng.f32s(p.elems(), 4096.0))
                .unwrap();
        }
    }
    match comm {
        None => step.finish().unwrap(),
        Some(comm) if per_bucket => {
            let after = step.executor().stream().clone();
            for b in plan.buckets().iter().rev() {
                dist_grads::all_reduce_bucket(step.executor_mut(), comm, b.bucket(), &after)
                    .unwrap();
            }
            dist_grads::join_gradients(step.executor_mut(), comm).unwrap();
            step.finish_with(|r| dist_grads::all_reduce_overflow(r, comm))
                .unwrap();
        }
        Some(comm) => {
            dist_grads::all_reduce_gradients(step.executor_mut(), comm).unwrap();
            step.finish_with(|r| dist_grads::all_reduce_overflow(r, comm))
                .unwrap();
        }
    }
    let r = step.executor();
    [Region::W, Region::A, Region::S]
        .into_iter()
        .map(|region| r.download_region_bytes(region).unwrap())
        .collect()
}

fn nccl_or_skip(test: &str, stream: &Arc<CudaStream>) -> Option<NcclComm> {
    let id = match NcclId::generate() {
        Ok(id) => id,
        Err(e) => {
            println!("SKIP {test}: {e}");
            return None;
        }
    };
    let link = stream.context().new_stream().unwrap();
    Some(NcclComm::new(link, 0, 1, &id).unwrap())
}

#[test]
fn gpu_a_one_rank_nccl_step_equals_the_step_without_a_communicator() {
    const TEST: &str = "gpu_a_one_rank_nccl_step_equals_the_step_without_a_communicator";
    let Some((stream, _)) = device(TEST) else {
        return;
    };
    let Some(mut comm) = nccl_or_skip(TEST, &stream) else {
        return;
    };
    let plain = step(&stream, None);
    let with = step(&stream, Some(&mut comm));
    comm.check_async().unwrap();
    for (name, (a, b)) in ["W", "A", "S"].iter().zip(plain.iter().zip(&with)) {
        assert_eq!(a, b, "region {name}");
    }
    comm.destroy().unwrap();
    println!(
        "{TEST}: W, A and S identical after one step (NCCL {})",
        cudnn_cbr_amp::dist::nccl::nccl_library()
            .map(|l| l.version())
            .unwrap_or(0)
    );
}

#[test]
fn gpu_per_bucket_sums_on_one_rank_equal_the_step_without_a_communicator() {
    const TEST: &str = "gpu_per_bucket_sums_on_one_rank_equal_the_step_without_a_communicator";
    let Some((stream, _)) = device(TEST) else {
        return;
    };
    let Some(mut comm) = nccl_or_skip(TEST, &stream) else {
        return;
    };
    let plain = step(&stream, None);
    let with = step_with(&stream, Some(&mut comm), true);
    comm.check_async().unwrap();
    for (name, (a, b)) in ["W", "A", "S"].iter().zip(plain.iter().zip(&with)) {
        assert_eq!(a, b, "region {name}");
    }
    // Synchronized BN's reducer over the same one-rank group leaves values as they are.
    let shared = Arc::new(std::sync::Mutex::new(comm));
    let mut bn = dist_grads::NcclBnSync::new(shared.clone());
    assert_eq!(bn.replicas(), 1);
    let host: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    let mut values = stream.clone_htod(&host).unwrap();
    bn.all_reduce_sum(&stream, &mut values).unwrap();
    assert_eq!(stream.clone_dtoh(&values).unwrap(), host);
    println!("{TEST}: per-bucket sums and the BN reducer leave one rank's step unchanged");
}

#[test]
fn gpu_an_aborted_communicator_refuses_later_collectives() {
    const TEST: &str = "gpu_an_aborted_communicator_refuses_later_collectives";
    let Some((stream, _)) = device(TEST) else {
        return;
    };
    let Some(mut comm) = nccl_or_skip(TEST, &stream) else {
        return;
    };
    let handle = comm.abort_handle();
    assert_eq!(handle.async_error(), None);
    handle.abort("the test's watchdog fired");
    let mut buf = stream.clone_htod(&[1f32; 16]).unwrap();
    let e = comm
        .all_reduce(&mut buf, ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    assert!(e.contains("aborted: the test's watchdog fired"), "{e}");
    assert!(comm.check_async().is_err());
    // A second abort and the drop after it free nothing twice.
    handle.abort("again");
    drop(comm);
    println!("{TEST}: refused after abort: {e}");
}

#[test]
fn gpu_a_group_that_never_forms_times_out_instead_of_hanging() {
    const TEST: &str = "gpu_a_group_that_never_forms_times_out_instead_of_hanging";
    let Some((stream, _)) = device(TEST) else {
        return;
    };
    let id = match NcclId::generate() {
        Ok(id) => id,
        Err(e) => {
            println!("SKIP {TEST}: {e}");
            return;
        }
    };
    // Rank 0 of two, and rank 1 never comes.
    let start = std::time::Instant::now();
    let link = stream.context().new_stream().unwrap();
    let timeout = std::time::Duration::from_secs(2);
    let e = NcclComm::new_within(link, 0, 2, &id, Some(timeout))
        .unwrap_err()
        .to_string();
    let waited = start.elapsed();
    assert!(e.contains("did not form within 2 s"), "{e}");
    assert!(waited >= timeout && waited < timeout * 5, "{waited:?}");
    println!("{TEST}: {e} after {:.1} s", waited.as_secs_f64());
}

#[test]
fn gpu_nccl_sums_across_every_gpu_like_the_cpu_group() {
    const TEST: &str = "gpu_nccl_sums_across_every_gpu_like_the_cpu_group";
    let Some((stream, _)) = device(TEST) else {
        return;
    };
    let count =
        cudnn_cbr_amp::cuda::cudarc::driver::CudaContext::device_count().unwrap_or(1) as usize;
    let id = match NcclId::generate() {
        Ok(id) => id,
        Err(e) => {
            println!("SKIP {TEST}: {e}");
            return;
        }
    };
    drop(stream);
    // One thread per GPU (NCCL's init blocks until every rank has joined).
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..count)
            .map(|rank| {
                s.spawn(move || {
                    let ctx = cudnn_cbr_amp::cuda::cuda_device(rank).unwrap();
                    let stream = ctx.new_stream().unwrap();
                    let mut comm = NcclComm::new(stream.clone(), rank, count, &id).unwrap();
                    let host: Vec<f32> = (0..1000).map(|i| (rank * 1000 + i) as f32).collect();
                    let mut buf = stream.clone_htod(&host).unwrap();
                    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    let out = stream.clone_dtoh(&buf).unwrap();
                    comm.destroy().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, v) in sums.iter().enumerate() {
        for (i, x) in v.iter().enumerate() {
            let want: f32 = (0..count).map(|r| (r * 1000 + i) as f32).sum();
            assert_eq!(*x, want, "rank {rank} element {i}");
        }
    }
    println!("{TEST}: {count} GPU(s) summed 1000 floats exactly");
}
