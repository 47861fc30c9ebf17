//! Gradient accumulation on the CUDA executor ([`TrainConfig::accum`](crate::TrainConfig::accum)):
//! a micro-batch before the step's last (steps 1–6 of the module table in `trainer/src/cuda.rs`,
//! then amp's `accumulate`, eager or from its graphs), and the metrics log's per-micro-batch
//! entries as per-step ones.

use super::{amp_error, driver, CudaTrainer, GraphState, TrainError};
use cudnn_cbr::amp::range::HeadMetrics;

impl CudaTrainer {
    /// With gradient accumulation, ends a micro-batch before the step's last: amp's
    /// `accumulate` from its graph when one was captured (`graph`), else eager.
    ///
    /// # Errors
    /// [`TrainError::Config`] when `graph` is asked without a captured accumulate graph.
    pub(super) fn accumulate(&mut self, graph: bool) -> Result<(), TrainError> {
        if graph {
            let g = self.accumulate_graph.as_ref().ok_or_else(|| {
                TrainError::Config("no accumulate graph has been captured".into())
            })?;
            self.step.replay(g).map_err(amp_error)
        } else {
            self.step.accumulate().map_err(amp_error)
        }
    }

    /// One micro-batch of a step with gradient accumulation ([`crate::TrainConfig::accum`]) on the
    /// uploaded batch: the step's `last` one is [`CudaTrainer::step`]; an earlier one runs
    /// steps 1–6 and amp's `accumulate`, as [`CudaTrainer::graph_state`] says (from the
    /// micro-batch graph, or eager 1–6 then the accumulate graph or eager accumulate).
    ///
    /// # Errors
    /// As [`CudaTrainer::step`].
    pub fn micro_step(&mut self, last: bool) -> Result<(), TrainError> {
        if last {
            return self.step();
        }
        match self.state {
            GraphState::Step => match &self.micro_graph {
                Some(g) => g
                    .launch()
                    .map_err(|e| driver("launch the micro-batch graph", e)),
                None => Err(TrainError::Config("no micro-batch graph".into())),
            },
            GraphState::Finish { .. } => {
                self.forward_backward()?;
                self.accumulate(true)
            }
            GraphState::Eager => {
                self.forward_backward()?;
                self.accumulate(false)
            }
        }
    }
}

/// One entry per optimizer step from a metrics log's per-micro-batch entries: each group of
/// `accum` entries' mean loss and accuracy (a trailing partial group is dropped; with one
/// micro-batch per step, the entries as they are).
pub(super) fn per_step(entries: &[HeadMetrics], accum: usize) -> Vec<HeadMetrics> {
    entries
        .chunks_exact(accum.max(1))
        .map(crate::mean_metrics)
        .collect()
}
