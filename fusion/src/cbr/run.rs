//! Running a planned layer: on a GPU through its cuDNN plans, or on the CPU through the
//! reference ops, over the same named buffers and in the same step order.

use super::buffers::{DeviceBuffers, HostBuffer, HostBuffers};
use super::graphs::{ApplyResidual, BackwardResidual};
use super::layer::{neg_inv_count, CbrLayer, GraphRole, InputKind, LayerStep, RouteKind, Src};
use crate::error::{Error, Result};
use crate::exec::{Bindings, Handle, Workspace};
use crate::reference::params::check_len;
use crate::reference::{
    self as r, Activation, BnParams, ChannelStats, ConvInput, Nhwc, ReluJoin, Residual,
    RunningStats, SavedBn,
};
use half::f16;

/// Which half of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward: conv, statistics, BN finalize, apply.
    Forward,
    /// Backward: gradients of the weights, of the previous BN and of the input.
    Backward,
}

impl CbrLayer {
    fn pass_steps(&self, pass: Pass) -> impl Iterator<Item = &LayerStep> {
        self.steps()
            .iter()
            .filter(move |s| s.role.is_backward() == (pass == Pass::Backward))
    }

    fn check_prev<T>(&self, prev: &Option<T>) -> Result<()> {
        match (self.config().input, prev.is_some()) {
            (InputKind::ThroughBn, false) => Err(Error::Buffer {
                name: "prev".into(),
                problem: format!(
                    "is required: layer {} takes its input through the previous BN",
                    self.config().shape.label()
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Enqueues one pass on the handle's stream. `this` holds the layer's buffers
    /// ([`CbrLayer::buffers`]); `prev` the previous layer's ([`CbrLayer::prev_buffers`]).
    /// Nothing waits for the GPU.
    pub fn run_gpu(
        &self,
        pass: Pass,
        handle: &Handle,
        this: &DeviceBuffers,
        prev: Option<&DeviceBuffers>,
    ) -> Result<()> {
        self.check_prev(&prev)?;
        for step in self.pass_steps(pass) {
            let plan = step.plan.as_ref().ok_or_else(|| {
                Error::CudnnMessage(format!(
                    "layer {} was made for the CPU executor: it has no cuDNN plans",
                    self.config().shape.label()
                ))
            })?;
            let prev_buf = |n: &str| {
                prev.ok_or_else(|| Error::Buffer {
                    name: format!("prev.{n}"),
                    problem: format!(
                        "is needed by step {:?} but no prev buffers were given",
                        step.role
                    ),
                })?
                .get(n)
            };
            // Per-channel reductions (GenStats' sums, BN_BWD_WEIGHTS' and the reductions' dγ/dβ)
            // may be split across CTAs that accumulate into their outputs; zero those first so
            // a step never adds to the previous step's values (a cheap memset, and harmless
            // where cuDNN overwrites them).
            let accumulated: &[&str] = match step.role {
                GraphRole::ConvStats => &["sum", "sq_sum"],
                GraphRole::DgradDreluDbn | GraphRole::DbnReduce | GraphRole::ApplyDbnReduce => {
                    &["dgamma", "dbeta"]
                }
                _ => &[],
            };
            for (_, src) in &step.bindings {
                let buf = match src {
                    Src::This(n) if accumulated.contains(n) => this.get(n)?,
                    Src::Prev(n) if accumulated.contains(n) => prev_buf(n)?,
                    _ => continue,
                };
                handle.zero_device_bytes(buf.ptr, buf.bytes)?;
            }
            let mut b = Bindings::new(plan);
            for (t, src) in &step.bindings {
                match src {
                    Src::This(name) => {
                        let buf = this.get(name)?;
                        b.bind_raw(*t, buf.ptr, buf.bytes, buf.dtype)?;
                    }
                    Src::Prev(name) => {
                        let buf = prev_buf(name)?;
                        b.bind_raw(*t, buf.ptr, buf.bytes, buf.dtype)?;
                    }
                    Src::Scalar(v) => {
                        b.bind_scalar(*t, *v)?;
                    }
                }
            }
            plan.execute(handle, &b, Workspace::Pooled)?;
        }
        Ok(())
    }

    /// Runs one pass on the CPU with the reference ops (FP16 storage, FP32 arithmetic), over
    /// host buffers named as on the GPU.
    pub fn run_cpu(
        &self,
        pass: Pass,
        this: &mut HostBuffers,
        mut prev: Option<&mut HostBuffers>,
    ) -> Result<()> {
        self.check_prev(&prev)?;
        let roles: Vec<GraphRole> = self.pass_steps(pass).map(|s| s.role).collect();
        for role in roles {
            cpu_step(self, role, this, prev.as_deref_mut())?;
        }
        Ok(())
    }
}

fn f16v(v: Vec<f16>) -> HostBuffer {
    HostBuffer::F16(v)
}

fn f32v(v: Vec<f32>) -> HostBuffer {
    HostBuffer::F32(v)
}

fn prev_of(prev: Option<&mut HostBuffers>) -> Result<&mut HostBuffers> {
    prev.ok_or_else(|| Error::Buffer {
        name: "prev".into(),
        problem: "is required by this step".into(),
    })
}

/// The previous BN's apply as the conv's prologue, read from the previous layer's buffers.
fn prologue_input(pv: &HostBuffers) -> Result<ConvInput<'_, f16>> {
    Ok(ConvInput::Prologue {
        y_prev: pv.f16("y")?,
        scale: pv.f16("eq_scale")?,
        bias: pv.f16("eq_bias")?,
    })
}

/// One role on the CPU. Mirrors the graphs in `route_graphs` buffer for buffer.
fn cpu_step(
    layer: &CbrLayer,
    role: GraphRole,
    this: &mut HostBuffers,
    prev: Option<&mut HostBuffers>,
) -> Result<()> {
    let cfg = layer.config();
    let s = &cfg.shape;
    let p = s.reference_params();
    let xs = Nhwc::new(s.n as usize, s.h as usize, s.w as usize, s.c as usize);
    let ys = Nhwc::new(s.n as usize, s.p() as usize, s.q() as usize, s.k as usize);
    let bn = BnParams {
        epsilon: cfg.epsilon,
        momentum: cfg.momentum,
    };
    let through_bn = cfg.input == InputKind::ThroughBn;
    let kind = layer.route().kind();
    // The conv's input where it is not read through the prologue, as `route_graphs` binds it:
    // the materialized previous activation, or the raw input.
    let plain_in = if through_bn { "a_prev" } else { "x" };
    match role {
        GraphRole::ConvStats => {
            // The generic route convolves the materialized activation (no prologue).
            let input = if through_bn && kind != RouteKind::Generic {
                prologue_input(prev_of(prev)?)?
            } else {
                ConvInput::Plain(this.f16(plain_in)?)
            };
            let out = r::fprop_genstats(&p, input, this.f16("w")?)?;
            this.set("y", f16v(out.y));
            this.set("sum", f32v(out.stats.sum));
            this.set("sq_sum", f32v(out.stats.sqsum));
        }
        GraphRole::Finalize => {
            let stats = ChannelStats {
                sum: this.f32("sum")?.to_vec(),
                sqsum: this.f32("sq_sum")?.to_vec(),
            };
            let (gamma, beta) = (this.f32("gamma")?.to_vec(), this.f32("beta")?.to_vec());
            let mut mean = this.f32("running_mean")?.to_vec();
            let mut var = this.f32("running_var")?.to_vec();
            let out = r::bn_finalize(
                &stats,
                &gamma,
                &beta,
                RunningStats {
                    mean: &mut mean,
                    var: &mut var,
                },
                s.count() as usize,
                &bn,
            )?;
            this.set("running_mean", f32v(mean));
            this.set("running_var", f32v(var));
            this.set("eq_scale", f16v(out.eq_scale));
            this.set("eq_bias", f16v(out.eq_bias));
            this.set("saved_mean", f32v(out.saved_mean));
            this.set("saved_inv_std", f32v(out.saved_inv_std));
        }
        GraphRole::Apply => {
            let residual = match cfg.apply {
                Some(ApplyResidual::Add) => Residual::Add(this.f16("residual")?),
                Some(ApplyResidual::DualScaleBias) => Residual::ScaleBias {
                    r: this.f16("residual")?,
                    scale: this.f16("residual_scale")?,
                    bias: this.f16("residual_bias")?,
                },
                _ => Residual::None,
            };
            let a = r::bn_apply(
                &ys,
                this.f16("y")?,
                this.f16("eq_scale")?,
                this.f16("eq_bias")?,
                residual,
                Activation::Relu,
            )?;
            this.set("a", f16v(a));
        }
        GraphRole::ApplyReluBackward => {
            let d = r::relu_bwd(&ys, this.f16("da")?, this.f16("a")?)?;
            this.set("dpre", f16v(d));
        }
        GraphRole::ApplyBnBackward => {
            let out = r::bn_bwd(
                &ys,
                this.f16("y")?,
                this.f16("dpre")?,
                this.f32("saved_mean")?,
                this.f32("saved_inv_std")?,
                this.f32("gamma")?,
            )?;
            this.set("dy", f16v(out.dx));
            this.set("dgamma", f32v(out.dgamma));
            this.set("dbeta", f32v(out.dbeta));
        }
        GraphRole::DgradDreluDbn => {
            let pv = prev_of(prev)?;
            let join = match cfg.backward_residual {
                BackwardResidual::None => ReluJoin::default(),
                BackwardResidual::FuseAdd => ReluJoin {
                    resid: None,
                    dy_branch: Some(this.f16("dy_branch")?),
                },
                BackwardResidual::Shortcut => ReluJoin {
                    resid: Some(this.f16("shortcut")?),
                    dy_branch: None,
                },
            };
            let out = r::dgrad_drelu_dbn(
                &p,
                this.f16("dy")?,
                this.f16("w")?,
                pv.f16("y")?,
                &SavedBn {
                    mean: pv.f32("saved_mean")?,
                    inv_std: pv.f32("saved_inv_std")?,
                    gamma: pv.f32("gamma")?,
                    beta: pv.f32("beta")?,
                },
                &join,
            )?;
            pv.set("dgamma", f32v(out.dgamma));
            pv.set("dbeta", f32v(out.dbeta));
            this.set("dz_prev", f16v(out.dz));
            this.set("dbn_a", f32v(out.a));
            this.set("dbn_b", f32v(out.b));
            this.set("dbn_c", f32v(out.c));
        }
        GraphRole::Wgrad => {
            let dw = if through_bn && kind == RouteKind::Fused {
                r::wgrad_with_prologue(&p, prologue_input(prev_of(prev)?)?, this.f16("dy")?)?
            } else {
                r::conv_wgrad(&p, this.f16(plain_in)?, this.f16("dy")?)?
            };
            this.set("dw", f16v(dw));
        }
        GraphRole::DbnApply => {
            let pv = prev_of(prev)?;
            let d = r::dbn_apply(
                &xs,
                this.f16("dz_prev")?,
                pv.f16("y")?,
                this.f32("dbn_a")?,
                this.f32("dbn_b")?,
                this.f32("dbn_c")?,
            )?;
            pv.set("dy", f16v(d));
        }
        GraphRole::Dgrad => {
            let d = r::conv_dgrad(&p, this.f16("dy")?, this.f16("w")?)?;
            this.set(if through_bn { "da_prev" } else { "dx" }, f16v(d));
        }
        GraphRole::ApplyPrev => {
            let pv = prev_of(prev)?;
            let residual = match cfg.backward_residual {
                BackwardResidual::Shortcut => Residual::Add(this.f16("shortcut")?),
                _ => Residual::None,
            };
            let a = r::bn_apply(
                &xs,
                pv.f16("y")?,
                pv.f16("eq_scale")?,
                pv.f16("eq_bias")?,
                residual,
                Activation::Relu,
            )?;
            this.set("a_prev", f16v(a));
        }
        GraphRole::Conv => {
            let y = r::conv_fprop(&p, this.f16(plain_in)?, this.f16("w")?)?;
            this.set("y", f16v(y));
        }
        GraphRole::BnForward => {
            let (gamma, beta) = (this.f32("gamma")?.to_vec(), this.f32("beta")?.to_vec());
            let mut mean = this.f32("running_mean")?.to_vec();
            let mut var = this.f32("running_var")?.to_vec();
            let out = r::bn_fwd_train(
                &ys,
                this.f16("y")?,
                &gamma,
                &beta,
                RunningStats {
                    mean: &mut mean,
                    var: &mut var,
                },
                &bn,
            )?;
            this.set("running_mean", f32v(mean));
            this.set("running_var", f32v(var));
            this.set("y_bn", f16v(out.out));
            this.set("saved_mean", f32v(out.saved_mean));
            this.set("saved_inv_std", f32v(out.saved_inv_std));
        }
        GraphRole::EqCoefficients => {
            let (gamma, beta) = (this.f32("gamma")?, this.f32("beta")?);
            let (mean, inv) = (this.f32("saved_mean")?, this.f32("saved_inv_std")?);
            let scale: Vec<f32> = gamma.iter().zip(inv).map(|(g, i)| g * i).collect();
            let bias: Vec<f16> = beta
                .iter()
                .zip(mean)
                .zip(&scale)
                .map(|((b, m), s)| f16::from_f32(b - m * s))
                .collect();
            let scale: Vec<f16> = scale.into_iter().map(f16::from_f32).collect();
            this.set("eq_scale", f16v(scale));
            this.set("eq_bias", f16v(bias));
        }
        GraphRole::AddBranch => {
            let d = r::add(&xs, this.f16("da_prev")?, this.f16("dy_branch")?)?;
            this.set("da_sum", f16v(d));
        }
        GraphRole::ReluBackward => {
            let grad = if cfg.backward_residual == BackwardResidual::FuseAdd {
                "da_sum"
            } else {
                "da_prev"
            };
            let d = r::relu_bwd(&xs, this.f16(grad)?, this.f16("a_prev")?)?;
            this.set("dz_prev", f16v(d));
        }
        GraphRole::BnBackward => {
            let pv = prev_of(prev)?;
            let out = r::bn_bwd(
                &xs,
                pv.f16("y")?,
                this.f16("dz_prev")?,
                pv.f32("saved_mean")?,
                pv.f32("saved_inv_std")?,
                pv.f32("gamma")?,
            )?;
            pv.set("dy", f16v(out.dx));
            pv.set("dgamma", f32v(out.dgamma));
            pv.set("dbeta", f32v(out.dbeta));
        }
        GraphRole::DbnReduce => {
            let pv = prev_of(prev)?;
            let (dgamma, dbeta) = dbn_reduce(
                &xs,
                pv.f16("y")?,
                this.f16("dz_prev")?,
                pv.f32("saved_mean")?,
                pv.f32("saved_inv_std")?,
            )?;
            pv.set("dgamma", f32v(dgamma));
            pv.set("dbeta", f32v(dbeta));
        }
        GraphRole::DbnCoefficients => {
            let pv = prev_of(prev)?;
            let [a, b, c] = dbn_coefficients(
                xs.pixels(),
                pv.f32("gamma")?,
                pv.f32("saved_inv_std")?,
                pv.f32("saved_mean")?,
                pv.f32("dgamma")?,
                pv.f32("dbeta")?,
            )?;
            this.set("dbn_a", f32v(a));
            this.set("dbn_b", f32v(b));
            this.set("dbn_c", f32v(c));
        }
        GraphRole::ApplyDbnReduce => {
            let (dgamma, dbeta) = dbn_reduce(
                &ys,
                this.f16("y")?,
                this.f16("dpre")?,
                this.f32("saved_mean")?,
                this.f32("saved_inv_std")?,
            )?;
            this.set("dgamma", f32v(dgamma));
            this.set("dbeta", f32v(dbeta));
        }
        GraphRole::ApplyDbnCoefficients => {
            let [a, b, c] = dbn_coefficients(
                ys.pixels(),
                this.f32("gamma")?,
                this.f32("saved_inv_std")?,
                this.f32("saved_mean")?,
                this.f32("dgamma")?,
                this.f32("dbeta")?,
            )?;
            this.set("apply_dbn_a", f32v(a));
            this.set("apply_dbn_b", f32v(b));
            this.set("apply_dbn_c", f32v(c));
        }
        GraphRole::ApplyDbnApply => {
            let d = r::dbn_apply(
                &ys,
                this.f16("dpre")?,
                this.f16("y")?,
                this.f32("apply_dbn_a")?,
                this.f32("apply_dbn_b")?,
                this.f32("apply_dbn_c")?,
            )?;
            this.set("dy", f16v(d));
        }
    }
    Ok(())
}

/// The generic route's `dbn_reduce` graph on the CPU: per channel, `dγ = Σ dz·x̂` and
/// `dβ = Σ dz` with `x̂ = (y − mean)·inv_std`.
///
/// Rounding points mirror the graph: `y − mean`, `·inv_std` and `dz·x̂` are each rounded to
/// FP32 (the graph's FP32 virtual tensors); the sums run in `f64` and are rounded to FP32 once
/// (the GPU's reduction sums FP32 values in an unspecified order, so it may differ in the last
/// bits). The reductions read the stored FP16 `dz`, as the graph does.
fn dbn_reduce(
    shape: &Nhwc,
    y: &[f16],
    dz: &[f16],
    mean: &[f32],
    inv_std: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    shape.validate("y")?;
    check_len("y", y, shape.elems())?;
    check_len("dz", dz, shape.elems())?;
    check_len("saved_mean", mean, shape.c)?;
    check_len("saved_inv_std", inv_std, shape.c)?;
    let c = shape.c;
    let mut dgamma = vec![0f64; c];
    let mut dbeta = vec![0f64; c];
    for (yp, dp) in y.chunks_exact(c).zip(dz.chunks_exact(c)) {
        for k in 0..c {
            let x_hat = (yp[k].to_f32() - mean[k]) * inv_std[k];
            let d = dp[k].to_f32();
            dgamma[k] += f64::from(d * x_hat);
            dbeta[k] += f64::from(d);
        }
    }
    Ok((
        dgamma.into_iter().map(|v| v as f32).collect(),
        dbeta.into_iter().map(|v| v as f32).collect(),
    ))
}

/// The generic route's `dbn_coefficients` graph on the CPU: the coefficients of
/// `dy = A·dz + B·y + C` over `count` elements per channel, every step in FP32 in the graph's
/// order (`a = γ·inv_std`, `B = ((a·inv_std)·dγ)·(−1/M)`, `C = ((a·dβ)·(−1/M)) − B·mean`,
/// `A = a`, with `−1/M` rounded to FP32 as the graph's by-value scalar). The GPU may contract a
/// multiply and the final subtraction into one FMA: at most one FP32 rounding apart.
fn dbn_coefficients(
    count: usize,
    gamma: &[f32],
    inv_std: &[f32],
    mean: &[f32],
    dgamma: &[f32],
    dbeta: &[f32],
) -> Result<[Vec<f32>; 3]> {
    let c = gamma.len();
    check_len("saved_inv_std", inv_std, c)?;
    check_len("saved_mean", mean, c)?;
    check_len("dgamma", dgamma, c)?;
    check_len("dbeta", dbeta, c)?;
    let nm = neg_inv_count(count as i64);
    let mut out = [
        Vec::with_capacity(c),
        Vec::with_capacity(c),
        Vec::with_capacity(c),
    ];
    for k in 0..c {
        let a = gamma[k] * inv_std[k];
        let b = a * inv_std[k] * dgamma[k] * nm;
        let cc = a * dbeta[k] * nm - b * mean[k];
        out[0].push(a);
        out[1].push(b);
        out[2].push(cc);
    }
    Ok(out)
}
