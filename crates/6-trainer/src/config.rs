//! What a run trains: the executor choice ([`Device`]), the configuration ([`TrainConfig`]:
//! network, data, optimizer, schedule, captures, checkpoints) and the reliability drill
//! ([`FaultDrill`], [`StepTrace`]).

use crate::net::{self, compile_net};
use crate::{DataSource, LrSchedule, TrainError};
use cudnn_cbr::amp::range::SgdConfig;
use cudnn_cbr::amp::step::StepConfig;
use cudnn_cbr::net::Arena;
use cudnn_cbr::net::Preset;
use std::str::FromStr;

/// Which executor trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// CUDA when a device, cuDNN and NVRTC are usable and every layer has a route; the CPU
    /// reference executor otherwise, with the reason in [`ExecutorInfo::reason`](crate::ExecutorInfo::reason).
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

/// What the CUDA executor replays from CUDA graphs after [`cuda::WARMUP_STEPS`](crate::cuda::WARMUP_STEPS) eager steps
/// (the CPU executor ignores it): the library engine's capture mode.
use cudnn_cbr::classifier::CudaGraphMode;

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
    /// Learning rate (the base rate of [`TrainConfig::lr_schedule`]).
    pub lr: f32,
    /// How the learning rate follows the steps after the warmup ([`TrainConfig::lr_at`]).
    pub lr_schedule: LrSchedule,
    /// Steps of linear learning-rate warmup (0: none; a warmup longer than the run ends with
    /// the run, as when a run trains a first slice of a longer schedule).
    pub warmup: usize,
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
    /// how the step handles them ([`TrainReport::trace`](crate::TrainReport::trace)).
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
    /// ([`TrainReport::held_out_ema_accuracy`](crate::TrainReport::held_out_ema_accuracy)). Every executor (on CUDA the update runs in
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
            lr_schedule: LrSchedule::Constant,
            warmup: 0,
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

    /// The learning rate of optimizer step `step` (0-based, counted from the start of
    /// training): [`crate::schedule::lr_at`] of this run's rate, schedule, warmup and steps.
    pub fn lr_at(&self, step: usize) -> f32 {
        crate::schedule::lr_at(self.lr, self.lr_schedule, self.warmup, self.steps, step)
    }

    /// Whether the rate changes from step to step (a schedule other than constant, or a
    /// warmup): the executors then write each step's rate before it.
    pub fn schedules_lr(&self) -> bool {
        self.lr_schedule != LrSchedule::Constant || self.warmup > 0
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

#[cfg(test)]
mod tests {
    use super::*;

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
