//! [`CpuGroup`]: the ranks of a data-parallel group as threads of one process.
//!
//! Every collective is one numbered round in shared memory: each rank deposits its buffer,
//! the last one to arrive combines them in rank order (0, 1, …, so the result does not depend
//! on which thread came first, and every rank gets the same bits), and each rank copies the
//! result out. A rank whose communicator is dropped (it returned an error, or panicked) or
//! marked failed with [`CpuComm::fail`] fails every pending and later round on the other
//! ranks; a round that does not fill within the group's timeout fails too.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use half::f16;

use super::{Collective, Communicator, DistError, ReduceOp};

/// How long a rank waits for the others in one collective unless told otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Builds the communicators of an in-process group.
#[derive(Debug, Clone, Copy)]
pub struct CpuGroup;

impl CpuGroup {
    /// `world` communicators, rank 0 first, to move into the ranks' threads; collectives
    /// wait at most [`DEFAULT_TIMEOUT`] for the other ranks.
    ///
    /// # Errors
    /// [`DistError::EmptyGroup`] for `world == 0`.
    pub fn ranks(world: usize) -> Result<Vec<CpuComm>, DistError> {
        Self::ranks_with_timeout(world, DEFAULT_TIMEOUT)
    }

    /// As [`CpuGroup::ranks`], with collectives that wait at most `timeout` for the others.
    ///
    /// # Errors
    /// [`DistError::EmptyGroup`] for `world == 0`.
    pub fn ranks_with_timeout(world: usize, timeout: Duration) -> Result<Vec<CpuComm>, DistError> {
        if world == 0 {
            return Err(DistError::EmptyGroup);
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            arrived: Condvar::new(),
        });
        Ok((0..world)
            .map(|rank| CpuComm {
                rank,
                world,
                seq: 0,
                timeout,
                shared: shared.clone(),
            })
            .collect())
    }
}

/// One rank of a [`CpuGroup`]. Dropping it tells the other ranks that this one has left:
/// their pending and later collectives fail with [`DistError::PeerFailed`].
#[derive(Debug)]
pub struct CpuComm {
    rank: usize,
    world: usize,
    seq: u64,
    timeout: Duration,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    arrived: Condvar,
}

#[derive(Debug, Default)]
struct State {
    rounds: HashMap<u64, Round>,
    /// The first rank that failed or left, and what it said.
    failed: Option<(usize, String)>,
}

type Payload = Arc<dyn Any + Send + Sync>;

