//! [`CpuClassifier`]: a compiled network on the CPU reference executor (FP16 storage, FP32
//! arithmetic), the head on netops' CPU twins of the CUDA head kernels, the amp step on
//! [`CpuRegions`].

use super::{check_batch, ClassifierError, EvalWeights, Evaluation};
use crate::amp::plan::Bucket;
use crate::amp::plan::Region;
use crate::amp::range::softmax_xent_backward;
use crate::amp::step::{AmpStep, CpuRegions, StepConfig};
use crate::amp::AmpError;
use crate::net::{
    initial_weights, memory_plan, memory_plan_with_ema, Arena, CompiledNet, CpuNet, GradSchedule,
};
use crate::netops::head::{self, HeadMetrics, HeadShape};

/// What a data-parallel step does with a gradient bucket once it is in the regions
/// ([`CpuClassifier::forward_backward_reduced`]).
pub type BucketReduce<'a> =
    dyn FnMut(&mut CpuRegions, Bucket) -> std::result::Result<(), AmpError> + 'a;

/// Copies layer `name`'s gradients of the parameters `suffixes` (`w`, `gamma`, `beta`) from
/// the network's buffers into the regions (G16 for the weight, G for the BN parameters).
fn copy_grads(
    net: &CpuNet<f16>,
    regions: &mut CpuRegions,
    name: &str,
    suffixes: &[&str],
) -> Result<()> {
    for &p in suffixes {
        if p == "w" {
            let dw = net.half(&format!("{name}.dw"))?;
            regions
                .param_f16_mut(&format!("{name}.w"), Region::G16)?
                .copy_from_slice(dw);
        } else {
            let g = net.float(&format!("{name}.d{p}"))?;
            regions
                .param_f32_mut(&format!("{name}.{p}"), Region::G)?
                .copy_from_slice(g);
        }
    }
    Ok(())
}
use half::f16;

type Result<T> = std::result::Result<T, ClassifierError>;

/// A classifier on the CPU executor.
#[derive(Debug)]
pub struct CpuClassifier {
    net: CpuNet<f16>,
    step: AmpStep<CpuRegions>,
    shape: HeadShape,
    layers: Vec<String>,
}

impl CpuClassifier {
    /// The network (compiled with a CPU policy, e.g. `RoutePolicy::Uniform`) with an FC head
    /// of `classes` outputs, its memory plan on the host, and the amp step of `config`; the
    /// master weights start from [`initial_weights`] of `seed`. A `config` with an EMA
    /// ([`StepConfig::with_ema`]) gets a plan with the EMA regions E and E16; one that
    /// accumulates gradients over several micro-batches ([`StepConfig::with_accum`]) gets the
    /// accumulator GA ([`CpuClassifier::train_step`]).
    ///
    /// # Errors
    /// A memory plan or step configuration the amp layer refuses: `classes` other than the
    /// spec's is [`crate::amp::PlanError::HeadClasses`], a micro-batch count outside
    /// `1..=`[`crate::amp::step::MAX_ACCUM`] is [`crate::amp::RangeOpError::InvalidConfig`].
    pub fn new(net: CompiledNet, classes: usize, config: StepConfig, seed: u64) -> Result<Self> {
        Self::with_arena(net, classes, config, seed, Arena::Separate)
    }

    /// [`CpuClassifier::new`] with the network's buffers laid out as `arena` says
    /// ([`Arena::Shared`]: the liveness-planned arena, the same results in less memory).
    ///
    /// # Errors
    /// As [`CpuClassifier::new`]; a host allocation that fails.
    pub fn with_arena(
        net: CompiledNet,
        classes: usize,
        config: StepConfig,
        seed: u64,
        arena: Arena,
    ) -> Result<Self> {
        let plan = if config.ema_decay.is_some() {
            memory_plan_with_ema(&net, classes)?
        } else {
            memory_plan(&net, classes)?
        };
        let plan = if config.accum > 1 {
            plan.with_grad_accumulator()?
        } else {
            plan
        };
        let mut regions = CpuRegions::new(plan)?;
        for (name, values) in initial_weights(&net, classes, seed) {
            regions
                .param_f32_mut(&name, Region::W)?
                .copy_from_slice(&values);
        }
        let mut step = AmpStep::new(regions, config)?;
        step.init_weights()?;
        let shape = HeadShape::new(net.batch, net.out_hw * net.out_hw, net.features, classes);
        let layers = net.layers.iter().map(|l| l.name.clone()).collect();
        Ok(CpuClassifier {
            net: CpuNet::with_arena(net, arena)?,
            step,
            shape,
            layers,
        })
    }

