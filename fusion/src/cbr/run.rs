//! Running a planned layer: on a GPU through its cuDNN plans, or on the CPU through the
//! reference ops, over the same named buffers and in the same step order.

use super::bn_sync::{sync_action, synced_step, BnSide, BnSync, DeviceBnSync, SyncAction};
use super::buffers::{HostBuffer, HostBuffers};
use super::device_buffers::{DeviceBuffer, DeviceBuffers, Resolved, Side, SyncScratch};
use super::graphs::{ApplyResidual, BackwardResidual};
use super::layer::{CbrLayer, GraphRole, InputKind, LayerStep, RouteKind, Src};
use crate::error::{Error, Result};
use crate::exec::{Bindings, Handle, Scalar, Workspace};
use crate::reference::bn::bn_recompute;
use crate::reference::parallel::channel_sums;
use crate::reference::params::check_len;
use crate::reference::{
    self as r, Activation, BnParams, ChannelStats, ConvInput, ConvScratch, InputStamp, Nhwc,
    ReluJoin, Residual, RunningStats, SavedBn,
};
use crate::reference::{Element, Real};
use half::f16;
use Src::{Prev, This};

/// Which half of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward: conv, statistics, BN finalize, apply.
    Forward,
    /// Backward: gradients of the weights, of the previous BN and of the input.
    Backward,
    /// Evaluation (inference) mode: the forward steps with BN normalizing by the running
    /// statistics ([`crate::reference::bn_eval_finalize`]) instead of the batch's. Nothing
    /// statistical is written: the running statistics and the saved statistics keep their
    /// values (on the CPU `sum` and `sq_sum` too; on the GPU the conv + GenStats graph still
    /// writes that scratch); `eq_scale` and `eq_bias` (or the unfused route's activation or BN
    /// output, on the GPU by our `cbr_bn_eval` kernel in place of the training-mode
    /// NormForward) are overwritten.
    Eval,
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

    /// Enqueues one pass on the handle's stream over `io`: this layer's buffers
    /// ([`CbrLayer::buffers`], bound with [`DeviceBuffers::bind`]) and, for a layer that reads
    /// through the previous BN, the previous layer's ([`CbrLayer::prev_buffers`], bound with
    /// [`DeviceBuffers::bind_prev`]). Every binding is checked (present, type, size,
    /// alignment) before its graph runs. Nothing waits for the GPU.
    pub fn run_gpu(&self, pass: Pass, handle: &Handle, io: &mut DeviceBuffers<'_>) -> Result<()> {
        self.run_gpu_with(pass, handle, io, None)
    }

    /// [`CbrLayer::run_gpu`] with synchronized BN ([`DeviceBnSync`], module
    /// `cbr::bn_sync`): the statistics and the BN-backward coefficients of the global
    /// batch, each step treated as `sync_action` says, the collectives enqueued on the
    /// handle's stream between the steps. With one replica it is [`CbrLayer::run_gpu`].
    ///
    /// # Errors
    /// As [`CbrLayer::run_gpu`]; [`Error::BnSync`] for a route whose BN graphs sum inside
    /// themselves ([`CbrLayer::check_gpu_bn_sync`]) or when the group fails; [`Error::Kernel`]
    /// when our coefficients kernel cannot be loaded.
    pub fn run_gpu_synced(
        &self,
        pass: Pass,
        handle: &Handle,
        io: &mut DeviceBuffers<'_>,
        sync: &mut dyn DeviceBnSync,
    ) -> Result<()> {
        let sync = (sync.replicas() > 1).then_some(sync);
        self.run_gpu_with(pass, handle, io, sync)
    }

    /// Whether synchronized BN can run this layer on the GPU: its route sums its BN
    /// statistics between steps (fused, generic), not inside one graph.
    ///
    /// # Errors
    /// [`Error::BnSync`] naming the layer, its route and the graph (the unfused route's
    /// NormForward / NormBackward).
    pub fn check_gpu_bn_sync(&self) -> Result<()> {
        match self
            .steps()
            .iter()
            .find(|s| sync_action(s.role) == SyncAction::Split)
        {
            Some(step) => Err(Error::BnSync(format!(
                "layer {} runs the {} route, whose {:?} graph sums its BN statistics inside \
                 itself; synchronized BN on the GPU needs the fused or generic route",
                self.config().shape.label(),
                self.route().name(),
                step.role
            ))),
            None => Ok(()),
        }
    }

    /// One pass, local or (with `sync`, of more than one replica) synchronized.
    fn run_gpu_with(
        &self,
        pass: Pass,
        handle: &Handle,
        io: &mut DeviceBuffers<'_>,
        mut sync: Option<&mut dyn DeviceBnSync>,
    ) -> Result<()> {
        let prev_given = io.has_prev().then_some(());
        self.check_prev(&prev_given)?;
        if pass == Pass::Eval {
            return self.run_gpu_eval(handle, io);
        }
        // Refused before anything is enqueued, so a pass never runs halfway.
        if let Some(step) = self
            .pass_steps(pass)
            .find(|s| s.plan.is_none() && s.kernel.is_none())
        {
            return Err(self.cpu_only(step));
        }
        if sync.is_some() {
            self.check_gpu_bn_sync()?;
        }
        let s = &self.config().shape;
        let (c, k) = (s.c as usize, s.k as usize);
        let stream = handle.stream().clone();
        let mut scratch = match sync {
            Some(_) => Some(SyncScratch::new(&stream, 2 * c.max(k))?),
            None => None,
        };
        let r = io.resolve(&stream);
        for step in self.pass_steps(pass) {
            let (Some(sync), Some(scratch)) = (sync.as_deref_mut(), scratch.as_mut()) else {
                self.gpu_step(step, handle, &r, 1)?;
                continue;
            };
            let replicas = sync.replicas();
            match sync_action(step.role) {
                SyncAction::Local | SyncAction::Split => self.gpu_step(step, handle, &r, 1)?,
                SyncAction::GlobalCount => self.gpu_step(step, handle, &r, replicas)?,
                SyncAction::ReduceStats => {
                    self.gpu_step(step, handle, &r, 1)?;
                    let sums = [(Side::This, "sum"), (Side::This, "sq_sum")];
                    scratch.gather(handle, &r, sums, k)?;
                    sync.all_reduce_sum(&stream, scratch.slice_mut())?;
                    scratch.scatter(handle, &r, sums, k)?;
                }
                SyncAction::Coefficients {
                    side,
                    outputs,
                    after_step,
                } => {
                    if after_step {
                        self.gpu_step(step, handle, &r, 1)?;
                    }
                    let (side, channels, pixels) = match side {
                        BnSide::Prev => (Side::Prev, c, s.n * s.h * s.w),
                        BnSide::This => (Side::This, k, s.n * s.p() * s.q()),
                    };
                    scratch.gather(handle, &r, [(side, "dgamma"), (side, "dbeta")], channels)?;
                    sync.all_reduce_sum(&stream, scratch.slice_mut())?;
                    let count = pixels as f64 * replicas as f64;
                    let inputs = [
                        r.get(side, "gamma")?,
                        r.get(side, "saved_inv_std")?,
                        r.get(side, "saved_mean")?,
                    ];
                    let [a, b, cc] = outputs.map(|n| r.get(Side::This, n));
                    scratch.coefficients(
                        handle,
                        inputs,
                        (-1.0 / count) as f32,
                        [a?, b?, cc?],
                        channels,
                    )?;
                }
            }
        }
        if pass == Pass::Forward {
            for (next, cur) in RUNNING_COPIES {
                r.copy(handle, cur, next)?;
            }
        }
        Ok(())
    }

    /// Evaluation mode on the GPU ([`Pass::Eval`]): the forward steps of the layer's route
    /// with BN finalize replaced by the evaluation-mode coefficients (eq_scale, eq_bias from
    /// the running statistics: [`crate::reference::bn_eval_finalize`], computed on the host
    /// from the device's FP32 values and uploaded, one host sync per layer) and no GenStats
    /// reduction of its own (the conv + GenStats graph still writes the layer's `sum` and
    /// `sq_sum` scratch, which nothing reads). The unfused route's BN forward (NormForward,
    /// training-mode BN) is replaced by our `cbr_bn_eval` kernel: the running statistics'
    /// mean and `1/sqrt(var + ε)` (from the host, as above) with γ and β in FP32, the residual
    /// and ReLU where the layer materializes its activation, in the CPU evaluation's op order
    /// ([`OwnKernel::BnEval`](super::kernels::OwnKernel::BnEval)). The running statistics are
    /// read, never written: no finalize runs and nothing is copied over them.
    ///
    /// # Errors
    /// A driver or kernel error; a running variance the evaluation refuses.
    fn run_gpu_eval(&self, handle: &Handle, io: &mut DeviceBuffers<'_>) -> Result<()> {
        let stream = handle.stream().clone();
        let r = io.resolve(&stream);
        for step in self.pass_steps(Pass::Eval) {
            match step.role {
                GraphRole::Stats => {}
                GraphRole::Finalize => self.gpu_eval_finalize(handle, &r)?,
                GraphRole::BnForward => self.gpu_eval_bn_forward(handle, &r)?,
                _ => self.gpu_step(step, handle, &r, 1)?,
            }
        }
        Ok(())
    }

    /// The unfused route's BN forward in evaluation mode: [`r::bn_eval_finalize`]'s FP32 mean
    /// and `1/sqrt(var + ε)` uploaded into scratch, then `cbr_bn_eval` from `y` into the
    /// layer's activation `a` (with its residual form) or its BN output `y_bn`. Waits for the
    /// kernel before the scratch is freed.
    fn gpu_eval_bn_forward(&self, handle: &Handle, r: &Resolved<'_>) -> Result<()> {
        use super::kernels::{launch_bn_eval, BnEvalBuffers, BnEvalOutput};
        use cudarc::driver::DevicePtrMut;
        let cfg = self.config();
        let k = cfg.shape.k as usize;
        let out = self.eval_coefficients(handle, r)?;
        let stream = handle.stream().clone();
        let fail = |what: &str, e: cudarc::driver::DriverError| crate::exec::driver(what, e);
        let stats: Vec<f32> = out
            .saved_mean
            .iter()
            .chain(&out.saved_inv_std)
            .copied()
            .collect();
        let mut scratch = stream
            .clone_htod(&stats)
            .map_err(|e| fail("upload the evaluation statistics", e))?;
        let (output, out_name) = match cfg.apply {
            Some(residual) => (BnEvalOutput::Activation(residual), "a"),
            None => (BnEvalOutput::BnOnly, "y_bn"),
        };
        let residual = match cfg.apply {
            Some(ApplyResidual::Add | ApplyResidual::DualScaleBias) => {
                Some(r.get(Side::This, "residual")?)
            }
            _ => None,
        };
        let residual_scale_bias = match cfg.apply {
            Some(ApplyResidual::DualScaleBias) => Some((
                r.get(Side::This, "residual_scale")?,
                r.get(Side::This, "residual_bias")?,
            )),
            _ => None,
        };
        let s = &cfg.shape;
        let elems = (s.n * s.p() * s.q() * s.k) as usize;
        {
            let (base, _record) = scratch.device_ptr_mut(&stream);
            let run = |i: u64| DeviceBuffer {
                ptr: base + 4 * k as u64 * i,
                bytes: 4 * k,
                dtype: crate::graph::DataType::Float,
            };
            let bufs = BnEvalBuffers {
                y: r.get(Side::This, "y")?,
                mean: run(0),
                inv_std: run(1),
                gamma: r.get(Side::This, "gamma")?,
                beta: r.get(Side::This, "beta")?,
                residual,
                residual_scale_bias,
                out: r.get(Side::This, out_name)?,
            };
            launch_bn_eval(handle, &bufs, output, elems, k)?;
        }
        // `scratch` is freed when dropped: the kernel must have read it by then.
        stream
            .synchronize()
            .map_err(|e| fail("wait for the evaluation-mode BN", e))
    }

    /// Evaluation-mode eq_scale and eq_bias of this layer's BN, through the host: γ, β and the
    /// running statistics gathered into scratch and downloaded, [`r::bn_eval_finalize`] in
    /// FP32 mode (FP16 results), the results uploaded and copied into `eq_scale`, `eq_bias`.
    fn gpu_eval_finalize(&self, handle: &Handle, r: &Resolved<'_>) -> Result<()> {
        let out = self.eval_coefficients(handle, r)?;
        r.upload_half(handle, "eq_scale", &out.eq_scale)?;
        r.upload_half(handle, "eq_bias", &out.eq_bias)
    }

    /// [`r::bn_eval_finalize`] of this layer's γ, β and running statistics, read from the
    /// device (gathered into scratch and downloaded: waits for the stream).
    fn eval_coefficients(&self, handle: &Handle, r: &Resolved<'_>) -> Result<r::BnFinalized<f16>> {
        let cfg = self.config();
        let k = cfg.shape.k as usize;
        let stream = handle.stream().clone();
        let fail = |what: &str, e: cudarc::driver::DriverError| crate::exec::driver(what, e);
        let mut params = SyncScratch::new(&stream, 2 * k)?;
        params.gather(handle, r, [(Side::This, "gamma"), (Side::This, "beta")], k)?;
        let mut running = SyncScratch::new(&stream, 2 * k)?;
        running.gather(
            handle,
            r,
            [(Side::This, "running_mean"), (Side::This, "running_var")],
            k,
        )?;
        let p = stream
            .clone_dtoh(params.slice_mut())
            .map_err(|e| fail("download a layer's BN parameters", e))?;
        let run = stream
            .clone_dtoh(running.slice_mut())
            .map_err(|e| fail("download a layer's running statistics", e))?;
        let bn = BnParams {
            epsilon: cfg.epsilon,
            momentum: cfg.momentum,
        };
        Ok(r::bn_eval_finalize(
            &p[..k],
            &p[k..2 * k],
            &run[..k],
            &run[k..2 * k],
            &bn,
        )?)
    }

    fn cpu_only(&self, step: &LayerStep) -> Error {
        Error::CudnnMessage(format!(
            "layer {} was made for the CPU executor: its {:?} step has no cuDNN plan",
            self.config().shape.label(),
            step.role
        ))
    }

    /// Enqueues one step: our kernel, or its cuDNN plan over the resolved buffers, after
    /// zeroing the outputs it accumulates into ([`LayerStep::outputs_to_zero`], the same on
    /// both paths). A BN finalize divides by the local element count times `replicas`.
    fn gpu_step(
        &self,
        step: &LayerStep,
        handle: &Handle,
        r: &Resolved<'_>,
        replicas: usize,
    ) -> Result<()> {
        if step.plan.is_none() && step.kernel.is_none() {
            return Err(self.cpu_only(step));
        }
        for (side, name) in step.outputs_to_zero() {
            r.zero(handle, side, name)?;
        }
        let plan = match (&step.plan, &step.kernel) {
            (Some(plan), _) => plan,
            (None, Some(kernel)) => return kernel.launch(handle, r),
            (None, None) => return Err(self.cpu_only(step)),
        };
        let mut b = Bindings::new(plan);
        for (t, src) in &step.bindings {
            match src {
                This(name) => r.bind(&mut b, *t, Side::This, name)?,
                Prev(name) => r.bind(&mut b, *t, Side::Prev, name)?,
                // The finalize's element count, the one by-value integer of a layer's graphs.
                Src::Scalar(Scalar::I64(n)) if step.role == GraphRole::Finalize => {
                    let global = i64::try_from(replicas)
                        .ok()
                        .and_then(|k| n.checked_mul(k))
                        .ok_or_else(|| {
                            Error::BnSync(format!("{n} elements × {replicas} replicas overflow"))
                        })?;
                    b.bind_scalar(*t, Scalar::I64(global))?;
                }
                Src::Scalar(v) => {
                    b.bind_scalar(*t, *v)?;
                }
            }
        }
        plan.execute(handle, &b, Workspace::Pooled)
    }

    /// Runs one pass on the CPU with the reference ops (FP16 storage, FP32 arithmetic), over
    /// host buffers named as on the GPU.
    pub fn run_cpu(
        &self,
        pass: Pass,
        this: &mut HostBuffers,
        prev: Option<&mut HostBuffers>,
    ) -> Result<()> {
        self.check_prev(&prev)?;
        self.run_cpu_io(pass, &mut PairIo { this, prev })
    }

    /// Runs one pass on the CPU over any buffer table ([`LayerIo`]): FP16 storage with FP32
    /// arithmetic for `T = f16`, exact `f64` throughout for `T = f64`. The steps and the
    /// buffers they read and write are those of [`CbrLayer::steps`], in order; after the
    /// forward pass the updated running statistics are copied over the current ones.
    pub fn run_cpu_io<T: Element, I: LayerIo<T> + ?Sized>(
        &self,
        pass: Pass,
        io: &mut I,
    ) -> Result<()> {
        self.run_cpu_io_synced(pass, io, None)
    }

    /// [`CbrLayer::run_cpu_io`] with synchronized BN when `sync` is given ([`BnSync`]): the
    /// forward's GenStats sums and the backward's `dγ`, `dβ` summed over the replicas before
    /// they are used, every count the global one. Without `sync` it is
    /// [`CbrLayer::run_cpu_io`].
    pub fn run_cpu_io_synced<T: Element, I: LayerIo<T> + ?Sized>(
        &self,
        pass: Pass,
        io: &mut I,
        mut sync: Option<&mut dyn BnSync<T::Acc>>,
    ) -> Result<()> {
        let roles: Vec<GraphRole> = self.pass_steps(pass).map(|s| s.role).collect();
        if pass == Pass::Eval {
            // Nothing to synchronize: no batch statistics.
            for role in roles {
                cpu_eval_step(self, role, io)?;
            }
            return Ok(());
        }
        for role in roles {
            match sync.as_deref_mut() {
                None => cpu_step(self, role, io, 1)?,
                Some(sync) => synced_step(self, role, io, sync)?,
            }
        }
        if pass == Pass::Forward {
            for (next, cur) in RUNNING_COPIES {
                let v = io.float(This(next))?.to_vec();
                io.set_float(This(cur), v)?;
            }
        }
        Ok(())
    }
}

