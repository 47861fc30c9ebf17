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
//! scale and counters of S for readers, `weights_hash` ([`crate::MasterWeights::hash`]) and
//! `checksums`: a JSON object of each tensor's FNV-1a 64 over its bytes ([`checksum`]).
//!
//! **Writing** ([`save`]) goes through a temporary file in the same folder, `fsync`ed and
//! renamed over the target (then the folder is `fsync`ed): a reader sees the old file or the
//! new one, never half of one. Every value is checked first: a state with NaN or Inf is a
//! [`CheckpointError::NonFinite`] naming the tensor, and nothing is written.
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

use crate::{plan_and_initial_weights, TrainConfig, FNV_OFFSET, FNV_PRIME};
use cudnn_cbr::amp::plan::{MemoryPlan, ParamKind, Region};
use cudnn_cbr::amp::range::Scalars;
use cudnn_cbr::sys::DataType;
use half::f16;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

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

/// FNV-1a 64 of `bytes` (the per-tensor checksum in the `checksums` metadata field).
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// Torchvision's name for one of our parameters or running statistics (`stem.w` →
/// `conv1.weight`, `s1.b0.down.gamma` → `layer2.0.downsample.1.weight`, `fc.b` → `fc.bias`);
/// `None` for a name that is not one.
pub fn torch_name(ours: &str) -> Option<String> {
    match ours {
        "fc.w" => return Some("fc.weight".into()),
        "fc.b" => return Some("fc.bias".into()),
        _ => {}
    }
    let (layer, field) = ours.rsplit_once('.')?;
    let (conv, bn) = if layer == "stem" {
        ("conv1".to_string(), "bn1".to_string())
    } else {
        let mut it = layer.split('.');
        let stage: usize = it.next()?.strip_prefix('s')?.parse().ok()?;
        let block: usize = it.next()?.strip_prefix('b')?.parse().ok()?;
        let role = it.next()?;
        if it.next().is_some() {
            return None;
        }
        let base = format!("layer{}.{block}", stage.checked_add(1)?);
        match role {
            "down" => (
                format!("{base}.downsample.0"),
                format!("{base}.downsample.1"),
            ),
            r => {
                let n = r.strip_prefix("conv")?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                (format!("{base}.conv{n}"), format!("{base}.bn{n}"))
            }
        }
    };
    Some(match field {
        "w" => format!("{conv}.weight"),
        "gamma" => format!("{bn}.weight"),
        "beta" => format!("{bn}.bias"),
        "running_mean" | "running_var" => format!("{bn}.{field}"),
        _ => return None,
    })
}

/// KRSC (`[k, r, s, c]`) → OIHW (`[k, c, r, s]`).
pub fn krsc_to_oihw(v: &[f32], shape: [usize; 4]) -> Vec<f32> {
    let [k, r, s, c] = shape;
    let mut out = vec![0.0; v.len()];
    for ki in 0..k {
        for ri in 0..r {
            for si in 0..s {
                for ci in 0..c {
                    out[((ki * c + ci) * r + ri) * s + si] = v[((ki * r + ri) * s + si) * c + ci];
                }
            }
        }
    }
    out
}

/// OIHW (`[k, c, r, s]`) → KRSC (`[k, r, s, c]`); `shape` is the KRSC shape.
pub fn oihw_to_krsc(v: &[f32], shape: [usize; 4]) -> Vec<f32> {
    let [k, r, s, c] = shape;
    let mut out = vec![0.0; v.len()];
    for ki in 0..k {
        for ri in 0..r {
            for si in 0..s {
                for ci in 0..c {
                    out[((ki * r + ri) * s + si) * c + ci] = v[((ki * c + ci) * r + ri) * s + si];
                }
            }
        }
    }
    out
}

/// One tensor of the file: where it comes from in the state and how it is stored.
#[derive(Debug, Clone)]
struct Slot {
    name: String,
    dtype: Dtype,
    /// The file's shape (OIHW for conv weights).
    shape: Vec<usize>,
    what: What,
}

