//! A chain of CBR layers composed from the ops, forward and backward, on either route:
//!
//! - [`Route::Fused`]: the GPU's graphs (docs/cudnn-graphs.md §8). Forward: [`fprop_genstats`] with the
//!   previous BN as prologue (plain for the first layer), [`bn_finalize`], and [`bn_apply`]
//!   only where an activation must be stored. Backward: the last BN (whose output feeds no conv)
//!   by [`relu_bwd`] + [`bn_bwd`]; then per layer [`dgrad_drelu_dbn`], [`wgrad_with_prologue`]
//!   and [`dbn_apply`]; the first layer by plain [`conv_wgrad`] and [`conv_dgrad`].
//! - [`Route::Unfused`]: every step materialized: [`conv_fprop`], [`bn_fwd_train`], [`add`]
//!   (shortcut), [`relu_fwd`]; backward [`relu_bwd`], [`bn_bwd`], [`conv_wgrad`],
//!   [`conv_dgrad`], [`add`].
//!
//! A layer may have an identity shortcut: its output is `relu(BN(conv(a)) + a)` for its input
//! activation `a` (same shape in and out). A layer's output activation is stored on the fused
//! route when it is the chain's output, has a shortcut, or is the shortcut of the next layer;
//! the next conv then reads it plainly, and the fused backward uses pattern 5's `shortcut`
//! (`resid`) and `fuse_add` (`dy_branch`) variants.
//!
//! [`weighted_sum_loss`] gives a scalar loss whose gradient w.r.t. the output is known, for
//! gradient checks.

use super::bn::{bn_bwd, bn_finalize, bn_fwd_train, RunningStats};
use super::conv::{conv_dgrad, conv_fprop, conv_wgrad};
use super::element::{Element, Real};
use super::error::{ReferenceError, Result};
use super::fused::{
    dgrad_drelu_dbn, fprop_genstats, wgrad_with_prologue, ConvInput, FpropStats, ReluJoin, SavedBn,
};
use super::params::{check_len, check_shape, BnParams, ConvParams};
use super::pointwise::{add, bn_apply, dbn_apply, relu_bwd, relu_fwd, Activation, Residual};

/// Which implementation of the CBR step a chain runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The fused cuDNN graphs (patterns 1–6).
    Fused,
    /// Separate, materialized conv, BN, add and ReLU steps.
    Unfused,
}

/// One conv + BN + ReLU layer: its parameters and BN state.
#[derive(Debug, Clone, PartialEq)]
pub struct CbrLayer<T: Element> {
    /// The conv's shape.
    pub conv: ConvParams,
    /// Filter, KRSC `[k, r, s, c]`.
    pub w: Vec<T>,
    /// BN γ, FP32 `[k]`.
    pub gamma: Vec<T::Acc>,
    /// BN β, FP32 `[k]`.
    pub beta: Vec<T::Acc>,
    /// BN running mean, FP32 `[k]` (updated by each forward).
    pub running_mean: Vec<T::Acc>,
    /// BN running variance, FP32 `[k]` (updated by each forward).
    pub running_var: Vec<T::Acc>,
    /// Whether the layer adds its input to the BN output before the ReLU (identity shortcut;
    /// the conv must keep the shape).
    pub shortcut: bool,
}

impl<T: Element> CbrLayer<T> {
    /// A layer without shortcut, with γ = 1, β = 0, running mean 0 and running variance 1.
    pub fn new(conv: ConvParams, w: Vec<T>) -> Self {
        let k = conv.k;
        CbrLayer {
            conv,
            w,
            gamma: vec![T::Acc::ONE; k],
            beta: vec![T::Acc::ZERO; k],
            running_mean: vec![T::Acc::ZERO; k],
            running_var: vec![T::Acc::ONE; k],
            shortcut: false,
        }
    }
}

