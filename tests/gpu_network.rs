//! Tier 4 (GPU): two small networks (a stem and one bottleneck block with a projection
//! shortcut; ResNet's 7×7/2 stem with its max-pool and two basic blocks with projections),
//! each compiled for the device on the fused route (with its fallbacks) and on the unfused
//! route, run forward and backward by the CUDA executor ([`CudaNet`]) and by the CPU executor
//! on the same routes and inputs; every buffer of the network compared; then the fused route
//! again with synchronized BN over two identical replicas on both executors; and the GPU
//! engine's data-parallel group (two ranks as threads over NCCL, synchronized BN) keeping its
//! ranks' weights identical. Prints one SKIP line without a usable CUDA device or cuDNN.

mod common;

use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::{BnSync, DeviceBnSync, RouteKind};
use cudnn_cbr::fusion::exec::Handle;
use cudnn_cbr::net::{compile, BufferRole, CompiledNet, CpuNet, CudaNet, NetSpec, RoutePolicy};
use cudnn_cbr::runtime::DataType;
use half::f16;

fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    if num == 0.0 {
        0.0
    } else {
        (num / den.max(1e-30)).sqrt()
    }
}

fn decode(bytes: &[u8], dtype: DataType) -> Vec<f64> {
    match dtype {
        DataType::Half => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
    }
}

/// Synchronized BN over two replicas that hold the same batch, on the host: every sum is
/// twice the local one (exact in FP32). The GPU run with [`DeviceTwin`] must match it, which
/// exercises the GPU's collectives points, global counts and recomputed coefficients against
/// the CPU executor's (whose synchronized BN the data-parallel tests check against one rank
/// with the whole batch).
struct HostTwin;

impl BnSync<f32> for HostTwin {
    fn replicas(&self) -> usize {
        2
    }
    fn all_reduce_sum(&mut self, values: &mut [f32]) -> cudnn_cbr::fusion::Result<()> {
        values.iter_mut().for_each(|v| *v *= 2.0);
        Ok(())
    }
}

/// [`HostTwin`] on the device (through the host: a test, not a collective).
struct DeviceTwin;

impl DeviceBnSync for DeviceTwin {
    fn replicas(&self) -> usize {
        2
    }
    fn all_reduce_sum(
        &mut self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        values: &mut cudarc::driver::CudaSlice<f32>,
    ) -> cudnn_cbr::fusion::Result<()> {
        let fail = |e: cudarc::driver::DriverError| cudnn_cbr::fusion::Error::BnSync(e.to_string());
        let mut host = stream.clone_dtoh(values).map_err(fail)?;
        host.iter_mut().for_each(|v| *v *= 2.0);
        stream.memcpy_htod(&host, values).map_err(fail)
    }
}

/// The network `on_gpu` was compiled from, compiled for the CPU executor on exactly the routes
/// the device got.
fn cpu_twin(on_gpu: &CompiledNet, spec: &NetSpec, batch: usize, hw: usize) -> CompiledNet {
    let routes = on_gpu
        .layers
        .iter()
        .map(|l| (l.name.clone(), l.layer.route().kind()))
        .collect();
    let policy = RoutePolicy::PerLayer {
        routes,
        default: RouteKind::Fused,
    };
    compile(spec, batch, hw, &policy).unwrap()
}

/// Forward + backward passes per side before comparing (an engine that accumulated into an
/// output instead of overwriting it would differ on the second).
const PASSES: usize = 2;

#[test]
fn a_bottleneck_block_with_projection_matches_the_cpu_executor() {
    let [(spec, batch_hw), _] = common::gpu_shapes::network_cases();
    matches_the_cpu_executor("a_bottleneck_block_with_projection", &spec, batch_hw);
}

#[test]
fn a_pooled_stem_and_basic_blocks_match_the_cpu_executor() {
    let [_, (spec, batch_hw)] = common::gpu_shapes::network_cases();
    matches_the_cpu_executor("a_pooled_stem_and_basic_blocks", &spec, batch_hw);
}

