//! [`CpuBackend`] and [`CpuClassifier`]: a compiled network on the CPU reference executor (FP16
//! storage, FP32 arithmetic), the head on netops' CPU twins of the CUDA head kernels, the amp
//! step on [`CpuRegions`]; and the CPU-only calls (synchronized BN, the training-mode logits,
//! the evaluation counts).

use super::backend::{Backend, BucketReduce};
use super::shared::{step_plan, Classifier};
use super::{Accuracies, ClassifierError, EvalWeights};
use crate::amp::plan::Bucket;
use crate::amp::plan::Region;
use crate::amp::range::softmax_xent_backward;
use crate::amp::step::{CpuRegions, StepConfig};
use crate::fusion::cbr::Pass;
#[cfg(doc)]
use crate::net::initial_weights;
use crate::net::layer_params::LayerParam;
use crate::net::{Arena, CompiledNet, CpuNet, GradSchedule};
use crate::netops::head::{self, HeadMetrics, HeadShape};

/// Copies layer `name`'s gradients of `params` from the network's buffers into the regions
/// (G16 for the weight, G for the BN parameters).
fn copy_grads(
    net: &CpuNet<f16>,
    regions: &mut CpuRegions,
    name: &str,
    params: &[LayerParam],
) -> Result<()> {
    for &p in params {
        let (grad, slot) = (p.grad_name(name), p.name(name));
        match p {
            LayerParam::Weight => regions
                .param_f16_mut(&slot, p.grad_region())?
                .copy_from_slice(net.half(&grad)?),
            LayerParam::Gamma | LayerParam::Beta => regions
                .param_f32_mut(&slot, p.grad_region())?
                .copy_from_slice(net.float(&grad)?),
        }
    }
    Ok(())
}
use half::f16;

type Result<T> = std::result::Result<T, ClassifierError>;

/// The CPU backend: the network on the reference executor ([`CpuNet`]), the head on amp's CPU
/// twins of the CUDA head kernels, the amp step on [`CpuRegions`].
#[derive(Debug)]
pub struct CpuBackend {
    net: CpuNet<f16>,
    layers: Vec<String>,
    shape: HeadShape,
    /// The batch's labels ([`Backend::load_labels`]).
    labels: Vec<i32>,
    /// The last forward's pooled features (FP32) and logits (FP16).
    pooled: Vec<f32>,
    logits: Vec<f16>,
    /// The head's gradient into the network's output, taken by the backward pass.
    d_out: Vec<f16>,
}

/// A classifier on the CPU executor.
pub type CpuClassifier = Classifier<CpuBackend>;

/// The (FP16, FP32) regions `weights` reads: (A, W) or (E16, E).
fn regions_of(regions: &CpuRegions, weights: EvalWeights) -> Result<(Region, Region)> {
    match weights {
        EvalWeights::Trained => Ok((Region::A, Region::W)),
        EvalWeights::Ema if regions.plan_arc().has_region(Region::E) => {
            Ok((Region::E16, Region::E))
        }
        EvalWeights::Ema => Err(ClassifierError::Input(
            "the EMA weights were asked for, but the step keeps no EMA (StepConfig::with_ema)"
                .into(),
        )),
    }
}

impl CpuBackend {
    /// Conv weights from the FP16 region (A, or E16), BN parameters from the FP32 one (W, or
    /// E) into the layers' buffers: the reference executor holds its parameters itself.
    fn load_weights(&mut self, regions: &CpuRegions, weights: EvalWeights) -> Result<()> {
        let (half, float) = regions_of(regions, weights)?;
        for name in &self.layers {
            for p in LayerParam::ALL {
                let key = p.name(name);
                match p {
                    LayerParam::Weight => self
                        .net
                        .set_half(&key, regions.param_f16(&key, half)?.to_vec())?,
                    LayerParam::Gamma | LayerParam::Beta => self
                        .net
                        .set_float(&key, regions.param_f32(&key, float)?.to_vec())?,
                }
            }
        }
        Ok(())
    }

    /// Pooling and FC of the network's output with the FC parameters of `weights`: the
    /// pooled features and the logits.
    fn pool_fc(&self, regions: &CpuRegions, weights: EvalWeights) -> Result<(Vec<f32>, Vec<f16>)> {
        let mut pooled = vec![0f32; self.shape.pooled_elems()];
        head::gap_forward(&self.shape, self.net.output(), &mut pooled)?;
        let mut logits = vec![f16::ZERO; self.shape.logits_elems()];
        let (_, float) = regions_of(regions, weights)?;
        head::fc_forward(
            &self.shape,
            &pooled,
            regions.param_f32("fc.w", float)?,
            regions.param_f32("fc.b", float)?,
            &mut logits,
        )?;
        Ok((pooled, logits))
    }
}

impl Backend for CpuBackend {
    type Regions = CpuRegions;
    type Exec<'a> = &'a mut CpuNet<f16>;
    type NetError = crate::fusion::Error;
    type Images<'a> = &'a [f16];
    type Metrics = HeadMetrics;

