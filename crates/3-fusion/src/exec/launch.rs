//! Executing a plan on a handle's stream: the workspace, the variant pack, cuDNN's execute,
//! and populating or updating a CUDA graph from a plan.
#![allow(unsafe_code)]

use super::{bind_context, driver, Bindings, Handle};
use crate::error::{Error, Result};
use crate::plan::ExecutionPlan;
use cudarc::driver::{CudaSlice, DevicePtr};
use cudnn_fe_sys as sys;

/// Workspace for one execution.
#[derive(Debug)]
pub enum Workspace<'a> {
    /// The handle's internal pool (grown on demand).
    Pooled,
    /// A caller-provided buffer.
    Buffer(&'a CudaSlice<u8>),
}

impl ExecutionPlan {
    /// Runs `enqueue` with the address of the workspace this plan needs (0 for none), holding
    /// the workspace's cudarc ordering guard until `enqueue` has returned: the guard records
    /// the workspace's use on the handle's stream when it drops, and work on other streams
    /// that later touches the buffer waits for that event, so it must be recorded after
    /// cuDNN's work is enqueued, not before ([`enqueue_holding`]).
    fn with_workspace<R>(
        &self,
        handle: &Handle,
        ws: Workspace<'_>,
        for_graph: bool,
        enqueue: impl FnOnce(u64) -> Result<R>,
    ) -> Result<R> {
        handle.ready()?;
        let need = self.workspace_size();
        match ws {
            Workspace::Pooled if need == 0 => enqueue(0),
            Workspace::Pooled => handle.with_pooled_workspace(need, for_graph, enqueue),
            Workspace::Buffer(buf) => {
                if buf.len() < need {
                    return Err(Error::WorkspaceTooSmall {
                        graph: self.graph_name().into(),
                        needed: need,
                        got: buf.len(),
                    });
                }
                let (ptr, guard) = buf.device_ptr(handle.stream());
                enqueue_holding(guard, || enqueue(ptr))
            }
        }
    }

    /// Enqueues the plan on the handle's stream. Every binding is checked first; nothing is
    /// sent to cuDNN when one is wrong.
    pub fn execute(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
        ws: Workspace<'_>,
    ) -> Result<()> {
        if handle.simulated {
            return self.with_workspace(handle, ws, false, |_| {
                self.execute_simulated(handle, bindings)
            });
        }
        self.with_workspace(handle, ws, false, |workspace| {
            let vp = bindings.variant_pack(workspace)?;
            bind_context(&handle.stream)?;
            // SAFETY: the plan and variant pack are finalized descriptors; every pointer in the
            // pack was checked non-null, aligned, of the right type and large enough; the
            // caller keeps the buffers alive until the stream reaches this work (Bindings'
            // contract), and the workspace's guard is held until this call has returned.
            unsafe {
                (handle.lib.api.cudnnBackendExecute)(handle.raw, self.descriptor().raw(), vp.raw())
            }
            .result()
            .map_err(|e| Error::cudnn(format!("execute plan `{}`", self.graph_name()), e))
        })
    }

    fn simulator_error(&self, problem: impl Into<String>) -> Error {
        Error::Simulator {
            plan: self.graph_name().into(),
            problem: problem.into(),
        }
    }

    /// The simulated device's execution: the plan's graph in the graph interpreter over the
    /// bound addresses (the simulator's allocations), in stream order. The handle's stream is
    /// synchronized first (what was enqueued before has run), then the interpreter runs on
    /// the calling thread, so its errors come back from this call.
    ///
    /// During a stream capture the execution is recorded instead, as a host node of the
    /// capture's graph that runs the interpreter over this call's variant pack at every
    /// replay, in stream order (`crate::sim::record_replay`, which documents who owns the
    /// recorded pack). A failure at replay faults the simulated context and is kept on the
    /// handle ([`Handle::replay_failure`]).
    fn execute_simulated(&self, handle: &Handle, bindings: &Bindings<'_>) -> Result<()> {
        let (pointers, scalars) = bindings.pack()?;
        let graph = self.source_graph().ok_or_else(|| {
            self.simulator_error(
                "the plan keeps no graph for the interpreter to run (plans the plan cache \
                 builds or restores keep theirs)",
            )
        })?;
        if handle.capturing()? {
            bind_context(&handle.stream)?;
            let replay = crate::sim::Replay {
                plan: self.graph_name().into(),
                graph: graph.clone(),
                pointers,
                scalars,
                fault: handle.replay_fault.clone(),
            };
            return crate::sim::record_replay(handle.stream.cu_stream(), replay).map_err(|e| {
                self.simulator_error(format!("record the execution into the capture: {e}"))
            });
        }
        let memory = crate::sim::SimMemory::new()
            .ok_or_else(|| self.simulator_error("the simulated driver no longer answers"))?;
        bind_context(&handle.stream)?;
        handle
            .stream
            .synchronize()
            .map_err(|e| driver("synchronize before a simulated plan execution", e))?;
        let pack = crate::interp::VariantPack {
            pointers: &pointers,
            scalars: &scalars,
        };
        // The simulator's allocations are host memory handed out as device pointers, live for
        // their whole length while the table lists them; the stream has just been synchronized
        // (eager mode runs work at enqueue; the adversarial mode's queues of other streams are
        // ordered through the bindings' event waits, which the synchronize ran).
        // SAFETY: every bound pointer lies in a live simulator allocation, kept alive and
        // unaliased by the caller until the stream reaches this work (Bindings' contract), and
        // no enqueued work touches it while the interpreter runs (synchronized above).
        unsafe { crate::interp::execute(graph, &pack, &memory, &crate::interp::Options::default()) }
            .map_err(|e| self.simulator_error(e.to_string()))
    }

