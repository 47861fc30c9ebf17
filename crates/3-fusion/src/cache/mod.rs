//! The plan cache: built plans keyed by graph signature + target identity + cuDNN version.
//!
//! A hit is one u64 hash and one string comparison under a read lock. With persistence, each
//! plan's engine choice is written to a folder, so a later process rebuilds the plan without
//! heuristics (and, for runtime-compiled engines, usually from cuDNN's kernel cache).
//!
//! # What a file holds, and why an edited one cannot change what runs
//!
//! A plan file (`<key>.plan.json`, format [`PLAN_FORMAT`]) holds only what cannot be rebuilt
//! from the graph: its key (graph signature, target identity with the cuDNN version), the
//! engine's global index and its knob settings ([`EngineChoice`]), the heuristics mode and
//! config index that proposed it (for reports), and for a tuned plan its [`TuneRecord`]
//! (timings). It holds no operation, tensor, scalar or precision: on restore the graph being
//! looked up is lowered again and the plan finalized for the recorded engine and knobs
//! ([`plan_from_choice`]; no heuristics query). An edited file can therefore at most pick
//! another engine or knob values, which we range-check and cuDNN then validates against our
//! own operation graph; an engine or knob cuDNN refuses, a value out of range, a field of the
//! wrong type, an unknown field or an unknown format (an older version's file included) makes
//! the file rejected: moved aside (`*.rejected-*`) with a warning, and the plan rebuilt by the
//! heuristics. Nothing about the folder makes planning fail.
//!
//! A restore lowers the graph and finalizes one plan: under a millisecond for precompiled
//! engines on 2 cores. A runtime-compiled engine is compiled by cuDNN again (NVRTC, a few
//! hundred milliseconds): its machine code is exactly what a file must not supply.
//!
//! # Trust in the folder
//!
//! As ssh does with `~/.ssh`, the folder is used only when it and the folders above it are
//! owned by this user or root and not writable by group or others
//! ([`check_private_folder`]); otherwise the cache warns once and works in memory
//! ([`PlanCache::refused`] says why). Each file is read only when it too is owned by this
//! user or root and not writable by others, is a regular file (a FIFO is not waited on) of at
//! most [`MAX_PLAN_FILE_BYTES`], and is strict JSON (a key given twice is refused). New
//! folders are made `0700`, files written `0600` through a temporary file unique to the writer
//! (process, thread, counter) renamed into place, so concurrent writers never see or leave
//! half a file; a failed write keeps the plan in memory and warns.
//!
//! # Tuned plans and failures
//!
//! A tuned plan ([`PlanCache::insert_tuned`], [`PlanCache::get_or_autotune`]) is persisted the
//! same way with its record; a later lookup of either kind restores it in preference to the
//! heuristics' plan. A graph cuDNN has no engine or plan for is remembered in memory (later
//! lookups in this process answer the error without planning) and recorded in the folder
//! (`*.failed.json`, keyed like plans). A record read from the folder is a hint only, never
//! the answer: the graph is planned again, and only a fresh failure is returned (a record
//! for a graph that then plans is moved aside as rejected).

use crate::autotune::{self, AutotuneOptions, PlanOptions, TuneRecord};
use crate::backend::{HeurMode, KnobChoice};
use crate::error::{Error, Result};
use crate::graph::{fnv1a, Graph, GraphSignature};
use crate::lower::OperationGraph;
use crate::plan::{build_plan, plan_from_choice, EngineChoice, ExecutionPlan};
use crate::target::Target;
use cudnn_cbr_runtime::stderr;
use cudnn_cbr_runtime::untrusted::{
    check_private_folder, create_private_folder, parse_strict_json, read_private_text, warn_once,
    write_private, FileProblem,
};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

mod files;
#[cfg(test)]
mod tests;

use files::*;

/// The `format` of a plan file this version writes and reads; a file without it, or with
/// another, is rejected (moved aside) and the plan rebuilt.
pub const PLAN_FORMAT: &str = "cudnn-cbr plan 2";

/// The `format` of a failure record this version writes and reads.
pub const FAILURE_FORMAT: &str = "cudnn-cbr failure 2";

/// How many rejection reasons [`PlanCache::rejections`] keeps.
pub const MAX_REJECTIONS_KEPT: usize = 32;

/// The most knob settings a plan file may give (engines have a handful).
const MAX_KNOBS: usize = 64;

