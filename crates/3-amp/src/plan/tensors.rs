//! The tensor arena: a network's non-parameter buffers (activations, their gradients, batch
//! and running statistics) laid out once in the memory plan, in one device allocation beside
//! the regions ([`crate::cuda::CudaRegions`] allocates it). Nothing in the amp step reads or
//! writes them.
//!
//! A tensor registered with a [`Lifetime`] span (the positions of the step's order where its
//! value is needed, first write to last read) may share bytes with tensors whose spans do not
//! meet: the interval assignment static memory planners use, greedy by size ([`assign`]).
//! A tensor registered for the [`Lifetime::Whole`] step keeps bytes of its own. Slots are
//! 256-byte aligned; [`check`] proves that no two tensors alive at the same position share a
//! byte.

use crate::error::PlanError;
use crate::plan::types::{align_up, ByteRange, DataType, SLOT_ALIGN};

/// When a tensor holds a value the step needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lifetime {
    /// Through the whole step and from one step to the next: bytes of its own.
    Whole,
    /// From position `first` to position `last` of the step's order, both included: its first
    /// write to its last read.
    Span {
        /// The first position.
        first: u32,
        /// The last position (`>= first`).
        last: u32,
    },
}

impl Lifetime {
    /// Whether two tensors with these lifetimes are ever needed at the same position.
    pub fn meets(self, other: Lifetime) -> bool {
        match (self, other) {
            (Lifetime::Span { first, last }, Lifetime::Span { first: f, last: l }) => {
                first <= l && f <= last
            }
            _ => true,
        }
    }
}

/// One buffer in the tensor arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlot {
    pub(crate) name: String,
    pub(crate) dtype: DataType,
    pub(crate) elems: usize,
    pub(crate) offset_bytes: usize,
    pub(crate) live: Lifetime,
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
    /// When its value is needed (what lets it share bytes).
    pub fn lifetime(&self) -> Lifetime {
        self.live
    }
}

/// Offsets for items of `(bytes, lifetime)`, each a multiple of `align` (a power of two), such
/// that two items whose lifetimes meet never share a byte; and the arena's size (a multiple
/// of `align`). [`Lifetime::Whole`] items come first, in order, each after the previous; the
/// spans are then placed largest first (ties: earlier first position, then order), each at
/// the lowest offset above the whole items where it meets none of the spans placed so far.
/// `None` when a size or offset overflows.
pub fn assign(items: &[(usize, Lifetime)], align: usize) -> Option<(Vec<usize>, usize)> {
    let mut offsets = vec![0usize; items.len()];
    let mut base = 0usize;
    for (i, &(bytes, live)) in items.iter().enumerate() {
        if live == Lifetime::Whole {
            offsets[i] = align_up(base, align)?;
            base = offsets[i].checked_add(bytes)?;
        }
    }
    let base = align_up(base, align)?;
    let mut end = base;
    let mut spans: Vec<usize> = (0..items.len())
        .filter(|&i| items[i].1 != Lifetime::Whole)
        .collect();
    let first = |i: usize| match items[i].1 {
        Lifetime::Span { first, .. } => first,
        Lifetime::Whole => 0,
    };
    spans.sort_by_key(|&i| (std::cmp::Reverse(items[i].0), first(i), i));
    // Placed spans as (offset, end, index), kept sorted by offset.
    let mut placed: Vec<(usize, usize, usize)> = Vec::with_capacity(spans.len());
    for i in spans {
        let (bytes, live) = items[i];
        let mut at = base;
        for &(o, e, j) in &placed {
            if !live.meets(items[j].1) || e <= at {
                continue;
            }
            if at.checked_add(bytes)? <= o {
                break;
            }
            at = align_up(e, align)?;
        }
        let stop = at.checked_add(bytes)?;
        offsets[i] = at;
        end = end.max(stop);
        let k = placed.partition_point(|p| p.0 <= at);
        placed.insert(k, (at, stop, i));
    }
    Some((offsets, align_up(end, align)?))
}

/// The most bytes alive at any one position: no assignment of `items` can be smaller (the
/// lower bound a report compares [`assign`]'s size with).
pub fn peak_live(items: &[(usize, Lifetime)]) -> usize {
    let whole: usize = items
        .iter()
        .filter(|(_, l)| *l == Lifetime::Whole)
        .map(|(b, _)| *b)
        .sum();
    // Sweep over span starts (+bytes) and ends (−bytes, one position later).
    let mut events: Vec<(u64, i128)> = Vec::new();
    for &(bytes, live) in items {
        if let Lifetime::Span { first, last } = live {
            events.push((u64::from(first) * 2, bytes as i128));
            events.push((u64::from(last) * 2 + 1, -(bytes as i128)));
        }
    }
    events.sort_unstable();
    let (mut now, mut peak) = (0i128, 0i128);
    for (_, d) in events {
        now += d;
        peak = peak.max(now);
    }
    whole + peak as usize
}

/// Lays `pending` (name, dtype, elems, lifetime) out with [`assign`]; returns the slots (in
/// registration order) and the arena size.
pub(crate) fn lay_out(
    pending: &[(String, DataType, usize, Lifetime)],
) -> Result<(Vec<TensorSlot>, usize), PlanError> {
    let overflow = || PlanError::SizeOverflow {
        name: pending.last().map(|p| p.0.clone()).unwrap_or_default(),
        shape: Vec::new(),
        what: "tensor arena total",
    };
    let items: Vec<(usize, Lifetime)> = pending
        .iter()
        .map(|(_, dtype, elems, live)| Some((elems.checked_mul(dtype.size())?, *live)))
        .collect::<Option<_>>()
        .ok_or_else(overflow)?;
    let (offsets, total) = assign(&items, SLOT_ALIGN).ok_or_else(overflow)?;
    let slots = pending
        .iter()
        .zip(offsets)
        .map(|((name, dtype, elems, live), offset_bytes)| TensorSlot {
            name: name.clone(),
            dtype: *dtype,
            elems: *elems,
            offset_bytes,
            live: *live,
        })
        .collect();
    Ok((slots, total))
}