    /// The amp step (begin, finish, capture, replay, learning rate, loss scale).
    pub fn step(&self) -> &AmpStep<CpuRegions> {
        &self.step
    }

    /// The compiled network.
    pub fn net(&self) -> &CompiledNet {
        self.net.net()
    }

    /// The amp step, to drive it.
    pub fn step_mut(&mut self) -> &mut AmpStep<CpuRegions> {
        &mut self.step
    }

    /// Synchronized BN for a data-parallel replica (see [`crate::dist::CpuReplica`], which
    /// sets it up): [`CpuNet::set_bn_sync`].
    pub fn set_bn_sync(&mut self, sync: Box<dyn crate::fusion::cbr::BnSync<f32> + Send>) {
        self.net.set_bn_sync(sync);
    }

    /// The compiled network.
    pub fn compiled(&self) -> &CompiledNet {
        self.net.net()
    }

    /// Every layer's running statistics (`stem.running_mean`, `stem.running_var`, …), in the
    /// network's buffer order: what a checkpoint saves besides the amp regions.
    ///
    /// # Errors
    /// A statistic the network does not hold as FP32 (not for a compiled network).
    pub fn running_stats(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let net = self.net.net();
        crate::net::cuda::running_stats(net)
            .map(|id| {
                let name = &net.buffers[id].name;
                Ok((name.clone(), self.net.float(name)?.to_vec()))
            })
            .collect()
    }

    /// Overwrites running statistic `name` (as [`CpuClassifier::running_stats`] names it),
    /// e.g. from a checkpoint.
    ///
    /// # Errors
    /// An unknown name or a length other than the statistic's.
    pub fn set_running_stat(&mut self, name: &str, values: Vec<f32>) -> Result<()> {
        Ok(self.net.set_float(name, values)?)
    }

    /// The (FP16, FP32) regions `weights` reads: (A, W) or (E16, E).
    fn regions_of(&self, weights: EvalWeights) -> Result<(Region, Region)> {
        match weights {
            EvalWeights::Trained => Ok((Region::A, Region::W)),
            EvalWeights::Ema if self.step.executor().plan_arc().has_region(Region::E) => {
                Ok((Region::E16, Region::E))
            }
            EvalWeights::Ema => Err(ClassifierError::Input(
                "the EMA weights were asked for, but the step keeps no EMA (StepConfig::with_ema)"
                    .into(),
            )),
        }
    }

    /// Conv weights from the FP16 region (A, or E16), BN parameters from the FP32 one (W, or
    /// E) into the layers' buffers.
    fn load_weights(&mut self, weights: EvalWeights) -> Result<()> {
        let (half, float) = self.regions_of(weights)?;
        let regions = self.step.executor();
        for name in &self.layers {
            let key = format!("{name}.w");
            self.net
                .set_half(&key, regions.param_f16(&key, half)?.to_vec())?;
            for p in ["gamma", "beta"] {
                let key = format!("{name}.{p}");
                self.net
                    .set_float(&key, regions.param_f32(&key, float)?.to_vec())?;
            }
        }
        Ok(())
    }

