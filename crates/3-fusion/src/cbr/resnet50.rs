//! ResNet-50's unique conv layers as CBR configurations, and a deviceless planning report over
//! them: every graph of a route planned through one [`PlanCache`], one [`GraphRow`] per graph,
//! and a [`Summary`] of which layers' routes are supported.
//!
//! Test scaffolding, built only with the crate's `testing` feature: `tests/deviceless_plans.rs`
//! (a small subset, fused route only) and the GPU tests' shapes (`tests/common/gpu_shapes.rs`)
//! use it.
//!
//! # Recipe
//! 1. [`resnet50_layers`]`(batch)` → `(label, config)` for each unique conv layer.
//! 2. [`plan_layers`]`(&layers, &[true, false], &target, &cache, progress)` → a [`PlanReport`].
//! 3. Print [`GraphRow::table_header`] and each row's [`GraphRow::table_line`] (or
//!    [`GraphRow::json_line`]), then the [`Summary`] (`supported A/B fused, C/D unfused`).

use super::graphs::ApplyResidual;
use super::{route_graphs, CbrConfig, ConvShape, GraphRole};
use crate::cache::{CacheStats, PlanCache};
use crate::target::Target;
use std::fmt;
use std::time::Instant;

/// The input resolution the layer list is built for (ImageNet's 224×224).
pub const INPUT_HW: i64 = 224;

/// One bottleneck stage: labels of its layers, bottleneck width, input channels, input size
/// and the stride of its first block (on the 3×3 conv and the downsample, as torchvision's
/// ResNet-50 v1.5 does).
struct Stage {
    labels: [&'static str; 6],
    width: i64,
    in_channels: i64,
    in_hw: i64,
    stride: i64,
}

const STAGES: [Stage; 4] = [
    Stage {
        labels: [
            "l1.conv1",
            "l1.conv2",
            "l1.conv3",
            "l1.down",
            "l1.b1.conv1",
            "l1.b1.conv2",
        ],
        width: 64,
        in_channels: 64,
        in_hw: 56,
        stride: 1,
    },
    Stage {
        labels: [
            "l2.conv1",
            "l2.conv2",
            "l2.conv3",
            "l2.down",
            "l2.b1.conv1",
            "l2.b1.conv2",
        ],
        width: 128,
        in_channels: 256,
        in_hw: 56,
        stride: 2,
    },
    Stage {
        labels: [
            "l3.conv1",
            "l3.conv2",
            "l3.conv3",
            "l3.down",
            "l3.b1.conv1",
            "l3.b1.conv2",
        ],
        width: 256,
        in_channels: 512,
        in_hw: 28,
        stride: 2,
    },
    Stage {
        labels: [
            "l4.conv1",
            "l4.conv2",
            "l4.conv3",
            "l4.down",
            "l4.b1.conv1",
            "l4.b1.conv2",
        ],
        width: 512,
        in_channels: 1024,
        in_hw: 14,
        stride: 2,
    },
];

/// ResNet-50's unique conv layers at 224×224 input and batch `batch`, as `(label, config)` in
/// network order.
///
/// - `stem`: the 7×7 stride-2 conv, C=3 → 64, 224 → 112 ([`CbrConfig::first`]); its activation
///   is materialized (`with_apply(ApplyResidual::None)`) because the max-pool reads it.
/// - Per stage `lN` (N = 1..4; output 56, 28, 14, 7): block 0's `lN.conv1` (1×1 from the
///   stored block input, [`CbrConfig::after_activation`]), `lN.conv2` (3×3 with conv1's BN as
///   its prologue, carries the stage's stride), `lN.conv3` (1×1 with conv2's BN as prologue,
///   the block output joining the projection's BN:
///   `with_apply(ApplyResidual::DualScaleBias)`) and `lN.down` (the 1×1 projection conv from
///   the stored block input, strided like `conv2`, `with_shortcut_bn()`); then the convs of
///   blocks 1 and up that differ from block 0's: `lN.b1.conv1` (1×1 from 4·width channels)
///   and `lN.b1.conv2` (the 3×3 at stride 1). A layer identical to an earlier one is listed
///   once. Later blocks' conv3 (identity shortcut, `ApplyResidual::Add`) differ from block 0's
///   only in the residual form; the network compiler (`cudnn_cbr::net`) plans every layer of
///   the whole network.
///
/// A non-positive `batch` gives shapes that every graph build rejects with a validation
/// error.
pub fn resnet50_layers(batch: i64) -> Vec<(&'static str, CbrConfig)> {
    let stem_hw = INPUT_HW;
    let mut layers = vec![(
        "stem",
        CbrConfig::first(ConvShape::square(batch, 3, stem_hw, 64, 7, 3, 2))
            .with_apply(ApplyResidual::None),
    )];
    for stage in &STAGES {
        let (w, cin, hw, st) = (stage.width, stage.in_channels, stage.in_hw, stage.stride);
        let out_hw = hw / st;
        // conv1 and the projection read the stored block input; conv2 and conv3 take the
        // previous BN+ReLU as their prologue; block 0's output joins the projection's BN
        // (dual scale-bias), later blocks' the identity.
        let candidates = [
            CbrConfig::after_activation(ConvShape::square(batch, cin, hw, w, 1, 0, 1)),
            CbrConfig::new(ConvShape::square(batch, w, hw, w, 3, 1, st)),
            CbrConfig::new(ConvShape::square(batch, w, out_hw, 4 * w, 1, 0, 1))
                .with_apply(ApplyResidual::DualScaleBias),
            CbrConfig::after_activation(ConvShape::square(batch, cin, hw, 4 * w, 1, 0, st))
                .with_shortcut_bn(),
            CbrConfig::after_activation(ConvShape::square(batch, 4 * w, out_hw, w, 1, 0, 1)),
            CbrConfig::new(ConvShape::square(batch, w, out_hw, w, 3, 1, 1)),
        ];
        for (label, config) in stage.labels.into_iter().zip(candidates) {
            if !layers.iter().any(|(_, c)| *c == config) {
                layers.push((label, config));
            }
        }
    }
    layers
}

/// The route name of `fused`: "fused" or "unfused".
pub fn route_name(fused: bool) -> &'static str {
    if fused {
        "fused"
    } else {
        "unfused"
    }
}

