//! Autotuning: time a graph's candidate plans on a live device and keep the fastest.
//!
//! Planning is heuristics-first by default ([`PlanOptions::Heuristics`]: the first plan that
//! finalizes). [`PlanOptions::Autotune`] asks for the timed choice instead:
//! [`PlanCache::get_or_autotune`](crate::cache::PlanCache::get_or_autotune) answers with a
//! tuned plan on record (in memory, or persisted: restoring one needs no device), else runs
//! [`tune`] on a live target and records the winner with its timings ([`TuneRecord`]).
//!
//! Timing runs never touch the caller's buffers: [`tune`] allocates its own zeroed scratch
//! buffers for every real tensor (a BN forward updates running statistics in place, so timing
//! it on the caller's buffers would change them once per run).

use crate::error::{Error, Result};
use crate::exec::{Bindings, Handle, Scalar, Workspace};
use crate::graph::{DataType, TensorId};
use crate::lower::OperationGraph;
use crate::plan::{build_plans, ExecutionPlan, PlanPolicy};
use crate::target::Target;
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// How many candidates to time, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutotuneOptions {
    /// At most this many candidate plans (heuristics mode A, in its order) are built and timed.
    pub max_candidates: usize,
    /// Untimed runs of each candidate first (caches, clocks, lazy initialization).
    pub warmup: usize,
    /// Timed runs of each candidate; its time is their median.
    pub iters: usize,
}

impl Default for AutotuneOptions {
    /// 8 candidates, 3 warm-up runs, median of 10 timed runs.
    fn default() -> Self {
        AutotuneOptions {
            max_candidates: 8,
            warmup: 3,
            iters: 10,
        }
    }
}

impl AutotuneOptions {
    /// Checks that there is something to time: at least one candidate and one timed run.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("max_candidates", self.max_candidates),
            ("iters", self.iters),
        ] {
            if value == 0 {
                return Err(Error::InvalidConfig {
                    layer: "autotune options".into(),
                    field: field.into(),
                    problem: "must be at least 1".into(),
                });
            }
        }
        Ok(())
    }
}

/// How a graph's plan is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlanOptions {
    /// The first plan heuristics offer that finalizes (a tuned plan on record is used too).
    #[default]
    Heuristics,
    /// The fastest candidate, timed on the live device; a tuned plan on record is reused.
    Autotune(AutotuneOptions),
}

/// One timed candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateTiming {
    /// Its engine tag ([`ExecutionPlan::engine_tag`]).
    pub engine: String,
    /// Its index among the configs heuristics returned ([`ExecutionPlan::config_index`]).
    pub config_index: usize,
    /// Median time in milliseconds; `None` when it could not run.
    pub time_ms: Option<f32>,
}

/// The tuned choice for one graph on one target, as the plan cache keeps and persists it.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneRecord {
    /// The winner's engine tag.
    pub engine: String,
    /// The winner's index among the configs heuristics returned.
    pub config_index: usize,
    /// The winner's median time in milliseconds.
    pub time_ms: f32,
    /// Every candidate, in heuristics order (the winner included).
    pub candidates: Vec<CandidateTiming>,
}

impl TuneRecord {
    /// The record of `plan` chosen with `time_ms` among `candidates`.
    pub fn for_plan(plan: &ExecutionPlan, time_ms: f32, candidates: Vec<CandidateTiming>) -> Self {
        TuneRecord {
            engine: plan.engine_tag(),
            config_index: plan.config_index(),
            time_ms,
            candidates,
        }
    }

    /// Checks that every time is a finite, non-negative number of milliseconds (a record read
    /// back must not carry NaN or a negative time into a comparison).
    pub fn validate(&self) -> Result<()> {
        let bad = |field: String, t: f32| Error::InvalidConfig {
            layer: "tune record".into(),
            field,
            problem: format!("must be a finite, non-negative time in ms, got {t}"),
        };
        if !(self.time_ms.is_finite() && self.time_ms >= 0.0) {
            return Err(bad("time_ms".into(), self.time_ms));
        }
        for (i, c) in self.candidates.iter().enumerate() {
            if let Some(t) = c.time_ms {
                if !(t.is_finite() && t >= 0.0) {
                    return Err(bad(format!("candidates[{i}].time_ms"), t));
                }
            }
        }
        Ok(())
    }