    /// Forward through the network (training mode, or evaluation mode with `eval`), the
    /// pooling and the FC layer: FP16 logits `[batch, classes]` and the pooled features.
    fn forward(
        &mut self,
        images: &[f16],
        eval: Option<EvalWeights>,
    ) -> Result<(Vec<f16>, Vec<f32>)> {
        let weights = eval.unwrap_or_default();
        self.load_weights(weights)?;
        match eval {
            Some(_) => self.net.evaluate(images)?,
            None => self.net.forward(images)?,
        }
        let mut pooled = vec![0f32; self.shape.pooled_elems()];
        head::gap_forward(&self.shape, self.net.output(), &mut pooled)?;
        let mut logits = vec![f16::ZERO; self.shape.logits_elems()];
        let (_, float) = self.regions_of(weights)?;
        let regions = self.step.executor();
        head::fc_forward(
            &self.shape,
            &pooled,
            regions.param_f32("fc.w", float)?,
            regions.param_f32("fc.b", float)?,
            &mut logits,
        )?;
        Ok((logits, pooled))
    }

    /// Evaluates one batch of `images` (NHWC FP16): forward only, BN in evaluation mode (each
    /// layer normalizes with its running statistics: [`CpuNet::evaluate`]), with the trained
    /// or the EMA weights. Running statistics, weights and the step are left as they were.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size, or for the EMA weights of a
    /// step that keeps none; a running variance below `−ε`.
    pub fn evaluate(&mut self, images: &[f16], weights: EvalWeights) -> Result<Evaluation> {
        let labels = vec![0; self.shape.batch];
        let want = self.net.net().buffers[self.net.net().input].elems;
        check_batch(
            images.len(),
            want,
            &labels,
            self.shape.batch,
            self.shape.classes,
        )?;
        let (logits, _) = self.forward(images, Some(weights))?;
        Ok(Evaluation::from_logits(logits, self.shape.classes))
    }

    /// The logits of `images` (NHWC FP16, one batch) with the current weights, BN in training
    /// mode (the batch's statistics, and the running statistics updated);
    /// [`CpuClassifier::evaluate`] is the evaluation-mode forward.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size.
    pub fn logits(&mut self, images: &[f16]) -> Result<Vec<f16>> {
        let labels = vec![0; self.shape.batch];
        let want = self.net.net().buffers[self.net.net().input].elems;
        check_batch(
            images.len(),
            want,
            &labels,
            self.shape.batch,
            self.shape.classes,
        )?;
        Ok(self.forward(images, None)?.0)
    }

    /// One forward and backward pass on a batch: gradients land in G16 (conv weights) and G
    /// (BN, FC), scaled by the current loss scale. Returns the batch's loss and accuracy.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size or a label out of range.
    pub fn forward_backward(&mut self, images: &[f16], labels: &[i32]) -> Result<HeadMetrics> {
        self.forward_backward_with(images, labels, None)
    }

    /// One optimizer step over `micro_batches` (images NHWC FP16, labels), as many as the
    /// step's [`StepConfig::accum`]: for each, [`AmpStep::begin`] and
    /// [`CpuClassifier::forward_backward`] (BN normalizes with that micro-batch's statistics
    /// and updates the running statistics once per micro-batch, as PyTorch's does), then
    /// [`AmpStep::accumulate`], or [`AmpStep::finish`] after the last one: the check, SGD
    /// (unscaling by `1 / (loss_scale · N)`) and the scale update run once, over the sum of
    /// the micro-batches' gradients. Returns each micro-batch's loss and accuracy.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a count other than the step's (nothing runs) or a bad
    /// micro-batch (the step stops there, before its update).
    pub fn train_step(&mut self, micro_batches: &[(&[f16], &[i32])]) -> Result<Vec<HeadMetrics>> {
        super::check_micro_batches(micro_batches.len(), self.step.config().accum)?;
        let mut metrics = Vec::with_capacity(micro_batches.len());
        for (k, (images, labels)) in micro_batches.iter().enumerate() {
            self.step.begin()?;
            metrics.push(self.forward_backward(images, labels)?);
            if k + 1 < micro_batches.len() {
                self.step.accumulate()?;
            } else {
                self.step.finish()?;
            }
        }
        Ok(metrics)
    }

    /// [`CpuClassifier::forward_backward`] for a data-parallel step: each gradient bucket is
    /// written to the regions and handed to `reduce` as soon as the backward pass has made it
    /// final (`schedule`, from [`crate::net::grad_schedule`] for this classifier's network and
    /// plan), the deepest first, while the shallower layers' backward is still to run.
    ///
    /// # Errors
    /// As [`CpuClassifier::forward_backward`]; `reduce`'s error (the pass stops there).
    pub fn forward_backward_reduced(
        &mut self,
        images: &[f16],
        labels: &[i32],
        schedule: &GradSchedule,
        reduce: &mut BucketReduce<'_>,
    ) -> Result<HeadMetrics> {
        self.forward_backward_with(images, labels, Some((schedule, reduce)))
    }