/// Where a graph's plan came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanSource {
    /// Built now: heuristics and plan finalize (and runtime compilation where the engine needs
    /// it).
    Built,
    /// Re-created from a persisted plan file (engine and config counts are then unknown).
    Restored,
    /// Already in the cache's memory (an identical graph of an earlier row).
    Hit,
}

impl PlanSource {
    /// "built", "restored" or "hit".
    pub fn name(self) -> &'static str {
        match self {
            PlanSource::Built => "built",
            PlanSource::Restored => "restored",
            PlanSource::Hit => "hit",
        }
    }

    /// The source implied by the cache counters before and after one lookup.
    fn between(before: CacheStats, after: CacheStats) -> Self {
        if after.built > before.built {
            PlanSource::Built
        } else if after.restored > before.restored {
            PlanSource::Restored
        } else {
            PlanSource::Hit
        }
    }
}

/// What a finalized plan reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedGraph {
    /// Engine configs heuristics reported and usable on the target; `None` for a plan
    /// restored from a persisted file (no heuristics ran).
    pub configs: Option<(usize, usize)>,
    /// The chosen engine ([`ExecutionPlan::engine_tag`](crate::plan::ExecutionPlan::engine_tag)).
    pub engine: String,
    /// Workspace bytes.
    pub workspace: usize,
    /// Whether cuDNN compiles the engine at run time.
    pub runtime_compiled: bool,
    /// Where the plan came from.
    pub source: PlanSource,
}