    /// The record as JSON (what the plan cache persists).
    pub(crate) fn to_json(&self) -> String {
        let candidates: Vec<serde_json::Value> = self
            .candidates
            .iter()
            .map(|c| {
                serde_json::json!({
                    "engine": c.engine,
                    "config_index": c.config_index,
                    "time_ms": c.time_ms,
                })
            })
            .collect();
        serde_json::json!({
            "engine": self.engine,
            "config_index": self.config_index,
            "time_ms": self.time_ms,
            "candidates": candidates,
        })
        .to_string()
    }

    /// Parses and validates [`TuneRecord::to_json`]'s output; says what is wrong otherwise.
    pub(crate) fn from_json(text: &str) -> std::result::Result<Self, String> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("tune record is not JSON: {e}"))?;
        let field =
            |v: &serde_json::Value, k: &str| -> std::result::Result<serde_json::Value, String> {
                v.get(k)
                    .cloned()
                    .ok_or_else(|| format!("tune record has no `{k}`"))
            };
        let string = |x: serde_json::Value, k: &str| {
            x.as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("tune record: `{k}` is not a string"))
        };
        let index = |x: serde_json::Value, k: &str| {
            x.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| format!("tune record: `{k}` is not an index"))
        };
        // serde_json keeps f32 values exactly (f32 → f64 → f32 is lossless).
        let time = |x: serde_json::Value, k: &str| {
            x.as_f64()
                .map(|t| t as f32)
                .ok_or_else(|| format!("tune record: `{k}` is not a number"))
        };
        let mut candidates = Vec::new();
        for c in field(&v, "candidates")?
            .as_array()
            .ok_or("tune record: `candidates` is not a list")?
        {
            let t = field(c, "time_ms")?;
            candidates.push(CandidateTiming {
                engine: string(field(c, "engine")?, "engine")?,
                config_index: index(field(c, "config_index")?, "config_index")?,
                time_ms: if t.is_null() {
                    None
                } else {
                    Some(time(t, "time_ms")?)
                },
            });
        }
        let record = TuneRecord {
            engine: string(field(&v, "engine")?, "engine")?,
            config_index: index(field(&v, "config_index")?, "config_index")?,
            time_ms: time(field(&v, "time_ms")?, "time_ms")?,
            candidates,
        };
        record.validate().map_err(|e| e.to_string())?;
        Ok(record)
    }
}

/// The winner of a tuning run and what was measured.
#[derive(Debug)]
pub struct Tuned {
    /// The fastest plan.
    pub plan: ExecutionPlan,
    /// Its timing and every candidate's.
    pub record: TuneRecord,
}

/// Builds up to `opts.max_candidates` plans for `op` (heuristics mode A; the default policy's
/// first plan when mode A has none), times each on `target`'s device on scratch buffers
/// (median of `opts.iters` runs after `opts.warmup`, CUDA events) and returns the fastest.
///
/// # Errors
/// [`Error::AutotuneNeedsDevice`] for a deviceless target (checked before any planning);
/// [`Error::InvalidConfig`] for options with nothing to time; [`Error::NoEngine`] /
/// [`Error::NoPlan`] when no plan builds; the first candidate's failure when none runs.
pub fn tune(op: &OperationGraph, target: &Target, opts: &AutotuneOptions) -> Result<Tuned> {
    opts.validate()?;
    let handle = target.handle().ok_or_else(|| Error::AutotuneNeedsDevice {
        graph: op.name().to_string(),
        target: target.props().name().to_string(),
    })?;
    let plans = match build_plans(op, target, &PlanPolicy::autotune(opts.max_candidates)) {
        Ok(plans) => plans,
        // Mode A alone may have nothing where the fallback list does: the heuristics' plan is
        // then the only candidate.
        Err(Error::NoEngine { .. } | Error::NoPlan { .. }) => {
            build_plans(op, target, &PlanPolicy::default())?
        }
        Err(e) => return Err(e),
    };
    let mut scratch = Scratch::for_plans(handle.stream(), &plans)?;
    let mut candidates = Vec::with_capacity(plans.len());
    let mut first_error = None;
    for plan in &plans {
        let time_ms = match time_plan(plan, handle, &mut scratch, opts) {
            Ok(t) => Some(t),
            Err(e) => {
                // One candidate that cannot run (e.g. its workspace does not fit) must not
                // stop the others from being timed.
                first_error.get_or_insert(e);
                None
            }
        };
        candidates.push(CandidateTiming {
            engine: plan.engine_tag(),
            config_index: plan.config_index(),
            time_ms,
        });
    }
    let best = candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.time_ms.map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let Some((best, time_ms)) = best else {
        return Err(first_error.unwrap_or_else(|| Error::cudnn_msg("no candidate to time")));
    };
    let mut plans = plans;
    let plan = plans.swap_remove(best);
    let record = TuneRecord::for_plan(&plan, time_ms, candidates);
    Ok(Tuned { plan, record })
}

