//! Tier 4 (GPU): the data-parallel step's collectives on NCCL. A one-rank NCCL group must
//! leave a step bit for bit as it is without a communicator. A one-rank sum in place is the
//! identity whatever datatype, count or op it is given, so the one-rank tests also sum out of
//! place into sentinel-filled regions: exactly each bucket's ranges must be written, with the
//! exact values, and every other byte keep the sentinel. With two or more GPUs, the ranks'
//! sums (and maxima) must equal the host's, per bucket of a plan too; with fewer that test
//! prints a SKIP line saying two GPUs are needed (one rank cannot tell Sum from Max).
//!
//! Without a device, NVRTC or NCCL each test prints one `SKIP <test>: <reason>` line.

use std::sync::Arc;

use cudnn_cbr_amp::cuda::{dist_grads, CudaRegions, CudaStream};
use cudnn_cbr_amp::plan::{ByteRange, MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::SgdConfig;
use cudnn_cbr_amp::step::{AmpStep, StepConfig};
use cudnn_cbr_dist::nccl::{NcclComm, NcclId};
use cudnn_cbr_dist::{Collective, Communicator, ReduceOp};
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
        cudnn_cbr_dist::nccl::nccl_library()
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
    assert_eq!(dist_grads::lock(&shared).world(), 1);
    let host: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    let mut values = stream.clone_htod(&host).unwrap();
    dist_grads::all_reduce_sum_ordered(&shared, &stream, &mut values).unwrap();
    assert_eq!(stream.clone_dtoh(&values).unwrap(), host);
    println!("{TEST}: per-bucket sums and the BN reducer leave one rank's step unchanged");
}

/// The ranges each bucket's sum writes, per region.
fn summed_ranges(plan: &MemoryPlan) -> Vec<(Region, ByteRange)> {
    plan.buckets()
        .iter()
        .flat_map(|b| cudnn_cbr_amp::dist::grads::bucket_collectives(plan, b.bucket()).unwrap())
        .map(|c| (c.region, c.range))
        .collect()
}

/// Bytes of `region` (its length) holding random finite values of the region's type.
fn random_region(plan: &MemoryPlan, region: Region, rng: &mut Rng) -> Vec<u8> {
    let len = plan.region_range(region).unwrap().len();
    match region {
        Region::G16 => rng
            .f16s(len / 2, 8.0)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        _ => rng
            .f32s(len / 4, 8.0)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
    }
}

/// What the destination regions hold before the sums: afterwards every byte outside the
/// summed ranges must still be this (the check is bytewise).
const SENTINEL: u8 = 0xA5;

