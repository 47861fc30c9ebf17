//! The CPU reference executor of the training loop: the network's CBR layers on the reference
//! ops, the head on the [`cudnn_cbr::amp::range`] twins of the CUDA head kernels, the amp step on
//! [`CpuRegions`].

use super::{
    data, mean_metrics, net::compile_net, net::cpu_policy, Bookkeeping, Checkpointed, ExecutorInfo,
    FaultDrill, Finished, HostMetrics, MasterWeights, Progress, RunModel, Session, StepTrace,
    TrainConfig, TrainError, TrainReport,
};
use crate::bookkeeping::Batch;
use crate::checkpoint::TrainState;
use cudnn_cbr::amp::plan::Region;
use cudnn_cbr::amp::step::CpuRegions;
use cudnn_cbr::amp::AmpError;
use cudnn_cbr::classifier::{Accuracies, CpuClassifier};
use cudnn_cbr::netops::head::HeadMetrics;
use half::f16;

/// The CPU executor, set up and ready to run.
#[derive(Debug)]
pub(crate) struct CpuTrainer {
    cfg: TrainConfig,
    data: std::sync::Arc<dyn data::Dataset>,
    /// The network, its head and the amp step (the library's classifier).
    model: CpuClassifier,
}

impl CpuTrainer {
    pub(crate) fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        cfg.check_host_memory(true)?;
        let data = data::open(cfg)?;
        // (The same initial weights as the CUDA executor's: `net::initial_weights` of the seed;
        // running variances start at 1, as in every framework: `CpuNet::new`.)
        let net = compile_net(cfg, &cpu_policy(cfg))?;
        let model =
            CpuClassifier::with_arena(net, cfg.classes, cfg.step_config(), cfg.seed, cfg.arena)?;
        Ok(CpuTrainer {
            cfg: *cfg,
            data,
            model,
        })
    }

    /// Restores a checkpoint's state ([`TrainState::load_into`]).
    pub(crate) fn load_state(&mut self, state: &TrainState) -> Result<(), TrainError> {
        state.load_into(&mut self.model)
    }

    /// [`crate::Trainer::evaluate`] on this executor.
    pub(crate) fn evaluate(&mut self, session: &Session) -> Result<crate::Evaluation, TrainError> {
        Bookkeeping::new(&self.cfg, session, self.data.clone(), (0, 1)).evaluation(self)
    }

    pub(crate) fn run(
        mut self,
        every: usize,
        progress: &mut dyn FnMut(&Progress),
        executor: ExecutorInfo,
        session: &Session,
    ) -> Result<TrainReport, TrainError> {
        let cfg = self.cfg;
        let mut book = Bookkeeping::new(&cfg, session, self.data.clone(), (0, 1));
        let first = book.first();
        let mut host = HostMetrics::with_capacity(cfg.steps - first);
        let (mut trace, mut skipped_before) = (Vec::new(), 0u32);
        // Step i trains on batches i·accum .. (i + 1)·accum (its micro-batches).
        let accum = cfg.accum.max(1);
        // Batches are made (and, for files, augmented) on a thread of their own while the
        // step runs; each is a pure function of its index, so the losses do not depend on it.
        let mut batches = data::Prefetch::spawn_range(
            self.data.clone(),
            cfg.batch,
            (first * accum) as u64..(cfg.steps * accum) as u64,
        );
        for i in first..cfg.steps {
            if cfg.schedules_lr() {
                self.model.step_mut().set_lr(cfg.lr_at(i))?;
            }
            let poison = cfg.drill.and_then(|d| d.poisons(i));
            let model = &mut self.model;
            let batches = &mut batches;
            // The step runs on a worker of rayon's pool, so the reference ops' parallel loops
            // start there (their tasks are pushed to that worker's deque and stolen by the
            // others) instead of each being handed over from this thread, which would sleep
            // until it is done: one hand-over per step instead of one per loop.
            let m =
                rayon::scope(|_| -> Result<HeadMetrics, TrainError> {
                    let mut each = Vec::with_capacity(accum);
                    // One micro-batch in memory at a time (the producer keeps a few ahead).
                    for k in 0..accum {
                        let (images, labels) = batches.next_shard((i * accum + k) as u64)?;
                        // The first accum − 1 micro-batches add into GA; the last one's finish
                        // adds it, then checks, updates and rescales once (amp::step). The drill
                        // poisons its micro-batch's gradients before they are added.
                        let drill = poison.filter(|&h| FaultDrill::micro_batch(h, accum) == k);
                        each.push(model.train_micro_batch(k, &images, &labels, |regions| {
                            match drill {
                                Some(h) => Ok(poison_gradient(regions, h)?),
                                None => Ok(()),
                            }
                        })?);
                    }
                    Ok(mean_metrics(&each))
                })?;
            let step = self.model.step_mut();
            if cfg.drill.is_some() {
                let s = step.executor().scalars();
                trace.push(StepTrace {
                    poisoned: poison.is_some(),
                    skipped: s.skipped > skipped_before,
                    loss_scale: s.loss_scale,
                    state_hash: state_hash(step.executor())?,
                });
                skipped_before = s.skipped;
            }
            host.record(&book, i + 1, m, step, every, progress)?;
            book.after_step(i + 1, &mut self)?;
        }
        let images_per_sec = book.clock().images_per_sec(cfg.steps - first);
        let held_out = book.held_out(&mut self)?;
        let step = self.model.step_mut();
        step.request_scalars()?;
        let scalars = step.poll_scalars()?.unwrap_or_default();
        let run = Finished {
            metrics: host.metrics,
            held_out,
            scalars,
            images_per_sec,
            executor,
            trace,
            curve: host.curve,
        };
        book.report(&self, run)
    }
}

