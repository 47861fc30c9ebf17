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
}
