//! Data-parallel training on the CPU executor: `ranks` threads, each a
//! [`CpuReplica`](cudnn_cbr::dist::CpuReplica) on its shard of the global batch
//! (`ranks × batch` images; rank r takes images `r·batch .. (r+1)·batch`), joined by an
//! in-process group. Rank 0 reports progress and the summary; every figure it reports is the
//! global batch's.

use super::{
    data, net::compile_net, net::cpu_policy, ExecutorInfo, Progress, TrainConfig, TrainError,
    TrainReport, Window, HELD_OUT_BATCHES,
};
use cudnn_cbr::amp::AmpError;
use cudnn_cbr::classifier::CpuClassifier;
use cudnn_cbr::dist::DistError;
use cudnn_cbr::dist::{Collective, Communicator, CpuComm, CpuGroup, CpuReplica, ReduceOp};
use cudnn_cbr::netops::head::HeadMetrics;
use half::f16;
use std::time::Instant;

/// The data-parallel CPU executor, checked and ready to run.
#[derive(Debug)]
pub(crate) struct DataParallelTrainer {
    cfg: TrainConfig,
}

impl DataParallelTrainer {
    pub(crate) fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        cfg.check_host_memory(true)?;
        // Compile once here so that a network that does not fit fails before any thread runs.
        compile_net(cfg, &cpu_policy(cfg))?;
        Ok(DataParallelTrainer { cfg: *cfg })
    }

    pub(crate) fn run(
        self,
        every: usize,
        mut progress: impl FnMut(&Progress),
        executor: ExecutorInfo,
    ) -> Result<TrainReport, TrainError> {
        let cfg = self.cfg;
        let grads = CpuGroup::ranks(cfg.ranks).map_err(AmpError::from)?;
        let mut bn: Vec<Option<CpuComm>> = match cfg.sync_bn {
            true => CpuGroup::ranks(cfg.ranks)
                .map_err(AmpError::from)?
                .into_iter()
                .map(Some)
                .collect(),
            false => (0..cfg.ranks).map(|_| None).collect(),
        };
        let mut comms: Vec<(CpuComm, Option<CpuComm>)> =
            grads.into_iter().zip(bn.drain(..)).collect();
        let (g0, b0) = comms.remove(0);
        std::thread::scope(|s| {
            let others: Vec<_> = comms
                .into_iter()
                .map(|(g, b)| {
                    std::thread::Builder::new()
                        .name(format!("rank {}", g.rank()))
                        .spawn_scoped(s, {
                            let executor = executor.clone();
                            move || run_rank(&cfg, g, b, every, &mut |_| {}, &executor)
                        })
                })
                .collect();
            let first = run_rank(&cfg, g0, b0, every, &mut progress, &executor);
            let mut results = vec![first];
            for h in others {
                results.push(match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(TrainError::Config("a rank's thread panicked".into()))
                    }),
                    Err(e) => Err(TrainError::Config(format!(
                        "could not start a rank's thread: {e}"
                    ))),
                });
            }
            // Report the failure that started it, not the others' "a peer failed".
            let root = results.iter().position(|r| match r {
                Err(TrainError::Amp(AmpError::Dist(DistError::PeerFailed { .. }))) => false,
                Err(TrainError::Fusion(cudnn_cbr::fusion::Error::BnSync(_))) => false,
                Err(_) => true,
                Ok(_) => false,
            });
            if let Some(i) = root {
                return Err(results
                    .swap_remove(i)
                    .err()
                    .unwrap_or_else(|| TrainError::Config("a rank failed".into())));
            }
            match results.swap_remove(0) {
                Ok(Some(report)) => Ok(report),
                Ok(None) => Err(TrainError::Config("rank 0 made no report".into())),
                Err(e) => Err(e),
            }
        })
    }
}

