//! The sync-free training step: one schedule of range ops, two executors.
//!
//! Recipe:
//! 1. Build a [`crate::plan::MemoryPlan`]; make its regions on an executor:
//!    [`CpuRegions::new`] (host memory, the CPU twins) or `cuda::CudaRegions::new` (device
//!    memory, the NVRTC kernels). Both start zeroed.
//! 2. Write the initial master weights into W, then [`AmpStep::new`] with a [`StepConfig`]
//!    (it writes S: the initial loss scale, flag clear, counters zero, and the SGD learning
//!    rate, momentum and weight decay) and
//!    [`AmpStep::init_weights`] (W → A, and W → E → E16 with EMA).
//! 3. Each step: [`AmpStep::begin`] (zero G and G16), your forward and backward on the same
//!    stream (conv wgrads FP16 into G16, FC/BN grads FP32 into G, the loss seed multiplied by
//!    the scale read from S), then [`AmpStep::finish`].
//!    With gradient accumulation over N micro-batches ([`StepConfig::with_accum`], a plan
//!    with GA), each micro-batch runs [`AmpStep::begin`], its forward and backward, then
//!    [`AmpStep::accumulate`] (GA += G + f32(G16)); the last runs [`AmpStep::finish`]
//!    instead, whose first op adds the last micro-batch and moves the sum into G (zeroing GA,
//!    even when the step is then skipped). The check, norm, SGD (unscaling by
//!    `1 / (loss_scale · ranks · N)`) and scale update run once per step, over the sum.
//! 4. For logging, [`AmpStep::request_scalars`] after a step and [`AmpStep::poll_scalars`]
//!    whenever convenient: the host never waits for the device.
//! 5. On CUDA, [`AmpStep::capture_finish`] (and [`AmpStep::capture_begin`]) record the op
//!    lists into CUDA graphs; [`AmpStep::replay`] launches one. A replay runs exactly the
//!    launches an eager call would. [`AmpStep::set_lr`] / [`AmpStep::set_hyper`] between
//!    replays change the hyper-parameters in S, which the SGD kernel reads: a schedule needs
//!    no recapture.
//!
//! What [`AmpStep::finish`] records, in order (see [`AmpStep::finish_ops`]):
//!
//! | # | op | over | notes |
//! |--:|----|------|-------|
//! | 1 | cast G16 → G | each of [`crate::plan::MemoryPlan::g16_cast_ranges`] | never the holes of G16 |
//! | 1′ | with [`StepConfig::accum`] > 1, instead: accumulate and drain GA → G | all of G, GA (G16 where it reaches) | G = GA + G + f32(G16), GA = 0 |
//! | 2 | check (NaN/Inf, or clip) | all of G | sets the flag in S |
//! | 2b | gradient norm (with [`StepConfig::clip_norm`]) | all of G | the global norm into S, in a fixed order |
//! | 3 | SGD, A = f16(W) | all of W/M/G/A, split where weight decay applies | skipped on the device when the flag is set; scales by the clipping factor |
//! | 4 | EMA, E16 = f16(E) | all of E/E16 (with EMA) | skipped when the flag is set |
//! | 5 | loss-scale update | S | backs off / grows, counts, clears the flag |
//!
//! The cast W → A is part of the SGD kernel (it writes A from the new W in the same pass),
//! so there is no separate cast after it: a skipped step leaves W and A both untouched, and
//! an applied one leaves `A == f16(W)` exactly. The scale update comes last because the SGD
//! kernel unscales with the scale the gradients were computed with and reads the flag that
//! the update clears; running the update before SGD would unscale with the next step's
//! scale and never skip.

#![forbid(unsafe_code)]

mod cpu;
mod op;

use std::sync::atomic::{AtomicU64, Ordering};

pub use cpu::{CpuGraph, CpuRegions};
pub(crate) use op::validate_decay;
pub use op::RangeOp;

use crate::error::{AmpError, ExecError};
use crate::plan::{ByteRange, MemoryPlan, Region};
use crate::range::{LossScalePolicy, OverflowPolicy, Scalars, SgdConfig};

