//! [`CudaClassifier`]: the GPU training engine. A compiled network on cuDNN, the head on amp's
//! kernels, the amp step on [`CudaRegions`], all on the handle's stream; on top, what a
//! training loop needs to keep the device busy: whole-step capture into a CUDA graph, the
//! device-side metrics log read back asynchronously, gradient accumulation, the EMA
//! evaluation, and a data-parallel group of launched ranks over NCCL. The trainer keeps the
//! loop (data, schedule, reports, checkpoint files).
//!
//! What one step enqueues, in order, with no host synchronization:
//!
//! | # | work | how |
//! |--:|------|-----|
//! | 1 | zero G and G16 | amp `begin` (range kernels) |
//! | 2 | forward: the compiled network's forward steps | each layer's cuDNN plans ([`crate::fusion::cbr::CbrLayer::run_gpu`]) |
//! | 3 | global average pool, FC forward | `net_gap_forward`, `net_fc_forward` (FP32 FC weights read from W) |
//! | 4 | loss seed, metrics | `amp_softmax_xent_backward` (loss scale read from S), `net_head_metrics` (appends loss and accuracy to the device log, when the engine keeps one) |
//! | 5 | FC backward, pool backward | `net_fc_backward` (FP32 dW, db straight into G), `net_gap_backward` (into the network output's gradient) |
//! | 6 | backward: the compiled network's backward steps | cuDNN plans; the gradient joins at block inputs with `net_add_f16`; in a group, each gradient bucket's NCCL sum as soon as it is written |
//! | 7 | cast G16→G, check, SGD, EMA, loss-scale update | amp `finish` |
//!
//! With gradient accumulation ([`StepConfig::accum`] = N), a step is N micro-batches, each
//! copied in before its own 1–6; the first N − 1 end with amp's `accumulate`
//! (`amp_accum_grads`: G16 and G added into the FP32 accumulator GA) instead of 7, the last
//! with 7, whose first op adds it and moves GA's sum into G in place of the cast. The metrics
//! log gets one entry per micro-batch.
//!
//! **Two ways to feed it.** [`CudaClassifier::forward_backward`] and
//! [`CudaClassifier::train_step`] read the caller's image buffer in place. The engine's own
//! steps ([`CudaClassifier::run_step`], [`CudaClassifier::run_micro_step`]) read the network's
//! fixed input buffer and the head's labels, filled before each step by
//! [`CudaClassifier::upload_batch`] (page-locked double-buffered staging) or
//! [`CudaClassifier::take_input`] (from a [`crate::amp::cuda::DoubleInput`] a copy stream
//! filled while the previous step trained): fixed addresses are what a captured graph
//! replays.
//!
//! **Graphs.** After a few eager steps ([`WARMUP_STEPS`]) [`CudaClassifier::capture`] captures
//! the step by [`CudaGraphMode`]: `Finish` captures step 7 as amp's op-list graph, replayed in
//! place of the eager `finish`; `Step` captures 1–7 into one CUDA graph (and, with
//! accumulation, a micro-batch's 1–6 and `accumulate` into a second); when that capture fails
//! the engine falls back to `Finish` and says why ([`GraphState`]). Capture is sound when the
//! context object has exactly one stream, the per-thread default stream
//! ([`open_device`] makes the handle so): cudarc's event tracking records and waits on events
//! only for a context in multi-stream mode, so nothing inside the capture touches an event
//! recorded outside it. The cuDNN handle's workspace pool is reserved at its final size before
//! the first step, so nothing is allocated inside the capture either. The per-thread stream
//! belongs to the thread that made the engine, so [`CudaClassifier`] is not `Send`.
//!
//! **Many GPUs** ([`EngineConfig::launch`], `group.rs`): one process per GPU started by a
//! launcher ([`crate::dist::bootstrap`]); rank 0's NCCL id shared through the TCP store or
//! rendezvous file, the networks' fingerprints compared, rank 0's weights broadcast. Each
//! gradient bucket's NCCL sum is enqueued on a communication stream as soon as backward has
//! written it ([`crate::net::GradSchedule`]), the overflow flag shared between the check and
//! SGD ([`crate::amp::cuda::dist_grads`]), BN optionally synchronized
//! ([`crate::dist::NcclBnSync`]); a watchdog aborts the communicator when
//! steps stop completing. Those steps run eagerly.
//!
//! **Logging without syncs** (`metrics.rs`): loss and accuracy never leave the device during a
//! step; [`CudaClassifier::request_readback`] asks for an asynchronous copy of the log and S
//! into page-locked memory, [`CudaClassifier::poll_readback`] returns it once it has arrived.