    fn compiled(&self) -> &CompiledNet {
        self.net.net()
    }

    fn images_len(images: &&[f16]) -> usize {
        images.len()
    }

    fn reborrow<'s>(images: &'s mut &[f16]) -> &'s [f16] {
        images
    }

    fn write_master(regions: &mut CpuRegions, name: &str, values: &[f32]) -> Result<()> {
        regions
            .param_f32_mut(name, Region::W)?
            .copy_from_slice(values);
        Ok(())
    }

    fn region_bytes(regions: &CpuRegions, region: Region) -> Result<Vec<u8>> {
        Ok(regions.region_bytes(region)?)
    }

    fn load_region_bytes(regions: &mut CpuRegions, region: Region, bytes: &[u8]) -> Result<()> {
        Ok(regions.load_region_bytes(region, bytes)?)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn load_labels(&mut self, labels: &[i32]) -> Result<()> {
        self.labels.clear();
        self.labels.extend_from_slice(labels);
        Ok(())
    }

    /// The parameters of `weights` and the batch are copied into the reference executor's
    /// buffers (it holds them itself); a backward pass takes the head's output gradient.
    fn begin_pass<'a>(
        &'a mut self,
        regions: &'a mut CpuRegions,
        images: &'a [f16],
        pass: Pass,
        weights: EvalWeights,
    ) -> Result<&'a mut CpuNet<f16>> {
        match pass {
            Pass::Forward | Pass::Eval => {
                self.load_weights(regions, weights)?;
                self.net.set_input(images)?;
            }
            Pass::Backward => self.net.set_output_grad(std::mem::take(&mut self.d_out))?,
        }
        Ok(&mut self.net)
    }

    fn end_pass(&mut self, regions: &mut CpuRegions, pass: Pass) -> Result<()> {
        if pass == Pass::Backward {
            for name in &self.layers {
                copy_grads(&self.net, regions, name, &LayerParam::ALL)?;
            }
        }
        Ok(())
    }

    /// The reference executor's backward with each bucket's gradients copied from its
    /// buffers into the regions as the pass makes them final, then handed to `reduce`.
    fn backward_reduced(
        &mut self,
        regions: &mut CpuRegions,
        _images: &[f16],
        schedule: &GradSchedule,
        reduce: &mut BucketReduce<'_, CpuRegions>,
    ) -> Result<()> {
        if schedule.after.len() != self.net.net().backward.len() {
            return Err(ClassifierError::Input(format!(
                "the gradient schedule has {} backward steps, the network {}",
                schedule.after.len(),
                self.net.net().backward.len()
            )));
        }
        let da = std::mem::take(&mut self.d_out);
        let plan = regions.plan_arc().clone();
        let layers = &self.layers;
        // The bucket's network gradients into the regions, then its sum.
        let mut release = |net: &CpuNet<f16>, regions: &mut CpuRegions, bucket: Bucket| {
            let info = plan.buckets().get(bucket.index()).ok_or_else(|| {
                ClassifierError::Input(format!("the schedule names bucket {}", bucket.index()))
            })?;
            for p in &plan.params()[info.params()] {
                let Some((layer, key)) = p.name().rsplit_once('.') else {
                    continue;
                };
                if let Some(param) = LayerParam::of_key(key) {
                    if layers.iter().any(|l| l == layer) {
                        copy_grads(net, regions, layer, &[param])?;
                    }
                }
            }
            reduce(regions, bucket)
        };
        for &b in &schedule.before {
            release(&self.net, regions, b)?;
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
            (None, pass) => Ok(pass?),
        }
    }

    fn head_forward(&mut self, regions: &mut CpuRegions) -> Result<()> {
        (self.pooled, self.logits) = self.pool_fc(regions, EvalWeights::Trained)?;
        Ok(())
    }

    fn head_backward(&mut self, regions: &mut CpuRegions) -> Result<HeadMetrics> {
        let (batch, classes) = (self.shape.batch, self.shape.classes);
        let (logits, labels) = (&self.logits, &self.labels);
        // The scaled loss gradient: scale / batch · (softmax − onehot), FP16.
        let scalars = regions.scalars();
        let mut dlogits = vec![f16::ZERO; logits.len()];
        let mut rows = vec![0f32; batch];
        softmax_xent_backward(
            logits,
            labels,
            classes,
            &scalars,
            &mut dlogits,
            Some(&mut rows),
        )?;
        let metrics = head::head_metrics(logits, labels, Some(&rows), classes)?;
        let mut dw = vec![0f32; self.shape.weight_elems()];
        let mut db = vec![0f32; classes];
        let mut dpooled = vec![0f32; self.pooled.len()];
        let w = regions.param_f32("fc.w", Region::W)?;
        head::fc_backward(
            &self.shape,
            &dlogits,
            &self.pooled,
            w,
            &mut dw,
            &mut db,
            &mut dpooled,
        )?;
        regions
            .param_f32_mut("fc.w", Region::G)?
            .copy_from_slice(&dw);
        regions
            .param_f32_mut("fc.b", Region::G)?
            .copy_from_slice(&db);
        let mut da = vec![f16::ZERO; self.shape.activation_elems()];
        head::gap_backward(&self.shape, &dpooled, &mut da)?;
        self.d_out = da;
        Ok(metrics)
    }

    fn eval_logits(
        &mut self,
        regions: &mut CpuRegions,
        images: &[f16],
        weights: EvalWeights,
    ) -> Result<Vec<f16>> {
        self.network_pass(regions, images, Pass::Eval, weights)?;
        Ok(self.pool_fc(regions, weights)?.1)
    }

    fn read_running_stat(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.net.float(name)?.to_vec())
    }

    fn write_running_stat(&mut self, name: &str, values: Vec<f32>) -> Result<()> {
        Ok(self.net.set_float(name, values)?)
    }
}