impl GraphRole {
    /// The buffers (by name) a step of this role adds into instead of overwriting: the
    /// per-channel reductions (GenStats' Σy and Σy², the BN-backward weights' and the
    /// reductions' dγ and dβ), which our kernels (`cbr_channel_stats`, `cbr_dbn_reduce`:
    /// `atomicAdd` per block) and cuDNN's engines (split across CTAs) may accumulate. The one
    /// table both GPU paths zero from ([`LayerStep::outputs_to_zero`]); zeroing where cuDNN
    /// overwrites anyway costs a memset of a few hundred bytes.
    pub fn accumulated_outputs(self) -> &'static [&'static str] {
        match self {
            GraphRole::ConvStats | GraphRole::Stats => &["sum", "sq_sum"],
            GraphRole::DgradDreluDbn | GraphRole::DbnReduce | GraphRole::ApplyDbnReduce => {
                &["dgamma", "dbeta"]
            }
            _ => &[],
        }
    }
}

impl LayerStep {
    /// The buffers to zero before this step runs on a GPU, our kernel or its cuDNN plan alike:
    /// those of its bindings its role accumulates into ([`GraphRole::accumulated_outputs`]),
    /// with the layer each belongs to.
    pub fn outputs_to_zero(&self) -> Vec<(Side, &'static str)> {
        let names = self.role.accumulated_outputs();
        self.bindings
            .iter()
            .filter_map(|(_, src)| match *src {
                This(n) if names.contains(&n) => Some((Side::This, n)),
                Prev(n) if names.contains(&n) => Some((Side::Prev, n)),
                _ => None,
            })
            .collect()
    }
}

