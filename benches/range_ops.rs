//! Range-op bandwidth on the GPU: each AMP range op over the regions of a 25.6 M-parameter
//! plan (ResNet-50's size), against a device-to-device copy of the same traffic measured in
//! the same run.
//!
//! For each op: `bytes` is what it reads plus what it writes ([`RangeOp::traffic_bytes`]),
//! `time` the median over samples of K back-to-back launches between two CUDA events, after
//! warm-up; the copy moves half that many bytes (so it too reads + writes `bytes`). `ratio`
//! is op GB/s over copy GB/s: 1.0 means the op runs at copy speed.
//!
//! `cargo bench --bench range_ops` prints the table; under `cargo test` (no `--bench` flag)
//! it does one tiny pass. Without a GPU it prints `SKIP range_ops: <reason>` and exits 0.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use cudnn_cbr::amp::cuda::CudaRegions;
use cudnn_cbr::amp::cuda::EventFlags;
use cudnn_cbr::amp::plan::{ByteRange, MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr::amp::range::{LossScalePolicy, OverflowPolicy, SgdConfig};
use cudnn_cbr::amp::step::{AmpExecutor, AmpStep, RangeOp, StepConfig};
use cudnn_cbr::amp::{AmpError, CudaError};

/// A driver failure while measuring: a real error, never a SKIP.
fn driver(op: &'static str) -> impl Fn(DriverError) -> AmpError {
    move |e| {
        CudaError::Driver {
            op: op.into(),
            code: e.to_string(),
        }
        .into()
    }
}

/// How hard to measure.
struct Effort {
    warmup: usize,
    samples: usize,
    reps: usize,
}

/// `params` conv weights of `[k, c, 1, 1]`: conv only, so G16 is one range without holes.
fn plan(params: usize, k: usize, c: usize) -> MemoryPlan {
    let mut b = MemoryPlanBuilder::new().with_ema(true);
    let all = b.bucket("all").expect("bucket");
    for i in 0..params {
        b.add(
            &format!("conv{i}.w"),
            ParamKind::ConvWeight,
            &[k, c, 1, 1],
            all,
        )
        .expect("param");
    }
    b.finalize().expect("plan")
}

/// GPU milliseconds of `work`, run `reps` times between two events, per run.
fn time_ms(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    reps: usize,
    mut work: impl FnMut() -> Result<(), AmpError>,
) -> Result<f64, AmpError> {
    let ev = || {
        ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT))
            .map_err(driver("create a timing event"))
    };
    let (start, end) = (ev()?, ev()?);
    start.record(stream).map_err(driver("record an event"))?;
    for _ in 0..reps {
        work()?;
    }
    end.record(stream).map_err(driver("record an event"))?;
    let ms = start
        .elapsed_ms(&end)
        .map_err(driver("read the event timer"))?;
    Ok(f64::from(ms) / reps as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    effort: &Effort,
    mut work: impl FnMut() -> Result<(), AmpError>,
) -> Result<f64, AmpError> {
    for _ in 0..effort.warmup {
        work()?;
    }
    let mut samples = Vec::with_capacity(effort.samples);
    for _ in 0..effort.samples {
        samples.push(time_ms(ctx, stream, effort.reps, &mut work)?);
    }
    Ok(median(samples))
}