/// Median time of one candidate, in milliseconds.
fn time_plan(
    plan: &ExecutionPlan,
    handle: &Arc<Handle>,
    scratch: &mut Scratch,
    opts: &AutotuneOptions,
) -> Result<f32> {
    let stream = handle.stream();
    // Grown before the runs, so that no timed run includes an allocation.
    handle.reserve_workspace(plan.workspace_size())?;
    let mut bindings = Bindings::new(plan);
    for real in plan.real_tensors() {
        if real.by_value {
            bindings.bind_scalar(real.id, harmless_scalar(real.dtype))?;
        }
    }
    scratch.bind_all(&mut bindings, plan, stream)?;
    bindings.check()?;
    for _ in 0..opts.warmup {
        plan.execute(handle, &bindings, Workspace::Pooled)?;
    }
    let ctx = stream.context();
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let event = || {
        ctx.new_event(timing)
            .map_err(|e| driver("create an event", e))
    };
    let mut marks = Vec::with_capacity(opts.iters);
    for _ in 0..opts.iters {
        let (start, end) = (event()?, event()?);
        start
            .record(stream)
            .map_err(|e| driver("record an event", e))?;
        plan.execute(handle, &bindings, Workspace::Pooled)?;
        end.record(stream)
            .map_err(|e| driver("record an event", e))?;
        marks.push((start, end));
    }
    // Read after all runs are queued, so the host does not stall the stream between runs.
    let mut times = marks
        .iter()
        .map(|(s, e)| s.elapsed_ms(e).map_err(|e| driver("time events", e)))
        .collect::<Result<Vec<f32>>>()?;
    Ok(median(&mut times))
}

/// The median (mean of the middle two for an even count); 0 for no values.
fn median(times: &mut [f32]) -> f32 {
    times.sort_by(f32::total_cmp);
    match times.len() {
        0 => 0.0,
        n if n % 2 == 1 => times[n / 2],
        n => (times[n / 2 - 1] + times[n / 2]) / 2.0,
    }
}

/// The host value timing runs pass for a by-value scalar. The CBR graphs' scalars are factors
/// and offsets (ε, momentum, −1/M); 1 is finite and non-zero, so no run divides by zero, and
/// the time does not depend on the value. Another dtype is refused by `bind_scalar`.
fn harmless_scalar(dtype: DataType) -> Scalar {
    match dtype {
        DataType::Double => Scalar::F64(1.0),
        DataType::Int64 => Scalar::I64(1),
        _ => Scalar::F32(1.0),
    }
}

fn driver(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Driver {
        what: what.into(),
        message: e.to_string(),
    }
}

/// A zeroed scratch buffer of one tensor's type.
enum Buffer {
    F16(CudaSlice<half::f16>),
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    I32(CudaSlice<i32>),
    I64(CudaSlice<i64>),
    /// Types without a device element type of their own (bf16, bool), bound as bytes.
    Bytes(CudaSlice<u8>),
}

/// Scratch buffers for every real device tensor of a graph's candidates, shared by all of
/// them (the candidates of one graph have the same real tensors).
struct Scratch {
    buffers: Vec<(TensorId, Buffer)>,
}

