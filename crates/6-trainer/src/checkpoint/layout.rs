//! What a file holds for a run: one slot per tensor of the plan's saved regions and the
//! running statistics, the value checks, the size limit and the fields that must match.

use super::names::torch_name;
use super::{CheckpointError, SAVED_REGIONS, SCALARS};
use crate::{plan_and_initial_weights, TrainConfig};
use cudnn_cbr::amp::plan::{MemoryPlan, ParamKind, Region};
use cudnn_cbr::amp::range::Scalars;
use cudnn_cbr::runtime::DataType;
use half::f16;
use safetensors::Dtype;

/// One tensor of the file: where it comes from in the state and how it is stored.
#[derive(Debug, Clone)]
pub(super) struct Slot {
    pub(super) name: String,
    pub(super) dtype: Dtype,
    /// The file's shape (OIHW for conv weights).
    pub(super) shape: Vec<usize>,
    pub(super) what: What,
}

#[derive(Debug, Clone)]
pub(super) enum What {
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

pub(super) fn prefix(r: Region) -> &'static str {
    match r {
        Region::M => "cbr.momentum.",
        Region::E => "cbr.ema.",
        Region::E16 => "cbr.ema16.",
        _ => "",
    }
}

/// Every tensor a checkpoint of `plan` with `running` statistics holds, in a fixed order.
pub(super) fn slots(
    plan: &MemoryPlan,
    running: &[(String, usize)],
) -> Result<Vec<Slot>, CheckpointError> {
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

pub(super) fn finite(tensor: &str, v: &[f32]) -> Result<(), CheckpointError> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(CheckpointError::NonFinite {
            tensor: tensor.into(),
            index,
            value: v[index],
        }),
        None => Ok(()),
    }
}

pub(super) fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
        .collect()
}

pub(super) fn f16s_as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|x| f16::from_le_bytes([x[0], x[1]]).to_f32())
        .collect()
}

pub(super) fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Checks the S image: it parses and its loss scale is finite and > 0.
pub(super) fn check_scalars(bytes: &[u8]) -> Result<Scalars, CheckpointError> {
    let bad = |e: cudnn_cbr::amp::RangeOpError| CheckpointError::BadValue {
        tensor: SCALARS.into(),
        reason: e.to_string(),
    };
    let s = Scalars::from_bytes(bytes).map_err(bad)?;
    s.validate().map_err(bad)?;
    Ok(s)
}

/// The memory plan and the running statistics (name, elements) of `cfg`'s network.
pub(super) fn layout(
    cfg: &TrainConfig,
) -> Result<(MemoryPlan, Vec<(String, usize)>), crate::TrainError> {
    let net = crate::compile_net(cfg, &crate::net::cpu_policy(cfg))?;
    let running = cudnn_cbr::net::running_stats(&net)
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

/// The metadata fields that must equal this run's, and their values for `cfg` trained by
/// `ranks` data-parallel ranks. `accum` (micro-batches per step) and `ranks` only when above
/// 1, so that a file without them (one batch per step on one rank, or written before either
/// existed) reads as 1.
pub(super) fn run_fields(cfg: &TrainConfig, ranks: usize) -> Vec<(&'static str, String)> {
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
    // A data-parallel group's: step `i` took global batches of `ranks × batch` images.
    if ranks > 1 {
        fields.push(("ranks", ranks.to_string()));
    }
    fields
}

/// The fields [`run_fields`] writes only when they differ from their default, and that
/// default (a file without the field was written by such a run).
pub(super) const OPTIONAL_FIELDS: [(&str, &str); 2] = [("accum", "1"), ("ranks", "1")];