/// A new, process-unique executor id (graphs remember where they were captured).
pub(crate) fn next_executor_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Every op of `ops` checked with [`RangeOp::validate`] against `plan`, in order.
fn validate_all(plan: &MemoryPlan, ops: &[RangeOp]) -> Result<(), AmpError> {
    ops.iter().try_for_each(|op| op.validate(plan))
}

/// What every [`AmpExecutor::capture`] checks first: a non-empty list of valid ops.
pub(crate) fn validate_capture(plan: &MemoryPlan, ops: &[RangeOp]) -> Result<(), AmpError> {
    if ops.is_empty() {
        return Err(ExecError::EmptyCapture.into());
    }
    validate_all(plan, ops)
}

/// What every [`AmpExecutor::replay`] checks first: the graph was captured on executor `id`.
pub(crate) fn check_graph_owner(owner: u64, id: u64) -> Result<(), AmpError> {
    if owner != id {
        return Err(ExecError::ForeignGraph {
            captured_on: owner,
            replayed_on: id,
        }
        .into());
    }
    Ok(())
}

/// The regions of one memory plan on one device, and the range ops over them.
///
/// Both executors give the same results bit for bit for every op of a step (the CPU twins
/// are exact for every kernel a step uses). Nothing here waits for the device: on CUDA every
/// method that touches device memory only enqueues work on the executor's stream.
pub trait AmpExecutor {
    /// A recorded op list that [`AmpExecutor::replay`] can run again.
    type Graph;

    /// Process-unique id of this executor.
    fn id(&self) -> u64;

    /// The memory plan the regions follow.
    fn plan(&self) -> &MemoryPlan;

    /// Runs (enqueues) one op after checking it with [`RangeOp::validate`].
    ///
    /// # Errors
    /// As [`RangeOp::validate`]; on CUDA also [`crate::CudaError::Driver`].
    fn run(&mut self, op: &RangeOp) -> Result<(), AmpError>;

    /// Runs a list of ops in order. Every op is validated before the first one runs, so a
    /// bad list runs nothing.
    ///
    /// # Errors
    /// As [`AmpExecutor::run`].
    fn run_all(&mut self, ops: &[RangeOp]) -> Result<(), AmpError> {
        validate_all(self.plan(), ops)?;
        ops.iter().try_for_each(|op| self.run(op))
    }

    /// Records `ops` (validated first) into a graph without running them.
    ///
    /// # Errors
    /// [`ExecError::EmptyCapture`] for an empty list; as [`AmpExecutor::run`].
    fn capture(&mut self, ops: &[RangeOp]) -> Result<Self::Graph, AmpError>;

    /// Runs a graph captured on this executor.
    ///
    /// # Errors
    /// [`ExecError::ForeignGraph`] for a graph of another executor; on CUDA, a driver error.
    fn replay(&mut self, graph: &Self::Graph) -> Result<(), AmpError>;

    /// Overwrites S with `s` (e.g. at start, or from a checkpoint). To resume a run, prefer
    /// [`AmpStep::restore_scalars`], which checks `s` on every executor.
    ///
    /// # Errors
    /// On the CPU, [`crate::RangeOpError::InvalidConfig`] for a NaN, infinite or ≤ 0 loss
    /// scale ([`Scalars::validate`]); on CUDA, a driver error.
    fn write_scalars(&mut self, s: &Scalars) -> Result<(), AmpError>;

    /// Overwrites only the SGD hyper-parameters in S (learning rate, momentum, weight decay),
    /// leaving the loss scale, flag and counters as the device has them. Ordered after the
    /// work enqueued so far and before what comes next; never waits.
    ///
    /// # Errors
    /// On CUDA, a driver error.
    fn write_hyper(&mut self, sgd: &SgdConfig) -> Result<(), AmpError>;

