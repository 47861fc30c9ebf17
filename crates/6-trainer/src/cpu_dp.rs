//! Data-parallel training on the CPU executor: `ranks` threads, each a
//! [`CpuReplica`](cudnn_cbr::dist::CpuReplica) on its shard of the global batch
//! (`ranks × batch` images; rank r takes images `r·batch .. (r+1)·batch`), joined by an
//! in-process group. Rank 0 reports progress and the summary; every figure it reports is the
//! global batch's. Rank 0 saves the checkpoints; a resumed run loads the same state into
//! every rank.

use super::{
    data, net::compile_net, net::cpu_policy, Bookkeeping, Checkpointed, ExecutorInfo, Finished,
    HostMetrics, MasterWeights, Progress, RunModel, Session, TrainConfig, TrainError, TrainReport,
};
use crate::bookkeeping::Batch;
use crate::checkpoint::TrainState;
use cudnn_cbr::amp::AmpError;
use cudnn_cbr::classifier::{Accuracies, CpuClassifier};
use cudnn_cbr::dist::DistError;
use cudnn_cbr::dist::{Collective, Communicator, CpuComm, CpuGroup, CpuReplica, ReduceOp};
use cudnn_cbr::netops::head::HeadMetrics;
use std::sync::Arc;

/// The data-parallel CPU executor, checked and ready to run.
#[derive(Debug)]
pub(crate) struct DataParallelTrainer {
    cfg: TrainConfig,
    /// Read once, shared by the ranks (each makes its own shards).
    data: Arc<dyn data::Dataset>,
    /// A checkpoint's state every rank starts from.
    resume: Option<Arc<TrainState>>,
}

impl DataParallelTrainer {
    pub(crate) fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        cfg.check_host_memory(true)?;
        // Compile once here so that a network that does not fit fails before any thread runs.
        compile_net(cfg, &cpu_policy(cfg))?;
        Ok(DataParallelTrainer {
            cfg: *cfg,
            data: data::open(cfg)?,
            resume: None,
        })
    }

    /// Every rank starts from `state` (a checkpoint's, checked against this run's network
    /// when the ranks load it).
    pub(crate) fn load_state(&mut self, state: TrainState) {
        self.resume = Some(Arc::new(state));
    }

    pub(crate) fn run(
        self,
        every: usize,
        progress: &mut dyn FnMut(&Progress),
        executor: ExecutorInfo,
        session: &Session,
    ) -> Result<TrainReport, TrainError> {
        self.in_group(every, progress, executor, session, &run_rank)
    }

    /// [`crate::Trainer::evaluate`] on the group: every rank evaluates its shard of each
    /// global batch with the state loaded (or initial), and the counts are summed, as the
    /// held-out and test-set figures of a training run are.
    pub(crate) fn evaluate(
        &self,
        session: &Session,
        executor: ExecutorInfo,
    ) -> Result<crate::Evaluation, TrainError> {
        let evaluate =
            |run: &RankRun<'_>, comms: (CpuComm, Option<CpuComm>), _: &mut dyn FnMut(&Progress)| {
                let rank = comms.0.rank();
                let mut me = rank_model(run, comms)?;
                let book = Bookkeeping::new(
                    &run.cfg,
                    run.session,
                    run.data.clone(),
                    (rank, run.cfg.ranks),
                );
                let evaluation = book.evaluation(&mut me)?;
                Ok((rank == 0).then_some(evaluation))
            };
        self.in_group(0, &mut |_| {}, executor, session, &evaluate)
    }

    /// Runs `per_rank` on a thread per rank, each with its communicators (gradients, and
    /// synchronized BN's), and returns rank 0's answer; rank 0 gets `progress`. A failing
    /// rank's error is returned rather than the "a peer failed" of the others.
    fn in_group<T: Send>(
        &self,
        every: usize,
        progress: &mut dyn FnMut(&Progress),
        executor: ExecutorInfo,
        session: &Session,
        per_rank: &PerRank<T>,
    ) -> Result<T, TrainError> {
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
        let run = RankRun {
            cfg,
            data: self.data.clone(),
            resume: self.resume.clone(),
            every,
            executor,
            session,
        };
        let run = &run;
        std::thread::scope(|s| {
            let others: Vec<_> = comms
                .into_iter()
                .map(|(g, b)| {
                    std::thread::Builder::new()
                        .name(format!("rank {}", g.rank()))
                        .spawn_scoped(s, move || per_rank(run, (g, b), &mut |_| {}))
                })
                .collect();
            let first = per_rank(run, (g0, b0), progress);
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
                Ok(Some(answer)) => Ok(answer),
                Ok(None) => Err(TrainError::Config("rank 0 gave no answer".into())),
                Err(e) => Err(e),
            }
        })
    }
}

