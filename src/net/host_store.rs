//! Where the CPU executor keeps a compiled network's buffers: one host vector each
//! ([`Arena::Separate`]), or the step-long buffers in a shared arena laid out by their
//! lifetimes ([`Arena::Shared`]: [`super::liveness`], the same interval assignment as the
//! GPU's tensor arena), so that buffers never alive together share memory.
//!
//! The shared arena is two pools, one per storage kind (`Half` buffers as `T`, `Float` ones
//! as `T::Acc`): the element types differ per precision mode, and typed pools need no casts.
//! A write copies into the buffer's range (in parts over the threads), and the vector it came
//! in is kept and lent to a later op for its output (at most [`SPARE`] of them). A read checks
//! that no buffer sharing its range was written after it ([`HostStore::check_read`]): a
//! lifetime the plan got wrong is a typed error naming both buffers, never a silently stale
//! value.

use super::compile::{BufId, CompiledNet, NetBuffer};
use super::cpu::Buf;
use super::liveness::lifetimes;
use super::params::in_arena;
use crate::amp::plan::{assign_tensor_offsets, Lifetime};
use crate::runtime::DataType;
use cudnn_cbr_fusion::reference::{Element, Real};
use cudnn_cbr_fusion::{Error, Result};

/// How the CPU executor lays out a network's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arena {
    /// One host vector per buffer, for the executor's whole life: every buffer can be read
    /// after a pass (tests that compare every buffer use this).
    #[default]
    Separate,
    /// Activations, their gradients and per-step scratch share one arena per storage kind,
    /// laid out by lifetime; the input, the output and its gradient, parameters and running
    /// statistics keep vectors of their own. A buffer can be read only while its value is
    /// needed (afterwards: [`Error::Buffer`] naming the buffer that took its place).
    Shared,
}

/// Alignment of arena slots in bytes (a cache line: no two slots share one).
const HOST_ALIGN: usize = 64;

#[derive(Debug, Clone, Copy)]
enum Slot {
    /// A vector of its own (in [`HostStore::own`]).
    Own,
    /// `len` elements at `at` of the `Half` pool.
    Half { at: usize, len: usize },
    /// `len` elements at `at` of the `Float` pool.
    Float { at: usize, len: usize },
}

/// A compiled network's host buffers, with a write stamp per buffer.
#[derive(Debug)]
pub(crate) struct HostStore<T: Element> {
    slots: Vec<Slot>,
    /// Each buffer's own vector (empty for arena buffers).
    own: Vec<Buf<T>>,
    half: Vec<T>,
    float: Vec<T::Acc>,
    /// Per buffer, the arena buffers whose ranges meet its own.
    aliases: Vec<Vec<BufId>>,
    /// Per buffer, the write clock's value at its last write.
    versions: Vec<u64>,
    clock: u64,
    /// Vectors an op wrote an arena buffer's new contents into, kept after their copy into
    /// the arena and lent to the next op ([`HostStore::take_half`]): a step then allocates
    /// (and the OS zeroes) no fresh output pages.
    spare: Vec<Vec<T>>,
}

/// The most vectors [`HostStore::spare`] keeps: an op borrows one output at a time, so two
/// cover a step, and the memory they hold stays at two of the largest `Half` buffers.
const SPARE: usize = 2;

/// Elements per part of a copy into the arena split over rayon's threads (an activation
/// copied on one thread would leave the others waiting between two parallel ops).
const COPY_PART: usize = 32 * 1024;