impl Scratch {
    fn for_plans(stream: &Arc<CudaStream>, plans: &[ExecutionPlan]) -> Result<Self> {
        // The largest extent any candidate gives each tensor.
        let mut needs: Vec<(TensorId, DataType, usize)> = Vec::new();
        for real in plans.iter().flat_map(|p| p.real_tensors()) {
            if real.by_value {
                continue;
            }
            match needs.iter_mut().find(|n| n.0 == real.id) {
                Some(n) => n.2 = n.2.max(real.bytes),
                None => needs.push((real.id, real.dtype, real.bytes)),
            }
        }
        let mut buffers = Vec::with_capacity(needs.len());
        for (id, dtype, bytes) in needs {
            let elems = bytes.div_ceil(dtype.size()).max(1);
            let fail = |e| driver("allocate an autotune scratch buffer", e);
            let buffer = match dtype {
                DataType::Half => Buffer::F16(stream.alloc_zeros(elems).map_err(fail)?),
                DataType::Float => Buffer::F32(stream.alloc_zeros(elems).map_err(fail)?),
                DataType::Double => Buffer::F64(stream.alloc_zeros(elems).map_err(fail)?),
                DataType::Int32 => Buffer::I32(stream.alloc_zeros(elems).map_err(fail)?),
                DataType::Int64 => Buffer::I64(stream.alloc_zeros(elems).map_err(fail)?),
                DataType::BFloat16 | DataType::Boolean => {
                    Buffer::Bytes(stream.alloc_zeros(elems * dtype.size()).map_err(fail)?)
                }
            };
            buffers.push((id, buffer));
        }
        Ok(Scratch { buffers })
    }

    /// Binds the scratch buffer of every real device tensor of `plan`, borrowed for as long
    /// as the bindings live.
    fn bind_all<'p>(
        &'p mut self,
        b: &mut Bindings<'p>,
        plan: &ExecutionPlan,
        stream: &'p CudaStream,
    ) -> Result<()> {
        for (id, buffer) in self.buffers.iter_mut() {
            if !plan
                .real_tensors()
                .iter()
                .any(|r| r.id == *id && !r.by_value)
            {
                continue;
            }
            match buffer {
                Buffer::F16(s) => b.bind(*id, s, stream)?,
                Buffer::F32(s) => b.bind(*id, s, stream)?,
                Buffer::F64(s) => b.bind(*id, s, stream)?,
                Buffer::I32(s) => b.bind(*id, s, stream)?,
                Buffer::I64(s) => b.bind(*id, s, stream)?,
                Buffer::Bytes(s) => {
                    let dtype = plan
                        .real_tensors()
                        .iter()
                        .find(|r| r.id == *id)
                        .map(|r| r.dtype)
                        .unwrap_or(DataType::Boolean);
                    b.bind_bytes(*id, s, dtype, stream)?
                }
            };
        }
        // Every device tensor got a buffer (`for_plans`); `check` names one if it had not.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn options_with_nothing_to_time_are_refused() {
        assert!(AutotuneOptions::default().validate().is_ok());
        for opts in [
            AutotuneOptions {
                iters: 0,
                ..Default::default()
            },
            AutotuneOptions {
                max_candidates: 0,
                ..Default::default()
            },
        ] {
            assert!(matches!(opts.validate(), Err(Error::InvalidConfig { .. })));
        }
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let record = TuneRecord {
            engine: "eng7".into(),
            config_index: 2,
            time_ms: 0.123_456_7,
            candidates: vec![
                CandidateTiming {
                    engine: "eng1".into(),
                    config_index: 0,
                    time_ms: Some(0.5),
                },
                CandidateTiming {
                    engine: "eng3".into(),
                    config_index: 1,
                    time_ms: None,
                },
                CandidateTiming {
                    engine: "eng7".into(),
                    config_index: 2,
                    time_ms: Some(0.123_456_7),
                },
            ],
        };
        assert_eq!(TuneRecord::from_json(&record.to_json()), Ok(record.clone()));
        let negative = TuneRecord {
            time_ms: -1.0,
            ..record.clone()
        };
        assert!(TuneRecord::from_json(&negative.to_json()).is_err());
        // NaN has no JSON form: it is written as null and refused on the way back.
        let nan = TuneRecord {
            time_ms: f32::NAN,
            ..record
        };
        assert!(nan.validate().is_err());
        assert!(TuneRecord::from_json(&nan.to_json()).is_err());
        assert!(TuneRecord::from_json("{}").is_err());
        assert!(TuneRecord::from_json("not json").is_err());
    }
}
