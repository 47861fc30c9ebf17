//! What every executor's training loop does around its steps, written once: a run's
//! [`Bookkeeping`] (the steps after which an epoch of the training data ends and the test set
//! is evaluated, the steps after which a checkpoint is saved, the throughput, the held-out
//! evaluation with the trained and EMA weights, the report's assembly), reached through one
//! interface the executors' models serve ([`RunModel`], [`Checkpointed`]: the library
//! classifiers' `evaluate_batches` on both backends); and, for the CPU executors, whose
//! metrics are on the host after every step, the curve and the progress window
//! ([`HostMetrics`]). An executor's own file keeps what differs: how a step runs and how its
//! metrics arrive.

use crate::checkpoint::{self, TrainState};
use crate::curves::CurvePoint;
use crate::data::{self, Dataset};
use crate::{
    EpochEval, ExecutorInfo, MasterWeights, Progress, Session, StepTrace, TrainConfig, TrainError,
    TrainReport,
};
use cudnn_cbr::amp::range::Scalars;
use cudnn_cbr::amp::step::{AmpStep, CpuRegions};
use cudnn_cbr::classifier::Accuracies;
use cudnn_cbr::netops::head::HeadMetrics;
use std::sync::Arc;
use std::time::Instant;

/// Held-out batches evaluated after training.
pub(crate) const HELD_OUT_BATCHES: u64 = 8;

pub(crate) use crate::data::Batch;

/// What the bookkeeping asks of an executor's model after training.
pub(crate) trait RunModel {
    /// The group's accuracies over this rank's shards of `batches`, with the trained and
    /// (with an EMA) the EMA weights, BN in evaluation mode: the library classifier's
    /// `evaluate_batches`.
    fn evaluate(&mut self, batches: &[Batch]) -> Result<Accuracies, TrainError>;

    /// The final FP32 master weights (region W; on a device, downloaded).
    fn weights(&self) -> Result<MasterWeights, TrainError>;
}

/// A model whose run saves checkpoints (one rank).
pub(crate) trait Checkpointed: RunModel {
    /// The state a checkpoint saves and its `routes` metadata (on a device, blocking).
    fn checkpoint(&self) -> Result<(TrainState, String), TrainError>;
}

/// Images per second since a run's start.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    start: Instant,
    images_per_step: usize,
}

impl Clock {
    /// The throughput after `done` steps of this run.
    pub(crate) fn images_per_sec(&self, done: usize) -> f64 {
        (done * self.images_per_step) as f64 / self.start.elapsed().as_secs_f64()
    }
}

/// One run's bookkeeping on one rank (module docs). Its clock starts when it is made.
pub(crate) struct Bookkeeping<'s> {
    cfg: TrainConfig,
    session: &'s Session,
    data: Arc<dyn Dataset>,
    /// This rank and the group's size: held-out and test batches are global batches of
    /// `world × batch` images, this rank evaluating its shard.
    rank: usize,
    world: usize,
    /// The steps (1-based) after which an epoch of the training data ends.
    ends: Vec<usize>,
    epochs: Vec<EpochEval>,
    clock: Clock,
}

impl<'s> Bookkeeping<'s> {
    /// The bookkeeping of `cfg`'s run from `session` on rank `rank` of `world`, whose steps
    /// train on `world × batch × accum` images of `data`.
    pub(crate) fn new(
        cfg: &TrainConfig,
        session: &'s Session,
        data: Arc<dyn Dataset>,
        (rank, world): (usize, usize),
    ) -> Self {
        let images_per_step = cfg.batch * world * cfg.accum.max(1);
        let ends = data
            .train_len()
            .map(|n| data::epoch_ends(n, images_per_step, cfg.steps))
            .unwrap_or_default();
        Bookkeeping {
            cfg: *cfg,
            session,
            data,
            rank,
            world,
            ends,
            epochs: Vec::new(),
            clock: Clock {
                start: Instant::now(),
                images_per_step,
            },
        }
    }

    /// Steps done before this run (from a checkpoint).
    pub(crate) fn first(&self) -> usize {
        self.session.start
    }

    /// The run's clock.
    pub(crate) fn clock(&self) -> Clock {
        self.clock
    }

    /// This rank's shard of a global batch ([`shard`]).
    ///
    /// # Errors
    /// As [`shard`].
    pub(crate) fn shard(&self, global: Batch) -> Result<Batch, TrainError> {
        shard(global, self.cfg.batch, (self.rank, self.world))
    }

    /// After step `step` (1-based, counted from the start of training): the checkpoint when
    /// one is due (rank 0's, for the group: every rank holds the same weights), then the
    /// whole test set when an epoch ended there.
    pub(crate) fn after_step(
        &mut self,
        step: usize,
        model: &mut impl Checkpointed,
    ) -> Result<(), TrainError> {
        self.save(step, model)?;
        self.evaluate_epoch(step, model)
    }

