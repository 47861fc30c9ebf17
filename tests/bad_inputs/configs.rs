//! Bad inputs: layer and network configs.

use super::*;

pub(super) fn shape() -> ConvShape {
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

pub(super) fn invalid_field(e: &Error, want: &str) {
    assert!(
        matches!(e, Error::InvalidConfig { field, .. } if field.contains(want)),
        "expected InvalidConfig on `{want}`, got {e:?}"
    );
}

pub(super) fn layer_err(config: CbrConfig) -> Error {
    // Validation comes before anything else: no cuDNN is needed to refuse a config.
    config.validate().expect_err("the config must be rejected")
}

pub(super) fn planned_layer_err(config: CbrConfig) -> Option<Error> {
    common::cudnn_or_skip("planned_layer_err")?;
    let target = h200();
    Some(CbrLayer::plan(config, &target, &PlanCache::new()).expect_err("must be rejected"))
}

pub(super) fn h200() -> Target {
    Target::deviceless_from_file(common::repo_root().join("tests/fixtures/devprops/h200-sm90.json"))
        .unwrap()
}

pub(super) fn config_rows() -> Vec<Row> {
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

pub(super) fn net_err_says(
    preset: Preset,
    batch: usize,
    hw: usize,
    field: &str,
    needle: &str,
) -> Verdict {
    let policy = RoutePolicy::Uniform(cudnn_cbr::fusion::cbr::RouteKind::Fused);
    let e = compile(&preset.spec(3, 4, 8), batch, hw, &policy).expect_err("must be rejected");
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    if !field.is_empty() {
        invalid_field(&e, field);
    }
    assert!(e.to_string().contains(needle), "{e}");
    typed(e)
}

pub(super) fn pool_err(pool: PoolSpec) -> Verdict {
    let mut spec = Preset::ResNet18.spec(3, 4, 8);
    spec.stem.max_pool = Some(pool);
    net_compile_err(&spec, 2, 32, "max_pool")
}

pub(super) fn max_pool_err(p: PoolSpec, hw: usize, field: &str) -> Verdict {
    let s = Nhwc::new(1, hw, hw, 2);
    let x = vec![half::f16::ONE; s.elems()];
    let e = max_pool(&p, &s, &x).unwrap_err();
    invalid_field(&e, field);
    typed(e)
}

pub(super) fn net_err(preset: Preset, batch: usize, hw: usize, field: &str) -> Verdict {
    let spec = preset.spec(3, 4, 8);
    net_compile_err(&spec, batch, hw, field)
}

pub(super) fn net_spec_err(spec: &NetSpec, field: &str) -> Verdict {
    net_compile_err(spec, 4, 16, field)
}

pub(super) fn net_compile_err(spec: &NetSpec, batch: usize, hw: usize, field: &str) -> Verdict {
    let policy = RoutePolicy::Uniform(cudnn_cbr::fusion::cbr::RouteKind::Fused);
    let e = compile(spec, batch, hw, &policy).expect_err("the network must be rejected");
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    if !field.is_empty() {
        invalid_field(&e, field);
    }
    typed(e)
}