/// (updated, current) running statistics: every route writes the BN forward's updated running
/// statistics to their own buffers and copies them over the current ones after the forward
/// pass (cuDNN documents no in-place update).
pub const RUNNING_COPIES: [(&str, &str); 2] = [
    ("running_mean_next", "running_mean"),
    ("running_var_next", "running_var"),
];

/// The buffers a layer's CPU steps read and write, by [`Src`] (this layer's or the previous
/// layer's buffer, by name), in one precision mode: `Half` buffers as `T`, `Float` buffers as
/// `T::Acc` (f16/f32 in FP16 mode, f64/f64 in f64 mode).
///
/// [`HostBuffers`] pairs implement it for FP16 mode; a network executor implements it over
/// its own buffer table, resolving each layer's names to the network's buffers.
pub trait LayerIo<T: Element> {
    /// A `Half` buffer.
    fn half(&self, src: Src) -> Result<&[T]>;
    /// A `Float` buffer.
    fn float(&self, src: Src) -> Result<&[T::Acc]>;
    /// Replaces a `Half` buffer's contents.
    fn set_half(&mut self, src: Src, v: Vec<T>) -> Result<()>;
    /// Replaces a `Float` buffer's contents.
    fn set_float(&mut self, src: Src, v: Vec<T::Acc>) -> Result<()>;

