//! Writing a checkpoint: the state checked, then written atomically (a temporary file in the
//! same folder, `fsync`ed and renamed over the target).

use super::layout::{
    check_scalars, f16s_as_f32, f32s, finite, layout, le_bytes, run_fields, slots, What,
};
use super::names::{checksum, krsc_to_oihw};
use super::{CheckpointError, TrainState, FORMAT, SCALARS, VERSION};
use crate::TrainConfig;
use cudnn_cbr::amp::plan::Region;
use safetensors::Dtype;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Saves `state` after `step` training steps of `cfg` on `cfg.ranks` ranks to `path`,
/// atomically (module docs). `routes` describes each layer's route (metadata only).
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
    save_in_group(path, cfg, state, step, routes, cfg.ranks.max(1))
}

/// [`save`] for a run of `ranks` data-parallel ranks (a launched group's size, recorded as
/// the `ranks` field when above 1): rank 0's state, which with synchronized BN is every
/// rank's.
///
/// # Errors
/// As [`save`].
pub fn save_in_group(
    path: &Path,
    cfg: &TrainConfig,
    state: &TrainState,
    step: u64,
    routes: &str,
    ranks: usize,
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
    let mut meta: HashMap<String, String> = run_fields(cfg, ranks)
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
    // Informational (a resumed run may change them): the rate of each step is recomputed
    // from the resuming run's configuration.
    if cfg.schedules_lr() {
        meta.insert("lr_schedule".into(), cfg.lr_schedule.to_string());
        meta.insert("warmup".into(), cfg.warmup.to_string());
    }
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
    let serialize = |what: &'static str, message: String| CheckpointError::Write {
        path: path.into(),
        what,
        message,
    };
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| serialize("serialize", e.to_string()))?;
    let bytes = sorted_header(bytes).map_err(|m| serialize("sort the header's keys", m))?;
    write_atomic(path, &bytes)?;
    Ok(())
}

/// `file` (safetensors' bytes) with the keys of its JSON header in sorted order, so that the
/// same state saves as the same bytes: the crate writes the metadata from a `HashMap`, whose
/// order differs from one process (and map) to the next. The entries, the header's length
/// (padded with spaces, as the format allows) and the data are unchanged.
fn sorted_header(mut file: Vec<u8>) -> Result<Vec<u8>, String> {
    fn sorted(v: serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(map) => {
                let map: std::collections::BTreeMap<String, serde_json::Value> =
                    map.into_iter().collect();
                serde_json::Value::Object(map.into_iter().map(|(k, v)| (k, sorted(v))).collect())
            }
            other => other,
        }
    }
    let len = file
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n <= file.len() - 8)
        .ok_or("the serialized file has no header")?;
    let header: serde_json::Value =
        serde_json::from_slice(&file[8..8 + len]).map_err(|e| e.to_string())?;
    let text = serde_json::to_vec(&sorted(header)).map_err(|e| e.to_string())?;
    if text.len() > len {
        return Err(format!(
            "the sorted header has {} bytes, the crate's {len}",
            text.len()
        ));
    }
    file[8..8 + text.len()].copy_from_slice(&text);
    file[8 + text.len()..8 + len].fill(b' ');
    Ok(file)
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