/// One graph of one route of one layer, and how planning it went.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphRow {
    /// Layer label, e.g. `l2.down`.
    pub layer: &'static str,
    /// The conv shape's label ([`ConvShape::label`]).
    pub shape: String,
    /// Whether this is the fused route.
    pub fused: bool,
    /// The graph's role in the layer.
    pub role: GraphRole,
    /// The graph's name, e.g. `scale_bias_relu_conv_genstats`.
    pub graph: String,
    /// Milliseconds the plan lookup took (build, restore or hit).
    pub build_ms: f64,
    /// The plan, or the error text when no plan finalized.
    pub outcome: Result<PlannedGraph, String>,
}

/// Characters of an error the table shows.
const TABLE_ERROR_CHARS: usize = 110;

impl GraphRow {
    /// Whether the graph's plan finalized.
    pub fn is_supported(&self) -> bool {
        self.outcome.is_ok()
    }

    /// The column header matching [`GraphRow::table_line`].
    pub fn table_header() -> String {
        format!(
            "{:<12} {:<28} {:<7} {:<17} {:<30} {:>9} {:>8} {:>10} {:>9} {:<8}",
            "layer",
            "shape",
            "route",
            "role",
            "graph",
            "engines",
            "engine",
            "workspace",
            "build ms",
            "plan"
        )
    }

    /// One table line: engines as reported/usable, the chosen engine, workspace bytes, build
    /// milliseconds and where the plan came from; or the error text, truncated, on one line.
    pub fn table_line(&self) -> String {
        let head = format!(
            "{:<12} {:<28} {:<7} {:<17} {:<30}",
            self.layer,
            self.shape,
            route_name(self.fused),
            format!("{:?}", self.role),
            self.graph
        );
        match &self.outcome {
            Ok(p) => format!(
                "{head} {:>9} {:>8} {:>10} {:>9.1} {:<8}",
                p.configs
                    .map_or_else(|| "-".into(), |(r, u)| format!("{r}/{u}")),
                p.engine,
                p.workspace,
                self.build_ms,
                p.source.name()
            ),
            Err(e) => format!(
                "{head} FAILED ({:.1} ms): {}",
                self.build_ms,
                one_line(e, TABLE_ERROR_CHARS)
            ),
        }
    }

    /// The row as one JSON object (on one line); a failure carries the full error text.
    pub fn json_line(&self) -> String {
        let mut v = serde_json::json!({
            "layer": self.layer,
            "shape": self.shape,
            "route": route_name(self.fused),
            "role": format!("{:?}", self.role),
            "graph": self.graph,
            "build_ms": (self.build_ms * 1000.0).round() / 1000.0,
            "supported": self.is_supported(),
        });
        match &self.outcome {
            Ok(p) => {
                v["configs_reported"] = p.configs.map(|c| c.0).into();
                v["configs_usable"] = p.configs.map(|c| c.1).into();
                v["engine"] = p.engine.clone().into();
                v["workspace"] = p.workspace.into();
                v["runtime_compiled"] = p.runtime_compiled.into();
                v["plan"] = p.source.name().into();
            }
            Err(e) => v["error"] = e.clone().into(),
        }
        v.to_string()
    }
}

/// `text` on one line (whitespace runs collapsed), at most `max` characters, `…` when cut.
fn one_line(text: &str, max: usize) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        flat
    } else {
        let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

/// Supported layers of one route: a layer's route is supported when every one of its graphs'
/// plans finalizes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteCount {
    /// Layers whose route is supported.
    pub supported: usize,
    /// Layers planned on the route.
    pub layers: usize,
}

/// Supported layers per route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// The fused route.
    pub fused: RouteCount,
    /// The unfused route.
    pub unfused: RouteCount,
}

impl Summary {
    /// The summary as one JSON object (with the text line under `summary`).
    pub fn json_line(&self) -> String {
        serde_json::json!({
            "summary": self.to_string(),
            "fused_supported": self.fused.supported,
            "fused_layers": self.fused.layers,
            "unfused_supported": self.unfused.supported,
            "unfused_layers": self.unfused.layers,
        })
        .to_string()
    }
}

