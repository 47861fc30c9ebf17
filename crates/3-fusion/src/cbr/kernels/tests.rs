//! Deviceless tests of our kernels: every launch against the compiled parameters.

use super::test_support::{accumulated_params, configs, entries, fake_buffers};
use super::*;
use crate::cbr::device_buffers::DeviceBuffer;
use crate::cbr::layer::{route_graphs, RouteKind};
use crate::error::Error;
use crate::graph::DataType;
use cudnn_cbr_runtime::rtc::{self, PtxParam};
use std::collections::{HashMap, HashSet};

/// NVRTC is part of the test dependencies (`.deps/`): its absence is a failure here.
fn sm90_params() -> HashMap<String, Vec<PtxParam>> {
    assert!(
        rtc::nvrtc_library_present(),
        "NVRTC cannot be loaded: run scripts/setup-test-deps.sh and `source .deps/env.sh`"
    );
    compile_uncached("sm_90", None)
        .expect("our kernels compile for sm_90")
        .params
}

fn float_buffer(i: u64, channels: usize) -> DeviceBuffer {
    DeviceBuffer {
        ptr: 0x7000_0000_0000 + (i << 20),
        bytes: 4 * channels,
        dtype: DataType::Float,
    }
}

/// Every launch our layers make (each route of each configuration, through the function
/// the GPU path pushes from) and synchronized BN's coefficients launch has the compiled
/// kernels' parameter kinds and sizes, in order.
#[test]
fn every_launch_matches_the_compiled_kernel() {
    let params = sm90_params();
    // The PTX says what the source says: one entry per kernel, with its parameter count.
    let source = entries();
    assert_eq!(source.len(), OwnKernel::ALL.len());
    for (entry, names, _) in &source {
        assert_eq!(params[entry].len(), names.len(), "{entry}");
    }
    let mut launched = HashSet::new();
    for config in configs() {
        for kind in [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic] {
            let graphs = route_graphs(&config, kind);
            let buffers = fake_buffers(&graphs);
            for lg in &graphs {
                let Some(step) = KernelStep::for_graph(lg, "sm_90") else {
                    continue;
                };
                let launch = step
                    .launch_with(&buffers)
                    .unwrap_or_else(|e| panic!("{:?} {:?}: {e}", kind, lg.role));
                let entry = step.kernel().entry();
                launch
                    .check(&params[entry])
                    .unwrap_or_else(|e| panic!("{} {kind:?}: {e}", config.shape.label()));
                launched.insert(entry);
            }
        }
    }
    let inputs = [0, 1, 2, 3, 4].map(|i| float_buffer(i, 20));
    let outputs = [5, 6, 7].map(|i| float_buffer(i, 20));
    let coefficients = dbn_coefficients_launch(inputs, -0.5, outputs, 20).unwrap();
    coefficients.check(&params["cbr_dbn_coefficients"]).unwrap();
    launched.insert("cbr_dbn_coefficients");
    let half = |i: u64, n: usize| DeviceBuffer {
        ptr: 0x7d00_0000_0000 + (i << 32),
        bytes: 2 * n,
        dtype: DataType::Half,
    };
    let (n, c) = (2 * 8 * 8 * 20, 20);
    let bufs = BnEvalBuffers {
        y: half(0, n),
        mean: float_buffer(1, c),
        inv_std: float_buffer(2, c),
        gamma: float_buffer(3, c),
        beta: float_buffer(4, c),
        residual: Some(half(5, n)),
        residual_scale_bias: Some((half(6, c), half(7, c))),
        out: half(8, n),
    };
    for output in [
        BnEvalOutput::BnOnly,
        BnEvalOutput::Activation(ApplyResidual::None),
        BnEvalOutput::Activation(ApplyResidual::Add),
        BnEvalOutput::Activation(ApplyResidual::DualScaleBias),
    ] {
        let launch = bn_eval_launch(&bufs, output, n, c).unwrap();
        launch.check(&params["cbr_bn_eval"]).unwrap();
    }
    // A residual form without its residual is refused by name.
    let no_residual = BnEvalBuffers {
        residual: None,
        ..bufs
    };
    let e = bn_eval_launch(
        &no_residual,
        BnEvalOutput::Activation(ApplyResidual::Add),
        n,
        c,
    )
    .unwrap_err();
    assert!(e.to_string().contains("residual"), "{e}");
    launched.insert("cbr_bn_eval");
    let all: HashSet<_> = OwnKernel::ALL.iter().map(|k| k.entry()).collect();
    assert_eq!(launched, all, "every kernel is launched by some layer");
}