/// A chain of CBR layers, each consuming the previous one's output.
#[derive(Debug, Clone, PartialEq)]
pub struct CbrChain<T: Element> {
    /// The layers, input first.
    pub layers: Vec<CbrLayer<T>>,
    /// BN epsilon and momentum, shared by all layers.
    pub bn: BnParams,
}

/// What the forward of one layer keeps for the backward.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerForward<T: Element> {
    /// The raw conv output, FP16 NHWC.
    pub y: Vec<T>,
    /// Saved batch mean, FP32 `[k]`.
    pub saved_mean: Vec<T::Acc>,
    /// Saved inverse std, FP32 `[k]`.
    pub saved_inv_std: Vec<T::Acc>,
    /// `(eq_scale, eq_bias)`, FP16 `[k]`: on the fused route only.
    pub eq: Option<(Vec<T>, Vec<T>)>,
    /// The stored output activation, where one is stored (every layer on the unfused route; see
    /// the module docs for the fused route). The last layer's is [`ChainForward::output`].
    pub activation: Option<Vec<T>>,
}

/// The result of [`CbrChain::forward`].
#[derive(Debug, Clone, PartialEq)]
pub struct ChainForward<T: Element> {
    /// The route that produced it; [`CbrChain::backward`] runs the same one.
    pub route: Route,
    /// Per layer, input first.
    pub layers: Vec<LayerForward<T>>,
    /// The chain's output activation, FP16 NHWC.
    pub output: Vec<T>,
}

/// One layer's gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerGrads<T: Element> {
    /// `∂L/∂w`, FP16 KRSC.
    pub dw: Vec<T>,
    /// `∂L/∂γ`, FP32 `[k]`.
    pub dgamma: Vec<T::Acc>,
    /// `∂L/∂β`, FP32 `[k]`.
    pub dbeta: Vec<T::Acc>,
}

/// The result of [`CbrChain::backward`].
#[derive(Debug, Clone, PartialEq)]
pub struct ChainGrads<T: Element> {
    /// `∂L/∂x` for the chain's input, FP16 NHWC.
    pub dx: Vec<T>,
    /// Per layer, input first.
    pub layers: Vec<LayerGrads<T>>,
}

impl<T: Element> CbrChain<T> {
    /// A validated chain (see [`CbrChain::validate`]).
    pub fn new(layers: Vec<CbrLayer<T>>, bn: BnParams) -> Result<Self> {
        let chain = CbrChain { layers, bn };
        chain.validate()?;
        Ok(chain)
    }

    /// Checks that there is at least one layer, that every conv is valid, that every vector has
    /// its layer's length, that each layer's input shape is the previous layer's output shape,
    /// and that shortcut layers keep their shape. Errors name the layer.
    pub fn validate(&self) -> Result<()> {
        if self.layers.is_empty() {
            return Err(ReferenceError::ZeroDimension {
                tensor: "chain",
                dim: "layers",
            });
        }
        self.bn.validate()?;
        for (i, layer) in self.layers.iter().enumerate() {
            let p = &layer.conv;
            let check = || -> Result<()> {
                p.validate()?;
                check_len("w", &layer.w, p.w_elems())?;
                check_len("gamma", &layer.gamma, p.k)?;
                check_len("beta", &layer.beta, p.k)?;
                check_len("running_mean", &layer.running_mean, p.k)?;
                check_len("running_var", &layer.running_var, p.k)?;
                if let Some(prev) = i.checked_sub(1).map(|j| &self.layers[j]) {
                    check_shape("x", p.input_shape(), prev.conv.output_shape())?;
                }
                if layer.shortcut {
                    check_shape("shortcut", p.output_shape(), p.input_shape())?;
                }
                Ok(())
            };
            check().map_err(|e| e.in_layer(i))?;
        }
        Ok(())
    }

