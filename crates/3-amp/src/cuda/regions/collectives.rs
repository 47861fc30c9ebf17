//! Collectives over byte ranges of [`CudaRegions`] in flight on another stream (a gradient
//! bucket's all-reduce): noted with the event recorded after each, and waited for only by the
//! uses whose ranges they touch.

use cudarc::driver::{CudaEvent, CudaStream};

use super::CudaRegions;
use crate::cuda::dist_grads::must_wait_for;
use crate::cuda::driver_error;
use crate::error::AmpError;
use crate::plan::{ByteRange, Region};

/// A collective in flight on another stream: the region ranges it reads or writes, and the
/// event recorded after it on that stream.
#[derive(Debug)]
pub(super) struct InFlight {
    ranges: Vec<(Region, ByteRange)>,
    event: CudaEvent,
}

impl CudaRegions {
    /// Records a collective enqueued on another stream over `ranges` of these regions (raw
    /// addresses, outside cudarc's event tracking), finished at `event`: later uses of those
    /// ranges through this executor wait for it, others do not.
    pub(crate) fn note_collective(&mut self, ranges: Vec<(Region, ByteRange)>, event: CudaEvent) {
        self.in_flight.push(InFlight { ranges, event });
    }

    /// How many collectives over these regions are in flight on another stream (noted by
    /// [`crate::cuda::dist_grads::all_reduce_bucket`], until
    /// [`CudaRegions::join_collectives`]).
    pub fn collectives_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Makes `stream` wait for the collectives in flight that touch bytes `range` of
    /// `region`, and for no other: e.g. before binding one slot of G16 on the compute stream
    /// while other buckets' all-reduces still run. [`CudaRegions::region_mut`] and its kin
    /// hand out whole buffers without waiting: a caller that uses a range a collective is
    /// still summing orders itself with this first.
    ///
    /// # Errors
    /// A driver error.
    pub fn order_after_collectives(
        &self,
        stream: &CudaStream,
        region: Region,
        range: ByteRange,
    ) -> Result<(), AmpError> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let ranges: Vec<Vec<(Region, ByteRange)>> =
            self.in_flight.iter().map(|f| f.ranges.clone()).collect();
        for i in must_wait_for(&ranges, region, range) {
            stream.wait(&self.in_flight[i].event).map_err(|e| {
                driver_error(format!("order a use of {region} after a collective"), e)
            })?;
        }
        Ok(())
    }

    /// Orders this executor's stream after every collective in flight over its regions and
    /// forgets them (the step's join point, before the amp step reads the gradients).
    ///
    /// # Errors
    /// A driver error; the collectives stay noted then.
    pub fn join_collectives(&mut self) -> Result<(), AmpError> {
        for f in &self.in_flight {
            self.stream
                .wait(&f.event)
                .map_err(|e| driver_error("order the step after the collectives", e))?;
        }
        self.in_flight.clear();
        Ok(())
    }
}

impl Drop for CudaRegions {
    fn drop(&mut self) {
        // The buffers are freed on this stream: after the collectives still reading or
        // writing them on another (their raw addresses are invisible to cudarc's tracking).
        for f in &self.in_flight {
            let _ = self.stream.wait(&f.event);
        }
    }
}