    /// Lends a `Half` buffer's storage to the op about to replace its contents (any length;
    /// the op overwrites every element and hands it back through [`LayerIo::set_half`]), so a
    /// step allocates no new output. Until then the buffer may read as empty. A table that
    /// lends nothing returns an empty vector (the default): the op then allocates.
    fn take_half(&mut self, src: Src) -> Result<Vec<T>> {
        let _ = src;
        Ok(Vec::new())
    }

    /// A stamp of a buffer's contents: a value that changes whenever they may have (a write
    /// counter), unique to the buffer; `None` (the default) where the table keeps none. The
    /// conv scratch then knows the forward's input by stamps instead of keeping copies.
    fn stamp(&self, src: Src) -> Option<u64> {
        let _ = src;
        None
    }

    /// Lends the layer's [`ConvScratch`] (storage its conv steps keep from one step to the
    /// next), until [`LayerIo::put_scratch`]. A table that keeps none returns an empty one
    /// (the default): nothing is then reused, and no value changes either way.
    fn take_scratch(&mut self) -> ConvScratch<T> {
        ConvScratch::default()
    }

    /// Takes back the scratch lent by [`LayerIo::take_scratch`] (the default drops it).
    fn put_scratch(&mut self, scratch: ConvScratch<T>) {
        drop(scratch);
    }
}

/// A layer's own host buffers and, when its input comes through the previous BN, the
/// previous layer's: the FP16-mode [`LayerIo`] of [`CbrLayer::run_cpu`].
#[derive(Debug)]
pub struct PairIo<'a> {
    /// This layer's buffers.
    pub this: &'a mut HostBuffers,
    /// The previous layer's buffers.
    pub prev: Option<&'a mut HostBuffers>,
}

impl PairIo<'_> {
    fn table(&self, src: Src) -> Result<(&HostBuffers, &'static str)> {
        match src {
            This(n) => Ok((&*self.this, n)),
            Prev(n) => Ok((self.prev.as_deref().ok_or_else(|| no_prev(n))?, n)),
            Src::Scalar(_) => Err(scalar_src()),
        }
    }

    fn table_mut(&mut self, src: Src) -> Result<(&mut HostBuffers, &'static str)> {
        match src {
            This(n) => Ok((&mut *self.this, n)),
            Prev(n) => Ok((self.prev.as_deref_mut().ok_or_else(|| no_prev(n))?, n)),
            Src::Scalar(_) => Err(scalar_src()),
        }
    }
}

fn no_prev(name: &str) -> Error {
    Error::Buffer {
        name: format!("prev.{name}"),
        problem: "is needed but no previous layer's buffers were given".into(),
    }
}

fn scalar_src() -> Error {
    Error::Buffer {
        name: "<scalar>".into(),
        problem: "is a by-value scalar, not a buffer".into(),
    }
}

impl LayerIo<f16> for PairIo<'_> {
    fn half(&self, src: Src) -> Result<&[f16]> {
        let (t, n) = self.table(src)?;
        t.f16(n)
    }
    fn float(&self, src: Src) -> Result<&[f32]> {
        let (t, n) = self.table(src)?;
        t.f32(n)
    }
    fn set_half(&mut self, src: Src, v: Vec<f16>) -> Result<()> {
        let (t, n) = self.table_mut(src)?;
        t.set(n, HostBuffer::F16(v));
        Ok(())
    }
    fn set_float(&mut self, src: Src, v: Vec<f32>) -> Result<()> {
        let (t, n) = self.table_mut(src)?;
        t.set(n, HostBuffer::F32(v));
        Ok(())
    }
}

/// The previous BN's apply as the conv's prologue, read from the previous layer's buffers.
fn prologue_input<T: Element, I: LayerIo<T> + ?Sized>(io: &I) -> Result<ConvInput<'_, T>> {
    Ok(ConvInput::Prologue {
        y_prev: io.half(Prev("y"))?,
        scale: io.half(Prev("eq_scale"))?,
        bias: io.half(Prev("eq_bias"))?,
    })
}

/// The stamps of a conv's input buffers ([`InputStamp`]): the prologue's `y_prev`,
/// `eq_scale` and `eq_bias`, or the plain input's; `None` unless the table stamps all of them.
/// The convolution of a `ConvStats` graph with its batch statistics: through the previous
/// layer's BN prologue where the layer reads its input so (the generic route convolves the
/// materialized activation instead), else from `plain_in`. The conv's input stays in the
/// scratch for this layer's wgrad.
fn conv_stats<T: Element, I: LayerIo<T> + ?Sized>(
    io: &mut I,
    p: &r::ConvParams,
    through_bn: bool,
    kind: RouteKind,
    plain_in: Src,
) -> Result<r::FpropStats<T>> {
    let y = io.take_half(This("y"))?;
    let mut scratch = io.take_scratch();
    let prologue = through_bn && kind != RouteKind::Generic;
    let input = if prologue {
        prologue_input(io)?
    } else {
        ConvInput::Plain(io.half(plain_in)?)
    };
    let stamp = input_stamp(io, prologue, plain_in);
    let w = io.half(This("w"))?;
    let out = r::fprop_genstats_with(p, input, w, &mut scratch, stamp, y);
    io.put_scratch(scratch);
    Ok(out?)
}