#[derive(Debug, Default)]
struct Round {
    /// What each rank called (op, element type, length), once it has arrived.
    calls: Vec<Option<String>>,
    inputs: Vec<Option<Payload>>,
    result: Option<Payload>,
    /// Two ranks called different collectives at this point.
    mismatch: bool,
    taken: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank never panics while holding the lock; should one, the state is still whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CpuComm {
    /// Marks this rank failed with `reason`: every other rank's pending and later collectives
    /// return [`DistError::PeerFailed`] naming this rank.
    pub fn fail(&self, reason: impl Into<String>) {
        let mut state = self.shared.lock();
        state.failed.get_or_insert((self.rank, reason.into()));
        self.shared.arrived.notify_all();
    }

    /// How long a collective waits for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// One round: deposit `input`, wait for every rank, return the combined value.
    fn round<T: Elem>(
        &mut self,
        op: &'static str,
        input: Vec<T>,
        combine: impl FnOnce(&[&[T]]) -> Vec<T>,
    ) -> Result<Vec<T>, DistError> {
        let seq = self.seq;
        self.seq += 1;
        let call = format!("{op}<{}>[{}]", T::NAME, input.len());
        let (me, world) = (self.rank, self.world);
        let start = Instant::now();
        let mut state = self.shared.lock();
        if let Some((rank, reason)) = state.failed.clone() {
            return Err(peer_failed(rank, me, op, reason));
        }
        let round = state.rounds.entry(seq).or_insert_with(|| Round {
            calls: vec![None; world],
            inputs: vec![None; world],
            ..Round::default()
        });
        if round.calls.iter().flatten().any(|c| *c != call) {
            round.mismatch = true;
        }
        round.calls[me] = Some(call);
        round.inputs[me] = Some(Arc::new(input));
        if !round.mismatch && round.inputs.iter().all(Option::is_some) {
            let inputs: Vec<&[T]> = round
                .inputs
                .iter()
                .map(|p| {
                    p.as_ref()
                        .and_then(|p| p.downcast_ref::<Vec<T>>())
                        .map_or(&[][..], Vec::as_slice)
                })
                .collect();
            round.result = Some(Arc::new(combine(&inputs)));
        }
        self.shared.arrived.notify_all();
        loop {
            let failed = state.failed.clone();
            // A round lives until every rank has taken its result, this one included.
            let Some(round) = state.rounds.get_mut(&seq) else {
                return Err(peer_failed(me, me, op, "its round was lost".into()));
            };
            if let Some(result) = round.result.clone() {
                round.taken += 1;
                if round.taken == world {
                    state.rounds.remove(&seq);
                }
                let out = result.downcast_ref::<Vec<T>>().cloned().unwrap_or_default();
                return Ok(out);
            }
            if round.mismatch {
                // Every rank names its own call and the first rank whose call differs.
                let mine = round.calls[me].clone().unwrap_or_default();
                let (other, theirs) = round
                    .calls
                    .iter()
                    .enumerate()
                    .find_map(|(r, c)| c.as_ref().filter(|c| **c != mine).map(|c| (r, c.clone())))
                    .unwrap_or((me, mine.clone()));
                return Err(DistError::Mismatch {
                    seq,
                    me,
                    mine,
                    other,
                    theirs,
                });
            }
            if let Some((rank, reason)) = failed {
                return Err(peer_failed(rank, me, op, reason));
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let missing = round
                    .inputs
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.is_none())
                    .map(|(r, _)| r)
                    .collect::<Vec<_>>();
                // The group is broken: let the others stop waiting too.
                state.failed.get_or_insert((
                    me,
                    format!("timed out in {op} waiting for ranks {missing:?}"),
                ));
                self.shared.arrived.notify_all();
                return Err(DistError::Timeout {
                    op,
                    me,
                    missing,
                    waited,
                });
            }
            state = self
                .shared
                .arrived
                .wait_timeout(state, self.timeout - waited)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

fn peer_failed(rank: usize, me: usize, op: &'static str, reason: String) -> DistError {
    DistError::PeerFailed {
        rank,
        me,
        op,
        reason,
    }
}

impl Drop for CpuComm {
    fn drop(&mut self) {
        let reason = if std::thread::panicking() {
            "its thread panicked"
        } else {
            "left the group (its communicator was dropped)"
        };
        let mut state = self.shared.lock();
        // Leaving after the last collective is how a run ends; it fails only what comes later.
        state.failed.get_or_insert((self.rank, reason.into()));
        self.shared.arrived.notify_all();
    }
}

impl Communicator for CpuComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
}

/// An element type the CPU group reduces.
trait Elem: Copy + Send + Sync + 'static {
    const NAME: &'static str;
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
}

impl Elem for f32 {
    const NAME: &'static str = "f32";
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Max if a.is_nan() || b.is_nan() => f32::NAN,
            ReduceOp::Max => a.max(b),
        }
    }
}

impl Elem for f64 {
    const NAME: &'static str = "f64";
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Max if a.is_nan() || b.is_nan() => f64::NAN,
            ReduceOp::Max => a.max(b),
        }
    }
}

impl Elem for f16 {
    const NAME: &'static str = "f16";
    /// In FP16 as NCCL adds FP16: each partial sum rounded to FP16 (the FP32 sum of two FP16
    /// values is exact, so this is one rounding per addition).
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        f16::from_f32(f32::combine(a.to_f32(), b.to_f32(), op))
    }
}

impl Elem for u32 {
    const NAME: &'static str = "u32";
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
        }
    }
}

impl<T: Elem> Collective<[T]> for CpuComm {
    fn all_reduce(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), DistError> {
        let name = match op {
            ReduceOp::Sum => "all_reduce(sum)",
            ReduceOp::Max => "all_reduce(max)",
        };
        let out = self.round(name, buf.to_vec(), |inputs| {
            let mut acc = inputs[0].to_vec();
            for other in &inputs[1..] {
                for (a, &b) in acc.iter_mut().zip(other.iter()) {
                    *a = T::combine(*a, b, op);
                }
            }
            acc
        })?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [T], root: usize) -> Result<(), DistError> {
        if root >= self.world {
            return Err(DistError::InvalidRank {
                rank: root,
                world: self.world,
                why: "a broadcast root must be a rank of the group",
            });
        }
        let out = self.round("broadcast", buf.to_vec(), |inputs| inputs[root].to_vec())?;
        buf.copy_from_slice(&out);
        Ok(())
    }
}