    /// Overwrites only S's rank count (data-parallel steps: SGD unscales G's sums by
    /// `1 / (loss_scale · ranks)`), ordered like [`AmpExecutor::write_hyper`].
    ///
    /// # Errors
    /// On CUDA, a driver error.
    fn write_ranks(&mut self, ranks: u32) -> Result<(), AmpError>;

    /// Overwrites only S's global-norm clipping bound (0: no clipping), ordered like
    /// [`AmpExecutor::write_hyper`].
    ///
    /// # Errors
    /// On CUDA, a driver error.
    fn write_clip_norm(&mut self, max_norm: f32) -> Result<(), AmpError>;

    /// Overwrites only S's micro-batch count (gradient accumulation: SGD unscales G's sums by
    /// `1 / (loss_scale · ranks · accum)`), ordered like [`AmpExecutor::write_hyper`].
    ///
    /// # Errors
    /// On CUDA, a driver error.
    fn write_accum(&mut self, accum: u32) -> Result<(), AmpError>;

    /// Asks for a snapshot of S as it will be once the work enqueued so far has run. Never
    /// waits: on CUDA it enqueues an asynchronous copy into pinned host memory.
    ///
    /// # Errors
    /// On CUDA, a driver error.
    fn request_scalars(&mut self) -> Result<(), AmpError>;

    /// The most recent requested snapshot of S that has arrived; `None` until the first one
    /// has. While a newer request is still in flight this is the previous snapshot (on the
    /// CPU a snapshot arrives at once). Never waits.
    ///
    /// # Errors
    /// On CUDA, a driver error (including one from earlier asynchronous work).
    fn poll_scalars(&mut self) -> Result<Option<Scalars>, AmpError>;
}

/// What an [`AmpStep`] does after backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepConfig {
    /// SGD hyper-parameters. `weight_decay` applies only to each bucket's decayed range
    /// (conv and FC weights, [`MemoryPlan::decay_range`]); BN affine parameters and biases
    /// get none.
    pub sgd: SgdConfig,
    /// EMA decay (the plan must have E and E16), or `None` for no EMA.
    pub ema_decay: Option<f32>,
    /// What the gradient check does with NaN/Inf.
    pub overflow: OverflowPolicy,
    /// How the loss scale moves.
    pub loss_scale: LossScalePolicy,
    /// Clipping by global norm (PyTorch's `clip_grad_norm_(max_norm)` after `unscale_`):
    /// `Some(max_norm)` adds the gradient-norm op to the step and SGD scales every gradient
    /// by `min(1, max_norm / (‖g‖ + 1e-6))`, both on the device; `None`: no clipping.
    pub clip_norm: Option<f32>,
    /// Micro-batches per optimizer step (gradient accumulation; 1: none). Above 1 the plan
    /// needs the accumulator GA ([`MemoryPlan::with_grad_accumulator`]), each micro-batch but
    /// the last ends with [`AmpStep::accumulate`] and the last with [`AmpStep::finish`];
    /// SGD unscales by `1 / (loss_scale · ranks · accum)`. At most [`MAX_ACCUM`].
    pub accum: u32,
}

/// The most micro-batches one optimizer step accumulates ([`StepConfig::accum`]): far more
/// than any schedule needs, and small enough that `loss_scale · ranks · accum` stays an exact
/// FP32 product for power-of-two loss scales and rank counts below 2^12.
pub const MAX_ACCUM: u32 = 4096;

impl StepConfig {
    /// `sgd` with no EMA, the default overflow policy (NaN/Inf skip the step) and the default
    /// loss scale (fixed, 8192).
    pub fn new(sgd: SgdConfig) -> Self {
        StepConfig {
            sgd,
            ema_decay: None,
            overflow: OverflowPolicy::default(),
            loss_scale: LossScalePolicy::default(),
            clip_norm: None,
            accum: 1,
        }
    }

    /// Sets gradient accumulation over `micro_batches` per optimizer step (1: none).
    pub fn with_accum(mut self, micro_batches: u32) -> Self {
        self.accum = micro_batches;
        self
    }

