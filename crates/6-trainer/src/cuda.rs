//! The CUDA executor of the training loop: the library's GPU engine
//! ([`cudnn_cbr::classifier::CudaClassifier`], whose module docs describe a step, the
//! whole-step capture, the data-parallel group and the device-side metrics log) built from a
//! [`TrainConfig`], and the loop around it: the input pipeline (`crates/6-trainer/src/cuda_input.rs`),
//! progress lines from the asynchronous readback every few steps, the capture after
//! [`WARMUP_STEPS`] and the curve; checkpoints, the epochs' test-set evaluations, the held-out
//! evaluation and the report go through the bookkeeping every executor shares
//! (`crates/6-trainer/src/bookkeeping.rs`).
//! The loop synchronizes only after the last step (for the report, the held-out evaluation
//! and the throughput).

#[path = "cuda_input.rs"]
mod input;

use super::net::compile_net;
use super::{
    data, Bookkeeping, Checkpointed, ExecutorInfo, Finished, MasterWeights, Progress, RunModel,
    Session, TrainConfig, TrainError, TrainReport, HELD_OUT_BATCHES,
};
use crate::bookkeeping::Batch;
use crate::checkpoint::TrainState;
use crate::curves::CurvePoint;
use cudnn_cbr::amp::cuda::{CudaRegions, CudaStream};
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::step::AmpStep;
use cudnn_cbr::amp::AmpError;
use cudnn_cbr::classifier::{check_fits, open_device, Accuracies};
use cudnn_cbr::classifier::{CudaClassifier, EngineConfig};
use cudnn_cbr::dist::bootstrap::LaunchEnv;
use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::CudaNetError;
use cudnn_cbr::net::{CompiledNet, RoutePolicy};
use cudnn_cbr::netops::head::{HeadMetrics, MetricsLog};
use half::f16;
use std::sync::Arc;

use cudnn_cbr::classifier::{CudaGraphMode, GraphState, Snapshot, WARMUP_STEPS};

/// Where built cuDNN plans are persisted (relative to the working directory), so that a rerun
/// restores them in about a millisecond each instead of running cuDNN's runtime compilation.
pub const PLAN_CACHE_DIR: &str = "target/plan-cache";

/// The amp layer's errors as the trainer's (the device, NVRTC and kernel-compile failures as
/// their own kinds).
pub(crate) fn amp_error(e: AmpError) -> TrainError {
    match e {
        AmpError::NoDevice { reason } => TrainError::NoDevice { reason },
        AmpError::NoNvrtc { reason } => TrainError::NoNvrtc { reason },
        AmpError::Cuda(c @ cudnn_cbr::amp::CudaError::Compile { .. }) => TrainError::NoNvrtc {
            reason: c.to_string(),
        },
        other => TrainError::Amp(other),
    }
}

/// The CUDA executor: the library's GPU engine for a [`TrainConfig`], and its data.
///
/// Made by [`CudaTrainer::new`]; [`super::Trainer::run`] runs the training loop. The step-level
/// methods ([`CudaTrainer::upload_batch`], [`CudaTrainer::step`], [`CudaTrainer::capture`],
/// [`CudaTrainer::snapshot`], …) delegate to the engine ([`CudaTrainer::engine`]); the loop
/// and the tier-4 tests use them.
pub struct CudaTrainer {
    cfg: TrainConfig,
    data: Arc<dyn data::Dataset>,
    engine: CudaClassifier,
}