/// `dst.copy_from_slice(src)`, in parts over the threads where it is long (equal lengths).
fn copy_in_parts<V: Copy + Send + Sync>(dst: &mut [V], src: &[V]) {
    if dst.len() < 2 * COPY_PART || rayon::current_num_threads() < 2 {
        dst.copy_from_slice(src);
        return;
    }
    use rayon::prelude::*;
    dst.par_chunks_mut(COPY_PART)
        .zip(src.par_chunks(COPY_PART))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

fn wrong_kind(name: &str, want: &str) -> Error {
    Error::Buffer {
        name: name.into(),
        problem: format!("is not {want}"),
    }
}

fn wrong_len(name: &str, got: usize, want: usize) -> Error {
    Error::Buffer {
        name: name.into(),
        problem: format!("takes {want} elements, got {got}"),
    }
}

/// A vector of `elems` copies of `v`, or an error naming the buffer when the host cannot
/// allocate it.
fn filled<V: Clone>(name: &str, elems: usize, v: V) -> Result<Vec<V>> {
    let mut out = Vec::new();
    out.try_reserve_exact(elems).map_err(|e| Error::Buffer {
        name: name.into(),
        problem: format!(
            "cannot be allocated on the host: {elems} elements of {} bytes ({e})",
            std::mem::size_of::<V>()
        ),
    })?;
    out.resize(elems, v);
    Ok(out)
}

/// The initial value of a `Float` buffer: running variances start at 1 (as in every
/// framework), everything else at 0.
fn init<A: Real>(b: &NetBuffer) -> A {
    if b.name.ends_with("running_var") {
        A::ONE
    } else {
        A::ZERO
    }
}

impl<T: Element> HostStore<T> {
    /// Zeroed buffers for `net` (running variances at 1), laid out as `arena` says.
    ///
    /// # Errors
    /// [`Error::Buffer`] naming a buffer (or pool) the host cannot allocate, or a buffer a
    /// layer binds that the network lacks (lifetimes, [`Arena::Shared`] only).
    pub(crate) fn new(net: &CompiledNet, arena: Arena) -> Result<Self> {
        let n = net.buffers.len();
        let shared = |id: usize| arena == Arena::Shared && in_arena(net, id);
        let mut own = Vec::with_capacity(n);
        for (id, b) in net.buffers.iter().enumerate() {
            let elems = if shared(id) { 0 } else { b.elems };
            own.push(match b.dtype {
                DataType::Half => Buf::Half(filled(&b.name, elems, T::default())?),
                _ => Buf::Float(filled(&b.name, elems, init::<T::Acc>(b))?),
            });
        }
        let mut slots = vec![Slot::Own; n];
        let mut aliases = vec![Vec::new(); n];
        let (mut half_len, mut float_len) = (0, 0);
        if arena == Arena::Shared {
            let live = lifetimes(net)?;
            for half in [true, false] {
                let ids: Vec<BufId> = (0..n)
                    .filter(|&id| shared(id) && (net.buffers[id].dtype == DataType::Half) == half)
                    .collect();
                let size = if half {
                    std::mem::size_of::<T>()
                } else {
                    std::mem::size_of::<T::Acc>()
                };
                let items: Vec<(usize, Lifetime)> = ids
                    .iter()
                    .map(|&id| (net.buffers[id].elems * size, live[id]))
                    .collect();
                let overflow = || Error::Buffer {
                    name: net.spec.name.clone(),
                    problem: "its shared arena's size overflows".into(),
                };
                let (offsets, total) =
                    assign_tensor_offsets(&items, HOST_ALIGN.max(size)).ok_or_else(overflow)?;
                for (&id, at) in ids.iter().zip(offsets) {
                    let (at, len) = (at / size, net.buffers[id].elems);
                    slots[id] = if half {
                        Slot::Half { at, len }
                    } else {
                        Slot::Float { at, len }
                    };
                }
                // Aliases: buffers of this pool whose ranges meet (lifetimes disjoint, by
                // the assignment; what a read checks).
                let mut by_at: Vec<(usize, usize, BufId)> = ids
                    .iter()
                    .map(|&id| match slots[id] {
                        Slot::Half { at, len } | Slot::Float { at, len } => (at, at + len, id),
                        Slot::Own => unreachable!("every id here was just given a pool slot"),
                    })
                    .collect();
                by_at.sort_unstable();
                for (i, &(_, end, a)) in by_at.iter().enumerate() {
                    for &(_, _, b) in by_at[i + 1..].iter().take_while(|x| x.0 < end) {
                        aliases[a].push(b);
                        aliases[b].push(a);
                    }
                }
                if half {
                    half_len = total / size;
                } else {
                    float_len = total / size;
                }
            }
        }
        let pool = |what: &str| format!("{}'s shared {what} arena", net.spec.name);
        Ok(HostStore {
            slots,
            own,
            half: filled(&pool("FP16"), half_len, T::default())?,
            float: filled(&pool("FP32"), float_len, T::Acc::ZERO)?,
            aliases,
            // Every buffer starts with a stamp of its own.
            versions: (1..=n as u64).collect(),
            clock: n as u64,
            spare: Vec::new(),
        })
    }

    /// Elements of the shared arena's pools (`Half`, `Float`); zeros with
    /// [`Arena::Separate`].
    pub(crate) fn arena_elems(&self) -> (usize, usize) {
        (self.half.len(), self.float.len())
    }

    /// Records a write to buffer `id`: a new value of the write clock, so a buffer's stamp is
    /// the same only while its contents are.
    pub(crate) fn touch(&mut self, id: BufId) {
        self.clock += 1;
        self.versions[id] = self.clock;
    }

    /// Buffer `id`'s write stamp.
    pub(crate) fn stamp(&self, id: BufId) -> u64 {
        self.versions[id]
    }

    /// A read of `id` is sound: no buffer sharing its arena range was written after it.
    fn check_read(&self, id: BufId, buffers: &[NetBuffer]) -> Result<()> {
        match self.aliases[id]
            .iter()
            .find(|&&a| self.versions[a] > self.versions[id])
        {
            None => Ok(()),
            Some(&a) => Err(Error::Buffer {
                name: buffers[id].name.clone(),
                problem: format!(
                    "was overwritten by `{}`, which shares its arena range, before this read \
                     (its lifetime ended: read it with the separate layout)",
                    buffers[a].name
                ),
            }),
        }
    }

    /// A `Half` buffer.
    pub(crate) fn half(&self, id: BufId, buffers: &[NetBuffer]) -> Result<&[T]> {
        match (self.slots[id], &self.own[id]) {
            (Slot::Half { at, len }, _) => {
                self.check_read(id, buffers)?;
                Ok(&self.half[at..at + len])
            }
            (Slot::Own, Buf::Half(v)) => Ok(v),
            _ => Err(wrong_kind(&buffers[id].name, "FP16")),
        }
    }

    /// A `Float` buffer.
    pub(crate) fn float(&self, id: BufId, buffers: &[NetBuffer]) -> Result<&[T::Acc]> {
        match (self.slots[id], &self.own[id]) {
            (Slot::Float { at, len }, _) => {
                self.check_read(id, buffers)?;
                Ok(&self.float[at..at + len])
            }
            (Slot::Own, Buf::Float(v)) => Ok(v),
            _ => Err(wrong_kind(&buffers[id].name, "FP32")),
        }
    }

    /// Replaces buffer `id`'s contents with `v` (its kind and declared length, checked).
    pub(crate) fn put(&mut self, id: BufId, v: Buf<T>, buffers: &[NetBuffer]) -> Result<()> {
        let b = &buffers[id];
        let len = match &v {
            Buf::Half(x) => x.len(),
            Buf::Float(x) => x.len(),
        };
        match (self.slots[id], &self.own[id], &v) {
            (Slot::Half { .. }, _, Buf::Float(_)) | (Slot::Own, Buf::Half(_), Buf::Float(_)) => {
                return Err(wrong_kind(&b.name, "FP32"))
            }
            (Slot::Float { .. }, _, Buf::Half(_)) | (Slot::Own, Buf::Float(_), Buf::Half(_)) => {
                return Err(wrong_kind(&b.name, "FP16"))
            }
            _ if len != b.elems => return Err(wrong_len(&b.name, len, b.elems)),
            _ => {}
        }
        self.touch(id);
        match (self.slots[id], v) {
            (Slot::Half { at, len }, Buf::Half(x)) => {
                copy_in_parts(&mut self.half[at..at + len], &x);
                if self.spare.len() < SPARE {
                    self.spare.push(x);
                }
            }
            (Slot::Float { at, len }, Buf::Float(x)) => {
                copy_in_parts(&mut self.float[at..at + len], &x)
            }
            (_, v) => self.own[id] = v,
        }
        Ok(())
    }

    /// Lends a `Half` buffer's vector to the op about to replace its contents (a separate
    /// buffer's storage; for an arena buffer a spare vector of an earlier write, or none: the
    /// op then allocates; the write copies it into the arena).
    pub(crate) fn take_half(&mut self, id: BufId, buffers: &[NetBuffer]) -> Result<Vec<T>> {
        self.touch(id);
        match (self.slots[id], &mut self.own[id]) {
            (Slot::Half { .. }, _) => Ok(self.spare.pop().unwrap_or_default()),
            (Slot::Own, Buf::Half(v)) => Ok(std::mem::take(v)),
            _ => Err(wrong_kind(&buffers[id].name, "FP16")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_in_parts_copies_every_element() {
        let n = 5 * COPY_PART / 2 + 3;
        let src: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let mut dst = vec![0u32; n];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a thread pool");
        pool.install(|| copy_in_parts(&mut dst, &src));
        assert_eq!(dst, src);
        let mut short = vec![0u32; 10];
        copy_in_parts(&mut short, &src[..10]);
        assert_eq!(short, src[..10]);
    }
}
