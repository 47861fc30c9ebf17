//! The CUDA executor of the training loop: the same network, step and head as the CPU
//! executor, as cuDNN plans and amp's NVRTC kernels on one stream.
//!
//! What one step enqueues, in order, with no host synchronization:
//!
//! | # | work | how |
//! |--:|------|-----|
//! | 1 | zero G and G16 | amp `begin` (range kernels) |
//! | 2 | forward: the compiled network's forward steps | each layer's cuDNN plans ([`cudnn_cbr::fusion::cbr::CbrLayer::run_gpu`]) |
//! | 3 | global average pool, FC forward | `amp_gap_forward`, `amp_fc_forward` (FP32 FC weights read from W) |
//! | 4 | loss seed, metrics | `amp_softmax_xent_backward` (loss scale read from S), `amp_head_metrics` (appends loss and accuracy to a device log) |
//! | 5 | FC backward, pool backward | `amp_fc_backward` (FP32 dW, db straight into G), `amp_gap_backward` (into the network output's gradient) |
//! | 6 | backward: the compiled network's backward steps | cuDNN plans; the gradient joins at block inputs with `amp_add_f16` |
//! | 7 | cast G16→G, check, SGD, loss-scale update | amp `finish` |
//!
//! With gradient accumulation ([`TrainConfig::accum`] = N), a step is N micro-batches, each
//! copied in before its own 1–6; the first N − 1 end with amp's `accumulate`
//! (`amp_accum_grads`: G16 and G added into the FP32 accumulator GA) instead of 7, the last
//! with 7, whose first op adds it and moves GA's sum into G in place of the cast. The metrics
//! log gets one entry per micro-batch; a step's loss and accuracy are their means.
//!
//! Before a step the batch is copied in (images into the network's input, labels into the
//! head's buffer): in the training loop from the second of two device buffers that a copy
//! stream of its own filled while the previous step trained (`trainer/src/cuda_input.rs`,
//! [`cudnn_cbr::amp::cuda::DoubleInput`]); through [`CudaTrainer::upload_batch`] (two
//! page-locked staging slots, [`cudnn_cbr::amp::cuda::Upload`]) for the evaluation batches
//! and the step-level API. Neither makes the host wait for the step.
//!
//! **Buffers.** The network compiler ([`cudnn_cbr::net::compile()`]) lists every buffer once,
//! shared ones included (a block input is one buffer that the block's first conv, its shortcut
//! and the previous block's output bind). Parameters and their gradients are slots of the amp
//! regions: `{layer}.w` → the weight's slot in A, `{layer}.dw` → its slot in G16,
//! `gamma`/`beta` → W, `dgamma`/`dbeta` → G; every other buffer is one allocation
//! ([`cudnn_cbr::net::cuda::binding_plan`]). Each layer's binding table maps its buffer names to
//! those; [`cudnn_cbr::net::CudaNet`] runs the steps.
//!
//! **Graphs.** After [`WARMUP_STEPS`] eager steps the step is captured by
//! [`CudaTrainer::capture`], by [`CudaGraphMode`]:
//! - `Finish`: steps 7 as amp's op-list graph ([`AmpStep::capture_finish`]), replayed in
//!   place of the eager `finish`; 1–6 stay eager.
//! - `Step` (default): steps 1–7 with stream capture into one CUDA graph, launched once per
//!   step after the batch copies. If that capture fails, the executor falls back to `Finish`
//!   and says why ([`CudaTrainer::graph_state`]).
//!
//! Capturing cuDNN plans and cudarc buffers is sound here because the executor's CUDA context
//! object has exactly one stream, the per-thread default stream, and never creates another:
//! cudarc's event tracking records and waits on events only for a context in multi-stream
//! mode, so nothing inside the capture touches an event recorded outside it. The cuDNN
//! handle's workspace pool is reserved at its final size before the first step, so nothing
//! is allocated inside the capture either. The per-thread stream belongs to the thread that made
//! the executor, so [`CudaTrainer`] is not `Send`.
//!
//! **Many GPUs.** Started by a launcher (torchrun, `mpirun`, Slurm: one process per GPU,
//! [`cudnn_cbr::amp::dist::bootstrap`]), each process is a [`CudaTrainer::launched`] rank: it
//! takes GPU `local_rank`, gets rank 0's NCCL id through the TCP store or rendezvous file,
//! trains on its shard of each global batch. Each gradient bucket's NCCL sum is enqueued on a
//! communication stream as soon as backward has written it ([`cudnn_cbr::net::GradSchedule`]),
//! so it overlaps the shallower layers' backward; the overflow flag is shared between the
//! check and SGD ([`cudnn_cbr::amp::cuda::dist_grads`]). With `--sync-bn` every layer's BN
//! uses the global batch's statistics (the sums over NCCL between the layer's steps:
//! [`cudnn_cbr::dist::NcclBnSync`]). All collectives go through one
//! communicator in the same order on every rank. Those steps run eagerly. The summary's loss
//! and accuracies are the global batch's; progress lines are rank 0's shard.
//!
//! **Logging without syncs.** Loss and accuracy never leave the device during a step: the
//! metrics kernel appends them to a log (one entry per step). Every few steps the loop asks
//! for an asynchronous copy of the log and of S into page-locked memory and polls for it
//! ([`cudnn_cbr::amp::cuda::Readback`], [`AmpStep::request_scalars`]); a progress report goes out
//! when a copy has arrived. The loop synchronizes only after the last step (for the report,
//! the held-out evaluation and the throughput).

#[path = "cuda_accum.rs"]
mod accum;
#[path = "cuda_curve.rs"]
mod curve;
#[path = "cuda_eval.rs"]
mod eval;
#[path = "cuda_input.rs"]
mod input;