impl RunModel for CpuTrainer {
    fn evaluate(&mut self, batches: &[Batch]) -> Result<Accuracies, TrainError> {
        Ok(self.model.evaluate_batches(batches)?)
    }

    fn weights(&self) -> Result<MasterWeights, TrainError> {
        master_weights(self.model.step().executor())
    }
}

impl Checkpointed for CpuTrainer {
    fn checkpoint(&self) -> Result<(TrainState, String), TrainError> {
        Ok((TrainState::of(&self.model)?, routes(&self.cfg)))
    }
}

/// The checkpoint's `routes` of a CPU run: the route every layer runs.
pub(crate) fn routes(cfg: &TrainConfig) -> String {
    format!(
        "cpu reference executor, {} route ops",
        if cfg.fused { "fused" } else { "unfused" }
    )
}

/// The FP32 master weights (region W) of a CPU run: what both CPU executors report.
pub(crate) fn master_weights(regions: &CpuRegions) -> Result<MasterWeights, TrainError> {
    Ok(MasterWeights::read(regions.plan_arc(), |p| {
        regions.param_f32(p.name(), Region::W).map(<[f32]>::to_vec)
    })?)
}

/// Overwrites one gradient element (chosen by `h`) with NaN, +Inf or −Inf: in G16 (the conv
/// weights' FP16 gradients) or G (the FP32 gradients of BN and FC parameters).
fn poison_gradient(regions: &mut CpuRegions, h: u64) -> Result<(), AmpError> {
    let value = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(h % 3) as usize];
    let plan = regions.plan_arc().clone();
    let params = plan.params();
    let p = &params[(h / 3) as usize % params.len()];
    let at = (h >> 32) as usize % p.elems();
    if regions.plan_arc().lives_in(p, Region::G16) {
        regions.param_f16_mut(p.name(), Region::G16)?[at] = f16::from_f32(value);
    } else {
        regions.param_f32_mut(p.name(), Region::G)?[at] = value;
    }
    Ok(())
}

/// FNV-1a over the bytes of W, M and E (those the plan has).
fn state_hash(regions: &CpuRegions) -> Result<u64, TrainError> {
    let mut h = crate::FNV_OFFSET;
    for region in [Region::W, Region::M, Region::E] {
        if !regions.plan_arc().has_region(region) {
            continue;
        }
        for byte in regions.region_bytes(region)? {
            h = (h ^ u64::from(byte)).wrapping_mul(crate::FNV_PRIME);
        }
    }
    Ok(h)
}
