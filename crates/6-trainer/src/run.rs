//! A training run: [`Trainer`] picks and sets up the executor and runs the loop
//! ([`train`] in one call), with what the executors share before it runs: the session
//! (resume, saves, curves), the memory plan and initial weights (what the loops share while
//! and after they run is in `bookkeeping.rs`).

use crate::net::{self, compile_net};
use crate::{
    checkpoint, cpu, cpu_dp, cuda, Device, ExecutorInfo, ExecutorKind, Progress, TrainConfig,
    TrainError, TrainReport,
};
use cudnn_cbr::amp::plan::MemoryPlan;
use cudnn_cbr::netops::head::HeadMetrics;

/// A configured training run on one executor.
#[derive(Debug)]
pub struct Trainer {
    cfg: TrainConfig,
    info: ExecutorInfo,
    exec: Exec,
    session: Session,
}

/// What a run does besides training: where it starts, where it saves, what it records.
#[derive(Debug, Clone, Default)]
pub(crate) struct Session {
    /// Steps done before this run (from a checkpoint).
    pub(crate) start: usize,
    /// Save to this path every `every` steps (0: only at the end), and at the end.
    pub(crate) save: Option<(std::path::PathBuf, usize)>,
    /// Record a curve point per step on CUDA (a blocking read of S per step).
    pub(crate) curve: bool,
}

impl Session {
    /// Whether to save after `done` steps of a run of `steps`.
    pub(crate) fn saves_after(&self, done: usize, steps: usize) -> Option<&std::path::Path> {
        let (path, every) = self.save.as_ref()?;
        (done == steps || (*every > 0 && done.is_multiple_of(*every))).then_some(path.as_path())
    }
}

#[derive(Debug)]
enum Exec {
    Cpu(Box<cpu::CpuTrainer>),
    CpuDataParallel(Box<cpu_dp::DataParallelTrainer>),
    Cuda(Box<cuda::CudaTrainer>),
}