mod capture;
mod group;
mod head;
mod metrics;
mod passes;
mod snapshot;
mod state;

pub use capture::{CudaGraphMode, GraphState, WARMUP_STEPS};
pub use group::open_device;
pub use metrics::{ScalarHistory, StepScalars};
pub use snapshot::Snapshot;

use super::shared::{step_plan, Classifier};
use super::ClassifierError;
use crate::amp::cuda::{AmpKernels, CudaContext, CudaStream, Readback, Upload};
use crate::amp::step::StepConfig;
use crate::dist::bootstrap::LaunchEnv;
use crate::fusion::exec::Handle;
#[cfg(doc)]
use crate::net::initial_weights;
use crate::net::{Arena, CompiledNet, CudaNet, MemoryReport};
use crate::netops::cuda::NetKernels;
use crate::netops::head::HeadShape;
use std::marker::PhantomData;
use std::sync::Arc;

#[cfg(doc)]
use crate::amp::cuda::CudaRegions;

type Result<T> = std::result::Result<T, ClassifierError>;

/// How the engine is set up beyond the network and the step: its memory layout, the capacity
/// of its device-side logs, and its data-parallel group.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Where the network's step-long buffers live: the memory plan's liveness-planned arena
    /// ([`Arena::Shared`], the default) or an allocation each ([`Arena::Separate`], to inspect
    /// any buffer after a pass).
    pub arena: Arena,
    /// Entries of the training metrics log (one per micro-batch the engine's own steps run);
    /// 0 keeps no log (the head then writes no metrics).
    pub log_entries: usize,
    /// Batches the evaluation log holds at a time ([`CudaClassifier::evaluate_batches`]
    /// evaluates in chunks of this many; at least 1).
    pub eval_batches: usize,
    /// This process's place in a group a launcher started (more than one rank: data
    /// parallelism over NCCL); `None` for one GPU.
    pub launch: Option<LaunchEnv>,
    /// In a group, normalize every BN with the global batch's statistics.
    pub sync_bn: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            arena: Arena::Shared,
            log_entries: 0,
            eval_batches: 8,
            launch: None,
            sync_bn: false,
        }
    }
}

/// The CUDA backend: the network on cuDNN ([`CudaNet`]), the head on netops' kernels and
/// device buffers, the amp step on [`CudaRegions`], all on the handle's stream; and the
/// engine's state around them (captured graphs, the metrics log's readback, the upload
/// staging, the data-parallel group).
pub struct CudaBackend {
    net: CudaNet,
    head: head::Head,
    kernels: Arc<AmpKernels>,
    /// The network's own kernels (the head's pooling and metrics), in the same context.
    net_kernels: Arc<NetKernels>,
    graphs: capture::Graphs,
    /// The asynchronous copy of the metrics log (with a log).
    log_readback: Option<Readback>,
    /// Page-locked, double-buffered staging for [`CudaClassifier::upload_batch`].
    staging: Upload,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    device_name: String,
    sync_bn: bool,
    /// This process's place in a data-parallel group started by a launcher.
    group: Option<group::GpuGroup>,
    /// The per-thread stream is this thread's: keep the engine on it.
    _not_send: PhantomData<*const ()>,
}

/// The GPU training engine (module docs): a [`Classifier`] on the [`CudaBackend`].
pub type CudaClassifier = Classifier<CudaBackend>;

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device_name)
            .field("routes", &routes(&self.net))
            .field("graphs", &self.graphs.state)
            .finish_non_exhaustive()
    }
}