    /// Forward in training mode on `route`: returns what the backward needs and the output,
    /// and updates every layer's running statistics. `x` is NHWC, the first conv's input.
    pub fn forward(&mut self, x: &[T], route: Route) -> Result<ChainForward<T>> {
        self.validate()?;
        check_len("x", x, self.layers[0].conv.x_elems())?;
        let shortcuts: Vec<bool> = self.layers.iter().map(|l| l.shortcut).collect();
        let bn = self.bn;
        let mut records: Vec<LayerForward<T>> = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let prev = i.checked_sub(1).map(|j| &records[j]);
            let record = match route {
                Route::Fused => {
                    let store = i + 1 == shortcuts.len()
                        || shortcuts[i]
                        || shortcuts.get(i + 1).copied().unwrap_or(false);
                    fused_layer_forward(layer, x, prev, i, store, &bn)
                }
                Route::Unfused => unfused_layer_forward(layer, x, prev, i, &bn),
            }
            .map_err(|e| e.in_layer(i))?;
            records.push(record);
        }
        let output = records.last_mut().and_then(|r| r.activation.take()).ok_or(
            ReferenceError::Internal {
                what: "the last layer stored no activation",
            },
        )?;
        Ok(ChainForward {
            route,
            layers: records,
            output,
        })
    }

    /// Backward of the loss whose gradient w.r.t. the chain's output is `d_out` (NHWC), on the
    /// route `fwd` was made on, with `x` the forward's input: `∂L/∂x` and each layer's
    /// `∂L/∂w`, `∂L/∂γ`, `∂L/∂β`.
    pub fn backward(&self, fwd: &ChainForward<T>, x: &[T], d_out: &[T]) -> Result<ChainGrads<T>> {
        self.validate()?;
        let n = self.layers.len();
        check_len("x", x, self.layers[0].conv.x_elems())?;
        check_len("d_out", d_out, self.layers[n - 1].conv.y_elems())?;
        if fwd.layers.len() != n {
            return Err(ReferenceError::ShapeMismatch {
                tensor: "fwd.layers",
                expected: n,
                got: fwd.layers.len(),
            });
        }
        let ctx = Backward {
            chain: self,
            fwd,
            x,
        };
        match fwd.route {
            Route::Fused => ctx.fused(d_out),
            Route::Unfused => ctx.unfused(d_out),
        }
    }
}

/// `Σ out·weights`, summed in `f64`: a scalar loss whose gradient w.r.t. `out` is `weights`.
pub fn weighted_sum_loss<T: Element>(out: &[T], weights: &[T]) -> Result<f64> {
    check_len("weights", weights, out.len())?;
    Ok(out
        .iter()
        .zip(weights)
        .map(|(o, w)| o.to_f64() * w.to_f64())
        .sum())
}

/// What layer `i`'s conv reads: `x` for the first layer, else the previous layer's stored
/// activation, or its raw output with its BN apply as prologue.
fn conv_input<'a, T: Element>(
    x: &'a [T],
    prev: Option<&'a LayerForward<T>>,
    i: usize,
) -> Result<ConvInput<'a, T>> {
    let Some(prev) = prev else {
        return Ok(ConvInput::Plain(x));
    };
    if let Some(a) = &prev.activation {
        return Ok(ConvInput::Plain(a));
    }
    let (scale, bias) = prev
        .eq
        .as_ref()
        .ok_or(ReferenceError::MissingForwardState {
            layer: i.saturating_sub(1),
            what: "eq_scale/eq_bias",
        })?;
    Ok(ConvInput::Prologue {
        y_prev: &prev.y,
        scale,
        bias,
    })
}

/// The activation a layer's shortcut adds: its conv's input, which must be stored.
fn stored_input<'a, T: Element>(
    x: &'a [T],
    prev: Option<&'a LayerForward<T>>,
    i: usize,
) -> Result<&'a [T]> {
    match conv_input(x, prev, i)? {
        ConvInput::Plain(a) => Ok(a),
        ConvInput::Prologue { .. } => Err(ReferenceError::MissingForwardState {
            layer: i.saturating_sub(1),
            what: "activation",
        }),
    }
}

