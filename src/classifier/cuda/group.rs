//! The device an engine runs on, and a data-parallel group of launched ranks: one process per
//! GPU, the NCCL communicator (on a stream of its own) that sums the gradients bucket by
//! bucket during backward, synchronized BN, the group's metrics, and the watchdog that aborts
//! the communicator when steps stop completing.

use super::{driver, CudaClassifier, Result};
use crate::amp::cuda::dist_grads::{self, SharedComm};
use crate::amp::cuda::{CudaContext, CudaRegions, CudaStream};
use crate::amp::step::AmpStep;
use crate::amp::AmpError;
use crate::classifier::ClassifierError;
use crate::dist::bootstrap::{exchange_id, LaunchEnv, RENDEZVOUS_TIMEOUT};
use crate::dist::nccl::{NcclComm, NcclId};
use crate::dist::watchdog::{timeout_from_env, Health, Watchdog};
use crate::dist::{Collective, DistError, ReduceOp};
use crate::dist::{NcclBnSync, NcclStepSync};
use crate::fusion::exec::Handle;
use crate::net::{grad_schedule, CompiledNet, GradSchedule};
use crate::netops::head::HeadMetrics;
use crate::runtime::cuda_device;
use cudarc::driver::CudaEvent;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Opens the GPU an engine runs on and a cuDNN handle on its per-thread stream, the only
/// stream of that context object (what whole-step capture needs: the module docs). One GPU:
/// device 0; a rank of a launched group takes [`LaunchEnv::device_ordinal`] of the GPUs it
/// sees. Checks first that cuDNN and NVRTC load.
///
/// # Errors
/// [`ClassifierError::NoDevice`], [`ClassifierError::NoCudnn`], [`ClassifierError::NoNvrtc`]
/// when the engine cannot run here; a cuDNN error making the handle.
pub fn open_device(launch: Option<&LaunchEnv>) -> Result<Arc<Handle>> {
    let ordinal = match launch.filter(|l| l.world > 1) {
        Some(l) => l.device_ordinal(
            crate::runtime::cuda_device_count()
                .map_err(|e| ClassifierError::NoDevice { reason: e.reason })?,
        ),
        None => 0,
    };
    let ctx = cuda_device(ordinal).map_err(|e| ClassifierError::NoDevice { reason: e.reason })?;
    crate::sys::library().map_err(|e| ClassifierError::NoCudnn {
        reason: e.to_string().lines().next().unwrap_or_default().to_string(),
    })?;
    if !crate::runtime::rtc::nvrtc_library_present() {
        return Err(ClassifierError::NoNvrtc {
            reason: "the NVRTC library (libnvrtc) is not on the loader path".into(),
        });
    }
    // The only stream of this context object (module docs: why capture is sound).
    let stream = ctx.per_thread_stream();
    Ok(Handle::new(stream)?)
}

/// One process of a multi-GPU run: its rank and the NCCL communicator (on a stream of its
/// own) that sums the gradients.
pub(super) struct GpuGroup {
    /// Aborts the communicator when the steps stop completing (a peer hung or died) or NCCL
    /// reports an asynchronous error. First, so that it stops before the communicator is
    /// dropped (fields drop in order).
    watchdog: Watchdog,
    rank: usize,
    world: usize,
    /// Shared with synchronized BN's reducer, when on.
    pub(super) comm: SharedComm,
    /// When each gradient bucket is final in the backward pass (its sum overlaps the rest).
    pub(super) schedule: GradSchedule,
    /// The step's join of the ranks over `comm`, ordered after the compute stream.
    pub(super) sync: NcclStepSync,
    /// An event after each step's collectives, until the watchdog sees it complete.
    pending: Arc<Mutex<VecDeque<CudaEvent>>>,
}

impl GpuGroup {
    /// Meets the group of `launch` on `ctx`: shares rank 0's NCCL id, makes the communicator
    /// on a stream of its own, compares the ranks' networks, broadcasts rank 0's initial
    /// weights into `step`'s W, starts the watchdog and tells the step the group's size.
    pub(super) fn form(
        launch: &LaunchEnv,
        ctx: &Arc<CudaContext>,
        compute: &Arc<CudaStream>,
        net: &CompiledNet,
        step: &mut AmpStep<CudaRegions>,
    ) -> Result<Self> {
        let dist = |e: DistError| ClassifierError::Amp(e.into());
        let id = exchange_id(
            launch,
            || NcclId::generate().map(|id| id.to_bytes()),
            RENDEZVOUS_TIMEOUT,
        )
        .and_then(|b| NcclId::from_bytes(&b))
        .map_err(dist)?;
        let link = ctx
            .new_stream()
            .map_err(|e| driver("create the communication stream", e))?;
        let mut comm = NcclComm::new_within(
            link,
            launch.rank,
            launch.world,
            &id,
            Some(RENDEZVOUS_TIMEOUT),
        )
        .map_err(dist)?;
        same_network(&mut comm, net)?;
        dist_grads::broadcast_weights(step.executor_mut(), &mut comm)?;
        let pending = Arc::new(Mutex::new(VecDeque::new()));
        let watchdog = watch(&comm, pending.clone())?;
        let comm = Arc::new(Mutex::new(comm));
        let ranks = u32::try_from(launch.world)
            .map_err(|_| ClassifierError::Config(format!("{} ranks", launch.world)))?;
        step.set_ranks(ranks)?;
        Ok(GpuGroup {
            rank: launch.rank,
            world: launch.world,
            sync: NcclStepSync::new(comm.clone(), compute.clone()),
            comm,
            schedule: grad_schedule(net, step.executor().plan_arc())?,
            pending,
            watchdog,
        })
    }