#[test]
fn gpu_one_ranks_bucket_sums_write_exactly_their_ranges_with_the_exact_values() {
    const TEST: &str = "gpu_one_ranks_bucket_sums_write_exactly_their_ranges_with_the_exact_values";
    let Some((stream, _)) = device(TEST) else {
        return;
    };
    let Some(mut comm) = nccl_or_skip(TEST, &stream) else {
        return;
    };
    let plan = plan();
    let mut rng = Rng(9);
    let mut from = CudaRegions::new(plan.clone(), stream.clone()).unwrap();
    let mut into = CudaRegions::new(plan.clone(), stream.clone()).unwrap();
    let regions = [Region::G16, Region::G];
    let mut sent = Vec::new();
    for region in regions {
        let bytes = random_region(&plan, region, &mut rng);
        from.upload_region_bytes(region, &bytes).unwrap();
        let len = bytes.len();
        sent.push(bytes);
        into.upload_region_bytes(region, &vec![SENTINEL; len])
            .unwrap();
    }
    let after = stream.clone();
    for (i, b) in plan.buckets().iter().rev().enumerate() {
        dist_grads::all_reduce_bucket_into(&mut from, &mut into, &mut comm, b.bucket(), &after)
            .unwrap();
        assert_eq!(into.collectives_in_flight(), i + 1);
    }
    dist_grads::join_gradients(&mut into, &mut comm).unwrap();
    dist_grads::join_gradients(&mut from, &mut comm).unwrap();
    assert_eq!(into.collectives_in_flight(), 0);
    comm.check_async().unwrap();
    let summed = summed_ranges(&plan);
    let mut written = 0;
    for (region, sent) in regions.into_iter().zip(&sent) {
        assert_eq!(
            &from.download_region_bytes(region).unwrap(),
            sent,
            "{region} of the source changed"
        );
        let got = into.download_region_bytes(region).unwrap();
        for (at, (g, s)) in got.iter().zip(sent).enumerate() {
            let inside = summed
                .iter()
                .any(|&(r, b)| r == region && (b.start..b.end).contains(&at));
            if inside {
                // One rank's sum is its own value, bit for bit (wrong datatype or count:
                // a short tail of sentinels, or a neighbour overwritten).
                assert_eq!(g, s, "{region} byte {at} inside a bucket's sum");
                written += 1;
            } else {
                assert_eq!(
                    *g, SENTINEL,
                    "{region} byte {at} outside every bucket's sum was written"
                );
            }
        }
    }
    let expect: usize = summed.iter().map(|(_, b)| b.len()).sum();
    assert_eq!(written, expect);
    comm.destroy().unwrap();
    println!(
        "{TEST}: {written} bytes written by {} calls, none outside them",
        summed.len()
    );
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
    let count = cudnn_cbr_amp::cuda::CudaContext::device_count().unwrap_or(1) as usize;
    if count < 2 {
        // One rank's sum and maximum are both the identity: nothing here could fail.
        println!("SKIP {TEST}: needs two GPUs, this machine has {count}");
        return;
    }
    let id = match NcclId::generate() {
        Ok(id) => id,
        Err(e) => {
            println!("SKIP {TEST}: {e}");
            return;
        }
    };
    drop(stream);
    let plan = plan();
    // Small integers: FP16 and FP32 sums of them are exact in any order.
    let g16 = |rank: usize, i: usize| f16::from_f32(((rank + 1) * (i % 7)) as f32);
    let g32 = |rank: usize, i: usize| ((rank + 3) * (i % 11)) as f32;
    // One thread per GPU (NCCL's init blocks until every rank has joined).
    type Out = (Vec<f32>, Vec<f32>, Vec<u8>, Vec<u8>);
    let outs: Vec<Out> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..count)
            .map(|rank| {
                let plan = plan.clone();
                s.spawn(move || {
                    let ctx = cudnn_cbr_runtime::cuda_device(rank).unwrap();
                    let stream = ctx.new_stream().unwrap();
                    let link = ctx.new_stream().unwrap();
                    let mut comm = NcclComm::new(link, rank, count, &id).unwrap();
                    let host: Vec<f32> = (0..1000).map(|i| (rank * 1000 + i) as f32).collect();
                    let mut sum = stream.clone_htod(&host).unwrap();
                    comm.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                    let mut max = stream.clone_htod(&host).unwrap();
                    comm.all_reduce(&mut max, ReduceOp::Max).unwrap();
                    // A step's bucket sums over the regions, in place.
                    let mut regions = CudaRegions::new(plan.clone(), stream.clone()).unwrap();
                    let n16 = plan.region_range(Region::G16).unwrap().len() / 2;
                    let n32 = plan.region_range(Region::G).unwrap().len() / 4;
                    let b16: Vec<u8> = (0..n16).flat_map(|i| g16(rank, i).to_le_bytes()).collect();
                    let b32: Vec<u8> = (0..n32).flat_map(|i| g32(rank, i).to_le_bytes()).collect();
                    regions.upload_region_bytes(Region::G16, &b16).unwrap();
                    regions.upload_region_bytes(Region::G, &b32).unwrap();
                    let after = stream.clone();
                    for b in plan.buckets().iter().rev() {
                        dist_grads::all_reduce_bucket(&mut regions, &mut comm, b.bucket(), &after)
                            .unwrap();
                    }
                    dist_grads::join_gradients(&mut regions, &mut comm).unwrap();
                    let out = (
                        stream.clone_dtoh(&sum).unwrap(),
                        stream.clone_dtoh(&max).unwrap(),
                        regions.download_region_bytes(Region::G16).unwrap(),
                        regions.download_region_bytes(Region::G).unwrap(),
                    );
                    comm.destroy().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let summed = summed_ranges(&plan);
    let inside = |region: Region, byte: usize| {
        summed
            .iter()
            .any(|&(r, b)| r == region && (b.start..b.end).contains(&byte))
    };
    for (rank, (sum, max, r16, r32)) in outs.iter().enumerate() {
        for (i, (s, m)) in sum.iter().zip(max).enumerate() {
            let want: f32 = (0..count).map(|r| (r * 1000 + i) as f32).sum();
            assert_eq!(*s, want, "rank {rank} sum element {i}");
            assert_eq!(
                *m,
                ((count - 1) * 1000 + i) as f32,
                "rank {rank} max element {i}"
            );
        }
        for (i, c) in r16.chunks_exact(2).enumerate() {
            let got = f16::from_le_bytes([c[0], c[1]]);
            let want = if inside(Region::G16, 2 * i) {
                f16::from_f32((0..count).map(|r| g16(r, i).to_f32()).sum())
            } else {
                g16(rank, i)
            };
            assert_eq!(got.to_bits(), want.to_bits(), "rank {rank} G16 element {i}");
        }
        for (i, c) in r32.chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let want = if inside(Region::G, 4 * i) {
                (0..count).map(|r| g32(r, i)).sum()
            } else {
                g32(rank, i)
            };
            assert_eq!(got, want, "rank {rank} G element {i}");
        }
    }
    println!("{TEST}: {count} GPUs summed and maxed 1000 floats and a plan's buckets exactly");
}