/// One rank's work in a group ([`DataParallelTrainer::in_group`]): rank 0 answers `Some`.
type PerRank<T> = dyn Fn(
        &RankRun<'_>,
        (CpuComm, Option<CpuComm>),
        &mut dyn FnMut(&Progress),
    ) -> Result<Option<T>, TrainError>
    + Sync;

/// What every rank's run shares.
struct RankRun<'a> {
    cfg: TrainConfig,
    data: Arc<dyn data::Dataset>,
    resume: Option<Arc<TrainState>>,
    every: usize,
    executor: ExecutorInfo,
    session: &'a Session,
}

/// One rank's model: its replica, and the configuration its checkpoint describes.
struct Rank {
    replica: CpuReplica,
    cfg: TrainConfig,
}

/// One rank's model, joined to its group, from the state every rank starts from.
fn rank_model(
    run: &RankRun<'_>,
    (grads, bn): (CpuComm, Option<CpuComm>),
) -> Result<Rank, TrainError> {
    let cfg = &run.cfg;
    let net = compile_net(cfg, &cpu_policy(cfg))?;
    let model =
        CpuClassifier::with_arena(net, cfg.classes, cfg.step_config(), cfg.seed, cfg.arena)?;
    let mut me = Rank {
        replica: CpuReplica::new(model, grads, bn)?,
        cfg: *cfg,
    };
    // Every rank loads the same state (after the group met and rank 0's initial weights
    // were broadcast), so the ranks stay equal; S keeps this group's rank count.
    if let Some(state) = &run.resume {
        state.load_into(me.replica.model_mut())?;
    }
    Ok(me)
}

/// One rank's whole run on its shards of the data, over its communicators (gradients, and
/// synchronized BN's); rank 0 returns the report.
fn run_rank(
    run: &RankRun<'_>,
    (grads, bn): (CpuComm, Option<CpuComm>),
    progress: &mut dyn FnMut(&Progress),
) -> Result<Option<TrainReport>, TrainError> {
    let (cfg, data) = (&run.cfg, &run.data);
    let (rank, ranks) = (grads.rank(), cfg.ranks);
    let mut me = rank_model(run, (grads, bn))?;
    // Rank 0 saves the checkpoints; the test set after each epoch of files.
    let mut book = Bookkeeping::new(cfg, run.session, data.clone(), (rank, ranks));
    let first = book.first();
    let mut host = HostMetrics::with_capacity(if rank == 0 { cfg.steps - first } else { 0 });
    // Step i trains on global batches i·accum .. (i + 1)·accum, each sharded over the ranks.
    let accum = cfg.accum.max(1);
    for i in first..cfg.steps {
        let replica = &mut me.replica;
        if cfg.schedules_lr() {
            replica.model_mut().step_mut().set_lr(cfg.lr_at(i))?;
        }
        // Each rank makes its own shard (of files: decodes its own images only).
        let shard = |b: usize| data.train_shard(cfg.batch, b as u64, (rank, ranks));
        let m = if accum == 1 {
            let (images, labels) = shard(i)?;
            replica.step(&images, &labels)?
        } else {
            // One micro-batch in memory at a time; the step's mean loss and accuracy over
            // the micro-batches, then over the ranks.
            let mut v = [0f32; 2];
            for k in 0..accum {
                let (images, labels) = shard(i * accum + k)?;
                let local = replica.micro_batch(k, &images, &labels)?;
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
        // Rank 0 reports; every figure is the global batch's.
        if rank == 0 {
            let step = replica.model_mut().step_mut();
            host.record(&book, i + 1, m, step, run.every, progress)?;
        }
        book.after_step(i + 1, &mut me)?;
    }
    let images_per_sec = book.clock().images_per_sec(cfg.steps - first);
    // Each rank evaluates its shard with its own running statistics (the same on every rank
    // with synchronized BN); the correct counts are summed.
    let held_out = book.held_out(&mut me)?;
    if rank != 0 {
        return Ok(None);
    }
    let step = me.replica.model_mut().step_mut();
    step.request_scalars()?;
    let scalars = step.poll_scalars()?.unwrap_or_default();
    let run = Finished {
        metrics: host.metrics,
        held_out,
        scalars,
        images_per_sec,
        executor: run.executor.clone(),
        trace: Vec::new(),
        curve: host.curve,
    };
    book.report(&me, run).map(Some)
}

impl RunModel for Rank {
    fn evaluate(&mut self, batches: &[Batch]) -> Result<Accuracies, TrainError> {
        Ok(self.replica.evaluate_batches(batches)?)
    }

    fn weights(&self) -> Result<MasterWeights, TrainError> {
        super::cpu::master_weights(self.replica.model().step().executor())
    }
}

impl Checkpointed for Rank {
    fn checkpoint(&self) -> Result<(TrainState, String), TrainError> {
        Ok((
            TrainState::of(self.replica.model())?,
            super::cpu::routes(&self.cfg),
        ))
    }
}
