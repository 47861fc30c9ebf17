//! The main job's training loop: a small ResNet-style CBR network on a synthetic dataset,
//! trained with the amp step (FP32 master weights, FP16 compute weights, fixed loss scaling,
//! SGD with momentum), on the CPU reference executor or on CUDA.
//!
//! A crate of its own, on the `cudnn_cbr` facade's public API. `examples/train_cbr.rs` drives
//! it from the command line; tests run it with fewer steps.
//! Every parameter lives in an [`amp`](cudnn_cbr::amp) memory plan: conv weights are read from
//! region A (FP16) and their FP16 wgrads written to G16; BN and FC parameters are read from W
//! and their FP32 gradients written to G. The step then casts, checks, applies SGD (skipping
//! on overflow) and updates the loss scale.
//!
//! Recipe:
//! 1. A [`TrainConfig`]; its [`Device`] picks the executor: [`Device::Cpu`] (the default),
//!    [`Device::Cuda`] (a typed error when it cannot run: [`TrainError::is_unavailable`]) or
//!    [`Device::Auto`] (CUDA when it can run, else the CPU, saying why).
//! 2. [`Trainer::new`] makes that choice and sets the executor up (on CUDA: plans every
//!    layer, allocates, uploads the initial weights); [`Trainer::executor`] says which and
//!    why. [`train`] is `Trainer::new` followed by [`Trainer::run`].
//! 3. Optionally, [`Trainer::resume`] loads a checkpoint, [`Trainer::save_to`] saves them
//!    ([`checkpoint`]: safetensors with torchvision's names, bit-exact resume) and
//!    [`Trainer::record_curve`] asks the CUDA executor for per-step [`curves`] too.
//! 4. [`Trainer::run`] trains and reports progress every few steps; the
//!    [`TrainReport`] holds the per-step losses, the final master weights and their
//!    [`TrainReport::weights_hash`], and the curve ([`curves::write`] draws it).
//!
//! Both executors run the same network (the preset [`TrainConfig::net`], compiled by
//! [`cudnn_cbr::net::compile()`]), from the same initial
//! weights and data, with the same head (the [`cudnn_cbr::amp::range`] twins of
//! `amp/kernels/amp_head.cu`); [`cuda`] explains what the CUDA executor runs, captures and
//! reads back.

#![forbid(unsafe_code)]

pub mod augment;
pub mod checkpoint;
pub mod cifar;
mod cpu;
mod cpu_dp;
pub mod cuda;
pub mod curves;
mod data;
pub mod net;

pub use cudnn_cbr::net::Preset;
pub use data::{DataSource, Dataset, Prefetch, Synthetic};
pub use net::compile_net;

use cudnn_cbr::amp::plan::{MemoryPlan, ParamInfo};
use cudnn_cbr::amp::range::{HeadMetrics, SgdConfig};
use cudnn_cbr::amp::step::StepConfig;
use cudnn_cbr::amp::AmpError;
pub use cudnn_cbr::net::Arena;
use std::fmt;
use std::str::FromStr;

/// Which executor trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// CUDA when a device, cuDNN and NVRTC are usable and every layer has a route; the CPU
    /// reference executor otherwise, with the reason in [`ExecutorInfo::reason`].
    Auto,
    /// The CUDA executor, or a typed error saying why it cannot run.
    Cuda,
    /// The CPU reference executor.
    #[default]
    Cpu,
}

impl Device {
    /// The lower-case name (`auto`, `cuda`, `cpu`).
    pub fn name(self) -> &'static str {
        match self {
            Device::Auto => "auto",
            Device::Cuda => "cuda",
            Device::Cpu => "cpu",
        }
    }
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Device::Auto),
            "cuda" => Ok(Device::Cuda),
            "cpu" => Ok(Device::Cpu),
            other => Err(format!("device must be auto, cuda or cpu, got `{other}`")),
        }
    }
}

/// What the CUDA executor replays from CUDA graphs after [`cuda::WARMUP_STEPS`] eager steps
/// (the CPU executor ignores it): the library engine's capture mode.
pub use cudnn_cbr::classifier::cuda::CudaGraphMode;