use super::net::compile_net;
use super::{
    checkpoint, data, plan_and_initial_weights, summarize, CudaGraphMode, ExecutorInfo,
    MasterWeights, Progress, Session, TrainConfig, TrainError, TrainReport, HELD_OUT_BATCHES,
};
use crate::checkpoint::{TrainState, SAVED_REGIONS};
pub use crate::snapshot::Snapshot;
use cudnn_cbr::amp::cuda::cudarc::driver::CudaEvent;
use cudnn_cbr::amp::cuda::cudarc::driver::{CudaGraph, DriverError};
use cudnn_cbr::amp::cuda::dist_grads::SharedComm;
use cudnn_cbr::amp::cuda::{
    dist_grads, AmpKernels, CudaContext, CudaRegions, CudaSlice, CudaStepGraph, CudaStream,
    DevRange, DevRangeMut, Readback, Upload,
};
use cudnn_cbr::amp::cuda::{CaptureMode, GraphInstantiateFlags};
use cudnn_cbr::amp::dist::bootstrap::{exchange_id, LaunchEnv};
use cudnn_cbr::amp::dist::nccl::{NcclComm, NcclId};
use cudnn_cbr::amp::dist::watchdog::{timeout_from_env, Health, Watchdog};
use cudnn_cbr::amp::dist::{Collective, DistError, ReduceOp};
use cudnn_cbr::amp::plan::{ByteRange, Region};
use cudnn_cbr::amp::range::Scalars;
use cudnn_cbr::amp::range::{
    metrics_log_bytes, metrics_log_read, HeadMetrics, HeadShape, MetricsLog,
};
use cudnn_cbr::amp::step::{AmpStep, StepGraph};
use cudnn_cbr::amp::AmpError;
use cudnn_cbr::dist::NcclBnSync;
use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::exec::Handle;
use cudnn_cbr::net::cuda::{running_stats, CudaNet, CudaNetError};
use cudnn_cbr::net::{
    grad_schedule, memory_plan_of, Arena, CompiledNet, GradSchedule, MemoryReport, PlanContents,
    RoutePolicy,
};
use cudnn_cbr::runtime::cuda_device;
use half::f16;
use std::collections::VecDeque;
use std::fmt;
use std::marker::PhantomData;
use std::sync::PoisonError;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;

/// Eager steps before the capture (cuDNN's lazy loading, the workspace pool and the first
/// launches of every kernel happen in them).
pub const WARMUP_STEPS: usize = 3;

/// Where built cuDNN plans are persisted (relative to the working directory), so that a rerun
/// restores them in about a millisecond each instead of running cuDNN's runtime compilation.
pub const PLAN_CACHE_DIR: &str = "target/plan-cache";

/// How long the ranks of a launched run wait for each other to share the NCCL id.
pub const RENDEZVOUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

fn driver(what: &str, e: DriverError) -> TrainError {
    TrainError::Driver {
        what: what.into(),
        message: e.to_string(),
    }
}

fn amp_error(e: AmpError) -> TrainError {
    match e {
        AmpError::NoDevice { reason } => TrainError::NoDevice { reason },
        AmpError::NoNvrtc { reason } => TrainError::NoNvrtc { reason },
        AmpError::Cuda(c @ cudnn_cbr::amp::CudaError::Compile { .. }) => TrainError::NoNvrtc {
            reason: c.to_string(),
        },
        other => TrainError::Amp(other),
    }
}

/// The head's buffers (bytes, typed by the kernels' checks).
struct Head {
    shape: HeadShape,
    /// FP32 `[batch, features]`.
    pooled: CudaSlice<u8>,
    /// FP16 `[batch, classes]`.
    logits: CudaSlice<u8>,
    /// FP16 `[batch, classes]`, scaled by the loss scale.
    dlogits: CudaSlice<u8>,
    /// FP32 `[batch]` per-row losses.
    loss: CudaSlice<u8>,
    /// FP32 `[batch, features]`.
    dpooled: CudaSlice<u8>,
    /// i32 `[batch]`.
    labels: CudaSlice<u8>,
    /// The training metrics log, one entry per step.
    log: CudaSlice<u8>,
    /// The held-out metrics log.
    eval_log: CudaSlice<u8>,
}

/// Which graph a [`CudaTrainer`] replays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GraphState {
    /// None: every step eager.
    Eager,
    /// The `finish` op list; the rest of the step eager. `why` says why not the whole step
    /// (`None` when only this was asked for).
    Finish {
        /// Why the whole-step capture was not used.
        why: Option<String>,
    },
    /// The whole step.
    Step,
}

impl fmt::Display for GraphState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphState::Eager => write!(f, "every step eager"),
            GraphState::Finish { why: None } => {
                write!(f, "amp finish op list replayed as a CUDA graph")
            }
            GraphState::Finish { why: Some(why) } => write!(
                f,
                "amp finish op list replayed as a CUDA graph (whole-step capture failed: {why})"
            ),
            GraphState::Step => write!(f, "whole step replayed as one CUDA graph"),
        }
    }
}

/// The CUDA executor: the network's layers planned for the device, the amp regions, the head.
///
/// Made by [`CudaTrainer::new`]; [`super::Trainer::run`] runs the training loop. The step-level
/// methods ([`CudaTrainer::upload_batch`], [`CudaTrainer::step`], [`CudaTrainer::capture`],
/// [`CudaTrainer::snapshot`], …) are what the loop and the tier-4 tests use.
pub struct CudaTrainer {
    cfg: TrainConfig,
    data: std::sync::Arc<dyn data::Dataset>,
    head: Head,
    /// The compiled network on the device (its layers planned for it).
    net: CudaNet,
    step: AmpStep<CudaRegions>,
    kernels: Arc<AmpKernels>,
    finish_graph: Option<StepGraph<CudaStepGraph>>,
    step_graph: Option<CudaGraph>,
    /// With gradient accumulation: amp's `accumulate` op list as a graph, and steps 1–6 with
    /// it as one graph (a micro-batch before the step's last).
    accumulate_graph: Option<StepGraph<CudaStepGraph>>,
    micro_graph: Option<CudaGraph>,
    state: GraphState,
    log_readback: Readback,
    /// Page-locked, double-buffered staging for each step's batch.
    staging: Upload,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    device_name: String,
    /// This process's place in a data-parallel group started by a launcher (module docs).
    dist: Option<GpuGroup>,
    /// The per-thread stream is this thread's: keep the executor on it.
    _not_send: PhantomData<*const ()>,
}

/// One process of a multi-GPU run: its rank and the NCCL communicator (on a stream of its
/// own) that sums the gradients.
struct GpuGroup {
    /// Aborts the communicator when the steps stop completing (a peer hung or died) or NCCL
    /// reports an asynchronous error. First, so that it stops before the communicator is
    /// dropped (fields drop in order).
    watchdog: Watchdog,
    rank: usize,
    world: usize,
    /// Shared with synchronized BN's reducer, when on.
    comm: SharedComm,
    /// When each gradient bucket is final in the backward pass (its sum overlaps the rest).
    schedule: GradSchedule,
    /// An event after each step's collectives, until the watchdog sees it complete.
    pending: Arc<Mutex<VecDeque<CudaEvent>>>,
}

impl GpuGroup {
    /// Records an event after the step enqueued so far on `stream`, for the watchdog.
    fn mark_step(&self, stream: &CudaStream) -> Result<(), TrainError> {
        let event = stream
            .record_event(None)
            .map_err(|e| driver("record the step's event", e))?;
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(event);
        Ok(())
    }
}

