//! The plan cache's folder: plan and failure files written atomically, read as untrusted
//! input (format, fields, ranges checked; a bad file moved aside).

use super::*;

pub(super) fn file_error(path: &Path, reason: String) -> Error {
    Error::CacheFile {
        path: path.display().to_string(),
        reason,
    }
}

/// A name no other writer uses at the same time: process, thread and a per-process counter.
pub(super) fn temp_name(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let thread = format!("{:?}", std::thread::current().id());
    let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
    path.with_extension(format!("tmp-{}-{thread}-{n}", std::process::id()))
}

/// Moves a rejected file out of the way (renamed beside itself); says what happened.
pub(super) fn move_aside(path: &Path) -> String {
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

/// Writes `doc` to `path` (`0600`) through a temporary file of this writer's own, so a
/// concurrent reader never sees half a file.
pub(super) fn write_doc(path: &Path, doc: &Value) -> Result<()> {
    write_private(path, &temp_name(path), doc.to_string().as_bytes())
        .map_err(|e| file_error(path, format!("cannot write: {e}")))
}

pub(super) fn mode_name(mode: HeurMode) -> &'static str {
    match mode {
        HeurMode::A => "A",
        HeurMode::B => "B",
        HeurMode::Fallback => "Fallback",
    }
}

pub(super) fn write_plan(
    dir: &Path,
    key: &PlanKey,
    plan: &ExecutionPlan,
    record: Option<&TuneRecord>,
) -> Result<()> {
    let path = dir.join(key.file_name());
    let choice = plan.engine_choice().ok_or_else(|| {
        file_error(
            &path,
            "cuDNN did not say which engine and knobs the plan has; nothing to persist".into(),
        )
    })?;
    let knobs: Vec<Value> = choice
        .knobs
        .iter()
        .map(|k| serde_json::json!({"knob": k.knob, "value": k.value}))
        .collect();
    let mut doc = serde_json::json!({
        "format": PLAN_FORMAT,
        "signature": key.signature().text(),
        "target": key.target(),
        "graph": plan.graph_name(),
        "engine": choice.engine,
        "knobs": knobs,
        "mode": plan.heuristics_mode().map(mode_name),
        "config_index": plan.config_index(),
    });
    if let Some(record) = record {
        doc["tune"] = parse_strict_json(&record.to_json())
            .map_err(|e| file_error(&path, format!("the tune record is not JSON: {e}")))?;
    }
    write_doc(&path, &doc)
}

/// What a plan file records, checked field by field.
#[derive(Debug, PartialEq)]
pub(super) struct StoredPlan {
    pub(super) choice: EngineChoice,
    pub(super) mode: Option<HeurMode>,
    pub(super) config_index: usize,
    pub(super) tune: Option<TuneRecord>,
}

/// The fields of a plan file; any other is refused.
pub(super) const PLAN_FIELDS: [&str; 9] = [
    "format",
    "signature",
    "target",
    "graph",
    "engine",
    "knobs",
    "mode",
    "config_index",
    "tune",
];

/// Refuses a document without `format` or of another format, and one with a field not in
/// `fields`.
pub(super) fn check_format(
    doc: &Map<String, Value>,
    format: &str,
    fields: &[&str],
) -> std::result::Result<(), String> {
    match doc.get("format") {
        None => {
            return Err(
                "of an unknown format (no `format` field: an earlier version's file)".into(),
            )
        }
        Some(Value::String(f)) if f == format => {}
        Some(f) => {
            return Err(format!(
                "of an unknown format ({f}; this version reads \"{format}\")"
            ))
        }
    }
    if let Some(k) = doc.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(format!("has an unknown field `{k}`"));
    }
    Ok(())
}

impl StoredPlan {
    pub(super) fn parse(doc: &Map<String, Value>) -> std::result::Result<Self, String> {
        check_format(doc, PLAN_FORMAT, &PLAN_FIELDS)?;
        if !matches!(doc.get("graph"), None | Some(Value::String(_))) {
            return Err("`graph` is not a string".into());
        }
        let engine = doc
            .get("engine")
            .and_then(Value::as_i64)
            .filter(|e| *e >= 0)
            .ok_or("`engine` is not an engine index")?;
        let list = doc
            .get("knobs")
            .and_then(Value::as_array)
            .ok_or("`knobs` is not a list")?;
        if list.len() > MAX_KNOBS {
            return Err(format!(
                "{} knobs, at most {MAX_KNOBS} accepted",
                list.len()
            ));
        }
        let mut knobs = Vec::with_capacity(list.len());
        for (i, k) in list.iter().enumerate() {
            let bad = || format!("knobs[{i}] is not {{\"knob\": type, \"value\": integer}}");
            let k = k.as_object().filter(|k| k.len() == 2).ok_or_else(bad)?;
            let knob = k
                .get("knob")
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(bad)?;
            let value = k.get("value").and_then(Value::as_i64).ok_or_else(bad)?;
            knobs.push(KnobChoice { knob, value });
        }
        let mode = match doc.get("mode") {
            None | Some(Value::Null) => None,
            Some(Value::String(m)) if m == "A" => Some(HeurMode::A),
            Some(Value::String(m)) if m == "B" => Some(HeurMode::B),
            Some(Value::String(m)) if m == "Fallback" => Some(HeurMode::Fallback),
            Some(m) => return Err(format!("`mode` {m} is no heuristics mode")),
        };
        let config_index = doc
            .get("config_index")
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or("`config_index` is not an index")?;
        let tune = match doc.get("tune") {
            None => None,
            Some(t @ Value::Object(_)) => {
                let record = TuneRecord::from_json(&t.to_string())?;
                if record.engine != format!("eng{engine}") || record.config_index != config_index {
                    return Err(format!(
                        "the tune record names {} (config {}) but the file engine {engine} (config {config_index})",
                        record.engine, record.config_index
                    ));
                }
                Some(record)
            }
            Some(_) => return Err("`tune` is not an object".into()),
        };
        Ok(StoredPlan {
            choice: EngineChoice { engine, knobs },
            mode,
            config_index,
            tune,
        })
    }
}