/// What to train.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Images per step.
    pub batch: usize,
    /// The network (`mini`, `resnet18`, `resnet34`, `resnet50`, `resnet101`).
    pub net: Preset,
    /// The mini network's base channel width (its second stage has twice as many; the
    /// ResNets' widths are fixed).
    pub width: usize,
    /// Seed of the dataset and the initial weights.
    pub seed: u64,
    /// Learning rate.
    pub lr: f32,
    /// Image size (height = width).
    pub hw: usize,
    /// Input channels.
    pub channels: usize,
    /// Classes.
    pub classes: usize,
    /// Run the fused route's ops (else the unfused route's). On CUDA, `true` plans the fused
    /// route with cuDNN's fallback to the unfused one per layer; `false` plans the unfused one.
    pub fused: bool,
    /// The executor.
    pub device: Device,
    /// CUDA-graph use on the CUDA executor.
    pub cuda_graph: CudaGraphMode,
    /// A reliability drill (CPU executor only): poison gradients on chosen steps and trace
    /// how the step handles them ([`TrainReport::trace`]).
    pub drill: Option<FaultDrill>,
    /// Data-parallel ranks (CPU executor: threads of this process). `batch` is the per-rank
    /// batch; rank r trains on its shard of the same global batch of `ranks × batch` images.
    pub ranks: usize,
    /// Synchronized BN across the ranks (every layer normalizes with the global batch's
    /// statistics); local BN (each rank its shard's) otherwise.
    pub sync_bn: bool,
    /// The training images: synthetic (the default) or CIFAR-10 files (one rank, CPU or CUDA
    /// executor; then `hw` must be 32 and `classes` 10, and `channels` ≥ 3 holds R, G, B and
    /// zeros).
    pub data: DataSource,
    /// Clipping by global norm (PyTorch's `clip_grad_norm_(max_norm)` after `unscale_`): the
    /// norm of the unscaled gradients is computed on the device each step and SGD scales
    /// them by `min(1, max_norm / (norm + 1e-6))`; `None`: no clipping.
    pub clip_norm: Option<f32>,
    /// An exponential moving average of the weights with this decay (region E, FP32, and its
    /// FP16 copy E16; `e = decay·e + (1 − decay)·w` after every applied step, skipped with the
    /// weights on overflow), evaluated besides the trained weights
    /// ([`TrainReport::held_out_ema_accuracy`]). Every executor (on CUDA the update runs in
    /// the step, inside its CUDA graph). `None`: no EMA.
    pub ema: Option<f32>,
    /// Gradient accumulation: micro-batches of `batch` images per optimizer step (1: none;
    /// at most [`MAX_ACCUM`]). Each micro-batch runs its own forward and backward pass (BN
    /// with its statistics) and its gradient is added in FP32 into the plan's accumulator;
    /// the overflow check, SGD (unscaling by `1 / (loss_scale · accum · ranks)`) and the
    /// loss-scale update run once per step. Step `i` trains on batches `i·accum ..
    /// (i + 1)·accum` of the dataset; its loss and accuracy are its micro-batches' means.
    pub accum: usize,
    /// How the network's buffers are laid out: [`Arena::Shared`] (the default) keeps the
    /// activations, their gradients and the per-step scratch in one arena where buffers
    /// never alive together share memory (the GPU's tensor arena, the CPU executor's shared
    /// pools); [`Arena::Separate`] gives each its own allocation. Same results either way.
    pub arena: Arena,
}

/// The most micro-batches per optimizer step ([`TrainConfig::accum`]): the amp step's bound,
/// [`cudnn_cbr::amp::step::MAX_ACCUM`].
pub const MAX_ACCUM: usize = cudnn_cbr::amp::step::MAX_ACCUM as usize;

