//! The plan cache: built plans keyed by graph signature + target identity + cuDNN version.
//!
//! A hit is one u64 hash and one string comparison under a read lock. With persistence, each
//! plan's JSON is written to a folder, so a later process re-creates the plan in about a
//! millisecond instead of running heuristics and (for runtime-compiled engines) NVRTC again.
//!
//! The folder is never trusted. Each file carries its full key (graph signature, target
//! identity with the cuDNN version) and a checksum of the plan; on restore the plan's own
//! tensors (uid, dims, strides, dtype, virtual or not) must be exactly the graph's real
//! tensors. Files are read only when they are regular files (a FIFO is not waited on) of at
//! most [`MAX_PLAN_FILE_BYTES`], and parsed as strict JSON (a key given twice is refused). A
//! file that fails any check, or cannot be read or parsed, is moved aside
//! (`*.rejected-*`) with a warning and the plan is rebuilt. Writes go to a temporary file
//! unique to the writer (process, thread, counter) and are renamed into place, so concurrent
//! writers never see or leave half a file; a failed write keeps the built plan in memory and
//! warns. Nothing about the folder makes planning fail.
//!
//! A tuned plan ([`PlanCache::insert_tuned`], [`PlanCache::get_or_autotune`]) is persisted the
//! same way, with its [`TuneRecord`] (timings and engine tags) under a second checksum that
//! also covers the plan's; a later lookup of either kind restores it in preference to the
//! heuristics' plan. Graphs cuDNN has no engine or plan for are persisted too
//! (`*.failed.json`, keyed like plans: a different cuDNN version or target misses), so a
//! later process answers them without planning again; delete those files to retry.

use crate::autotune::{self, AutotuneOptions, PlanOptions, TuneRecord};
use crate::error::{Error, Result};
use crate::graph::{fnv1a, Graph, GraphSignature};
use crate::lower::{real_tensor_layout, OperationGraph};
use crate::plan::{build_plan, ExecutionPlan};
use crate::target::Target;
use crate::untrusted::{parse_strict_json, read_regular_text, FileProblem};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// The most bytes of a persisted plan or failure file (a plan's JSON is a few KiB to a few
/// hundred KiB); a larger file is rejected unread.
pub const MAX_PLAN_FILE_BYTES: u64 = 16 << 20;

/// What a plan is cached under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanKey {
    signature: GraphSignature,
    target: Arc<str>,
    hash: u64,
}

impl PlanKey {
    /// The key of `signature` on `target` (the identity includes the cuDNN version).
    pub fn new(signature: GraphSignature, target: &Target) -> Self {
        let target: Arc<str> = Arc::from(target.identity());
        let hash = signature.hash64() ^ fnv1a(target.as_bytes()).rotate_left(17);
        PlanKey {
            signature,
            target,
            hash,
        }
    }

    /// The graph signature.
    pub fn signature(&self) -> &GraphSignature {
        &self.signature
    }

    /// The target identity.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The file name a persisted plan for this key gets.
    pub fn file_name(&self) -> String {
        format!("{:016x}.plan.json", self.hash)
    }

    /// The file name a persisted "no engine" / "no plan" failure for this key gets.
    pub fn failure_file_name(&self) -> String {
        format!("{:016x}.failed.json", self.hash)
    }
}

impl Hash for PlanKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Hit/miss counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served from memory.
    pub hits: u64,
    /// Plans restored from a persisted JSON file.
    pub restored: u64,
    /// Plans built from scratch (heuristics + finalize).
    pub built: u64,
    /// Persisted files rejected (unreadable, corrupt, tampered, for another graph) and moved
    /// aside; their plans were rebuilt.
    pub rejected: u64,
    /// Plans that could not be written to the folder (kept in memory).
    pub write_failures: u64,
    /// Lookups answered with a remembered "no engine" / "no plan" error instead of planning
    /// the graph again (remembered in memory, or persisted by an earlier process).
    pub failure_hits: u64,
    /// Plans chosen by timing candidates on the device (each also counts as built).
    pub tuned: u64,
}