    /// Sets clipping by global norm to `max_norm`.
    pub fn with_clip_norm(mut self, max_norm: f32) -> Self {
        self.clip_norm = Some(max_norm);
        self
    }

    /// Sets the EMA decay.
    pub fn with_ema(mut self, decay: f32) -> Self {
        self.ema_decay = Some(decay);
        self
    }

    /// Sets the overflow policy.
    pub fn with_overflow(mut self, policy: OverflowPolicy) -> Self {
        self.overflow = policy;
        self
    }

    /// Sets the loss-scale policy.
    pub fn with_loss_scale(mut self, policy: LossScalePolicy) -> Self {
        self.loss_scale = policy;
        self
    }

    /// Checks the configuration, and that `plan` has the regions it needs (M for momentum,
    /// E and E16 for EMA).
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] naming the field, or
    /// [`ExecError::MissingRegion`].
    pub fn validate(&self, plan: &MemoryPlan) -> Result<(), AmpError> {
        self.sgd.validate()?;
        self.overflow.validate()?;
        self.loss_scale.validate()?;
        if let Some(max_norm) = self.clip_norm {
            if !(max_norm.is_finite() && max_norm > 0.0) {
                return Err(crate::RangeOpError::InvalidConfig {
                    op: "StepConfig",
                    field: "clip_norm",
                    value: max_norm.to_string(),
                    why: "must be finite and > 0",
                }
                .into());
            }
        }
        if !(1..=MAX_ACCUM).contains(&self.accum) {
            return Err(crate::RangeOpError::InvalidConfig {
                op: "StepConfig",
                field: "accum",
                value: self.accum.to_string(),
                why: "micro-batches per step must be in 1..=4096 (MAX_ACCUM)",
            }
            .into());
        }
        if self.accum > 1 && !plan.has_region(Region::GA) {
            return Err(ExecError::MissingRegion {
                what: format!("gradient accumulation over {} micro-batches", self.accum),
                region: Region::GA,
            }
            .into());
        }
        if self.sgd.momentum != 0.0 && !plan.has_region(Region::M) {
            return Err(ExecError::MissingRegion {
                what: format!("SGD momentum {}", self.sgd.momentum),
                region: Region::M,
            }
            .into());
        }
        if let Some(decay) = self.ema_decay {
            op::validate_decay(decay)?;
            if !plan.has_region(Region::E) {
                return Err(ExecError::MissingRegion {
                    what: format!("EMA with decay {decay}"),
                    region: Region::E,
                }
                .into());
            }
        }
        Ok(())
    }
}

/// The whole FP16-layout extent of the parameter regions.
fn whole16(plan: &MemoryPlan) -> ByteRange {
    ByteRange::new(0, plan.region_len(Region::A))
}

/// The ops of [`AmpStep::begin`]: zero G and G16 (whole regions: padding and G16's holes
/// must be zero too).
pub fn begin_ops(plan: &MemoryPlan) -> Vec<RangeOp> {
    let mut ops = vec![RangeOp::Zero {
        region: Region::G,
        span16: whole16(plan),
    }];
    if plan.has_region(Region::G16) {
        ops.push(RangeOp::Zero {
            region: Region::G16,
            span16: ByteRange::new(0, plan.region_len(Region::G16)),
        });
    }
    ops
}

/// The SGD launches: one over everything without weight decay; with it, each bucket's decayed
/// range with the decay and the rest of the bucket without, adjacent equal launches merged.
fn sgd_ops(plan: &MemoryPlan, sgd: SgdConfig) -> Vec<RangeOp> {
    let momentum_buffer = plan.has_region(Region::M);
    let op = |decay: bool, span16: ByteRange| RangeOp::Sgd {
        nesterov: sgd.nesterov,
        decay,
        momentum_buffer,
        span16,
    };
    // Which ranges take weight decay is structure, fixed here; its value is read from S.
    let mut ops: Vec<RangeOp> = Vec::new();
    let mut push = |decay: bool, span16: ByteRange| {
        if span16.is_empty() {
            return;
        }
        if let Some(RangeOp::Sgd {
            decay: last,
            span16: s,
            ..
        }) = ops.last_mut()
        {
            if *last == decay && s.end == span16.start {
                s.end = span16.end;
                return;
            }
        }
        ops.push(op(decay, span16));
    };
    for b in plan.buckets() {
        let span = b.span16();
        let decay = b.decay16();
        push(true, decay);
        push(false, ByteRange::new(decay.end, span.end));
    }
    ops
}