/// A reliability drill: on about `per_mille`/1000 of the steps, chosen by `seed`, one
/// gradient element is overwritten with NaN, +Inf or −Inf (in turn) after the backward pass
/// and before the amp step's finish, as an overflow in the backward pass would leave it. The
/// amp step must then skip that step (weights, momentum and EMA untouched) and halve the loss
/// scale (floor 1). With gradient accumulation the element is poisoned in one micro-batch of
/// the step ([`FaultDrill::micro_batch`]), before it is added into the accumulator: the whole
/// step must be skipped and the scale halved once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultDrill {
    /// Poisoned steps per 1000.
    pub per_mille: u32,
    /// Chooses the steps and the poisoned elements.
    pub seed: u64,
}

impl FaultDrill {
    /// Whether step `i` is poisoned, and if so a hash that picks the element and value.
    pub fn poisons(&self, step: usize) -> Option<u64> {
        let h = mix(self.seed ^ mix(step as u64));
        (h % 1000 < u64::from(self.per_mille)).then_some(mix(h))
    }
}

impl FaultDrill {
    /// Which of a poisoned step's `accum` micro-batches gets the bad value, from the hash
    /// [`FaultDrill::poisons`] gave (always 0 with one micro-batch).
    pub fn micro_batch(hash: u64, accum: usize) -> usize {
        ((hash >> 8) % accum.max(1) as u64) as usize
    }
}

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

