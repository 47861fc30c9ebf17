//! The compiler itself: a description's layers in forward order with their routes and
//! pairings, every buffer once, and the forward and backward steps.

use super::validate::{elems, in_layer, invalid, out_size, validate};
use super::{BufId, BufferRole, CompiledNet, LayerRole, NetBuffer, NetLayer, RoutePolicy, Step};
use crate::net::spec::{BlockKind, BlockSpec, NetSpec};
use crate::runtime::DataType;
use cudnn_cbr_fusion::cbr::graphs::ApplyResidual;
use cudnn_cbr_fusion::cbr::{CbrConfig, CbrLayer, ConvShape, InputKind, Pass, RouteKind};
use cudnn_cbr_fusion::reference::Nhwc;
use cudnn_cbr_fusion::Result;
use std::collections::BTreeMap;

/// Compiles `spec` for `batch` images of `hw`×`hw`, with each layer's route from `policy`.
pub fn compile(
    spec: &NetSpec,
    batch: usize,
    hw: usize,
    policy: &RoutePolicy<'_>,
) -> Result<CompiledNet> {
    validate(spec, batch, hw)?;
    let mut c = Compiler {
        policy,
        n: batch as i64,
        buffers: Vec::new(),
        layers: Vec::new(),
        forward: Vec::new(),
        backward: Vec::new(),
    };
    let input_elems = elems("input", "hw", [batch, hw, spec.in_channels])?;
    let input = c.alloc("input", DataType::Half, input_elems, BufferRole::Input);
    // Stem: conv + BN + ReLU, stored.
    let st = &spec.stem;
    let stem_shape = ConvShape::square(
        c.n,
        spec.in_channels as i64,
        hw as i64,
        st.out as i64,
        st.kernel as i64,
        st.pad as i64,
        st.stride as i64,
    );
    stem_shape.validate().map_err(|e| in_layer("stem", e))?;
    let stem_hw = stem_shape.p() as usize;
    let act = |c: &mut Compiler, name: &str, hw: usize, ch: usize| -> Result<(BufId, BufId)> {
        let elems = elems(name, "hw", [batch, hw, ch])?;
        let a = c.alloc(name, DataType::Half, elems, BufferRole::Activation);
        let d = c.alloc(
            &format!("d:{name}"),
            DataType::Half,
            elems,
            BufferRole::Gradient,
        );
        Ok((a, d))
    };
    let (stem_out, d_stem_out) = act(&mut c, "stem.out", stem_hw, st.out)?;
    let stem_cfg = CbrConfig::first(stem_shape).with_apply(ApplyResidual::None);
    let stem = c.add_layer(
        "stem",
        LayerRole::Stem,
        stem_cfg,
        None,
        [("x", input), ("a", stem_out), ("da", d_stem_out)],
    )?;
    c.forward.push(Step::Layer {
        layer: stem,
        pass: Pass::Forward,
    });
    let mut stem_bwd = vec![Step::Layer {
        layer: stem,
        pass: Pass::Backward,
    }];
    let (mut x, mut dx, mut x_hw) = (stem_out, d_stem_out, stem_hw);
    if let Some(pool) = st.max_pool {
        let p_hw = out_size(stem_hw, pool.kernel, pool.stride, pool.pad).ok_or_else(|| {
            invalid(
                "stem",
                "max_pool",
                format!(
                    "a {0}x{0} window does not fit the stem's {stem_hw}x{stem_hw} output padded \
                     by {1}",
                    pool.kernel, pool.pad
                ),
            )
        })?;
        let (pooled, d_pooled) = act(&mut c, "stem.pool", p_hw, st.out)?;
        let shape = Nhwc::new(batch, stem_hw, stem_hw, st.out);
        c.forward.push(Step::MaxPool {
            pool,
            shape,
            input: stem_out,
            output: pooled,
        });
        stem_bwd.insert(
            0,
            Step::MaxPoolBackward {
                pool,
                shape,
                input: stem_out,
                grad_output: d_pooled,
                grad_input: d_stem_out,
            },
        );
        (x, dx, x_hw) = (pooled, d_pooled, p_hw);
    }
    let mut block_bwd: Vec<Vec<Step>> = Vec::new();
    for (i, stage) in spec.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            let prefix = format!("s{i}.b{j}");
            let out_hw = out_size(x_hw, 3, b.stride, 1).ok_or_else(|| {
                invalid(
                    &prefix,
                    "stride",
                    format!("{} does not fit {x_hw}", b.stride),
                )
            })?;
            let (out, d_out) = act(&mut c, &format!("{prefix}.out"), out_hw, b.out)?;
            let mut bwd = Vec::new();
            c.block(&prefix, b, (x_hw, out_hw), (x, dx), (out, d_out), &mut bwd)?;
            block_bwd.push(bwd);
            (x, dx, x_hw) = (out, d_out, out_hw);
        }
    }
    for bwd in block_bwd.into_iter().rev() {
        c.backward.extend(bwd);
    }
    c.backward.extend(stem_bwd);
    // Every buffer fits on its own (checked above); all of them together must too, so that
    // `CompiledNet::bytes` cannot wrap and an executor can size its allocation up front.
    c.buffers
        .iter()
        .try_fold(0usize, |sum, b| {
            b.elems
                .checked_mul(b.dtype.size())
                .and_then(|n| sum.checked_add(n))
        })
        .filter(|&total| total <= ConvShape::MAX_TENSOR_BYTES as usize)
        .ok_or_else(|| {
            invalid(
                &spec.name,
                "batch",
                format!(
                    "{batch} images of {hw}x{hw} need buffers beyond {} bytes in all",
                    ConvShape::MAX_TENSOR_BYTES
                ),
            )
        })?;
    check_route_names(spec, policy, &c.layers)?;
    let features = spec
        .stages
        .iter()
        .flatten()
        .last()
        .map_or(st.out, |b| b.out);
    Ok(CompiledNet {
        spec: spec.clone(),
        batch,
        hw,
        layers: c.layers,
        buffers: c.buffers,
        forward: c.forward,
        backward: c.backward,
        input,
        output: x,
        output_grad: dx,
        features,
        out_hw: x_hw,
    })
}

