//! The typed keys a trainer binds device buffers with agree with what the graphs bind, and
//! every layer of every network the compiler makes can be bound through them (tier 1: no
//! cuDNN, no GPU).

use cudnn_cbr::fusion::cbr::graphs::{ApplyResidual, BackwardResidual};
use cudnn_cbr::fusion::cbr::{keys, CbrConfig, CbrLayer, ConvShape, RouteKind, Side};
use cudnn_cbr::net::layer_bindings;
use cudnn_cbr::{net::compile, net::Preset, net::RoutePolicy};
use std::collections::BTreeSet;

/// Every buffer of every layer, on every route, of every preset at a small size.
fn every_layer_buffer() -> Vec<(String, &'static str, Side, cudnn_cbr::runtime::DataType)> {
    let mut out = Vec::new();
    for preset in Preset::ALL {
        for route in RouteKind::ALL {
            let spec = preset.spec(3, 10, 8);
            let net = compile(&spec, 2, 32, &RoutePolicy::Uniform(route)).unwrap();
            for l in &net.layers {
                for b in l.layer.buffers() {
                    out.push((l.name.clone(), b.name, Side::This, b.dtype));
                }
                for b in l.layer.prev_buffers() {
                    out.push((l.name.clone(), b.name, Side::Prev, b.dtype));
                }
            }
        }
    }
    // Standalone layers a trainer may chain by hand: through the previous BN (the unfused
    // routes store its activation as `a_prev`), with and without a shortcut gradient, with
    // each apply form.
    let shape = ConvShape::square(2, 8, 8, 8, 3, 1, 1);
    let mut configs = Vec::new();
    for residual in [BackwardResidual::None, BackwardResidual::FuseAdd] {
        let base = CbrConfig::new(shape).with_backward_residual(residual);
        configs.push(base);
        for apply in [
            ApplyResidual::None,
            ApplyResidual::Add,
            ApplyResidual::DualScaleBias,
        ] {
            configs.push(base.with_apply(apply));
        }
    }
    configs.push(CbrConfig::first(shape));
    configs.push(CbrConfig::after_activation(shape).with_shortcut_bn());
    for config in configs {
        for route in RouteKind::ALL {
            let l = CbrLayer::for_cpu(config, route).unwrap();
            let name = format!("{config:?} {route:?}");
            for b in l.buffers() {
                out.push((name.clone(), b.name, Side::This, b.dtype));
            }
            for b in l.prev_buffers() {
                out.push((name.clone(), b.name, Side::Prev, b.dtype));
            }
        }
    }
    out
}

#[test]
fn every_buffer_a_graph_binds_has_a_key_of_its_element_type() {
    let all = every_layer_buffer();
    assert!(all.len() > 100, "only {} buffers seen", all.len());
    for (layer, name, side, dtype) in &all {
        assert_eq!(
            keys::dtype_of(name),
            Some(*dtype),
            "{layer}: {side:?} buffer `{name}` is {dtype:?}"
        );
    }
    // No key names a buffer nothing binds (a stale key would compile and then fail at run time).
    let used: BTreeSet<&str> = all.iter().map(|b| b.1).collect();
    for (name, _) in keys::ALL {
        assert!(used.contains(name), "key `{name}` is bound by no layer");
    }
    assert_eq!(keys::Y.name(), "y");
    assert_eq!(keys::SUM.dtype(), cudnn_cbr::runtime::DataType::Float);
}

#[test]
fn every_layer_pass_of_every_network_resolves_its_bindings() {
    for preset in Preset::ALL {
        for route in RouteKind::ALL {
            let spec = preset.spec(3, 10, 8);
            let net = compile(&spec, 2, 32, &RoutePolicy::Uniform(route)).unwrap();
            for (i, l) in net.layers.iter().enumerate() {
                let wanted = layer_bindings(&net, i).unwrap();
                // Every buffer the layer's graphs bind is in its table, on its side, with the
                // network buffer's element type and at least the layer's element count.
                for (side, specs) in [
                    (Side::This, l.layer.buffers()),
                    (Side::Prev, l.layer.prev_buffers()),
                ] {
                    for spec in specs {
                        let (_, _, id) = wanted
                            .iter()
                            .find(|w| w.0 == side && w.1 == spec.name)
                            .unwrap_or_else(|| {
                                panic!("{}: {side:?} `{}` unbound", l.name, spec.name)
                            });
                        let b = &net.buffers[*id];
                        assert_eq!(b.dtype, spec.dtype, "{}: `{}`", l.name, spec.name);
                        assert!(b.elems >= spec.elems, "{}: `{}`", l.name, spec.name);
                    }
                }
                // And nothing more than the layer binds on the previous layer's side.
                let prev = wanted.iter().filter(|w| w.0 == Side::Prev).count();
                assert_eq!(prev, l.layer.prev_buffers().len(), "{}", l.name);
            }
        }
    }
}
