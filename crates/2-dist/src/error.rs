//! [`DistError`]: what a collective or a group's setup can fail with.

use std::time::Duration;

/// A data-parallel failure: a peer that failed or went silent, collectives that do not match
/// across ranks, a bad rank, or the backend's own error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// Another rank failed or left the group (its communicator was dropped, or it reported an
    /// error) while this rank was in, or entered, a collective.
    #[error("rank {rank} of the group failed or left during {op} (this rank: {me}): {reason}")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
        /// This rank.
        me: usize,
        /// The collective this rank was in.
        op: &'static str,
        /// What the failed rank reported.
        reason: String,
    },
    /// The watchdog aborted the group: collectives on the device made no progress within its
    /// timeout, or the backend reported an asynchronous error ([`super::watchdog`]).
    #[error("rank {me}: the data-parallel group was aborted by its watchdog: {reason}")]
    Aborted {
        /// This rank.
        me: usize,
        /// Why.
        reason: String,
    },
    /// Not every rank reached the collective within the group's timeout.
    #[error("{op} on rank {me}: ranks {missing:?} did not arrive within {waited:?}")]
    Timeout {
        /// The collective.
        op: &'static str,
        /// This rank.
        me: usize,
        /// The ranks that were still missing.
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    /// The ranks called different collectives at the same point, or with different lengths
    /// or element types.
    #[error("collective #{seq} differs across ranks: rank {me} called {mine}, rank {other} called {theirs}")]
    Mismatch {
        /// The collective's sequence number in this group.
        seq: u64,
        /// This rank.
        me: usize,
        /// What this rank called.
        mine: String,
        /// The first rank that called something else.
        other: usize,
        /// What it called.
        theirs: String,
    },
    /// Two ranks of the group compiled different models ([`super::same`]): every rank
    /// reports it when the group forms, naming two ranks that differ.
    #[error("rank {me}: the ranks compiled different networks: rank {rank_a} has `{summary_a}` (hash {hash_a:016x}), rank {rank_b} has `{summary_b}` (hash {hash_b:016x})")]
    ModelMismatch {
        /// This rank.
        me: usize,
        /// One rank.
        rank_a: usize,
        /// Its model's hash.
        hash_a: u64,
        /// Its model, for people.
        summary_a: String,
        /// A rank whose model differs from `rank_a`'s.
        rank_b: usize,
        /// Its model's hash.
        hash_b: u64,
        /// Its model, for people.
        summary_b: String,
    },
    /// A rank index outside the group (a broadcast root, or a rank taken twice).
    #[error("rank {rank} is not available in a group of {world} ranks: {why}")]
    InvalidRank {
        /// The rank asked for.
        rank: usize,
        /// The group's size.
        world: usize,
        /// Why it is refused.
        why: &'static str,
    },
    /// A group needs at least one rank.
    #[error("a group needs at least one rank")]
    EmptyGroup,
    /// The NCCL library could not be loaded from any place it was looked for.
    #[error("NCCL is not available; tried:\n  {}\ninstall it with `pip install nvidia-nccl-cu13` (or the system's libnccl2 package), or set NCCL_LIB_DIR to the folder holding libnccl.so.2", tried.join("\n  "))]
    NcclUnavailable {
        /// Every place tried, each with why it did not work.
        tried: Vec<String>,
    },
    /// An NCCL call failed, or was refused before it was made.
    #[error("NCCL {op} failed{}: {message}", code.map(|c| format!(" (ncclResult_t {c})")).unwrap_or_default())]
    Nccl {
        /// The call (`ncclCommInitRank`, `ncclAllReduce`, …).
        op: &'static str,
        /// NCCL's result code; `None` when the call was refused before reaching NCCL.
        code: Option<i32>,
        /// NCCL's description of the error, or why the call was refused.
        message: String,
    },
    /// A unique id (NCCL's, 128 bytes) that is not one: wrong length, or not hex.
    #[error("invalid communicator id: {problem}")]
    InvalidId {
        /// What is wrong with it.
        problem: String,
    },
    /// The launcher's environment does not describe a usable rank.
    #[error("launcher environment: {var}={value:?}: {problem}")]
    Bootstrap {
        /// The environment variable at fault (or the one that is missing).
        var: String,
        /// Its value (empty when missing).
        value: String,
        /// What is wrong.
        problem: String,
    },
    /// The rendezvous that ships rank 0's id failed: no answer in time, refused, a bad header.
    #[error("rendezvous at {addr}: {problem}")]
    Store {
        /// The store: `host:port`, or the rendezvous file's path.
        addr: String,
        /// What went wrong.
        problem: String,
    },
}
