//! What the roles share: the step context of a CPU step, the conv input through the previous
//! BN's prologue, the residual of an activation, and the graph-with-bindings constructor.

use crate::cbr::graphs::ApplyResidual;
use crate::cbr::keys as k;
use crate::cbr::layer::{CbrConfig, CbrLayer, GraphRole, InputKind, LayerGraph, RouteKind, Src};
use crate::cbr::run::LayerRead;
use crate::error::{Error, Result};
use crate::graph::{Graph, TensorId};
use crate::reference::{self as r, BnParams, ConvInput, Element, InputStamp, Nhwc, Residual};

/// A graph of `role` with the buffer each of its real tensors binds to.
pub(super) fn lg(role: GraphRole, graph: Graph, bindings: Vec<(TensorId, Src)>) -> LayerGraph {
    LayerGraph {
        role,
        graph,
        bindings,
    }
}

/// What one CPU step of a layer needs: its configuration, its route, and how many replicas'
/// batches its BN statistics cover (synchronized BN's global count; 1 locally).
pub(crate) struct Cx<'a> {
    /// The layer's configuration.
    pub(crate) cfg: &'a CbrConfig,
    /// The route the layer runs.
    pub(crate) kind: RouteKind,
    /// The BN finalize's element count is the local one times this.
    pub(crate) replicas: usize,
}

impl<'a> Cx<'a> {
    /// The context of `layer`'s steps.
    pub(crate) fn new(layer: &'a CbrLayer, replicas: usize) -> Self {
        Cx {
            cfg: layer.config(),
            kind: layer.route().kind(),
            replicas,
        }
    }

    /// The reference ops' conv geometry.
    pub(crate) fn p(&self) -> r::ConvParams {
        self.cfg.shape.reference_params()
    }

    /// The conv input's shape (the previous BN's tensors).
    pub(crate) fn xs(&self) -> Nhwc {
        let s = &self.cfg.shape;
        Nhwc::new(s.n as usize, s.h as usize, s.w as usize, s.c as usize)
    }

    /// The conv output's shape (this BN's tensors).
    pub(crate) fn ys(&self) -> Nhwc {
        let s = &self.cfg.shape;
        Nhwc::new(s.n as usize, s.p() as usize, s.q() as usize, s.k as usize)
    }

    /// The BN's ε and momentum.
    pub(crate) fn bn(&self) -> BnParams {
        BnParams {
            epsilon: self.cfg.epsilon,
            momentum: self.cfg.momentum,
        }
    }

    /// Whether the input comes through the previous BN.
    pub(crate) fn through_bn(&self) -> bool {
        self.cfg.input == InputKind::ThroughBn
    }

    /// The conv's input where it is not read through the prologue, as the graphs bind it.
    pub(crate) fn plain_in(&self) -> Src {
        plain_in(self.cfg)
    }
}

/// The conv's input where it is not read through the prologue: the materialized previous
/// activation (the unfused and generic routes materialize it), or the raw input.
pub(super) fn plain_in(config: &CbrConfig) -> Src {
    if config.input == InputKind::ThroughBn {
        k::A_PREV.this()
    } else {
        k::X.this()
    }
}

/// The error of a [`LayerIo::write_half`] that returned without running its op (a table's
/// defect, named instead of a panic).
pub(super) fn unwritten(name: &str) -> Error {
    Error::Buffer {
        name: name.into(),
        problem: "was not written: the buffer table's write_half did not run the op".into(),
    }
}

/// The previous BN's apply as the conv's prologue, read from the previous layer's buffers.
pub(super) fn prologue_input<T: Element, I: LayerRead<T> + ?Sized>(
    io: &I,
) -> Result<ConvInput<'_, T>> {
    Ok(ConvInput::Prologue {
        y_prev: io.half(k::Y.prev())?,
        scale: io.half(k::EQ_SCALE.prev())?,
        bias: io.half(k::EQ_BIAS.prev())?,
    })
}

/// The stamps of a conv's input buffers ([`InputStamp`]): the prologue's `y_prev`,
/// `eq_scale` and `eq_bias`, or the plain input's; `None` unless the table stamps all of them.
pub(super) fn input_stamp<T: Element, I: LayerRead<T> + ?Sized>(
    io: &I,
    prologue: bool,
    plain_in: Src,
) -> InputStamp {
    if prologue {
        Some([
            io.stamp(k::Y.prev())?,
            io.stamp(k::EQ_SCALE.prev())?,
            io.stamp(k::EQ_BIAS.prev())?,
        ])
    } else {
        Some([io.stamp(plain_in)?, 0, 0])
    }
}

/// The residual of a layer's activation, as its config names it.
pub(crate) fn residual_of<'a, T: Element, I: LayerRead<T> + ?Sized>(
    io: &'a I,
    residual: Option<ApplyResidual>,
) -> Result<Residual<'a, T>> {
    Ok(match residual {
        Some(ApplyResidual::Add) => Residual::Add(io.half(k::RESIDUAL.this())?),
        Some(ApplyResidual::DualScaleBias) => Residual::ScaleBias {
            r: io.half(k::RESIDUAL.this())?,
            scale: io.half(k::RESIDUAL_SCALE.this())?,
            bias: io.half(k::RESIDUAL_BIAS.this())?,
        },
        _ => Residual::None,
    })
}

/// The bindings of an activation's residual tensors (the residual, and its own scale and bias
/// in the dual form), as both the apply and the unfused BN forward name them.
pub(super) fn residual_bindings(
    residual: Option<TensorId>,
    scale_bias: Option<(TensorId, TensorId)>,
) -> Vec<(TensorId, Src)> {
    let mut b: Vec<_> = residual
        .map(|r| (r, k::RESIDUAL.this()))
        .into_iter()
        .collect();
    if let Some((s2, b2)) = scale_bias {
        b.extend([
            (s2, k::RESIDUAL_SCALE.this()),
            (b2, k::RESIDUAL_BIAS.this()),
        ]);
    }
    b
}
