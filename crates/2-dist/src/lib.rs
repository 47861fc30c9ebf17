//! cudnn-cbr-dist: data-parallel training's distribution layer: communicators, the collectives
//! over them, and how the ranks of a launched job find each other.
//!
//! A data-parallel step runs the same network on every rank, each on its shard of the global
//! batch. Between backward and the optimizer the ranks sum their gradients (per amp bucket,
//! the deepest bucket first, as backward produces them), and they share the overflow verdict
//! (max of the flags) so that every rank skips the same steps and keeps the same loss scale.
//! Those gradient collectives are the mixed-precision layer's (`cudnn_cbr_amp::dist::grads`,
//! `cudnn_cbr_amp::cuda::dist_grads`); this crate holds what they run over and knows nothing of
//! the memory plan.
//!
//! | piece | what it is | where |
//! |-------|------------|-------|
//! | [`Communicator`] | a rank in a group of `world` ranks | this crate's root |
//! | [`Collective`] | all-reduce and broadcast over one kind of buffer | this crate's root |
//! | [`cpu::CpuGroup`] | ranks as threads of one process, fixed reduction order | [`cpu`] |
//! | [`nccl::NcclComm`] | one rank of an NCCL communicator, over device buffers | [`nccl`] |
//! | [`same::check_same_model`] | every rank compiled the same model, checked when the group forms | [`same`] |
//! | [`bootstrap::LaunchEnv`], [`bootstrap::exchange_id`] | rank and world from torchrun, MPI or Slurm; rank 0's id to every rank | [`bootstrap`] |
//! | [`watchdog::Watchdog`] | aborts a group whose collectives stop making progress | [`watchdog`] |
//!
//! Every collective is called by every rank of the group in the same order. A rank that
//! fails or leaves makes the others' pending and later collectives return
//! [`DistError::PeerFailed`]; a rank that stops answering makes them return
//! [`DistError::Timeout`]: never a hang.
//!
//! The crate builds on `cudnn_cbr_runtime` only (library discovery, the checks before opening
//! a file); the root crate re-exports it as `cudnn_cbr::dist`, its one public path.
//!
//! Unsafe code lives only in the NCCL loader and communicator (`nccl/library.rs`,
//! `nccl/comm.rs`); everything else denies it.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod bootstrap;
pub mod cpu;
mod error;
pub mod nccl;
pub mod same;
pub mod watchdog;

pub use error::DistError;

/// How an all-reduce combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise maximum (e.g. of the overflow flags).
    Max,
}

/// One rank of a group of ranks that run collectives together.
pub trait Communicator: Send {
    /// This rank, in `0..world()`.
    fn rank(&self) -> usize;
    /// How many ranks the group has.
    fn world(&self) -> usize;
}

/// Collectives over buffers of type `B`: host slices (`[f32]`, `[f16]`, `[f64]`, `[u32]`) for
/// the CPU communicator, device memory for NCCL.
///
/// Every rank calls the same collectives in the same order with buffers of the same length;
/// a mismatch is [`DistError::Mismatch`] on every rank.
pub trait Collective<B: ?Sized>: Communicator {
    /// Combines `buf` over every rank with `op`, in place: afterwards every rank holds the
    /// same values.
    ///
    /// # Errors
    /// [`DistError::PeerFailed`], [`DistError::Timeout`], [`DistError::Mismatch`], or the
    /// backend's own error.
    fn all_reduce(&mut self, buf: &mut B, op: ReduceOp) -> Result<(), DistError>;

    /// Copies `root`'s `buf` into every other rank's.
    ///
    /// # Errors
    /// As [`Collective::all_reduce`]; [`DistError::InvalidRank`] for a root outside the group.
    fn broadcast(&mut self, buf: &mut B, root: usize) -> Result<(), DistError>;
}