    /// The checkpoint after step `step` when one is due, written by rank 0.
    pub(crate) fn save(&self, step: usize, model: &impl Checkpointed) -> Result<(), TrainError> {
        if let Some(path) = self.session.saves_after(step, self.cfg.steps) {
            if self.rank == 0 {
                let (state, routes) = model.checkpoint()?;
                let (cfg, world) = (&self.cfg, self.world);
                checkpoint::save_in_group(path, cfg, &state, step as u64, &routes, world)?;
            }
        }
        Ok(())
    }

    /// After step `step` (1-based): the whole test set when an epoch of the training data
    /// ended there (every rank of a group calls it; the accuracies are the group's).
    pub(crate) fn evaluate_epoch(
        &mut self,
        step: usize,
        model: &mut impl RunModel,
    ) -> Result<(), TrainError> {
        if let Some(e) = self.ends.iter().position(|&s| s == step) {
            if let Some(acc) = self.test_set(model)? {
                self.epochs.push(EpochEval {
                    epoch: e + 1,
                    step,
                    accuracy: acc.trained,
                    ema_accuracy: acc.ema,
                });
            }
        }
        Ok(())
    }

    /// The whole test set, where the data has a finite one (the last batch wraps around to
    /// its first images), BN in evaluation mode: the group's accuracies (every rank calls it).
    pub(crate) fn test_set(
        &self,
        model: &mut impl RunModel,
    ) -> Result<Option<Accuracies>, TrainError> {
        let Some(len) = self.data.held_out_len() else {
            return Ok(None);
        };
        let batches = self.eval_batches(data::test_batches(len, self.cfg.batch * self.world))?;
        model.evaluate(&batches).map(Some)
    }

    /// [`crate::Trainer::evaluate`]: the held-out batches and the test set.
    pub(crate) fn evaluation(
        &self,
        model: &mut impl RunModel,
    ) -> Result<crate::Evaluation, TrainError> {
        let held = self.held_out(model)?;
        let test = self.test_set(model)?;
        Ok(crate::Evaluation {
            held_out_accuracy: held.trained,
            held_out_ema_accuracy: held.ema,
            test_set: test.map(|a| (a.trained, a.ema)),
        })
    }

    /// The held-out batches after training, BN in evaluation mode (running statistics;
    /// weights and statistics are not touched), with the trained weights and, with an EMA,
    /// the EMA weights: the group's accuracies (every rank calls it).
    pub(crate) fn held_out(&self, model: &mut impl RunModel) -> Result<Accuracies, TrainError> {
        model.evaluate(&self.eval_batches(HELD_OUT_BATCHES)?)
    }

    /// This rank's shards of the first `n` held-out batches.
    fn eval_batches(&self, n: u64) -> Result<Vec<Batch>, TrainError> {
        let global = self.cfg.batch * self.world;
        (0..n)
            .map(|i| self.shard(self.data.held_out_batch(global, i)))
            .collect()
    }

    /// The report of the finished run, with `model`'s final master weights.
    pub(crate) fn report(
        self,
        model: &impl RunModel,
        run: Finished,
    ) -> Result<TrainReport, TrainError> {
        let weights = model.weights()?;
        let (first_loss, last_loss, last_accuracy, step_losses) = summarize(&run.metrics);
        Ok(TrainReport {
            first_loss,
            last_loss,
            last_accuracy,
            held_out_accuracy: run.held_out.trained,
            held_out_eval_mode: run.held_out.eval_mode,
            held_out_ema_accuracy: run.held_out.ema,
            skipped: run.scalars.skipped,
            loss_scale: run.scalars.loss_scale,
            images_per_sec: run.images_per_sec,
            step_losses,
            weights,
            executor: run.executor,
            trace: run.trace,
            start_step: self.session.start,
            curve: run.curve,
            epochs: self.epochs,
        })
    }
}

/// Rank `rank`'s shard of a global batch of `world × batch` images: images
/// `rank·batch .. (rank + 1)·batch` (the batch itself on one rank).
///
/// # Errors
/// [`TrainError::Config`] when the global batch does not hold `world × batch` labels and as
/// many equal images (a dataset that made the wrong size), instead of a slice out of range.
pub(crate) fn shard(
    (images, labels): Batch,
    batch: usize,
    (rank, world): (usize, usize),
) -> Result<Batch, TrainError> {
    if world == 1 {
        return Ok((images, labels));
    }
    let global = batch.checked_mul(world);
    let per = images.len() / labels.len().max(1);
    if global != Some(labels.len()) || per * labels.len() != images.len() || rank >= world {
        return Err(TrainError::Config(format!(
            "rank {rank} of {world}: a global batch of {} labels and {} image values cannot be \
             cut into shards of {batch} images",
            labels.len(),
            images.len()
        )));
    }
    Ok((
        images[rank * batch * per..(rank + 1) * batch * per].to_vec(),
        labels[rank * batch..(rank + 1) * batch].to_vec(),
    ))
}

