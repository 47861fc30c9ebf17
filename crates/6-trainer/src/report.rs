//! What a run reports: progress lines ([`Progress`]), the executor that ran
//! ([`ExecutorInfo`]), the outcome ([`TrainReport`], [`EpochEval`]) and the FP32 master
//! weights with their hash ([`MasterWeights`]).

use crate::{curves, plan_and_initial_weights, StepTrace, TrainConfig, TrainError};
use cudnn_cbr::amp::plan::{MemoryPlan, ParamInfo};
use std::fmt;

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

/// Which executor a [`Trainer`](crate::Trainer) runs, and why.
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
    /// [`Trainer::record_curve`](crate::Trainer::record_curve) asked for it (S's loss scale and learning rate copied on the
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

/// What [`Trainer::evaluate`](crate::Trainer::evaluate) measured, BN in evaluation mode,
/// weights and statistics untouched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// Top-1 accuracy on the held-out batches a training run's summary measures
    /// ([`TrainReport::held_out_accuracy`]) with the trained weights.
    pub held_out_accuracy: f32,
    /// The same with the EMA weights, when the run keeps an EMA.
    pub held_out_ema_accuracy: Option<f32>,
    /// Top-1 accuracy on the whole test set, where the data has one (CIFAR-10), with the
    /// trained and the EMA weights.
    pub test_set: Option<(f32, Option<f32>)>,
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
}
