//! A table of bad inputs and faults against the public API and both examples' command lines.
//! Each row asserts the specific typed error, or the documented recovery, and that the process
//! did not crash: rows that could kill a process (the loader's) run in a child process, the
//! rest under `catch_unwind`. The test prints the table's totals.

mod common;

use cudnn_cbr::amp::plan::{MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr::amp::range::{LossScalePolicy, Scalars, SgdConfig};
use cudnn_cbr::amp::step::AmpExecutor;
use cudnn_cbr::amp::step::{AmpStep, CpuRegions, StepConfig};
use cudnn_cbr::amp::RangeOpError;
use cudnn_cbr::amp::{AmpError, PlanError};
use cudnn_cbr::dist::bootstrap::{read_id_file, write_id_file, LaunchEnv};
use cudnn_cbr::dist::nccl::{
    nccl_candidates, NcclCandidate, NcclLibrary, NCCL_LIB_DIR_ENV, NCCL_PATH_ENV,
};
use cudnn_cbr::dist::watchdog::parse_timeout;
use cudnn_cbr::dist::{CpuGroup, CpuReplica, DistError};
use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::kernels::Pointwise;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::cbr::{CbrConfig, CbrLayer, ConvShape, HostBuffers, Pass};
use cudnn_cbr::fusion::graph::{
    ConvAttrs, Graph, GraphError, PointwiseAttrs, PointwiseMode, ReductionAttrs, ReductionMode,
    TensorAttrs,
};
use cudnn_cbr::fusion::reference::Nhwc;
use cudnn_cbr::fusion::{DeviceProps, Error, Target};
use cudnn_cbr::net::cpu::{max_pool, max_pool_backward};
use cudnn_cbr::net::{
    compile, BlockKind, BlockSpec, CpuNet, NetSpec, PoolSpec, Preset, RoutePolicy,
};
use cudnn_cbr::sys::{load_from, LoadError, SearchPaths};
use cudnn_cbr::{ClassifierError, CpuClassifier};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How a row ended when it met its expectation.
enum Verdict {
    /// The specific typed error the row expects (its text, for the printout).
    Typed(String),
    /// The documented recovery (what happened).
    Recovered(String),
}

type Row = (&'static str, &'static str, fn() -> Verdict);

fn typed(e: impl std::fmt::Display) -> Verdict {
    Verdict::Typed(e.to_string().lines().next().unwrap_or_default().to_string())
}

// ---------------------------------------------------------------------------------------------
// Graph builder

fn conv_graph(x: [i64; 4], w: [i64; 4], attrs: ConvAttrs) -> Graph {
    let mut g = Graph::new("g");
    let x = g.tensor(TensorAttrs::new("X", x));
    let w = g.tensor(TensorAttrs::new("W", w));
    let y = g.conv_fprop(x, w, attrs);
    g.set_output(y, None).unwrap();
    g
}

fn graph_err(g: Graph) -> GraphError {
    g.validate().expect_err("the graph must be rejected")
}

fn graph_rows() -> Vec<Row> {
    vec![
        ("graph", "empty graph", || {
            let e = graph_err(Graph::new("g"));
            assert!(matches!(e, GraphError::EmptyGraph { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "zero batch", || {
            let e = graph_err(conv_graph([0, 8, 8, 8], [8, 8, 3, 3], ConvAttrs::default()));
            assert!(
                matches!(e, GraphError::NonPositiveDim { value: 0, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "negative filter dim", || {
            let e = graph_err(conv_graph(
                [2, 8, 8, 8],
                [-8, 8, 3, 3],
                ConvAttrs::default(),
            ));
            assert!(
                matches!(e, GraphError::NonPositiveDim { value: -8, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "conv input of rank 3", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8]));
            let w = g.tensor(TensorAttrs::new("W", [8, 8, 3, 3]));
            let y = g.conv_fprop(x, w, ConvAttrs::default());
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::Rank { got: 3, .. }), "{e:?}");
            typed(e)
        }),
        (
            "graph",
            "filter channels differ from the input's (the cause, not 'no dims')",
            || {
                let e = graph_err(conv_graph([2, 8, 8, 8], [8, 4, 3, 3], ConvAttrs::default()));
                assert!(
                    matches!(
                        e,
                        GraphError::ChannelMismatch {
                            expected: 8,
                            got: 4,
                            ..
                        }
                    ),
                    "{e:?}"
                );
                typed(e)
            },
        ),
        ("graph", "stride 0 (the cause, not 'no dims')", || {
            let a = ConvAttrs {
                stride: [0, 1],
                ..ConvAttrs::default()
            };
            let e = graph_err(conv_graph([2, 8, 8, 8], [8, 8, 3, 3], a));
            assert!(matches!(&e, GraphError::ConvAttr { .. }), "{e:?}");
            assert!(e.to_string().contains("stride"), "{e}");
            typed(e)
        }),
        (
            "graph",
            "kernel larger than its input (the cause, not 'no dims')",
            || {
                let e = graph_err(conv_graph([2, 8, 4, 4], [8, 8, 7, 7], ConvAttrs::default()));
                assert!(matches!(e, GraphError::ConvOutputEmpty { .. }), "{e:?}");
                typed(e)
            },
        ),
        ("graph", "negative padding", || {
            let e = graph_err(conv_graph(
                [2, 8, 8, 8],
                [8, 8, 3, 3],
                ConvAttrs::default().padding(-1),
            ));
            assert!(matches!(e, GraphError::ConvAttr { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "strides of the wrong rank", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]).strides([1, 2]));
            let y = g.relu(x);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::StridesRank { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a negative stride", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]).strides([512, 1, -64, 8]));
            let y = g.relu(x);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(
                matches!(e, GraphError::NonPositiveStride { value: -64, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "a tensor of 2^62 elements", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [1 << 40, 1 << 22, 1, 1]));
            let y = g.relu(x);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::SizeOverflow { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "two tensors with one uid", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]).uid(5));
            let b = g.tensor(TensorAttrs::vector("B", 8).uid(5));
            let y = g.add(x, b);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(
                matches!(e, GraphError::DuplicateUid { uid: 5, .. }),
                "{e:?}"
            );
            typed(e)
        }),
        ("graph", "a by-value tensor that is not a scalar", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let mut s = TensorAttrs::vector("S", 8);
            s.by_value = true;
            let s = g.tensor(s);
            let y = g.mul(x, s);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::ByValueShape { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a tensor id from another graph", || {
            let mut other = Graph::new("other");
            let mut t = other.tensor(TensorAttrs::new("O", [1, 1, 1, 1]));
            for _ in 0..5 {
                t = other.relu(t);
            }
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let y = g.add(x, t);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::UnknownTensor { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "set_output on a foreign id", || {
            let mut g = Graph::new("g");
            let mut other = Graph::new("other");
            let mut t = other.tensor(TensorAttrs::new("O", [1, 1, 1, 1]));
            for _ in 0..3 {
                t = other.relu(t);
            }
            let e = g.set_output(t, None).unwrap_err();
            assert!(matches!(e, GraphError::UnknownTensor { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "operands that do not broadcast", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let b = g.tensor(TensorAttrs::vector("B", 5));
            let y = g.add(x, b);
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::NotBroadcastable { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a reduction to dims the input cannot give", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let y = g.reduce(x, ReductionAttrs::new(ReductionMode::Add, [1, 3, 1, 1]));
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(matches!(e, GraphError::ReductionDims { .. }), "{e:?}");
            typed(e)
        }),
        ("graph", "a select with too few inputs", || {
            let mut g = Graph::new("g");
            let x = g.tensor(TensorAttrs::new("X", [2, 8, 8, 8]));
            let y = g.pointwise(&[x], PointwiseAttrs::new(PointwiseMode::BinarySelect));
            g.set_output(y, None).unwrap();
            let e = graph_err(g);
            assert!(e.to_string().contains("input"), "{e}");
            typed(e)
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// Layer and network configs

fn shape() -> ConvShape {
    ConvShape {
        n: 4,
        c: 8,
        h: 8,
        w: 8,
        k: 8,
        r: 3,
        s: 3,
        pad: 1,
        stride: 1,
    }
}

fn invalid_field(e: &Error, want: &str) {
    assert!(
        matches!(e, Error::InvalidConfig { field, .. } if field.contains(want)),
        "expected InvalidConfig on `{want}`, got {e:?}"
    );
}

fn layer_err(config: CbrConfig) -> Error {
    // Validation comes before anything else: no cuDNN is needed to refuse a config.
    config.validate().expect_err("the config must be rejected")
}

fn planned_layer_err(config: CbrConfig) -> Option<Error> {
    common::cudnn_or_skip("planned_layer_err")?;
    let target = h200();
    Some(CbrLayer::plan(config, &target, &PlanCache::new()).expect_err("must be rejected"))
}

fn h200() -> Target {
    Target::deviceless_from_file(common::repo_root().join("tests/fixtures/devprops/h200-sm90.json"))
        .unwrap()
}

fn config_rows() -> Vec<Row> {
    vec![
        ("layer", "stride 0", || {
            let e = layer_err(CbrConfig::new(ConvShape {
                stride: 0,
                ..shape()
            }));
            invalid_field(&e, "stride");
            typed(e)
        }),
        ("layer", "batch 2^58 (sizes that wrap)", || {
            let e = layer_err(CbrConfig::new(ConvShape {
                n: 1 << 58,
                ..shape()
            }));
            assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
            typed(e)
        }),
        ("layer", "negative padding", || {
            let e = layer_err(CbrConfig::new(ConvShape { pad: -1, ..shape() }));
            invalid_field(&e, "pad");
            typed(e)
        }),
        ("layer", "filter larger than the padded input", || {
            let e = layer_err(CbrConfig::new(ConvShape {
                r: 11,
                s: 11,
                ..shape()
            }));
            invalid_field(&e, "r/s");
            typed(e)
        }),
        ("layer", "zero output channels", || {
            let e = layer_err(CbrConfig::new(ConvShape { k: 0, ..shape() }));
            invalid_field(&e, "k");
            typed(e)
        }),
        ("layer", "NaN epsilon, on the fused planning path", || {
            let mut c = CbrConfig::new(shape());
            c.epsilon = f64::NAN;
            let e = planned_layer_err(c).unwrap_or_else(|| layer_err(c));
            invalid_field(&e, "epsilon");
            typed(e)
        }),
        ("layer", "negative epsilon", || {
            let mut c = CbrConfig::new(shape());
            c.epsilon = -1e-5;
            let e = layer_err(c);
            invalid_field(&e, "epsilon");
            typed(e)
        }),
        ("layer", "momentum 1.5, on the fused planning path", || {
            let mut c = CbrConfig::new(shape());
            c.momentum = 1.5;
            let e = planned_layer_err(c).unwrap_or_else(|| layer_err(c));
            invalid_field(&e, "momentum");
            typed(e)
        }),
        ("layer", "a shortcut BN that also materializes", || {
            let c = CbrConfig::new(shape())
                .with_shortcut_bn()
                .with_apply(cudnn_cbr::fusion::cbr::graphs::ApplyResidual::None);
            let e = layer_err(c);
            invalid_field(&e, "shortcut_bn");
            typed(e)
        }),
        ("layer", "a raw input with a backward residual", || {
            let c = CbrConfig::after_activation(shape())
                .with_backward_residual(cudnn_cbr::fusion::cbr::graphs::BackwardResidual::FuseAdd);
            let e = layer_err(c);
            invalid_field(&e, "backward_residual");
            typed(e)
        }),
        (
            "buffers",
            "a CPU layer run without the previous layer's buffers",
            || {
                let layer = CbrLayer::for_cpu(CbrConfig::new(shape()), true).unwrap();
                let mut this = HostBuffers::zeros(layer.buffers());
                let e = layer.run_cpu(Pass::Forward, &mut this, None).unwrap_err();
                assert!(
                    matches!(&e, Error::Buffer { name, .. } if name == "prev"),
                    "{e:?}"
                );
                typed(e)
            },
        ),
        ("buffers", "a CPU layer run with a buffer missing", || {
            let layer = CbrLayer::for_cpu(CbrConfig::first(shape()), true).unwrap();
            let mut this = HostBuffers::zeros(&layer.buffers()[1..]);
            let e = layer.run_cpu(Pass::Forward, &mut this, None).unwrap_err();
            assert!(
                matches!(e, Error::Buffer { .. } | Error::Reference(_)),
                "{e:?}"
            );
            typed(e)
        }),
        (
            "buffers",
            "a CPU layer run with a buffer of the wrong length",
            || {
                let layer = CbrLayer::for_cpu(CbrConfig::first(shape()), true).unwrap();
                let mut this = HostBuffers::zeros(layer.buffers());
                let first = layer.buffers()[0].clone();
                let short = cudnn_cbr::fusion::cbr::BufferSpec {
                    elems: first.elems - 1,
                    ..first
                };
                this.set(
                    first.name,
                    cudnn_cbr::fusion::cbr::HostBuffer::zeros(&short),
                );
                let e = layer.run_cpu(Pass::Forward, &mut this, None).unwrap_err();
                assert!(
                    matches!(e, Error::Buffer { .. } | Error::Reference(_)),
                    "{e:?}"
                );
                typed(e)
            },
        ),
        ("network", "batch 0", || {
            net_err(Preset::Mini, 0, 16, "batch")
        }),
        ("network", "input size 0", || {
            net_err(Preset::Mini, 4, 0, "hw")
        }),
        (
            "network",
            "a stem kernel larger than the unpadded input",
            || {
                let mut spec = Preset::ResNet50.spec(3, 4, 8);
                spec.stem.pad = 0;
                net_compile_err(&spec, 2, 4, "")
            },
        ),
        ("network", "batch 2^40 (sizes that wrap)", || {
            net_err(Preset::Mini, 1 << 40, 16, "")
        }),
        ("network", "an identity block whose channels change", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.stages[1][0].projection = false;
            net_spec_err(&spec, "")
        }),
        ("network", "blocks whose channels do not chain", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.stages[0][0].in_ch += 1;
            net_spec_err(&spec, "")
        }),
        ("network", "zero classes", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.classes = 0;
            net_spec_err(&spec, "classes")
        }),
        ("network", "a stem kernel of 0", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.stem.kernel = 0;
            net_spec_err(&spec, "kernel")
        }),
        ("network", "a block width of 2^62", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.stages[0][0] = BlockSpec::new(BlockKind::Basic, 8, 1 << 62, 8, 1);
            net_spec_err(&spec, "width")
        }),
        (
            "network",
            "input size 2^31 (products of extents wrap)",
            || net_err_says(Preset::Mini, 4, 1 << 31, "hw", "beyond 35184372088832"),
        ),
        ("network", "input size 2^31 + 1", || {
            net_err_says(Preset::Mini, 4, (1 << 31) + 1, "hw", "beyond 2147483648")
        }),
        ("network", "batch 2^31 of 2^16-pixel images", || {
            net_err_says(Preset::ResNet50, 1 << 31, 1 << 16, "", "beyond")
        }),
        (
            "network",
            "ResNet-101 whose buffers together pass 2^47 bytes",
            || net_err_says(Preset::ResNet101, 1 << 14, 1 << 12, "batch", "in all"),
        ),
        ("network", "a stem max-pool of stride 0", || {
            pool_err(PoolSpec {
                kernel: 3,
                stride: 0,
                pad: 1,
            })
        }),
        ("network", "a stem max-pool of kernel 0", || {
            pool_err(PoolSpec {
                kernel: 0,
                stride: 2,
                pad: 0,
            })
        }),
        (
            "network",
            "a stem max-pool whose padding equals its kernel",
            || {
                pool_err(PoolSpec {
                    kernel: 3,
                    stride: 2,
                    pad: 3,
                })
            },
        ),
        (
            "network",
            "a stem max-pool padded past half its kernel (windows of padding alone)",
            || {
                pool_err(PoolSpec {
                    kernel: 3,
                    stride: 1,
                    pad: 2,
                })
            },
        ),
        ("network", "a stem max-pool of stride 2^40", || {
            pool_err(PoolSpec {
                kernel: 3,
                stride: 1 << 40,
                pad: 1,
            })
        }),
        (
            "network",
            "a stem max-pool larger than the stem's padded output",
            || {
                let mut spec = Preset::ResNet50.spec(3, 4, 8);
                spec.stem.max_pool = Some(PoolSpec {
                    kernel: 15,
                    stride: 2,
                    pad: 0,
                });
                net_compile_err(&spec, 2, 8, "max_pool")
            },
        ),
        ("network", "a stem padding of 2^40", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.stem.pad = 1 << 40;
            net_spec_err(&spec, "stem.pad")
        }),
        ("network", "a stem of 2^40 channels", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.stem.out = 1 << 40;
            net_spec_err(&spec, "stem.out")
        }),
        ("network", "2^40 classes", || {
            let mut spec = Preset::Mini.spec(3, 4, 8);
            spec.classes = 1 << 40;
            net_spec_err(&spec, "classes")
        }),
        (
            "network",
            "a network with a 384 GiB input on the CPU executor (typed, not an abort)",
            || {
                let policy = RoutePolicy::Uniform(cudnn_cbr::fusion::cbr::RouteKind::Fused);
                let net = compile(&Preset::Mini.spec(3, 4, 8), 1 << 16, 1 << 10, &policy)
                    .expect("each buffer fits 2^47 bytes");
                let e = CpuNet::<half::f16>::try_new(net)
                    .map(|_| ())
                    .expect_err("384 GiB cannot be allocated here");
                assert!(
                    matches!(&e, Error::Buffer { name, .. } if name == "input"),
                    "{e:?}"
                );
                typed(e)
            },
        ),
        ("layer", "a CPU layer of stride 0", || {
            let e = CbrLayer::for_cpu(
                CbrConfig::new(ConvShape {
                    stride: 0,
                    ..shape()
                }),
                true,
            )
            .map(|_| ())
            .unwrap_err();
            invalid_field(&e, "stride");
            typed(e)
        }),
        ("layer", "a CPU layer of batch 2^50", || {
            let e = CbrLayer::for_cpu(
                CbrConfig::new(ConvShape {
                    n: 1 << 50,
                    ..shape()
                }),
                true,
            )
            .map(|_| ())
            .unwrap_err();
            invalid_field(&e, "x");
            typed(e)
        }),
        ("layer", "a CPU layer of 2^40 output channels", || {
            let e = CbrLayer::for_cpu(
                CbrConfig::new(ConvShape {
                    k: 1 << 40,
                    ..shape()
                }),
                false,
            )
            .map(|_| ())
            .unwrap_err();
            invalid_field(&e, "w");
            typed(e)
        }),
        ("max-pool", "stride 0 (a division by zero)", || {
            max_pool_err(
                PoolSpec {
                    kernel: 3,
                    stride: 0,
                    pad: 1,
                },
                8,
                "stem.max_pool",
            )
        }),
        ("max-pool", "a window larger than its padded input", || {
            max_pool_err(
                PoolSpec {
                    kernel: 7,
                    stride: 1,
                    pad: 1,
                },
                4,
                "kernel",
            )
        }),
        ("max-pool", "padding equal to the window", || {
            max_pool_err(
                PoolSpec {
                    kernel: 2,
                    stride: 2,
                    pad: 2,
                },
                8,
                "stem.max_pool",
            )
        }),
        (
            "max-pool",
            "backward with a window of padding alone",
            || {
                let p = PoolSpec {
                    kernel: 3,
                    stride: 1,
                    pad: 2,
                };
                let s = Nhwc::new(1, 4, 4, 1);
                let x = vec![half::f16::ONE; s.elems()];
                let e = max_pool_backward(&p, &s, &x, &x).unwrap_err();
                invalid_field(&e, "stem.max_pool");
                typed(e)
            },
        ),
    ]
}

fn net_err_says(preset: Preset, batch: usize, hw: usize, field: &str, needle: &str) -> Verdict {
    let policy = RoutePolicy::Uniform(cudnn_cbr::fusion::cbr::RouteKind::Fused);
    let e = compile(&preset.spec(3, 4, 8), batch, hw, &policy).expect_err("must be rejected");
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    if !field.is_empty() {
        invalid_field(&e, field);
    }
    assert!(e.to_string().contains(needle), "{e}");
    typed(e)
}

fn pool_err(pool: PoolSpec) -> Verdict {
    let mut spec = Preset::ResNet18.spec(3, 4, 8);
    spec.stem.max_pool = Some(pool);
    net_compile_err(&spec, 2, 32, "max_pool")
}

fn max_pool_err(p: PoolSpec, hw: usize, field: &str) -> Verdict {
    let s = Nhwc::new(1, hw, hw, 2);
    let x = vec![half::f16::ONE; s.elems()];
    let e = max_pool(&p, &s, &x).unwrap_err();
    invalid_field(&e, field);
    typed(e)
}

fn net_err(preset: Preset, batch: usize, hw: usize, field: &str) -> Verdict {
    let spec = preset.spec(3, 4, 8);
    net_compile_err(&spec, batch, hw, field)
}

fn net_spec_err(spec: &NetSpec, field: &str) -> Verdict {
    net_compile_err(spec, 4, 16, field)
}

fn net_compile_err(spec: &NetSpec, batch: usize, hw: usize, field: &str) -> Verdict {
    let policy = RoutePolicy::Uniform(cudnn_cbr::fusion::cbr::RouteKind::Fused);
    let e = compile(spec, batch, hw, &policy).expect_err("the network must be rejected");
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    if !field.is_empty() {
        invalid_field(&e, field);
    }
    typed(e)
}

// ---------------------------------------------------------------------------------------------
// Device properties

const H200_JSON: &str = include_str!("fixtures/devprops/h200-sm90.json");

fn props_with(key: &str, value: serde_json::Value) -> Verdict {
    let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
    v[key] = value;
    let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
    assert!(
        matches!(&e, Error::DeviceProps { reason, .. } if reason.contains(key)),
        "{e:?}"
    );
    typed(e)
}

fn props_rows() -> Vec<Row> {
    use serde_json::json;
    vec![
        ("device props", "not JSON", || {
            let e = DeviceProps::from_json("{not json").unwrap_err();
            assert!(matches!(e, Error::DeviceProps { .. }), "{e:?}");
            typed(e)
        }),
        ("device props", "not an object", || {
            let e = DeviceProps::from_json("[1, 2, 3]").unwrap_err();
            assert!(matches!(e, Error::DeviceProps { .. }), "{e:?}");
            typed(e)
        }),
        ("device props", "a required key missing", || {
            let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
            v.as_object_mut().unwrap().remove("maxRegistersPerSM");
            let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
            assert!(e.to_string().contains("maxRegistersPerSM"), "{e}");
            typed(e)
        }),
        ("device props", "warpSize -32", || {
            props_with("warpSize", json!(-32))
        }),
        ("device props", "multiProcessorCount 0", || {
            props_with("multiProcessorCount", json!(0))
        }),
        ("device props", "an unknown compute capability", || {
            props_with("deviceVer", json!(950))
        }),
        ("device props", "maxGridSize of two values", || {
            props_with("maxGridSize", json!([1, 2]))
        }),
        ("device props", "a string where a count belongs", || {
            props_with("maxThreadsPerSM", json!("lots"))
        }),
        ("device props", "a file that does not exist", || {
            let e = DeviceProps::from_file("/nonexistent/devprops.json").unwrap_err();
            assert!(e.to_string().contains("/nonexistent/devprops.json"), "{e}");
            typed(e)
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// Plan cache files and folders (recoveries: the plan is rebuilt, nothing escapes)

fn scratch(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("cudnn-cbr-bad-inputs-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn small_graph() -> Graph {
    conv_graph(
        [2, 16, 8, 8],
        [16, 16, 3, 3],
        ConvAttrs::default().padding(1),
    )
}

/// Persists the small graph's plan in a fresh folder, edits the file, and plans again.
fn cache_after_edit(tag: &str, edit: fn(String) -> String) -> Verdict {
    if common::cudnn_or_skip("cache rows").is_none() {
        return Verdict::Recovered("SKIP (no cuDNN)".into());
    }
    let dir = scratch(tag);
    let target = h200();
    let g = small_graph();
    PlanCache::persistent(&dir)
        .unwrap()
        .get_or_build(&g, &target)
        .unwrap();
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, edit(text)).unwrap();
    let cache = PlanCache::persistent(&dir).unwrap();
    cache
        .get_or_build(&g, &target)
        .expect("the plan is rebuilt");
    let s = cache.stats();
    assert_eq!((s.built, s.restored), (1, 0), "{s:?}");
    // And the rebuilt file restores.
    let again = PlanCache::persistent(&dir).unwrap();
    again.get_or_build(&g, &target).unwrap();
    assert_eq!(again.stats().restored, 1);
    let _ = std::fs::remove_dir_all(&dir);
    Verdict::Recovered(if s.rejected == 1 {
        "rebuilt; the bad file was moved aside".to_string()
    } else {
        "rebuilt; the file (another key) was overwritten".to_string()
    })
}

fn cache_rows() -> Vec<Row> {
    vec![
        ("plan cache", "a truncated file", || {
            cache_after_edit("trunc", |t| t[..t.len() / 3].into())
        }),
        ("plan cache", "an empty file", || {
            cache_after_edit("empty", |_| String::new())
        }),
        ("plan cache", "binary garbage", || {
            cache_after_edit("garbage", |_| "\u{0}\u{ff}\u{7}".into())
        }),
        (
            "plan cache",
            "an earlier version's file (cuDNN's plan JSON)",
            || {
                // What an edit of alpha, precision or dims used to go through: now an unknown
                // format, whatever it says.
                cache_after_edit("old-format", |t| {
                    let mut v: serde_json::Value = serde_json::from_str(&t).unwrap();
                    v.as_object_mut().unwrap().remove("format");
                    v["plan"] = "{\"operationGraph\":{}}".into();
                    v.to_string()
                })
            },
        ),
        ("plan cache", "a file for another target", || {
            cache_after_edit("target", |t| t.replacen("NVIDIA H200", "NVIDIA A100", 1))
        }),
        ("plan cache", "a file from another cuDNN version", || {
            cache_after_edit("version", |t| {
                let v: serde_json::Value = serde_json::from_str(&t).unwrap();
                let target = v["target"].as_str().unwrap();
                let mut v = v.clone();
                v["target"] = format!("{target}-cudnn90100").into();
                v.to_string()
            })
        }),
        ("plan cache", "a folder that vanished (writes fail)", || {
            if common::cudnn_or_skip("cache rows").is_none() {
                return Verdict::Recovered("SKIP (no cuDNN)".into());
            }
            let dir = scratch("vanish");
            let cache = PlanCache::persistent(&dir).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
            cache.get_or_build(&small_graph(), &h200()).unwrap();
            cache.get_or_build(&small_graph(), &h200()).unwrap();
            let s = cache.stats();
            assert_eq!((s.built, s.hits, s.write_failures), (1, 1, 1), "{s:?}");
            Verdict::Recovered("plan kept in memory, one write failure counted".into())
        }),
        ("plan cache", "a folder that cannot be created", || {
            if common::cudnn_or_skip("cache rows").is_none() {
                return Verdict::Recovered("SKIP (no cuDNN)".into());
            }
            let file = scratch("file-in-the-way");
            std::fs::write(&file, b"x").unwrap();
            let cache = PlanCache::persistent(file.join("plans")).unwrap();
            assert_eq!(cache.dir(), None);
            cache.get_or_build(&small_graph(), &h200()).unwrap();
            let _ = std::fs::remove_file(&file);
            Verdict::Recovered("memory-only cache".into())
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// The loader (each in a child process: these faults used to kill the process)

fn cudnn_dir() -> Option<PathBuf> {
    let lib = common::cudnn_or_skip("loader rows")?;
    Some(Path::new(lib.path()).parent()?.to_path_buf())
}

fn loader_rows() -> Vec<Row> {
    vec![
        ("loader", "a folder without cuDNN", || {
            let dir = scratch("no-cudnn");
            std::fs::create_dir_all(&dir).unwrap();
            let e = SearchPaths {
                lib_dir: Some(dir),
                system_loader: false,
                site_packages: vec![],
            }
            .load()
            .unwrap_err();
            assert!(
                matches!(&e, LoadError::NotFound { attempts } if attempts[0].reason == "no such file"),
                "{e:?}"
            );
            typed(e)
        }),
        ("loader", "a library without cuDNN's symbols", || {
            let e = load_from("libm.so.6").unwrap_err();
            assert!(e.to_string().contains("cudnnGetVersion"), "{e}");
            typed(e)
        }),
        ("loader", "a text file named libcudnn.so.9", || {
            in_child("text_file", "ELF magic")
        }),
        ("loader", "a truncated libcudnn.so.9", || {
            in_child("truncated_main", "truncated")
        }),
        ("loader", "libcudnn.so.9 without its sub-libraries", || {
            in_child("no_sublibraries", "libcudnn_graph.so.9 is missing")
        }),
        ("loader", "a truncated sub-library", || {
            in_child("truncated_graph", "truncated")
        }),
        (
            "loader",
            "a foreign library under libcudnn_graph.so.9 (aborted in cuDNN's version call)",
            || {
                in_child("foreign_graph", "libcudnn_graph.so.9 at")
                    .expect_says("does not define cudnnGetVersion")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn_heuristic.so.9 (was: every layer unfused)",
            || {
                in_child("foreign_heuristic", "libcudnn_heuristic.so.9 at")
                    .expect_says("dummyHeuristicSymbol")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn_engines_precompiled.so.9",
            || {
                in_child(
                    "foreign_precompiled",
                    "libcudnn_engines_precompiled.so.9 at",
                )
                .expect_says("dummyBackendEnginesPreCompiledSymbol")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn_engines_runtime_compiled.so.9",
            || {
                in_child(
                    "foreign_runtime_compiled",
                    "libcudnn_engines_runtime_compiled.so.9 at",
                )
                .expect_says("dummyBackendEnginesRuntimeCompiledSymbol")
            },
        ),
        (
            "loader",
            "a foreign library under libcudnn.so.9 (checked before dlopen)",
            || {
                in_child(
                    "foreign_main",
                    "not cuDNN: it does not define cudnnGetVersion",
                )
            },
        ),
        (
            "loader",
            "no libcuda.so.1 (was blamed on the device properties)",
            || {
                in_child(
                    "no_driver",
                    "the CUDA driver library libcuda.so.1 is missing",
                )
            },
        ),
        ("loader", "a truncated libcuda.so.1 beside cuDNN", || {
            in_child("truncated_driver", "libcuda.so.1 at").expect_says("truncated")
        }),
    ]
}

trait ExpectSays {
    /// The typed error's text also says `needle`.
    fn expect_says(self, needle: &str) -> Verdict;
}

impl ExpectSays for Verdict {
    fn expect_says(self, needle: &str) -> Verdict {
        if let Verdict::Typed(text) = &self {
            assert!(
                text.starts_with("SKIP") || text.contains(needle),
                "`{needle}` not in: {text}"
            );
        }
        self
    }
}

/// Runs a loader fault in a child process with no loader path, so nothing outside the
/// prepared folder can stand in; asserts the child exited normally and printed `needle`.
fn in_child(case: &str, needle: &str) -> Verdict {
    if cudnn_dir().is_none() {
        return Verdict::Typed("SKIP (no cuDNN to build the faulty folder from)".into());
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "loader_fault_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("BAD_INPUTS_CHILD", case)
        .env("BAD_INPUTS_CUDNN_DIR", cudnn_dir().unwrap())
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("CUDNN_LIB_DIR")
        .output()
        .expect("spawn the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.code() == Some(0),
        "child {case} did not exit normally ({:?}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("CHILD ").map(|(_, v)| v))
        .unwrap_or_else(|| panic!("child {case} printed no verdict:\n{stdout}"));
    assert!(line.contains(needle), "child {case}: {line}");
    Verdict::Typed(line.to_string())
}

/// The child half of the loader rows (does nothing unless `BAD_INPUTS_CHILD` is set).
#[test]
fn loader_fault_child() {
    let Some(case) = std::env::var_os("BAD_INPUTS_CHILD") else {
        return;
    };
    let src = PathBuf::from(std::env::var_os("BAD_INPUTS_CUDNN_DIR").unwrap());
    let dir = scratch(&format!("child-{}", case.to_string_lossy()));
    std::fs::create_dir_all(&dir).unwrap();
    let main = dir.join("libcudnn.so.9");
    let bytes = || std::fs::read(src.join("libcudnn.so.9")).unwrap();
    let link = |name: &str| std::os::unix::fs::symlink(src.join(name), dir.join(name)).unwrap();
    // A complete shared object for this machine that is not cuDNN (the C math library).
    let foreign = |name: &str| {
        let libm = cudnn_cbr::runtime::preflight::resolve_by_name("libm.so.6").expect("libm.so.6");
        std::fs::copy(libm, dir.join(name)).unwrap();
    };
    let subs = [
        "libcudnn_graph.so.9",
        "libcudnn_heuristic.so.9",
        "libcudnn_engines_precompiled.so.9",
        "libcudnn_engines_runtime_compiled.so.9",
    ];
    // The main library and every sub-library but `odd`, which `foreign` replaces.
    let all_but = |odd: &str| {
        link("libcudnn.so.9");
        for name in subs.iter().filter(|n| **n != odd) {
            link(name);
        }
    };
    match case.to_str().unwrap() {
        "foreign_graph" => {
            all_but(subs[0]);
            foreign(subs[0]);
        }
        "foreign_heuristic" => {
            all_but(subs[1]);
            foreign(subs[1]);
        }
        "foreign_precompiled" => {
            all_but(subs[2]);
            foreign(subs[2]);
        }
        "foreign_runtime_compiled" => {
            all_but(subs[3]);
            foreign(subs[3]);
        }
        "foreign_main" => foreign("libcudnn.so.9"),
        // The child runs without LD_LIBRARY_PATH, so the stand-in driver is out of reach.
        "no_driver" => all_but(""),
        "truncated_driver" => {
            all_but("");
            std::fs::write(dir.join("libcuda.so.1"), &bytes()[..4096]).unwrap();
        }
        "text_file" => std::fs::write(&main, "this is not a library\n".repeat(8)).unwrap(),
        "truncated_main" => std::fs::write(&main, &bytes()[..bytes().len() * 2 / 3]).unwrap(),
        "no_sublibraries" => std::fs::write(&main, bytes()).unwrap(),
        "truncated_graph" => {
            std::fs::write(&main, bytes()).unwrap();
            let graph = std::fs::read(src.join("libcudnn_graph.so.9")).unwrap();
            std::fs::write(dir.join("libcudnn_graph.so.9"), &graph[..graph.len() / 2]).unwrap();
            for name in [
                "libcudnn_heuristic.so.9",
                "libcudnn_engines_precompiled.so.9",
                "libcudnn_engines_runtime_compiled.so.9",
            ] {
                link(name);
            }
        }
        "fifo_graph" => {
            all_but(subs[0]);
            mkfifo(&dir.join(subs[0]));
        }
        "folder_heuristic" => {
            all_but(subs[1]);
            std::fs::create_dir_all(dir.join(subs[1])).unwrap();
        }
        "fifo_driver" => {
            all_but("");
            mkfifo(&dir.join("libcuda.so.1"));
        }
        other => panic!("unknown child case {other}"),
    }
    let result = load_from(&main);
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Ok(lib) => println!("CHILD loaded?! {lib:?}"),
        Err(e) => println!("CHILD {}", e.to_string().replace('\n', " ")),
    }
}

// ---------------------------------------------------------------------------------------------
// amp plans and steps

fn amp_rows() -> Vec<Row> {
    vec![
        ("amp plan", "an empty parameter name", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b.add("", ParamKind::BnGamma, &[8], k).unwrap_err();
            assert!(matches!(e, PlanError::EmptyName { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a parameter registered twice", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            b.add("g", ParamKind::BnGamma, &[8], k).unwrap();
            let e = b.add("g", ParamKind::BnGamma, &[8], k).unwrap_err();
            assert!(matches!(e, PlanError::DuplicateName { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a zero dimension", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b
                .add("w", ParamKind::ConvWeight, &[8, 0, 3, 3], k)
                .unwrap_err();
            assert!(matches!(e, PlanError::ZeroDim { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a conv weight of rank 1", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b.add("w", ParamKind::ConvWeight, &[8], k).unwrap_err();
            assert!(matches!(e, PlanError::RankMismatch { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a parameter whose size overflows", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b
                .add("w", ParamKind::ConvWeight, &[1 << 40, 1 << 30, 1, 1], k)
                .unwrap_err();
            assert!(matches!(e, PlanError::SizeOverflow { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a bucket declared twice", || {
            let mut b = MemoryPlanBuilder::new();
            b.bucket("b").unwrap();
            let e = b.bucket("b").unwrap_err();
            assert!(matches!(e, PlanError::BadBucketName { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a plan with no parameters", || {
            let e = MemoryPlanBuilder::new().finalize().unwrap_err();
            typed(e)
        }),
        (
            "amp plan",
            "a plan of 17 TB on the CPU executor (checked before allocating)",
            || {
                let mut b = MemoryPlanBuilder::new();
                let k = b.bucket("b").unwrap();
                // 2^40 weights at 16 bytes each over W, G, M, A and G16: 17.6 TB.
                b.add("w", ParamKind::ConvWeight, &[1 << 20, 1 << 20, 1, 1], k)
                    .unwrap();
                let plan = b.finalize().unwrap();
                let e = CpuRegions::new(plan).unwrap_err();
                assert!(
                    matches!(e, AmpError::OutOfMemory { place: "host", .. }),
                    "{e:?}"
                );
                typed(e)
            },
        ),
        ("amp step", "a NaN learning rate", || {
            step_err(SgdConfig {
                lr: f32::NAN,
                ..SgdConfig::new(0.1)
            })
        }),
        ("amp step", "a negative momentum", || {
            step_err(SgdConfig {
                momentum: -0.5,
                ..SgdConfig::new(0.1)
            })
        }),
        ("amp step", "an infinite weight decay", || {
            step_err(SgdConfig {
                weight_decay: f32::INFINITY,
                ..SgdConfig::new(0.1)
            })
        }),
        ("loss scale", "a configured scale of 0", || {
            scale_config_err(0.0)
        }),
        ("loss scale", "a configured scale of +Inf", || {
            scale_config_err(f32::INFINITY)
        }),
        ("loss scale", "a configured scale of NaN", || {
            scale_config_err(f32::NAN)
        }),
        ("loss scale", "a configured scale of -8", || {
            scale_config_err(-8.0)
        }),
        ("loss scale", "a scale of 0 set on a running step", || {
            let mut step = small_step();
            let config =
                StepConfig::new(SgdConfig::new(0.1)).with_loss_scale(LossScalePolicy::fixed(0.0));
            let e = step.set_config(config).unwrap_err();
            assert_eq!(step.config().loss_scale.init_scale, 8192.0);
            scale_field(e, "init_scale")
        }),
        ("loss scale", "S written with a scale of 0", || {
            let mut regions = small_regions();
            let e = regions.write_scalars(&with_scale(0.0)).unwrap_err();
            unchanged(&regions);
            scale_field(e, "loss_scale")
        }),
        ("loss scale", "S written with a scale of +Inf", || {
            let mut regions = small_regions();
            let e = regions
                .write_scalars(&with_scale(f32::INFINITY))
                .unwrap_err();
            unchanged(&regions);
            scale_field(e, "loss_scale")
        }),
        ("loss scale", "S written with a scale of NaN", || {
            let mut regions = small_regions();
            let e = regions.write_scalars(&with_scale(f32::NAN)).unwrap_err();
            unchanged(&regions);
            scale_field(e, "loss_scale")
        }),
        (
            "loss scale",
            "S restored on a step with a scale of -Inf",
            || {
                let mut step = small_step();
                let e = step
                    .restore_scalars(&with_scale(f32::NEG_INFINITY))
                    .unwrap_err();
                unchanged(step.executor());
                scale_field(e, "loss_scale")
            },
        ),
        (
            "loss scale",
            "S restored on a step with a scale of 0",
            || {
                let mut step = small_step();
                let e = step.restore_scalars(&with_scale(0.0)).unwrap_err();
                unchanged(step.executor());
                scale_field(e, "loss_scale")
            },
        ),
        (
            "loss scale",
            "an S image (checkpoint) with a scale of 0",
            || {
                let mut regions = small_regions();
                let bytes = with_scale(0.0).to_bytes();
                let e = regions.load_region_bytes(Region::S, &bytes).unwrap_err();
                unchanged(&regions);
                scale_field(e, "loss_scale")
            },
        ),
        (
            "loss scale",
            "an S image (checkpoint) with a scale of +Inf",
            || {
                let e = Scalars::from_bytes(&with_scale(f32::INFINITY).to_bytes()).unwrap_err();
                scale_field(AmpError::from(e), "loss_scale")
            },
        ),
        ("loss scale", "a restored scale of 4096 (accepted)", || {
            let mut step = small_step();
            step.restore_scalars(&with_scale(4096.0)).unwrap();
            let s = step.executor().scalars();
            assert_eq!((s.loss_scale, s.lr), (4096.0, 0.1));
            Verdict::Recovered("S holds scale 4096 and the step's own learning rate".into())
        }),
    ]
}

fn small_regions() -> CpuRegions {
    let mut b = MemoryPlanBuilder::new();
    let k = b.bucket("b").unwrap();
    b.add("g", ParamKind::BnGamma, &[8], k).unwrap();
    CpuRegions::new(b.finalize().unwrap()).unwrap()
}

fn small_step() -> AmpStep<CpuRegions> {
    AmpStep::new(small_regions(), StepConfig::new(SgdConfig::new(0.1))).unwrap()
}

fn with_scale(loss_scale: f32) -> Scalars {
    Scalars {
        loss_scale,
        ..Scalars::default()
    }
}

/// S still holds what was there before the rejected write: the default scale, 8192.
fn unchanged(regions: &CpuRegions) {
    assert_eq!(regions.scalars().loss_scale, 8192.0);
}

fn scale_config_err(scale: f32) -> Verdict {
    let e = AmpStep::new(
        small_regions(),
        StepConfig::new(SgdConfig::new(0.1)).with_loss_scale(LossScalePolicy::fixed(scale)),
    )
    .map(|_| ())
    .unwrap_err();
    scale_field(e, "init_scale")
}

fn scale_field(e: AmpError, field: &str) -> Verdict {
    assert!(
        matches!(&e, AmpError::RangeOp(RangeOpError::InvalidConfig { field: f, .. }) if *f == field),
        "expected InvalidConfig on `{field}`, got {e:?}"
    );
    typed(e)
}

fn step_err(sgd: SgdConfig) -> Verdict {
    let mut b = MemoryPlanBuilder::new();
    let k = b.bucket("b").unwrap();
    b.add("g", ParamKind::BnGamma, &[8], k).unwrap();
    let regions = CpuRegions::new(b.finalize().unwrap()).unwrap();
    let e = AmpStep::new(regions, StepConfig::new(sgd))
        .map(|_| ())
        .unwrap_err();
    assert!(
        e.to_string().to_lowercase().contains("invalid") || matches!(e, AmpError::RangeOp(_)),
        "{e:?}"
    );
    typed(e)
}

// ---------------------------------------------------------------------------------------------
// Both examples' command lines

/// The example exits with `code` (never a signal, never a panic) and says `needle`.
fn example_exits(name: &str, args: &[&str], code: i32, needle: &str) -> Verdict {
    let (got, text) = common::run_example(name, args);
    assert_eq!(got, Some(code), "{name} {args:?}:\n{text}");
    assert!(
        !text.contains("panicked at"),
        "{name} {args:?} panicked:\n{text}"
    );
    assert!(
        text.contains(needle),
        "{name} {args:?} did not say `{needle}`:\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_default();
    if code == 0 {
        Verdict::Recovered(line.to_string())
    } else {
        Verdict::Typed(line.to_string())
    }
}

fn example_rows() -> Vec<Row> {
    vec![
        ("train_cbr", "--help", || {
            example_exits("train_cbr", &["--help"], 0, "Usage")
        }),
        ("train_cbr", "an unknown flag", || {
            example_exits("train_cbr", &["--frobnicate"], 2, "frobnicate")
        }),
        ("train_cbr", "--width 4294967296", || {
            example_exits("train_cbr", &["--width", "4294967296"], 1, "width")
        }),
        ("train_cbr", "--batch 1099511627776", || {
            example_exits("train_cbr", &["--batch", "1099511627776"], 1, "beyond")
        }),
        ("train_cbr", "--steps not-a-number", || {
            example_exits("train_cbr", &["--steps", "many"], 2, "steps")
        }),
        ("train_cbr", "--net that does not exist", || {
            example_exits("train_cbr", &["--net", "resnet7"], 2, "resnet7")
        }),
        ("train_cbr", "--batch 0", || {
            example_exits("train_cbr", &["--batch", "0"], 1, "batch ≥ 2")
        }),
        ("deviceless_plans", "--help", || {
            example_exits("deviceless_plans", &["--help"], 0, "Usage")
        }),
        ("deviceless_plans", "--props that does not exist", || {
            example_exits(
                "deviceless_plans",
                &["--props", "/nonexistent.json"],
                1,
                "/nonexistent.json",
            )
        }),
        ("deviceless_plans", "--batch 0", || {
            example_exits("deviceless_plans", &["--batch", "0"], 2, "batch")
        }),
        ("deviceless_plans", "--net that does not exist", || {
            example_exits("deviceless_plans", &["--net", "resnet7"], 2, "resnet7")
        }),
        ("deviceless_plans", "a flag without its value", || {
            example_exits("deviceless_plans", &["--hw"], 2, "--hw")
        }),
        (
            "train_cbr",
            "--hw 2147483648 on the CPU (was: a panic)",
            || {
                example_exits(
                    "train_cbr",
                    &["--hw", "2147483648", "--device", "cpu"],
                    1,
                    "beyond 35184372088832",
                )
            },
        ),
        ("train_cbr", "--hw 2147483648 (was: a panic)", || {
            example_exits("train_cbr", &["--hw", "2147483648"], 1, "hw")
        }),
        ("train_cbr", "--steps 1099511627776 (was: an abort)", || {
            example_exits(
                "train_cbr",
                &["--steps", "1099511627776", "--device", "cpu"],
                1,
                "steps must be at most 16777216",
            )
        }),
        ("train_cbr", "--steps u64::MAX (was: an abort)", || {
            example_exits(
                "train_cbr",
                &["--steps", "18446744073709551615"],
                1,
                "steps must be at most 16777216",
            )
        }),
        ("deviceless_plans", "--hw 2147483648 (was: a panic)", || {
            example_exits(
                "deviceless_plans",
                &["--hw", "2147483648"],
                1,
                "beyond 35184372088832",
            )
        }),
        (
            "custom_trainer",
            "--steps 0 (was: an index out of bounds)",
            || {
                example_exits(
                    "custom_trainer",
                    &["--steps", "0", "--device", "cpu"],
                    2,
                    "must be in 1..=1000000, got 0",
                )
            },
        ),
        ("custom_trainer", "--steps u64::MAX", || {
            example_exits(
                "custom_trainer",
                &["--steps", "18446744073709551615", "--device", "cpu"],
                2,
                "must be in 1..=1000000",
            )
        }),
        ("fuzz_graphs", "--help", || {
            example_exits("fuzz_graphs", &["--help"], 0, "Usage")
        }),
        ("fuzz_graphs", "a --case that is not hex", || {
            example_exits("fuzz_graphs", &["--case", "xyz"], 2, "xyz")
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// Per-layer routes, the head's classes, and data-parallel groups of different networks

fn per_layer(names: &[&str]) -> RoutePolicy<'static> {
    RoutePolicy::PerLayer {
        routes: names
            .iter()
            .map(|n| (n.to_string(), RouteKind::Unfused))
            .collect(),
        default: RouteKind::Fused,
    }
}

/// `names` on ResNet-18 (3 classes, 16x16) must be refused, naming each unknown one and the
/// real layers.
fn unknown_routes(names: &[&str], unknown: &[&str]) -> Verdict {
    let spec = Preset::ResNet18.spec(3, 4, 8);
    let e = compile(&spec, 2, 16, &per_layer(names)).expect_err("the routes must be refused");
    invalid_field(&e, "routes");
    let text = e.to_string();
    for u in unknown {
        assert!(text.contains(&format!(" {u}")), "`{u}` not named: {text}");
    }
    assert!(text.contains("its layers: stem, s0.b0.conv1"), "{text}");
    typed(e)
}

fn route_rows() -> Vec<Row> {
    vec![
        ("routes", "a layer the network does not have", || {
            unknown_routes(&["s9.b0.conv1"], &["s9.b0.conv1"])
        }),
        ("routes", "two unknown layers beside a real one", || {
            unknown_routes(&["stem", "s0.b9.conv2", "fc"], &["fc", "s0.b9.conv2"])
        }),
        ("routes", "a buffer's name, not a layer's", || {
            unknown_routes(&["stem.out"], &["stem.out"])
        }),
        ("routes", "a layer name in the wrong case", || {
            unknown_routes(&["Stem"], &["Stem"])
        }),
        ("routes", "an empty layer name", || {
            unknown_routes(&[""], &[""])
        }),
        ("routes", "a bottleneck's conv3 on basic blocks", || {
            unknown_routes(&["s1.b0.conv3"], &["s1.b0.conv3"])
        }),
        ("routes", "a projection on a block that has none", || {
            unknown_routes(&["s0.b0.down"], &["s0.b0.down"])
        }),
        ("routes", "real layer names (accepted and applied)", || {
            let spec = Preset::ResNet18.spec(3, 4, 8);
            let net = compile(&spec, 2, 16, &per_layer(&["s1.b0.down", "s0.b1.conv2"])).unwrap();
            for l in &net.layers {
                let want = if ["s1.b0.down", "s0.b1.conv2"].contains(&l.name.as_str()) {
                    RouteKind::Unfused
                } else {
                    RouteKind::Fused
                };
                assert_eq!(l.layer.route().kind(), want, "{}", l.name);
            }
            Verdict::Recovered("the two named layers unfused, the rest fused".into())
        }),
    ]
}

fn mini_net(classes: usize) -> cudnn_cbr::net::CompiledNet {
    let spec = Preset::Mini.spec(3, classes, 4);
    compile(&spec, 2, 8, &RoutePolicy::Uniform(RouteKind::Fused)).unwrap()
}

/// The head's class count against a spec of 4 must be refused, naming both.
fn head_classes(e: ClassifierError, head: usize) -> Verdict {
    assert!(
        matches!(
            &e,
            ClassifierError::Amp(AmpError::Plan(PlanError::HeadClasses { spec: 4, head: h, .. }))
                if *h == head
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains(&format!(
            "has {head} classes, but network `mini`'s spec has 4"
        )),
        "{e}"
    );
    typed(e)
}

fn cpu_classifier(classes: usize) -> Result<CpuClassifier, ClassifierError> {
    CpuClassifier::new(
        mini_net(4),
        classes,
        StepConfig::new(SgdConfig::new(0.1)),
        1,
    )
}

/// A 4-class mini classifier (batch 2 of 8x8x3) fed `images` values and `labels`.
fn classifier_input(images: usize, labels: &[i32], needle: &str) -> Verdict {
    let mut model = cpu_classifier(4).unwrap();
    model.step_mut().begin().unwrap();
    let e = model
        .forward_backward(&vec![half::f16::ZERO; images], labels)
        .expect_err("the batch must be refused");
    assert!(matches!(e, ClassifierError::Input(_)), "{e:?}");
    assert!(e.to_string().contains(needle), "{e}");
    typed(e)
}

fn head_rows() -> Vec<Row> {
    vec![
        (
            "head",
            "a CPU classifier of 3 classes on a 4-class spec",
            || head_classes(cpu_classifier(3).unwrap_err(), 3),
        ),
        (
            "head",
            "a CPU classifier of 5 classes on a 4-class spec",
            || head_classes(cpu_classifier(5).unwrap_err(), 5),
        ),
        (
            "head",
            "a CPU classifier of 0 classes on a 4-class spec",
            || head_classes(cpu_classifier(0).unwrap_err(), 0),
        ),
        (
            "head",
            "a memory plan of 2 classes on a 4-class spec",
            || {
                let e = cudnn_cbr::net::memory_plan(&mini_net(4), 2).unwrap_err();
                head_classes(AmpError::from(e).into(), 2)
            },
        ),
        (
            "head",
            "a memory plan with buffers of 9 classes on a 4-class spec",
            || {
                let e = cudnn_cbr::net::memory_plan_with_buffers(&mini_net(4), 9).unwrap_err();
                head_classes(AmpError::from(e).into(), 9)
            },
        ),
        ("head", "a label equal to the class count", || {
            classifier_input(2 * 8 * 8 * 3, &[0, 4], "label 4 is outside 0..4")
        }),
        ("head", "a negative label", || {
            classifier_input(2 * 8 * 8 * 3, &[-1, 0], "label -1 is outside 0..4")
        }),
        ("head", "three labels for a batch of two", || {
            classifier_input(2 * 8 * 8 * 3, &[0, 1, 2], "3 labels for a batch of 2")
        }),
        ("head", "one image short", || {
            classifier_input(8 * 8 * 3, &[0, 1], "the network reads 384")
        }),
    ]
}

/// Two CPU ranks (threads) whose networks are `a` and `b` form a group: both must fail with
/// the mismatch (naming both summaries), promptly.
fn group_of(
    a: (usize, usize, usize, usize, RouteKind),
    b: (usize, usize, usize, usize, RouteKind),
    says: &[&str],
) -> Verdict {
    let start = std::time::Instant::now();
    let comms = CpuGroup::ranks_with_timeout(2, std::time::Duration::from_secs(60)).unwrap();
    let out: Vec<Result<CpuReplica, ClassifierError>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip([a, b])
            .map(|(comm, (classes, width, batch, hw, route))| {
                s.spawn(move || {
                    let spec = Preset::Mini.spec(3, classes, width);
                    let net = compile(&spec, batch, hw, &RoutePolicy::Uniform(route)).unwrap();
                    let model =
                        CpuClassifier::new(net, classes, StepConfig::new(SgdConfig::new(0.1)), 1)?;
                    CpuReplica::new(model, comm, None)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(start.elapsed().as_secs() < 30, "{:?}", start.elapsed());
    let mut first = String::new();
    for (rank, o) in out.into_iter().enumerate() {
        let e = match o {
            Err(ClassifierError::Amp(AmpError::Dist(e))) => e,
            other => panic!("rank {rank}: {other:?}"),
        };
        assert!(
            matches!(&e, DistError::ModelMismatch { me, rank_a: 0, rank_b: 1, hash_a, hash_b, .. }
                if *me == rank && hash_a != hash_b),
            "{e:?}"
        );
        let text = e.to_string();
        for s in says {
            assert!(text.contains(s), "`{s}` not in: {text}");
        }
        if rank == 0 {
            first = text;
        }
    }
    typed(first)
}

const F: RouteKind = RouteKind::Fused;

fn group_rows() -> Vec<Row> {
    vec![
        ("group", "ranks of 4 and 5 classes", || {
            group_of(
                (4, 4, 2, 8, F),
                (5, 4, 2, 8, F),
                &["mini classes 4 batch 2", "mini classes 5 batch 2"],
            )
        }),
        (
            "group",
            "ranks of other routes (same parameter sizes)",
            || {
                group_of(
                    (4, 4, 2, 8, F),
                    (4, 4, 2, 8, RouteKind::Unfused),
                    &["routes f*", "routes u*"],
                )
            },
        ),
        ("group", "ranks of other batches", || {
            group_of(
                (4, 4, 2, 8, F),
                (4, 4, 4, 8, F),
                &["batch 2 hw", "batch 4 hw"],
            )
        }),
        ("group", "ranks of other image sizes", || {
            group_of((4, 4, 2, 8, F), (4, 4, 2, 16, F), &["hw 8 ", "hw 16 "])
        }),
        (
            "group",
            "ranks of other widths (the summary alike, the hash not)",
            || {
                group_of(
                    (4, 4, 2, 8, F),
                    (4, 8, 2, 8, F),
                    &["mini classes 4 batch 2 hw 8"],
                )
            },
        ),
        (
            "group",
            "ranks of the same network (the group forms)",
            || {
                let comms = CpuGroup::ranks(2).unwrap();
                let ok = std::thread::scope(|s| {
                    let hs: Vec<_> = comms
                        .into_iter()
                        .map(|comm| {
                            s.spawn(move || {
                                let model = cpu_classifier(4).unwrap();
                                CpuReplica::new(model, comm, None).is_ok()
                            })
                        })
                        .collect();
                    hs.into_iter().all(|h| h.join().unwrap())
                });
                assert!(ok);
                Verdict::Recovered("both ranks joined".into())
            },
        ),
        (
            "group",
            "a gathered fingerprint buffer of the wrong length",
            || {
                let e = cudnn_cbr::dist::same::check_gathered(&[0; 7], 0, 2).unwrap_err();
                assert!(matches!(e, DistError::Mismatch { .. }), "{e:?}");
                typed(e)
            },
        ),
        ("group", "a synchronized-BN group of other ranks", || {
            let mut grads = CpuGroup::ranks(2).unwrap();
            let mut bn = CpuGroup::ranks(3).unwrap();
            let e = CpuReplica::new(
                cpu_classifier(4).unwrap(),
                grads.remove(0),
                Some(bn.remove(1)),
            )
            .unwrap_err();
            assert!(matches!(e, ClassifierError::Input(_)), "{e:?}");
            assert!(e.to_string().contains("rank 1 of 3"), "{e}");
            typed(e)
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// Library files that are not regular files (a FIFO used to block the process for good)

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let made = Command::new("mkfifo").arg(path).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
}

/// `load_from(path)` is refused at once, the attempt naming `path` and `why`.
fn load_refused(path: &Path, why: &str) -> Verdict {
    let e = load_from(path).unwrap_err();
    let shown = path.display().to_string();
    assert!(
        matches!(&e, LoadError::NotFound { attempts }
            if attempts[0].candidate == shown && attempts[0].reason == why),
        "{e:?}"
    );
    typed(e)
}

/// NCCL from `candidates` is refused, one attempt saying `why`.
fn nccl_refused(candidates: &[NcclCandidate], why: &str) -> Verdict {
    let e = NcclLibrary::open_first(candidates).unwrap_err();
    match &e {
        DistError::NcclUnavailable { tried } => {
            assert!(tried.iter().any(|t| t.contains(why)), "{tried:?}")
        }
        other => panic!("{other:?}"),
    }
    Verdict::Typed(e.to_string().replace('\n', " "))
}

fn library_rows() -> Vec<Row> {
    vec![
        (
            "loader",
            "a FIFO given as libcudnn.so.9 (was: a hang)",
            || {
                let dir = scratch("fifo-main");
                std::fs::create_dir_all(&dir).unwrap();
                let fifo = dir.join("libcudnn.so.9");
                mkfifo(&fifo);
                let v = load_refused(&fifo, "is a FIFO (named pipe), not a regular file");
                let _ = std::fs::remove_dir_all(&dir);
                v
            },
        ),
        ("loader", "a folder given as libcudnn.so.9", || {
            let dir = scratch("folder-main").join("libcudnn.so.9");
            std::fs::create_dir_all(&dir).unwrap();
            load_refused(&dir, "is a folder, not a regular file")
        }),
        ("loader", "/dev/null given as the library", || {
            load_refused(
                Path::new("/dev/null"),
                "is a character device, not a regular file",
            )
        }),
        ("loader", "a FIFO as libcudnn.so.9 in CUDNN_LIB_DIR", || {
            let dir = scratch("fifo-lib-dir");
            std::fs::create_dir_all(&dir).unwrap();
            mkfifo(&dir.join("libcudnn.so.9"));
            let e = SearchPaths {
                lib_dir: Some(dir.clone()),
                system_loader: false,
                site_packages: vec![],
            }
            .load()
            .unwrap_err();
            let _ = std::fs::remove_dir_all(&dir);
            assert!(
                matches!(&e, LoadError::NotFound { attempts }
                    if attempts[0].reason == "is a FIFO (named pipe), not a regular file"),
                "{e:?}"
            );
            typed(e)
        }),
        (
            "loader",
            "a FIFO as libcudnn_graph.so.9 beside cuDNN",
            || in_child("fifo_graph", "libcudnn_graph.so.9").expect_says("is a FIFO"),
        ),
        (
            "loader",
            "a folder as libcudnn_heuristic.so.9 beside cuDNN",
            || in_child("folder_heuristic", "libcudnn_heuristic.so.9").expect_says("is a folder"),
        ),
        ("loader", "a FIFO as libcuda.so.1 beside cuDNN", || {
            in_child("fifo_driver", "libcuda.so.1").expect_says("is a FIFO")
        }),
        ("nccl", "a FIFO given as the library (was: a hang)", || {
            let dir = scratch("fifo-nccl");
            std::fs::create_dir_all(&dir).unwrap();
            let fifo = dir.join("libnccl.so.2");
            mkfifo(&fifo);
            let v = nccl_refused(
                &[NcclCandidate::Path(fifo)],
                "libnccl.so.2: is a FIFO (named pipe), not a regular file",
            );
            let _ = std::fs::remove_dir_all(&dir);
            v
        }),
        ("nccl", "CUDNN_CBR_NCCL naming a FIFO", || {
            let dir = scratch("fifo-nccl-env");
            std::fs::create_dir_all(&dir).unwrap();
            let fifo = dir.join("nccl-pipe");
            mkfifo(&fifo);
            let shown = fifo.display().to_string();
            let c = nccl_candidates(|v| (v == NCCL_PATH_ENV).then(|| shown.clone()), &[]);
            assert_eq!(c[0], NcclCandidate::Path(fifo.clone()));
            let v = nccl_refused(&c[..1], &format!("{shown}: is a FIFO"));
            let _ = std::fs::remove_dir_all(&dir);
            v
        }),
        (
            "nccl",
            "NCCL_LIB_DIR holding a FIFO named libnccl.so.2",
            || {
                let dir = scratch("fifo-nccl-dir");
                std::fs::create_dir_all(&dir).unwrap();
                mkfifo(&dir.join("libnccl.so.2"));
                let shown = dir.display().to_string();
                let c = nccl_candidates(|v| (v == NCCL_LIB_DIR_ENV).then(|| shown.clone()), &[]);
                let v = nccl_refused(&c[..2], "libnccl.so.2: is a FIFO");
                let _ = std::fs::remove_dir_all(&dir);
                v
            },
        ),
        ("nccl", "a folder named libnccl.so.2", || {
            let dir = scratch("folder-nccl").join("libnccl.so.2");
            std::fs::create_dir_all(&dir).unwrap();
            nccl_refused(
                &[NcclCandidate::Path(dir)],
                "is a folder, not a regular file",
            )
        }),
        ("nccl", "a text file named libnccl.so.2", || {
            let dir = scratch("text-nccl");
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join("libnccl.so.2");
            std::fs::write(&file, "not a library\n".repeat(10)).unwrap();
            nccl_refused(&[NcclCandidate::Path(file)], "no ELF magic number")
        }),
        ("nccl", "a library that is not NCCL", || {
            let libm = cudnn_cbr::runtime::preflight::resolve_by_name("libm.so.6").unwrap();
            nccl_refused(&[NcclCandidate::Path(libm)], "missing ncclGetVersion")
        }),
        ("nccl", "no candidate places at all", || {
            nccl_refused(&[], "(no candidate places)")
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// Environment variables, launcher environments and rendezvous files

fn launch_err(vars: &'static [(&'static str, &'static str)], var: &str, needle: &str) -> Verdict {
    let e = LaunchEnv::from_vars(|n| {
        vars.iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.to_string())
    })
    .unwrap_err();
    assert!(
        matches!(&e, DistError::Bootstrap { var: v, problem, .. } if v == var && problem.contains(needle)),
        "{e:?}"
    );
    typed(e)
}

/// Rank 1's read of a rendezvous file at `path` (given `bytes`, or prepared by `make`) is
/// refused at once, saying `needle`.
fn rendezvous_err(tag: &str, make: fn(&Path), needle: &str) -> Verdict {
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rendezvous");
    make(&path);
    let start = std::time::Instant::now();
    let e = read_id_file::<128>(&path, 2, std::time::Duration::from_secs(30)).unwrap_err();
    assert!(start.elapsed().as_secs() < 10, "{:?}", start.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        matches!(&e, DistError::Store { problem, .. } if problem.contains(needle)),
        "{e:?}"
    );
    typed(e)
}

fn env_rows() -> Vec<Row> {
    vec![
        ("launcher env", "no launcher's rank variable", || {
            launch_err(&[], "RANK", "no launcher environment found")
        }),
        ("launcher env", "RANK without WORLD_SIZE", || {
            launch_err(&[("RANK", "0")], "WORLD_SIZE", "the world size is missing")
        }),
        ("launcher env", "WORLD_SIZE 0", || {
            launch_err(
                &[("RANK", "0"), ("WORLD_SIZE", "0")],
                "WORLD_SIZE",
                "at least one rank",
            )
        }),
        ("launcher env", "RANK 5 of WORLD_SIZE 2", || {
            launch_err(
                &[("RANK", "5"), ("WORLD_SIZE", "2")],
                "RANK",
                "not below the world size 2",
            )
        }),
        ("launcher env", "RANK not a number", || {
            launch_err(
                &[("RANK", "first"), ("WORLD_SIZE", "2")],
                "RANK",
                "not a non-negative integer",
            )
        }),
        ("launcher env", "LOCAL_WORLD_SIZE above WORLD_SIZE", || {
            launch_err(
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "3"),
                ],
                "LOCAL_WORLD_SIZE",
                "must be in 1..=2",
            )
        }),
        (
            "launcher env",
            "LOCAL_RANK not below LOCAL_WORLD_SIZE",
            || {
                launch_err(
                    &[
                        ("RANK", "0"),
                        ("WORLD_SIZE", "4"),
                        ("LOCAL_RANK", "2"),
                        ("LOCAL_WORLD_SIZE", "2"),
                    ],
                    "LOCAL_RANK",
                    "local rank is not below",
                )
            },
        ),
        ("launcher env", "MASTER_PORT 0", || {
            launch_err(
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "localhost"),
                    ("MASTER_PORT", "0"),
                ],
                "MASTER_PORT",
                "not a port number",
            )
        }),
        (
            "launcher env",
            "an MPI world size that is not a number",
            || {
                launch_err(
                    &[
                        ("OMPI_COMM_WORLD_RANK", "0"),
                        ("OMPI_COMM_WORLD_SIZE", "two"),
                    ],
                    "OMPI_COMM_WORLD_SIZE",
                    "not a non-negative integer",
                )
            },
        ),
        (
            "rendezvous",
            "a FIFO as the rendezvous file (was: a hang)",
            || {
                rendezvous_err(
                    "rdv-fifo",
                    mkfifo,
                    "is a FIFO (named pipe), not a regular file",
                )
            },
        ),
        ("rendezvous", "a folder as the rendezvous file", || {
            rendezvous_err(
                "rdv-folder",
                |p| std::fs::create_dir_all(p).unwrap(),
                "is a folder, not a regular file",
            )
        }),
        ("rendezvous", "a file too short for its header", || {
            rendezvous_err(
                "rdv-short",
                |p| std::fs::write(p, b"CBR").unwrap(),
                "3 bytes: too short for the header",
            )
        }),
        ("rendezvous", "a file of another program", || {
            rendezvous_err(
                "rdv-magic",
                |p| std::fs::write(p, [b'x'; 150]).unwrap(),
                "bad magic",
            )
        }),
        (
            "rendezvous",
            "a file written for another world size",
            || {
                rendezvous_err(
                    "rdv-world",
                    |p| write_id_file(p, 3, &[7; 128]).unwrap(),
                    "written for world size 3, this rank has 2",
                )
            },
        ),
        ("rendezvous", "a file with a 16-byte id", || {
            rendezvous_err(
                "rdv-len",
                |p| write_id_file(p, 2, &[7; 16]).unwrap(),
                "holds a 16-byte id",
            )
        }),
        (
            "rendezvous",
            "a 1 MiB file (read no further than a header and an id)",
            || {
                rendezvous_err(
                    "rdv-huge",
                    |p| {
                        write_id_file(p, 2, &[7; 128]).unwrap();
                        let mut b = std::fs::read(p).unwrap();
                        b.resize(1 << 20, 0);
                        std::fs::write(p, b).unwrap();
                    },
                    "in 151 bytes, expected 128 bytes",
                )
            },
        ),
        ("dist timeout", "CUDNN_CBR_DIST_TIMEOUT=soon", || {
            let e = parse_timeout(Some("soon")).unwrap_err();
            assert!(
                e.contains("`soon`; expected a positive number of seconds"),
                "{e}"
            );
            Verdict::Typed(e)
        }),
        ("dist timeout", "CUDNN_CBR_DIST_TIMEOUT=0", || {
            let e = parse_timeout(Some("0")).unwrap_err();
            assert!(e.contains("`0`; expected a positive number"), "{e}");
            Verdict::Typed(e)
        }),
        ("dist timeout", "CUDNN_CBR_DIST_TIMEOUT=inf", || {
            let e = parse_timeout(Some("inf")).unwrap_err();
            assert!(e.contains("`inf`; expected a positive number"), "{e}");
            Verdict::Typed(e)
        }),
        ("pointwise env", "CUDNN_CBR_POINTWISE=fast", || {
            let e = Pointwise::parse(Some("fast")).unwrap_err();
            invalid_field(&e, "CUDNN_CBR_POINTWISE");
            assert!(e.to_string().contains("expected `own` or `cudnn`"), "{e}");
            typed(e)
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// Device-properties documents: each check of the strict parser, and files that are not files

fn props_file_err(tag: &str, make: fn(&Path), problem: &str) -> Verdict {
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("props.json");
    make(&path);
    let e = DeviceProps::from_file(&path).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(matches!(e, Error::File { .. }), "{e:?}");
    assert!(e.to_string().ends_with(problem), "{e}");
    typed(e)
}

fn props_more_rows() -> Vec<Row> {
    use serde_json::json;
    vec![
        ("device props", "an unknown key", || {
            let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
            v["l3CacheSize"] = json!(1);
            let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
            assert!(e.to_string().contains("unknown key `l3CacheSize`"), "{e}");
            typed(e)
        }),
        ("device props", "a key given twice (strict JSON)", || {
            let doc = H200_JSON.replacen("{", "{\"warpSize\": 32, ", 1);
            let e = DeviceProps::from_json(&doc).unwrap_err();
            assert!(e.to_string().contains("warpSize"), "{e}");
            typed(e)
        }),
        ("device props", "an empty deviceName", || {
            props_with("deviceName", json!(""))
        }),
        ("device props", "a deviceName of 300 bytes", || {
            props_with("deviceName", json!("G".repeat(300)))
        }),
        ("device props", "a deviceName with a NUL", || {
            props_with("deviceName", json!("NVIDIA\u{0}H200"))
        }),
        ("device props", "a deviceName that is a number", || {
            props_with("deviceName", json!(200))
        }),
        (
            "device props",
            "maxThreadsPerBlock above maxThreadsPerSM",
            || {
                let mut v: serde_json::Value = serde_json::from_str(H200_JSON).unwrap();
                v["maxThreadsPerBlock"] = json!(4096);
                v["maxThreadsPerSM"] = json!(2048);
                let e = DeviceProps::from_json(&v.to_string()).unwrap_err();
                assert!(e.to_string().contains("exceeds `maxThreadsPerSM`"), "{e}");
                typed(e)
            },
        ),
        (
            "device props",
            "shared memory per block above its opt-in",
            || props_with("maxSharedMemoryPerBlock", json!(300000)),
        ),
        ("device props", "a maxBlockSize element of 0", || {
            props_with("maxBlockSize", json!([1024, 0, 64]))
        }),
        ("device props", "a maxGridSize element of 2^31", || {
            props_with("maxGridSize", json!([2147483648u64, 65535, 65535]))
        }),
        ("device props", "isTccDriver 2 (a flag)", || {
            props_with("isTccDriver", json!(2))
        }),
        (
            "device props",
            "a flag given as true in a deviceless document",
            || props_with("supportCoopLaunch", json!(true)),
        ),
        ("device props", "totalGlobalMem of 2^51 bytes", || {
            props_with("totalGlobalMem", json!(1u64 << 51))
        }),
        ("device props", "an SM clock of 0 kHz", || {
            props_with("smClockRateKHz", json!(0))
        }),
        ("device props", "a memory clock of 20 GHz", || {
            props_with("memClockRateKHz", json!(20_000_000))
        }),
        ("device props", "a negative pciDeviceId", || {
            props_with("pciDeviceId", json!(-1))
        }),
        ("device props", "a fractional SM count", || {
            props_with("multiProcessorCount", json!(131.5))
        }),
        ("device props", "a document of 100 KiB", || {
            let doc = format!("{}{}", " ".repeat(100 << 10), H200_JSON);
            let e = DeviceProps::from_json(&doc).unwrap_err();
            assert!(e.to_string().contains("at most 65536 accepted"), "{e}");
            typed(e)
        }),
        (
            "device props",
            "a live document that is not an object",
            || {
                let e = DeviceProps::from_live_json("\"NVIDIA H200\"").unwrap_err();
                assert!(e.to_string().contains("the live device"), "{e}");
                typed(e)
            },
        ),
        ("device props", "a FIFO as the file (was: a hang)", || {
            props_file_err(
                "props-fifo",
                mkfifo,
                "is a FIFO (named pipe), not a regular file",
            )
        }),
        ("device props", "a folder as the file", || {
            props_file_err(
                "props-folder",
                |p| std::fs::create_dir_all(p).unwrap(),
                "is a folder, not a regular file",
            )
        }),
        ("device props", "a 1 MiB file", || {
            props_file_err(
                "props-huge",
                |p| std::fs::write(p, vec![b' '; 1 << 20]).unwrap(),
                "at most 65536 accepted",
            )
        }),
        ("device props", "a file that is not UTF-8", || {
            props_file_err(
                "props-latin1",
                |p| std::fs::write(p, b"{\"deviceName\": \"caf\xe9\"}").unwrap(),
                "is not UTF-8 text",
            )
        }),
        ("device props", "/dev/zero as the file", || {
            let e = DeviceProps::from_file("/dev/zero").unwrap_err();
            assert!(
                e.to_string()
                    .ends_with("is a character device, not a regular file"),
                "{e}"
            );
            typed(e)
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// Plan-cache folders others could write (recoveries: memory-only, with the reason)

fn cache_folder_refused(tag: &str, mode: u32, needle: &str) -> Verdict {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
    let cache = PlanCache::persistent(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(cache.dir(), None);
    let why = cache.refused().expect("a reason").to_string();
    assert!(why.contains(needle), "{why}");
    Verdict::Recovered(format!("memory-only: {why}"))
}

fn cache_folder_rows() -> Vec<Row> {
    vec![
        ("plan cache", "a folder its group can write (0770)", || {
            cache_folder_refused("mode770", 0o770, "writable by its group (mode 770)")
        }),
        ("plan cache", "a folder anyone can write (0777)", || {
            cache_folder_refused("mode777", 0o777, "writable by its group and others")
        }),
        (
            "plan cache",
            "a folder others can write, sticky (1777)",
            || cache_folder_refused("mode1777", 0o1777, "writable by its group and others"),
        ),
        (
            "plan cache",
            "a private folder inside one anyone can write",
            || {
                use std::os::unix::fs::PermissionsExt;
                let open = scratch("open-parent");
                std::fs::create_dir_all(&open).unwrap();
                std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
                let cache = PlanCache::persistent(open.join("plans")).unwrap();
                let _ = std::fs::remove_dir_all(&open);
                assert_eq!(cache.dir(), None);
                let why = cache.refused().expect("a reason").to_string();
                assert!(
                    why.contains("open-parent is writable by its group and others"),
                    "{why}"
                );
                Verdict::Recovered(format!("memory-only: {why}"))
            },
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// The five programs' command lines and environment

/// As [`example_exits`], with `env` set for the program.
fn example_env_exits(
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
    code: i32,
    needle: &str,
) -> Verdict {
    let out = Command::new(common::example(name))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(common::repo_root())
        .output()
        .expect("spawn the example");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(code),
        "{name} {args:?} {env:?}:\n{text}"
    );
    assert!(
        !text.contains("panicked at"),
        "{name} {args:?} panicked:\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{name} {args:?} {env:?} did not say `{needle}`:\n{text}"));
    if code == 0 {
        Verdict::Recovered(line.to_string())
    } else {
        Verdict::Typed(line.to_string())
    }
}

/// A FIFO for a program's file argument, made fresh.
fn fifo_arg(tag: &str) -> String {
    let dir = scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("props.json");
    mkfifo(&fifo);
    fifo.display().to_string()
}

const NO_DEVICE_ENV: [(&str, &str); 1] = [("CUDNN_CBR_DEVICE", "bogus")];

fn program_rows() -> Vec<Row> {
    vec![
        ("train_cbr", "--lr=-1", || {
            example_exits(
                "train_cbr",
                &["--lr=-1", "--device", "cpu"],
                1,
                "invalid lr = -1",
            )
        }),
        ("train_cbr", "--lr nan", || {
            example_exits(
                "train_cbr",
                &["--lr", "nan", "--device", "cpu"],
                1,
                "invalid lr = NaN",
            )
        }),
        ("train_cbr", "--device tpu", || {
            example_exits(
                "train_cbr",
                &["--device", "tpu"],
                2,
                "device must be auto, cuda or cpu, got `tpu`",
            )
        }),
        ("train_cbr", "--cuda-graph sometimes", || {
            example_exits(
                "train_cbr",
                &["--cuda-graph", "sometimes"],
                2,
                "CUDA graph mode must be off, finish or step, got `sometimes`",
            )
        }),
        ("train_cbr", "--data imagenet", || {
            example_exits(
                "train_cbr",
                &["--data", "imagenet"],
                2,
                "data must be `synthetic` or `cifar10:DIR`",
            )
        }),
        (
            "train_cbr",
            "--data cifar10: a folder without the files",
            || {
                example_exits(
                    "train_cbr",
                    &["--data", "cifar10:/nonexistent", "--device", "cpu"],
                    1,
                    "CIFAR-10 file /nonexistent/data_batch_1.bin is missing",
                )
            },
        ),
        ("train_cbr", "--data cifar10: a file, not a folder", || {
            example_exits(
                "train_cbr",
                &["--data", "cifar10:/etc/passwd", "--device", "cpu"],
                1,
                "/etc/passwd/data_batch_1.bin",
            )
        }),
        ("train_cbr", "--ranks 0", || {
            example_exits(
                "train_cbr",
                &["--ranks", "0", "--device", "cpu"],
                1,
                "ranks must be in 1..=1024",
            )
        }),
        ("train_cbr", "--ranks 2 with CIFAR-10", || {
            example_exits(
                "train_cbr",
                &["--ranks", "2", "--data", "cifar10:/tmp", "--device", "cpu"],
                1,
                "trains on one rank (the CPU or CUDA executor)",
            )
        }),
        ("train_cbr", "--width 0", || {
            example_exits(
                "train_cbr",
                &["--width", "0", "--device", "cpu"],
                1,
                "width ≥ 1",
            )
        }),
        ("train_cbr", "--device cuda without a GPU", || {
            example_exits(
                "train_cbr",
                &["--device", "cuda", "--steps", "1"],
                1,
                "no usable CUDA device",
            )
        }),
        ("train_cbr", "CUDNN_CBR_DEVICE=bogus --device cuda", || {
            example_env_exits(
                "train_cbr",
                &["--device", "cuda", "--steps", "1"],
                &NO_DEVICE_ENV,
                1,
                "CUDNN_CBR_DEVICE is `bogus`; expected `sim`",
            )
        }),
        (
            "train_cbr",
            "CUDNN_CBR_DEVICE=bogus, device auto (falls back)",
            || {
                example_env_exits(
                    "train_cbr",
                    &["--steps", "1"],
                    &NO_DEVICE_ENV,
                    0,
                    "CUDNN_CBR_DEVICE is `bogus`",
                )
            },
        ),
        ("train_cbr", "RANK 5 of WORLD_SIZE 2", || {
            example_env_exits(
                "train_cbr",
                &["--device", "cpu", "--steps", "1"],
                &[("RANK", "5"), ("WORLD_SIZE", "2")],
                1,
                "rank is not below the world size 2",
            )
        }),
        ("train_cbr", "WORLD_SIZE=x", || {
            example_env_exits(
                "train_cbr",
                &["--device", "cpu", "--steps", "1"],
                &[("RANK", "0"), ("WORLD_SIZE", "x")],
                1,
                "WORLD_SIZE=\"x\": not a non-negative integer",
            )
        }),
        ("custom_trainer", "--help", || {
            example_exits("custom_trainer", &["--help"], 0, "Usage")
        }),
        ("custom_trainer", "--device tpu", || {
            example_exits(
                "custom_trainer",
                &["--device", "tpu"],
                2,
                "invalid value 'tpu'",
            )
        }),
        ("custom_trainer", "--steps abc", || {
            example_exits(
                "custom_trainer",
                &["--steps", "abc"],
                2,
                "`abc` is not a step count",
            )
        }),
        ("custom_trainer", "an unknown flag", || {
            example_exits(
                "custom_trainer",
                &["--bogus"],
                2,
                "unexpected argument '--bogus'",
            )
        }),
        ("custom_trainer", "--device cuda without a GPU", || {
            example_exits(
                "custom_trainer",
                &["--device", "cuda", "--steps", "1"],
                1,
                "--device cuda: no GPU",
            )
        }),
        (
            "custom_trainer",
            "CUDNN_CBR_DEVICE=bogus --device cuda",
            || {
                example_env_exits(
                    "custom_trainer",
                    &["--device", "cuda", "--steps", "1"],
                    &NO_DEVICE_ENV,
                    1,
                    "CUDNN_CBR_DEVICE is `bogus`",
                )
            },
        ),
        ("deviceless_plans", "--props /dev/null", || {
            example_exits(
                "deviceless_plans",
                &["--props", "/dev/null"],
                1,
                "is a character device, not a regular file",
            )
        }),
        ("deviceless_plans", "--props a folder", || {
            example_exits(
                "deviceless_plans",
                &["--props", "/etc"],
                1,
                "/etc: is a folder, not a regular file",
            )
        }),
        ("deviceless_plans", "--props a FIFO (was: a hang)", || {
            let fifo = fifo_arg("plans-fifo");
            example_exits(
                "deviceless_plans",
                &["--props", &fifo],
                1,
                "is a FIFO (named pipe), not a regular file",
            )
        }),
        (
            "deviceless_plans",
            "--props a file that is not JSON",
            || {
                example_exits(
                    "deviceless_plans",
                    &["--props", "Cargo.toml"],
                    1,
                    "(Cargo.toml): not valid JSON",
                )
            },
        ),
        ("deviceless_plans", "--props with warpSize 16", || {
            let dir = scratch("plans-warp");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("props.json");
            std::fs::write(
                &path,
                H200_JSON.replace("\"warpSize\": 32", "\"warpSize\": 16"),
            )
            .unwrap();
            let p = path.display().to_string();
            example_exits(
                "deviceless_plans",
                &["--props", &p],
                1,
                "`warpSize` must be 32 on every NVIDIA GPU, got 16",
            )
        }),
        ("deviceless_plans", "--threads abc", || {
            example_exits(
                "deviceless_plans",
                &["--threads", "abc"],
                2,
                "invalid value 'abc' for '--threads",
            )
        }),
        ("device_props", "--help", || {
            example_exits("device_props", &["--help"], 0, "Usage")
        }),
        ("device_props", "three positional arguments", || {
            example_exits(
                "device_props",
                &["a", "b", "c"],
                2,
                "unexpected argument 'c'",
            )
        }),
        ("device_props", "an unknown flag", || {
            example_exits(
                "device_props",
                &["--bogus"],
                2,
                "unexpected argument '--bogus'",
            )
        }),
        ("device_props", "no GPU", || {
            let out = scratch("device-props-out").display().to_string();
            example_exits("device_props", &[&out], 1, "device_props: no CUDA device")
        }),
        ("device_props", "CUDNN_CBR_DEVICE=bogus", || {
            let out = scratch("device-props-env").display().to_string();
            example_env_exits(
                "device_props",
                &[&out],
                &NO_DEVICE_ENV,
                1,
                "CUDNN_CBR_DEVICE is `bogus`",
            )
        }),
        ("fuzz_graphs", "--cases abc", || {
            example_exits(
                "fuzz_graphs",
                &["--cases", "abc"],
                2,
                "invalid value 'abc' for '--cases",
            )
        }),
        ("fuzz_graphs", "a --case beyond 64 bits", || {
            example_exits(
                "fuzz_graphs",
                &["--case", "123456789012345678901234"],
                2,
                "number too large",
            )
        }),
        (
            "fuzz_graphs",
            "--props that does not exist (validates only)",
            || {
                example_exits(
                    "fuzz_graphs",
                    &["--props", "/nonexistent.json", "--cases", "3"],
                    0,
                    "device-properties file /nonexistent.json: no such file",
                )
            },
        ),
        (
            "fuzz_graphs",
            "--props a FIFO (validates only; was: a hang)",
            || {
                let fifo = fifo_arg("fuzz-fifo");
                example_exits(
                    "fuzz_graphs",
                    &["--props", &fifo, "--cases", "3"],
                    0,
                    "is a FIFO (named pipe), not a regular file",
                )
            },
        ),
    ]
}

// ---------------------------------------------------------------------------------------------

#[test]
fn every_bad_input_is_a_typed_error_or_a_documented_recovery() {
    let rows: Vec<Row> = [
        graph_rows(),
        config_rows(),
        props_rows(),
        cache_rows(),
        loader_rows(),
        amp_rows(),
        example_rows(),
        route_rows(),
        head_rows(),
        group_rows(),
        library_rows(),
        env_rows(),
        props_more_rows(),
        cache_folder_rows(),
        program_rows(),
    ]
    .concat();
    let (mut errors, mut recoveries, mut failures) = (0, 0, Vec::new());
    println!("{:<17} {:<60} outcome", "area", "input");
    for (area, what, row) in &rows {
        match catch_unwind(AssertUnwindSafe(row)) {
            Ok(Verdict::Typed(msg)) => {
                errors += 1;
                println!("{area:<17} {what:<60} typed error: {msg}");
            }
            Ok(Verdict::Recovered(msg)) => {
                recoveries += 1;
                println!("{area:<17} {what:<60} recovered: {msg}");
            }
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("{area:<17} {what:<60} FAILED: {msg}");
                failures.push(format!("{area}: {what}: {msg}"));
            }
        }
    }
    println!(
        "totals: {} rows: {errors} typed errors / {recoveries} documented recoveries / {} failures (crashes 0: every row ran to its end)",
        rows.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(rows.len() >= 250, "the table has {} rows", rows.len());
}
