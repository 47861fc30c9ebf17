//! Tier 2: the BF16 canary (docs/cudnn-graphs.md §11). Every CBR graph of ours, with its FP16
//! tensors retyped to BF16 ([`Graph::retype`]; statistics and FP32 vectors unchanged), is
//! planned deviceless on the H200, A100 and B200 fixtures through the normal lowering and
//! heuristics, and the table (graph × fixture → planned or refused, with cuDNN's reason) is
//! printed. The specialised fused graphs must still be refused: the day a cuDNN plans one,
//! this test fails and says that a BF16 training mode can be built. Each of them is planned in
//! FP16 first: where that plans, its BF16 refusal must name the data type, in cuDNN's reason
//! for the very engine that took the FP16 graph. The graphs that plan in BF16 are asserted too,
//! so the probe is shown to work.
//!
//! cuDNN's reasons come from its own warning log (`CUDNN_LOGLEVEL_DBG=2`), which it writes to
//! `CUDNN_LOGDEST_DBG`: both are read when the library loads, so this file holds one test that
//! sets them before anything loads cuDNN.

mod common;

use cudnn_cbr::fusion::cbr::graphs::{self, ApplyResidual, BackwardResidual};
use cudnn_cbr::fusion::cbr::ConvShape;
use cudnn_cbr::fusion::graph::Graph;
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::runtime::DataType;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

/// What we measured for a graph in BF16 with cuDNN 9.28.1 (docs/cudnn-graphs.md §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A specialised fused engine that matches FP16 only: refused (the canary).
    Refused,
    /// Planned (precompiled or runtime-compiled engines).
    Plans,
    /// No engine in FP16 either at this shape, so the graph says nothing about BF16: shown in
    /// the table, asserted neither way.
    NoEngine,
}

/// Whether the FP16 form of a fused graph plans on a fixture, as measured: sm_100 has no
/// engine for the prologue forms (conv + GenStats and wgrad with the BN-apply prologue; the
/// same as tests/network_plans.rs finds for whole networks). Elsewhere a fused graph that no
/// longer plans in FP16 leaves the canary without its baseline, and the test fails.
fn fp16_fused_plans(label: &str, graph: &str) -> bool {
    !(label.starts_with("B200") && graph.starts_with("scale_bias_relu_"))
}

/// One graph to probe: its FP16 form as production builds it, and the expectation in BF16.
struct Probe {
    graph: Graph,
    expect: Expect,
    /// Outputs to keep FP32 after retyping (BN finalize's eq_scale/eq_bias: our validation
    /// accepts only FP16 or FP32 there, and a BF16 mode would keep these vectors FP32).
    float_outputs: bool,
}

fn probe(graph: Graph, expect: Expect) -> Probe {
    Probe {
        graph,
        expect,
        float_outputs: false,
    }
}

/// Every graph of `fusion::cbr::graphs` that has an FP16 tensor (`dbn_coefficients` has none).
fn probes(shape: &ConvShape) -> Vec<Probe> {
    use Expect::*;
    let y = shape.y_dims();
    let (none, add, dual) = (
        ApplyResidual::None,
        ApplyResidual::Add,
        ApplyResidual::DualScaleBias,
    );
    vec![
        // Specialised fused engines (docs/cudnn-graphs.md §2, §5.1, §5.2).
        probe(graphs::conv_fprop(shape, true, true).0, Refused),
        probe(graphs::wgrad(shape, true).0, Refused),
        probe(
            graphs::dgrad_drelu_dbn(shape, BackwardResidual::None).0,
            Refused,
        ),
        probe(
            graphs::dgrad_drelu_dbn(shape, BackwardResidual::FuseAdd).0,
            Refused,
        ),
        // Convolutions without a prologue.
        probe(graphs::conv_fprop(shape, false, true).0, Plans),
        probe(graphs::conv_fprop(shape, false, false).0, Plans),
        probe(graphs::conv_dgrad(shape).0, Plans),
        probe(graphs::wgrad(shape, false).0, Plans),
        // BN finalize with FP32 eq_scale/eq_bias.
        Probe {
            float_outputs: true,
            ..probe(graphs::bn_finalize(shape.k).0, Plans)
        },
        // The apply and pointwise graphs (runtime-compiled).
        probe(graphs::apply(y, DataType::Half, none).0, Plans),
        probe(graphs::apply(y, DataType::Half, add).0, Plans),
        probe(graphs::apply(y, DataType::Half, dual).0, Plans),
        probe(graphs::dbn_apply(shape.x_dims()).0, Plans),
        probe(graphs::relu_forward(y).0, Plans),
        probe(graphs::relu_backward(y).0, Plans),
        probe(graphs::add(y).0, Plans),
        probe(graphs::dbn_reduce(y).0, Plans),
        probe(graphs::channel_stats(y).0, Plans),
        // The unfused BN forward and backward.
        probe(graphs::batchnorm_forward(y).0, Plans),
        probe(graphs::batchnorm_activation(y, none).0, Plans),
        probe(graphs::batchnorm_activation(y, add).0, Plans),
        probe(graphs::batchnorm_activation(y, dual).0, NoEngine),
        probe(graphs::batchnorm_backward(y).0, Plans),
    ]
}

