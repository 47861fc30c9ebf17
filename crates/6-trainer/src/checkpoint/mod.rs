//! Checkpoints: the whole training state in one [safetensors] file, with tensors named as
//! torchvision names a ResNet's, so that other tools read the weights.
//!
//! **What is saved.** Per parameter, from the amp regions:
//!
//! | region | tensor name | dtype |
//! |--------|-------------|-------|
//! | W (FP32 master weights) | torchvision's: `conv1.weight`, `bn1.weight`, `bn1.bias`, `layer1.0.conv1.weight`, `layer1.0.bn1.weight`, `layer2.0.downsample.0.weight`, `layer2.0.downsample.1.bias`, `fc.weight`, `fc.bias` | F32 |
//! | M (SGD momentum) | `cbr.momentum.` + the weight's name | F32 |
//! | E (EMA), when the plan has it | `cbr.ema.` + the weight's name | F32 |
//! | E16 (FP16 EMA copy), when the plan has it | `cbr.ema16.` + the weight's name | F16 |
//! | S (loss scale, overflow flag, growth tracker, step and skip counters, SGD values, ranks) | `cbr.scalars`, its 256-byte image ([`cudnn_cbr::amp::range::Scalars`], whose module documents the layout) | U8 |
//!
//! and each BN layer's `running_mean`, `running_var` (F32) and `num_batches_tracked` (I64,
//! shape `[]`: the training steps done) under the BN's torchvision name (`bn1.running_mean`,
//! `layer1.0.bn2.running_var`, `layer2.0.downsample.1.num_batches_tracked`). Our names map as
//! `stem` → `conv1`/`bn1`, `s{i}.b{j}.conv{n}` → `layer{i+1}.{j}.conv{n}`/`bn{n}`,
//! `s{i}.b{j}.down` → `layer{i+1}.{j}.downsample.0`/`.1`, `fc.w`/`fc.b` → `fc.weight`/`fc.bias`.
//! Conv weights (and their momentum and EMA) are stored OIHW as torchvision holds them; the
//! master copy is KRSC (NHWC filters), so they are transposed on save and back on load.
//! A (the FP16 compute copy) is not saved: it is `f16(W)`, remade on load; G and G16 are
//! zeroed at the start of every step.
//!
//! The metadata record ([`Meta`]): `format`, `version`, the network (`net`, `width`,
//! `channels`, `classes`), `batch`, `hw`, `seed`, `data`, `lr`, `fused`, `step` (the data
//! position: the next training batch's index; every batch, synthetic or CIFAR-10 with its
//! shuffle and augmentation, is a pure function of the seed and its index, so the seed and
//! the position are the whole data and RNG state), `routes` (each layer's route), the loss
//! scale and counters of S for readers, `weights_hash` ([`crate::MasterWeights::hash`]),
//! `accum` and `ranks` (micro-batches per step and the data-parallel group's size, each only
//! when above 1; [`save_in_group`], [`load_in_group`]) and `checksums`: a JSON object of each
//! tensor's FNV-1a 64 over its bytes ([`checksum`]).
//!
//! **Writing** ([`save`]) goes through a temporary file in the same folder, `fsync`ed and
//! renamed over the target (then the folder is `fsync`ed): a reader sees the old file or the
//! new one, never half of one. Every value is checked first: a state with NaN or Inf is a
//! [`CheckpointError::NonFinite`] naming the tensor, and nothing is written. The header's
//! keys are sorted, so the same state saves as the same bytes.
//!
//! **Reading** ([`load`]) treats the file as untrusted: a regular file only, at most
//! [`size_limit`] bytes; then, in this order, the format and version, the network and run
//! ([`CheckpointError::OtherRun`]), the tensor names (missing or unexpected), each tensor's
//! dtype and shape, each tensor's checksum (a flipped byte is
//! [`CheckpointError::Checksum`] naming the tensor), and the values: NaN or Inf anywhere, a
//! negative running variance, or a loss scale that is NaN, infinite or ≤ 0. Each failure is a
//! typed [`CheckpointError`] naming the tensor or field.
//!
//! [safetensors]: https://github.com/huggingface/safetensors

mod layout;
mod names;
mod read;
mod write;

pub use layout::size_limit;
pub use names::{checksum, krsc_to_oihw, oihw_to_krsc, torch_name};
pub use read::{load, load_in_group};
pub use write::{check_writable, save, save_in_group, write_atomic};

use crate::TrainError;
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::classifier::{Backend, Classifier};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The `format` metadata value.
pub const FORMAT: &str = "cudnn-cbr-trainer-checkpoint";
/// The `version` metadata value this build writes and reads.
pub const VERSION: u32 = 1;
/// The S image's tensor name.
pub const SCALARS: &str = "cbr.scalars";

