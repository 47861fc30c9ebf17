//! Tier 2: the evaluation-mode (inference) graphs of ResNet-50, planned deviceless on the
//! H200, A100 and B200 fixtures. Evaluation folds each BN into a per-channel scale and bias
//! from the running statistics; three forms can run it, and this records which plan where:
//!
//! - **prologue**: the training route's conv with the previous BN as its prologue, minus
//!   GenStats (`scale_bias_relu_conv`, or a plain conv for a layer that reads a stored
//!   input), then the layer's own apply where it materializes its activation;
//! - **epilogue**: the conv with its own BN (and the residual add and ReLU) as its epilogue
//!   (`conv_scale_bias[_add]_relu`, `conv_scale_bias` for a projection shortcut);
//! - **unfused**: a plain conv and a pointwise scale-bias(-add)-ReLU graph (the fallback).
//!
//! Each distinct layer of ResNet-50 at batch 256, 224×224, is planned in every form on every
//! fixture; every layer must have at least one form that plans (the unfused one is made of
//! the training step's own graphs), and the table says which forms did.

mod common;

use cudnn_cbr::fusion::cbr::graphs::{self, ApplyResidual};
use cudnn_cbr::fusion::cbr::{CbrConfig, RouteKind};
use cudnn_cbr::fusion::graph::Graph;
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::net::{compile, Preset, RoutePolicy};
use cudnn_cbr::runtime::DataType;
use std::collections::BTreeMap;
use std::time::Instant;

/// One distinct evaluation-mode layer: its config and whether it reads the previous BN
/// through its prologue in the fused network.
#[derive(Clone)]
struct EvalLayer {
    name: String,
    config: CbrConfig,
    prologue: bool,
    /// Its BN output is a projection shortcut's (no ReLU; read by the block's last apply).
    shortcut: bool,
}

impl EvalLayer {
    fn key(&self) -> String {
        format!(
            "{} prologue={} apply={:?} shortcut={}",
            self.config.shape.label(),
            self.prologue,
            self.config.apply,
            self.shortcut
        )
    }

    /// The graphs of each form.
    fn forms(&self) -> [(&'static str, Vec<Graph>); 3] {
        let s = &self.config.shape;
        let own_apply = |g: &mut Vec<Graph>| {
            if let Some(res) = self.config.apply {
                g.push(graphs::apply(s.y_dims(), DataType::Half, res).0);
            }
        };
        let mut prologue = vec![graphs::conv_fprop(s, self.prologue, false).0];
        own_apply(&mut prologue);
        let residual = self.config.apply.unwrap_or(ApplyResidual::None);
        let epilogue = vec![graphs::conv_scale_bias_relu(s, residual, !self.shortcut).0];
        let mut unfused = vec![graphs::conv_fprop(s, false, false).0];
        match self.config.apply {
            Some(res) => unfused.push(graphs::apply(s.y_dims(), DataType::Half, res).0),
            // The shortcut's BN is folded into the block's dual apply; any other BN's
            // activation is materialized for the next (plain) conv.
            None if self.shortcut => {}
            None => unfused.push(graphs::scale_bias_relu(s.y_dims(), DataType::Half).0),
        }
        [
            ("prologue", prologue),
            ("epilogue", epilogue),
            ("unfused", unfused),
        ]
    }
}

fn distinct_layers() -> Vec<EvalLayer> {
    let spec = Preset::ResNet50.spec(3, 1000, 0);
    let net = compile(&spec, 256, 224, &RoutePolicy::Uniform(RouteKind::Fused)).unwrap();
    let mut out: BTreeMap<String, EvalLayer> = BTreeMap::new();
    for l in &net.layers {
        let e = EvalLayer {
            name: l.name.clone(),
            config: *l.layer.config(),
            prologue: l.prev.is_some(),
            shortcut: l.layer.config().shortcut_bn,
        };
        out.entry(e.key()).or_insert(e);
    }
    out.into_values().collect()
}

// One test per fixture, so the harness plans them side by side (planning is
// single-threaded).
#[test]
fn resnet50_inference_graphs_plan_on_the_h200() {
    inference_graphs_plan(0);
}
#[test]
fn resnet50_inference_graphs_plan_on_the_a100() {
    inference_graphs_plan(1);
}
#[test]
fn resnet50_inference_graphs_plan_on_the_b200() {
    inference_graphs_plan(2);
}

/// Every distinct layer in every form on fixture `fixture`: at least one form plans for
/// each, and the unfused form (the training step's own graphs) for all.
fn inference_graphs_plan(fixture: usize) {
    let Some(_) = common::cudnn_or_skip("resnet50_inference_graphs_plan_on_every_fixture") else {
        return;
    };
    let fixtures = common::devprops_fixtures();
    assert_eq!(fixtures.len(), 3, "a new fixture needs its test here");
    let (label, path) = &fixtures[fixture];
    let layers = distinct_layers();
    assert!(layers.len() >= 10, "{} distinct layers", layers.len());
    // form → layers whose every graph planned.
    let mut table: BTreeMap<&'static str, usize> = BTreeMap::new();
    // A graph planned once, whichever layer asks (by name and shape).
    let mut planned: BTreeMap<String, Result<String, String>> = BTreeMap::new();
    let target = Target::deviceless_from_file(path).unwrap();
    let start = Instant::now();
    for l in &layers {
        let mut any = false;
        let mut row = Vec::new();
        for (form, graphs) in l.forms() {
            let mut ok = true;
            for g in &graphs {
                let key = format!("{} {:?}", g.name(), l.key());
                let r = planned.entry(key).or_insert_with(|| {
                    OperationGraph::new(g)
                        .map_err(|e| e.to_string())
                        .and_then(|op| build_plan(&op, &target).map_err(|e| e.to_string()))
                        .map(|p| p.engine_tag())
                });
                ok &= r.is_ok();
            }
            if ok {
                *table.entry(form).or_default() += 1;
            }
            row.push(format!("{form} {}", if ok { "yes" } else { "no" }));
            any |= ok;
        }
        println!(
            "{label:<10} {:<14} {:<60} {}",
            l.name,
            l.key(),
            row.join(", ")
        );
        assert!(any, "{label}: no evaluation form plans for {}", l.key());
    }
    println!(
        "{label}: {} layers planned in {:.1} s; inference forms that plan ({} distinct \
         ResNet-50 layers):",
        layers.len(),
        start.elapsed().as_secs_f64(),
        layers.len()
    );
    for (form, n) in &table {
        println!("  {label:<10} {form:<9} {n}/{}", layers.len());
    }
    // The unfused form is the training step's own conv and apply graphs: it plans
    // everywhere the training step does.
    assert_eq!(table.get("unfused").copied(), Some(layers.len()), "{label}");
}