fn mix(mut z: u64) -> u64 {
    // SplitMix64's finalizer: a well-spread hash of a counter.
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One step of a drilled run ([`TrainConfig::drill`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTrace {
    /// A gradient element was poisoned on this step.
    pub poisoned: bool,
    /// The amp step skipped the update.
    pub skipped: bool,
    /// The loss scale after the step.
    pub loss_scale: f32,
    /// A hash of the optimizer state after the step (master weights W, momentum M, EMA E),
    /// bit for bit: equal before and after a skipped step.
    pub state_hash: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 200,
            batch: 32,
            net: Preset::Mini,
            width: 16,
            seed: 1,
            lr: 0.05,
            hw: 16,
            channels: 8,
            classes: 8,
            fused: true,
            device: Device::Cpu,
            cuda_graph: CudaGraphMode::Step,
            drill: None,
            ranks: 1,
            sync_bn: false,
            data: DataSource::Synthetic,
            clip_norm: None,
            ema: None,
            accum: 1,
            arena: Arena::Shared,
        }
    }
}

/// The most optimizer steps one run takes: 2^24, far beyond any schedule the trainer runs.
/// Each step's metrics are kept for the summary, so a larger count would reserve memory the
/// host does not have before the first step.
pub const MAX_STEPS: usize = 1 << 24;

impl TrainConfig {
    /// Checks what both executors need.
    ///
    /// # Errors
    /// [`TrainError::Config`] naming the requirement.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.steps == 0
            || self.batch < 2
            || self.width == 0
            || self.hw < 4
            || self.channels == 0
            || self.classes == 0
        {
            return Err(TrainError::Config(format!(
                "steps ≥ 1, batch ≥ 2, width ≥ 1, channels ≥ 1, classes ≥ 1 and an image size \
                 ≥ 4 are needed, got {self:?}"
            )));
        }
        // The mini network's widths go up to 2·width; name the flag before the network does.
        if self.width > 1 << 30 {
            return Err(TrainError::Config(format!(
                "width must be at most {}, got {}",
                1usize << 30,
                self.width
            )));
        }
        if self.steps > MAX_STEPS {
            return Err(TrainError::Config(format!(
                "steps must be at most {MAX_STEPS} (every step's loss and accuracy are kept \
                 for the summary), got {}",
                self.steps
            )));
        }
        if self.accum == 0 || self.accum > MAX_ACCUM {
            return Err(TrainError::Config(format!(
                "accum (micro-batches per optimizer step) must be in 1..={MAX_ACCUM}, got {}",
                self.accum
            )));
        }
        self.steps
            .checked_mul(self.accum)
            .and_then(|b| b.checked_mul(self.batch))
            .ok_or_else(|| TrainError::Config("steps × accum × batch overflows".into()))?;
        if self.ranks == 0 || self.ranks > 1024 {
            return Err(TrainError::Config(format!(
                "ranks must be in 1..=1024 (CPU ranks are threads), got {}",
                self.ranks
            )));
        }
        if let Some(max_norm) = self.clip_norm {
            if !(max_norm.is_finite() && max_norm > 0.0) {
                return Err(TrainError::Config(format!(
                    "clip-norm must be finite and > 0, got {max_norm}"
                )));
            }
        }
        if let Some(decay) = self.ema {
            if !(decay.is_finite() && (0.0..1.0).contains(&decay)) {
                return Err(TrainError::Config(format!(
                    "ema decay must be in [0, 1), got {decay}"
                )));
            }
        }
        if self.data_parallel() && self.drill.is_some() {
            return Err(TrainError::Config(
                "the fault drill runs on one rank; drop --ranks / --sync-bn".into(),
            ));
        }
        self.batch
            .checked_mul(self.ranks)
            .ok_or_else(|| TrainError::Config("ranks × batch overflows".into()))?;
        // The network itself: every layer's shape fits (the compiler says which does not).
        let spec = self.net.spec(self.channels, self.classes, self.width);
        cudnn_cbr::net::validate(&spec, self.batch, self.hw)?;
        Ok(())
    }

    /// Checks that the host can hold what the run allocates on it before anything is
    /// allocated: the synthetic dataset's class templates and one batch, and, for the CPU
    /// executor (`cpu_net`), every buffer of the network (FP16 storage, FP32 vectors) and as
    /// much again for the reference ops' working copies.
    ///
    /// # Errors
    /// [`TrainError::Config`] saying how much is needed and how much the host has available
    /// (from `/proc/meminfo`; where that cannot be read, nothing is checked).
    pub fn check_host_memory(&self, cpu_net: bool) -> Result<(), TrainError> {
        let image = self.hw as u128 * self.hw as u128 * self.channels as u128;
        // Templates are f32, batches f16 plus their f32 staging.
        let mut need = image * 4 * self.classes as u128 + image * 6 * self.batch as u128;
        if cpu_net {
            let net = compile_net(self, &net::cpu_policy(self))?;
            let buffers: u128 = net
                .buffers
                .iter()
                .map(|b| b.elems as u128 * b.dtype.size() as u128)
                .sum();
            // The reference ops' working copies (im2col, widened inputs, results before they
            // replace a buffer) take about as much again.
            // Every rank holds its own network.
            need += 2 * buffers * self.ranks.max(1) as u128;
        }
        match cudnn_cbr::amp::memory::host_memory_available() {
            Some(have) if need > u128::from(have) => Err(TrainError::Config(format!(
                "the run needs {:.1} GiB of host memory ({} network); the host has {:.1} GiB \
                 available",
                need as f64 / (1u64 << 30) as f64,
                if cpu_net { "with the" } else { "without the" },
                have as f64 / (1u64 << 30) as f64
            ))),
            _ => Ok(()),
        }
    }

    /// Whether the run is data-parallel (more than one rank, or synchronized BN).
    pub fn data_parallel(&self) -> bool {
        self.ranks > 1 || self.sync_bn
    }

    /// The SGD hyper-parameters of the run.
    pub fn sgd(&self) -> SgdConfig {
        SgdConfig {
            lr: self.lr,
            momentum: 0.9,
            weight_decay: 5e-4,
            nesterov: false,
        }
    }

    /// The amp step's configuration: [`TrainConfig::sgd`], with clipping by global norm,
    /// the EMA of the weights and gradient accumulation when asked.
    pub fn step_config(&self) -> StepConfig {
        let step = StepConfig::new(self.sgd());
        // validate() bounds accum by MAX_ACCUM, a u32; the fallback only keeps this total.
        let step = match self.accum {
            0 | 1 => step,
            n => step.with_accum(u32::try_from(n).unwrap_or(u32::MAX)),
        };
        let step = match self.clip_norm {
            Some(max_norm) => step.with_clip_norm(max_norm),
            None => step,
        };
        match self.ema {
            Some(decay) => step.with_ema(decay),
            None => step,
        }
    }
}