/// A thread-safe plan cache, optionally persisted to a folder.
#[derive(Debug, Default)]
pub struct PlanCache {
    map: RwLock<HashMap<PlanKey, Arc<ExecutionPlan>>>,
    /// Graphs cuDNN has no engine or plan for, with the error: asking again would only
    /// repeat the (slow) heuristics and finalization. Persisted too; the key holds the target
    /// identity and cuDNN version, so another cuDNN or target asks again.
    failed: RwLock<HashMap<PlanKey, Error>>,
    /// The timing record of each tuned plan in `map`.
    tuned: RwLock<HashMap<PlanKey, TuneRecord>>,
    dir: Option<PathBuf>,
    tuned_runs: AtomicU64,
    failure_hits: AtomicU64,
    hits: AtomicU64,
    restored: AtomicU64,
    built: AtomicU64,
    rejected: AtomicU64,
    write_failures: AtomicU64,
}

impl PlanCache {
    /// An in-memory cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache that also writes each built plan's JSON under `dir` and reads it back on a
    /// miss. A folder that cannot be created leaves an in-memory cache, with one warning
    /// ([`PlanCache::dir`] is then `None`); the `Result` never holds an error today and is
    /// kept for callers written against the earlier contract.
    pub fn persistent(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        if let Err(e) = std::fs::create_dir_all(&dir) {
            eprintln!(
                "warning: plan cache: cannot create {}: {e}; plans stay in memory only",
                dir.display()
            );
            return Ok(Self::default());
        }
        Ok(PlanCache {
            dir: Some(dir),
            ..Self::default()
        })
    }

    /// The persistence folder, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// A plan already in memory.
    pub fn get(&self, key: &PlanKey) -> Option<Arc<ExecutionPlan>> {
        let found = self
            .map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned();
        if found.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Puts a plan in memory (and on disk when persistent; a failed write is a warning and
    /// the plan stays in memory); returns the shared plan.
    pub fn insert(&self, key: PlanKey, plan: ExecutionPlan) -> Result<Arc<ExecutionPlan>> {
        self.store(key, plan, None)
    }

    /// Puts a tuned plan in memory (and on disk when persistent) with its timing record:
    /// later lookups of its key, here or in another process on the same folder, use it in
    /// preference to the heuristics' plan.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a time in `record` is not a finite, non-negative number,
    /// or when `record` names another engine or config index than the plan's own (a plan
    /// restored from JSON, whose engine is unknown, is taken as the record says).
    pub fn insert_tuned(
        &self,
        key: PlanKey,
        plan: ExecutionPlan,
        record: TuneRecord,
    ) -> Result<Arc<ExecutionPlan>> {
        record.validate()?;
        if plan.engine().is_some()
            && (record.engine != plan.engine_tag() || record.config_index != plan.config_index())
        {
            return Err(Error::InvalidConfig {
                layer: format!("tune record of `{}`", plan.graph_name()),
                field: "engine".into(),
                problem: format!(
                    "names {} (config {}) but the plan is {} (config {})",
                    record.engine,
                    record.config_index,
                    plan.engine_tag(),
                    plan.config_index()
                ),
            });
        }
        self.store(key, plan, Some(record))
    }

    /// The timing record of the tuned plan for `key`, when one is in memory (inserted, tuned
    /// or restored by this cache).
    pub fn tuned(&self, key: &PlanKey) -> Option<TuneRecord> {
        self.tuned
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned()
    }

    fn store(
        &self,
        key: PlanKey,
        plan: ExecutionPlan,
        record: Option<TuneRecord>,
    ) -> Result<Arc<ExecutionPlan>> {
        if let Some(dir) = &self.dir {
            if let Err(e) = write_plan(dir, &key, &plan, record.as_ref()) {
                self.write_failures.fetch_add(1, Ordering::Relaxed);
                eprintln!("warning: plan cache: {e}; the plan stays in memory only");
            }
        }
        self.remember(key, plan, record)
    }

    /// Keeps a plan (and its record) in memory only.
    fn remember(
        &self,
        key: PlanKey,
        plan: ExecutionPlan,
        record: Option<TuneRecord>,
    ) -> Result<Arc<ExecutionPlan>> {
        let plan = Arc::new(plan);
        // The map changes under the record lock: a reader that sees a record sees its plan.
        let mut tuned = self.tuned.write().unwrap_or_else(|p| p.into_inner());
        match record {
            Some(r) => tuned.insert(key.clone(), r),
            None => tuned.remove(&key),
        };
        self.map
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, plan.clone());
        Ok(plan)
    }

    /// The plan for `graph` on `target`: from memory, else from a persisted file (a tuned
    /// plan when one was recorded), else built (first plan that finalizes) and stored.
    pub fn get_or_build(&self, graph: &Graph, target: &Target) -> Result<Arc<ExecutionPlan>> {
        let key = PlanKey::new(graph.signature()?, target);
        if let Some(plan) = self.get(&key) {
            return Ok(plan);
        }
        if let Some(found) = self.recall(&key, graph, target, false) {
            return found;
        }
        let op = OperationGraph::for_target(graph, target)?;
        let mut plan = match build_plan(&op, target) {
            Ok(plan) => plan,
            Err(e) => return Err(self.failed_with(key, e)),
        };
        self.built.fetch_add(1, Ordering::Relaxed);
        plan.set_source_graph(graph);
        self.insert(key, plan)
    }

    /// The tuned plan for `graph` on `target`: a tuned plan on record (in memory or
    /// persisted; restoring needs no device), else the fastest candidate timed now on the
    /// target's device ([`autotune::tune`]), stored with its [`TuneRecord`].
    ///
    /// # Errors
    /// [`Error::AutotuneNeedsDevice`] on a deviceless target without a tuned plan on record;
    /// a remembered or new [`Error::NoEngine`] / [`Error::NoPlan`]; what tuning returns.
    pub fn get_or_autotune(
        &self,
        graph: &Graph,
        target: &Target,
        opts: &AutotuneOptions,
    ) -> Result<Arc<ExecutionPlan>> {
        let key = PlanKey::new(graph.signature()?, target);
        let in_memory = self
            .tuned
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&key);
        if in_memory {
            if let Some(plan) = self.get(&key) {
                return Ok(plan);
            }
        }
        if let Some(found) = self.recall(&key, graph, target, true) {
            return found;
        }
        let op = OperationGraph::for_target(graph, target)?;
        let mut tuned = match autotune::tune(&op, target, opts) {
            Ok(tuned) => tuned,
            Err(e) => return Err(self.failed_with(key, e)),
        };
        self.built.fetch_add(1, Ordering::Relaxed);
        self.tuned_runs.fetch_add(1, Ordering::Relaxed);
        tuned.plan.set_source_graph(graph);
        self.insert_tuned(key, tuned.plan, tuned.record)
    }