fn input_stamp<T: Element, I: LayerIo<T> + ?Sized>(
    io: &I,
    prologue: bool,
    plain_in: Src,
) -> InputStamp {
    if prologue {
        Some([
            io.stamp(Prev("y"))?,
            io.stamp(Prev("eq_scale"))?,
            io.stamp(Prev("eq_bias"))?,
        ])
    } else {
        Some([io.stamp(plain_in)?, 0, 0])
    }
}

/// The residual of a layer's activation, as its config names it.
pub(super) fn residual_of<'a, T: Element, I: LayerIo<T> + ?Sized>(
    io: &'a I,
    residual: Option<ApplyResidual>,
) -> Result<Residual<'a, T>> {
    Ok(match residual {
        Some(ApplyResidual::Add) => Residual::Add(io.half(This("residual"))?),
        Some(ApplyResidual::DualScaleBias) => Residual::ScaleBias {
            r: io.half(This("residual"))?,
            scale: io.half(This("residual_scale"))?,
            bias: io.half(This("residual_bias"))?,
        },
        _ => Residual::None,
    })
}

/// One forward role in evaluation mode ([`Pass::Eval`]): the conv steps as in training, minus
/// the statistics; BN finalize replaced by [`r::bn_eval_finalize`] (eq_scale and eq_bias from
/// the running statistics, nothing else written); the unfused route's BN forward normalizing
/// with the running statistics in [`bn_recompute`]'s order, rounded once. The applies (the
/// next conv's prologue, the materialized activation, the dual residual) read the same
/// `eq_scale` / `eq_bias` buffers as in training.
fn cpu_eval_step<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    role: GraphRole,
    io: &mut I,
) -> Result<()> {
    let cfg = layer.config();
    let s = &cfg.shape;
    let bn = BnParams {
        epsilon: cfg.epsilon,
        momentum: cfg.momentum,
    };
    let eval = |io: &I| -> Result<r::BnFinalized<T>> {
        Ok(r::bn_eval_finalize(
            io.float(This("gamma"))?,
            io.float(This("beta"))?,
            io.float(This("running_mean"))?,
            io.float(This("running_var"))?,
            &bn,
        )?)
    };
    match role {
        GraphRole::ConvStats => {
            let p = s.reference_params();
            let through_bn = cfg.input == InputKind::ThroughBn;
            let plain_in = if through_bn {
                This("a_prev")
            } else {
                This("x")
            };
            // The conv of the training graph; its statistics are dropped, not stored.
            let out = conv_stats(io, &p, through_bn, layer.route().kind(), plain_in)?;
            io.set_half(This("y"), out.y)?;
        }
        GraphRole::Stats => {}
        GraphRole::Finalize => {
            let out = eval(io)?;
            io.set_half(This("eq_scale"), out.eq_scale)?;
            io.set_half(This("eq_bias"), out.eq_bias)?;
        }
        GraphRole::BnForward => {
            let ys = Nhwc::new(s.n as usize, s.p() as usize, s.q() as usize, s.k as usize);
            let out = eval(io)?;
            let y = io.half(This("y"))?;
            let (gamma, beta) = (io.float(This("gamma"))?, io.float(This("beta"))?);
            let (mean, inv_std) = (&out.saved_mean, &out.saved_inv_std);
            match cfg.apply {
                Some(_) => {
                    let a = bn_activation(
                        &ys,
                        y,
                        mean,
                        inv_std,
                        gamma,
                        beta,
                        residual_of(io, cfg.apply)?,
                    )?;
                    io.set_half(This("a"), a)?;
                }
                None => {
                    let c = ys.c;
                    let y_bn = y
                        .iter()
                        .enumerate()
                        .map(|(i, v)| {
                            let ch = i % c;
                            T::from_acc(bn_recompute(
                                v.to_acc(),
                                mean[ch],
                                inv_std[ch],
                                gamma[ch],
                                beta[ch],
                            ))
                        })
                        .collect();
                    io.set_half(This("y_bn"), y_bn)?;
                }
            }
        }
        GraphRole::Conv | GraphRole::Apply | GraphRole::ApplyPrev => cpu_step(layer, role, io, 1)?,
        backward => {
            return Err(Error::CudnnMessage(format!(
                "layer {}: {backward:?} is a backward step, not part of evaluation",
                s.label()
            )))
        }
    }
    Ok(())
}