/// The ops of [`AmpStep::accumulate`] for `plan` and `cfg`: with [`StepConfig::accum`] above
/// 1, one [`RangeOp::AccumGrads`] over all of G (this micro-batch's G and G16 added into GA);
/// none otherwise.
pub fn accumulate_ops(plan: &MemoryPlan, cfg: &StepConfig) -> Vec<RangeOp> {
    if cfg.accum > 1 {
        vec![RangeOp::AccumGrads {
            drain: false,
            span16: whole16(plan),
        }]
    } else {
        Vec::new()
    }
}

/// The ops of [`AmpStep::finish`] for `plan` and `cfg` (the table in the module docs).
pub fn finish_ops(plan: &MemoryPlan, cfg: &StepConfig) -> Vec<RangeOp> {
    let mut ops: Vec<RangeOp> = if cfg.accum > 1 {
        // The last micro-batch: its gradient plus GA's sum into G, GA zeroed (one pass
        // instead of the cast).
        vec![RangeOp::AccumGrads {
            drain: true,
            span16: whole16(plan),
        }]
    } else {
        plan.g16_cast_ranges()
            .into_iter()
            .map(|span16| RangeOp::CastF16ToF32 {
                src: Region::G16,
                dst: Region::G,
                span16,
            })
            .collect()
    };
    ops.push(RangeOp::Check {
        policy: cfg.overflow,
        span16: whole16(plan),
    });
    if cfg.clip_norm.is_some() {
        ops.push(RangeOp::GradNorm {
            span16: whole16(plan),
        });
    }
    ops.extend(sgd_ops(plan, cfg.sgd));
    if let Some(decay) = cfg.ema_decay {
        ops.push(RangeOp::Ema {
            decay,
            span16: whole16(plan),
        });
    }
    ops.push(RangeOp::LossScaleUpdate {
        policy: cfg.loss_scale,
    });
    ops
}

/// The ops of [`AmpStep::init_weights`]: W → A, and with EMA W → E, E → E16.
pub fn init_ops(plan: &MemoryPlan) -> Vec<RangeOp> {
    let span16 = whole16(plan);
    let mut ops = vec![RangeOp::CastF32ToF16 {
        src: Region::W,
        dst: Region::A,
        span16,
    }];
    if plan.has_region(Region::E) {
        ops.push(RangeOp::CopyF32 {
            src: Region::W,
            dst: Region::E,
            span16,
        });
        ops.push(RangeOp::CastF32ToF16 {
            src: Region::E,
            dst: Region::E16,
            span16,
        });
    }
    ops
}

/// Which part of a step a [`StepGraph`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPhase {
    /// [`AmpStep::begin_ops`].
    Begin,
    /// [`AmpStep::finish_ops`].
    Finish,
    /// [`AmpStep::accumulate_ops`].
    Accumulate,
}

/// A captured part of a step: replay it with [`AmpStep::replay`].
#[derive(Debug)]
pub struct StepGraph<G> {
    graph: G,
    phase: StepPhase,
    generation: u64,
}

impl<G> StepGraph<G> {
    /// Which part of the step it holds.
    pub fn phase(&self) -> StepPhase {
        self.phase
    }

    /// The executor's graph.
    pub fn graph(&self) -> &G {
        &self.graph
    }
}