/// One rank's whole run; rank 0 returns the report.
fn run_rank(
    cfg: &TrainConfig,
    grads: CpuComm,
    bn: Option<CpuComm>,
    every: usize,
    progress: &mut dyn FnMut(&Progress),
    executor: &ExecutorInfo,
) -> Result<Option<TrainReport>, TrainError> {
    let (rank, ranks) = (grads.rank(), cfg.ranks);
    let data = data::Synthetic::new(cfg.hw, cfg.channels, cfg.classes, cfg.seed);
    let net = compile_net(cfg, &cpu_policy(cfg))?;
    let model =
        CpuClassifier::with_arena(net, cfg.classes, cfg.step_config(), cfg.seed, cfg.arena)?;
    let mut replica = CpuReplica::new(model, grads, bn)?;
    let per = cfg.hw * cfg.hw * cfg.channels;
    let shard = |(images, labels): (Vec<f16>, Vec<i32>)| {
        let (i0, l0) = (rank * cfg.batch * per, rank * cfg.batch);
        (
            images[i0..i0 + cfg.batch * per].to_vec(),
            labels[l0..l0 + cfg.batch].to_vec(),
        )
    };
    let start = Instant::now();
    let mut metrics = Vec::with_capacity(cfg.steps);
    let mut curve = Vec::with_capacity(if rank == 0 { cfg.steps } else { 0 });
    let mut window = Window::default();
    // Step i trains on global batches i·accum .. (i + 1)·accum, each sharded over the ranks.
    let accum = cfg.accum.max(1);
    let images_per_step = cfg.batch * ranks * accum;
    for i in 0..cfg.steps {
        let m = if accum == 1 {
            let (images, labels) = shard(data.batch(cfg.batch * ranks, i as u64, 0));
            replica.step(&images, &labels)?
        } else {
            // One micro-batch in memory at a time; the step's mean loss and accuracy over
            // the micro-batches, then over the ranks.
            let mut v = [0f32; 2];
            for k in 0..accum {
                let (images, labels) =
                    shard(data.batch(cfg.batch * ranks, (i * accum + k) as u64, 0));
                let local = replica.micro_batch(&images, &labels, k + 1 == accum)?;
                v[0] += local.loss / accum as f32;
                v[1] += local.accuracy / accum as f32;
            }
            replica
                .comm_mut()
                .all_reduce(&mut v[..], ReduceOp::Sum)
                .map_err(AmpError::from)?;
            HeadMetrics {
                loss: v[0] / ranks as f32,
                accuracy: v[1] / ranks as f32,
            }
        };
        metrics.push(m);
        window.add(m);
        if rank == 0 {
            let s = replica.model_mut().step().executor().scalars();
            curve.push(crate::curves::CurvePoint {
                step: i + 1,
                loss: m.loss,
                accuracy: m.accuracy,
                loss_scale: s.loss_scale,
                lr: s.lr,
                images_per_sec: ((i + 1) * images_per_step) as f64 / start.elapsed().as_secs_f64(),
            });
        }
        if rank == 0 && ((i + 1) % every.max(1) == 0 || i + 1 == cfg.steps) {
            let step = replica.model_mut().step_mut();
            step.request_scalars()?;
            let s = step.poll_scalars()?.unwrap_or_default();
            progress(&window.report(i + 1, i + 1, images_per_step, start, s));
        }
    }
    let images_per_sec = (cfg.steps * images_per_step) as f64 / start.elapsed().as_secs_f64();
    // Held-out batches, evaluation mode: each rank its shard with its own running statistics
    // (the same on every rank with synchronized BN), the correct counts summed; with an EMA,
    // the EMA weights' count second.
    let mut correct = [0f32; 2];
    for i in 0..HELD_OUT_BATCHES {
        let (images, labels) = shard(data.batch(cfg.batch * ranks, i, 1));
        for (c, w) in correct.iter_mut().zip(super::cpu::eval_weights(cfg)) {
            let e = replica.model_mut().evaluate(&images, w)?;
            *c += e
                .top1
                .iter()
                .zip(&labels)
                .filter(|(&p, &l)| p as i32 == l)
                .count() as f32;
        }
    }
    replica
        .comm_mut()
        .all_reduce(&mut correct[..], ReduceOp::Sum)
        .map_err(AmpError::from)?;
    if rank != 0 {
        return Ok(None);
    }
    let n = (HELD_OUT_BATCHES as usize * cfg.batch * ranks) as f32;
    super::cpu::report(
        replica.model_mut().step_mut(),
        &metrics,
        correct[0] / n,
        images_per_sec,
        executor.clone(),
        Vec::new(),
    )
    .map(|r| {
        Some(TrainReport {
            curve: std::mem::take(&mut curve),
            held_out_ema_accuracy: cfg.ema.map(|_| correct[1] / n),
            ..r
        })
    })
}