/// A persisted plan for `key`, rebuilt for `op`, with its tune record when it is a tuned
/// plan: `Ok(None)` when there is no file, the file belongs to another key (a hash collision;
/// it will be overwritten), or `tuned_only` and the plan is not tuned; `Err(why)` when the
/// file is unreadable, not trusted, malformed, or names an engine or knobs cuDNN refuses for
/// the graph.
pub(super) fn read_plan(
    dir: &Path,
    key: &PlanKey,
    op: &OperationGraph,
    target: &Target,
    tuned_only: bool,
) -> std::result::Result<Option<(ExecutionPlan, Option<TuneRecord>)>, String> {
    let path = dir.join(key.file_name());
    let at = |why: String| format!("{}: {why}", path.display());
    let Some(doc) = read_doc(&path, key).map_err(at)? else {
        return Ok(None);
    };
    if tuned_only && !doc.contains_key("tune") {
        return Ok(None);
    }
    let stored = StoredPlan::parse(&doc).map_err(|why| at(format!("the file {why}")))?;
    let mut plan = plan_from_choice(op, target, &stored.choice).map_err(|e| {
        at(format!(
            "engine {} with knobs {:?} does not plan the graph: {e}",
            stored.choice.engine, stored.choice.knobs
        ))
    })?;
    plan.set_origin(stored.mode, stored.config_index);
    Ok(Some((plan, stored.tune)))
}

/// The JSON object at `path` when it is `key`'s: `Ok(None)` for no file or another key's.
pub(super) fn read_doc(
    path: &Path,
    key: &PlanKey,
) -> std::result::Result<Option<Map<String, Value>>, String> {
    let text = match read_private_text(path, MAX_PLAN_FILE_BYTES) {
        Ok(text) => text,
        Err(FileProblem::NotFound) => return Ok(None),
        Err(e) => return Err(format!("the file {e}")),
    };
    let doc = parse_strict_json(&text).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(doc) = doc else {
        return Err("not a JSON object".into());
    };
    if doc.get("signature").and_then(Value::as_str) != Some(key.signature().text())
        || doc.get("target").and_then(Value::as_str) != Some(key.target())
    {
        return Ok(None);
    }
    Ok(Some(doc))
}

pub(super) fn write_failure(dir: &Path, key: &PlanKey, e: &Error) -> Result<()> {
    let kind = match e {
        Error::NoEngine { .. } => "no_engine",
        Error::NoPlan { .. } => "no_plan",
        // Only "no engine" and "no plan" are facts about the graph on this target.
        _ => return Ok(()),
    };
    let doc = serde_json::json!({
        "format": FAILURE_FORMAT,
        "signature": key.signature().text(),
        "target": key.target(),
        "kind": kind,
        "error": e.to_string(),
    });
    write_doc(&dir.join(key.failure_file_name()), &doc)
}

/// Whether a well-formed failure record for `key` is in `dir` (same contract as
/// [`read_plan`]). What it says is not read back: it is only a reason to plan again.
pub(super) fn read_failure(dir: &Path, key: &PlanKey) -> std::result::Result<bool, String> {
    let path = dir.join(key.failure_file_name());
    let at = |why: String| format!("{}: {why}", path.display());
    let Some(doc) = read_doc(&path, key).map_err(at)? else {
        return Ok(false);
    };
    check_format(
        &doc,
        FAILURE_FORMAT,
        &["format", "signature", "target", "kind", "error"],
    )
    .map_err(|why| at(format!("the failure record {why}")))?;
    match doc.get("kind").and_then(Value::as_str) {
        Some("no_engine" | "no_plan") => Ok(true),
        _ => Err(at("the failure record is of no known kind".into())),
    }
}