/// A per-layer route for a layer this network does not have is a caller's typo that would
/// otherwise silently leave the intended layer on the default route.
fn check_route_names(spec: &NetSpec, policy: &RoutePolicy<'_>, layers: &[NetLayer]) -> Result<()> {
    let RoutePolicy::PerLayer { routes, .. } = policy else {
        return Ok(());
    };
    let unknown: Vec<&str> = routes
        .keys()
        .filter(|k| !layers.iter().any(|l| &l.name == *k))
        .map(String::as_str)
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let real: Vec<&str> = layers.iter().map(|l| l.name.as_str()).collect();
    Err(invalid(
        &spec.name,
        "routes",
        format!(
            "names {} not in this network: {} (its layers: {})",
            if unknown.len() == 1 {
                "a layer"
            } else {
                "layers"
            },
            unknown.join(", "),
            real.join(", ")
        ),
    ))
}

struct Compiler<'p, 'a> {
    policy: &'p RoutePolicy<'a>,
    n: i64,
    buffers: Vec<NetBuffer>,
    layers: Vec<NetLayer>,
    forward: Vec<Step>,
    backward: Vec<Step>,
}

/// A conv of a block before its pairing is decided.
struct Draft {
    name: String,
    role: LayerRole,
    shape: ConvShape,
}

impl Compiler<'_, '_> {
    fn alloc(&mut self, name: &str, dtype: DataType, elems: usize, role: BufferRole) -> BufId {
        self.buffers.push(NetBuffer {
            name: name.into(),
            dtype,
            elems,
            role,
        });
        self.buffers.len() - 1
    }