    fn require_cuda_graph_api(&self) -> Result<()> {
        if self.supports_cuda_graph_api() {
            return Ok(());
        }
        Err(Error::CudnnMessage(format!(
            "plan `{}` ({}) does not support cuDNN's CUDA-graph API; capture its stream instead",
            self.graph_name(),
            self.engine_tag()
        )))
    }

    /// Adds this plan's kernels to a new CUDA graph (cuDNN's native population API; only for
    /// plans whose engine reports support, see [`ExecutionPlan::supports_cuda_graph_api`]).
    pub fn populate_cuda_graph(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
    ) -> Result<CudaGraph> {
        if handle.simulated {
            return Err(self.simulator_error(
                "cuDNN's CUDA-graph population is not simulated; capture the stream instead",
            ));
        }
        self.require_cuda_graph_api()?;
        self.with_workspace(handle, Workspace::Pooled, true, |workspace| {
            self.populate_with(handle, bindings, workspace)
        })
    }

    fn populate_with(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
        workspace: u64,
    ) -> Result<CudaGraph> {
        let vp = bindings.variant_pack(workspace)?;
        let mut graph: cudarc::driver::sys::CUgraph = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags must be 0.
        unsafe { cudarc::driver::sys::cuGraphCreate(&mut graph, 0) }
            .result()
            .map_err(|e| driver("cuGraphCreate", e))?;
        let owned = CudaGraph { raw: graph };
        // SAFETY: handle, plan and pack are live and finalized; `graph` is an empty CUDA graph
        // owned by `owned`, which destroys it on every path.
        unsafe {
            (handle.lib.api.cudnnBackendPopulateCudaGraph)(
                handle.raw,
                self.descriptor().raw(),
                vp.raw(),
                owned.raw as sys::cudaGraph_t,
            )
        }
        .result()
        .map_err(|e| {
            Error::cudnn(
                format!("populate a CUDA graph from `{}`", self.graph_name()),
                e,
            )
        })?;
        Ok(owned)
    }
}

impl ExecutionPlan {
    /// Points a CUDA graph made by [`ExecutionPlan::populate_cuda_graph`] at new buffers.
    pub fn update_cuda_graph(
        &self,
        handle: &Handle,
        bindings: &Bindings<'_>,
        graph: &mut CudaGraph,
    ) -> Result<()> {
        if handle.simulated {
            return Err(self.simulator_error(
                "cuDNN's CUDA-graph population is not simulated; capture the stream instead",
            ));
        }
        self.require_cuda_graph_api()?;
        self.with_workspace(handle, Workspace::Pooled, true, |workspace| {
            let vp = bindings.variant_pack(workspace)?;
            // SAFETY: handle, plan and pack are live and finalized; `graph` was populated from
            // this plan and is exclusively borrowed.
            unsafe {
                (handle.lib.api.cudnnBackendUpdateCudaGraph)(
                    handle.raw,
                    self.descriptor().raw(),
                    vp.raw(),
                    graph.raw as sys::cudaGraph_t,
                )
            }
            .result()
            .map_err(|e| {
                Error::cudnn(
                    format!("update the CUDA graph of `{}`", self.graph_name()),
                    e,
                )
            })
        })
    }
}

/// An owned CUDA graph (destroyed on drop).
#[derive(Debug)]
pub struct CudaGraph {
    raw: cudarc::driver::sys::CUgraph,
}

impl CudaGraph {
    /// The raw graph, for instantiation by the caller.
    pub fn raw(&self) -> cudarc::driver::sys::CUgraph {
        self.raw
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: `raw` came from cuGraphCreate and is destroyed once.
        let _ = unsafe { cudarc::driver::sys::cuGraphDestroy(self.raw) };
    }
}

/// Runs `enqueue` while holding `guards` (cudarc's ordering guards of the memory the work
/// uses), dropping them only after it returns, on success and on error alike: a guard records
/// the memory's use on the stream when it drops, so dropped before the work is enqueued it
/// would order later users after nothing. Every address handed to cuDNN goes through here or
/// through [`Bindings`], which hold their guards until they drop.
pub(super) fn enqueue_holding<G, R>(guards: G, enqueue: impl FnOnce() -> R) -> R {
    let out = enqueue();
    drop(guards);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::SyncOnDrop;
    use std::cell::RefCell;

    /// A guard that logs when it drops.
    struct Logged<'a>(&'a RefCell<Vec<&'static str>>);

    impl Drop for Logged<'_> {
        fn drop(&mut self) {
            self.0.borrow_mut().push("guard dropped");
        }
    }

    /// The workspace's guard outlives the enqueue, whether it succeeds or fails.
    #[test]
    fn guards_drop_only_after_the_work_is_enqueued() {
        for ok in [true, false] {
            let log = RefCell::new(Vec::new());
            let out: std::result::Result<u64, &str> = enqueue_holding(Logged(&log), || {
                log.borrow_mut().push("enqueued");
                if ok {
                    Ok(7)
                } else {
                    Err("refused")
                }
            });
            assert_eq!(out.is_ok(), ok);
            assert_eq!(*log.borrow(), ["enqueued", "guard dropped"]);
        }
        // cudarc's own guard type goes through unchanged (a guard with no event to record,
        // as cudarc hands out where tracking is off).
        let out = enqueue_holding(SyncOnDrop::Record(None), || 3);
        assert_eq!(out, 3);
    }
}