impl Trainer {
    /// Chooses the executor by `cfg.device` and sets it up.
    ///
    /// # Errors
    /// [`TrainError::Config`] for a bad configuration; with [`Device::Cuda`], the
    /// [`TrainError::is_unavailable`] errors when the CUDA executor cannot run here; any
    /// error of the setup itself.
    pub fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        Self::with_launch(cfg, launch_env()?)
    }

    /// [`Trainer::new`] as rank `launch.rank` of a data-parallel group of `launch.world`
    /// GPU processes, from a launch description the caller made itself
    /// ([`LaunchEnv::from_vars`](cudnn_cbr::dist::bootstrap::LaunchEnv::from_vars)) rather
    /// than from this process's environment (as `Trainer::new` reads a launcher's): the CUDA
    /// executor joins the group ([`cuda::CudaTrainer::launched`]). A group of one is
    /// `Trainer::new` without a launcher.
    ///
    /// # Errors
    /// As [`Trainer::new`]; [`TrainError::Config`] for a configuration a group does not run
    /// (the CPU executor, `--ranks`, the fault drill).
    pub fn launched(
        cfg: &TrainConfig,
        launch: cudnn_cbr::dist::bootstrap::LaunchEnv,
    ) -> Result<Self, TrainError> {
        Self::with_launch(cfg, Some(launch).filter(|l| l.world > 1))
    }

    fn with_launch(
        cfg: &TrainConfig,
        launch: Option<cudnn_cbr::dist::bootstrap::LaunchEnv>,
    ) -> Result<Self, TrainError> {
        cfg.validate()?;
        // The CPU executor reads its SIMD cap itself and ignores a value it does not know:
        // refuse that value here, whatever the device, rather than run without the cap.
        cudnn_cbr::fusion::reference::cpu_simd_from_env()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let cpu = |reason: String| -> Result<Trainer, TrainError> {
            Ok(Trainer {
                cfg: *cfg,
                info: ExecutorInfo {
                    kind: ExecutorKind::Cpu,
                    reason,
                    detail: format!(
                        "CPU reference executor ({}), {} route ops",
                        cudnn_cbr::fusion::reference::cpu_paths(),
                        if cfg.fused { "fused" } else { "unfused" }
                    ),
                },
                exec: Exec::Cpu(Box::new(cpu::CpuTrainer::new(cfg)?)),
                session: Session::default(),
            })
        };
        if let Some(l) = &launch {
            let why = if cfg.ranks > 1 {
                Some("--ranks runs CPU ranks as threads in one process")
            } else if cfg.device == Device::Cpu {
                Some("the CPU executor does not join a launched group")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(TrainError::Config(format!(
                    "this process was launched as rank {} of {} ({:?}): {why}; run \
                     --device cuda, one process per GPU",
                    l.rank, l.world, l.launcher
                )));
            }
        }
        let cuda = |reason: &str| -> Result<Trainer, TrainError> {
            let t = cuda::CudaTrainer::launched(cfg, launch.clone())?;
            Ok(Trainer {
                cfg: *cfg,
                info: ExecutorInfo {
                    kind: ExecutorKind::Cuda,
                    reason: reason.to_string(),
                    detail: t.describe(),
                },
                exec: Exec::Cuda(Box::new(t)),
                session: Session::default(),
            })
        };
        // Under a launcher, --sync-bn synchronizes the GPU ranks (one process each).
        if cfg.data_parallel() && launch.is_none() {
            if cfg.device == Device::Cuda {
                return Err(TrainError::Config(
                    "--ranks and --sync-bn run CPU ranks as threads; the CUDA executor runs \
                     data-parallel as one process per GPU under a launcher (torchrun, mpirun, \
                     srun), with --sync-bn and without --ranks"
                        .into(),
                ));
            }
            return Ok(Trainer {
                cfg: *cfg,
                info: ExecutorInfo {
                    kind: ExecutorKind::Cpu,
                    reason: format!(
                        "{} data-parallel ranks run as CPU threads (device {})",
                        cfg.ranks,
                        cfg.device.name()
                    ),
                    detail: format!(
                        "CPU reference executor, {} route ops, {} ranks × batch {}, {} BN",
                        if cfg.fused { "fused" } else { "unfused" },
                        cfg.ranks,
                        cfg.batch,
                        if cfg.sync_bn { "synchronized" } else { "local" }
                    ),
                },
                exec: Exec::CpuDataParallel(Box::new(cpu_dp::DataParallelTrainer::new(cfg)?)),
                session: Session::default(),
            });
        }
        if cfg.drill.is_some() {
            return match cfg.device {
                Device::Cuda => Err(TrainError::Config(
                    "the fault drill runs on the CPU executor only".into(),
                )),
                _ => cpu("a fault drill runs on the CPU executor".into()),
            };
        }
        match cfg.device {
            Device::Cpu => cpu("requested (device cpu)".into()),
            Device::Cuda => cuda("requested (device cuda)"),
            Device::Auto => match cuda("auto: a CUDA device, cuDNN and NVRTC are usable") {
                Err(e) if e.is_unavailable() && launch.is_none() => cpu(format!("auto: {e}")),
                other => other,
            },
        }
    }

    /// This process's rank and the number of processes of its group (0 of 1 unless a
    /// launcher started several: [`cuda::CudaTrainer::launched`]). Only rank 0 need report.
    pub fn process_rank(&self) -> (usize, usize) {
        match &self.exec {
            Exec::Cuda(t) => t.rank(),
            _ => (0, 1),
        }
    }

    /// The executor it runs, and why.
    pub fn executor(&self) -> &ExecutorInfo {
        &self.info
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// Saves a checkpoint ([`checkpoint`]) to `path` after every `every` steps (0: none
    /// between) and after the last step. In a data-parallel run rank 0 writes it (every
    /// rank holds the same weights; with local BN, rank 0's running statistics) and records
    /// the group's size; the other processes of a launched group write nothing. Makes the
    /// folder if needed and checks now (on the rank that writes) that a file can be written
    /// there.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] when the folder cannot hold the file.
    pub fn save_to(&mut self, path: &std::path::Path, every: usize) -> Result<(), TrainError> {
        if self.process_rank().0 == 0 {
            checkpoint::check_writable(path)?;
        }
        self.session.save = Some((path.to_path_buf(), every));
        Ok(())
    }

    /// Records a [`curves::CurvePoint`](crate::curves::CurvePoint) per step on the CUDA executor too (the CPU executors
    /// always do): S's loss scale and learning rate are copied on the device behind every
    /// step and read back once at the end, so the step never waits for the host.
    pub fn record_curve(&mut self, on: bool) {
        self.session.curve = on;
    }

    /// Loads a checkpoint of this run's network, data and group size
    /// ([`checkpoint::load_in_group`]) into the executor (every rank of a data-parallel run
    /// loads it): the run then trains from its step up to [`TrainConfig::steps`], on the
    /// batches that follow. Returns that step.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming what is wrong with the file (one of another group
    /// size is [`checkpoint::CheckpointError::OtherRun`]); [`TrainError::Config`] for a
    /// checkpoint at or past `steps`; the executor's error.
    pub fn resume(&mut self, path: &std::path::Path) -> Result<usize, TrainError> {
        self.load(path, true)
    }

    /// Loads a checkpoint as [`Trainer::resume`] does, for [`Trainer::evaluate`]: its step
    /// need not be below `steps`. Returns that step.
    ///
    /// # Errors
    /// As [`Trainer::resume`], but for the step bound.
    pub fn load_checkpoint(&mut self, path: &std::path::Path) -> Result<usize, TrainError> {
        self.load(path, false)
    }

    fn load(&mut self, path: &std::path::Path, to_train: bool) -> Result<usize, TrainError> {
        let ranks = self.cfg.ranks.max(self.process_rank().1);
        let loaded = checkpoint::load_in_group(path, &self.cfg, ranks)?;
        let step = usize::try_from(loaded.step).unwrap_or(usize::MAX);
        if to_train && step >= self.cfg.steps {
            return Err(TrainError::Config(format!(
                "the checkpoint {} is at step {step}; --steps counts from the start of the \
                 run, so it must be more than that (got {})",
                path.display(),
                self.cfg.steps
            )));
        }
        match &mut self.exec {
            Exec::Cpu(t) => t.load_state(&loaded.state)?,
            Exec::Cuda(t) => t.load_state(&loaded.state)?,
            Exec::CpuDataParallel(t) => t.load_state(loaded.state),
        }
        self.session.start = step.min(self.cfg.steps);
        Ok(step)
    }

    /// Evaluates the model as it stands (after [`Trainer::load_checkpoint`]: a checkpoint's), without
    /// training: the held-out batches a training run's summary measures, and the whole test
    /// set where the data has one, BN in evaluation mode, with the trained and (with an EMA)
    /// the EMA weights; on CPU ranks or in a launched group, the group's accuracies (each
    /// rank evaluating its shard of every global batch, as a training run's figures are).
    ///
    /// # Errors
    /// The executor's error.
    pub fn evaluate(&mut self) -> Result<crate::Evaluation, TrainError> {
        match &mut self.exec {
            Exec::Cpu(t) => t.evaluate(&self.session),
            Exec::Cuda(t) => t.evaluate(&self.session),
            Exec::CpuDataParallel(t) => t.evaluate(&self.session, self.info.clone()),
        }
    }

    /// Trains and reports. `progress` is called every `every` steps on the CPU; on CUDA it
    /// is called whenever an asynchronous readback of the device's metrics log arrives after
    /// such a request (so a report may cover more than `every` steps, and reports may be
    /// fewer), and always for the final steps.
    ///
    /// # Errors
    /// Any failure of the executor.
    pub fn run(
        self,
        every: usize,
        mut progress: impl FnMut(&Progress),
    ) -> Result<TrainReport, TrainError> {
        self.run_reporting_to(every, &mut progress)
    }

    // Not generic: the training loops are compiled once, here, instead of once per caller's
    // closure in every crate that calls `run` (release builds do not share instances).
    fn run_reporting_to(
        self,
        every: usize,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<TrainReport, TrainError> {
        match self.exec {
            Exec::Cpu(t) => t.run(every, progress, self.info, &self.session),
            Exec::CpuDataParallel(t) => t.run(every, progress, self.info, &self.session),
            Exec::Cuda(t) => t.run(every, progress, self.info, &self.session),
        }
    }
}

/// Trains and reports; `progress` is called every `every` steps (see [`Trainer::run`]).
///
/// # Errors
/// As [`Trainer::new`] and [`Trainer::run`].
pub fn train(
    cfg: &TrainConfig,
    every: usize,
    progress: impl FnMut(&Progress),
) -> Result<TrainReport, TrainError> {
    Trainer::new(cfg)?.run(every, progress)
}

/// The launcher's description of this process when one started several
/// ([`cudnn_cbr::dist::bootstrap`] lists the variables read); `None` without a launcher
/// or for a group of one.
///
/// # Errors
/// [`TrainError::Config`] when a launcher's variables are set but wrong.
fn launch_env() -> Result<Option<cudnn_cbr::dist::bootstrap::LaunchEnv>, TrainError> {
    const RANK_VARS: [&str; 4] = ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"];
    if !RANK_VARS
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()))
    {
        return Ok(None);
    }
    let env = cudnn_cbr::dist::bootstrap::LaunchEnv::from_env()
        .map_err(|e| TrainError::Config(format!("the launcher's environment: {e}")))?;
    Ok((env.world > 1).then_some(env))
}