/// A planted mismatch (an argument pushed with the wrong kind, one left out) is caught,
/// naming the kernel and the parameter.
#[test]
fn a_wrong_argument_list_names_the_kernel_and_the_parameter() {
    let params = sm90_params();
    let inputs = [0, 1, 2, 3, 4].map(|i| float_buffer(i, 8));
    let outputs = [5, 6, 7].map(|i| float_buffer(i, 8));
    let launch = dbn_coefficients_launch(inputs, -0.25, outputs, 8).unwrap();
    let expected = &params["cbr_dbn_coefficients"];
    launch.check(expected).unwrap();
    let mut args = launch.args().to_vec();
    // neg_inv_count (parameter 5) pushed as a pointer-sized integer.
    args[5] = KernelArg::U64(0);
    let msg = check_args("cbr_dbn_coefficients", expected, &args)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("cbr_dbn_coefficients") && msg.contains("parameter 5"),
        "{msg}"
    );
    // `c` (parameter 10, an unsigned) pushed as an f32: same size, another kind.
    let mut args = launch.args().to_vec();
    args[10] = KernelArg::F32(8.0);
    let msg = check_args("cbr_dbn_coefficients", expected, &args)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("parameter 10"), "{msg}");
    // The trailing `vec` left out.
    let args = &launch.args()[..launch.args().len() - 1];
    let msg = check_args("cbr_dbn_coefficients", expected, args)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("takes 12 parameters") && msg.contains("passes 11"),
        "{msg}"
    );
    // Another kernel's list for this one.
    let stats = &params["cbr_channel_stats"];
    let e = launch.check(stats).unwrap_err();
    assert!(matches!(e, Error::Kernel { ref kernel, .. } if kernel == "cbr_dbn_coefficients"));
}

/// The trailing arguments and the grid: eight-wide access only for 8k channels at
/// 16-byte-aligned addresses and never for a reduction, whose blocks get 2·c FP32
/// accumulators of shared memory.
#[test]
fn the_trailing_arguments_and_the_grid_follow_the_shape() {
    let ptrs = |base: u64| vec![KernelArg::Ptr(base); 4];
    let apply = OwnKernel::Apply(ApplyResidual::None);
    let l = Launch::new(apply, ptrs(0x1000), 64 * 100, 64);
    assert_eq!(
        l.args()[4..],
        [KernelArg::U64(6400), KernelArg::U32(64), KernelArg::I32(1)]
    );
    assert_eq!(l.config(132).shared_mem_bytes, 0);
    // 6400 / 8 groups over 256 threads: 4 blocks.
    assert_eq!(l.config(132).grid_dim.0, 4);
    for (values, c) in [(ptrs(0x1008), 64), (ptrs(0x1000), 20)] {
        let l = Launch::new(apply, values, u64::from(c) * 100, c);
        assert_eq!(l.args()[6], KernelArg::I32(0));
    }
    let stats = Launch::new(
        OwnKernel::ChannelStats,
        ptrs(0x1000)[..3].to_vec(),
        6400,
        64,
    );
    assert_eq!(stats.args()[5], KernelArg::I32(0));
    let cfg = stats.config(132);
    assert_eq!(cfg.shared_mem_bytes, 8 * 64);
    // Capped at two blocks per SM.
    let big = Launch::new(
        OwnKernel::ChannelStats,
        ptrs(0x1000)[..3].to_vec(),
        1 << 30,
        64,
    );
    assert_eq!(big.config(132).grid_dim.0, 264);
}

/// The reading of the source the zeroing test relies on finds the two reductions'
/// accumulators and nothing else.
#[test]
fn the_source_accumulates_only_into_the_reductions_outputs() {
    let found: Vec<(String, Vec<usize>)> = accumulated_params()
        .into_iter()
        .filter(|(_, t)| !t.is_empty())
        .collect();
    assert_eq!(
        found,
        vec![
            ("cbr_channel_stats".to_string(), vec![1, 2]),
            ("cbr_dbn_reduce".to_string(), vec![4, 5]),
        ]
    );
}