fn driver(what: &str, e: impl std::fmt::Display) -> ClassifierError {
    ClassifierError::Driver {
        what: what.to_string(),
        message: e.to_string(),
    }
}

/// Each layer's name and route name.
fn routes(net: &CudaNet) -> Vec<(String, &'static str)> {
    net.compiled()
        .layers
        .iter()
        .map(|l| (l.name.clone(), l.layer.route().name()))
        .collect()
}

impl CudaClassifier {
    /// The network (compiled with a planned policy for `handle`'s target) with an FC head of
    /// `classes` outputs, its memory plan in device regions on the handle's stream, and the
    /// amp step of `config`; the master weights start from [`initial_weights`] of `seed`
    /// (the same as [`super::CpuClassifier`]'s). A `config` that accumulates gradients over
    /// several micro-batches ([`StepConfig::with_accum`]) gets the accumulator GA
    /// ([`Classifier::train_step`]). [`CudaClassifier::with_engine`] with the default
    /// [`EngineConfig`] (no metrics log, no group).
    ///
    /// # Errors
    /// As [`CudaRegions::new`] and [`CudaNet::new`]; a plan or step configuration the amp
    /// layer refuses (`classes` other than the spec's is
    /// [`crate::amp::PlanError::HeadClasses`]).
    pub fn new(
        net: CompiledNet,
        handle: Arc<Handle>,
        classes: usize,
        config: StepConfig,
        seed: u64,
    ) -> Result<Self> {
        Self::with_engine(net, handle, classes, config, seed, EngineConfig::default())
    }

    /// [`CudaClassifier::new`] with the engine's setup: the arena, the metrics log's capacity
    /// and, with [`EngineConfig::launch`] of more than one rank, the data-parallel group (this
    /// process trains on its shard of each global batch; the group meets here, compares the
    /// ranks' networks and broadcasts rank 0's initial weights). For capture, make `handle`
    /// on the per-thread stream of a context with no other stream ([`open_device`]).
    ///
    /// # Errors
    /// As [`CudaClassifier::new`]; [`ClassifierError::Amp`] with a `DistError` when the
    /// group cannot meet (rendezvous, NCCL) or, on every rank, `DistError::ModelMismatch`
    /// when the ranks compiled different networks; [`ClassifierError::Config`] for a
    /// watchdog timeout that does not parse.
    pub fn with_engine(
        net: CompiledNet,
        handle: Arc<Handle>,
        classes: usize,
        config: StepConfig,
        seed: u64,
        engine: EngineConfig,
    ) -> Result<Self> {
        let launch = engine.launch.clone().filter(|l| l.world > 1);
        let stream = handle.stream().clone();
        let ctx = stream.context().clone();
        let device_name = ctx.name().unwrap_or_else(|_| "unknown device".into());
        // The network's step-long buffers in the plan's liveness-planned tensor arena (with
        // the shared arena); E and E16 when the step keeps an EMA. The regions' layout is the
        // CPU classifier's (the same parameters in the same places).
        let plan = step_plan(&net, classes, &config, engine.arena == Arena::Shared)?;
        let regions = crate::amp::cuda::CudaRegions::new(plan, stream.clone())?;
        let kernels = regions.kernels().clone();
        // The group meets before A and the EMA are made from W: rank 0's W is broadcast.
        let (step, group) = Self::amp_step(&net, classes, config, seed, regions, |step| {
            launch
                .map(|l| group::GpuGroup::form(&l, &ctx, handle.stream(), &net, step))
                .transpose()
        })?;
        // (CudaNet::new reserves the largest workspace, so that the pool never grows inside
        // the step's capture.)
        let amp_plan = Some(step.executor().plan_arc().clone());
        let mut net = CudaNet::new(net, handle, amp_plan)?;
        if let (Some(g), true) = (&group, engine.sync_bn) {
            net.set_bn_sync(g.bn_sync())?;
        }
        let net_kernels = net.net_kernels().clone();
        let compiled = net.compiled();
        let shape = HeadShape::new(
            compiled.batch,
            compiled.out_hw * compiled.out_hw,
            compiled.features,
            classes,
        );
        let input_bytes = 2 * compiled.buffers[compiled.input].elems;
        let head = head::Head::new(&stream, shape, engine.log_entries, engine.eval_batches)?;
        let log_readback = match &head.log {
            Some(log) => Some(Readback::new(&ctx, log.len())?),
            None => None,
        };
        let staging = Upload::new(&ctx, input_bytes + 4 * shape.batch)?;
        let backend = CudaBackend {
            net,
            head,
            kernels,
            net_kernels,
            graphs: capture::Graphs::default(),
            log_readback,
            staging,
            stream,
            ctx,
            device_name,
            sync_bn: engine.sync_bn,
            group,
            _not_send: PhantomData,
        };
        Ok(Self::assemble(backend, step, classes))
    }

