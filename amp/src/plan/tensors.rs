//! The tensor arena: a network's non-parameter buffers (activations, their gradients, batch
//! and running statistics) laid out once in the memory plan, in one device allocation beside
//! the regions ([`crate::cuda::CudaRegions`] allocates it). Slots are 256-byte aligned and
//! never overlap; nothing in the amp step reads or writes them.

use crate::error::PlanError;
use crate::plan::types::{align_up, ByteRange, DataType, SLOT_ALIGN};

/// One buffer in the tensor arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlot {
    pub(crate) name: String,
    pub(crate) dtype: DataType,
    pub(crate) elems: usize,
    pub(crate) offset_bytes: usize,
}

impl TensorSlot {
    /// The registered name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Element type.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }
    /// Element count.
    pub fn elems(&self) -> usize {
        self.elems
    }
    /// Byte offset in the arena (a multiple of 256).
    pub fn offset_bytes(&self) -> usize {
        self.offset_bytes
    }
    /// Bytes of data (`elems × element size`).
    pub fn len_bytes(&self) -> usize {
        self.elems * self.dtype.size()
    }
    /// The data's bytes in the arena.
    pub fn range(&self) -> ByteRange {
        ByteRange::new(self.offset_bytes, self.offset_bytes + self.len_bytes())
    }
}

/// Lays `pending` (name, dtype, elems) out in order; returns the slots and the arena size.
pub(crate) fn lay_out(
    pending: &[(String, DataType, usize)],
) -> Result<(Vec<TensorSlot>, usize), PlanError> {
    let mut slots = Vec::with_capacity(pending.len());
    let mut end = 0usize;
    for (name, dtype, elems) in pending {
        let overflow = || PlanError::SizeOverflow {
            name: name.clone(),
            shape: vec![*elems],
            what: "tensor arena total",
        };
        let offset_bytes = align_up(end, SLOT_ALIGN).ok_or_else(overflow)?;
        end = elems
            .checked_mul(dtype.size())
            .and_then(|b| offset_bytes.checked_add(b))
            .ok_or_else(overflow)?;
        slots.push(TensorSlot {
            name: name.clone(),
            dtype: *dtype,
            elems: *elems,
            offset_bytes,
        });
    }
    let total = align_up(end, SLOT_ALIGN).ok_or_else(|| PlanError::SizeOverflow {
        name: pending.last().map(|p| p.0.clone()).unwrap_or_default(),
        shape: Vec::new(),
        what: "tensor arena total",
    })?;
    Ok((slots, total))
}

/// The arena's invariants: slots in order, aligned, disjoint, inside the arena.
pub(crate) fn check(slots: &[TensorSlot], total: usize) -> Result<(), PlanError> {
    let mut end = 0usize;
    for s in slots {
        let bad = |what: String| {
            Err(PlanError::Invariant {
                name: s.name.clone(),
                what,
            })
        };
        if s.offset_bytes % SLOT_ALIGN != 0 || s.offset_bytes < end {
            return bad(format!(
                "tensor slot at {} overlaps or is misaligned",
                s.offset_bytes
            ));
        }
        end = s.range().end;
        if end > total {
            return bad(format!(
                "tensor slot ends at {end}, past the arena's {total}"
            ));
        }
    }
    Ok(())
}
