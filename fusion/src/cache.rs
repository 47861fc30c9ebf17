//! The plan cache: built plans keyed by graph signature + target identity + cuDNN version.
//!
//! A hit is one u64 hash and one string comparison under a read lock. With persistence, each
//! plan's JSON is written to a folder, so a later process re-creates the plan in about a
//! millisecond instead of running heuristics and (for runtime-compiled engines) NVRTC again.

use crate::error::{Error, Result};
use crate::graph::{fnv1a, Graph, GraphSignature};
use crate::lower::{real_tensor_layout, OperationGraph};
use crate::plan::{build_plan, ExecutionPlan};
use crate::target::Target;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

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
}

/// A thread-safe plan cache, optionally persisted to a folder.
#[derive(Debug, Default)]
pub struct PlanCache {
    map: RwLock<HashMap<PlanKey, Arc<ExecutionPlan>>>,
    dir: Option<PathBuf>,
    hits: AtomicU64,
    restored: AtomicU64,
    built: AtomicU64,
}

impl PlanCache {
    /// An in-memory cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache that also writes each built plan's JSON under `dir` and reads it back on a miss.
    pub fn persistent(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::CacheFile {
            path: dir.display().to_string(),
            reason: format!("cannot create the folder: {e}"),
        })?;
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

    /// Puts a plan in memory (and on disk when persistent); returns the shared plan.
    pub fn insert(&self, key: PlanKey, plan: ExecutionPlan) -> Result<Arc<ExecutionPlan>> {
        if let Some(dir) = &self.dir {
            write_plan(dir, &key, &plan)?;
        }
        let plan = Arc::new(plan);
        self.map
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, plan.clone());
        Ok(plan)
    }

    /// The plan for `graph` on `target`: from memory, else from a persisted file, else built
    /// (first plan that finalizes) and stored.
    pub fn get_or_build(&self, graph: &Graph, target: &Target) -> Result<Arc<ExecutionPlan>> {
        let key = PlanKey::new(graph.signature()?, target);
        if let Some(plan) = self.get(&key) {
            return Ok(plan);
        }
        if let Some(dir) = &self.dir {
            if let Some(plan) = read_plan(dir, &key, graph, target)? {
                self.restored.fetch_add(1, Ordering::Relaxed);
                let plan = Arc::new(plan);
                self.map
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key, plan.clone());
                return Ok(plan);
            }
        }
        let op = OperationGraph::new(graph)?;
        let plan = build_plan(&op, target)?;
        self.built.fetch_add(1, Ordering::Relaxed);
        self.insert(key, plan)
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
        }
    }
}

fn file_error(path: &Path, reason: String) -> Error {
    Error::CacheFile {
        path: path.display().to_string(),
        reason,
    }
}

fn write_plan(dir: &Path, key: &PlanKey, plan: &ExecutionPlan) -> Result<()> {
    let path = dir.join(key.file_name());
    let doc = serde_json::json!({
        "signature": key.signature().text(),
        "target": key.target(),
        "graph": plan.graph_name(),
        "plan": plan.json()?,
    });
    // Write then rename, so a concurrent reader never sees half a file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, doc.to_string())
        .and_then(|_| std::fs::rename(&tmp, &path))
        .map_err(|e| file_error(&path, format!("cannot write: {e}")))
}

/// A persisted plan for `key`, if the file exists and was written for exactly this key.
fn read_plan(
    dir: &Path,
    key: &PlanKey,
    graph: &Graph,
    target: &Target,
) -> Result<Option<ExecutionPlan>> {
    let path = dir.join(key.file_name());
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let doc: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| file_error(&path, format!("not valid JSON: {e}")))?;
    // A hash collision or a stale file for another key: ignore it, it will be overwritten.
    if doc["signature"].as_str() != Some(key.signature().text())
        || doc["target"].as_str() != Some(key.target())
    {
        return Ok(None);
    }
    let json = doc["plan"]
        .as_str()
        .ok_or_else(|| file_error(&path, "no `plan` field".into()))?;
    let desc = crate::backend::plan_from_json(json, target.plan_site())
        .map_err(|e| file_error(&path, format!("cuDNN could not restore the plan: {e}")))?;
    ExecutionPlan::from_parts(desc, graph.name().to_string(), real_tensor_layout(graph)).map(Some)
}
