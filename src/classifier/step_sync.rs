//! [`StepSync`]: how the ranks of a data-parallel step join, whatever the backend: each
//! gradient bucket summed over the ranks as the backward pass makes it final, and the overflow
//! flag shared between the check and SGD, so every rank updates (or skips) together.
//! [`super::Classifier::train_micro_batch_synced`] runs a micro-batch with one;
//! [`crate::dist`] has the CPU group's ([`crate::dist::CpuComm`]) and NCCL's
//! ([`crate::dist::NcclStepSync`]).

use super::ClassifierError;
use crate::amp::plan::Bucket;
use crate::amp::AmpError;

/// How one rank of a data-parallel step joins the others (module docs).
pub trait StepSync<R> {
    /// Sums gradient bucket `bucket` of `regions` over the ranks (on a device: enqueued).
    ///
    /// # Errors
    /// A failed or timed-out collective.
    fn reduce_bucket(&mut self, regions: &mut R, bucket: Bucket) -> Result<(), ClassifierError>;

    /// After the backward pass: what comes next on the regions (amp's `accumulate`, or the
    /// check and SGD) waits for every bucket's sum (on a device: an event join; where the
    /// sums are done when [`StepSync::reduce_bucket`] returns, nothing).
    ///
    /// # Errors
    /// A driver error.
    fn join(&mut self, regions: &mut R) -> Result<(), ClassifierError>;

    /// Between the overflow check and SGD of a step's last micro-batch: the overflow flag
    /// shared (max) over the ranks.
    ///
    /// # Errors
    /// A failed or timed-out collective.
    fn share_overflow(&mut self, regions: &mut R) -> Result<(), AmpError>;

    /// This rank's pass failed with `why`: tell the others at once where the group can,
    /// rather than at their next collective's timeout.
    fn fail(&mut self, why: &str);
}
