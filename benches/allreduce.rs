//! NCCL all-reduce bandwidth per bucket size, for the GPU check: one rank per GPU of this
//! machine (threads of one process), FP32 sums in place on each rank's communication stream.
//!
//! For each size: `time` is the median of `samples` all-reduces, each between two CUDA events
//! on rank 0's stream, after warm-up. `algbw` = bytes / time; `busbw` = algbw · 2(n−1)/n, the
//! figure NCCL's own tests print (the traffic a ring moves per link), so it compares across
//! GPU counts. With one GPU a collective moves nothing between GPUs, so busbw (0 by that
//! factor) is not printed: the table gives algbw and says busbw needs two or more ranks. The rows marked
//! `resnet50` are the gradient buckets of ResNet-50's memory plan (G16 conv run in FP16 and
//! the rest of G in FP32), as a data-parallel step sends them.
//!
//! `cargo bench --bench allreduce` prints the table; under `cargo test` it does one small
//! size. Without a GPU or NCCL it prints `SKIP allreduce: <reason>` and exits 0.

use std::time::Instant;

use cudnn_cbr::amp::cuda::{CudaContext, EventFlags};
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::dist::nccl::{NcclComm, NcclId};
use cudnn_cbr::dist::{Collective, ReduceOp};
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::{compile, memory_plan, RoutePolicy};
use cudnn_cbr::runtime::cuda_device;

// The network it runs, which tests/planned_gpu_shapes.rs compiles in CI.
#[path = "../tests/common/gpu_shapes.rs"]
mod gpu_shapes;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if let Err(e) = cuda_device(0) {
        println!("SKIP allreduce: {e}");
        return;
    }
    let id = match NcclId::generate() {
        Ok(id) => id,
        Err(e) => {
            println!("SKIP allreduce: {e}");
            return;
        }
    };
    let gpus = CudaContext::device_count().unwrap_or(1).max(1) as usize;
    // Sizes in bytes: powers of 4 from 4 KiB to 256 MiB, and ResNet-50's buckets.
    let mut sizes: Vec<(String, usize)> = if full {
        (6..=14)
            .map(|k| (String::new(), 1usize << (2 * k)))
            .collect()
    } else {
        vec![(String::new(), 1 << 16)]
    };
    if full {
        let (spec, batch, hw) = gpu_shapes::allreduce_net();
        let net = compile(&spec, batch, hw, &RoutePolicy::Uniform(RouteKind::Fused))
            .expect("ResNet-50 compiles");
        let plan = memory_plan(&net, 1000).expect("its memory plan");
        for b in plan.buckets().iter().rev() {
            let g16 = plan
                .bucket_range(b.bucket(), Region::G16)
                .map(|r| r.len())
                .unwrap_or(0);
            let rest = b
                .span16()
                .end
                .saturating_sub(b.conv16().end.max(b.span16().start))
                * 2;
            sizes.push((format!("resnet50 {} G16", b.name()), g16));
            sizes.push((format!("resnet50 {} G", b.name()), rest));
        }
    }
    let (warmup, samples) = if full { (5, 20) } else { (1, 3) };
    let started = Instant::now();
    let rows: Vec<(String, usize, f32)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..gpus)
            .map(|rank| {
                let sizes = sizes.clone();
                s.spawn(move || {
                    let ctx = cuda_device(rank).expect("device");
                    let stream = ctx.new_stream().expect("stream");
                    let mut comm =
                        NcclComm::new(stream.clone(), rank, gpus, &id).expect("NCCL init");
                    let timing = Some(EventFlags::CU_EVENT_DEFAULT);
                    let mut out = Vec::new();
                    for (label, bytes) in sizes {
                        let n = (bytes / 4).max(1);
                        let mut buf = stream.alloc_zeros::<f32>(n).expect("alloc");
                        for _ in 0..warmup {
                            comm.all_reduce(&mut buf, ReduceOp::Sum)
                                .expect("all-reduce");
                        }
                        let mut times = Vec::new();
                        for _ in 0..samples {
                            let (a, b) = (
                                ctx.new_event(timing).unwrap(),
                                ctx.new_event(timing).unwrap(),
                            );
                            a.record(&stream).unwrap();
                            comm.all_reduce(&mut buf, ReduceOp::Sum)
                                .expect("all-reduce");
                            b.record(&stream).unwrap();
                            times.push(a.elapsed_ms(&b).unwrap());
                        }
                        times.sort_by(f32::total_cmp);
                        out.push((label, n * 4, times[times.len() / 2]));
                    }
                    comm.destroy().expect("destroy");
                    out
                })
            })
            .collect();
        let mut all: Vec<_> = hs
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect();
        all.swap_remove(0)
    });
    println!("NCCL all-reduce (sum, f32, in place), {gpus} GPU(s), median of {samples}:");
    if gpus < 2 {
        println!(
            "busbw needs at least 2 ranks (its factor 2(n-1)/n is 0 for one): algbw only, \
             a one-rank all-reduce moves no data between GPUs"
        );
    }
    println!(
        "{:>28} {:>12} {:>10} {:>10} {:>10}",
        "bucket", "bytes", "time us", "algbw GB/s", "busbw GB/s"
    );
    let factor = 2.0 * (gpus as f64 - 1.0) / gpus as f64;
    for (label, bytes, ms) in rows {
        let algbw = bytes as f64 / (f64::from(ms) * 1e-3) / 1e9;
        let busbw = if gpus < 2 {
            "n/a".to_string()
        } else {
            format!("{:.2}", algbw * factor)
        };
        println!(
            "{label:>28} {bytes:>12} {:>10.1} {algbw:>10.2} {busbw:>10}",
            ms * 1000.0
        );
    }
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
}