/// Why a checkpoint was not saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file cannot be read (not found, not a regular file, too large, I/O).
    #[error("checkpoint {path}: {problem}")]
    File {
        /// The path.
        path: PathBuf,
        /// Why.
        problem: String,
    },
    /// Writing failed; an existing file at the path is untouched.
    #[error("checkpoint {path}: cannot {what}: {message} (any existing file is untouched)")]
    Write {
        /// The path.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The operating system's error.
        message: String,
    },
    /// Not a safetensors file, or a truncated one.
    #[error("checkpoint {path}: not a whole safetensors file: {reason}")]
    Format {
        /// The path.
        path: PathBuf,
        /// The parser's account.
        reason: String,
    },
    /// A metadata field is missing or not what this build writes.
    #[error("checkpoint metadata `{field}`: {reason}")]
    Metadata {
        /// The field.
        field: String,
        /// Why.
        reason: String,
    },
    /// The checkpoint is of another network or run.
    #[error("checkpoint of another run: its `{field}` is {file}, this run's is {run}")]
    OtherRun {
        /// The field (`net`, `width`, `batch`, …).
        field: String,
        /// The file's value.
        file: String,
        /// This run's value.
        run: String,
    },
    /// A tensor the network needs is absent.
    #[error("checkpoint tensor `{tensor}` is missing")]
    MissingTensor {
        /// Its name.
        tensor: String,
    },
    /// A tensor this network does not have.
    #[error("checkpoint tensor `{tensor}` is not part of this network's state")]
    UnexpectedTensor {
        /// Its name.
        tensor: String,
    },
    /// A tensor of the wrong dtype.
    #[error("checkpoint tensor `{tensor}` is {got}, expected {want}")]
    Dtype {
        /// Its name.
        tensor: String,
        /// The dtype expected.
        want: String,
        /// The file's.
        got: String,
    },
    /// A tensor of the wrong shape.
    #[error("checkpoint tensor `{tensor}` has shape {got:?}, expected {want:?}")]
    Shape {
        /// Its name.
        tensor: String,
        /// The shape expected.
        want: Vec<usize>,
        /// The file's.
        got: Vec<usize>,
    },
    /// A tensor's bytes do not match the checksum recorded for it.
    #[error("checkpoint tensor `{tensor}`: checksum {got:016x} differs from the recorded {want:016x} (the file was altered or damaged)")]
    Checksum {
        /// Its name.
        tensor: String,
        /// Recorded.
        want: u64,
        /// Computed.
        got: u64,
    },
    /// NaN or Inf in the state (saving or loading).
    #[error("checkpoint tensor `{tensor}` holds {value} at element {index}")]
    NonFinite {
        /// Its name.
        tensor: String,
        /// The first bad element.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A value out of its range (a negative running variance, a bad loss scale).
    #[error("checkpoint tensor `{tensor}`: {reason}")]
    BadValue {
        /// Its name.
        tensor: String,
        /// Why.
        reason: String,
    },
}

/// The training state a checkpoint holds, as the executors hold it.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainState {
    /// The images of regions W, M, E and E16 (those the plan has) and S, padding included,
    /// as [`cudnn_cbr::amp::step::CpuRegions::region_bytes`] gives them.
    pub regions: Vec<(Region, Vec<u8>)>,
    /// Every BN layer's running statistics by buffer name (`stem.running_mean`, …).
    pub running: Vec<(String, Vec<f32>)>,
}

/// The regions a checkpoint keeps, in the order they are restored (W first: A and the EMA
/// are remade from it, then the EMA is overwritten with its own saved values).
pub const SAVED_REGIONS: [Region; 5] = [Region::W, Region::M, Region::E, Region::E16, Region::S];

impl TrainState {
    /// What a checkpoint saves of `model`, on either backend: the images of
    /// [`SAVED_REGIONS`] that its plan has, in that order, and its running statistics (on a
    /// GPU downloaded, blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn of<B: Backend>(model: &Classifier<B>) -> Result<Self, TrainError> {
        Ok(TrainState {
            running: model.running_stats()?,
            regions: model.region_images(&SAVED_REGIONS)?,
        })
    }

    /// Restores this state into `model` (and waits for it): W, then A and the EMA made from
    /// it, then M, E, E16, S (with the model's SGD values) and the running statistics
    /// ([`Classifier::load_state`]).
    ///
    /// # Errors
    /// A state of another network; a driver error.
    pub fn load_into<B: Backend>(&self, model: &mut Classifier<B>) -> Result<(), TrainError> {
        Ok(model.load_state(&self.regions, &self.running)?)
    }

    /// One region's image.
    pub fn region(&self, r: Region) -> Option<&[u8]> {
        self.regions
            .iter()
            .find(|(x, _)| *x == r)
            .map(|(_, b)| b.as_slice())
    }

    /// Region `r`'s image, mutable.
    pub fn region_mut(&mut self, r: Region) -> Option<&mut Vec<u8>> {
        self.regions
            .iter_mut()
            .find(|(x, _)| *x == r)
            .map(|(_, b)| b)
    }
}

/// The metadata record of a checkpoint (all values are strings in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta(pub BTreeMap<String, String>);

impl Meta {
    /// A field's value.
    pub fn get(&self, field: &str) -> Option<&str> {
        self.0.get(field).map(String::as_str)
    }

    /// The data position: training steps done (the next step's index; its first batch is
    /// `step · accum`).
    pub fn step(&self) -> Option<u64> {
        self.get("step")?.parse().ok()
    }
}

/// A loaded checkpoint.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The state, in the executors' layout.
    pub state: TrainState,
    /// Training steps done (the data position).
    pub step: u64,
    /// The metadata record.
    pub meta: Meta,
}