/// One role on the CPU. Mirrors the graphs in `route_graphs` buffer for buffer.
/// One step on the CPU; `replicas` multiplies the BN finalize's element count (synchronized
/// BN, whose sums the caller has reduced).
pub(super) fn cpu_step<T: Element, I: LayerIo<T> + ?Sized>(
    layer: &CbrLayer,
    role: GraphRole,
    io: &mut I,
    replicas: usize,
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
    let plain_in = if through_bn {
        This("a_prev")
    } else {
        This("x")
    };
    match role {
        GraphRole::ConvStats => {
            let out = conv_stats(io, &p, through_bn, kind, plain_in)?;
            io.set_half(This("y"), out.y)?;
            io.set_float(This("sum"), out.stats.sum)?;
            io.set_float(This("sq_sum"), out.stats.sqsum)?;
        }
        GraphRole::Stats => {
            let stats = r::genstats(&p.output_shape(), io.half(This("y"))?)?;
            io.set_float(This("sum"), stats.sum)?;
            io.set_float(This("sq_sum"), stats.sqsum)?;
        }
        GraphRole::Finalize => {
            let stats = ChannelStats {
                sum: io.float(This("sum"))?.to_vec(),
                sqsum: io.float(This("sq_sum"))?.to_vec(),
            };
            let mut mean = io.float(This("running_mean"))?.to_vec();
            let mut var = io.float(This("running_var"))?.to_vec();
            let out: r::BnFinalized<T> = r::bn_finalize(
                &stats,
                io.float(This("gamma"))?,
                io.float(This("beta"))?,
                RunningStats {
                    mean: &mut mean,
                    var: &mut var,
                },
                s.count() as usize * replicas,
                &bn,
            )?;
            io.set_float(This("running_mean_next"), mean)?;
            io.set_float(This("running_var_next"), var)?;
            io.set_half(This("eq_scale"), out.eq_scale)?;
            io.set_half(This("eq_bias"), out.eq_bias)?;
            io.set_float(This("saved_mean"), out.saved_mean)?;
            io.set_float(This("saved_inv_std"), out.saved_inv_std)?;
        }
        GraphRole::Apply => {
            let out = io.take_half(This("a"))?;
            let a = r::bn_apply_into(
                &ys,
                io.half(This("y"))?,
                io.half(This("eq_scale"))?,
                io.half(This("eq_bias"))?,
                residual_of(io, cfg.apply)?,
                Activation::Relu,
                out,
            )?;
            io.set_half(This("a"), a)?;
        }
        GraphRole::ApplyReluBackward => {
            let out = io.take_half(This("dpre"))?;
            let d = r::relu_bwd_into(&ys, io.half(This("da"))?, io.half(This("a"))?, out)?;
            io.set_half(This("dpre"), d)?;
        }
        GraphRole::ApplyBnBackward => {
            let out = r::bn_bwd(
                &ys,
                io.half(This("y"))?,
                io.half(This("dpre"))?,
                io.float(This("saved_mean"))?,
                io.float(This("saved_inv_std"))?,
                io.float(This("gamma"))?,
            )?;
            io.set_half(This("dy"), out.dx)?;
            io.set_float(This("dgamma"), out.dgamma)?;
            io.set_float(This("dbeta"), out.dbeta)?;
        }
        GraphRole::DgradDreluDbn => {
            let dz = io.take_half(This("dz_prev"))?;
            let mut scratch = io.take_scratch();
            let join = match cfg.backward_residual {
                BackwardResidual::None => ReluJoin::default(),
                BackwardResidual::FuseAdd => ReluJoin {
                    resid: None,
                    dy_branch: Some(io.half(This("dy_branch"))?),
                },
            };
            let out = r::dgrad_drelu_dbn_with(
                &p,
                io.half(This("dy"))?,
                io.half(This("w"))?,
                io.half(Prev("y"))?,
                &SavedBn {
                    mean: io.float(Prev("saved_mean"))?,
                    inv_std: io.float(Prev("saved_inv_std"))?,
                    gamma: io.float(Prev("gamma"))?,
                    beta: io.float(Prev("beta"))?,
                },
                &join,
                &mut scratch,
                dz,
            );
            io.put_scratch(scratch);
            let out = out?;
            io.set_float(Prev("dgamma"), out.dgamma)?;
            io.set_float(Prev("dbeta"), out.dbeta)?;
            io.set_half(This("dz_prev"), out.dz)?;
            io.set_float(This("dbn_a"), out.a)?;
            io.set_float(This("dbn_b"), out.b)?;
            io.set_float(This("dbn_c"), out.c)?;
        }
        GraphRole::Wgrad => {
            let mut scratch = io.take_scratch();
            let prologue = through_bn && kind == RouteKind::Fused;
            let input = if prologue {
                prologue_input(io)?
            } else {
                ConvInput::Plain(io.half(plain_in)?)
            };
            // The forward's input where the scratch holds this very input, else recomputed:
            // `conv_wgrad`'s values either way.
            let stamp = input_stamp(io, prologue, plain_in);
            let dy = io.half(This("dy"))?;
            let dw = r::wgrad_with_prologue_with(&p, input, dy, &mut scratch, stamp);
            io.put_scratch(scratch);
            io.set_half(This("dw"), dw?)?;
        }
        GraphRole::DbnApply => {
            let out = io.take_half(Prev("dy"))?;
            let d = r::dbn_apply_into(
                &xs,
                io.half(This("dz_prev"))?,
                io.half(Prev("y"))?,
                io.float(This("dbn_a"))?,
                io.float(This("dbn_b"))?,
                io.float(This("dbn_c"))?,
                out,
            )?;
            io.set_half(Prev("dy"), d)?;
        }
        GraphRole::Dgrad => {
            let dst = if through_bn {
                This("da_prev")
            } else {
                This("dx")
            };
            let out = io.take_half(dst)?;
            let mut scratch = io.take_scratch();
            let (dy, w) = (io.half(This("dy"))?, io.half(This("w"))?);
            let d = r::conv_dgrad_with(&p, dy, w, &mut scratch, out);
            io.put_scratch(scratch);
            io.set_half(dst, d?)?;
        }
        GraphRole::ApplyPrev => {
            let a = if kind == RouteKind::Unfused {
                r::relu_fwd(&xs, io.half(Prev("y_bn"))?)?
            } else {
                r::bn_apply(
                    &xs,
                    io.half(Prev("y"))?,
                    io.half(Prev("eq_scale"))?,
                    io.half(Prev("eq_bias"))?,
                    Residual::None,
                    Activation::Relu,
                )?
            };
            io.set_half(This("a_prev"), a)?;
        }
        GraphRole::Conv => {
            let y = r::conv_fprop(&p, io.half(plain_in)?, io.half(This("w"))?)?;
            io.set_half(This("y"), y)?;
        }
        GraphRole::BnForward => {
            let mut mean = io.float(This("running_mean"))?.to_vec();
            let mut var = io.float(This("running_var"))?.to_vec();
            let y = io.half(This("y"))?;
            let (gamma, beta) = (io.float(This("gamma"))?, io.float(This("beta"))?);
            let out = r::bn_fwd_train(
                &ys,
                y,
                gamma,
                beta,
                RunningStats {
                    mean: &mut mean,
                    var: &mut var,
                },
                &bn,
            )?;
            let activation = match cfg.apply {
                // The graph keeps the normalized value virtual (FP32) through the residual
                // add and the ReLU, and stores only the activation: round once, at the end.
                Some(_) => Some(bn_activation(
                    &ys,
                    y,
                    &out.saved_mean,
                    &out.saved_inv_std,
                    gamma,
                    beta,
                    residual_of(io, cfg.apply)?,
                )?),
                None => None,
            };
            io.set_float(This("running_mean_next"), mean)?;
            io.set_float(This("running_var_next"), var)?;
            io.set_float(This("saved_mean"), out.saved_mean)?;
            io.set_float(This("saved_inv_std"), out.saved_inv_std)?;
            match activation {
                Some(a) => io.set_half(This("a"), a)?,
                None => io.set_half(This("y_bn"), out.out)?,
            }
        }
        GraphRole::AddBranch => {
            let d = r::add(&xs, io.half(This("da_prev"))?, io.half(This("dy_branch"))?)?;
            io.set_half(This("da_sum"), d)?;
        }
        GraphRole::ReluBackward => {
            let grad = if cfg.backward_residual == BackwardResidual::FuseAdd {
                This("da_sum")
            } else {
                This("da_prev")
            };
            let d = r::relu_bwd(&xs, io.half(grad)?, io.half(This("a_prev"))?)?;
            io.set_half(This("dz_prev"), d)?;
        }
        GraphRole::BnBackward => {
            let out = r::bn_bwd(
                &xs,
                io.half(Prev("y"))?,
                io.half(This("dz_prev"))?,
                io.float(Prev("saved_mean"))?,
                io.float(Prev("saved_inv_std"))?,
                io.float(Prev("gamma"))?,
            )?;
            io.set_half(Prev("dy"), out.dx)?;
            io.set_float(Prev("dgamma"), out.dgamma)?;
            io.set_float(Prev("dbeta"), out.dbeta)?;
        }
        GraphRole::DbnReduce => {
            let [dgamma, dbeta] = dbn_reduce(
                &xs,
                io.half(Prev("y"))?,
                io.half(This("dz_prev"))?,
                io.float(Prev("saved_mean"))?,
                io.float(Prev("saved_inv_std"))?,
            )?;
            io.set_float(Prev("dgamma"), dgamma)?;
            io.set_float(Prev("dbeta"), dbeta)?;
        }
        GraphRole::DbnCoefficients => {
            let [a, b, c] = dbn_coefficients(
                xs.pixels(),
                io.float(Prev("gamma"))?,
                io.float(Prev("saved_inv_std"))?,
                io.float(Prev("saved_mean"))?,
                io.float(Prev("dgamma"))?,
                io.float(Prev("dbeta"))?,
            )?;
            io.set_float(This("dbn_a"), a)?;
            io.set_float(This("dbn_b"), b)?;
            io.set_float(This("dbn_c"), c)?;
        }
        GraphRole::ApplyDbnReduce => {
            let [dgamma, dbeta] = dbn_reduce(
                &ys,
                io.half(This("y"))?,
                io.half(This("dpre"))?,
                io.float(This("saved_mean"))?,
                io.float(This("saved_inv_std"))?,
            )?;
            io.set_float(This("dgamma"), dgamma)?;
            io.set_float(This("dbeta"), dbeta)?;
        }
        GraphRole::ApplyDbnCoefficients => {
            let [a, b, c] = dbn_coefficients(
                ys.pixels(),
                io.float(This("gamma"))?,
                io.float(This("saved_inv_std"))?,
                io.float(This("saved_mean"))?,
                io.float(This("dgamma"))?,
                io.float(This("dbeta"))?,
            )?;
            io.set_float(This("apply_dbn_a"), a)?;
            io.set_float(This("apply_dbn_b"), b)?;
            io.set_float(This("apply_dbn_c"), c)?;
        }
        GraphRole::ApplyDbnApply => {
            let out = io.take_half(This("dy"))?;
            let d = r::dbn_apply_into(
                &ys,
                io.half(This("dpre"))?,
                io.half(This("y"))?,
                io.float(This("apply_dbn_a"))?,
                io.float(This("apply_dbn_b"))?,
                io.float(This("apply_dbn_c"))?,
                out,
            )?;
            io.set_half(This("dy"), d)?;
        }
    }
    Ok(())
}