/// The watchdog of a rank's communicator: it probes NCCL's asynchronous error and the events
/// of the steps enqueued ([`GpuGroup::mark_step`]), and aborts the communicator after the
/// timeout of pending steps without progress.
fn watch(
    comm: &NcclComm,
    pending: Arc<Mutex<VecDeque<CudaEvent>>>,
) -> Result<Watchdog, TrainError> {
    let timeout = timeout_from_env().map_err(TrainError::Config)?;
    let (health, abort) = (comm.abort_handle(), comm.abort_handle());
    let ctx = comm.stream().context().clone();
    let probe = move || {
        if let Some(why) = health.async_error() {
            return Health::Failed(why);
        }
        if let Err(e) = ctx.bind_to_thread() {
            return Health::Failed(format!("the watchdog cannot bind the CUDA context: {e}"));
        }
        let mut q = pending.lock().unwrap_or_else(PoisonError::into_inner);
        let mut advanced = false;
        while let Some(event) = q.front() {
            match event.try_is_complete() {
                Ok(true) => {
                    q.pop_front();
                    advanced = true;
                }
                Ok(false) => break,
                Err(e) => return Health::Failed(format!("a step failed on the device: {e}")),
            }
        }
        match (advanced, q.is_empty()) {
            (true, _) => Health::Advancing,
            (false, true) => Health::Idle,
            (false, false) => Health::Waiting,
        }
    };
    let tick = (timeout / 20).clamp(Duration::from_millis(10), Duration::from_secs(1));
    Watchdog::spawn(timeout, tick, probe, move |why| abort.abort(why))
        .map_err(|e| TrainError::Config(format!("cannot start the NCCL watchdog thread: {e}")))
}