    /// [`PlanCache::get_or_build`] or [`PlanCache::get_or_autotune`], as `options` say.
    pub fn get_with(
        &self,
        graph: &Graph,
        target: &Target,
        options: &PlanOptions,
    ) -> Result<Arc<ExecutionPlan>> {
        match options {
            PlanOptions::Heuristics => self.get_or_build(graph, target),
            PlanOptions::Autotune(opts) => self.get_or_autotune(graph, target, opts),
        }
    }

    /// What the cache knows about `key` without planning: a remembered failure (in memory or
    /// persisted), or a persisted plan (only a tuned one when `tuned_only`). A bad file is
    /// moved aside and counted; `None` means "plan it".
    fn recall(
        &self,
        key: &PlanKey,
        graph: &Graph,
        target: &Target,
        tuned_only: bool,
    ) -> Option<Result<Arc<ExecutionPlan>>> {
        if let Some(e) = self
            .failed
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
        {
            self.failure_hits.fetch_add(1, Ordering::Relaxed);
            return Some(Err(e.clone()));
        }
        let dir = self.dir.as_ref()?;
        match read_plan(dir, key, graph, target, tuned_only) {
            Ok(Some((plan, record))) => {
                self.restored.fetch_add(1, Ordering::Relaxed);
                return Some(self.remember(key.clone(), plan, record));
            }
            Ok(None) => {}
            Err(reason) => self.reject(dir, &key.file_name(), &reason, "rebuilding the plan"),
        }
        match read_failure(dir, key) {
            Ok(Some(e)) => {
                self.failure_hits.fetch_add(1, Ordering::Relaxed);
                self.failed
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key.clone(), e.clone());
                Some(Err(e))
            }
            Ok(None) => None,
            Err(reason) => {
                self.reject(dir, &key.failure_file_name(), &reason, "planning the graph");
                None
            }
        }
    }

    fn reject(&self, dir: &Path, file: &str, reason: &str, then: &str) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let aside = move_aside(&dir.join(file));
        eprintln!("warning: plan cache: {reason}; {aside}; {then}");
    }

    /// Remembers a "no engine" / "no plan" error (in memory and in the folder); returns `e`.
    fn failed_with(&self, key: PlanKey, e: Error) -> Error {
        if !matches!(e, Error::NoEngine { .. } | Error::NoPlan { .. }) {
            return e;
        }
        if let Some(dir) = &self.dir {
            if let Err(w) = write_failure(dir, &key, &e) {
                self.write_failures.fetch_add(1, Ordering::Relaxed);
                eprintln!("warning: plan cache: {w}; the failure is remembered in memory only");
            }
        }
        self.failed
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, e.clone());
        e
    }

    /// Number of plans in memory.
    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no plan is in memory.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hit/restore/build counters.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            restored: self.restored.load(Ordering::Relaxed),
            built: self.built.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            write_failures: self.write_failures.load(Ordering::Relaxed),
            failure_hits: self.failure_hits.load(Ordering::Relaxed),
            tuned: self.tuned_runs.load(Ordering::Relaxed),
        }
    }
}