impl std::fmt::Debug for CudaTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTrainer")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl CudaTrainer {
    /// Opens device 0, plans every layer (through the persistent plan cache in
    /// [`PLAN_CACHE_DIR`]), allocates the regions and buffers, uploads the initial weights
    /// (the same as the CPU executor's for the same seed).
    ///
    /// # Errors
    /// [`TrainError::NoDevice`], [`TrainError::NoCudnn`], [`TrainError::NoNvrtc`],
    /// [`TrainError::NoRoute`] when the executor cannot run here; [`TrainError::Config`] for
    /// a bad configuration; any failure of the setup.
    pub fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        Self::launched(cfg, None)
    }

    /// [`CudaTrainer::new`] as one process of a data-parallel group a launcher started
    /// (`launch`, from [`LaunchEnv::from_env`], with more than one rank): this process takes
    /// GPU `local_rank` (modulo the GPUs it sees), trains on its shard of each global batch
    /// of `world × batch` images, sums the gradients over NCCL during the backward pass and
    /// shares the overflow flag before SGD ([`EngineConfig::launch`]). Rank 0's initial
    /// weights are broadcast. The steps run eagerly.
    ///
    /// # Errors
    /// As [`CudaTrainer::new`]; [`TrainError::Amp`] with a `DistError` when the group
    /// cannot meet (rendezvous, NCCL), or on every rank `DistError::ModelMismatch` when the
    /// ranks compiled different networks (spec, batch, image size or routes).
    pub fn launched(cfg: &TrainConfig, launch: Option<LaunchEnv>) -> Result<Self, TrainError> {
        cfg.validate()?;
        cfg.check_host_memory(false)?;
        let launch = launch.filter(|l| l.world > 1);
        let handle = open_device(launch.as_ref())?;
        let target = handle.target()?;
        // A working directory where the folder cannot be made: plan in memory only.
        let cache = PlanCache::persistent(PLAN_CACHE_DIR).unwrap_or_else(|_| PlanCache::new());
        let net = plan_net(cfg, &target, &cache)?;
        check_fits(&net, cfg.classes, cfg.arena, handle.stream().context())?;
        let engine = EngineConfig {
            arena: cfg.arena,
            // One entry per micro-batch.
            log_entries: cfg.steps * cfg.accum.max(1),
            eval_batches: HELD_OUT_BATCHES as usize,
            launch,
            sync_bn: cfg.sync_bn,
        };
        let engine = CudaClassifier::with_engine(
            net,
            handle,
            cfg.classes,
            cfg.step_config(),
            cfg.seed,
            engine,
        )?;
        Ok(CudaTrainer {
            cfg: *cfg,
            data: data::open(cfg)?,
            engine,
        })
    }

    /// The library's GPU engine this executor drives.
    pub fn engine(&self) -> &CudaClassifier {
        &self.engine
    }

    /// The engine, to drive it.
    pub fn engine_mut(&mut self) -> &mut CudaClassifier {
        &mut self.engine
    }

    /// One line: the device, each layer's route, the graph plan.
    pub fn describe(&self) -> String {
        self.engine.describe(self.cfg.cuda_graph)
    }

    /// The graph the steps replay now.
    pub fn graph_state(&self) -> &GraphState {
        self.engine.graph_state()
    }

    /// The stream everything goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.engine.stream()
    }

    /// The amp step (regions, scalars).
    pub fn amp_step(&self) -> &AmpStep<CudaRegions> {
        self.engine.step()
    }

    /// Each layer's name and route name.
    pub fn routes(&self) -> Vec<(String, &'static str)> {
        self.engine.routes()
    }

    /// This process's rank and the group's size (0 of 1 without a launcher).
    pub fn rank(&self) -> (usize, usize) {
        self.engine.rank()
    }

    /// Copies one batch in ([`CudaClassifier::upload_batch`]).
    ///
    /// # Errors
    /// [`TrainError::Config`] for a batch of the wrong size; a driver error.
    pub fn upload_batch(&mut self, images: &[f16], labels: &[i32]) -> Result<(), TrainError> {
        Ok(self.engine.upload_batch(images, labels)?)
    }

    /// Steps 1–6 of a step: zero the gradients, forward, head, backward
    /// ([`CudaClassifier::run_forward_backward`]).
    ///
    /// # Errors
    /// A driver, cuDNN or amp error.
    pub fn forward_backward(&mut self) -> Result<(), TrainError> {
        Ok(self.engine.run_forward_backward()?)
    }

    /// Step 7: the amp finish, from its graph when one was captured (`graph`), else eager.
    ///
    /// # Errors
    /// [`TrainError::Config`] when `graph` is asked without a captured finish graph.
    pub fn finish(&mut self, graph: bool) -> Result<(), TrainError> {
        Ok(self.engine.run_finish(graph)?)
    }

    /// One training step on the uploaded batch ([`CudaClassifier::run_step`]).
    ///
    /// # Errors
    /// A driver, cuDNN or amp error.
    pub fn step(&mut self) -> Result<(), TrainError> {
        Ok(self.engine.run_step()?)
    }

    /// One eager step, whatever graphs exist (the reference a replay is compared with).
    ///
    /// # Errors
    /// As [`CudaTrainer::step`].
    pub fn step_eager(&mut self) -> Result<(), TrainError> {
        Ok(self.engine.run_step_eager()?)
    }

    /// One micro-batch of a step with gradient accumulation ([`TrainConfig::accum`]) on the
    /// uploaded batch ([`CudaClassifier::run_micro_step`]).
    ///
    /// # Errors
    /// As [`CudaTrainer::step`].
    pub fn micro_step(&mut self, last: bool) -> Result<(), TrainError> {
        Ok(self.engine.run_micro_step(last)?)
    }

    /// Captures the step by `mode` ([`CudaClassifier::capture`]); afterwards
    /// [`CudaTrainer::step`] replays. Run a few eager steps first ([`WARMUP_STEPS`]).
    ///
    /// # Errors
    /// A failure to capture the finish op list; a failed whole-step capture is not an error
    /// (the state falls back to the finish graph and records why).
    pub fn capture(&mut self, mode: CudaGraphMode) -> Result<(), TrainError> {
        Ok(self.engine.capture(mode)?)
    }

    /// Downloads everything a step reads and writes that outlives it (blocking: tests and
    /// checkpoints only).
    ///
    /// # Errors
    /// A driver error.
    pub fn snapshot(&self) -> Result<Snapshot, TrainError> {
        Ok(self.engine.snapshot()?)
    }

    /// Writes a [`Snapshot`] back (asynchronously, in stream order).
    ///
    /// # Errors
    /// A snapshot of another configuration; a driver error.
    pub fn restore(&mut self, s: &Snapshot) -> Result<(), TrainError> {
        Ok(self.engine.restore(s)?)
    }

    /// The state a checkpoint saves (blocking): regions W, M, E, E16 and S (those the plan
    /// has) and the running statistics.
    ///
    /// # Errors
    /// A driver error.
    pub fn train_state(&self) -> Result<TrainState, TrainError> {
        TrainState::of(&self.engine)
    }

    /// Restores a checkpoint's state (in stream order): W, then A (and the EMA) made from it,
    /// then M, E, E16, S (with this run's SGD values) and the running statistics.
    ///
    /// # Errors
    /// A state of another network; a driver error.
    pub fn load_state(&mut self, state: &TrainState) -> Result<(), TrainError> {
        state.load_into(&mut self.engine)
    }

    /// The training metrics log, downloaded (blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn metrics_log(&self) -> Result<MetricsLog, TrainError> {
        Ok(self.engine.metrics_log()?)
    }

    /// The FP32 master weights, downloaded (blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn master_weights(&self) -> Result<MasterWeights, TrainError> {
        let regions = self.engine.step().executor();
        MasterWeights::read(regions.plan_arc(), |p| {
            regions.download_f32(Region::W, p.name())
        })
        .map_err(amp_error)
    }

    /// [`super::Trainer::evaluate`] on this executor (every rank of a group calls it).
    pub(crate) fn evaluate(&mut self, session: &Session) -> Result<super::Evaluation, TrainError> {
        let rank = self.rank();
        Bookkeeping::new(&self.cfg, session, self.data.clone(), rank).evaluation(self)
    }

    /// The training loop (see [`super::Trainer::run`] for the reporting rules).
    pub(crate) fn run(
        mut self,
        every: usize,
        progress: &mut dyn FnMut(&Progress),
        executor: ExecutorInfo,
        session: &Session,
    ) -> Result<TrainReport, TrainError> {
        let out = self.run_steps(every, progress, executor, session);
        // Once the watchdog has aborted the group, the abort is what caused `e`.
        out.map_err(|e| match self.engine.aborted(&e) {
            Some(abort) => amp_error(abort),
            None => e,
        })
    }

    fn run_steps(
        &mut self,
        every: usize,
        progress: &mut dyn FnMut(&Progress),
        mut executor: ExecutorInfo,
        session: &Session,
    ) -> Result<TrainReport, TrainError> {
        let cfg = self.cfg;
        let first = session.start;
        let mut history = match session.curve {
            true => Some(
                self.engine
                    .scalar_history(cfg.steps.saturating_sub(first))?,
            ),
            false => None,
        };
        let mut enqueued: Vec<f64> = Vec::new();
        let every = every.max(1);
        // Step i trains on batches i·accum .. (i + 1)·accum; the log has an entry for each.
        let accum = cfg.accum.max(1);
        let mut book = Bookkeeping::new(&cfg, session, self.data.clone(), self.rank());
        let clock = book.clock();
        let mut reported = 0usize;
        let emit = |log: &MetricsLog,
                    scale: f32,
                    skipped: u32,
                    reported: &mut usize,
                    progress: &mut dyn FnMut(&Progress)| {
            let done = log.count as usize / accum;
            if done <= *reported {
                return;
            }
            let steps = per_step(&log.entries, accum);
            let window = &steps[(*reported).min(steps.len())..];
            let n = window.len().max(1) as f32;
            progress(&Progress {
                step: first + done,
                loss: window.iter().map(|m| m.loss).sum::<f32>() / n,
                accuracy: window.iter().map(|m| m.accuracy).sum::<f32>() / n,
                loss_scale: scale,
                skipped,
                images_per_sec: clock.images_per_sec(done),
            });
            *reported = done;
        };
        // Batches made ahead on a CPU thread, copied to the device beside the step before.
        let mut feed = self.feed((first * accum) as u64..(cfg.steps * accum) as u64)?;
        for i in first..cfg.steps {
            if cfg.schedules_lr() {
                // Into S in stream order, before the step's SGD reads it (no wait; captured
                // graphs read S).
                self.engine
                    .step_mut()
                    .set_lr(cfg.lr_at(i))
                    .map_err(amp_error)?;
            }
            for k in 0..accum {
                // Micro-batch `i·accum + k`, copied beside the one before; the next is staged
                // once this one's work is enqueued.
                self.take_batch(&mut feed, (i * accum + k) as u64)?;
                self.micro_step(k + 1 == accum)?;
                self.stage_next(&mut feed)?;
            }
            if i + 1 - first == WARMUP_STEPS {
                self.capture(cfg.cuda_graph)?;
            }
            if let Some(h) = history.as_mut() {
                // S's loss scale and learning rate copied on the device behind the step (no
                // host wait); loss and accuracy come from the metrics log at the end. The
                // throughput is the host's at enqueue, at most two micro-batches ahead of the
                // device (the input's double buffer).
                self.engine.record_scalars(h)?;
                enqueued.push(clock.images_per_sec(i + 1 - first));
            }
            book.after_step(i + 1, self)?;
            // Logging without syncs: poll what has arrived, request more every `every` steps.
            if let Some((log, s)) = self.engine.poll_readback()? {
                emit(&log, s.loss_scale, s.skipped, &mut reported, progress);
            }
            if (i + 1) % every == 0 && i + 1 < cfg.steps {
                self.engine.request_readback()?;
            }
        }
        // The end of the run: the one place the loop waits for the device.
        self.stream()
            .synchronize()
            .map_err(|e| TrainError::Driver {
                what: "synchronize after the last step".into(),
                message: e.to_string(),
            })?;
        let images_per_sec = clock.images_per_sec(cfg.steps - first);
        let (mut log, s) = self.engine.wait_readback()?;
        emit(&log, s.loss_scale, s.skipped, &mut reported, progress);
        // One entry per step from here on: its micro-batches' means.
        log.entries = per_step(&log.entries, accum);
        // The summary is the global batch's: each step's mean over the ranks' shards (the
        // progress lines above are rank 0's shard).
        log.entries = self.engine.global_metrics(&log.entries)?;
        let mut curve = match &history {
            Some(h) => self
                .engine
                .scalar_rows(h)?
                .into_iter()
                .enumerate()
                .map(|(k, row)| CurvePoint {
                    step: first + k + 1,
                    loss: f32::NAN,
                    accuracy: f32::NAN,
                    loss_scale: row.loss_scale,
                    lr: row.lr,
                    images_per_sec: enqueued.get(k).copied().unwrap_or(0.0),
                })
                .collect(),
            None => Vec::new(),
        };
        for (p, m) in curve.iter_mut().zip(&log.entries) {
            p.loss = m.loss;
            p.accuracy = m.accuracy;
        }
        // Forward only, on every route (the unfused one's BN through `cbr_bn_eval`).
        let held_out = book.held_out(self)?;
        executor.detail = format!("{}; ran: {}", executor.detail, self.graph_state());
        let run = Finished {
            metrics: log.entries,
            held_out,
            scalars: s,
            images_per_sec,
            executor,
            trace: Vec::new(),
            curve,
        };
        book.report(self, run)
    }
}