/// The mixed-precision training step over one executor's regions.
///
/// It never waits for the device: on CUDA each method only enqueues launches on the
/// executor's stream, and the loss scale and overflow flag stay in S, read by the kernels.
#[derive(Debug)]
pub struct AmpStep<X: AmpExecutor> {
    exec: X,
    config: StepConfig,
    begin: Vec<RangeOp>,
    finish: Vec<RangeOp>,
    accumulate: Vec<RangeOp>,
    /// The data-parallel ranks S counts ([`AmpStep::set_ranks`]): this run's, kept when S is
    /// restored from another run.
    ranks: u32,
    /// Bumped by every change of the step's structure; graphs remember the one they were
    /// captured at.
    generation: u64,
}

impl<X: AmpExecutor> AmpStep<X> {
    /// A step over `exec` with `config`. Writes S: the policy's initial scale, flag clear,
    /// counters zero (overwrite it with [`AmpExecutor::write_scalars`] to resume a run).
    ///
    /// # Errors
    /// As [`StepConfig::validate`]; on CUDA, a driver error from writing S.
    pub fn new(mut exec: X, config: StepConfig) -> Result<Self, AmpError> {
        config.validate(exec.plan())?;
        let s = Scalars {
            clip_norm: config.clip_norm.unwrap_or(0.0),
            accum: config.accum,
            ..Scalars::new(&config.loss_scale).with_sgd(&config.sgd)
        };
        exec.write_scalars(&s)?;
        let begin = begin_ops(exec.plan());
        let finish = finish_ops(exec.plan(), &config);
        let accumulate = accumulate_ops(exec.plan(), &config);
        Ok(AmpStep {
            exec,
            config,
            begin,
            finish,
            accumulate,
            ranks: 1,
            generation: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &StepConfig {
        &self.config
    }

    /// Replaces the configuration. The loss scale, flag and counters in S stay as they are;
    /// the SGD hyper-parameters in S take the new values. Graphs captured before become stale
    /// ([`AmpStep::replay`] refuses them) only when the structure changed (Nesterov, overflow
    /// or loss-scale policy, EMA, clipping by norm, the micro-batch count); a change of
    /// learning rate, momentum or weight decay alone keeps them valid, as with
    /// [`AmpStep::set_hyper`]. Change the micro-batch count between steps only: GA holds
    /// the sum of the step's micro-batches so far.
    ///
    /// # Errors
    /// As [`StepConfig::validate`]; the step is unchanged on error.
    pub fn set_config(&mut self, config: StepConfig) -> Result<(), AmpError> {
        config.validate(self.exec.plan())?;
        let structural = StepConfig {
            sgd: config.sgd.with_values_of(&self.config.sgd),
            ..config
        } != self.config;
        self.exec.write_hyper(&config.sgd)?;
        if config.clip_norm != self.config.clip_norm {
            self.exec.write_clip_norm(config.clip_norm.unwrap_or(0.0))?;
        }
        if config.accum != self.config.accum {
            self.exec.write_accum(config.accum)?;
        }
        if structural {
            self.finish = finish_ops(self.exec.plan(), &config);
            self.accumulate = accumulate_ops(self.exec.plan(), &config);
            self.generation += 1;
        }
        self.config = config;
        Ok(())
    }

    /// Sets the learning rate, momentum and weight decay for the steps enqueued from now on
    /// (eager or replayed): they are written into S, which the SGD kernel reads, so captured
    /// graphs stay valid and follow the schedule. Never waits.
    ///
    /// # Errors
    /// As [`StepConfig::validate`] for out-of-range values (a non-zero momentum needs the
    /// plan's M region); the step is unchanged on error.
    pub fn set_hyper(&mut self, lr: f32, momentum: f32, weight_decay: f32) -> Result<(), AmpError> {
        let mut config = self.config;
        config.sgd.lr = lr;
        config.sgd.momentum = momentum;
        config.sgd.weight_decay = weight_decay;
        self.set_config(config)
    }

    /// Changes the learning rate (see [`AmpStep::set_hyper`]: written into S, captured graphs
    /// stay valid).
    ///
    /// # Errors
    /// As [`StepConfig::validate`] for a negative or non-finite rate.
    pub fn set_lr(&mut self, lr: f32) -> Result<(), AmpError> {
        let sgd = self.config.sgd;
        self.set_hyper(lr, sgd.momentum, sgd.weight_decay)
    }

    /// Restores S from a checkpoint or another run: the loss scale, flag and counters of
    /// `s`, with this step's SGD hyper-parameters, clipping bound and accumulation (the
    /// configuration's, which S follows) and its ranks ([`AmpStep::set_ranks`]: this run's
    /// group, whatever group wrote `s`).
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for a NaN, infinite or ≤ 0 loss scale, before
    /// S is touched (0 would turn every master weight into NaN after one step, +Inf skip every
    /// step forever); on CUDA, a driver error.
    pub fn restore_scalars(&mut self, s: &Scalars) -> Result<(), AmpError> {
        s.validate()?;
        let s = Scalars {
            clip_norm: self.config.clip_norm.unwrap_or(0.0),
            accum: self.config.accum,
            ranks: self.ranks,
            ..s.with_sgd(&self.config.sgd)
        };
        self.exec.write_scalars(&s)
    }

    /// The ops [`AmpStep::begin`] runs.
    pub fn begin_ops(&self) -> &[RangeOp] {
        &self.begin
    }

    /// The ops [`AmpStep::finish`] runs.
    pub fn finish_ops(&self) -> &[RangeOp] {
        &self.finish
    }

    /// The ops [`AmpStep::accumulate`] runs (none without gradient accumulation).
    pub fn accumulate_ops(&self) -> &[RangeOp] {
        &self.accumulate
    }

    /// Makes the compute copies from the master weights in W: A = f16(W), and with EMA
    /// E = W, E16 = f16(E). Run it once after writing W (or after loading a checkpoint).
    ///
    /// # Errors
    /// On CUDA, a driver error.
    pub fn init_weights(&mut self) -> Result<(), AmpError> {
        let ops = init_ops(self.exec.plan());
        self.exec.run_all(&ops)
    }

    /// Starts a step: zeroes G and G16.
    ///
    /// # Errors
    /// On CUDA, a driver error.
    pub fn begin(&mut self) -> Result<(), AmpError> {
        self.exec.run_all(&self.begin)
    }

    /// Ends a micro-batch other than the step's last, with gradient accumulation
    /// ([`StepConfig::accum`] above 1): adds its gradient (G16 and G) into GA. Run
    /// [`AmpStep::begin`] before each micro-batch's backward pass and this after it, for the
    /// first `accum − 1` micro-batches; after the last one's, [`AmpStep::finish`] (which
    /// adds it and moves the sum into G). Without accumulation it runs nothing.
    ///
    /// # Errors
    /// On CUDA, a driver error.
    pub fn accumulate(&mut self) -> Result<(), AmpError> {
        if self.accumulate.is_empty() {
            return Ok(());
        }
        self.exec.run_all(&self.accumulate)
    }

    /// Ends a step after backward: cast, check, SGD, EMA, scale update (module docs).
    ///
    /// # Errors
    /// On CUDA, a driver error.
    pub fn finish(&mut self) -> Result<(), AmpError> {
        self.exec.run_all(&self.finish)
    }

    /// [`AmpStep::finish`] with `between` run after the overflow check and before SGD: where
    /// a data-parallel step shares the overflow flag across ranks
    /// ([`crate::dist::grads::all_reduce_overflow`]), so that every rank skips together.
    ///
    /// # Errors
    /// As [`AmpStep::finish`], or what `between` returns; the ops after the check do not run
    /// when it fails.
    pub fn finish_with(
        &mut self,
        between: impl FnOnce(&mut X) -> Result<(), AmpError>,
    ) -> Result<(), AmpError> {
        let split = self
            .finish
            .iter()
            .rposition(|op| matches!(op, RangeOp::Check { .. }))
            .map_or(0, |i| i + 1);
        validate_all(self.exec.plan(), &self.finish)?;
        self.exec.run_all(&self.finish[..split])?;
        between(&mut self.exec)?;
        self.exec.run_all(&self.finish[split..])
    }

    /// Sets how many data-parallel ranks' gradients G sums (S's `ranks`; 1 by default): SGD
    /// then unscales by `1 / (loss_scale · ranks)`, averaging the sums in the same multiply.
    /// Captured graphs stay valid (the kernel reads S).
    ///
    /// # Errors
    /// [`crate::RangeOpError::InvalidConfig`] for 0 ranks; on CUDA, a driver error.
    pub fn set_ranks(&mut self, ranks: u32) -> Result<(), AmpError> {
        if ranks == 0 {
            return Err(crate::RangeOpError::InvalidConfig {
                op: "AmpStep::set_ranks",
                field: "ranks",
                value: "0".into(),
                why: "a step runs on at least one rank",
            }
            .into());
        }
        self.exec.write_ranks(ranks)?;
        self.ranks = ranks;
        Ok(())
    }

    fn capture(&mut self, phase: StepPhase) -> Result<StepGraph<X::Graph>, AmpError> {
        let ops = match phase {
            StepPhase::Begin => &self.begin,
            StepPhase::Finish => &self.finish,
            StepPhase::Accumulate => &self.accumulate,
        };
        Ok(StepGraph {
            graph: self.exec.capture(ops)?,
            phase,
            generation: self.generation,
        })
    }

    /// Records [`AmpStep::begin_ops`] into a graph (nothing runs).
    ///
    /// # Errors
    /// As [`AmpExecutor::capture`].
    pub fn capture_begin(&mut self) -> Result<StepGraph<X::Graph>, AmpError> {
        self.capture(StepPhase::Begin)
    }

    /// Records [`AmpStep::accumulate_ops`] into a graph (nothing runs).
    ///
    /// # Errors
    /// As [`AmpExecutor::capture`] ([`ExecError::EmptyCapture`] without accumulation).
    pub fn capture_accumulate(&mut self) -> Result<StepGraph<X::Graph>, AmpError> {
        self.capture(StepPhase::Accumulate)
    }

    /// Records [`AmpStep::finish_ops`] into a graph (nothing runs).
    ///
    /// # Errors
    /// As [`AmpExecutor::capture`].
    pub fn capture_finish(&mut self) -> Result<StepGraph<X::Graph>, AmpError> {
        self.capture(StepPhase::Finish)
    }

    /// Runs a captured graph: the same launches as the eager call it replaces.
    ///
    /// # Errors
    /// [`ExecError::StaleGraph`] when the configuration changed since the capture,
    /// [`ExecError::ForeignGraph`] for another executor's graph; on CUDA, a driver error.
    pub fn replay(&mut self, graph: &StepGraph<X::Graph>) -> Result<(), AmpError> {
        if graph.phase != StepPhase::Begin && graph.generation != self.generation {
            return Err(ExecError::StaleGraph {
                captured: graph.generation,
                current: self.generation,
            }
            .into());
        }
        self.exec.replay(&graph.graph)
    }

    /// See [`AmpExecutor::request_scalars`].
    ///
    /// # Errors
    /// As [`AmpExecutor::request_scalars`].
    pub fn request_scalars(&mut self) -> Result<(), AmpError> {
        self.exec.request_scalars()
    }

    /// See [`AmpExecutor::poll_scalars`].
    ///
    /// # Errors
    /// As [`AmpExecutor::poll_scalars`].
    pub fn poll_scalars(&mut self) -> Result<Option<Scalars>, AmpError> {
        self.exec.poll_scalars()
    }

    /// The memory plan.
    pub fn plan(&self) -> &MemoryPlan {
        self.exec.plan()
    }

    /// The executor (its regions).
    pub fn executor(&self) -> &X {
        &self.exec
    }

    /// The executor, to write gradients and read weights.
    pub fn executor_mut(&mut self) -> &mut X {
        &mut self.exec
    }

    /// Gives the executor back.
    pub fn into_executor(self) -> X {
        self.exec
    }
}