fn file_error(path: &Path, reason: String) -> Error {
    Error::CacheFile {
        path: path.display().to_string(),
        reason,
    }
}

/// A name no other writer uses at the same time: process, thread and a per-process counter.
fn temp_name(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let thread = format!("{:?}", std::thread::current().id());
    let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
    path.with_extension(format!("tmp-{}-{thread}-{n}", std::process::id()))
}

/// Moves a rejected file out of the way (renamed beside itself); says what happened.
fn move_aside(path: &Path) -> String {
    let aside = path.with_extension(format!(
        "rejected-{}",
        temp_name(path)
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("x")
    ));
    match std::fs::rename(path, &aside) {
        Ok(()) => format!("moved it to {}", aside.display()),
        Err(e) => format!("could not move it aside ({e})"),
    }
}

/// Writes `doc` to `path` through a temporary file of this writer's own, so a concurrent
/// reader never sees half a file.
fn write_doc(path: &Path, doc: &serde_json::Value) -> Result<()> {
    let tmp = temp_name(path);
    let written = std::fs::write(&tmp, doc.to_string()).and_then(|_| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(|e| file_error(path, format!("cannot write: {e}")))
}

/// The checksum of a tune record, bound to the plan's checksum: a record moved onto another
/// plan does not verify.
fn tune_checksum(plan_checksum: &str, tune: &str) -> String {
    format!(
        "{:016x}",
        fnv1a(format!("{plan_checksum}\n{tune}").as_bytes())
    )
}

fn write_plan(
    dir: &Path,
    key: &PlanKey,
    plan: &ExecutionPlan,
    record: Option<&TuneRecord>,
) -> Result<()> {
    let json = plan.json()?;
    let checksum = format!("{:016x}", fnv1a(json.as_bytes()));
    let mut doc = serde_json::json!({
        "signature": key.signature().text(),
        "target": key.target(),
        "graph": plan.graph_name(),
        "checksum": checksum,
        "plan": json,
    });
    if let Some(record) = record {
        let tune = record.to_json();
        doc["tune_checksum"] = tune_checksum(&checksum, &tune).into();
        doc["tune"] = tune.into();
    }
    write_doc(&dir.join(key.file_name()), &doc)
}

/// A persisted plan for `key`, with its tune record when it is a tuned plan: `Ok(None)` when
/// there is no file, the file belongs to another key (a hash collision; it will be
/// overwritten), or `tuned_only` and the plan is not tuned; `Err(why)` when the file is
/// unreadable, corrupt, tampered with or does not describe `graph`.
fn read_plan(
    dir: &Path,
    key: &PlanKey,
    graph: &Graph,
    target: &Target,
    tuned_only: bool,
) -> std::result::Result<Option<(ExecutionPlan, Option<TuneRecord>)>, String> {
    let path = dir.join(key.file_name());
    let at = |why: String| format!("{}: {why}", path.display());
    let Some(doc) = read_doc(&path, key).map_err(at)? else {
        return Ok(None);
    };
    if tuned_only && doc.get("tune").is_none() {
        return Ok(None);
    }
    let json = doc["plan"]
        .as_str()
        .ok_or_else(|| at("no `plan` field".into()))?;
    let checksum = format!("{:016x}", fnv1a(json.as_bytes()));
    if doc["checksum"].as_str() != Some(checksum.as_str()) {
        return Err(at("the plan does not match its checksum".into()));
    }
    let record = match doc.get("tune") {
        None => None,
        Some(tune) => {
            let tune = tune
                .as_str()
                .ok_or_else(|| at("`tune` is not a string".into()))?;
            if doc["tune_checksum"].as_str() != Some(tune_checksum(&checksum, tune).as_str()) {
                return Err(at("the tune record does not match its checksum".into()));
            }
            Some(TuneRecord::from_json(tune).map_err(at)?)
        }
    };
    check_plan_tensors(json, graph).map_err(at)?;
    let desc = crate::backend::plan_from_json(json, target.plan_site())
        .map_err(|e| at(format!("cuDNN could not restore the plan: {e}")))?;
    let mut plan = ExecutionPlan::from_parts(
        desc,
        graph.name().to_string(),
        real_tensor_layout(graph),
        target,
    )
    .map_err(|e| at(e.to_string()))?;
    plan.set_source_graph(graph);
    if let Some(record) = &record {
        let engine = crate::backend::plan_engine_info(plan.descriptor()).ok();
        plan.set_origin(engine, record.config_index);
        if plan.engine().is_some() && plan.engine_tag() != record.engine {
            return Err(at(format!(
                "the plan runs {} but its tune record names {}",
                plan.engine_tag(),
                record.engine
            )));
        }
    }
    Ok(Some((plan, record)))
}

/// The JSON document at `path` when it is `key`'s: `Ok(None)` for no file or another key's.
fn read_doc(path: &Path, key: &PlanKey) -> std::result::Result<Option<serde_json::Value>, String> {
    let text = match read_regular_text(path, MAX_PLAN_FILE_BYTES) {
        Ok(text) => text,
        Err(FileProblem::NotFound) => return Ok(None),
        Err(e) => return Err(format!("the file {e}")),
    };
    let doc = parse_strict_json(&text).map_err(|e| format!("not valid JSON: {e}"))?;
    if doc["signature"].as_str() != Some(key.signature().text())
        || doc["target"].as_str() != Some(key.target())
    {
        return Ok(None);
    }
    Ok(Some(doc))
}

fn write_failure(dir: &Path, key: &PlanKey, e: &Error) -> Result<()> {
    let error = match e {
        Error::NoEngine {
            graph,
            target,
            mode,
            reported,
            usable,
        } => serde_json::json!({
            "kind": "no_engine", "graph": graph, "target": target, "mode": mode,
            "reported": reported, "usable": usable,
        }),
        Error::NoPlan {
            graph,
            target,
            tried,
            last,
        } => serde_json::json!({
            "kind": "no_plan", "graph": graph, "target": target, "tried": tried, "last": last,
        }),
        // Only "no engine" and "no plan" are facts about the graph on this target.
        _ => return Ok(()),
    }
    .to_string();
    let doc = serde_json::json!({
        "signature": key.signature().text(),
        "target": key.target(),
        "checksum": format!("{:016x}", fnv1a(error.as_bytes())),
        "error": error,
    });
    write_doc(&dir.join(key.failure_file_name()), &doc)
}

/// A persisted failure for `key` (same contract as [`read_plan`]).
fn read_failure(dir: &Path, key: &PlanKey) -> std::result::Result<Option<Error>, String> {
    let path = dir.join(key.failure_file_name());
    let at = |why: String| format!("{}: {why}", path.display());
    let Some(doc) = read_doc(&path, key).map_err(at)? else {
        return Ok(None);
    };
    let text = doc["error"]
        .as_str()
        .ok_or_else(|| at("no `error` field".into()))?;
    if doc["checksum"].as_str() != Some(format!("{:016x}", fnv1a(text.as_bytes())).as_str()) {
        return Err(at("the failure does not match its checksum".into()));
    }
    let e = parse_strict_json(text).map_err(|e| at(format!("the failure is not JSON: {e}")))?;
    let string = |k: &str| {
        e[k].as_str()
            .map(str::to_string)
            .ok_or_else(|| at(format!("the failure has no `{k}`")))
    };
    let count = |k: &str| {
        e[k].as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| at(format!("the failure has no count `{k}`")))
    };
    let error = match e["kind"].as_str() {
        Some("no_engine") => Error::NoEngine {
            graph: string("graph")?,
            target: string("target")?,
            mode: string("mode")?,
            reported: count("reported")?,
            usable: count("usable")?,
        },
        Some("no_plan") => Error::NoPlan {
            graph: string("graph")?,
            target: string("target")?,
            tried: count("tried")?,
            last: string("last")?,
        },
        _ => return Err(at("the failure is of no known kind".into())),
    };
    Ok(Some(error))
}