fn fused_layer_forward<T: Element>(
    layer: &mut CbrLayer<T>,
    x: &[T],
    prev: Option<&LayerForward<T>>,
    i: usize,
    store: bool,
    bn: &BnParams,
) -> Result<LayerForward<T>> {
    let p = layer.conv;
    let FpropStats { y, stats } = fprop_genstats(&p, conv_input(x, prev, i)?, &layer.w)?;
    let out_shape = p.output_shape();
    let running = RunningStats {
        mean: &mut layer.running_mean,
        var: &mut layer.running_var,
    };
    let fin = bn_finalize(
        &stats,
        &layer.gamma,
        &layer.beta,
        running,
        out_shape.pixels(),
        bn,
    )?;
    let activation = if store {
        let residual = if layer.shortcut {
            Residual::Add(stored_input(x, prev, i)?)
        } else {
            Residual::None
        };
        let (s, b) = (&fin.eq_scale, &fin.eq_bias);
        Some(bn_apply(&out_shape, &y, s, b, residual, Activation::Relu)?)
    } else {
        None
    };
    Ok(LayerForward {
        y,
        saved_mean: fin.saved_mean,
        saved_inv_std: fin.saved_inv_std,
        eq: Some((fin.eq_scale, fin.eq_bias)),
        activation,
    })
}

fn unfused_layer_forward<T: Element>(
    layer: &mut CbrLayer<T>,
    x: &[T],
    prev: Option<&LayerForward<T>>,
    i: usize,
    bn: &BnParams,
) -> Result<LayerForward<T>> {
    let p = layer.conv;
    let input = stored_input(x, prev, i)?;
    let y = conv_fprop(&p, input, &layer.w)?;
    let out_shape = p.output_shape();
    let running = RunningStats {
        mean: &mut layer.running_mean,
        var: &mut layer.running_var,
    };
    let bnf = bn_fwd_train(&out_shape, &y, &layer.gamma, &layer.beta, running, bn)?;
    let pre_relu = if layer.shortcut {
        add(&out_shape, &bnf.out, input)?
    } else {
        bnf.out
    };
    Ok(LayerForward {
        activation: Some(relu_fwd(&out_shape, &pre_relu)?),
        y,
        saved_mean: bnf.saved_mean,
        saved_inv_std: bnf.saved_inv_std,
        eq: None,
    })
}

/// The inputs every backward step reads.
struct Backward<'a, T: Element> {
    chain: &'a CbrChain<T>,
    fwd: &'a ChainForward<T>,
    x: &'a [T],
}