    fn forward_backward_with(
        &mut self,
        images: &[f16],
        labels: &[i32],
        reduced: Option<(&GradSchedule, &mut BucketReduce<'_>)>,
    ) -> Result<HeadMetrics> {
        let (batch, classes) = (self.shape.batch, self.shape.classes);
        let want = self.net.net().buffers[self.net.net().input].elems;
        check_batch(images.len(), want, labels, batch, classes)?;
        let (logits, pooled) = self.forward(images, None)?;
        // The scaled loss gradient: scale / batch · (softmax − onehot), FP16.
        let scalars = self.step.executor().scalars();
        let mut dlogits = vec![f16::ZERO; logits.len()];
        let mut rows = vec![0f32; batch];
        softmax_xent_backward(
            &logits,
            labels,
            classes,
            &scalars,
            &mut dlogits,
            Some(&mut rows),
        )?;
        let metrics = head::head_metrics(&logits, labels, Some(&rows), classes)?;
        let mut dw = vec![0f32; self.shape.weight_elems()];
        let mut db = vec![0f32; classes];
        let mut dpooled = vec![0f32; pooled.len()];
        let w = self.step.executor().param_f32("fc.w", Region::W)?;
        head::fc_backward(
            &self.shape,
            &dlogits,
            &pooled,
            w,
            &mut dw,
            &mut db,
            &mut dpooled,
        )?;
        let regions = self.step.executor_mut();
        regions
            .param_f32_mut("fc.w", Region::G)?
            .copy_from_slice(&dw);
        regions
            .param_f32_mut("fc.b", Region::G)?
            .copy_from_slice(&db);
        let mut da = vec![f16::ZERO; self.shape.activation_elems()];
        head::gap_backward(&self.shape, &dpooled, &mut da)?;
        let Some((schedule, reduce)) = reduced else {
            self.net.backward(da)?;
            for name in &self.layers {
                copy_grads(&self.net, regions, name, &["w", "gamma", "beta"])?;
            }
            return Ok(metrics);
        };
        let plan = regions.plan_arc().clone();
        let layers = &self.layers;
        // The bucket's network gradients into the regions, then its sum.
        let mut release = |net: &CpuNet<f16>, regions: &mut CpuRegions, bucket: Bucket| {
            let info = plan.buckets().get(bucket.index()).ok_or_else(|| {
                ClassifierError::Input(format!("the schedule names bucket {}", bucket.index()))
            })?;
            for p in &plan.params()[info.params()] {
                if let Some((layer, suffix)) = p.name().rsplit_once('.') {
                    if layers.iter().any(|l| l == layer) {
                        copy_grads(net, regions, layer, &[suffix])?;
                    }
                }
            }
            reduce(regions, bucket).map_err(ClassifierError::from)
        };
        for &b in &schedule.before {
            release(&self.net, regions, b)?;
        }
        if schedule.after.len() != self.net.net().backward.len() {
            return Err(ClassifierError::Input(format!(
                "the gradient schedule has {} backward steps, the network {}",
                schedule.after.len(),
                self.net.net().backward.len()
            )));
        }
        // The first failure of a release, kept while the pass stops.
        let mut failed: Option<ClassifierError> = None;
        let pass = self.net.backward_observed(da, &mut |net, i| {
            for &b in &schedule.after[i] {
                if let Err(e) = release(net, regions, b) {
                    failed = Some(e);
                    return Err(crate::fusion::Error::BnSync(
                        "a gradient bucket's all-reduce failed".into(),
                    ));
                }
            }
            Ok(())
        });
        match (failed, pass) {
            (Some(e), _) => Err(e),
            (None, Err(e)) => Err(e.into()),
            (None, Ok(())) => Ok(metrics),
        }
    }
}
