//! Tier 2: the frontend builds, lowers and plans every basic graph for the H200, A100 and B200
//! fixtures with real cuDNN and no GPU.

mod common;

use cudnn_cbr::fusion::cbr::{graphs, ConvShape};
use cudnn_cbr::fusion::graph::Graph;
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::Target;
use cudnn_cbr::runtime::DataType;
use std::time::Instant;

fn basic_graphs(shape: &ConvShape) -> Vec<Graph> {
    vec![
        graphs::conv_fprop(shape, false, false).0,
        graphs::conv_dgrad(shape).0,
        graphs::conv_wgrad(shape, DataType::Half).0,
        graphs::conv_fprop(shape, false, true).0,
        graphs::bn_finalize(shape.k).0,
        graphs::scale_bias_relu(shape.y_dims(), DataType::Half).0,
    ]
}

#[test]
fn every_basic_graph_plans_on_every_fixture() {
    let Some(_) = common::cudnn_or_skip("every_basic_graph_plans_on_every_fixture") else {
        return;
    };
    // Small batch keeps the runtime-compiled pointwise plan cheap; shapes stay realistic.
    let shape = ConvShape::square(8, 64, 28, 64, 3, 1, 1);
    println!(
        "{:<12} {:<32} {:>8} {:>6} {:>6} {:>10} {:>9}",
        "target", "graph", "reported", "usable", "engine", "workspace", "build ms"
    );
    for (label, path) in common::devprops_fixtures() {
        let target = Target::deviceless_from_file(&path).unwrap();
        for graph in basic_graphs(&shape) {
            let start = Instant::now();
            let op = OperationGraph::new(&graph)
                .unwrap_or_else(|e| panic!("{label} {}: lowering failed: {e}", graph.name()));
            let plan = build_plan(&op, &target)
                .unwrap_or_else(|e| panic!("{label} {}: no plan: {e}", graph.name()));
            let ms = start.elapsed().as_secs_f64() * 1e3;
            let (reported, usable) = plan.config_counts();
            println!(
                "{label:<12} {:<32} {reported:>8} {usable:>6} {:>6} {:>10} {ms:>9.1}",
                graph.name(),
                plan.engine_tag(),
                plan.workspace_size()
            );
            assert!(usable >= 1, "{label} {}: no usable config", graph.name());
            assert_eq!(plan.graph_name(), graph.name());
            // The variant pack needs every real tensor, sorted by uid.
            let uids: Vec<i64> = plan.real_tensors().iter().map(|r| r.uid).collect();
            assert!(uids.windows(2).all(|w| w[0] < w[1]), "{uids:?}");
        }
    }
}

#[test]
fn a_graph_cudnn_rejects_is_a_typed_no_engine_error() {
    let Some(_) = common::cudnn_or_skip("a_graph_cudnn_rejects_is_a_typed_no_engine_error") else {
        return;
    };
    // docs/cudnn-graphs.md §5.1: the fused wgrad with an FP32 dW has no engine on sm_90.
    let shape = ConvShape::square(8, 64, 28, 64, 3, 1, 1);
    let mut g = Graph::new("scale_bias_relu_wgrad_fp32_dw");
    use cudnn_cbr::fusion::graph::TensorAttrs;
    let x = g.tensor(TensorAttrs::new("X", shape.x_dims()));
    let s = g.tensor(TensorAttrs::vector("scale", shape.c));
    let b = g.tensor(TensorAttrs::vector("bias", shape.c));
    let dy = g.tensor(TensorAttrs::new("dY", shape.y_dims()));
    let v1 = g.mul(x, s);
    let v2 = g.add(v1, b);
    let v3 = g.relu(v2);
    let dw = g.conv_wgrad(v3, dy, shape.conv_attrs(), shape.w_dims());
    g.set_output(dw, Some(DataType::Float)).unwrap();
    let target = Target::deviceless_from_file(&common::devprops_fixtures()[0].1).unwrap();
    let op = OperationGraph::new(&g).unwrap();
    let policy = cudnn_cbr::fusion::plan::PlanPolicy {
        modes: vec![cudnn_cbr::fusion::backend::HeurMode::A],
        ..Default::default()
    };
    let err = cudnn_cbr::fusion::plan::build_plans(&op, &target, &policy).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, cudnn_cbr::fusion::Error::NoEngine { .. }),
        "{text}"
    );
    assert!(text.contains("scale_bias_relu_wgrad_fp32_dw"), "{text}");
    assert!(text.contains("NVIDIA H200"), "{text}");
    println!("as expected: {text}");
}
