//! Running a planned layer: on a GPU through its cuDNN plans, or on the CPU through the
//! reference ops, over the same named buffers and in the same step order.

use super::bn_sync::{sync_action, synced_step, BnSide, BnSync, DeviceBnSync, SyncAction};
use super::buffers::{HostBuffer, HostBuffers};
use super::device_buffers::{DeviceBuffer, DeviceBuffers, Resolved, Side, SyncScratch};
use super::graphs::ApplyResidual;
use super::keys as k;
use super::layer::{CbrLayer, GraphRole, InputKind, LayerStep, Src};
use super::role::{cpu_eval_step, cpu_step, EvalStep, RolePass};
use crate::error::{Error, Result};
use crate::exec::{Bindings, Handle, Scalar, Workspace};
use crate::reference::{self as r, BnParams, ConvScratch, Element};
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
                    let sums = [(Side::This, k::SUM.name()), (Side::This, k::SQ_SUM.name())];
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
                    scratch.gather(
                        handle,
                        &r,
                        [(side, k::DGAMMA.name()), (side, k::DBETA.name())],
                        channels,
                    )?;
                    sync.all_reduce_sum(&stream, scratch.slice_mut())?;
                    let count = pixels as f64 * replicas as f64;
                    let inputs = [
                        r.get(side, k::GAMMA.name())?,
                        r.get(side, k::SAVED_INV_STD.name())?,
                        r.get(side, k::SAVED_MEAN.name())?,
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
            // The role's evaluation step, from the per-role table (the CPU's dispatches on it
            // too: `role::cpu_eval_step`).
            match step.role.def().pass {
                RolePass::Forward(EvalStep::Skip) => {}
                RolePass::Forward(EvalStep::AsTraining | EvalStep::ConvWithoutStats) => {
                    self.gpu_step(step, handle, &r, 1)?
                }
                RolePass::Forward(EvalStep::FinalizeFromRunning) => {
                    self.gpu_eval_finalize(handle, &r)?
                }
                RolePass::Forward(EvalStep::BnFromRunning) => {
                    self.gpu_eval_bn_forward(handle, &r)?
                }
                RolePass::Backward => {
                    return Err(Error::CudnnMessage(format!(
                        "layer {}: {:?} is a backward step, not part of evaluation",
                        self.config().shape.label(),
                        step.role
                    )))
                }
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
            Some(residual) => (BnEvalOutput::Activation(residual), k::A.name()),
            None => (BnEvalOutput::BnOnly, k::Y_BN.name()),
        };
        let residual = match cfg.apply {
            Some(ApplyResidual::Add | ApplyResidual::DualScaleBias) => {
                Some(r.get(Side::This, k::RESIDUAL.name())?)
            }
            _ => None,
        };
        let residual_scale_bias = match cfg.apply {
            Some(ApplyResidual::DualScaleBias) => Some((
                r.get(Side::This, k::RESIDUAL_SCALE.name())?,
                r.get(Side::This, k::RESIDUAL_BIAS.name())?,
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
                y: r.get(Side::This, k::Y.name())?,
                mean: run(0),
                inv_std: run(1),
                gamma: r.get(Side::This, k::GAMMA.name())?,
                beta: r.get(Side::This, k::BETA.name())?,
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
        r.upload_half(handle, k::EQ_SCALE.name(), &out.eq_scale)?;
        r.upload_half(handle, k::EQ_BIAS.name(), &out.eq_bias)
    }

    /// [`r::bn_eval_finalize`] of this layer's γ, β and running statistics, read from the
    /// device (gathered into scratch and downloaded: waits for the stream).
    fn eval_coefficients(&self, handle: &Handle, r: &Resolved<'_>) -> Result<r::BnFinalized<f16>> {
        let cfg = self.config();
        let k = cfg.shape.k as usize;
        let stream = handle.stream().clone();
        let fail = |what: &str, e: cudarc::driver::DriverError| crate::exec::driver(what, e);
        let mut params = SyncScratch::new(&stream, 2 * k)?;
        params.gather(
            handle,
            r,
            [(Side::This, k::GAMMA.name()), (Side::This, k::BETA.name())],
            k,
        )?;
        let mut running = SyncScratch::new(&stream, 2 * k)?;
        running.gather(
            handle,
            r,
            [
                (Side::This, k::RUNNING_MEAN.name()),
                (Side::This, k::RUNNING_VAR.name()),
            ],
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
    pub fn run_cpu_io<T: CpuElement>(&self, pass: Pass, io: &mut dyn LayerIo<T>) -> Result<()> {
        self.run_cpu_io_synced(pass, io, None)
    }

    /// [`CbrLayer::run_cpu_io`] with synchronized BN when `sync` is given ([`BnSync`]): the
    /// forward's GenStats sums and the backward's `dγ`, `dβ` summed over the replicas before
    /// they are used, every count the global one. Without `sync` it is
    /// [`CbrLayer::run_cpu_io`].
    pub fn run_cpu_io_synced<T: CpuElement>(
        &self,
        pass: Pass,
        io: &mut dyn LayerIo<T>,
        sync: Option<&mut dyn BnSync<T::Acc>>,
    ) -> Result<()> {
        T::run_layer_pass(self, pass, io, sync)
    }
}

/// The element types a layer's CPU pass runs in: `f16` storage with `f32` arithmetic, or
/// `f64` throughout ([`Element`]'s two modes; sealed as it is).
///
/// Each mode's pass is one concrete function of this crate, so the reference steps are
/// compiled here once: release builds do not share generic instances between crates, and
/// every crate that ran a pass generically (each test binary among them) would otherwise
/// compile the whole reference executor again.
pub trait CpuElement: Element {
    /// [`CbrLayer::run_cpu_io_synced`] in this mode.
    #[doc(hidden)]
    fn run_layer_pass(
        layer: &CbrLayer,
        pass: Pass,
        io: &mut dyn LayerIo<Self>,
        sync: Option<&mut dyn BnSync<Self::Acc>>,
    ) -> Result<()>;
}

impl CpuElement for f16 {
    fn run_layer_pass(
        layer: &CbrLayer,
        pass: Pass,
        io: &mut dyn LayerIo<Self>,
        sync: Option<&mut dyn BnSync<f32>>,
    ) -> Result<()> {
        layer_pass(layer, pass, io, sync)
    }
}

impl CpuElement for f64 {
    fn run_layer_pass(
        layer: &CbrLayer,
        pass: Pass,
        io: &mut dyn LayerIo<Self>,
        sync: Option<&mut dyn BnSync<f64>>,
    ) -> Result<()> {
        layer_pass(layer, pass, io, sync)
    }
}

/// A layer's CPU pass in either mode (see [`CbrLayer::run_cpu_io_synced`]).
fn layer_pass<T: Element>(
    layer: &CbrLayer,
    pass: Pass,
    io: &mut dyn LayerIo<T>,
    mut sync: Option<&mut dyn BnSync<T::Acc>>,
) -> Result<()> {
    let roles: Vec<GraphRole> = layer.pass_steps(pass).map(|s| s.role).collect();
    if pass == Pass::Eval {
        // Nothing to synchronize: no batch statistics.
        for role in roles {
            cpu_eval_step(layer, role, io)?;
        }
        return Ok(());
    }
    for role in roles {
        match sync.as_deref_mut() {
            None => cpu_step(layer, role, io, 1)?,
            Some(sync) => synced_step(layer, role, io, sync)?,
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

impl GraphRole {
    /// The buffers (by name) a step of this role adds into instead of overwriting: the
    /// per-channel reductions (GenStats' Σy and Σy², the BN-backward weights' and the
    /// reductions' dγ and dβ), which our kernels (`cbr_channel_stats`, `cbr_dbn_reduce`:
    /// `atomicAdd` per block) and cuDNN's engines (split across CTAs) may accumulate. The one
    /// table both GPU paths zero from ([`LayerStep::outputs_to_zero`]); zeroing where cuDNN
    /// overwrites anyway costs a memset of a few hundred bytes.
    pub fn accumulated_outputs(self) -> &'static [&'static str] {
        self.def().accumulates
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
    (k::RUNNING_MEAN_NEXT.name(), k::RUNNING_MEAN.name()),
    (k::RUNNING_VAR_NEXT.name(), k::RUNNING_VAR.name()),
];

/// The buffers a layer's CPU steps read and write, by [`Src`] (this layer's or the previous
/// layer's buffer, by name), in one precision mode: `Half` buffers as `T`, `Float` buffers as
/// `T::Acc` (f16/f32 in FP16 mode, f64/f64 in f64 mode).
///
/// [`HostBuffers`] pairs implement it for FP16 mode; a network executor implements it over
/// its own buffer table, resolving each layer's names to the network's buffers.
pub trait LayerIo<T: Element>: LayerRead<T> {
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

    /// Writes `len` values into `Half` buffer `out`: `f(storage, reads)` overwrites every
    /// element of `storage` and reads its inputs through `reads`. A table that keeps `out` in a
    /// shared arena hands `f` the arena's range itself, with every other buffer readable (a
    /// read of a buffer that shares bytes with `out` is an [`Error::Buffer`], never stale
    /// data); others lend the buffer's vector ([`write_half_via_vec`]).
    ///
    /// # Errors
    /// `f`'s; [`Error::Buffer`] when `out` is not an FP16 buffer of `len` elements.
    fn write_half(&mut self, out: Src, len: usize, f: &mut WriteHalf<'_, T>) -> Result<()>;

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

/// Read access to a layer's buffers by [`Src`]: what an op reads, also while it writes its
/// output ([`LayerIo::write_half`]).
pub trait LayerRead<T: Element> {
    /// A `Half` buffer.
    fn half(&self, src: Src) -> Result<&[T]>;
    /// A `Float` buffer.
    fn float(&self, src: Src) -> Result<&[T::Acc]>;

    /// A stamp of a buffer's contents: a value that changes whenever they may have (a write
    /// counter), unique to the buffer; `None` (the default) where the table keeps none. The
    /// conv scratch then knows the forward's input by stamps instead of keeping copies.
    fn stamp(&self, src: Src) -> Option<u64> {
        let _ = src;
        None
    }
}

/// The op of a [`LayerIo::write_half`]: `(storage, reads)`.
pub type WriteHalf<'f, T> = dyn FnMut(&mut [T], &dyn LayerRead<T>) -> Result<()> + 'f;

/// [`LayerIo::write_half`] through the buffer's vector: lent by [`LayerIo::take_half`], sized
/// to `len` (its old contents left for `f` to overwrite), and handed back through
/// [`LayerIo::set_half`]. Until then `out` reads as the table's `take_half` leaves it.
///
/// # Errors
/// `f`'s, and the table's.
pub fn write_half_via_vec<T: Element, I: LayerIo<T>>(
    io: &mut I,
    out: Src,
    len: usize,
    f: &mut WriteHalf<'_, T>,
) -> Result<()> {
    let mut v = io.take_half(out)?;
    v.resize(len, T::default());
    f(&mut v, &*io)?;
    io.set_half(out, v)
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

impl LayerRead<f16> for PairIo<'_> {
    fn half(&self, src: Src) -> Result<&[f16]> {
        let (t, n) = self.table(src)?;
        t.f16(n)
    }
    fn float(&self, src: Src) -> Result<&[f32]> {
        let (t, n) = self.table(src)?;
        t.f32(n)
    }
}

impl LayerIo<f16> for PairIo<'_> {
    fn write_half(&mut self, out: Src, len: usize, f: &mut WriteHalf<'_, f16>) -> Result<()> {
        write_half_via_vec(self, out, len, f)
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

#[cfg(test)]
mod tests {
    use super::super::kernels::test_support::{accumulated_params, configs};
    use super::super::kernels::KernelStep;
    use super::super::layer::{route_graphs, RouteKind};
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
