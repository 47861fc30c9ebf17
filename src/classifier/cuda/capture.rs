//! The engine's own steps on the resident batch, eager or replayed: the capture of step 7 as
//! amp's op-list graph, or of steps 1–7 (and, with gradient accumulation, a micro-batch's
//! 1–6 and `accumulate`) into CUDA graphs, with the fallback and its reason.

use super::{driver, CudaClassifier, Result};
use crate::amp::cuda::{CaptureMode, CudaStepGraph, GraphInstantiateFlags};
use crate::amp::step::StepGraph;
use crate::classifier::ClassifierError;
use crate::classifier::StepSync;
use cudarc::driver::CudaGraph;
use std::fmt;
use std::str::FromStr;

/// Eager steps before the capture (cuDNN's lazy loading, the workspace pool and the first
/// launches of every kernel happen in them).
pub const WARMUP_STEPS: usize = 3;

/// What [`CudaClassifier::capture`] captures into CUDA graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaGraphMode {
    /// Every step eager.
    Off,
    /// The amp step's `finish` op list (cast, check, SGD, loss-scale update) as one graph.
    Finish,
    /// The whole step (zero grads, forward, head, backward, finish) as one graph; when that
    /// capture fails, the `finish` graph, and [`GraphState::Finish`] says why.
    #[default]
    Step,
}

impl FromStr for CudaGraphMode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "off" => Ok(CudaGraphMode::Off),
            "finish" => Ok(CudaGraphMode::Finish),
            "step" => Ok(CudaGraphMode::Step),
            other => Err(format!(
                "CUDA graph mode must be off, finish or step, got `{other}`"
            )),
        }
    }
}

/// Which graph a [`CudaClassifier`]'s steps replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GraphState {
    /// None: every step eager.
    Eager,
    /// The `finish` op list; the rest of the step eager. `why` says why not the whole step
    /// (`None` when only this was asked for).
    Finish {
        /// Why the whole-step capture was not used.
        why: Option<String>,
    },
    /// The whole step.
    Step,
}

impl fmt::Display for GraphState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphState::Eager => write!(f, "every step eager"),
            GraphState::Finish { why: None } => {
                write!(f, "amp finish op list replayed as a CUDA graph")
            }
            GraphState::Finish { why: Some(why) } => write!(
                f,
                "amp finish op list replayed as a CUDA graph (whole-step capture failed: {why})"
            ),
            GraphState::Step => write!(f, "whole step replayed as one CUDA graph"),
        }
    }
}

/// The captured graphs and which of them the steps replay.
pub(super) struct Graphs {
    pub(super) state: GraphState,
    finish: Option<StepGraph<CudaStepGraph>>,
    step: Option<CudaGraph>,
    /// With gradient accumulation: amp's `accumulate` op list as a graph, and steps 1–6 with
    /// it as one graph (a micro-batch before the step's last).
    accumulate: Option<StepGraph<CudaStepGraph>>,
    micro: Option<CudaGraph>,
}

impl Default for Graphs {
    fn default() -> Self {
        Graphs {
            state: GraphState::Eager,
            finish: None,
            step: None,
            accumulate: None,
            micro: None,
        }
    }
}

fn not_captured(what: &str) -> ClassifierError {
    ClassifierError::Config(format!("no {what} has been captured"))
}

impl CudaClassifier {
    /// The graph the steps replay now.
    pub fn graph_state(&self) -> &GraphState {
        &self.backend.graphs.state
    }

    /// Step 7: the amp finish, from its graph when one was captured (`graph`), else eager
    /// (in a group: after the gradient buckets' sums, sharing the overflow flag).
    ///
    /// # Errors
    /// [`ClassifierError::Config`] when `graph` is asked without a captured finish graph; an
    /// amp, driver or NCCL error.
    pub fn run_finish(&mut self, graph: bool) -> Result<()> {
        if graph {
            let g = self
                .backend
                .graphs
                .finish
                .as_ref()
                .ok_or_else(|| not_captured("finish graph"))?;
            Ok(self.step.replay(g)?)
        } else if let Some(g) = self.backend.group.as_mut() {
            // The buckets' sums were enqueued during backward: the step waits for them.
            g.sync.join(self.step.executor_mut())?;
            self.step.finish_with(|r| g.sync.share_overflow(r))?;
            g.mark_step(&self.backend.stream)
        } else {
            Ok(self.step.finish()?)
        }
    }

    /// With gradient accumulation, ends a micro-batch before the step's last: amp's
    /// `accumulate` from its graph when one was captured (`graph`), else eager. In a group
    /// (whose steps stay eager) the micro-batch's bucket sums were enqueued during backward:
    /// the regions' stream joins them first, as before the step's finish, so that the sums
    /// of one micro-batch are done before the next one's backward writes G16 again.
    ///
    /// # Errors
    /// [`ClassifierError::Config`] when `graph` is asked without a captured accumulate graph.
    pub fn run_accumulate(&mut self, graph: bool) -> Result<()> {
        if graph {
            let g = self
                .backend
                .graphs
                .accumulate
                .as_ref()
                .ok_or_else(|| not_captured("accumulate graph"))?;
            Ok(self.step.replay(g)?)
        } else {
            if let Some(g) = self.backend.group.as_mut() {
                g.sync.join(self.step.executor_mut())?;
            }
            Ok(self.step.accumulate()?)
        }
    }