    /// Adds a planned layer: its buffers are the `shared` ones where named, else its own.
    fn add_layer<const N: usize>(
        &mut self,
        name: &str,
        role: LayerRole,
        config: CbrConfig,
        prev: Option<usize>,
        shared: [(&'static str, BufId); N],
    ) -> Result<usize> {
        let layer = self.policy.layer(name, config)?;
        self.push_layer(name, role, layer, prev, &shared, None)
    }

    fn push_layer(
        &mut self,
        name: &str,
        role: LayerRole,
        layer: CbrLayer,
        prev: Option<usize>,
        shared: &[(&'static str, BufId)],
        stored_input_why: Option<String>,
    ) -> Result<usize> {
        let mut table = BTreeMap::new();
        for spec in layer.buffers() {
            let id = match shared.iter().find(|(n, _)| *n == spec.name) {
                Some(&(_, id)) => {
                    let b = &self.buffers[id];
                    if b.dtype != spec.dtype || b.elems != spec.elems {
                        return Err(invalid(
                            name,
                            spec.name,
                            format!(
                                "binds `{}` ({} x{}) but needs {} x{}",
                                b.name, b.dtype, b.elems, spec.dtype, spec.elems
                            ),
                        ));
                    }
                    id
                }
                None => self.alloc(
                    &format!("{name}.{}", spec.name),
                    spec.dtype,
                    spec.elems,
                    own_role(spec.name, spec.dtype),
                ),
            };
            table.insert(spec.name, id);
        }
        // Names bound through the prologue must exist on the previous layer.
        if let Some(p) = prev {
            for spec in layer.prev_buffers() {
                if !self.layers[p].table.contains_key(spec.name) {
                    return Err(invalid(
                        name,
                        spec.name,
                        format!(
                            "is read from `{}`, which has no such buffer",
                            self.layers[p].name
                        ),
                    ));
                }
            }
        }
        self.layers.push(NetLayer {
            name: name.into(),
            role,
            layer,
            prev,
            table,
            stored_input_why,
        });
        Ok(self.layers.len() - 1)
    }

    /// One residual block from input `(x, dx)` to output `(out, d_out)`; pushes its forward
    /// steps and writes its backward steps into `bwd`.
    fn block(
        &mut self,
        prefix: &str,
        b: &BlockSpec,
        (x_hw, out_hw): (usize, usize),
        (x, dx): (BufId, BufId),
        (out, d_out): (BufId, BufId),
        bwd: &mut Vec<Step>,
    ) -> Result<()> {
        // The block's output size (its stride sits on a 3×3 pad-1 conv; the 1×1 projection at
        // that stride gives the same).
        let (n, hw, out_hw) = (self.n, x_hw as i64, out_hw as i64);
        let (cin, width, cout, stride) = (
            b.in_ch as i64,
            b.width as i64,
            b.out as i64,
            b.stride as i64,
        );
        let draft = |conv: &str, role, shape| Draft {
            name: format!("{prefix}.{conv}"),
            role,
            shape,
        };
        let drafts: Vec<Draft> = match b.kind {
            BlockKind::Basic => vec![
                draft(
                    "conv1",
                    LayerRole::First,
                    ConvShape::square(n, cin, hw, width, 3, 1, stride),
                ),
                draft(
                    "conv2",
                    LayerRole::Last,
                    ConvShape::square(n, width, out_hw, cout, 3, 1, 1),
                ),
            ],
            BlockKind::Bottleneck => vec![
                draft(
                    "conv1",
                    LayerRole::First,
                    ConvShape::square(n, cin, hw, width, 1, 0, 1),
                ),
                draft(
                    "conv2",
                    LayerRole::Inner,
                    ConvShape::square(n, width, hw, width, 3, 1, stride),
                ),
                draft(
                    "conv3",
                    LayerRole::Last,
                    ConvShape::square(n, width, out_hw, cout, 1, 0, 1),
                ),
            ],
        };
        for d in &drafts {
            d.shape.validate().map_err(|e| in_layer(&d.name, e))?;
        }
        // The block output's joined gradient (after its ReLU backward): the last conv's and
        // the projection BN's `dpre`.
        let out_elems = self.buffers[out].elems;
        let dpre = self.alloc(
            &format!("{prefix}.dpre"),
            DataType::Half,
            out_elems,
            BufferRole::Gradient,
        );
        // The projection first: the block output's apply reads its BN.
        let down = if b.projection {
            let shape = ConvShape::square(n, cin, hw, cout, 1, 0, stride);
            let name = format!("{prefix}.down");
            shape.validate().map_err(|e| in_layer(&name, e))?;
            let cfg = CbrConfig::after_activation(shape).with_shortcut_bn();
            let id = self.add_layer(
                &name,
                LayerRole::Down,
                cfg,
                None,
                [("x", x), ("dpre", dpre)],
            )?;
            self.forward.push(Step::Layer {
                layer: id,
                pass: Pass::Forward,
            });
            Some(id)
        } else {
            None
        };
        // The last conv's residual: the identity, the projection's BN (dual scale-bias) or
        // its stored BN output (unfused route).
        let residual: (ApplyResidual, Vec<(&'static str, BufId)>) = match down {
            None => (ApplyResidual::Add, vec![("residual", x)]),
            Some(d) => {
                let t = &self.layers[d].table;
                match t.get("y_bn") {
                    Some(&y_bn) => (ApplyResidual::Add, vec![("residual", y_bn)]),
                    None => (
                        ApplyResidual::DualScaleBias,
                        vec![
                            ("residual", t["y"]),
                            ("residual_scale", t["eq_scale"]),
                            ("residual_bias", t["eq_bias"]),
                        ],
                    ),
                }
            }
        };
        // Decide the chain's pairings: conv k+1 takes conv k's BN as its prologue when it runs
        // fused and conv k's BN has eq coefficients; else conv k stores its activation.
        let count = drafts.len();
        let mut configs: Vec<CbrConfig> = Vec::with_capacity(count);
        let mut planned: Vec<CbrLayer> = Vec::with_capacity(count);
        let mut whys: Vec<Option<String>> = Vec::with_capacity(count);
        for (k, d) in drafts.iter().enumerate() {
            let mut cfg = if k == 0 {
                CbrConfig::after_activation(d.shape)
            } else {
                CbrConfig::new(d.shape)
            };
            if d.role == LayerRole::Last {
                cfg = cfg.with_apply(residual.0);
            }
            let mut layer = self.policy.layer(&d.name, cfg)?;
            let mut why = None;
            if k > 0 {
                let prev_kind = planned[k - 1].route().kind();
                if layer.route().kind() != RouteKind::Fused || prev_kind == RouteKind::Unfused {
                    why = Some(match layer.route().reason() {
                        Some(reason) if layer.route().kind() != RouteKind::Fused => format!(
                            "with the prologue it runs {}: {}",
                            layer.route().name(),
                            reason.lines().next().unwrap_or("")
                        ),
                        _ => format!(
                            "{} runs {} (no eq coefficients for a prologue)",
                            drafts[k - 1].name,
                            prev_kind.name()
                        ),
                    });
                    // Materialize the pair: the producer stores its activation, the consumer
                    // reads it like a block input.
                    let pcfg = configs[k - 1].with_apply(ApplyResidual::None);
                    planned[k - 1] = self.policy.layer(&drafts[k - 1].name, pcfg)?;
                    configs[k - 1] = pcfg;
                    cfg = CbrConfig {
                        input: InputKind::Raw,
                        ..cfg
                    };
                    layer = self.policy.layer(&d.name, cfg)?;
                }
            }
            configs.push(cfg);
            planned.push(layer);
            whys.push(why);
        }
        // Tables: a materialized pair shares the producer's activation (`a`) and its gradient
        // (`da` = the consumer's `dx`); the first conv reads the block input; the last writes
        // the block output.
        let mut ids = Vec::with_capacity(count);
        let mut pending: Vec<(&'static str, BufId)> = vec![("x", x)];
        for (k, ((d, layer), why)) in drafts.iter().zip(planned).zip(whys).enumerate() {
            let mut shared = std::mem::take(&mut pending);
            let materialized = layer.config().apply.is_some() && d.role != LayerRole::Last;
            if d.role == LayerRole::Last {
                shared.extend([("a", out), ("da", d_out), ("dpre", dpre)]);
                shared.extend(residual.1.iter().copied());
            }
            let prev = (k > 0 && layer.config().input == InputKind::ThroughBn).then(|| ids[k - 1]);
            let id = self.push_layer(&d.name, d.role, layer, prev, &shared, why)?;
            if materialized {
                let t = &self.layers[id].table;
                pending = vec![("x", t["a"]), ("dx", t["da"])];
            }
            self.forward.push(Step::Layer {
                layer: id,
                pass: Pass::Forward,
            });
            ids.push(id);
        }
        // Backward: the chain in reverse, then the projection (it needs the joined `dpre`),
        // then the gradient join at the block input.
        for &id in ids.iter().rev() {
            bwd.push(Step::Layer {
                layer: id,
                pass: Pass::Backward,
            });
        }
        let first_dx = self.layers[ids[0]].table["dx"];
        let shortcut_grad = match down {
            Some(d) => {
                bwd.push(Step::Layer {
                    layer: d,
                    pass: Pass::Backward,
                });
                self.layers[d].table["dx"]
            }
            None => dpre,
        };
        bwd.push(Step::Add {
            a: first_dx,
            b: shortcut_grad,
            out: dx,
        });
        Ok(())
    }
}

/// The role of a layer's own buffer, by its name and type.
fn own_role(name: &str, dtype: DataType) -> BufferRole {
    match name {
        "w" | "gamma" | "beta" => BufferRole::Param,
        "dw" | "dgamma" | "dbeta" => BufferRole::ParamGrad,
        "running_mean" | "running_var" | "running_mean_next" | "running_var_next" => {
            BufferRole::Running
        }
        "y" | "a" | "y_bn" | "a_prev" => BufferRole::Activation,
        // Full-tensor gradients (dy, dz_prev, dpre, …) are FP16; the per-channel `d…` vectors
        // (the dBN coefficients) are scratch.
        n if n.starts_with('d') && dtype == DataType::Half => BufferRole::Gradient,
        _ => BufferRole::Scratch,
    }
}