/// One progress report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Steps done.
    pub step: usize,
    /// Mean loss over the steps since the last report.
    pub loss: f32,
    /// Mean batch accuracy over the steps since the last report.
    pub accuracy: f32,
    /// Current loss scale.
    pub loss_scale: f32,
    /// Steps skipped for overflow so far.
    pub skipped: u32,
    /// Throughput since the start.
    pub images_per_sec: f64,
}

/// The executor kind that ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutorKind {
    /// The CPU reference executor.
    Cpu,
    /// The CUDA executor (cuDNN plans, NVRTC kernels).
    Cuda,
}

/// Which executor a [`Trainer`] runs, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorInfo {
    /// The executor.
    pub kind: ExecutorKind,
    /// Why this one: requested, or what `auto` found.
    pub reason: String,
    /// What it runs (on CUDA: the device, each layer's route, what is replayed as a graph).
    pub detail: String,
}

/// The outcome of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    /// Mean loss of the first 10 steps.
    pub first_loss: f32,
    /// Mean loss of the last 10 steps.
    pub last_loss: f32,
    /// Mean batch accuracy of the last 10 steps.
    pub last_accuracy: f32,
    /// Accuracy on 8 held-out batches with the trained weights: BN in evaluation mode (the
    /// running statistics) on every executor and route
    /// ([`TrainReport::held_out_eval_mode`] says so).
    pub held_out_accuracy: f32,
    /// Whether [`TrainReport::held_out_accuracy`] was measured with BN in evaluation mode.
    pub held_out_eval_mode: bool,
    /// With an EMA ([`TrainConfig::ema`]): the accuracy on the same held-out batches with
    /// the EMA weights (the FP16 copy E16 for the convs, E for BN and FC), BN in evaluation
    /// mode.
    pub held_out_ema_accuracy: Option<f32>,
    /// Steps skipped for overflow.
    pub skipped: u32,
    /// Final loss scale.
    pub loss_scale: f32,
    /// Training throughput.
    pub images_per_sec: f64,
    /// Each step's mean loss, in order.
    pub step_losses: Vec<f32>,
    /// The final FP32 master weights (region W).
    pub weights: MasterWeights,
    /// The executor that ran.
    pub executor: ExecutorInfo,
    /// Per step, when the run was a drill ([`TrainConfig::drill`]); empty otherwise.
    pub trace: Vec<StepTrace>,
    /// The steps done before this run (a resumed run's checkpoint step; 0 otherwise):
    /// [`TrainReport::step_losses`] are those of steps `start_step + 1 ..= steps`.
    pub start_step: usize,
    /// One point per step of this run ([`curves`]): always on the CPU executors; on CUDA when
    /// [`Trainer::record_curve`] asked for it (S's loss scale and learning rate copied on the
    /// device after every step, read back once at the end).
    pub curve: Vec<curves::CurvePoint>,
    /// The test set evaluated after each epoch of this run, where the data has epochs
    /// (CIFAR-10, one rank): BN in evaluation mode, trained and EMA weights.
    pub epochs: Vec<EpochEval>,
}

/// FNV-1a's 64-bit offset basis.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a's 64-bit prime.
pub(crate) const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// The test set after one epoch ([`TrainReport::epochs`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochEval {
    /// The epoch (1-based).
    pub epoch: usize,
    /// The step after which it ended (1-based, counted from the start of training).
    pub step: usize,
    /// Top-1 accuracy on the whole test set (the last batch wraps around to its first
    /// images) with the trained weights.
    pub accuracy: f32,
    /// The same with the EMA weights, when the run keeps an EMA.
    pub ema_accuracy: Option<f32>,
}

impl TrainReport {
    /// [`MasterWeights::hash`] of the final master weights.
    pub fn weights_hash(&self) -> u64 {
        self.weights.hash()
    }
}

/// FP32 master weights by parameter name (`stem.w`, `stem.gamma`, …, `fc.b`), in memory-plan
/// order. Its `Debug` output is a summary, not the values.
#[derive(Clone, Default, PartialEq)]
pub struct MasterWeights(pub Vec<(String, Vec<f32>)>);