/// The arena's invariants: every slot aligned and inside the arena, and no two slots whose
/// lifetimes meet sharing a byte (the proof that sharing is safe, checked on every plan).
pub(crate) fn check(slots: &[TensorSlot], total: usize) -> Result<(), PlanError> {
    let bad = |s: &TensorSlot, what: String| {
        Err(PlanError::Invariant {
            name: s.name.clone(),
            what,
        })
    };
    for s in slots {
        if s.offset_bytes % SLOT_ALIGN != 0 {
            return bad(
                s,
                format!("tensor slot at {} is misaligned", s.offset_bytes),
            );
        }
        if s.range().end > total {
            return bad(
                s,
                format!(
                    "tensor slot ends at {}, past the arena's {total}",
                    s.range().end
                ),
            );
        }
    }
    let mut by_offset: Vec<&TensorSlot> = slots.iter().collect();
    by_offset.sort_by_key(|s| s.offset_bytes);
    for (i, a) in by_offset.iter().enumerate() {
        for b in by_offset[i + 1..]
            .iter()
            .take_while(|b| b.offset_bytes < a.range().end)
        {
            if a.live.meets(b.live) {
                return bad(
                    a,
                    format!(
                        "tensor slot {:?} shares bytes with `{}` {:?} while both are alive \
                         ({:?} and {:?})",
                        a.range(),
                        b.name,
                        b.range(),
                        a.live,
                        b.live
                    ),
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use Lifetime::{Span, Whole};

    fn span(first: u32, last: u32) -> Lifetime {
        Span { first, last }
    }

    fn slots(items: &[(usize, Lifetime)]) -> (Vec<TensorSlot>, usize) {
        let pending: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(i, &(b, l))| (format!("t{i}"), DataType::Half, b / 2, l))
            .collect();
        lay_out(&pending).unwrap()
    }

    #[test]
    fn spans_that_do_not_meet_share_bytes_and_whole_ones_never_do() {
        let items = [
            (1024, Whole),
            (4096, span(0, 2)),
            (4096, span(3, 5)),
            (2048, span(2, 3)),
            (512, Whole),
        ];
        let (offsets, total) = assign(&items, 256).unwrap();
        // The whole items first, in order; then the two 4 KiB spans at one offset (they never
        // meet), the 2 KiB span above both (it meets each).
        assert_eq!(offsets, vec![0, 1536, 1536, 5632, 1024]);
        assert_eq!(total, 7680);
        assert_eq!(peak_live(&items), 1536 + 4096 + 2048);
        let (s, t) = slots(&items);
        check(&s, t).unwrap();
    }

    #[test]
    fn the_assignment_fills_gaps_below_the_top() {
        // A short-lived large buffer, then two small ones that fit under it once it is dead.
        let items = [
            (8192, span(0, 1)),
            (1024, span(1, 4)),
            (4096, span(2, 3)),
            (2048, span(3, 5)),
        ];
        let (offsets, total) = assign(&items, 256).unwrap();
        assert_eq!(offsets, vec![0, 8192, 0, 4096]);
        assert_eq!(total, 9216);
        let (s, t) = slots(&items);
        check(&s, t).unwrap();
    }

    #[test]
    fn the_check_names_two_live_slots_that_share_bytes() {
        let (mut s, t) = slots(&[(1024, span(0, 2)), (1024, span(3, 4)), (1024, span(2, 3))]);
        check(&s, t).unwrap();
        // Move the third over the first: both are alive at position 2.
        s[2].offset_bytes = s[0].offset_bytes;
        let e = check(&s, t).unwrap_err().to_string();
        assert!(e.contains("t0") && e.contains("`t2`"), "{e}");
        // A misaligned slot and one past the end.
        let (mut s, t) = slots(&[(1024, Whole)]);
        s[0].offset_bytes = 8;
        assert!(check(&s, t).unwrap_err().to_string().contains("misaligned"));
        s[0].offset_bytes = 256;
        assert!(check(&s, t)
            .unwrap_err()
            .to_string()
            .contains("past the arena"));
    }

    /// Many random lifetimes: the assignment is always proved safe by the check, never larger
    /// than one slot each and never smaller than the peak of live bytes.
    #[test]
    fn random_lifetimes_are_always_assigned_safely() {
        let mut state = 7u64;
        let mut next = |m: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % m
        };
        for _ in 0..200 {
            let n = 1 + next(40) as usize;
            let items: Vec<(usize, Lifetime)> = (0..n)
                .map(|_| {
                    let bytes = 2 * (1 + next(3000) as usize);
                    let live = if next(10) == 0 {
                        Whole
                    } else {
                        let a = next(30) as u32;
                        span(a, a + next(8) as u32)
                    };
                    (bytes, live)
                })
                .collect();
            let (s, total) = slots(&items);
            check(&s, total).unwrap();
            let separate: usize = items.iter().map(|(b, _)| align_up(*b, 256).unwrap()).sum();
            assert!(total <= separate, "{total} > {separate}");
            assert!(total >= peak_live(&items));
        }
    }
}