/// The most bytes of a persisted plan or failure file (a plan file is well under a KiB, a
/// long graph signature and tune record included); a larger file is rejected unread.
pub const MAX_PLAN_FILE_BYTES: u64 = 1 << 20;

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
    /// Plans rebuilt from a persisted engine choice (no heuristics).
    pub restored: u64,
    /// Plans built from scratch (heuristics + finalize).
    pub built: u64,
    /// Persisted files rejected (unreadable, not trusted, corrupt, of an unknown format, an
    /// engine or knob cuDNN refuses, a failure record for a graph that planned) and moved
    /// aside; their plans were rebuilt.
    pub rejected: u64,
    /// Plans (or failure records) that could not be written to the folder (kept in memory).
    pub write_failures: u64,
    /// Lookups answered with a "no engine" / "no plan" error this cache met earlier in this
    /// process, without planning again. A failure recorded on disk is never answered as
    /// such: see `failure_hints`.
    pub failure_hits: u64,
    /// Failure records read from the folder: each made the graph be planned again (the
    /// record is a hint, never the answer).
    pub failure_hints: u64,
    /// Plannings that ended in a fresh "no engine" / "no plan" error (returned, remembered in
    /// memory and recorded in the folder).
    pub failures: u64,
    /// Plans chosen by timing candidates on the device (each also counts as built).
    pub tuned: u64,
}

/// A thread-safe plan cache, optionally persisted to a folder.
#[derive(Debug, Default)]
pub struct PlanCache {
    map: RwLock<HashMap<PlanKey, Arc<ExecutionPlan>>>,
    /// Graphs cuDNN had no engine or plan for in this process, with the error: asking again
    /// would only repeat the (slow) heuristics and finalization.
    failed: RwLock<HashMap<PlanKey, Error>>,
    /// The timing record of each tuned plan in `map`.
    tuned: RwLock<HashMap<PlanKey, TuneRecord>>,
    dir: Option<PathBuf>,
    /// Why the folder asked for is not used, when it is not.
    refused: Option<String>,
    /// Why files were rejected, oldest first (at most [`MAX_REJECTIONS_KEPT`]).
    rejections: std::sync::Mutex<Vec<String>>,
    tuned_runs: AtomicU64,
    failure_hits: AtomicU64,
    failure_hints: AtomicU64,
    failures: AtomicU64,
    hits: AtomicU64,
    restored: AtomicU64,
    built: AtomicU64,
    rejected: AtomicU64,
    write_failures: AtomicU64,
}

/// What the folder says about a key, short of a plan.
enum Recalled {
    Plan(Arc<ExecutionPlan>),
    /// A failure record: plan again to see.
    FailureHint,
    Nothing,
}

impl PlanCache {
    /// An in-memory cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache that also writes each built plan's engine choice under `dir` and rebuilds the
    /// plan from it on a miss. A folder that cannot be created (made `0700`), or that this
    /// user does not alone control (module docs), leaves an in-memory cache with one warning
    /// ([`PlanCache::dir`] is then `None`, [`PlanCache::refused`] says why); the `Result`
    /// never holds an error today and is kept for callers written against the earlier
    /// contract.
    pub fn persistent(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        let refused = match create_private_folder(&dir) {
            Err(e) => format!("cannot create {}: {e}", dir.display()),
            Ok(()) => match check_private_folder(&dir) {
                Ok(()) => {
                    return Ok(PlanCache {
                        dir: Some(dir),
                        ..Self::default()
                    })
                }
                Err(why) => format!("{} is not used: {why}", dir.display()),
            },
        };
        warn_once(&format!(
            "warning: plan cache: {refused}; plans stay in memory only"
        ));
        Ok(PlanCache {
            refused: Some(refused),
            ..Self::default()
        })
    }