impl MasterWeights {
    /// Every parameter of `plan`, in plan order, with the values `read` gives for it.
    pub(crate) fn read<E>(
        plan: &MemoryPlan,
        mut read: impl FnMut(&ParamInfo) -> Result<Vec<f32>, E>,
    ) -> Result<Self, E> {
        plan.params()
            .iter()
            .map(|p| Ok((p.name().to_owned(), read(p)?)))
            .collect::<Result<_, E>>()
            .map(MasterWeights)
    }

    /// The weights hash: FNV-1a (64-bit; offset basis `0xcbf29ce484222325`, prime
    /// `0x100000001b3`) over, for each parameter in memory-plan order, its name's UTF-8
    /// bytes, one zero byte, then every value's FP32 little-endian bytes in storage order
    /// (conv weights KRSC, as the master copy holds them). Equal hashes mean the same names,
    /// order and bits; any one byte that differs changes it (each FNV-1a round is a bijection
    /// of the state). `train_cbr` prints it as `weights hash <16 hex digits>`.
    pub fn hash(&self) -> u64 {
        let mut h = FNV_OFFSET;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
            }
        };
        for (name, values) in &self.0 {
            eat(name.as_bytes());
            eat(&[0]);
            for v in values {
                eat(&v.to_le_bytes());
            }
        }
        h
    }

    /// One parameter's values.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

impl fmt::Debug for MasterWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MasterWeights")
            .field("params", &self.0.len())
            .field("elems", &self.0.iter().map(|(_, v)| v.len()).sum::<usize>())
            .finish()
    }
}

/// The master weights both executors start from for `cfg` (its seed and shapes).
///
/// # Errors
/// [`TrainError::Config`] for a bad configuration.
pub fn initial_master_weights(cfg: &TrainConfig) -> Result<MasterWeights, TrainError> {
    cfg.validate()?;
    let (plan, init) = plan_and_initial_weights(cfg)?;
    MasterWeights::read(&plan, |p| {
        Ok(init
            .iter()
            .find(|(n, _)| n == p.name())
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| vec![0.0; p.elems()]))
    })
}