impl<T: Element> Backward<'_, T> {
    /// The record of the layer before `i`, if any.
    fn prev(&self, i: usize) -> Option<&LayerForward<T>> {
        i.checked_sub(1).map(|j| &self.fwd.layers[j])
    }

    /// Layer `i`'s stored output activation.
    fn activation(&self, i: usize) -> Result<&[T]> {
        if i + 1 == self.fwd.layers.len() {
            return Ok(&self.fwd.output);
        }
        self.fwd.layers[i]
            .activation
            .as_deref()
            .ok_or(ReferenceError::MissingForwardState {
                layer: i,
                what: "activation",
            })
    }

    fn fused(&self, d_out: &[T]) -> Result<ChainGrads<T>> {
        let layers = &self.chain.layers;
        let last = layers.len() - 1;
        let mut grads = vec![
            LayerGrads {
                dw: Vec::new(),
                dgamma: Vec::new(),
                dbeta: Vec::new(),
            };
            layers.len()
        ];
        // The last BN feeds no conv: ReLU backward on the stored output, then BN backward.
        // `dy` is the gradient w.r.t. the current layer's raw conv output, `dz` the one w.r.t.
        // its BN output (its ReLU input, and its shortcut's input).
        let (layer, rec) = (&layers[last], &self.fwd.layers[last]);
        let shape = layer.conv.output_shape();
        let step = || -> Result<_> {
            let dz = relu_bwd(&shape, d_out, self.activation(last)?)?;
            let g = &layer.gamma;
            let bnb = bn_bwd(&shape, &rec.y, &dz, &rec.saved_mean, &rec.saved_inv_std, g)?;
            Ok((bnb, dz))
        };
        let (bnb, mut dz) = step().map_err(|e| e.in_layer(last))?;
        let mut dy = bnb.dx;
        grads[last].dgamma = bnb.dgamma;
        grads[last].dbeta = bnb.dbeta;
        // Layers last..1: conv i's dgrad fused with BN i-1's backward, and conv i's wgrad.
        for i in (1..=last).rev() {
            let (layer, prev_layer, prev) = (&layers[i], &layers[i - 1], &self.fwd.layers[i - 1]);
            let p = layer.conv;
            let step = || -> Result<_> {
                let join = ReluJoin {
                    resid: if prev_layer.shortcut {
                        Some(stored_input(self.x, self.prev(i - 1), i - 1)?)
                    } else {
                        None
                    },
                    dy_branch: layer.shortcut.then_some(dz.as_slice()),
                };
                let saved = SavedBn {
                    mean: &prev.saved_mean,
                    inv_std: &prev.saved_inv_std,
                    gamma: &prev_layer.gamma,
                    beta: &prev_layer.beta,
                };
                let r = dgrad_drelu_dbn(&p, &dy, &layer.w, &prev.y, &saved, &join)?;
                let dw = wgrad_with_prologue(&p, conv_input(self.x, Some(prev), i)?, &dy)?;
                let dy_prev = dbn_apply(&p.input_shape(), &r.dz, &prev.y, &r.a, &r.b, &r.c)?;
                Ok((r, dw, dy_prev))
            };
            let (r, dw, dy_prev) = step().map_err(|e| e.in_layer(i))?;
            grads[i].dw = dw;
            grads[i - 1].dgamma = r.dgamma;
            grads[i - 1].dbeta = r.dbeta;
            dy = dy_prev;
            dz = r.dz;
        }
        // The first conv: plain wgrad and dgrad, plus the shortcut's gradient.
        let p = layers[0].conv;
        let step = || -> Result<_> {
            let dw = conv_wgrad(&p, self.x, &dy)?;
            let dx = conv_dgrad(&p, &dy, &layers[0].w)?;
            let dx = if layers[0].shortcut {
                add(&p.input_shape(), &dx, &dz)?
            } else {
                dx
            };
            Ok((dw, dx))
        };
        let (dw, dx) = step().map_err(|e| e.in_layer(0))?;
        grads[0].dw = dw;
        Ok(ChainGrads { dx, layers: grads })
    }

    fn unfused(&self, d_out: &[T]) -> Result<ChainGrads<T>> {
        let layers = &self.chain.layers;
        let mut grads = Vec::with_capacity(layers.len());
        let mut d_act = d_out.to_vec();
        for (i, (layer, rec)) in layers.iter().zip(&self.fwd.layers).enumerate().rev() {
            let p = layer.conv;
            let step = || -> Result<_> {
                let shape = p.output_shape();
                let dz = relu_bwd(&shape, &d_act, self.activation(i)?)?;
                let g = &layer.gamma;
                let bnb = bn_bwd(&shape, &rec.y, &dz, &rec.saved_mean, &rec.saved_inv_std, g)?;
                let input = stored_input(self.x, self.prev(i), i)?;
                let dw = conv_wgrad(&p, input, &bnb.dx)?;
                let d_in = conv_dgrad(&p, &bnb.dx, &layer.w)?;
                let d_in = if layer.shortcut {
                    add(&p.input_shape(), &d_in, &dz)?
                } else {
                    d_in
                };
                Ok((
                    LayerGrads {
                        dw,
                        dgamma: bnb.dgamma,
                        dbeta: bnb.dbeta,
                    },
                    d_in,
                ))
            };
            let (g, d_in) = step().map_err(|e| e.in_layer(i))?;
            grads.push(g);
            d_act = d_in;
        }
        grads.reverse();
        Ok(ChainGrads {
            dx: d_act,
            layers: grads,
        })
    }
}