    /// The network on the device (its buffers, to inspect them).
    pub fn net(&self) -> &CudaNet {
        &self.backend.net
    }

    /// The stream everything goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.backend.stream
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.backend.device_name
    }

    /// Each layer's name and route name.
    pub fn routes(&self) -> Vec<(String, &'static str)> {
        routes(&self.backend.net)
    }

    /// One line: the group, the device, each layer's route (with the reason of a fallback),
    /// what `mode` captures, the network's buffers and the amp kernels' form.
    pub fn describe(&self, mode: CudaGraphMode) -> String {
        let routes: Vec<String> = self
            .backend
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
            match mode {
                _ if self.backend.group.is_some() => format!(
                "eager steps (NCCL: gradient buckets during backward, the overflow flag between \
                 the check and SGD; {} BN)",
                if self.backend.sync_bn { "synchronized" } else { "local" }
            ),
                CudaGraphMode::Off => "no CUDA graphs".to_string(),
                CudaGraphMode::Finish => {
                    format!("amp finish op list as a CUDA graph after {WARMUP_STEPS} warm-up steps")
                }
                CudaGraphMode::Step => {
                    format!("whole step as one CUDA graph after {WARMUP_STEPS} warm-up steps")
                }
            };
        let graphs = match self.step.config().accum {
            0 | 1 => graphs,
            n => format!(
                "{graphs}; {n} micro-batches per step (gradient accumulation: each before the \
                 last ends with amp's accumulate, from a graph of its own)"
            ),
        };
        let group = self
            .backend
            .group
            .as_ref()
            .map(|g| g.describe())
            .unwrap_or_default();
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
            self.backend.ctx.ordinal(),
            self.backend.device_name,
            routes.join(", "),
            self.backend.kernels.code()
        )
    }
}

/// Refuses up front, with the memory report, a network whose step (its batch, `classes`
/// outputs, `arena`) the device of `ctx` cannot hold; call it before anything of the step is
/// allocated.
///
/// # Errors
/// [`ClassifierError::Config`]: the memory plan refused, the device's memory cannot be
/// queried, or the step does not fit (with the largest batch that would and the report).
pub fn check_fits(
    net: &CompiledNet,
    classes: usize,
    arena: Arena,
    ctx: &CudaContext,
) -> Result<()> {
    let device = ctx.name().unwrap_or_else(|_| "unknown device".into());
    let report = MemoryReport::of(net, classes)
        .map_err(|e| ClassifierError::Config(format!("the memory plan: {e}")))?;
    let report = match arena {
        Arena::Shared => report,
        Arena::Separate => report.separate(),
    };
    let (free, _total) = ctx
        .mem_get_info()
        .map_err(|e| ClassifierError::Config(format!("cannot query the device memory: {e}")))?;
    if report.total() <= free as u64 {
        return Ok(());
    }
    let largest = match report.largest_batch(free as u64) {
        Some(b) => format!("the largest batch that fits is about {b}"),
        None => "not one image fits".into(),
    };
    Err(ClassifierError::Config(format!(
        "batch {} does not fit on {device} ({:.1} MB free): {largest}\n{report}",
        net.batch,
        free as f64 / 1e6
    )))
}