/// What an executor hands [`Bookkeeping::report`] at the end of its run.
pub(crate) struct Finished {
    /// Each step's loss and accuracy (the global batch's), in order.
    pub(crate) metrics: Vec<HeadMetrics>,
    /// [`Bookkeeping::held_out`].
    pub(crate) held_out: Accuracies,
    /// S after the last step (loss scale, skip count).
    pub(crate) scalars: Scalars,
    /// The training throughput.
    pub(crate) images_per_sec: f64,
    /// The executor that ran.
    pub(crate) executor: ExecutorInfo,
    /// A drill's per-step trace (empty otherwise).
    pub(crate) trace: Vec<StepTrace>,
    /// The curve's points.
    pub(crate) curve: Vec<CurvePoint>,
}

/// The report's loss and accuracy fields from the per-step metrics.
fn summarize(steps: &[HeadMetrics]) -> (f32, f32, f32, Vec<f32>) {
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len().max(1) as f32;
    let losses: Vec<f32> = steps.iter().map(|m| m.loss).collect();
    let accs: Vec<f32> = steps.iter().map(|m| m.accuracy).collect();
    let head = &losses[..losses.len().min(10)];
    let tail = &losses[losses.len().saturating_sub(10)..];
    (
        mean(head),
        mean(tail),
        mean(&accs[accs.len().saturating_sub(10)..]),
        losses,
    )
}

/// The per-step metrics of a CPU executor, on the host after every step: the report's list,
/// the curve and the window of the next progress line.
#[derive(Debug, Default)]
pub(crate) struct HostMetrics {
    /// Each step's loss and accuracy.
    pub(crate) metrics: Vec<HeadMetrics>,
    /// One point per step.
    pub(crate) curve: Vec<CurvePoint>,
    window: Window,
}

impl HostMetrics {
    /// Room for `steps` steps.
    pub(crate) fn with_capacity(steps: usize) -> Self {
        HostMetrics {
            metrics: Vec::with_capacity(steps),
            curve: Vec::with_capacity(steps),
            window: Window::default(),
        }
    }

    /// Records step `step`'s (1-based) metrics `m` with the scale and learning rate `amp`'s S
    /// holds after it; every `every` steps and after the last, a progress line (S read
    /// through a request and a poll, as on a device).
    pub(crate) fn record(
        &mut self,
        book: &Bookkeeping<'_>,
        step: usize,
        m: HeadMetrics,
        amp: &mut AmpStep<CpuRegions>,
        every: usize,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<(), TrainError> {
        self.metrics.push(m);
        self.window.add(m);
        let done = step - book.first();
        let s = amp.executor().scalars();
        self.curve.push(CurvePoint {
            step,
            loss: m.loss,
            accuracy: m.accuracy,
            loss_scale: s.loss_scale,
            lr: s.lr,
            images_per_sec: book.clock.images_per_sec(done),
        });
        if step.is_multiple_of(every.max(1)) || step == book.cfg.steps {
            amp.request_scalars()?;
            let s = amp.poll_scalars()?.unwrap_or_default();
            progress(&self.window.report(step, done, book.clock, s));
        }
        Ok(())
    }
}

/// Loss and accuracy of the steps since the last progress report.
#[derive(Debug, Default)]
struct Window {
    loss: f32,
    accuracy: f32,
    n: usize,
}

impl Window {
    fn add(&mut self, m: HeadMetrics) {
        self.loss += m.loss;
        self.accuracy += m.accuracy;
        self.n += 1;
    }

    /// The report after `step` steps (`done` of them in this run), with S's scale and skip
    /// count; empties the window.
    fn report(&mut self, step: usize, done: usize, clock: Clock, s: Scalars) -> Progress {
        let n = self.n.max(1) as f32;
        let p = Progress {
            step,
            loss: self.loss / n,
            accuracy: self.accuracy / n,
            loss_scale: s.loss_scale,
            skipped: s.skipped,
            images_per_sec: clock.images_per_sec(done),
        };
        *self = Window::default();
        p
    }
}

#[cfg(test)]
mod tests {
    use super::shard;
    use half::f16;

    /// A global batch of `n` images of `per` values, image `j`'s values all `j`.
    fn global(n: usize, per: usize) -> super::Batch {
        let images = (0..n * per)
            .map(|v| f16::from_f32((v / per) as f32))
            .collect();
        (images, (0..n as i32).collect())
    }

    #[test]
    fn a_shard_is_its_ranks_images_and_a_wrong_size_is_a_typed_error() {
        let (images, labels) = shard(global(6, 2), 3, (1, 2)).unwrap();
        assert_eq!(labels, [3, 4, 5]);
        assert_eq!(images.len(), 6);
        assert_eq!(images[0].to_f32(), 3.0);
        // One rank: the batch as it is.
        assert_eq!(shard(global(5, 2), 3, (0, 1)).unwrap().1.len(), 5);
        // Too few images for two ranks of 3, images not a whole number each, a rank past the
        // group, a size that overflows: each refused, none a panic.
        for (g, batch, rank) in [
            (global(5, 2), 3, (1, 2)),
            ((vec![f16::ZERO; 13], (0..6).collect()), 3, (0, 2)),
            (global(6, 2), 3, (2, 2)),
            (global(6, 2), usize::MAX, (0, 2)),
        ] {
            let e = shard(g, batch, rank).unwrap_err();
            assert!(e.to_string().contains("cannot be cut into shards"), "{e}");
        }
    }
}
