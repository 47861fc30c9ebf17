//! Tier 4 (GPU): a conv fprop plan executes through the frontend and matches the CPU
//! reference. Prints one SKIP line where there is no usable CUDA device or cuDNN.

use cudnn_cbr::fusion::cbr::graphs;
mod common;

use cudnn_cbr::fusion::exec::{Bindings, Handle, Workspace};
use cudnn_cbr::fusion::lower::OperationGraph;
use cudnn_cbr::fusion::plan::build_plan;
use cudnn_cbr::fusion::reference::{self, ConvParams};
use cudnn_cbr::fusion::{device_binding, DevicePropSource, Error, TargetKind};
use half::f16;

/// Deterministic values in [-1, 1), rounded to FP16.
fn random_f16(len: usize, seed: u64) -> Vec<f16> {
    let mut s = seed;
    (0..len)
        .map(|_| f16::from_f32(common::uniform(&mut s)))
        .collect()
}

#[test]
fn conv_fprop_matches_the_cpu_reference() {
    let Some(ctx) = common::gpu_or_skip("conv_fprop_matches_the_cpu_reference") else {
        return;
    };
    let stream = ctx.default_stream();
    let handle = Handle::new(stream.clone()).unwrap();
    let target = handle.target().unwrap();
    println!("device: {} ({})", target.props().name(), target.identity());

    let shape = common::gpu_shapes::conv_shape();
    let (graph, t) = graphs::conv_fprop(&shape, false, false);
    let plan = build_plan(
        &OperationGraph::for_target(&graph, &target).unwrap(),
        &target,
    )
    .unwrap();
    println!(
        "plan {} workspace {}",
        plan.engine_tag(),
        plan.workspace_size()
    );

    let x = random_f16((shape.n * shape.c * shape.h * shape.w) as usize, 1);
    let w = random_f16((shape.k * shape.c * shape.r * shape.s) as usize, 2);
    let y_len = (shape.n * shape.k * shape.p() * shape.q()) as usize;
    let mut dx = stream.clone_htod(&x).unwrap();
    let mut dw = stream.clone_htod(&w).unwrap();
    let mut dy = stream.alloc_zeros::<f16>(y_len).unwrap();
    let mut b = Bindings::new(&plan);
    b.bind(t.x, &mut dx, &stream).unwrap();
    b.bind(t.w, &mut dw, &stream).unwrap();
    b.bind(t.y, &mut dy, &stream).unwrap();
    plan.execute(&handle, &b, Workspace::Pooled).unwrap();
    // The bindings borrow the buffers (and record their use on drop): release them first.
    drop(b);
    let got: Vec<f16> = stream.clone_dtoh(&dy).unwrap();

    let p = ConvParams::new(
        shape.n as usize,
        shape.c as usize,
        shape.h as usize,
        shape.w as usize,
        shape.k as usize,
        shape.r as usize,
        shape.s as usize,
    )
    .with_padding(1, 1);
    let want = reference::conv_fprop::<f16>(&p, &x, &w).unwrap();
    // Both sides accumulate C·R·S = 288 FP16 products in FP32 and round once to FP16; only the
    // summation order differs. |y| stays below ~20 here, where one FP16 ulp is 2^-6; the FP32
    // reordering error (288 · 2^-24 · 20) is far below that. Allow 1 ulp at 32 plus 2^-10
    // relative: a wrong layout, padding or filter order gives errors of order 1.
    let mut worst = 0f32;
    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
        let (g, r) = (g.to_f32(), r.to_f32());
        let err = (g - r).abs();
        worst = worst.max(err);
        assert!(
            err <= 2f32.powi(-5) + r.abs() * 2f32.powi(-10),
            "y[{i}]: gpu {g} vs cpu {r}"
        );
    }
    println!("conv fprop on GPU matches the CPU reference; worst abs error {worst}");
}

#[test]
fn a_live_plan_is_lowered_with_the_handle_and_ranked_for_the_device() {
    let Some(ctx) =
        common::gpu_or_skip("a_live_plan_is_lowered_with_the_handle_and_ranked_for_the_device")
    else {
        return;
    };
    let handle = Handle::new(ctx.default_stream()).unwrap();
    let target = handle.target().unwrap();
    let binding = target.binding();
    if handle.is_simulated() {
        // On the simulated device cuDNN sees no driver: the handle's target is the deviceless
        // target of the simulator's device-properties document, and its plans are lowered
        // without a handle.
        assert_eq!(
            binding,
            device_binding(TargetKind::Deviceless, target.cudnn_version())
        );
        let (graph, _) = graphs::conv_fprop(&common::gpu_shapes::conv_shape(), false, true);
        let op = OperationGraph::for_target(&graph, &target).unwrap();
        assert!(!op.has_handle());
        let plan = build_plan(&op, &target).unwrap();
        assert_eq!(plan.target_identity(), target.identity());
        println!(
            "simulated device: deviceless plan {} on {}",
            plan.engine_tag(),
            target.identity()
        );
        return;
    }
    assert_eq!(
        binding,
        device_binding(TargetKind::Live, target.cudnn_version())
    );
    assert!(binding.graph_handle && binding.plan_on_handle);
    if target.cudnn_version() >= cudnn_cbr::sys::DEVICELESS_MIN_VERSION {
        assert_eq!(binding.heuristics_devprop, Some(DevicePropSource::Handle));
    }
    let (graph, _) = graphs::conv_fprop(&common::gpu_shapes::conv_shape(), false, true);
    // Lowered with the handle (CUDNN_ATTR_OPERATIONGRAPH_HANDLE), heuristics given the
    // device's DEVICEPROP descriptor: cuDNN accepts both and a plan finalizes.
    let op = OperationGraph::for_target(&graph, &target).unwrap();
    assert!(op.has_handle());
    let plan = build_plan(&op, &target).unwrap();
    assert_eq!(plan.target_identity(), target.identity());
    println!(
        "live plan {} on {} (handle on the graph, device properties from the handle)",
        plan.engine_tag(),
        target.identity()
    );
    // A graph lowered without the handle is refused, not ranked for whatever is current.
    let bare = OperationGraph::new(&graph).unwrap();
    let err = build_plan(&bare, &target).unwrap_err();
    assert!(matches!(err, Error::LoweredForOtherTarget { .. }), "{err}");
}