impl fmt::Debug for CudaTrainer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaTrainer")
            .field("device", &self.device_name)
            .field("routes", &self.routes())
            .field("graphs", &self.state)
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
    /// of `world × batch` images, sums the gradients over NCCL after the backward pass and
    /// shares the overflow flag before SGD. Rank 0's initial weights are broadcast. The step
    /// runs eagerly (the collectives sit between the amp step's check and SGD).
    ///
    /// # Errors
    /// As [`CudaTrainer::new`]; [`TrainError::Amp`] with a `DistError` when the group
    /// cannot meet (rendezvous, NCCL), or on every rank `DistError::ModelMismatch` when the
    /// ranks compiled different networks (spec, batch, image size or routes).
    pub fn launched(cfg: &TrainConfig, launch: Option<LaunchEnv>) -> Result<Self, TrainError> {
        cfg.validate()?;
        cfg.check_host_memory(false)?;
        let launch = launch.filter(|l| l.world > 1);
        if launch.is_some() && cfg.accum > 1 {
            return Err(TrainError::Config(
                "gradient accumulation runs on one rank so far; drop --accum in a launched group"
                    .into(),
            ));
        }
        let ordinal = match &launch {
            Some(l) => {
                let seen = cudnn_cbr::runtime::cuda_device_count()
                    .map_err(|e| TrainError::NoDevice { reason: e.reason })?;
                l.local_rank.unwrap_or(l.rank) % seen.max(1)
            }
            None => 0,
        };
        let ctx = cuda_device(ordinal).map_err(|e| TrainError::NoDevice { reason: e.reason })?;
        cudnn_cbr::sys::library().map_err(|e| TrainError::NoCudnn {
            reason: e.to_string().lines().next().unwrap_or_default().to_string(),
        })?;
        if !cudnn_cbr::runtime::rtc::nvrtc_library_present() {
            return Err(TrainError::NoNvrtc {
                reason: "the NVRTC library (libnvrtc) is not on the loader path".into(),
            });
        }
        let device_name = ctx.name().unwrap_or_else(|_| "unknown device".into());
        // The only stream of this context object (module docs: why capture is sound).
        let stream = ctx.per_thread_stream();
        let handle = Handle::new(stream.clone())?;
        let target = handle.target()?;
        // A working directory where the folder cannot be made: plan in memory only.
        let cache = PlanCache::persistent(PLAN_CACHE_DIR).unwrap_or_else(|_| PlanCache::new());
        let net = plan_net(cfg, &target, &cache)?;
        check_fits(cfg, &net, &ctx, &device_name)?;
        // (CudaNet::new reserves the largest workspace, so that the pool never grows inside
        // the step's capture.)

        // The memory plan and its regions, with the CPU executor's initial weights.
        // The regions' layout is the CPU plan's (the same parameters in the same places);
        // with the shared arena, the network's step-long buffers are added to it, laid out
        // by their lifetimes in this planned network (its routes decide which buffers exist).
        let (_, init) = plan_and_initial_weights(cfg)?;
        let contents = PlanContents {
            ema: cfg.ema.is_some(),
            buffers: cfg.arena == Arena::Shared,
        };
        let plan = memory_plan_of(&net, cfg.classes, contents)?;
        // Gradient accumulation adds the FP32 accumulator GA; nothing else moves.
        let plan = if cfg.accum > 1 {
            plan.with_grad_accumulator()?
        } else {
            plan
        };
        let mut regions = CudaRegions::new(plan, stream.clone()).map_err(amp_error)?;
        for (name, values) in init {
            regions
                .upload_f32(Region::W, &name, &values)
                .map_err(amp_error)?;
        }
        let kernels = regions.kernels().clone();
        let mut step = AmpStep::new(regions, cfg.step_config()).map_err(amp_error)?;
        let dist = match launch {
            None => None,
            Some(l) => {
                let id = exchange_id(
                    &l,
                    || NcclId::generate().map(|id| id.to_bytes()),
                    RENDEZVOUS_TIMEOUT,
                )
                .and_then(|b| NcclId::from_bytes(&b))
                .map_err(|e| amp_error(e.into()))?;
                let link = ctx
                    .new_stream()
                    .map_err(|e| driver("create the communication stream", e))?;
                let mut comm =
                    NcclComm::new_within(link, l.rank, l.world, &id, Some(RENDEZVOUS_TIMEOUT))
                        .map_err(|e| amp_error(e.into()))?;
                same_network(&mut comm, &net)?;
                dist_grads::broadcast_weights(step.executor_mut(), &mut comm).map_err(amp_error)?;
                let pending = Arc::new(Mutex::new(VecDeque::new()));
                let watchdog = watch(&comm, pending.clone())?;
                let comm = Arc::new(Mutex::new(comm));
                let ranks = u32::try_from(l.world)
                    .map_err(|_| TrainError::Config(format!("{} ranks", l.world)))?;
                step.set_ranks(ranks).map_err(amp_error)?;
                Some(GpuGroup {
                    rank: l.rank,
                    world: l.world,
                    comm,
                    schedule: grad_schedule(&net, step.executor().plan_arc()).map_err(net_error)?,
                    pending,
                    watchdog,
                })
            }
        };
        step.init_weights().map_err(amp_error)?;

        let amp_plan = Some(step.executor().plan_arc().clone());
        let mut net = CudaNet::new(net, handle, kernels.clone(), amp_plan).map_err(net_error)?;
        if let (Some(g), true) = (&dist, cfg.sync_bn) {
            net.set_bn_sync(Box::new(NcclBnSync::new(g.comm.clone())))
                .map_err(net_error)?;
        }
        let (out_hw, features) = (net.compiled().out_hw, net.compiled().features);
        let shape = HeadShape::new(cfg.batch, out_hw * out_hw, features, cfg.classes);
        let alloc = |bytes: usize, what: &str| {
            stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(|e| driver(&format!("allocate the head's {what}"), e))
        };
        let head = Head {
            pooled: alloc(4 * shape.pooled_elems(), "pooled features")?,
            logits: alloc(2 * shape.logits_elems(), "logits")?,
            dlogits: alloc(2 * shape.logits_elems(), "logit gradients")?,
            loss: alloc(4 * shape.batch, "per-row losses")?,
            dpooled: alloc(4 * shape.pooled_elems(), "pooled gradients")?,
            labels: alloc(4 * shape.batch, "labels")?,
            // One entry per micro-batch.
            log: alloc(
                metrics_log_bytes(cfg.steps * cfg.accum.max(1)),
                "metrics log",
            )?,
            eval_log: alloc(metrics_log_bytes(HELD_OUT_BATCHES as usize), "held-out log")?,
            shape,
        };
        let log_readback = Readback::new(&ctx, head.log.len()).map_err(amp_error)?;
        let batch_bytes = 2 * cfg.batch * cfg.hw * cfg.hw * cfg.channels + 4 * cfg.batch;
        let staging = Upload::new(&ctx, batch_bytes).map_err(amp_error)?;
        Ok(CudaTrainer {
            cfg: *cfg,
            data: data::open(cfg)?,
            head,
            net,
            step,
            kernels,
            finish_graph: None,
            step_graph: None,
            accumulate_graph: None,
            micro_graph: None,
            state: GraphState::Eager,
            log_readback,
            staging,
            stream,
            ctx,
            device_name,
            dist,
            _not_send: PhantomData,
        })
    }

    /// One line: the device, each layer's route, the graph plan.
    pub fn describe(&self) -> String {
        let routes: Vec<String> = self
            .net
            .compiled()
            .layers
            .iter()
            .map(|l| match l.layer.route().reason() {
                None => format!("{} {}", l.name, l.layer.route().name()),
                Some(why) => {
                    // cuDNN's account can be long: its first line, shortened.
                    let why: String = why.lines().next().unwrap_or("").chars().take(160).collect();
                    format!("{} {} ({why})", l.name, l.layer.route().name())
                }
            })
            .collect();
        let graphs =
            match self.cfg.cuda_graph {
                _ if self.dist.is_some() => format!(
                "eager steps (NCCL: gradient buckets during backward, the overflow flag between \
                 the check and SGD; {} BN)",
                if self.cfg.sync_bn { "synchronized" } else { "local" }
            ),
                CudaGraphMode::Off => "no CUDA graphs".to_string(),
                CudaGraphMode::Finish => {
                    format!("amp finish op list as a CUDA graph after {WARMUP_STEPS} warm-up steps")
                }
                CudaGraphMode::Step => {
                    format!("whole step as one CUDA graph after {WARMUP_STEPS} warm-up steps")
                }
            };
        let graphs = match self.cfg.accum {
            0 | 1 => graphs,
            n => format!(
                "{graphs}; {n} micro-batches per step (gradient accumulation: each before the \
                 last ends with amp's accumulate, from a graph of its own)"
            ),
        };
        let group = match &self.dist {
            Some(g) => format!(
                "rank {} of {} (NCCL {}, watchdog {:.0} s); ",
                g.rank,
                g.world,
                dist_grads::lock(&g.comm).library().version(),
                g.watchdog.timeout().as_secs_f64()
            ),
            None => String::new(),
        };
        let arena = self.step.executor().plan_arc().tensor_bytes();
        let buffers = if arena > 0 {
            format!(
                "network buffers in a shared arena of {:.1} MB",
                arena as f64 / 1e6
            )
        } else {
            "network buffers allocated one by one".into()
        };
        format!(
            "{group}cuda:{} {}; routes: {}; {graphs}; {buffers}; amp kernels as {}",
            self.ctx.ordinal(),
            self.device_name,
            routes.join(", "),
            self.kernels.code()
        )
    }

    /// The graph the steps replay now.
    pub fn graph_state(&self) -> &GraphState {
        &self.state
    }

    /// The stream everything goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The amp step (regions, scalars).
    pub fn amp_step(&self) -> &AmpStep<CudaRegions> {
        &self.step
    }

    /// Each layer's name and route name.
    pub fn routes(&self) -> Vec<(String, &'static str)> {
        self.net
            .compiled()
            .layers
            .iter()
            .map(|l| (l.name.clone(), l.layer.route().name()))
            .collect()
    }

    /// Copies one batch in: NHWC FP16 images into the network's input, labels into the head, through
    /// the double-buffered page-locked staging ([`cudnn_cbr::amp::cuda::Upload`]): asynchronous,
    /// waiting only while the device is two batches behind. Not during a stream capture.
    ///
    /// # Errors
    /// [`TrainError::Config`] for a batch of the wrong size; a driver error.
    pub fn upload_batch(&mut self, images: &[f16], labels: &[i32]) -> Result<(), TrainError> {
        let c = &self.cfg;
        let pixels = c.batch * c.hw * c.hw * c.channels;
        if labels.len() != c.batch || images.len() != pixels {
            return Err(TrainError::Config(format!(
                "a batch of {} needs {} labels and {pixels} image values, got {} and {}",
                c.batch,
                c.batch,
                labels.len(),
                images.len()
            )));
        }
        let image_bytes: Vec<u8> = images.iter().flat_map(|v| v.to_le_bytes()).collect();
        let label_bytes: Vec<u8> = labels.iter().flat_map(|l| l.to_le_bytes()).collect();
        let input = self.net.compiled().input;
        let x = self.net.buffer_mut(input).map_err(net_error)?;
        let x = DevRangeMut::new(x, ByteRange::new(0, image_bytes.len())).map_err(amp_error)?;
        let labels = DevRangeMut::new(&mut self.head.labels, ByteRange::new(0, label_bytes.len()))
            .map_err(amp_error)?;
        self.staging
            .upload(
                &self.stream,
                &mut [(&image_bytes, x), (&label_bytes, labels)],
            )
            .map_err(amp_error)
    }

    /// Forward through the network, the pooling and the FC layer.
    fn forward(&mut self) -> Result<(), TrainError> {
        self.net
            .forward_with(self.step.executor_mut())
            .map_err(net_error)?;
        self.head_forward()
    }

    /// The network's forward pass in evaluation mode (BN from the running statistics, none
    /// written: [`CudaNet::evaluate_with`]), then the head's.
    fn forward_eval(&mut self) -> Result<(), TrainError> {
        self.net
            .evaluate_with(self.step.executor_mut())
            .map_err(net_error)?;
        self.head_forward()
    }

    /// Pooling and FC of the network's output into the logits.
    fn head_forward(&mut self) -> Result<(), TrainError> {
        let shape = self.head.shape;
        let a = self
            .net
            .buffer(self.net.compiled().output)
            .map_err(net_error)?;
        self.kernels
            .gap_forward(
                &self.stream,
                &shape,
                DevRange::whole(a),
                DevRangeMut::whole(&mut self.head.pooled),
            )
            .map_err(amp_error)?;
        self.step
            .executor()
            .fc_forward(
                "fc.w",
                "fc.b",
                &shape,
                DevRange::whole(&self.head.pooled),
                DevRangeMut::whole(&mut self.head.logits),
            )
            .map_err(amp_error)
    }

    /// Loss seed, metrics, FC and pooling backward (into the network output's gradient).
    fn head_backward(&mut self) -> Result<(), TrainError> {
        let shape = self.head.shape;
        let h = &mut self.head;
        self.kernels
            .softmax_xent_backward_range(
                &self.stream,
                shape.classes,
                DevRange::whole(&h.logits),
                DevRange::whole(&h.labels),
                DevRange::whole(self.step.executor().region(Region::S).map_err(amp_error)?),
                DevRangeMut::whole(&mut h.dlogits),
                Some(DevRangeMut::whole(&mut h.loss)),
            )
            .map_err(amp_error)?;
        self.kernels
            .head_metrics(
                &self.stream,
                shape.classes,
                DevRange::whole(&h.logits),
                DevRange::whole(&h.labels),
                Some(DevRange::whole(&h.loss)),
                DevRangeMut::whole(&mut h.log),
            )
            .map_err(amp_error)?;
        self.step
            .executor_mut()
            .fc_backward(
                "fc.w",
                "fc.b",
                &shape,
                DevRange::whole(&h.dlogits),
                DevRange::whole(&h.pooled),
                DevRangeMut::whole(&mut h.dpooled),
            )
            .map_err(amp_error)?;
        let d_out = self.net.compiled().output_grad;
        let d_out = self.net.buffer_mut(d_out).map_err(net_error)?;
        self.kernels
            .gap_backward(
                &self.stream,
                &shape,
                DevRange::whole(&h.dpooled),
                DevRangeMut::whole(d_out),
            )
            .map_err(amp_error)
    }

    /// Backward through the network, with the gradient joins at block inputs; in a group,
    /// each gradient bucket's NCCL sum is enqueued as soon as backward has written it, on the
    /// communication stream, so it overlaps the shallower layers' backward.
    fn backward(&mut self) -> Result<(), TrainError> {
        match &self.dist {
            None => self
                .net
                .backward_with(self.step.executor_mut())
                .map_err(net_error),
            Some(g) => {
                let comm = g.comm.clone();
                self.net
                    .backward_overlapped(
                        self.step.executor_mut(),
                        None,
                        &g.schedule,
                        &mut |regions, bucket, after| {
                            let mut comm = dist_grads::lock(&comm);
                            dist_grads::all_reduce_bucket(regions, &mut comm, bucket, after)
                                .map_err(CudaNetError::from)
                        },
                    )
                    .map_err(net_error)
            }
        }
    }

    /// Steps 1–6 of the module table: zero the gradients, forward, head, backward.
    pub fn forward_backward(&mut self) -> Result<(), TrainError> {
        self.step.begin().map_err(amp_error)?;
        self.forward()?;
        self.head_backward()?;
        self.backward()
    }

    /// Step 7: the amp finish, from its graph when one was captured (`graph`), else eager.
    ///
    /// # Errors
    /// [`TrainError::Config`] when `graph` is asked without a captured finish graph.
    pub fn finish(&mut self, graph: bool) -> Result<(), TrainError> {
        if graph {
            let g = self
                .finish_graph
                .as_ref()
                .ok_or_else(|| TrainError::Config("no finish graph has been captured".into()))?;
            self.step.replay(g).map_err(amp_error)
        } else if let Some(g) = self.dist.as_mut() {
            // The buckets' sums were enqueued during backward: the step waits for them.
            let mut comm = dist_grads::lock(&g.comm);
            dist_grads::join_gradients(self.step.executor_mut(), &mut comm).map_err(amp_error)?;
            self.step
                .finish_with(|r| dist_grads::all_reduce_overflow(r, &mut comm))
                .map_err(amp_error)?;
            g.mark_step(&self.stream)
        } else {
            self.step.finish().map_err(amp_error)
        }
    }

    /// Each entry's mean over the group's ranks (their shards are the same size), through one
    /// NCCL sum; `entries` as they are without a group. Every rank calls it with as many.
    ///
    /// # Errors
    /// [`TrainError::Amp`] from NCCL; a driver error.
    fn global_metrics(&mut self, entries: &[HeadMetrics]) -> Result<Vec<HeadMetrics>, TrainError> {
        let Some(g) = self.dist.as_ref() else {
            return Ok(entries.to_vec());
        };
        let flat: Vec<f32> = entries.iter().flat_map(|m| [m.loss, m.accuracy]).collect();
        if flat.is_empty() {
            return Ok(Vec::new());
        }
        let mut comm = dist_grads::lock(&g.comm);
        let link = comm.stream().clone();
        let mut sums = link
            .clone_htod(&flat)
            .map_err(|e| driver("upload the metrics to sum", e))?;
        comm.all_reduce(&mut sums, ReduceOp::Sum)
            .map_err(|e| amp_error(e.into()))?;
        let sums = link
            .clone_dtoh(&sums)
            .map_err(|e| driver("download the summed metrics", e))?;
        let n = g.world as f32;
        Ok(sums
            .chunks_exact(2)
            .map(|p| HeadMetrics {
                loss: p[0] / n,
                accuracy: p[1] / n,
            })
            .collect())
    }

    /// This process's rank and the group's size (0 of 1 without a launcher).
    pub fn rank(&self) -> (usize, usize) {
        self.dist.as_ref().map_or((0, 1), |g| (g.rank, g.world))
    }

    /// This rank's shard of a global batch of `world × batch` images.
    fn shard(&self, (images, labels): (Vec<f16>, Vec<i32>)) -> (Vec<f16>, Vec<i32>) {
        let (rank, world) = self.rank();
        if world == 1 {
            return (images, labels);
        }
        let b = self.cfg.batch;
        let per = images.len() / labels.len().max(1);
        (
            images[rank * b * per..(rank + 1) * b * per].to_vec(),
            labels[rank * b..(rank + 1) * b].to_vec(),
        )
    }

    /// One training step on the uploaded batch, as [`CudaTrainer::graph_state`] says: the
    /// whole-step graph, or eager steps 1–6 then the finish graph or eager finish.
    ///
    /// # Errors
    /// A driver, cuDNN or amp error.
    pub fn step(&mut self) -> Result<(), TrainError> {
        match self.state {
            GraphState::Step => match &self.step_graph {
                Some(g) => g.launch().map_err(|e| driver("launch the step graph", e)),
                None => Err(TrainError::Config("no step graph".into())),
            },
            GraphState::Finish { .. } => {
                self.forward_backward()?;
                self.finish(true)
            }
            GraphState::Eager => {
                self.forward_backward()?;
                self.finish(false)
            }
        }
    }

    /// One eager step, whatever graphs exist (the reference a replay is compared with).
    ///
    /// # Errors
    /// As [`CudaTrainer::step`].
    pub fn step_eager(&mut self) -> Result<(), TrainError> {
        self.forward_backward()?;
        self.finish(false)
    }

    /// Captures the step by `mode` (module docs), without running anything; afterwards
    /// [`CudaTrainer::step`] replays. Run a few eager steps first ([`WARMUP_STEPS`]).
    ///
    /// # Errors
    /// A failure to capture the finish op list; a failed whole-step capture is not an error
    /// (the state falls back to the finish graph and records why).
    pub fn capture(&mut self, mode: CudaGraphMode) -> Result<(), TrainError> {
        if mode == CudaGraphMode::Off || self.dist.is_some() {
            self.state = GraphState::Eager;
            return Ok(());
        }
        if self.finish_graph.is_none() {
            self.finish_graph = Some(self.step.capture_finish().map_err(amp_error)?);
        }
        let accumulates = self.cfg.accum > 1;
        if accumulates && self.accumulate_graph.is_none() {
            self.accumulate_graph = Some(self.step.capture_accumulate().map_err(amp_error)?);
        }
        self.state = GraphState::Finish { why: None };
        if mode == CudaGraphMode::Step {
            // The micro-batch graph (steps 1–6 and accumulate) where the step accumulates.
            let micro = match accumulates {
                true => self.capture_step(false).map(Some),
                false => Ok(None),
            };
            match micro.and_then(|m| Ok((m, self.capture_step(true)?))) {
                Ok((micro, g)) => {
                    self.micro_graph = micro;
                    self.step_graph = Some(g);
                    self.state = GraphState::Step;
                }
                Err(e) => self.state = GraphState::Finish { why: Some(e) },
            }
        }
        Ok(())
    }

    /// Stream capture of steps 1–7 (`last`), or of steps 1–6 and amp's `accumulate` (a
    /// micro-batch before a step's last, with gradient accumulation), the amp ops launched
    /// eagerly inside (a graph launch inside a capture is avoided). Always ends the capture;
    /// the error says what failed.
    fn capture_step(&mut self, last: bool) -> Result<CudaGraph, String> {
        self.stream
            .begin_capture(CaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("begin stream capture: {e}"))?;
        let body = match last {
            true => self.step_eager(),
            false => self
                .forward_backward()
                .and_then(|()| self.accumulate(false)),
        };
        // Always end the capture, so the stream is usable again whatever happened.
        let ended = self.stream.end_capture(GraphInstantiateFlags(0));
        body.map_err(|e| format!("while capturing: {e}"))?;
        let graph = ended
            .map_err(|e| format!("end capture and instantiate: {e}"))?
            .ok_or_else(|| "the capture produced no graph".to_string())?;
        graph
            .upload()
            .map_err(|e| format!("upload the graph: {e}"))?;
        Ok(graph)
    }

    /// Downloads everything a step reads and writes that outlives it (blocking: tests and
    /// checkpoints only).
    ///
    /// # Errors
    /// A driver error.
    pub fn snapshot(&self) -> Result<Snapshot, TrainError> {
        let regions = self.step.executor();
        let mut out = Snapshot {
            regions: Vec::new(),
            running: Vec::new(),
            log: Vec::new(),
        };
        for r in Region::ALL {
            if regions.plan_arc().has_region(r) {
                out.regions
                    .push((r, regions.download_region_bytes(r).map_err(amp_error)?));
            }
        }
        let net = self.net.compiled();
        for id in running_stats(net) {
            let name = &net.buffers[id].name;
            let bytes = self.net.download(name).map_err(net_error)?;
            let v = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            out.running.push((name.clone(), v));
        }
        out.log = self
            .stream
            .clone_dtoh(&self.head.log)
            .map_err(|e| driver("download the metrics log", e))?;
        Ok(out)
    }

    /// Writes a [`Snapshot`] back (asynchronously, in stream order).
    ///
    /// # Errors
    /// A snapshot of another configuration; a driver error.
    pub fn restore(&mut self, s: &Snapshot) -> Result<(), TrainError> {
        let stream = self.stream.clone();
        for (r, bytes) in &s.regions {
            self.step
                .executor_mut()
                .upload_region_bytes(*r, bytes)
                .map_err(amp_error)?;
        }
        for (name, v) in &s.running {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.net.upload(name, &bytes).map_err(net_error)?;
        }
        stream
            .memcpy_htod(&s.log, &mut self.head.log)
            .map_err(|e| driver("restore the metrics log", e))
    }

    /// The state a checkpoint saves (blocking): regions W, M, E, E16 and S (those the plan
    /// has) and the running statistics.
    ///
    /// # Errors
    /// A driver error.
    pub fn train_state(&self) -> Result<TrainState, TrainError> {
        let snap = self.snapshot()?;
        Ok(TrainState {
            regions: snap
                .regions
                .into_iter()
                .filter(|(r, _)| SAVED_REGIONS.contains(r))
                .collect(),
            running: snap.running,
        })
    }

    /// Restores a checkpoint's state (in stream order): W, then A (and the EMA) made from it,
    /// then M, E, E16, S (with this run's SGD values) and the running statistics.
    ///
    /// # Errors
    /// A state of another network; a driver error.
    pub fn load_state(&mut self, state: &TrainState) -> Result<(), TrainError> {
        let mut scalars = None;
        for (r, bytes) in &state.regions {
            match r {
                Region::W => {
                    self.step
                        .executor_mut()
                        .upload_region_bytes(*r, bytes)
                        .map_err(amp_error)?;
                    self.step.init_weights().map_err(amp_error)?;
                }
                Region::S => scalars = Some(Scalars::from_bytes(bytes).map_err(AmpError::from)?),
                _ => self
                    .step
                    .executor_mut()
                    .upload_region_bytes(*r, bytes)
                    .map_err(amp_error)?,
            }
        }
        if let Some(s) = scalars {
            self.step.restore_scalars(&s).map_err(amp_error)?;
        }
        for (name, v) in &state.running {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.net.upload(name, &bytes).map_err(net_error)?;
        }
        self.stream
            .synchronize()
            .map_err(|e| driver("synchronize after restoring a checkpoint", e))
    }

    /// The training metrics log, downloaded (blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn metrics_log(&self) -> Result<MetricsLog, TrainError> {
        let bytes = self
            .stream
            .clone_dtoh(&self.head.log)
            .map_err(|e| driver("download the metrics log", e))?;
        Ok(metrics_log_read(&bytes).map_err(AmpError::from)?)
    }

    /// The FP32 master weights, downloaded (blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn master_weights(&self) -> Result<MasterWeights, TrainError> {
        let regions = self.step.executor();
        MasterWeights::read(regions.plan_arc(), |p| {
            regions.download_f32(Region::W, p.name())
        })
        .map_err(amp_error)
    }

    /// Requests asynchronous copies of S and the metrics log (never waits).
    fn request_readback(&mut self) -> Result<(), TrainError> {
        self.step.request_scalars().map_err(amp_error)?;
        self.log_readback
            .request(&self.stream, &self.head.log)
            .map_err(amp_error)
    }

    /// The training loop (see [`super::Trainer::run`] for the reporting rules).
    pub(crate) fn run(
        mut self,
        every: usize,
        progress: impl FnMut(&Progress),
        executor: ExecutorInfo,
        session: &Session,
    ) -> Result<TrainReport, TrainError> {
        let out = self.run_steps(every, progress, executor, session);
        out.map_err(|e| self.explain(e))
    }

    /// `e`, or, once the watchdog has aborted the group, the abort that caused it.
    fn explain(&self, e: TrainError) -> TrainError {
        match &self.dist {
            Some(g) => match g.watchdog.fired() {
                Some(reason) => amp_error(AmpError::Dist(DistError::Aborted {
                    me: g.rank,
                    reason: format!("{reason} (then: {e})"),
                })),
                None => e,
            },
            None => e,
        }
    }

    fn run_steps(
        &mut self,
        every: usize,
        mut progress: impl FnMut(&Progress),
        mut executor: ExecutorInfo,
        session: &Session,
    ) -> Result<TrainReport, TrainError> {
        let cfg = self.cfg;
        let first = session.start;
        let mut history = match session.curve {
            true => Some(self.scalar_history(first, cfg.steps)?),
            false => None,
        };
        let mut enqueued: Vec<f64> = Vec::new();
        let every = every.max(1);
        let world = self.rank().1;
        // Step i trains on batches i·accum .. (i + 1)·accum; the log has an entry for each.
        let accum = cfg.accum.max(1);
        let images_per_step = cfg.batch * world * accum;
        let start = Instant::now();
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
            let steps = accum::per_step(&log.entries, accum);
            let window = &steps[(*reported).min(steps.len())..];
            let n = window.len().max(1) as f32;
            progress(&Progress {
                step: first + done,
                loss: window.iter().map(|m| m.loss).sum::<f32>() / n,
                accuracy: window.iter().map(|m| m.accuracy).sum::<f32>() / n,
                loss_scale: scale,
                skipped,
                images_per_sec: (done * images_per_step) as f64 / start.elapsed().as_secs_f64(),
            });
            *reported = done;
        };
        // Batches made ahead on a CPU thread, copied to the device beside the step before.
        let mut feed = self.feed((first * accum) as u64..(cfg.steps * accum) as u64)?;
        let (ends, mut epochs) = (self.epoch_ends(), Vec::new());
        for i in first..cfg.steps {
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
                self.record_scalars(h)?;
                enqueued.push(
                    ((i + 1 - first) * images_per_step) as f64 / start.elapsed().as_secs_f64(),
                );
            }
            if let Some(path) = session.saves_after(i + 1, cfg.steps) {
                let state = self.train_state()?;
                let routes = self
                    .routes()
                    .iter()
                    .map(|(l, r)| format!("{l}={r}"))
                    .collect::<Vec<_>>()
                    .join(",");
                checkpoint::save(path, &cfg, &state, (i + 1) as u64, &routes)?;
            }
            if let Some(e) = ends.iter().position(|&s| s == i + 1) {
                epochs.push(self.test_epoch(e + 1, i + 1)?);
            }
            // Logging without syncs: poll what has arrived, request more every `every` steps.
            if let Some(bytes) = self.log_readback.poll().map_err(amp_error)? {
                let log = metrics_log_read(bytes).map_err(AmpError::from)?;
                let s = self
                    .step
                    .poll_scalars()
                    .map_err(amp_error)?
                    .unwrap_or_default();
                emit(&log, s.loss_scale, s.skipped, &mut reported, &mut progress);
            }
            if (i + 1) % every == 0 && i + 1 < cfg.steps {
                self.request_readback()?;
            }
        }
        // The end of the run: the one place the loop waits for the device.
        self.stream
            .synchronize()
            .map_err(|e| driver("synchronize after the last step", e))?;
        let images_per_sec =
            ((cfg.steps - first) * images_per_step) as f64 / start.elapsed().as_secs_f64();
        self.request_readback()?;
        let bytes = self
            .log_readback
            .wait()
            .map_err(amp_error)?
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        let mut log = metrics_log_read(&bytes).map_err(AmpError::from)?;
        let s = self
            .step
            .executor()
            .read_scalars_blocking()
            .map_err(amp_error)?;
        emit(&log, s.loss_scale, s.skipped, &mut reported, &mut progress);
        // One entry per step from here on: its micro-batches' means.
        log.entries = accum::per_step(&log.entries, accum);
        // The summary is the global batch's: each step's mean over the ranks' shards (the
        // progress lines above are rank 0's shard).
        log.entries = self.global_metrics(&log.entries)?;
        let mut curve = match &history {
            Some(h) => self.curve_from(h, |done| enqueued.get(done - 1).copied().unwrap_or(0.0))?,
            None => Vec::new(),
        };
        for (p, m) in curve.iter_mut().zip(&log.entries) {
            p.loss = m.loss;
            p.accuracy = m.accuracy;
        }

        // Held-out batches, forward only, BN in evaluation mode (the running statistics, as
        // the CPU executor), on every route; with an EMA, a second time with the EMA weights.
        let held_out: Vec<_> = (0..HELD_OUT_BATCHES)
            .map(|i| self.shard(self.data.held_out_batch(cfg.batch * world, i)))
            .collect();
        let acc = self.evaluate_batches(&held_out)?;
        let (first_loss, last_loss, last_accuracy, step_losses) = summarize(&log.entries);
        let weights = self.master_weights()?;
        executor.detail = format!("{}; ran: {}", executor.detail, self.state);
        Ok(TrainReport {
            first_loss,
            last_loss,
            last_accuracy,
            held_out_accuracy: acc.trained,
            held_out_eval_mode: acc.eval_mode,
            held_out_ema_accuracy: acc.ema,
            skipped: s.skipped,
            loss_scale: s.loss_scale,
            images_per_sec,
            step_losses,
            weights,
            executor,
            trace: Vec::new(),
            start_step: first,
            curve,
            epochs,
        })
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

