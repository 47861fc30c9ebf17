//! Reading a checkpoint as an untrusted file, in the order the module docs give.

use super::layout::{
    check_scalars, f16s_as_f32, f32s, finite, layout, le_bytes, run_fields, size_limit, slots,
    What, OPTIONAL_FIELDS,
};
use super::names::{checksum, oihw_to_krsc};
use super::{CheckpointError, Loaded, Meta, TrainState, FORMAT, SAVED_REGIONS, VERSION};
use crate::TrainConfig;
use cudnn_cbr::amp::plan::Region;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// Loads and checks a checkpoint for `cfg`'s run (module docs for the checks), on
/// `cfg.ranks` ranks ([`load_in_group`] for a launched group).
///
/// # Errors
/// A [`CheckpointError`] naming the file, field or tensor.
pub fn load(path: &Path, cfg: &TrainConfig) -> Result<Loaded, crate::TrainError> {
    load_in_group(path, cfg, cfg.ranks.max(1))
}

/// [`load`] for a run of `ranks` data-parallel ranks (a launched group's size): the file must
/// be of a group of that size (its data position counts global batches of `ranks × batch`
/// images).
///
/// # Errors
/// As [`load`].
pub fn load_in_group(
    path: &Path,
    cfg: &TrainConfig,
    ranks: usize,
) -> Result<Loaded, crate::TrainError> {
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
    let fields = run_fields(cfg, ranks);
    // A field written only off its default (an accumulating run's, a group's), in the file
    // but not among this run's: this run has the default.
    for (f, default) in OPTIONAL_FIELDS {
        if let Some(file) = meta.get(f).filter(|_| fields.iter().all(|(r, _)| *r != f)) {
            return Err(CheckpointError::OtherRun {
                field: f.into(),
                file: file.into(),
                run: default.into(),
            }
            .into());
        }
    }
    for (f, run) in fields {
        let got = match OPTIONAL_FIELDS.iter().find(|(o, _)| *o == f) {
            // Written without it: the default (one micro-batch per step, one rank).
            Some((_, default)) => meta.get(f).unwrap_or(default),
            None => field(f)?,
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