impl Classifier<CpuBackend> {
    /// The network (compiled with a CPU policy, e.g. `RoutePolicy::Uniform`) with an FC head
    /// of `classes` outputs, its memory plan on the host, and the amp step of `config`; the
    /// master weights start from [`initial_weights`] of `seed`. A `config` with an EMA
    /// ([`StepConfig::with_ema`]) gets a plan with the EMA regions E and E16; one that
    /// accumulates gradients over several micro-batches ([`StepConfig::with_accum`]) gets the
    /// accumulator GA ([`Classifier::train_step`]).
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
        let regions = CpuRegions::new(step_plan(&net, classes, &config, false)?)?;
        let (step, ()) = Self::amp_step(&net, classes, config, seed, regions, |_| Ok(()))?;
        let shape = HeadShape::new(net.batch, net.out_hw * net.out_hw, net.features, classes);
        let layers = net.layers.iter().map(|l| l.name.clone()).collect();
        let backend = CpuBackend {
            net: CpuNet::with_arena(net, arena)?,
            layers,
            shape,
            labels: Vec::new(),
            pooled: Vec::new(),
            logits: Vec::new(),
            d_out: Vec::new(),
        };
        Ok(Self::assemble(backend, step, classes))
    }

    /// The compiled network.
    pub fn net(&self) -> &CompiledNet {
        self.backend.net.net()
    }

    /// Synchronized BN for a data-parallel replica (see [`crate::dist::CpuReplica`], which
    /// sets it up): [`CpuNet::set_bn_sync`].
    pub fn set_bn_sync(&mut self, sync: Box<dyn crate::fusion::cbr::BnSync<f32> + Send>) {
        self.backend.net.set_bn_sync(sync);
    }

    /// Evaluates `batches` (NHWC FP16 images, labels) with [`Classifier::evaluate`], one batch
    /// at a time: the fraction of all their images whose top-1 class is their label, with the
    /// trained weights and, where the step keeps an EMA, with the EMA weights (the CPU twin of
    /// [`super::CudaClassifier::evaluate_batches`]). Weights, running statistics and the
    /// step are left as they were.
    ///
    /// # Errors
    /// As [`Classifier::evaluate`].
    pub fn evaluate_batches(&mut self, batches: &[(Vec<f16>, Vec<i32>)]) -> Result<Accuracies> {
        let (correct, images) = self.correct_top1(batches)?;
        let correct = [correct[0] as f32, correct[1] as f32];
        let ema = self.step.config().ema_decay.is_some();
        Ok(Accuracies::from_counts(correct, images as f32, ema))
    }

    /// The correct top-1 predictions over `batches` with the trained weights, then (0 without
    /// an EMA) with the EMA weights, and the number of images evaluated: what
    /// [`CpuClassifier::evaluate_batches`] divides, and a data-parallel replica sums over its
    /// group first.
    pub(crate) fn correct_top1(
        &mut self,
        batches: &[(Vec<f16>, Vec<i32>)],
    ) -> Result<([usize; 2], usize)> {
        let mut weights = vec![EvalWeights::Trained];
        if self.step.config().ema_decay.is_some() {
            weights.push(EvalWeights::Ema);
        }
        let mut correct = [0usize; 2];
        for (c, &w) in correct.iter_mut().zip(&weights) {
            for (images, labels) in batches {
                *c += self.evaluate(images, w)?.correct(labels);
            }
        }
        Ok((correct, batches.len() * self.shape.batch))
    }

    /// The logits of `images` (NHWC FP16, one batch) with the current weights, BN in training
    /// mode (the batch's statistics, and the running statistics updated);
    /// [`Classifier::evaluate`] is the evaluation-mode forward.
    ///
    /// # Errors
    /// [`ClassifierError::Input`] for a batch of the wrong size.
    pub fn logits(&mut self, images: &[f16]) -> Result<Vec<f16>> {
        self.check(images.len(), &vec![0; self.shape.batch])?;
        let regions = self.step.executor_mut();
        let trained = EvalWeights::Trained;
        self.backend
            .network_pass(regions, images, Pass::Forward, trained)?;
        self.backend.head_forward(regions)?;
        Ok(self.backend.logits.clone())
    }
}