/// Fails every rank of the group when any two compiled different networks
/// ([`cudnn_cbr::amp::dist::same`]): the fingerprints are all-gathered by one NCCL sum in
/// which each rank fills only its own slot.
fn same_network(comm: &mut NcclComm, net: &CompiledNet) -> Result<(), TrainError> {
    use cudnn_cbr::amp::dist::{same, Communicator};
    let (me, world) = (comm.rank(), comm.world());
    let words = net.fingerprint().words(me, world);
    let link = comm.stream().clone();
    let mut gathered = link
        .clone_htod(&words)
        .map_err(|e| driver("upload the network's fingerprint", e))?;
    comm.all_reduce(&mut gathered, ReduceOp::Sum)
        .map_err(|e| amp_error(e.into()))?;
    let words = link
        .clone_dtoh(&gathered)
        .map_err(|e| driver("download the group's fingerprints", e))?;
    same::check_gathered(&words, me, world).map_err(|e| amp_error(e.into()))
}

/// The CUDA network executor's errors as the trainer's.
fn net_error(e: CudaNetError) -> TrainError {
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

/// Refuses up front, with the memory report, a batch whose step the device cannot hold
/// (before anything of the step is allocated).
fn check_fits(
    cfg: &TrainConfig,
    net: &CompiledNet,
    ctx: &CudaContext,
    device: &str,
) -> Result<(), TrainError> {
    let report = MemoryReport::of(net, cfg.classes)
        .map_err(|e| TrainError::Config(format!("the memory plan: {e}")))?;
    let report = match cfg.arena {
        Arena::Shared => report,
        Arena::Separate => report.separate(),
    };
    let (free, _total) = ctx
        .mem_get_info()
        .map_err(|e| TrainError::Config(format!("cannot query the device memory: {e}")))?;
    if report.total() <= free as u64 {
        return Ok(());
    }
    let largest = match report.largest_batch(free as u64) {
        Some(b) => format!("the largest batch that fits is about {b}"),
        None => "not one image fits".into(),
    };
    Err(TrainError::Config(format!(
        "batch {} does not fit on {device} ({:.1} MB free): {largest}\n{report}",
        cfg.batch,
        free as f64 / 1e6
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudnn_cbr::fusion::cbr::RouteKind;
    use cudnn_cbr::net::cuda::{binding_plan, check_binding, Source};
    use cudnn_cbr::net::{BufId, Step};

    /// The binding plan of every route mix of the main job's network (each block's first
    /// and last convs on each route, so pairs are prologues or materialized) against the real
    /// memory plan: every parameter and parameter gradient has an amp slot of its type with
    /// room, every other buffer is allocated, and the buffers the executor reaches outside the
    /// layers (input, output and its gradient, the joins' operands) are allocations of equal
    /// size where they are added together. No device involved.
    #[test]
    fn every_route_mix_binds_every_buffer() {
        let cfg = TrainConfig {
            batch: 16,
            ..TrainConfig::default()
        };
        let kinds = [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic];
        let mut mixes = 0;
        for first in kinds {
            for last in kinds {
                let shapes = compile_net(&cfg, &RoutePolicy::Uniform(RouteKind::Fused))
                    .unwrap()
                    .conv_shapes();
                let routes = shapes
                    .iter()
                    .map(|(n, _)| (n.clone(), if n.ends_with("conv1") { first } else { last }))
                    .collect();
                let policy = RoutePolicy::PerLayer {
                    routes,
                    default: RouteKind::Fused,
                };
                let net = compile_net(&cfg, &policy).unwrap();
                let plan = cudnn_cbr::net::memory_plan(&net, cfg.classes).unwrap();
                let sources = binding_plan(&net, true).unwrap();
                for (b, source) in net.buffers.iter().zip(&sources) {
                    let (bytes, dtype) = match source {
                        Source::Param { key, region } => {
                            let v = plan
                                .view(key, *region)
                                .unwrap_or_else(|e| panic!("{first:?}/{last:?} {}: {e}", b.name));
                            (v.len_bytes, v.dtype)
                        }
                        Source::Own => (b.elems * b.dtype.size(), b.dtype),
                    };
                    check_binding(b, bytes, dtype)
                        .unwrap_or_else(|e| panic!("{first:?}/{last:?}: {e}"));
                }
                let own_bytes = |id: BufId| {
                    assert_eq!(sources[id], Source::Own, "{}", net.buffers[id].name);
                    net.buffers[id].elems * 2
                };
                let image = cfg.batch * cfg.hw * cfg.hw * cfg.channels * 2;
                assert_eq!(own_bytes(net.input), image);
                let pooled = cfg.batch * net.out_hw * net.out_hw * net.features * 2;
                assert_eq!(
                    (own_bytes(net.output), own_bytes(net.output_grad)),
                    (pooled, pooled)
                );
                let mut joins = 0;
                for step in &net.backward {
                    if let Step::Add { a, b, out } = *step {
                        let sizes = (own_bytes(out), own_bytes(a), own_bytes(b));
                        assert!(sizes.0 == sizes.1 && sizes.1 == sizes.2, "{sizes:?}");
                        joins += 1;
                    }
                }
                assert_eq!(joins, 2, "one join per block");
                mixes += 1;
            }
        }
        assert_eq!(mixes, 9);
    }
}