impl fmt::Display for Summary {
    /// `supported A/B fused, C/D unfused`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "supported {}/{} fused, {}/{} unfused",
            self.fused.supported, self.fused.layers, self.unfused.supported, self.unfused.layers
        )
    }
}

/// Every graph row, in planning order, and the per-route summary.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanReport {
    /// One row per graph: layer by layer, each layer's routes in the order asked.
    pub rows: Vec<GraphRow>,
    /// Supported layers per route.
    pub summary: Summary,
}

/// Plans every graph of each route in `routes` (`true` = fused) for each layer on `target`
/// through `cache`. A graph whose plan does not finalize (no engine, or any other error) becomes
/// a row with its error text; planning goes on. `progress(row, done, total)` is called after
/// each graph (`done` counts from 1), e.g. to report the slow, runtime-compiled graphs.
pub fn plan_layers(
    layers: &[(&'static str, CbrConfig)],
    routes: &[bool],
    target: &Target,
    cache: &PlanCache,
    mut progress: impl FnMut(&GraphRow, usize, usize),
) -> PlanReport {
    let work: Vec<_> = layers
        .iter()
        .flat_map(|(label, config)| {
            routes
                .iter()
                .map(move |&fused| (*label, config, fused, route_graphs(config, fused)))
        })
        .collect();
    let total = work.iter().map(|(_, _, _, graphs)| graphs.len()).sum();
    let mut rows = Vec::with_capacity(total);
    let mut summary = Summary::default();
    for (label, config, fused, graphs) in work {
        let mut all_ok = true;
        for layer_graph in graphs {
            let (role, graph) = (layer_graph.role, layer_graph.graph);
            let before = cache.stats();
            let start = Instant::now();
            let result = cache.get_or_build(&graph, target);
            let build_ms = start.elapsed().as_secs_f64() * 1e3;
            let outcome = match result {
                Ok(plan) => Ok(PlannedGraph {
                    // A plan heuristics chose has at least one usable config; a restored one none.
                    configs: (plan.config_counts().1 > 0).then(|| plan.config_counts()),
                    engine: plan.engine_tag(),
                    workspace: plan.workspace_size(),
                    runtime_compiled: plan.is_runtime_compiled(),
                    source: PlanSource::between(before, cache.stats()),
                }),
                Err(e) => Err(e.to_string()),
            };
            all_ok &= outcome.is_ok();
            rows.push(GraphRow {
                layer: label,
                shape: config.shape.label(),
                fused,
                role,
                graph: graph.name().to_string(),
                build_ms,
                outcome,
            });
            let row = rows.last().expect("a row was just pushed");
            progress(row, rows.len(), total);
        }
        let count = if fused {
            &mut summary.fused
        } else {
            &mut summary.unfused
        };
        count.layers += 1;
        count.supported += usize::from(all_ok);
    }
    PlanReport { rows, summary }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cbr::InputKind;

    #[test]
    fn the_layer_list_has_every_unique_conv_of_resnet50() {
        let layers = resnet50_layers(32);
        assert_eq!(layers.len(), 24);
        let mut distinct: Vec<ConvShape> = layers.iter().map(|(_, c)| c.shape).collect();
        distinct.sort_by_key(|s| (s.c, s.h, s.k, s.r, s.stride));
        distinct.dedup();
        assert_eq!(distinct.len(), 23, "l1.down shares l1.conv3's shape only");
        let labels: Vec<&str> = layers.iter().map(|(l, _)| *l).collect();
        let mut unique_labels = labels.clone();
        unique_labels.sort_unstable();
        unique_labels.dedup();
        assert_eq!(unique_labels.len(), labels.len(), "labels are unique");
        assert!(layers.iter().all(|(_, c)| c.shape.n == 32));
    }

    #[test]
    fn output_sizes_follow_the_stages() {
        let layers = resnet50_layers(8);
        let out = |label: &str| {
            let (_, c) = layers.iter().find(|(l, _)| *l == label).expect(label);
            (c.shape.p(), c.shape.q(), c.shape.k)
        };
        assert_eq!(out("stem"), (112, 112, 64));
        assert_eq!(out("l1.conv2"), (56, 56, 64));
        assert_eq!(out("l1.conv3"), (56, 56, 256));
        assert_eq!(out("l2.conv2"), (28, 28, 128));
        assert_eq!(out("l2.down"), (28, 28, 512));
        assert_eq!(out("l3.conv3"), (14, 14, 1024));
        assert_eq!(out("l4.down"), (7, 7, 2048));
        assert_eq!(out("l4.b1.conv2"), (7, 7, 512));
        // Each stage's convs after its first 1×1 end at the stage's output size.
        for (label, config) in &layers {
            let expected = match &label[..2] {
                "st" => 112,
                "l1" => 56,
                "l2" => 28,
                "l3" => 14,
                _ => 7,
            };
            if !label.ends_with(".conv1") {
                assert_eq!(config.shape.p(), expected, "{label}");
            }
        }
    }

    #[test]
    fn configs_follow_the_block_structure() {
        let layers = resnet50_layers(32);
        let (first, stem) = &layers[0];
        assert_eq!(*first, "stem");
        assert_eq!(stem.input, InputKind::Raw);
        assert_eq!(
            (stem.shape.c, stem.shape.h, stem.shape.r, stem.shape.pad),
            (3, 224, 7, 3)
        );
        // The bottleneck's dataflow: conv1 and the projection read the stored block input,
        // conv2 and conv3 take the previous BN as their prologue, the block output joins the
        // projection's BN.
        for (label, config) in &layers[1..] {
            let reads_input = label.ends_with(".conv1") || label.ends_with(".down");
            let expected = if reads_input {
                InputKind::Raw
            } else {
                InputKind::ThroughBn
            };
            assert_eq!(config.input, expected, "{label}");
            let apply = label
                .ends_with(".conv3")
                .then_some(ApplyResidual::DualScaleBias);
            assert_eq!(config.apply, apply, "{label}");
            assert_eq!(config.shortcut_bn, label.ends_with(".down"), "{label}");
            assert!(config.input_grad, "{label}");
        }
        // Strided convs: the stem, and the first 3×3 and the downsample of stages 2-4.
        let strided: Vec<&str> = layers
            .iter()
            .filter(|(_, c)| c.shape.stride == 2)
            .map(|(l, _)| *l)
            .collect();
        assert_eq!(
            strided,
            ["stem", "l2.conv2", "l2.down", "l3.conv2", "l3.down", "l4.conv2", "l4.down"]
        );
    }

    #[test]
    fn summary_line_and_error_text() {
        let summary = Summary {
            fused: RouteCount {
                supported: 20,
                layers: 24,
            },
            unfused: RouteCount {
                supported: 24,
                layers: 24,
            },
        };
        assert_eq!(summary.to_string(), "supported 20/24 fused, 24/24 unfused");
        let v: serde_json::Value = serde_json::from_str(&summary.json_line()).unwrap();
        assert_eq!(v["fused_supported"], 20);
        assert_eq!(one_line("a\n  b", 10), "a b");
        assert_eq!(one_line("abcdefghijkl", 5).chars().count(), 5);
        let row = GraphRow {
            layer: "stem",
            shape: "s".into(),
            fused: true,
            role: GraphRole::ConvStats,
            graph: "g".into(),
            build_ms: 1.0,
            outcome: Err("no engine\nfor this".into()),
        };
        assert!(!row.is_supported());
        assert!(row.table_line().contains("FAILED"));
        assert!(row.table_line().contains("no engine for this"));
        let v: serde_json::Value = serde_json::from_str(&row.json_line()).unwrap();
        assert_eq!(v["supported"], false);
    }
}
