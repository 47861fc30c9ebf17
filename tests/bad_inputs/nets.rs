//! Bad inputs: per-layer routes, the head's classes, and data-parallel groups of different networks.

use super::*;

pub(super) fn per_layer(names: &[&str]) -> RoutePolicy<'static> {
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
pub(super) fn unknown_routes(names: &[&str], unknown: &[&str]) -> Verdict {
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

pub(super) fn route_rows() -> Vec<Row> {
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

pub(super) fn mini_net(classes: usize) -> cudnn_cbr::net::CompiledNet {
    let spec = Preset::Mini.spec(3, classes, 4);
    compile(&spec, 2, 8, &RoutePolicy::Uniform(RouteKind::Fused)).unwrap()
}

/// The head's class count against a spec of 4 must be refused, naming both.
pub(super) fn head_classes(e: ClassifierError, head: usize) -> Verdict {
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

pub(super) fn cpu_classifier(classes: usize) -> Result<CpuClassifier, ClassifierError> {
    CpuClassifier::new(
        mini_net(4),
        classes,
        StepConfig::new(SgdConfig::new(0.1)),
        1,
    )
}

/// A 4-class mini classifier (batch 2 of 8x8x3) fed `images` values and `labels`.
pub(super) fn classifier_input(images: usize, labels: &[i32], needle: &str) -> Verdict {
    let mut model = cpu_classifier(4).unwrap();
    model.step_mut().begin().unwrap();
    let e = model
        .forward_backward(&vec![half::f16::ZERO; images], labels)
        .expect_err("the batch must be refused");
    assert!(matches!(e, ClassifierError::Input(_)), "{e:?}");
    assert!(e.to_string().contains(needle), "{e}");
    typed(e)
}

pub(super) fn head_rows() -> Vec<Row> {
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
pub(super) fn group_of(
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

pub(super) const F: RouteKind = RouteKind::Fused;

pub(super) fn group_rows() -> Vec<Row> {
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