/// `graph` with every FP16 tensor in BF16; panics if nothing changed (the probe would then
/// test FP16 again).
fn bf16(p: &Probe) -> Graph {
    let mut g = p.graph.clone();
    let changed = g.retype(DataType::Half, DataType::BFloat16);
    assert!(changed > 0, "{}: no FP16 tensor to retype", g.name());
    if p.float_outputs {
        let outputs = g.nodes().last().expect("a node").outputs();
        for t in outputs {
            if g.dtype(t) == Some(DataType::BFloat16) {
                g.set_output(t, Some(DataType::Float)).expect("in graph");
            }
        }
    }
    g
}

/// cuDNN's warning log, read in pieces: each [`CudnnLog::take`] returns what cuDNN wrote since
/// the last one.
struct CudnnLog {
    path: PathBuf,
    read: u64,
}

impl CudnnLog {
    /// Points cuDNN's debug log at a temporary file at warning level, unless the caller has
    /// already chosen a log level (then reasons come from `cudnnGetLastErrorString` only).
    /// Must run before cuDNN is loaded.
    fn install() -> Option<CudnnLog> {
        if std::env::var_os("CUDNN_LOGLEVEL_DBG").is_some() {
            return None;
        }
        let path = std::env::temp_dir().join(format!("bf16_canary-{}.log", std::process::id()));
        std::fs::write(&path, b"").ok()?;
        std::env::set_var("CUDNN_LOGLEVEL_DBG", "2");
        std::env::set_var("CUDNN_LOGDEST_DBG", &path);
        Some(CudnnLog { path, read: 0 })
    }

    fn take(&mut self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.path) {
            if f.seek(SeekFrom::Start(self.read)).is_ok() {
                let _ = f.read_to_string(&mut text);
            }
        }
        self.read += text.len() as u64;
        text
    }
}