/// `spec` at `(batch, hw)` on both executors, every buffer compared (module docs).
fn matches_the_cpu_executor(test: &str, spec: &NetSpec, (batch, hw): (usize, usize)) {
    let Some(ctx) = common::gpu_or_skip(test) else {
        return;
    };
    let stream = ctx.default_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let target = handle.target().unwrap();
    let cache = PlanCache::new();
    // (fused, synchronized BN over two identical replicas)
    for (fused, synced) in [(true, false), (false, false), (true, true)] {
        let policy = if fused {
            RoutePolicy::Planned {
                target: &target,
                cache: &cache,
            }
        } else {
            RoutePolicy::PlannedRoute {
                target: &target,
                cache: &cache,
                route: RouteKind::Unfused,
            }
        };
        let on_gpu = compile(spec, batch, hw, &policy).unwrap();
        let cpu_net = cpu_twin(&on_gpu, spec, batch, hw);
        let mut cpu: CpuNet<f16> = CpuNet::new(cpu_net);
        let mut gpu = CudaNet::new(on_gpu, handle.clone(), None).unwrap();
        if synced {
            cpu.set_bn_sync(Box::new(HostTwin));
            gpu.set_bn_sync(Box::new(DeviceTwin)).unwrap();
        }
        // The same parameters, images and output gradient on both sides.
        let mut seed = 7u64;
        let buffers = cpu.net().buffers.clone();
        for b in buffers.iter().filter(|b| b.role == BufferRole::Param) {
            let (scale, base) = if b.name.ends_with(".w") {
                (0.25, 0.0)
            } else if b.name.ends_with(".gamma") {
                (0.2, 1.0)
            } else {
                (0.2, 0.0)
            };
            let v: Vec<f32> = (0..b.elems)
                .map(|_| base + scale * common::uniform(&mut seed))
                .collect();
            if b.dtype == DataType::Half {
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                gpu.upload(
                    &b.name,
                    &h.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
                )
                .unwrap();
                cpu.set_half(&b.name, h).unwrap();
            } else {
                gpu.upload(
                    &b.name,
                    &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
                )
                .unwrap();
                cpu.set_float(&b.name, v).unwrap();
            }
        }
        let half = |n: usize, seed: &mut u64| -> Vec<f16> {
            (0..n)
                .map(|_| f16::from_f32(common::uniform(seed)))
                .collect()
        };
        let net = cpu.net();
        let (input, d_out) = (net.input, net.output_grad);
        let images = half(buffers[input].elems, &mut seed);
        let grad = half(buffers[d_out].elems, &mut seed);
        let bytes = |v: &[f16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        for _ in 0..PASSES {
            cpu.forward(&images).unwrap();
            cpu.backward(grad.clone()).unwrap();
            gpu.upload(&buffers[input].name, &bytes(&images)).unwrap();
            gpu.forward().unwrap();
            gpu.upload(&buffers[d_out].name, &bytes(&grad)).unwrap();
            gpu.backward().unwrap();
        }
        stream.synchronize().unwrap();
        let routes: Vec<String> = gpu
            .compiled()
            .layers
            .iter()
            .map(|l| format!("{} {}", l.name, l.layer.route().name()))
            .collect();
        println!("routes: {}", routes.join(", "));
        let mut compared = 0;
        for b in &buffers {
            let on_gpu = decode(&gpu.download(&b.name).unwrap(), b.dtype);
            let on_cpu = cpu.values(&b.name).unwrap();
            let err = rel_l2(&on_gpu, &on_cpu);
            println!(
                "{:<8} {:<28} rel L2 {err:.2e}",
                match (fused, synced) {
                    (true, true) => "synced",
                    (true, false) => "fused",
                    _ => "unfused",
                },
                b.name
            );
            // FP16 stores on both sides with FP32 accumulation in different orders: forward
            // values agree to a few 2^-11; gradients (and the coefficients derived from them) go
            // through more FP16 stores and near-zero ReLU decisions: 2e-2, as the layer parity
            // test.
            let gradient = matches!(b.role, BufferRole::Gradient | BufferRole::ParamGrad)
                || b.name.contains("dbn");
            let tol = if gradient { 2e-2 } else { 5e-3 };
            assert!(err <= tol, "{}: {err:.2e}", b.name);
            compared += 1;
        }
        assert!(compared > 60, "only {compared} buffers compared");
    }
}

/// Evaluation mode ([`CudaNet::evaluate`]) against the CPU executor's
/// ([`CpuNet::evaluate`]) on the device's fused route (with its fallbacks): one training
/// forward first (so the running statistics are not their initial values), then the
/// evaluation of other images; the output and every activation compared, and the running
/// statistics on the device bit for bit what the training forward left.
#[test]
fn eval_mode_matches_the_cpu_executor() {
    eval_mode_case("eval_mode_matches_the_cpu_executor", None);
}

/// [`eval_mode_matches_the_cpu_executor`] with every layer on the unfused route: its BN forward
/// (NormForward, training-mode BN) is replaced in evaluation by our `cbr_bn_eval` kernel
/// (running statistics, then the residual and ReLU, or the BN output alone for `y_bn`).
#[test]
fn eval_mode_on_the_unfused_route_matches_the_cpu_executor() {
    eval_mode_case(
        "eval_mode_on_the_unfused_route_matches_the_cpu_executor",
        Some(RouteKind::Unfused),
    );
}

/// The bottleneck block with the device's planned routes, or every layer on `route`.
fn eval_mode_case(test: &str, route: Option<RouteKind>) {
    let Some(ctx) = common::gpu_or_skip(test) else {
        return;
    };
    let [(spec, (batch, hw)), _] = common::gpu_shapes::network_cases();
    let stream = ctx.default_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let target = handle.target().unwrap();
    let cache = PlanCache::new();
    let policy = match route {
        None => RoutePolicy::Planned {
            target: &target,
            cache: &cache,
        },
        Some(route) => RoutePolicy::PlannedRoute {
            target: &target,
            cache: &cache,
            route,
        },
    };
    let on_gpu = compile(&spec, batch, hw, &policy).unwrap();
    if let Some(route) = route {
        assert!(on_gpu
            .layers
            .iter()
            .all(|l| l.layer.route().kind() == route));
    }
    let cpu_net = cpu_twin(&on_gpu, &spec, batch, hw);
    let mut cpu: CpuNet<f16> = CpuNet::new(cpu_net);
    let mut gpu = CudaNet::new(on_gpu, handle.clone(), None).unwrap();
    let mut seed = 11u64;
    let buffers = cpu.net().buffers.clone();
    let bytes16 = |v: &[f16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    for b in buffers.iter().filter(|b| b.role == BufferRole::Param) {
        let (scale, base) = if b.name.ends_with(".gamma") {
            (0.2, 1.0)
        } else {
            (0.25, 0.0)
        };
        let v: Vec<f32> = (0..b.elems)
            .map(|_| base + scale * common::uniform(&mut seed))
            .collect();
        if b.dtype == DataType::Half {
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            gpu.upload(&b.name, &bytes16(&h)).unwrap();
            cpu.set_half(&b.name, h).unwrap();
        } else {
            let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            gpu.upload(&b.name, &raw).unwrap();
            cpu.set_float(&b.name, v).unwrap();
        }
    }
    let input = cpu.net().input;
    let half = |n: usize, seed: &mut u64| -> Vec<f16> {
        (0..n)
            .map(|_| f16::from_f32(common::uniform(seed)))
            .collect()
    };
    let train = half(buffers[input].elems, &mut seed);
    let images = half(buffers[input].elems, &mut seed);
    cpu.forward(&train).unwrap();
    gpu.upload(&buffers[input].name, &bytes16(&train)).unwrap();
    gpu.forward().unwrap();
    let running: Vec<&str> = buffers
        .iter()
        .map(|b| b.name.as_str())
        .filter(|n| n.ends_with(".running_mean") || n.ends_with(".running_var"))
        .collect();
    assert!(!running.is_empty());
    let before: Vec<Vec<u8>> = running.iter().map(|n| gpu.download(n).unwrap()).collect();
    cpu.evaluate(&images).unwrap();
    gpu.upload(&buffers[input].name, &bytes16(&images)).unwrap();
    gpu.evaluate().unwrap();
    stream.synchronize().unwrap();
    let after: Vec<Vec<u8>> = running.iter().map(|n| gpu.download(n).unwrap()).collect();
    assert!(
        before == after,
        "evaluation wrote a running statistic on the device"
    );
    let mut compared = 0;
    let activation = |n: &str| {
        !n.starts_with("d:") && (n.ends_with(".out") || n.ends_with(".a") || n.ends_with(".y_bn"))
    };
    for b in buffers.iter().filter(|b| activation(&b.name)) {
        let on_gpu = decode(&gpu.download(&b.name).unwrap(), b.dtype);
        let on_cpu = cpu.values(&b.name).unwrap();
        let err = rel_l2(&on_gpu, &on_cpu);
        println!("eval {:<28} rel L2 {err:.2e}", b.name);
        // FP16 stores on both sides with FP32 accumulation in different orders, and the same
        // FP16 eq coefficients (both from bn_eval_finalize; on the unfused route the same
        // FP32 normalization, in the same op order): the forward's tolerance above.
        assert!(err <= 5e-3, "{}: {err:.2e}", b.name);
        compared += 1;
    }
    let out = &buffers[cpu.net().output];
    let err = rel_l2(
        &decode(&gpu.download(&out.name).unwrap(), out.dtype),
        &cpu.values(&out.name).unwrap(),
    );
    println!("eval output {} rel L2 {err:.2e}", out.name);
    assert!(err <= 5e-3, "output {}: {err:.2e}", out.name);
    assert!(compared >= 2, "only {compared} activations compared");
}

/// The classifiers end to end: two training steps on the CPU and on the device from the same
/// weights and data (routes as the device planned them), then one batch evaluated by both
/// (BN from the running statistics): the logits agree, the last training batch's metrics
/// survive the evaluation, and the EMA weights are a typed error on the device so far.
#[test]
fn the_cuda_classifier_evaluates_like_the_cpu_classifier() {
    use cudnn_cbr::classifier::{CpuClassifier, CudaClassifier, EvalWeights};
    use cudnn_cbr::{amp::range::SgdConfig, amp::step::StepConfig, net::Preset};
    let Some(ctx) = common::gpu_or_skip("the_cuda_classifier_evaluates_like_the_cpu_classifier")
    else {
        return;
    };
    let stream = ctx.default_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let target = handle.target().unwrap();
    let cache = PlanCache::new();
    let (batch, hw, classes) = (8, 16, 4);
    let spec = Preset::Mini.spec(3, classes, 8);
    let planned = RoutePolicy::Planned {
        target: &target,
        cache: &cache,
    };
    let on_gpu = compile(&spec, batch, hw, &planned).unwrap();
    let on_cpu = cpu_twin(&on_gpu, &spec, batch, hw);
    // With an EMA (decay 0.5: two steps move it well away from the weights), so the EMA
    // evaluation reads other weights than the trained one.
    let config = StepConfig::new(SgdConfig::new(0.05)).with_ema(0.5);
    let mut cpu = CpuClassifier::new(on_cpu, classes, config, 7).unwrap();
    let mut gpu = CudaClassifier::new(on_gpu, handle, classes, config, 7).unwrap();
    let mut seed = 11u64;
    let batch_of = |seed: &mut u64| -> Vec<f16> {
        (0..batch * hw * hw * 3)
            .map(|_| f16::from_f32(common::uniform(seed)))
            .collect()
    };
    let labels: Vec<i32> = (0..batch as i32).map(|i| i % classes as i32).collect();
    for _ in 0..2 {
        let images = batch_of(&mut seed);
        cpu.step_mut().begin().unwrap();
        cpu.forward_backward(&images, &labels).unwrap();
        cpu.step_mut().finish().unwrap();
        let mut x = stream.clone_htod(&images).unwrap();
        gpu.step_mut().begin().unwrap();
        gpu.forward_backward(&mut x, &labels).unwrap();
        gpu.step_mut().finish().unwrap();
    }
    let trained = gpu.metrics_blocking().unwrap();
    let images = batch_of(&mut seed);
    let want = cpu.evaluate(&images, EvalWeights::Trained).unwrap();
    let mut x = stream.clone_htod(&images).unwrap();
    let got = gpu.evaluate(&mut x, EvalWeights::Trained).unwrap();
    let as_f64 = |v: &[f16]| v.iter().map(|x| x.to_f64()).collect::<Vec<_>>();
    let err = rel_l2(&as_f64(&got.logits), &as_f64(&want.logits));
    println!(
        "evaluation logits rel L2 {err:.2e}; top-1 {:?} vs {:?}",
        got.top1, want.top1
    );
    // Two training steps' updates (FP32 sums in other orders, 2e-2 as gradients above) and an
    // FP16 forward (5e-3 as activations): the logits within 2e-2.
    assert!(err <= 2e-2, "logits differ by {err:.2e}");
    assert_eq!(got.logits.len(), batch * classes);
    assert_eq!(
        gpu.metrics_blocking().unwrap(),
        trained,
        "evaluation moved the metrics"
    );
    // The EMA weights (E16 and E in place of A and W on the device) against the CPU
    // classifier's EMA evaluation, within the same tolerance; they differ from the trained
    // weights' logits, and the trained weights come back bit for bit.
    let want_ema = cpu.evaluate(&images, EvalWeights::Ema).unwrap();
    let got_ema = gpu.evaluate(&mut x, EvalWeights::Ema).unwrap();
    let err_ema = rel_l2(&as_f64(&got_ema.logits), &as_f64(&want_ema.logits));
    let apart = rel_l2(&as_f64(&got_ema.logits), &as_f64(&got.logits));
    println!("EMA evaluation logits rel L2 {err_ema:.2e} (trained vs EMA: {apart:.2e})");
    assert!(err_ema <= 2e-2, "EMA logits differ by {err_ema:.2e}");
    assert!(
        apart > 10.0 * err_ema.max(1e-4),
        "the EMA changed nothing: {apart:.2e}"
    );
    let again = gpu.evaluate(&mut x, EvalWeights::Trained).unwrap();
    assert_eq!(
        again.logits, got.logits,
        "the trained weights did not come back bit for bit"
    );
}

/// The GPU engine as two launched ranks (threads of this process: the simulated NCCL's ranks
/// are threads) with synchronized BN, each on its own half of every global batch: the group
/// meets through a rendezvous file, each gradient bucket is summed during backward, and after
/// three steps both ranks hold the same master weights bit for bit (moved from the initial
/// ones), the same global metrics, and finite losses.
#[test]
fn the_engines_two_ranks_keep_the_same_weights() {
    const TEST: &str = "the_engines_two_ranks_keep_the_same_weights";
    if !common::nccl_ranks_or_skip(TEST, 2) {
        return;
    }
    use cudnn_cbr::amp::plan::Region;
    use cudnn_cbr::classifier::open_device;
    use cudnn_cbr::classifier::{CudaClassifier, EngineConfig};
    use cudnn_cbr::dist::bootstrap::LaunchEnv;
    use cudnn_cbr::{amp::range::SgdConfig, amp::step::StepConfig};
    const BATCH: usize = 4;
    const HW: usize = 8;
    const CLASSES: usize = 3;
    let file = std::env::temp_dir().join(format!("engine-ranks-{}", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let file_s = file.to_str().unwrap().to_owned();
    let ranks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..2usize)
            .map(|rank| {
                let file_s = file_s.clone();
                s.spawn(move || {
                    let launch = LaunchEnv::from_vars(|n| match n {
                        "RANK" | "LOCAL_RANK" => Some(rank.to_string()),
                        "WORLD_SIZE" => Some("2".into()),
                        "CUDNN_CBR_RENDEZVOUS_FILE" => Some(file_s.clone()),
                        _ => None,
                    })
                    .unwrap();
                    let handle = open_device(Some(&launch)).unwrap();
                    let net = common::planned_mini(&handle, BATCH, HW, CLASSES);
                    let engine = EngineConfig {
                        log_entries: 3,
                        launch: Some(launch),
                        sync_bn: true,
                        ..EngineConfig::default()
                    };
                    let config = StepConfig::new(SgdConfig::new(0.05));
                    let mut model =
                        CudaClassifier::with_engine(net, handle, CLASSES, config, 3, engine)
                            .unwrap();
                    assert_eq!(model.rank(), (rank, 2));
                    let initial = model.step().executor().download_f32(Region::W, "fc.w");
                    for step in 0..3 {
                        let mut seed = 0x7e57 + (2 * step + rank) as u64;
                        let images: Vec<f16> = (0..BATCH * HW * HW * 3)
                            .map(|_| f16::from_f32(common::uniform(&mut seed)))
                            .collect();
                        let labels: Vec<i32> = (0..BATCH)
                            .map(|i| ((i + step + rank) % CLASSES) as i32)
                            .collect();
                        model.upload_batch(&images, &labels).unwrap();
                        model.run_step().unwrap();
                    }
                    let (log, _) = model.wait_readback().unwrap();
                    let global = model.global_metrics(&log.entries).unwrap();
                    let w = model
                        .step()
                        .executor()
                        .download_region_bytes(Region::W)
                        .unwrap();
                    let w: Vec<f32> = w
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    let moved = model.step().executor().download_f32(Region::W, "fc.w");
                    assert_ne!(initial.unwrap(), moved.unwrap(), "rank {rank}: no update");
                    let losses = global.iter().map(|m| m.loss).collect();
                    let accs = global.iter().map(|m| m.accuracy).collect();
                    (w, losses, accs)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let _ = std::fs::remove_file(&file);
    assert_eq!(ranks[0].0, ranks[1].0, "the ranks' master weights differ");
    assert_eq!(ranks[0].1, ranks[1].1, "the global losses differ");
    assert_eq!(ranks[0].2, ranks[1].2, "the global accuracies differ");
    assert_eq!(ranks[0].1.len(), 3);
    assert!(ranks[0].1.iter().all(|l| l.is_finite()), "{:?}", ranks[0].1);
}