/// The unfused route's BN forward with the activation fused in:
/// `relu(BN(y) [+ r | + r·s2 + b2])` with the normalized value, the residual sum and the ReLU
/// in `T::Acc` (the graph's FP32 virtuals), rounded to `T` once.
pub(super) fn bn_activation<T: Element>(
    shape: &Nhwc,
    y: &[T],
    mean: &[T::Acc],
    inv_std: &[T::Acc],
    gamma: &[T::Acc],
    beta: &[T::Acc],
    residual: Residual<'_, T>,
) -> Result<Vec<T>> {
    let c = shape.c;
    let n = y.len();
    match residual {
        Residual::Add(r) => check_len("residual", r, n)?,
        Residual::ScaleBias { r, scale, bias } => {
            check_len("residual", r, n)?;
            check_len("residual_scale", scale, c)?;
            check_len("residual_bias", bias, c)?;
        }
        Residual::None => {}
    }
    Ok((0..n)
        .map(|i| {
            let ch = i % c;
            let v = bn_recompute(y[i].to_acc(), mean[ch], inv_std[ch], gamma[ch], beta[ch]);
            let v = match residual {
                Residual::None => v,
                Residual::Add(r) => v + r[i].to_acc(),
                Residual::ScaleBias { r, scale, bias } => {
                    v + (r[i].to_acc() * scale[ch].to_acc() + bias[ch].to_acc())
                }
            };
            T::from_acc(v.relu())
        })
        .collect())
}

/// The generic route's `dbn_reduce` graph on the CPU: per channel, `dγ = Σ dz·x̂` and
/// `dβ = Σ dz` with `x̂ = (y − mean)·inv_std`.
///
/// Rounding points mirror the graph: `y − mean`, `·inv_std` and `dz·x̂` are each rounded to
/// FP32 (the graph's FP32 virtual tensors); the sums run in `f64` and are rounded to FP32 once
/// (the GPU's reduction sums FP32 values in an unspecified order, so it may differ in the last
/// bits). The reductions read the stored FP16 `dz`, as the graph does.
pub(super) fn dbn_reduce<T: Element>(
    shape: &Nhwc,
    y: &[T],
    dz: &[T],
    mean: &[T::Acc],
    inv_std: &[T::Acc],
) -> Result<[Vec<T::Acc>; 2]> {
    shape.validate("y")?;
    check_len("y", y, shape.elems())?;
    check_len("dz", dz, shape.elems())?;
    check_len("saved_mean", mean, shape.c)?;
    check_len("saved_inv_std", inv_std, shape.c)?;
    let c = shape.c;
    // Blocks of pixels in parallel, each widened a slice at a time; the FP32 products are the
    // graph's, summed in f64 (chunk by chunk, in row order within a chunk).
    let sums = channel_sums::<2, Vec<T::Acc>, _>(shape.pixels(), c, |rows, buf, acc| {
        let range = rows.start * c..rows.end * c;
        let n = range.len();
        buf.resize(2 * n, T::Acc::ZERO);
        let (yv, dv) = buf.split_at_mut(n);
        T::widen_into(&y[range.clone()], yv);
        T::widen_into(&dz[range], dv);
        let (mean, inv_std) = (&mean[..c], &inv_std[..c]);
        let acc = &mut acc[..c];
        for (yp, dp) in yv.chunks_exact(c).zip(dv.chunks_exact(c)) {
            let (yp, dp) = (&yp[..c], &dp[..c]);
            for k in 0..c {
                let x_hat = (yp[k] - mean[k]) * inv_std[k];
                acc[k][0] += (dp[k] * x_hat).to_f64();
                acc[k][1] += dp[k].to_f64();
            }
        }
    });
    Ok([
        sums.iter().map(|s| T::Acc::from_f64(s[0])).collect(),
        sums.iter().map(|s| T::Acc::from_f64(s[1])).collect(),
    ])
}