impl RunModel for CudaTrainer {
    /// [`CudaClassifier::evaluate_batches`]: the group's accuracies.
    fn evaluate(&mut self, batches: &[Batch]) -> Result<Accuracies, TrainError> {
        Ok(self.engine.evaluate_batches(batches)?)
    }

    fn weights(&self) -> Result<MasterWeights, TrainError> {
        self.master_weights()
    }
}

impl Checkpointed for CudaTrainer {
    fn checkpoint(&self) -> Result<(TrainState, String), TrainError> {
        let routes = self
            .routes()
            .iter()
            .map(|(l, r)| format!("{l}={r}"))
            .collect::<Vec<_>>()
            .join(",");
        Ok((self.train_state()?, routes))
    }
}

/// The network of `cfg` planned for `target`: each layer on the fused route with cuDNN's
/// fallbacks (pairs that cannot be fused are materialized), or every layer unfused.
///
/// # Errors
/// [`TrainError::NoRoute`] when a layer has no route here; a configuration error otherwise.
fn plan_net(
    cfg: &TrainConfig,
    target: &cudnn_cbr::fusion::Target,
    cache: &PlanCache,
) -> Result<CompiledNet, TrainError> {
    let policy = if cfg.fused {
        RoutePolicy::Planned { target, cache }
    } else {
        RoutePolicy::PlannedRoute {
            target,
            cache,
            route: RouteKind::Unfused,
        }
    };
    let net = compile_net(cfg, &policy).map_err(|e| match e {
        TrainError::Fusion(
            e @ (cudnn_cbr::fusion::Error::NoRoute { .. }
            | cudnn_cbr::fusion::Error::NoEngine { .. }
            | cudnn_cbr::fusion::Error::NoPlan { .. }),
        ) => TrainError::NoRoute {
            layer: format!("a layer of {}", cfg.net),
            reason: e.to_string(),
        },
        other => other,
    })?;
    Ok(net)
}

/// The CUDA network executor's errors as the trainer's.
pub(crate) fn net_error(e: CudaNetError) -> TrainError {
    match e {
        CudaNetError::Fusion(e) => TrainError::Fusion(e),
        CudaNetError::Amp(e) => amp_error(e),
        CudaNetError::Driver { what, message } => TrainError::Driver { what, message },
        CudaNetError::Binding(m) => TrainError::Config(m),
        CudaNetError::Replan(f) => TrainError::NoRoute {
            layer: format!("{} of {}", f.layer, f.net),
            reason: format!(
                "planned for {}; planning it again for the live device {} failed: {}",
                f.planned_for, f.live, f.source
            ),
        },
    }
}

/// One entry per optimizer step from a metrics log's per-micro-batch entries: each group of
/// `accum` entries' mean loss and accuracy (a trailing partial group is dropped; with one
/// micro-batch per step, the entries as they are).
fn per_step(entries: &[HeadMetrics], accum: usize) -> Vec<HeadMetrics> {
    entries
        .chunks_exact(accum.max(1))
        .map(crate::mean_metrics)
        .collect()
}