    /// One training step on the resident batch, as [`CudaClassifier::graph_state`] says: the
    /// whole-step graph, or eager steps 1–6 then the finish graph or eager finish.
    ///
    /// # Errors
    /// A driver, cuDNN or amp error.
    pub fn run_step(&mut self) -> Result<()> {
        match self.backend.graphs.state {
            GraphState::Step => match &self.backend.graphs.step {
                Some(g) => g.launch().map_err(|e| driver("launch the step graph", e)),
                None => Err(not_captured("step graph")),
            },
            GraphState::Finish { .. } => {
                self.run_forward_backward()?;
                self.run_finish(true)
            }
            GraphState::Eager => {
                self.run_forward_backward()?;
                self.run_finish(false)
            }
        }
    }

    /// One eager step, whatever graphs exist (the reference a replay is compared with).
    ///
    /// # Errors
    /// As [`CudaClassifier::run_step`].
    pub fn run_step_eager(&mut self) -> Result<()> {
        self.run_forward_backward()?;
        self.run_finish(false)
    }

    /// One micro-batch of a step with gradient accumulation on the resident batch: the step's
    /// `last` one is [`CudaClassifier::run_step`]; an earlier one runs steps 1–6 and amp's
    /// `accumulate`, as [`CudaClassifier::graph_state`] says (from the micro-batch graph, or
    /// eager 1–6 then the accumulate graph or eager accumulate).
    ///
    /// # Errors
    /// As [`CudaClassifier::run_step`].
    pub fn run_micro_step(&mut self, last: bool) -> Result<()> {
        if last {
            return self.run_step();
        }
        match self.backend.graphs.state {
            GraphState::Step => match &self.backend.graphs.micro {
                Some(g) => g
                    .launch()
                    .map_err(|e| driver("launch the micro-batch graph", e)),
                None => Err(not_captured("micro-batch graph")),
            },
            GraphState::Finish { .. } => {
                self.run_forward_backward()?;
                self.run_accumulate(true)
            }
            GraphState::Eager => {
                self.run_forward_backward()?;
                self.run_accumulate(false)
            }
        }
    }

    /// Captures the step by `mode` (module docs), without running anything; afterwards
    /// [`CudaClassifier::run_step`] replays. Run a few eager steps first ([`WARMUP_STEPS`]).
    /// A group's steps stay eager.
    ///
    /// # Errors
    /// A failure to capture the finish op list; a failed whole-step capture is not an error
    /// (the state falls back to the finish graph and records why).
    pub fn capture(&mut self, mode: CudaGraphMode) -> Result<()> {
        if mode == CudaGraphMode::Off || self.backend.group.is_some() {
            self.backend.graphs.state = GraphState::Eager;
            return Ok(());
        }
        if self.backend.graphs.finish.is_none() {
            self.backend.graphs.finish = Some(self.step.capture_finish()?);
        }
        let accumulates = self.step.config().accum > 1;
        if accumulates && self.backend.graphs.accumulate.is_none() {
            self.backend.graphs.accumulate = Some(self.step.capture_accumulate()?);
        }
        self.backend.graphs.state = GraphState::Finish { why: None };
        if mode == CudaGraphMode::Step {
            // The micro-batch graph (steps 1–6 and accumulate) where the step accumulates.
            let micro = match accumulates {
                true => self.capture_step(false).map(Some),
                false => Ok(None),
            };
            match micro.and_then(|m| Ok((m, self.capture_step(true)?))) {
                Ok((micro, g)) => {
                    self.backend.graphs.micro = micro;
                    self.backend.graphs.step = Some(g);
                    self.backend.graphs.state = GraphState::Step;
                }
                Err(e) => self.backend.graphs.state = GraphState::Finish { why: Some(e) },
            }
        }
        Ok(())
    }

    /// Stream capture of steps 1–7 (`last`), or of steps 1–6 and amp's `accumulate` (a
    /// micro-batch before a step's last, with gradient accumulation), the amp ops launched
    /// eagerly inside (a graph launch inside a capture is avoided). Always ends the capture;
    /// the error says what failed.
    fn capture_step(&mut self, last: bool) -> std::result::Result<CudaGraph, String> {
        self.backend
            .stream
            .begin_capture(CaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("begin stream capture: {e}"))?;
        let body = match last {
            true => self.run_step_eager(),
            false => self
                .run_forward_backward()
                .and_then(|()| self.run_accumulate(false)),
        };
        // Always end the capture, so the stream is usable again whatever happened.
        let ended = self.backend.stream.end_capture(GraphInstantiateFlags(0));
        body.map_err(|e| format!("while capturing: {e}"))?;
        let graph = ended
            .map_err(|e| format!("end capture and instantiate: {e}"))?
            .ok_or_else(|| "the capture produced no graph".to_string())?;
        graph
            .upload()
            .map_err(|e| format!("upload the graph: {e}"))?;
        Ok(graph)
    }
}