/// Errors of the training loop.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The amp layer refused something.
    #[error(transparent)]
    Amp(#[from] AmpError),
    /// The memory plan refused a registration.
    #[error(transparent)]
    Plan(#[from] cudnn_cbr::amp::PlanError),
    /// A CBR layer failed.
    #[error(transparent)]
    Fusion(#[from] cudnn_cbr::fusion::Error),
    /// The configuration cannot work.
    #[error("bad training configuration: {0}")]
    Config(String),
    /// No usable CUDA device (no driver library, no device, or it cannot be opened).
    #[error("no usable CUDA device: {reason}")]
    NoDevice {
        /// Why.
        reason: String,
    },
    /// cuDNN cannot be loaded.
    #[error("cuDNN not loadable: {reason}")]
    NoCudnn {
        /// The loader's account (the paths tried).
        reason: String,
    },
    /// NVRTC (needed for the amp kernels) cannot be loaded or compile them.
    #[error("NVRTC unusable: {reason}")]
    NoNvrtc {
        /// Why.
        reason: String,
    },
    /// A CUDA driver call of the training loop failed (a copy, a capture, a graph launch).
    #[error("CUDA driver call failed while trying to {what}: {message}")]
    Driver {
        /// What the loop was doing.
        what: String,
        /// The driver's error.
        message: String,
    },
    /// A layer has no route (fused, unfused or generic) on this device.
    #[error("layer `{layer}` has no cuDNN route on this device: {reason}")]
    NoRoute {
        /// The layer (its parameter prefix and shape).
        layer: String,
        /// cuDNN's account for both routes.
        reason: String,
    },
    /// The dataset cannot be read or does not fit the network.
    #[error(transparent)]
    Data(#[from] cifar::CifarError),
    /// A checkpoint cannot be saved or loaded.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The training curves cannot be written.
    #[error("cannot write the training curves to {path}: {message}")]
    Curves {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        message: String,
    },
}

impl TrainError {
    /// Whether the error says that the CUDA executor cannot run on this machine (no device,
    /// no cuDNN, no NVRTC, a layer without a route), as opposed to a failure while running.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            TrainError::NoDevice { .. }
                | TrainError::NoCudnn { .. }
                | TrainError::NoNvrtc { .. }
                | TrainError::NoRoute { .. }
        )
    }
}

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
        cfg.validate()?;
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
        let launch = launch_env()?;
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
        // Files are read on one rank: the CPU executor or the CUDA executor (whose batches
        // are made ahead on a CPU thread and copied on a stream of their own).
        if cfg.data != DataSource::Synthetic && (cfg.data_parallel() || launch.is_some()) {
            return Err(TrainError::Config(format!(
                "--data {} trains on one rank (the CPU or CUDA executor); drop --ranks / \
                 --sync-bn and the launcher",
                cfg.data
            )));
        }
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
    /// between) and after the last step. One rank only (CPU or CUDA executor). Makes the
    /// folder if needed and checks now that a file can be written there.
    ///
    /// # Errors
    /// [`TrainError::Config`] for a data-parallel run; [`TrainError::Checkpoint`] when the
    /// folder cannot hold the file.
    pub fn save_to(&mut self, path: &std::path::Path, every: usize) -> Result<(), TrainError> {
        self.one_rank("--save")?;
        checkpoint::check_writable(path)?;
        self.session.save = Some((path.to_path_buf(), every));
        Ok(())
    }

    /// Records a [`curves::CurvePoint`] per step on the CUDA executor too (the CPU executors
    /// always do): S's loss scale and learning rate are copied on the device behind every
    /// step and read back once at the end, so the step never waits for the host.
    pub fn record_curve(&mut self, on: bool) {
        self.session.curve = on;
    }

    fn one_rank(&self, what: &str) -> Result<(), TrainError> {
        if matches!(self.exec, Exec::CpuDataParallel(_)) || self.process_rank().1 > 1 {
            return Err(TrainError::Config(format!(
                "{what} works on one rank (the CPU or CUDA executor without --ranks, \
                 --sync-bn or a launcher)"
            )));
        }
        Ok(())
    }

    /// Loads a checkpoint of this run's network and data ([`checkpoint::load`]) into the
    /// executor: the run then trains from its step up to [`TrainConfig::steps`], on the
    /// batches that follow. Returns that step.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming what is wrong with the file; [`TrainError::Config`]
    /// for a data-parallel run or a checkpoint at or past `steps`; the executor's error.
    pub fn resume(&mut self, path: &std::path::Path) -> Result<usize, TrainError> {
        self.one_rank("--resume")?;
        let loaded = checkpoint::load(path, &self.cfg)?;
        let step = usize::try_from(loaded.step).unwrap_or(usize::MAX);
        if step >= self.cfg.steps {
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
            Exec::CpuDataParallel(_) => {
                return Err(TrainError::Config("--resume works on one rank".into()))
            }
        }
        self.session.start = step;
        Ok(step)
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
        progress: impl FnMut(&Progress),
    ) -> Result<TrainReport, TrainError> {
        match self.exec {
            Exec::Cpu(t) => t.run(every, progress, self.info, &self.session),
            Exec::CpuDataParallel(t) => t.run(every, progress, self.info),
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

/// Loss and accuracy of the steps since the last progress report (the CPU executors').
#[derive(Debug, Default)]
pub(crate) struct Window {
    loss: f32,
    accuracy: f32,
    n: usize,
}

impl Window {
    pub(crate) fn add(&mut self, m: HeadMetrics) {
        self.loss += m.loss;
        self.accuracy += m.accuracy;
        self.n += 1;
    }

    /// The report after `step` steps (`done` of them since `start`) of `images_per_step`
    /// images, with S's scale and skip count; empties the window.
    pub(crate) fn report(
        &mut self,
        step: usize,
        done: usize,
        images_per_step: usize,
        start: std::time::Instant,
        s: cudnn_cbr::amp::range::Scalars,
    ) -> Progress {
        let n = self.n.max(1) as f32;
        let p = Progress {
            step,
            loss: self.loss / n,
            accuracy: self.accuracy / n,
            loss_scale: s.loss_scale,
            skipped: s.skipped,
            images_per_sec: (done * images_per_step) as f64 / start.elapsed().as_secs_f64(),
        };
        *self = Window::default();
        p
    }
}

/// Held-out batches evaluated after training.
pub(crate) const HELD_OUT_BATCHES: u64 = 8;

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

/// The report's loss and accuracy fields from the per-step metrics.
pub(crate) fn summarize(steps: &[HeadMetrics]) -> (f32, f32, f32, Vec<f32>) {
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len().max(1) as f32;
    let losses: Vec<f32> = steps.iter().map(|m| m.loss).collect();
    let accs: Vec<f32> = steps.iter().map(|m| m.accuracy).collect();
    let head = &losses[..losses.len().min(10)];
    let tail = &losses[losses.len().saturating_sub(10)..];
    (
        mean(head),
        mean(tail),
        mean(&accs[accs.len().saturating_sub(10)..]),
        losses,
    )
}

impl From<cudnn_cbr::ClassifierError> for TrainError {
    fn from(e: cudnn_cbr::ClassifierError) -> Self {
        use cudnn_cbr::ClassifierError as C;
        match e {
            C::Fusion(e) => TrainError::Fusion(e),
            C::Amp(e) => cuda::amp_error(e),
            C::Net(e) => cuda::net_error(e),
            C::Driver { what, message } => TrainError::Driver { what, message },
            C::Input(m) | C::Config(m) => TrainError::Config(m),
            C::NoDevice { reason } => TrainError::NoDevice { reason },
            C::NoCudnn { reason } => TrainError::NoCudnn { reason },
            C::NoNvrtc { reason } => TrainError::NoNvrtc { reason },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weights_hash_is_fnv1a_over_names_and_le_bytes() {
        let w = MasterWeights(vec![("a".into(), vec![1.0]), ("b".into(), vec![])]);
        // By hand: FNV-1a of "a", 0, 1.0f32 LE (00 00 80 3f), "b", 0.
        let mut h = FNV_OFFSET;
        for b in [b'a', 0, 0, 0, 0x80, 0x3f, b'b', 0] {
            h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        assert_eq!(w.hash(), h);
        // One bit of one value, or the order, changes it.
        let flipped = MasterWeights(vec![
            ("a".into(), vec![f32::from_bits(1.0f32.to_bits() ^ 1)]),
            ("b".into(), vec![]),
        ]);
        assert_ne!(flipped.hash(), h);
        let swapped = MasterWeights(vec![("b".into(), vec![]), ("a".into(), vec![1.0])]);
        assert_ne!(swapped.hash(), h);
    }

    #[test]
    fn step_counts_and_widths_past_their_limits_are_named() {
        for (cfg, needle) in [
            (
                TrainConfig {
                    steps: MAX_STEPS + 1,
                    ..TrainConfig::default()
                },
                "steps must be at most 16777216",
            ),
            (
                TrainConfig {
                    steps: usize::MAX,
                    ..TrainConfig::default()
                },
                "steps must be at most",
            ),
            (
                TrainConfig {
                    width: 1 << 32,
                    ..TrainConfig::default()
                },
                "width must be at most",
            ),
            (
                TrainConfig {
                    hw: 1 << 31,
                    ..TrainConfig::default()
                },
                "`hw`",
            ),
            (
                TrainConfig {
                    clip_norm: Some(0.0),
                    ..TrainConfig::default()
                },
                "clip-norm must be finite and > 0, got 0",
            ),
            (
                TrainConfig {
                    clip_norm: Some(f32::NAN),
                    ..TrainConfig::default()
                },
                "clip-norm must be finite and > 0, got NaN",
            ),
        ] {
            let e = cfg.validate().unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        let last = TrainConfig {
            steps: MAX_STEPS,
            ..TrainConfig::default()
        };
        last.validate().unwrap();
    }
}