impl Drop for CudnnLog {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// cuDNN's reason for refusing a graph, from its log text. The first `Reason:` of each engine
/// config's error stack is where that config failed (the lines after it are the call chain).
/// The configs of `engine` (the one that plans the FP16 graph) are asked first; otherwise, or
/// when the log has none of them, every config counts, except those whose engine does not
/// exist for the pattern or the architecture (they say nothing about the graph). The most
/// frequent reason wins, the first seen on a tie.
fn reason(log: &str, engine: Option<i64>) -> Option<String> {
    // (engine id of the stack, leaf reason)
    let mut leaves: Vec<(Option<i64>, String)> = Vec::new();
    let mut stack: Option<Option<i64>> = None;
    for line in log.lines() {
        if let Some(at) = line.find("\"engineId\":") {
            let id = line[at + "\"engineId\":".len()..]
                .split(|c: char| c != '-' && !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse().ok());
            stack = Some(id);
            continue;
        }
        let Some(at) = line.find("CUDNN_STATUS_") else {
            continue;
        };
        if !line.contains("Reason:") {
            continue;
        }
        if let Some(id) = stack.take() {
            leaves.push((id, line[at + "CUDNN_STATUS_".len()..].trim().to_string()));
        }
    }
    let of_engine: Vec<&String> = leaves
        .iter()
        .filter(|(id, _)| engine.is_some() && *id == engine)
        .map(|(_, l)| l)
        .collect();
    let candidates = if of_engine.is_empty() {
        leaves
            .iter()
            .map(|(_, l)| l)
            .filter(|l| !l.contains("ARCH_MISMATCH") && !l.contains("is not found for"))
            .collect()
    } else {
        of_engine
    };
    let mut counts: Vec<(&String, usize)> = Vec::new();
    for l in candidates {
        match counts.iter_mut().find(|(c, _)| *c == l) {
            Some((_, n)) => *n += 1,
            None => counts.push((l, 1)),
        }
    }
    let best = counts.iter().map(|(_, n)| *n).max()?;
    counts
        .into_iter()
        .find(|(_, n)| *n == best)
        .map(|(l, _)| l.clone())
}

/// A graph planned: its engine.
struct Planned {
    tag: String,
    global_index: Option<i64>,
    runtime_compiled: bool,
}

/// A graph refused: our error, and cuDNN's reason when its log gives one.
struct Refused {
    error: String,
    reason: Option<String>,
}

impl Refused {
    /// cuDNN's reason, else the first line of our error.
    fn why(&self) -> String {
        self.reason
            .clone()
            .unwrap_or_else(|| self.error.lines().next().unwrap_or_default().to_string())
    }
}

/// Plans `graph` for `target` (heuristics mode A then fallback, the first config that
/// finalizes); on refusal, the reason is looked up for `engine` first (see [`reason`]).
fn plan(
    graph: &Graph,
    target: &Target,
    log: &mut Option<CudnnLog>,
    engine: Option<i64>,
) -> Result<Planned, Refused> {
    if let Some(log) = log.as_mut() {
        log.take();
    }
    let result = OperationGraph::new(graph).and_then(|op| build_plan(&op, target));
    match result {
        Ok(p) => Ok(Planned {
            tag: p.engine_tag(),
            global_index: p.engine().map(|e| e.global_index),
            runtime_compiled: p.is_runtime_compiled(),
        }),
        Err(e) => {
            let text = match log.as_mut() {
                Some(log) => log.take(),
                None => cudnn_cbr::sys::library()
                    .map(|l| l.last_error_string())
                    .unwrap_or_default(),
            };
            Err(Refused {
                error: e.to_string(),
                reason: reason(&text, engine),
            })
        }
    }
}

#[test]
fn bf16_is_refused_by_the_fused_engines_and_planned_elsewhere() {
    let mut log = CudnnLog::install();
    let test = "bf16_is_refused_by_the_fused_engines_and_planned_elsewhere";
    let Some(lib) = common::cudnn_or_skip(test) else {
        return;
    };
    // Small batch keeps the runtime-compiled plans cheap; 64 channels suit every engine.
    let shape = ConvShape::square(8, 64, 28, 64, 3, 1, 1);
    let probes = probes(&shape);
    let mut accepted = Vec::new();
    let mut unexpected = Vec::new();
    let mut broken = Vec::new();
    println!(
        "cuDNN {}, {}",
        lib.version(),
        if log.is_some() {
            "reasons from cuDNN's warning log"
        } else {
            "reasons from cudnnGetLastErrorString"
        }
    );
    println!(
        "{:<12} {:<36} {:<8} {:<8} engine / cuDNN's reason",
        "target", "graph", "FP16", "BF16"
    );
    for (label, path) in common::devprops_fixtures() {
        let target = Target::deviceless_from_file(&path).unwrap();
        for p in &probes {
            let name = p.graph.name();
            // The canary's FP16 baseline: where the FP16 graph does not plan either, a BF16
            // refusal says nothing about BF16. Other graphs plan FP16 (tests/deviceless_graphs.rs,
            // tests/network_plans.rs); their baseline is planned only to explain a refusal.
            let mut fp16 =
                (p.expect != Expect::Plans).then(|| plan(&p.graph, &target, &mut log, None));
            let engine = fp16
                .as_ref()
                .and_then(|r| r.as_ref().ok())
                .and_then(|p| p.global_index);
            let bf16 = plan(&bf16(p), &target, &mut log, engine);
            if p.expect == Expect::Plans && bf16.is_err() {
                fp16 = Some(plan(&p.graph, &target, &mut log, None));
            }
            let fp16_col = match &fp16 {
                None => "-".to_string(),
                Some(Ok(planned)) => planned.tag.clone(),
                Some(Err(_)) => "refused".to_string(),
            };
            let (status, detail) = match &bf16 {
                Ok(planned) => (
                    "planned",
                    format!(
                        "{}{}",
                        planned.tag,
                        if planned.runtime_compiled {
                            " (runtime-compiled)"
                        } else {
                            ""
                        }
                    ),
                ),
                Err(refused) => ("refused", refused.why()),
            };
            println!("{label:<12} {name:<36} {fp16_col:<8} {status:<8} {detail}");
            if let Some(Err(refused)) = &fp16 {
                println!("{:<12} {:<36} FP16 refused: {}", "", "", refused.why());
            }
            match (p.expect, &bf16) {
                (Expect::Refused, Ok(_)) => accepted.push(format!("{label} {name}: {detail}")),
                (Expect::Refused, Err(refused)) => match &fp16 {
                    // Where FP16 plans, the BF16 refusal must be about the data type, not
                    // about something else the retyping broke.
                    Some(Ok(_)) if log.is_some() && !refused.why().contains("CUDNN_DATA_HALF") => {
                        broken.push(format!(
                            "{label} {name}: refused in BF16, but not for the data type: {}",
                            refused.why()
                        ))
                    }
                    Some(Err(fp16)) if fp16_fused_plans(label, name) => broken.push(format!(
                        "{label} {name}: the FP16 graph no longer plans, so the canary has no \
                         baseline: {}",
                        fp16.error
                    )),
                    _ => {}
                },
                (Expect::Plans, Err(refused)) => {
                    unexpected.push(format!("{label} {name}: {}", refused.error))
                }
                (Expect::Plans, Ok(_)) | (Expect::NoEngine, _) => {}
            }
        }
    }
    assert!(
        accepted.is_empty(),
        "cuDNN {} now accepts BF16 for a fused CBR graph: build a BF16 training mode \
         (docs/cudnn-graphs.md §11).\n{}",
        lib.version(),
        accepted.join("\n")
    );
    assert!(
        unexpected.is_empty(),
        "graphs that planned in BF16 no longer do (the probe is broken, or cuDNN changed):\n{}",
        unexpected.join("\n")
    );
    assert!(
        broken.is_empty(),
        "the canary's fused graphs are refused for another reason than BF16:\n{}",
        broken.join("\n")
    );
}