/// The network's memory plan ([`cudnn_cbr::net::memory_plan`]) and initial master weights
/// ([`cudnn_cbr::net::initial_weights`]) for `cfg`'s shapes and seed: what both executors start from.
pub(crate) fn plan_and_initial_weights(
    cfg: &TrainConfig,
) -> Result<(MemoryPlan, NamedValues), TrainError> {
    // Shapes do not depend on routes: compile for the CPU, without cuDNN.
    let net = compile_net(cfg, &net::cpu_policy(cfg))?;
    // With an EMA the plan has E and E16 (as the CPU classifier's and the checkpoint's).
    let plan = if cfg.ema.is_some() {
        cudnn_cbr::net::memory_plan_with_ema(&net, cfg.classes)?
    } else {
        cudnn_cbr::net::memory_plan(&net, cfg.classes)?
    };
    // Gradient accumulation adds the FP32 accumulator GA; nothing else moves.
    let plan = if cfg.accum > 1 {
        plan.with_grad_accumulator()?
    } else {
        plan
    };
    let init = cudnn_cbr::net::initial_weights(&net, cfg.classes, cfg.seed);
    Ok((plan, init))
}

/// (parameter, values) pairs.
pub(crate) type NamedValues = Vec<(String, Vec<f32>)>;

/// The mean loss and accuracy of a step's micro-batches (the one micro-batch's own values
/// without accumulation).
pub(crate) fn mean_metrics(each: &[HeadMetrics]) -> HeadMetrics {
    if let [one] = each {
        return *one;
    }
    let n = each.len().max(1) as f32;
    HeadMetrics {
        loss: each.iter().map(|m| m.loss).sum::<f32>() / n,
        accuracy: each.iter().map(|m| m.accuracy).sum::<f32>() / n,
    }
}