#[derive(Debug, Clone)]
enum What {
    /// A parameter's values in a region: elements `offset..offset + elems`; `krsc` when it is
    /// a conv weight stored transposed.
    Param {
        region: Region,
        offset: usize,
        elems: usize,
        krsc: Option<[usize; 4]>,
    },
    /// The S image.
    Scalars,
    /// A running statistic (buffer name).
    Running { buffer: String, var: bool },
    /// A BN layer's `num_batches_tracked`.
    Tracked,
}

fn prefix(r: Region) -> &'static str {
    match r {
        Region::M => "cbr.momentum.",
        Region::E => "cbr.ema.",
        Region::E16 => "cbr.ema16.",
        _ => "",
    }
}

/// Every tensor a checkpoint of `plan` with `running` statistics holds, in a fixed order.
fn slots(plan: &MemoryPlan, running: &[(String, usize)]) -> Result<Vec<Slot>, CheckpointError> {
    let unnamed = |n: &str| CheckpointError::Metadata {
        field: "tensor names".into(),
        reason: format!("`{n}` has no torchvision name"),
    };
    let mut out = Vec::new();
    for r in SAVED_REGIONS {
        if !plan.has_region(r) {
            continue;
        }
        if r == Region::S {
            out.push(Slot {
                name: SCALARS.into(),
                dtype: Dtype::U8,
                shape: vec![cudnn_cbr::amp::range::S_REGION_BYTES],
                what: What::Scalars,
            });
            continue;
        }
        for p in plan.params() {
            if !plan.lives_in(p, r) {
                continue;
            }
            let view = plan
                .view(p.name(), r)
                .map_err(|e| CheckpointError::Metadata {
                    field: "plan".into(),
                    reason: e.to_string(),
                })?;
            let torch = torch_name(p.name()).ok_or_else(|| unnamed(p.name()))?;
            let krsc = match (p.kind(), p.shape()) {
                (ParamKind::ConvWeight, &[k, rr, s, c]) => Some([k, rr, s, c]),
                _ => None,
            };
            let shape = match krsc {
                Some([k, rr, s, c]) => vec![k, c, rr, s],
                None => p.shape().to_vec(),
            };
            out.push(Slot {
                name: format!("{}{torch}", prefix(r)),
                dtype: if view.dtype == DataType::Half {
                    Dtype::F16
                } else {
                    Dtype::F32
                },
                shape,
                what: What::Param {
                    region: r,
                    offset: view.elem_offset(),
                    elems: view.elems,
                    krsc,
                },
            });
        }
    }
    for (buffer, elems) in running {
        let torch = torch_name(buffer).ok_or_else(|| unnamed(buffer))?;
        out.push(Slot {
            name: torch.clone(),
            dtype: Dtype::F32,
            shape: vec![*elems],
            what: What::Running {
                buffer: buffer.clone(),
                var: buffer.ends_with("running_var"),
            },
        });
        if let Some(bn) = torch.strip_suffix(".running_mean") {
            out.push(Slot {
                name: format!("{bn}.num_batches_tracked"),
                dtype: Dtype::I64,
                shape: vec![],
                what: What::Tracked,
            });
        }
    }
    Ok(out)
}

fn finite(tensor: &str, v: &[f32]) -> Result<(), CheckpointError> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(CheckpointError::NonFinite {
            tensor: tensor.into(),
            index,
            value: v[index],
        }),
        None => Ok(()),
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
        .collect()
}

fn f16s_as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|x| f16::from_le_bytes([x[0], x[1]]).to_f32())
        .collect()
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Checks the S image: it parses and its loss scale is finite and > 0.
fn check_scalars(bytes: &[u8]) -> Result<Scalars, CheckpointError> {
    let bad = |e: cudnn_cbr::amp::RangeOpError| CheckpointError::BadValue {
        tensor: SCALARS.into(),
        reason: e.to_string(),
    };
    let s = Scalars::from_bytes(bytes).map_err(bad)?;
    s.validate().map_err(bad)?;
    Ok(s)
}

/// The memory plan and the running statistics (name, elements) of `cfg`'s network.
fn layout(cfg: &TrainConfig) -> Result<(MemoryPlan, Vec<(String, usize)>), crate::TrainError> {
    let net = crate::compile_net(cfg, &crate::net::cpu_policy(cfg))?;
    let running = cudnn_cbr::net::cuda::running_stats(&net)
        .map(|id| (net.buffers[id].name.clone(), net.buffers[id].elems))
        .collect();
    let (plan, _) = plan_and_initial_weights(cfg)?;
    Ok((plan, running))
}