/// The generic route's `dbn_coefficients` graph on the CPU: the coefficients of
/// `dy = A·dz + B·y + C` over `count` elements per channel, every step in FP32 in the graph's
/// order (`a = γ·inv_std`, `B = ((a·inv_std)·dγ)·(−1/M)`, `C = ((a·dβ)·(−1/M)) − B·mean`,
/// `A = a`, with `−1/M` rounded to FP32 as the graph's by-value scalar). The GPU may contract a
/// multiply and the final subtraction into one FMA: at most one FP32 rounding apart.
pub(super) fn dbn_coefficients<A: Real>(
    count: usize,
    gamma: &[A],
    inv_std: &[A],
    mean: &[A],
    dgamma: &[A],
    dbeta: &[A],
) -> Result<[Vec<A>; 3]> {
    let c = gamma.len();
    check_len("saved_inv_std", inv_std, c)?;
    check_len("saved_mean", mean, c)?;
    check_len("dgamma", dgamma, c)?;
    check_len("dbeta", dbeta, c)?;
    // −1/M rounded once to the arithmetic type, as the graph's by-value FP32 scalar.
    let nm = A::from_f64(-1.0 / count as f64);
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

#[cfg(test)]
mod tests {
    use super::super::kernels::test_support::{accumulated_params, configs};
    use super::super::kernels::KernelStep;
    use super::super::layer::route_graphs;
    use super::*;
    use crate::graph::{Node, TensorId};
    use std::collections::HashSet;

    fn side_of(src: Src) -> Option<(Side, &'static str)> {
        match src {
            This(n) => Some((Side::This, n)),
            Prev(n) => Some((Side::Prev, n)),
            Src::Scalar(_) => None,
        }
    }

    /// Every step that accumulates into an output has it zeroed before it runs, on every
    /// route, for layers whose steps run on our kernels and on cuDNN's plans (the steps are
    /// built as [`CbrLayer::plan`] builds them, without cuDNN). What accumulates is read
    /// from the kernels themselves: each `atomicAdd` target of our kernels' source (through
    /// the step's argument list), and for a cuDNN graph the outputs of its reductions
    /// (Reduction, GenStats, the BN-backward weights' dγ and dβ). Nothing a step reads is
    /// zeroed.
    #[test]
    fn every_accumulated_output_is_zeroed_before_its_step() {
        let atomics = accumulated_params();
        let mut kernels_seen = HashSet::new();
        let mut plans_seen = HashSet::new();
        for config in configs() {
            for kind in [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic] {
                for lg in route_graphs(&config, kind) {
                    for arch in [Some("sm_90"), None] {
                        let kernel = arch.and_then(|a| KernelStep::for_graph(&lg, a));
                        let step = LayerStep {
                            role: lg.role,
                            plan: None,
                            kernel,
                            bindings: lg.bindings.clone(),
                        };
                        let zeroed = step.outputs_to_zero();
                        let at = || format!("{} {kind:?} {:?}", config.shape.label(), lg.role);
                        let (accumulated, inputs): (Vec<_>, Vec<_>) = match &step.kernel {
                            Some(k) => {
                                let sources = k.sources();
                                let targets = &atomics
                                    .iter()
                                    .find(|(e, _)| e == k.kernel().entry())
                                    .expect("the kernel is in the source")
                                    .1;
                                if !targets.is_empty() {
                                    kernels_seen.insert(k.kernel().entry());
                                }
                                let acc = targets
                                    .iter()
                                    .map(|&i| side_of(sources[i]).expect("a buffer"))
                                    .collect();
                                // The arguments before the first output are what it reads.
                                let n_in = sources.len() - k.output_count();
                                let ins = sources[..n_in].iter().filter_map(|s| side_of(*s));
                                (acc, ins.collect())
                            }
                            None => {
                                let g = &lg.graph;
                                let mut acc_ids = Vec::new();
                                let mut produced = HashSet::new();
                                let mut read = HashSet::new();
                                for node in g.nodes() {
                                    produced.extend(node.outputs());
                                    read.extend(node.inputs());
                                    match node {
                                        Node::Reduction { y, .. } => acc_ids.push(*y),
                                        Node::GenStats { sum, sq_sum, .. } => {
                                            acc_ids.extend([*sum, *sq_sum])
                                        }
                                        Node::DbnWeight { outputs, .. } => {
                                            acc_ids.extend([outputs.dscale, outputs.dbias])
                                        }
                                        _ => {}
                                    }
                                }
                                let bound = |ids: &mut dyn Iterator<Item = TensorId>| {
                                    ids.filter_map(|t| lg.bindings.iter().find(|(b, _)| *b == t))
                                        .filter_map(|(_, s)| side_of(*s))
                                        .collect::<Vec<_>>()
                                };
                                let acc = bound(&mut acc_ids.clone().into_iter());
                                if !acc.is_empty() {
                                    plans_seen.insert(lg.role);
                                }
                                let ins =
                                    bound(&mut read.into_iter().filter(|t| !produced.contains(t)));
                                (acc, ins)
                            }
                        };
                        for out in &accumulated {
                            assert!(zeroed.contains(out), "{}: {out:?} not zeroed", at());
                        }
                        for z in &zeroed {
                            assert!(!inputs.contains(z), "{}: zeroes its input {z:?}", at());
                        }
                    }
                }
            }
        }
        // Both of our reductions and every accumulating cuDNN role were among the steps.
        assert_eq!(
            kernels_seen,
            HashSet::from(["cbr_channel_stats", "cbr_dbn_reduce"])
        );
        for role in [
            GraphRole::ConvStats,
            GraphRole::Stats,
            GraphRole::DgradDreluDbn,
            GraphRole::DbnReduce,
            GraphRole::ApplyDbnReduce,
        ] {
            assert!(plans_seen.contains(&role), "no cuDNN step of {role:?}");
        }
    }

    /// The zeroing list is the role table's buffers as the step binds them (this layer's or
    /// the previous one's), and nothing for a role that overwrites.
    #[test]
    fn the_zeroing_list_follows_the_step_bindings() {
        let step = |role, bindings: Vec<(u32, Src)>| LayerStep {
            role,
            plan: None,
            kernel: None,
            bindings: bindings
                .into_iter()
                .map(|(i, s)| (TensorId(i), s))
                .collect(),
        };
        let generic = step(
            GraphRole::DbnReduce,
            vec![
                (0, Prev("y")),
                (1, This("dz_prev")),
                (2, Prev("dgamma")),
                (3, Prev("dbeta")),
            ],
        );
        assert_eq!(
            generic.outputs_to_zero(),
            [(Side::Prev, "dgamma"), (Side::Prev, "dbeta")]
        );
        let finalize = step(GraphRole::Finalize, vec![(0, This("sum"))]);
        assert!(finalize.outputs_to_zero().is_empty());
    }
}