    /// Synchronized BN's reducer over this group's communicator.
    pub(super) fn bn_sync(&self) -> Box<NcclBnSync> {
        Box::new(NcclBnSync::new(self.comm.clone()))
    }

    /// The group's part of [`CudaClassifier::describe`].
    pub(super) fn describe(&self) -> String {
        format!(
            "rank {} of {} (NCCL {}, watchdog {:.0} s); ",
            self.rank,
            self.world,
            dist_grads::lock(&self.comm).library().version(),
            self.watchdog.timeout().as_secs_f64()
        )
    }

    /// Records an event after the step enqueued so far on `stream`, for the watchdog.
    pub(super) fn mark_step(&self, stream: &CudaStream) -> Result<()> {
        let event = stream
            .record_event(None)
            .map_err(|e| driver("record the step's event", e))?;
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(event);
        Ok(())
    }
}

/// The watchdog of a rank's communicator: it probes NCCL's asynchronous error and the events
/// of the steps enqueued ([`GpuGroup::mark_step`]), and aborts the communicator after the
/// timeout of pending steps without progress.
fn watch(comm: &NcclComm, pending: Arc<Mutex<VecDeque<CudaEvent>>>) -> Result<Watchdog> {
    let timeout = timeout_from_env().map_err(ClassifierError::Config)?;
    let (health, abort) = (comm.abort_handle(), comm.abort_handle());
    let ctx = comm.stream().context().clone();
    let probe = move || {
        if let Some(why) = health.async_error() {
            return Health::Failed(why);
        }
        if let Err(e) = ctx.bind_to_thread() {
            return Health::Failed(format!("the watchdog cannot bind the CUDA context: {e}"));
        }
        let mut q = pending.lock().unwrap_or_else(PoisonError::into_inner);
        let mut advanced = false;
        while let Some(event) = q.front() {
            match event.try_is_complete() {
                Ok(true) => {
                    q.pop_front();
                    advanced = true;
                }
                Ok(false) => break,
                Err(e) => return Health::Failed(format!("a step failed on the device: {e}")),
            }
        }
        match (advanced, q.is_empty()) {
            (true, _) => Health::Advancing,
            (false, true) => Health::Idle,
            (false, false) => Health::Waiting,
        }
    };
    let tick = (timeout / 20).clamp(Duration::from_millis(10), Duration::from_secs(1));
    Watchdog::spawn(timeout, tick, probe, move |why| abort.abort(why))
        .map_err(|e| ClassifierError::Config(format!("cannot start the NCCL watchdog thread: {e}")))
}

/// Fails every rank of the group when any two compiled different networks
/// ([`crate::dist::same`]): the fingerprints are all-gathered by one NCCL sum in which
/// each rank fills only its own slot.
fn same_network(comm: &mut NcclComm, net: &CompiledNet) -> Result<()> {
    use crate::dist::{same, Communicator};
    let (me, world) = (comm.rank(), comm.world());
    let words = net.fingerprint().words(me, world);
    let link = comm.stream().clone();
    let mut gathered = link
        .clone_htod(&words)
        .map_err(|e| driver("upload the network's fingerprint", e))?;
    comm.all_reduce(&mut gathered, ReduceOp::Sum)
        .map_err(|e| ClassifierError::Amp(e.into()))?;
    let words = link
        .clone_dtoh(&gathered)
        .map_err(|e| driver("download the group's fingerprints", e))?;
    same::check_gathered(&words, me, world).map_err(|e| ClassifierError::Amp(e.into()))
}

impl CudaClassifier {
    /// This process's rank and the group's size (0 of 1 without a group).
    pub fn rank(&self) -> (usize, usize) {
        self.backend
            .group
            .as_ref()
            .map_or((0, 1), |g| (g.rank, g.world))
    }

    /// Once the watchdog has aborted the group: the abort, as the error that `then` (the
    /// failure the caller saw) followed from; `None` otherwise.
    pub fn aborted(&self, then: &dyn std::fmt::Display) -> Option<AmpError> {
        let g = self.backend.group.as_ref()?;
        let reason = g.watchdog.fired()?;
        Some(AmpError::Dist(DistError::Aborted {
            me: g.rank,
            reason: format!("{reason} (then: {then})"),
        }))
    }

    /// Each entry's mean over the group's ranks (their shards are the same size), through one
    /// NCCL sum; `entries` as they are without a group. Every rank calls it with as many.
    ///
    /// # Errors
    /// [`ClassifierError::Amp`] from NCCL; a driver error.
    pub fn global_metrics(&mut self, entries: &[HeadMetrics]) -> Result<Vec<HeadMetrics>> {
        let Some(g) = self.backend.group.as_ref() else {
            return Ok(entries.to_vec());
        };
        let flat: Vec<f32> = entries.iter().flat_map(|m| [m.loss, m.accuracy]).collect();
        if flat.is_empty() {
            return Ok(Vec::new());
        }
        let mut comm = dist_grads::lock(&g.comm);
        let link = comm.stream().clone();
        let mut sums = link
            .clone_htod(&flat)
            .map_err(|e| driver("upload the metrics to sum", e))?;
        comm.all_reduce(&mut sums, ReduceOp::Sum)
            .map_err(|e| ClassifierError::Amp(e.into()))?;
        let sums = link
            .clone_dtoh(&sums)
            .map_err(|e| driver("download the summed metrics", e))?;
        let n = g.world as f32;
        Ok(sums
            .chunks_exact(2)
            .map(|p| HeadMetrics {
                loss: p[0] / n,
                accuracy: p[1] / n,
            })
            .collect())
    }
}