/// The most bytes a checkpoint of `cfg` may have: twice its tensors' bytes and 1 MiB for the
/// header (the header lists every tensor and the checksums; a few hundred bytes each).
///
/// # Errors
/// A configuration the network compiler refuses.
pub fn size_limit(cfg: &TrainConfig) -> Result<u64, crate::TrainError> {
    let (plan, running) = layout(cfg)?;
    let tensors: u64 = slots(&plan, &running)?
        .iter()
        .map(|s| (s.shape.iter().product::<usize>() * s.dtype.bitsize() / 8) as u64)
        .sum();
    Ok(tensors.saturating_mul(2).saturating_add(1 << 20))
}

/// The metadata fields that must equal this run's, and their values for `cfg`. `accum`
/// (micro-batches per step) only when above 1, so that a file without it (one batch per
/// step, or written before gradient accumulation existed) reads as 1.
fn run_fields(cfg: &TrainConfig) -> Vec<(&'static str, String)> {
    let mut fields = vec![
        ("net", cfg.net.to_string()),
        ("width", cfg.width.to_string()),
        ("channels", cfg.channels.to_string()),
        ("classes", cfg.classes.to_string()),
        ("hw", cfg.hw.to_string()),
        ("batch", cfg.batch.to_string()),
        ("seed", cfg.seed.to_string()),
        ("data", cfg.data.to_string()),
    ];
    if cfg.accum > 1 {
        fields.push(("accum", cfg.accum.to_string()));
    }
    fields
}

