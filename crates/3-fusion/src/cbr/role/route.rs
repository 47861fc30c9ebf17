//! Each route's graphs in execution order, composed from the role families.

use super::{apply, backward_fused, backward_unfused, forward_fused, forward_unfused};
use crate::cbr::layer::{CbrConfig, InputKind, LayerGraph, RouteKind};

/// The graphs of one route of a layer in execution order (forward, then backward), with the
/// buffer of every real tensor. Backward order: the apply's backward (when the activation is
/// materialized) first, since it produces this layer's `dy`. `route` is a [`RouteKind`] (or a
/// `bool`: `true` = fused, `false` = unfused).
pub fn route_graphs(config: &CbrConfig, route: impl Into<RouteKind>) -> Vec<LayerGraph> {
    let kind = route.into();
    let through_bn = config.input == InputKind::ThroughBn;
    let mut out = Vec::new();
    // The unfused and generic routes materialize the previous BN's activation; the conv reads it.
    if kind != RouteKind::Fused {
        out.extend(forward_unfused::apply_prev_graph(config, kind));
    }
    match kind {
        RouteKind::Fused | RouteKind::Generic => {
            // The fused route applies the previous BN as the conv's prologue; the generic route
            // convolves the materialized activation (conv + GenStats without the prologue has a
            // runtime-compiled engine where ConvBNfprop has none). Both then run BN finalize.
            out.extend(forward_fused::graphs(config, kind));
            out.push(forward_fused::finalize_graph(config));
        }
        RouteKind::Unfused => out.extend(forward_unfused::graphs(config)),
    }
    // The unfused route's BN forward already stored the activation; the others apply the BN
    // from its eq coefficients.
    out.extend(apply::apply_graph(config, kind));
    out.extend(apply::backward_graphs(config, kind));
    match (kind, through_bn) {
        (RouteKind::Fused, true) => out.extend(backward_fused::fused_graphs(config)),
        (_, false) => out.extend(backward_fused::raw_input_graphs(config)),
        (RouteKind::Unfused | RouteKind::Generic, true) => {
            out.extend(backward_unfused::graphs(config, kind))
        }
    }
    out
}