/// cuDNN's name of a data type in plan JSON.
fn cudnn_dtype_name(d: crate::graph::DataType) -> &'static str {
    use crate::graph::DataType as D;
    match d {
        D::Half => "CUDNN_DATA_HALF",
        D::BFloat16 => "CUDNN_DATA_BFLOAT16",
        D::Float => "CUDNN_DATA_FLOAT",
        D::Double => "CUDNN_DATA_DOUBLE",
        D::Int32 => "CUDNN_DATA_INT32",
        D::Int64 => "CUDNN_DATA_INT64",
        D::Boolean => "CUDNN_DATA_BOOLEAN",
    }
}

/// The plan's real tensors (its operation graph's non-virtual ones) must be exactly the
/// graph's: same uids, dims, strides and dtypes. A plan whose dims were edited would read and
/// write outside the buffers bound for the graph.
fn check_plan_tensors(json: &str, graph: &Graph) -> std::result::Result<(), String> {
    // Strict: with a key given twice, this check and cuDNN could read different values.
    let plan = parse_strict_json(json).map_err(|e| format!("the plan is not valid JSON: {e}"))?;
    let tensors = plan["operationGraph"]["tensors"]
        .as_array()
        .ok_or("the plan lists no tensors")?;
    let ints = |v: &serde_json::Value| -> Option<Vec<i64>> {
        v.as_array()?
            .iter()
            .map(serde_json::Value::as_i64)
            .collect()
    };
    let mut real = Vec::new();
    for t in tensors {
        if t["isVirtual"].as_bool() == Some(true) {
            continue;
        }
        let uid = t["name"].as_str().unwrap_or_default().to_string();
        let dims = ints(&t["dim"]).ok_or_else(|| format!("tensor {uid} has no dims"))?;
        let strides = ints(&t["stride"]).ok_or_else(|| format!("tensor {uid} has no strides"))?;
        let dtype = t["dataType"].as_str().unwrap_or_default().to_string();
        real.push((uid, dims, strides, dtype));
    }
    let expected = real_tensor_layout(graph);
    if real.len() != expected.len() {
        return Err(format!(
            "the plan has {} real tensors, the graph {}",
            real.len(),
            expected.len()
        ));
    }
    for t in &expected {
        let uid = t.uid.to_string();
        let (_, dims, strides, dtype) = real
            .iter()
            .find(|r| r.0 == uid)
            .ok_or_else(|| format!("the plan has no tensor {uid} (`{}`)", t.name))?;
        let attrs = graph.get(t.id).ok_or("a graph tensor vanished")?;
        let want_strides = graph.strides(t.id).unwrap_or_default();
        if *dims != attrs.dims || *strides != want_strides || dtype != cudnn_dtype_name(t.dtype) {
            return Err(format!(
                "tensor {uid} (`{}`) is {dtype} {dims:?} strides {strides:?} in the plan, {} {:?} strides {want_strides:?} in the graph",
                t.name,
                cudnn_dtype_name(t.dtype),
                attrs.dims
            ));
        }
    }
    Ok(())
}