/// Saves `state` after `step` training steps of `cfg` to `path`, atomically (module docs).
/// `routes` describes each layer's route (metadata only).
///
/// # Errors
/// [`CheckpointError::NonFinite`] / [`CheckpointError::BadValue`] for a state that must not
/// be saved, [`CheckpointError::Write`] when the file system refuses; in every case an
/// existing file at `path` is untouched.
pub fn save(
    path: &Path,
    cfg: &TrainConfig,
    state: &TrainState,
    step: u64,
    routes: &str,
) -> Result<(), crate::TrainError> {
    let (plan, running) = layout(cfg)?;
    let slots = slots(&plan, &running)?;
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(slots.len());
    let mut scalars = None;
    let mut weights = Vec::new();
    for slot in &slots {
        let bytes = match &slot.what {
            What::Param {
                region,
                offset,
                elems,
                krsc,
            } => {
                let size = region.dtype().map_or(4, |d| d.size());
                let image =
                    state
                        .region(*region)
                        .ok_or_else(|| CheckpointError::MissingTensor {
                            tensor: format!("region {region} of the state ({})", slot.name),
                        })?;
                let raw = image
                    .get(offset * size..(offset + elems) * size)
                    .ok_or_else(|| CheckpointError::BadValue {
                        tensor: slot.name.clone(),
                        reason: format!("region {region}'s image is too short"),
                    })?;
                if size == 2 {
                    finite(&slot.name, &f16s_as_f32(raw))?;
                    raw.to_vec()
                } else {
                    let v = f32s(raw);
                    finite(&slot.name, &v)?;
                    if *region == Region::W {
                        weights.push(v.clone());
                    }
                    match krsc {
                        Some(shape) => le_bytes(&krsc_to_oihw(&v, *shape)),
                        None => raw.to_vec(),
                    }
                }
            }
            What::Scalars => {
                let b = state.region(Region::S).unwrap_or_default();
                scalars = Some(check_scalars(b)?);
                b.to_vec()
            }
            What::Running { buffer, var } => {
                let v = state
                    .running
                    .iter()
                    .find(|(n, _)| n == buffer)
                    .map(|(_, v)| v.as_slice())
                    .ok_or_else(|| CheckpointError::MissingTensor {
                        tensor: slot.name.clone(),
                    })?;
                if v.len() != slot.shape[0] {
                    return Err(CheckpointError::Shape {
                        tensor: slot.name.clone(),
                        want: slot.shape.clone(),
                        got: vec![v.len()],
                    }
                    .into());
                }
                finite(&slot.name, v)?;
                if *var {
                    if let Some(i) = v.iter().position(|x| *x < 0.0) {
                        return Err(CheckpointError::BadValue {
                            tensor: slot.name.clone(),
                            reason: format!("negative variance {} at element {i}", v[i]),
                        }
                        .into());
                    }
                }
                le_bytes(v)
            }
            What::Tracked => (step as i64).to_le_bytes().to_vec(),
        };
        tensors.push((slot.name.clone(), slot.dtype, slot.shape.clone(), bytes));
    }
    let s = scalars.ok_or_else(|| CheckpointError::MissingTensor {
        tensor: SCALARS.into(),
    })?;
    let hash = crate::MasterWeights(
        plan.params()
            .iter()
            .map(|p| p.name().to_owned())
            .zip(weights)
            .collect(),
    )
    .hash();
    let checksums: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .map(|(n, _, _, b)| (n.clone(), format!("{:016x}", checksum(b)).into()))
        .collect();
    let mut meta: HashMap<String, String> = run_fields(cfg)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    meta.extend([
        ("format".to_string(), FORMAT.to_string()),
        ("version".to_string(), VERSION.to_string()),
        ("step".to_string(), step.to_string()),
        ("lr".to_string(), cfg.lr.to_string()),
        ("fused".to_string(), cfg.fused.to_string()),
        ("routes".to_string(), routes.to_string()),
        ("loss_scale".to_string(), s.loss_scale.to_string()),
        ("applied_steps".to_string(), s.step.to_string()),
        ("skipped_steps".to_string(), s.skipped.to_string()),
        ("weights_hash".to_string(), format!("{hash:016x}")),
        (
            "conv_layout".to_string(),
            "OIHW (torchvision); the trainer's master copy is KRSC".to_string(),
        ),
        (
            "checksums".to_string(),
            serde_json::Value::Object(checksums).to_string(),
        ),
    ]);
    let views = tensors
        .iter()
        .map(|(n, d, shape, b)| {
            safetensors::tensor::TensorView::new(*d, shape.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| CheckpointError::BadValue {
                    tensor: n.clone(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| CheckpointError::Write {
        path: path.into(),
        what: "serialize",
        message: e.to_string(),
    })?;
    write_atomic(path, &bytes)?;
    Ok(())
}

/// Makes `path`'s folder if needed and checks that a temporary file can be made in it, so
/// that a run that is to save finds out before it trains rather than after.
///
/// # Errors
/// [`CheckpointError::Write`] naming what failed.
pub fn check_writable(path: &Path) -> Result<(), CheckpointError> {
    let err = |what: &'static str, e: std::io::Error| CheckpointError::Write {
        path: path.into(),
        what,
        message: e.to_string(),
    };
    let (dir, tmp) = temporary(path).map_err(|e| err("name a file", e))?;
    std::fs::create_dir_all(&dir).map_err(|e| err("make its folder", e))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| err("create a temporary file next to it", e))?;
    std::fs::remove_file(&tmp).map_err(|e| err("remove the temporary file", e))
}

/// `path`'s folder and the temporary file a save writes first.
fn temporary(path: &Path) -> std::io::Result<(PathBuf, PathBuf)> {
    let name = path.file_name().ok_or(std::io::ErrorKind::InvalidInput)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp.{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    Ok((dir, tmp))
}

/// Writes `bytes` to a temporary file next to `path`, `fsync`s it, renames it over `path`
/// and `fsync`s the folder. On failure the temporary file is removed and `path` untouched.
///
/// # Errors
/// [`CheckpointError::Write`] naming the step that failed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let err = |what: &'static str, e: std::io::Error| CheckpointError::Write {
        path: path.into(),
        what,
        message: e.to_string(),
    };
    let (dir, tmp) = temporary(path).map_err(|e| err("name a file", e))?;
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| err("create the temporary file", e))?;
        f.write_all(bytes)
            .map_err(|e| err("write the temporary file", e))?;
        f.sync_all()
            .map_err(|e| err("fsync the temporary file", e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| err("rename the temporary file", e))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    // The rename is durable once the folder is; a folder that cannot be opened for this
    // (some file systems) leaves the file written, so this is best effort.
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Loads and checks a checkpoint for `cfg`'s run (module docs for the checks).
///
/// # Errors
/// A [`CheckpointError`] naming the file, field or tensor.
pub fn load(path: &Path, cfg: &TrainConfig) -> Result<Loaded, crate::TrainError> {
    let (plan, running) = layout(cfg)?;
    let slots = slots(&plan, &running)?;
    let limit = size_limit(cfg)?;
    let bytes = cudnn_cbr::runtime::untrusted::read_regular(path, limit).map_err(|p| {
        CheckpointError::File {
            path: path.into(),
            problem: p.to_string(),
        }
    })?;
    let format = |e: safetensors::SafeTensorError| CheckpointError::Format {
        path: path.into(),
        reason: e.to_string(),
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(format)?;
    let file = SafeTensors::deserialize(&bytes).map_err(format)?;
    let meta = Meta(
        header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
    );
    let field = |f: &str| -> Result<&str, CheckpointError> {
        meta.get(f).ok_or_else(|| CheckpointError::Metadata {
            field: f.into(),
            reason: "missing".into(),
        })
    };
    if field("format")? != FORMAT {
        return Err(CheckpointError::Metadata {
            field: "format".into(),
            reason: format!("`{}`, expected `{FORMAT}`", field("format")?),
        }
        .into());
    }
    if field("version")? != VERSION.to_string() {
        return Err(CheckpointError::Metadata {
            field: "version".into(),
            reason: format!("{}, this build reads version {VERSION}", field("version")?),
        }
        .into());
    }
    // A file of an accumulating run, loaded by a run that does not accumulate.
    if let (Some(file), 1) = (meta.get("accum"), cfg.accum) {
        return Err(CheckpointError::OtherRun {
            field: "accum".into(),
            file: file.into(),
            run: "1".into(),
        }
        .into());
    }
    for (f, run) in run_fields(cfg) {
        let got = match (f, meta.get(f)) {
            // Written without it: one micro-batch per step.
            ("accum", None) => "1",
            _ => field(f)?,
        };
        if got != run {
            return Err(CheckpointError::OtherRun {
                field: f.into(),
                file: got.into(),
                run,
            }
            .into());
        }
    }
    let step: u64 = field("step")?
        .parse()
        .map_err(|e| CheckpointError::Metadata {
            field: "step".into(),
            reason: format!("not a step count: {e}"),
        })?;
    let sums = cudnn_cbr::runtime::untrusted::parse_strict_json(field("checksums")?)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .ok_or_else(|| CheckpointError::Metadata {
            field: "checksums".into(),
            reason: "not a JSON object".into(),
        })?;
    // Names: exactly the network's.
    let names: std::collections::BTreeSet<&str> = file.names().into_iter().collect();
    for s in &slots {
        if !names.contains(s.name.as_str()) {
            return Err(CheckpointError::MissingTensor {
                tensor: s.name.clone(),
            }
            .into());
        }
    }
    if let Some(extra) = names.iter().find(|n| !slots.iter().any(|s| s.name == **n)) {
        return Err(CheckpointError::UnexpectedTensor {
            tensor: (*extra).into(),
        }
        .into());
    }
    // Dtypes and shapes, then checksums, then values.
    let mut views = Vec::with_capacity(slots.len());
    for s in &slots {
        let v = file.tensor(&s.name).map_err(format)?;
        if v.dtype() != s.dtype {
            return Err(CheckpointError::Dtype {
                tensor: s.name.clone(),
                want: s.dtype.to_string(),
                got: v.dtype().to_string(),
            }
            .into());
        }
        if v.shape() != s.shape.as_slice() {
            return Err(CheckpointError::Shape {
                tensor: s.name.clone(),
                want: s.shape.clone(),
                got: v.shape().to_vec(),
            }
            .into());
        }
        views.push(v);
    }
    for (s, v) in slots.iter().zip(&views) {
        let want = sums
            .get(&s.name)
            .and_then(|x| x.as_str())
            .and_then(|x| u64::from_str_radix(x, 16).ok())
            .ok_or_else(|| CheckpointError::Metadata {
                field: "checksums".into(),
                reason: format!("no checksum for `{}`", s.name),
            })?;
        let got = checksum(v.data());
        if got != want {
            return Err(CheckpointError::Checksum {
                tensor: s.name.clone(),
                want,
                got,
            }
            .into());
        }
    }
    let mut regions: Vec<(Region, Vec<u8>)> = Vec::new();
    for r in SAVED_REGIONS {
        if plan.has_region(r) {
            let len = plan
                .region_range(r)
                .map_err(|e| CheckpointError::Metadata {
                    field: "plan".into(),
                    reason: e.to_string(),
                })?;
            regions.push((r, vec![0u8; len.len()]));
        }
    }
    let mut state = TrainState {
        regions,
        running: Vec::new(),
    };
    for (s, v) in slots.iter().zip(&views) {
        let data = v.data();
        match &s.what {
            What::Param {
                region,
                offset,
                elems,
                krsc,
            } => {
                let (size, bytes) = if s.dtype == Dtype::F16 {
                    finite(&s.name, &f16s_as_f32(data))?;
                    (2, data.to_vec())
                } else {
                    let v = f32s(data);
                    finite(&s.name, &v)?;
                    match krsc {
                        Some(shape) => (4, le_bytes(&oihw_to_krsc(&v, *shape))),
                        None => (4, data.to_vec()),
                    }
                };
                let at = offset * size..(offset + elems) * size;
                match state.region_mut(*region).and_then(|img| img.get_mut(at)) {
                    Some(dst) if dst.len() == bytes.len() => dst.copy_from_slice(&bytes),
                    _ => {
                        return Err(CheckpointError::Shape {
                            tensor: s.name.clone(),
                            want: vec![*elems],
                            got: vec![bytes.len() / size],
                        }
                        .into())
                    }
                }
            }
            What::Scalars => {
                check_scalars(data)?;
                if let Some(img) = state.region_mut(Region::S) {
                    img.copy_from_slice(data);
                }
            }
            What::Running { buffer, var } => {
                let v = f32s(data);
                finite(&s.name, &v)?;
                if *var {
                    if let Some(i) = v.iter().position(|x| *x < 0.0) {
                        return Err(CheckpointError::BadValue {
                            tensor: s.name.clone(),
                            reason: format!("negative variance {} at element {i}", v[i]),
                        }
                        .into());
                    }
                }
                state.running.push((buffer.clone(), v));
            }
            What::Tracked => {}
        }
    }
    Ok(Loaded { state, step, meta })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_torchvisions() {
        for (ours, theirs) in [
            ("stem.w", "conv1.weight"),
            ("stem.gamma", "bn1.weight"),
            ("stem.beta", "bn1.bias"),
            ("stem.running_mean", "bn1.running_mean"),
            ("s0.b0.conv1.w", "layer1.0.conv1.weight"),
            ("s0.b1.conv2.gamma", "layer1.1.bn2.weight"),
            ("s3.b2.conv3.running_var", "layer4.2.bn3.running_var"),
            ("s1.b0.down.w", "layer2.0.downsample.0.weight"),
            ("s1.b0.down.beta", "layer2.0.downsample.1.bias"),
            ("fc.w", "fc.weight"),
            ("fc.b", "fc.bias"),
        ] {
            assert_eq!(torch_name(ours).as_deref(), Some(theirs), "{ours}");
        }
        for bad in [
            "stem",
            "s0.b0.conv1.x",
            "s0.conv1.w",
            "sx.b0.conv1.w",
            "s0.b0.convx.w",
        ] {
            assert_eq!(torch_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn conv_weights_round_trip_through_oihw() {
        let shape = [3, 2, 5, 4];
        let v: Vec<f32> = (0..3 * 2 * 5 * 4).map(|i| i as f32).collect();
        let o = krsc_to_oihw(&v, shape);
        // Element (k=2, r=1, s=3, c=1): KRSC index ((2·2+1)·5+3)·4+1 = 113; OIHW index
        // ((2·4+1)·2+1)·5+3 = 98.
        assert_eq!(o[98], v[113]);
        assert_ne!(o, v);
        assert_eq!(oihw_to_krsc(&o, shape), v);
    }

    #[test]
    fn checksums_see_every_byte() {
        let a = checksum(b"abcd");
        assert_ne!(a, checksum(b"abce"));
        assert_ne!(a, checksum(b"abc"));
        assert_eq!(checksum(b""), FNV_OFFSET);
    }
}