    /// The persistence folder, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Why the folder given to [`PlanCache::persistent`] is not used (cannot be created, or
    /// could be written by another user), when it is not.
    pub fn refused(&self) -> Option<&str> {
        self.refused.as_deref()
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
    /// or when `record` names another engine or config index than the plan's own.
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
                stderr::line(&format!(
                    "warning: plan cache: {e}; the plan stays in memory only"
                ));
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

    /// The plan for `graph` on `target`: from memory, else rebuilt from a persisted engine
    /// choice (a tuned plan's when one was recorded), else built (first plan that finalizes)
    /// and stored.
    pub fn get_or_build(&self, graph: &Graph, target: &Target) -> Result<Arc<ExecutionPlan>> {
        let key = PlanKey::new(graph.signature()?, target);
        if let Some(plan) = self.get(&key) {
            return Ok(plan);
        }
        if let Some(e) = self.remembered_failure(&key) {
            return Err(e);
        }
        let op = OperationGraph::for_target(graph, target)?;
        let hint = match self.recall(&key, &op, target, false) {
            Recalled::Plan(plan) => return Ok(plan),
            Recalled::FailureHint => true,
            Recalled::Nothing => false,
        };
        let mut plan = match build_plan(&op, target) {
            Ok(plan) => plan,
            Err(e) => return Err(self.failed_with(key, e)),
        };
        if hint {
            self.refute_failure(&key);
        }
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
    /// a remembered or new [`Error::NoEngine`] / [`Error::NoPlan`] (a failure recorded in the
    /// folder is checked by planning with the heuristics first); what tuning returns.
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
        if let Some(e) = self.remembered_failure(&key) {
            return Err(e);
        }
        let op = OperationGraph::for_target(graph, target)?;
        match self.recall(&key, &op, target, true) {
            Recalled::Plan(plan) => return Ok(plan),
            // The record is checked with the heuristics (tuning starts from them): a fresh
            // failure is the answer, a plan refutes the record.
            Recalled::FailureHint => match build_plan(&op, target) {
                Ok(_) => self.refute_failure(&key),
                Err(e) => return Err(self.failed_with(key, e)),
            },
            Recalled::Nothing => {}
        }
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

    /// A "no engine" / "no plan" error met for `key` earlier in this process.
    fn remembered_failure(&self, key: &PlanKey) -> Option<Error> {
        let e = self
            .failed
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned()?;
        self.failure_hits.fetch_add(1, Ordering::Relaxed);
        Some(e)
    }

    /// What the folder knows about `key`: a persisted plan rebuilt for `op` (only a tuned one
    /// when `tuned_only`), or a failure record (a hint). A bad file is moved aside and
    /// counted.
    fn recall(
        &self,
        key: &PlanKey,
        op: &OperationGraph,
        target: &Target,
        tuned_only: bool,
    ) -> Recalled {
        let Some(dir) = self.dir.as_ref() else {
            return Recalled::Nothing;
        };
        match read_plan(dir, key, op, target, tuned_only) {
            Ok(Some((plan, record))) => {
                self.restored.fetch_add(1, Ordering::Relaxed);
                // `remember` cannot fail; an error would only lose the restore.
                if let Ok(plan) = self.remember(key.clone(), plan, record) {
                    return Recalled::Plan(plan);
                }
            }
            Ok(None) => {}
            Err(reason) => self.reject(dir, &key.file_name(), &reason, "rebuilding the plan"),
        }
        match read_failure(dir, key) {
            Ok(true) => {
                self.failure_hints.fetch_add(1, Ordering::Relaxed);
                Recalled::FailureHint
            }
            Ok(false) => Recalled::Nothing,
            Err(reason) => {
                self.reject(dir, &key.failure_file_name(), &reason, "planning the graph");
                Recalled::Nothing
            }
        }
    }

    /// A failure record for a graph that has just planned: wrong (another cuDNN's, or
    /// forged), so moved aside.
    fn refute_failure(&self, key: &PlanKey) {
        if let Some(dir) = &self.dir {
            let path = dir.join(key.failure_file_name());
            self.reject(
                dir,
                &key.failure_file_name(),
                &format!(
                    "{}: records that the graph has no engine or plan, but it planned",
                    path.display()
                ),
                "keeping the plan",
            );
        }
    }

    /// Why this cache rejected files (the warnings it printed, without the move), oldest
    /// first; the first [`MAX_REJECTIONS_KEPT`] are kept.
    pub fn rejections(&self) -> Vec<String> {
        self.rejections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn reject(&self, dir: &Path, file: &str, reason: &str, then: &str) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let mut kept = self.rejections.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < MAX_REJECTIONS_KEPT {
            kept.push(reason.to_string());
        }
        drop(kept);
        let aside = move_aside(&dir.join(file));
        stderr::line(&format!("warning: plan cache: {reason}; {aside}; {then}"));
    }

    /// Remembers a fresh "no engine" / "no plan" error (in memory and in the folder); returns
    /// `e`.
    fn failed_with(&self, key: PlanKey, e: Error) -> Error {
        if !matches!(e, Error::NoEngine { .. } | Error::NoPlan { .. }) {
            return e;
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        if let Some(dir) = &self.dir {
            if let Err(w) = write_failure(dir, &key, &e) {
                self.write_failures.fetch_add(1, Ordering::Relaxed);
                stderr::line(&format!(
                    "warning: plan cache: {w}; the failure is remembered in memory only"
                ));
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
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CacheStats {
            hits: n(&self.hits),
            restored: n(&self.restored),
            built: n(&self.built),
            rejected: n(&self.rejected),
            write_failures: n(&self.write_failures),
            failure_hits: n(&self.failure_hits),
            failure_hints: n(&self.failure_hints),
            failures: n(&self.failures),
            tuned: n(&self.tuned_runs),
        }
    }
}