/// A device-to-device copy of `bytes` between two scratch buffers.
fn copy_ms(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    effort: &Effort,
    src: &CudaSlice<u8>,
    dst: &mut CudaSlice<u8>,
    bytes: usize,
) -> Result<f64, AmpError> {
    measure(ctx, stream, effort, || {
        let from = src.slice(0..bytes);
        let mut to = dst.slice_mut(0..bytes);
        stream
            .memcpy_dtod(&from, &mut to)
            .map_err(driver("copy device to device"))
    })
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

fn run(full: bool) -> Result<(), AmpError> {
    let (params, k, c) = if full {
        (25, 1024, 1000)
    } else {
        (1, 256, 1024)
    };
    let effort = if full {
        Effort {
            warmup: 10,
            samples: 31,
            reps: 20,
        }
    } else {
        Effort {
            warmup: 1,
            samples: 3,
            reps: 2,
        }
    };
    let plan = Arc::new(plan(params, k, c));
    let n = plan.total_elems();
    let ctx = cudnn_cbr::runtime::cuda_device(0)?;
    let stream = ctx.new_stream().map_err(driver("create a stream"))?;
    let regions = CudaRegions::new(plan.clone(), stream.clone())?;
    let config = StepConfig::new(SgdConfig::new(0.01).with_momentum(0.9))
        .with_ema(0.999)
        .with_loss_scale(LossScalePolicy::default());
    let mut step = AmpStep::new(regions, config)?;
    step.init_weights()?;

    let whole = ByteRange::new(0, plan.region_len(Region::A));
    let ops: Vec<(&str, RangeOp)> = vec![
        (
            "zero G",
            RangeOp::Zero {
                region: Region::G,
                span16: whole,
            },
        ),
        (
            "cast G16->G",
            RangeOp::CastF16ToF32 {
                src: Region::G16,
                dst: Region::G,
                span16: whole,
            },
        ),
        (
            "cast W->A",
            RangeOp::CastF32ToF16 {
                src: Region::W,
                dst: Region::A,
                span16: whole,
            },
        ),
        (
            "check NaN/Inf",
            RangeOp::Check {
                policy: OverflowPolicy::NanOrInf,
                span16: whole,
            },
        ),
        (
            "check+clip",
            RangeOp::Check {
                policy: OverflowPolicy::clip_inf(),
                span16: whole,
            },
        ),
        (
            "SGD momentum",
            // (lr, momentum and weight decay come from S: the step above wrote 0.01 and 0.9.)
            RangeOp::Sgd {
                nesterov: false,
                decay: true,
                momentum_buffer: true,
                span16: whole,
            },
        ),
        (
            "SGD plain",
            RangeOp::Sgd {
                nesterov: false,
                decay: true,
                momentum_buffer: false,
                span16: whole,
            },
        ),
        (
            "EMA",
            RangeOp::Ema {
                decay: 0.999,
                span16: whole,
            },
        ),
        (
            "copy W->E",
            RangeOp::CopyF32 {
                src: Region::W,
                dst: Region::E,
                span16: whole,
            },
        ),
        (
            "loss-scale update",
            RangeOp::LossScaleUpdate {
                policy: LossScalePolicy::default(),
            },
        ),
    ];
    let max_traffic = ops
        .iter()
        .map(|(_, op)| op.traffic_bytes())
        .chain(step.finish_ops().iter().map(RangeOp::traffic_bytes))
        .max()
        .unwrap_or(0);
    let alloc = |bytes: usize| {
        stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(driver("allocate copy scratch"))
    };
    let src = alloc(max_traffic / 2)?;
    let mut dst = alloc(max_traffic / 2)?;

    println!(
        "range ops on device 0 ({}), {:.1} M parameters, median of {} samples x {} launches",
        step.executor().kernels().code(),
        n as f64 / 1e6,
        effort.samples,
        effort.reps
    );
    println!(
        "{:<20} {:>10} {:>10} {:>9} {:>10} {:>7}",
        "op", "bytes MB", "time us", "GB/s", "copy GB/s", "ratio"
    );
    let row = |name: &str, bytes: usize, ms: f64, copy: Option<f64>| {
        let (g, cg) = (gbps(bytes, ms), copy.map(|c| gbps(bytes, c)));
        println!(
            "{:<20} {:>10.1} {:>10.1} {:>9.0} {:>10} {:>7}",
            name,
            bytes as f64 / 1e6,
            ms * 1e3,
            g,
            cg.map_or("-".into(), |c| format!("{c:.0}")),
            cg.map_or("-".into(), |c| format!("{:.2}", g / c)),
        );
    };
    for (name, op) in &ops {
        let bytes = op.traffic_bytes();
        let ex = step.executor_mut();
        let ms = measure(&ctx, &stream, &effort, || ex.run(op))?;
        if matches!(op, RangeOp::LossScaleUpdate { .. }) {
            row(name, bytes, ms, None);
            continue;
        }
        let copy = copy_ms(&ctx, &stream, &effort, &src, &mut dst, bytes / 2)?;
        row(name, bytes, ms, Some(copy));
    }
    // The whole finish, eager and as a graph replay.
    let finish_bytes: usize = step.finish_ops().iter().map(RangeOp::traffic_bytes).sum();
    let eager = measure(&ctx, &stream, &effort, || step.finish())?;
    let graph = step.capture_finish()?;
    let replay = measure(&ctx, &stream, &effort, || step.replay(&graph))?;
    row(
        &format!("finish ({} ops)", step.finish_ops().len()),
        finish_bytes,
        eager,
        None,
    );
    row("finish, graph", finish_bytes, replay, None);
    stream.synchronize().map_err(driver("synchronize"))?;
    Ok(())
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    match run(full) {
        Ok(()) => {}
        Err(e) if e.is_unavailable() => println!("SKIP range_ops: {e}"),
        Err(e) => {
            eprintln!("range_ops failed: {e}");
            std::process::exit(1);
        }
    }
}
