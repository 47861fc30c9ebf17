//! Where the CPU executor keeps a compiled network's buffers: one host vector each
//! ([`Arena::Separate`]), or the step-long buffers in a shared arena laid out by their
//! lifetimes ([`Arena::Shared`]: [`super::liveness`], the same interval assignment as the
//! GPU's tensor arena), so that buffers never alive together share memory.
//!
//! The shared arena is two pools, one per storage kind (`Half` buffers as `T`, `Float` ones
//! as `T::Acc`): the element types differ per precision mode, and typed pools need no casts.
//! An op writes an FP16 activation straight into its range ([`HostStore::write_half`]: the
//! pool split around the range, so the op reads the other buffers while it writes, all
//! borrow-checked); other writes copy into the range (in parts over the threads). A read
//! checks that no buffer sharing its range was written after it ([`StoreRead::check_read`]):
//! a lifetime the plan got wrong is a typed error naming both buffers, never a silently stale
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
}

/// Read access to a [`HostStore`]'s buffers, while one `Half` arena range may be lent to an op
/// for writing ([`HostStore::write_half`]): the `Half` pool is seen as the parts before and
/// after that range.
#[derive(Debug)]
pub(crate) struct StoreRead<'s, T: Element> {
    slots: &'s [Slot],
    own: &'s [Buf<T>],
    float: &'s [T::Acc],
    aliases: &'s [Vec<BufId>],
    versions: &'s [u64],
    /// The `Half` pool before the lent range, and after it.
    before: &'s [T],
    after: &'s [T],
    /// The lent range (`at`, `len`, buffer); `None`: all of the pool is in `before`.
    lent: Option<(usize, usize, BufId)>,
}

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
        })
    }

    /// Read access to every buffer.
    fn read(&self) -> StoreRead<'_, T> {
        StoreRead {
            slots: &self.slots,
            own: &self.own,
            float: &self.float,
            aliases: &self.aliases,
            versions: &self.versions,
            before: &self.half,
            after: &[],
            lent: None,
        }
    }

    /// Whether buffer `id` lives in the `Half` pool of the shared arena.
    pub(crate) fn in_half_arena(&self, id: BufId) -> bool {
        matches!(self.slots[id], Slot::Half { .. })
    }

    /// Writes `len` values into `Half` arena buffer `id` in place: `f(range, reads)` overwrites
    /// every element of the buffer's range and reads the other buffers through `reads` (a read
    /// of one sharing bytes with `id` is an [`Error::Buffer`]).
    ///
    /// # Errors
    /// `f`'s; [`Error::Buffer`] when `id` is not in the `Half` pool or `len` is not its length.
    pub(crate) fn write_half(
        &mut self,
        id: BufId,
        len: usize,
        buffers: &[NetBuffer],
        f: impl FnOnce(&mut [T], &StoreRead<'_, T>) -> Result<()>,
    ) -> Result<()> {
        let Slot::Half { at, len: n } = self.slots[id] else {
            return Err(wrong_kind(&buffers[id].name, "FP16 arena"));
        };
        if len != n {
            return Err(wrong_len(&buffers[id].name, len, n));
        }
        self.touch(id);
        if n == 0 {
            return f(&mut [], &self.read());
        }
        // The pool split around the range (`assign_tensor_offsets` keeps every range inside
        // the pool, whose length is the plan's total).
        let (before, rest) = self.half.split_at_mut(at);
        let (range, after) = rest.split_at_mut(n);
        let reads = StoreRead {
            slots: &self.slots,
            own: &self.own,
            float: &self.float,
            aliases: &self.aliases,
            versions: &self.versions,
            before,
            after,
            lent: Some((at, n, id)),
        };
        f(range, &reads)
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

    /// A `Half` buffer.
    pub(crate) fn half(&self, id: BufId, buffers: &[NetBuffer]) -> Result<&[T]> {
        self.read().half(id, buffers)
    }

    /// A `Float` buffer.
    pub(crate) fn float(&self, id: BufId, buffers: &[NetBuffer]) -> Result<&[T::Acc]> {
        self.read().float(id, buffers)
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
                copy_in_parts(&mut self.half[at..at + len], &x)
            }
            (Slot::Float { at, len }, Buf::Float(x)) => {
                copy_in_parts(&mut self.float[at..at + len], &x)
            }
            (_, v) => self.own[id] = v,
        }
        Ok(())
    }

    /// Lends a `Half` buffer's vector to the op about to replace its contents (a separate
    /// buffer's storage; none for an arena buffer, which an op writes in place instead,
    /// [`HostStore::write_half`]: the op then allocates, and the write copies into the arena).
    pub(crate) fn take_half(&mut self, id: BufId, buffers: &[NetBuffer]) -> Result<Vec<T>> {
        self.touch(id);
        match (self.slots[id], &mut self.own[id]) {
            (Slot::Half { .. }, _) => Ok(Vec::new()),
            (Slot::Own, Buf::Half(v)) => Ok(std::mem::take(v)),
            _ => Err(wrong_kind(&buffers[id].name, "FP16")),
        }
    }
}

impl<'s, T: Element> StoreRead<'s, T> {
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

    /// Elements `at..at + len` of the `Half` pool, unless they meet the lent range.
    fn half_range(
        &self,
        id: BufId,
        at: usize,
        len: usize,
        buffers: &[NetBuffer],
    ) -> Result<&'s [T]> {
        let Some((l_at, l_len, lent)) = self.lent else {
            return Ok(&self.before[at..at + len]);
        };
        if at + len <= l_at {
            Ok(&self.before[at..at + len])
        } else if at >= l_at + l_len {
            let from = at - (l_at + l_len);
            Ok(&self.after[from..from + len])
        } else {
            // (Reached only if the aliases missed an overlap: `write_half` stamps the lent
            // buffer, so `check_read` refuses a buffer that shares its bytes first.)
            Err(Error::Buffer {
                name: buffers[id].name.clone(),
                problem: format!(
                    "shares arena bytes with `{}`, which the op is writing",
                    buffers[lent].name
                ),
            })
        }
    }

    /// A `Half` buffer.
    pub(crate) fn half(&self, id: BufId, buffers: &[NetBuffer]) -> Result<&'s [T]> {
        match (self.slots[id], &self.own[id]) {
            (Slot::Half { at, len }, _) => {
                self.check_read(id, buffers)?;
                self.half_range(id, at, len, buffers)
            }
            (Slot::Own, Buf::Half(v)) => Ok(v),
            _ => Err(wrong_kind(&buffers[id].name, "FP16")),
        }
    }

    /// A `Float` buffer.
    pub(crate) fn float(&self, id: BufId, buffers: &[NetBuffer]) -> Result<&'s [T::Acc]> {
        match (self.slots[id], &self.own[id]) {
            (Slot::Float { at, len }, _) => {
                self.check_read(id, buffers)?;
                Ok(&self.float[at..at + len])
            }
            (Slot::Own, Buf::Float(v)) => Ok(v),
            _ => Err(wrong_kind(&buffers[id].name, "FP32")),
        }
    }

    /// Buffer `id`'s write stamp.
    pub(crate) fn stamp(&self, id: BufId) -> u64 {
        self.versions[id]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::compile::BufferRole;
    use half::f16;

    /// A store over a 40-element `Half` pool: `a` 0..10, `b` 10..20, `c` 20..30, `d` 20..40
    /// (sharing bytes with `c` and `e`), `e` 30..40, and `f` an FP32 vector of its own; the
    /// pool holds each element's index. `aliases` as the plan's, or none (a defective plan).
    fn store(aliases: bool) -> (HostStore<f16>, Vec<NetBuffer>) {
        let half = |at, len| Slot::Half { at, len };
        let slots = vec![
            half(0, 10),
            half(10, 10),
            half(20, 10),
            half(20, 20),
            half(30, 10),
            Slot::Own,
        ];
        let buffers = ["a", "b", "c", "d", "e", "f"]
            .iter()
            .zip(&slots)
            .map(|(name, slot)| NetBuffer {
                name: (*name).into(),
                dtype: if matches!(slot, Slot::Own) {
                    DataType::Float
                } else {
                    DataType::Half
                },
                elems: match slot {
                    Slot::Half { len, .. } => *len,
                    _ => 3,
                },
                role: BufferRole::Activation,
            })
            .collect();
        let aliases = if aliases {
            vec![vec![], vec![], vec![3], vec![2, 4], vec![3], vec![]]
        } else {
            vec![Vec::new(); 6]
        };
        let mut own = vec![Buf::Half(Vec::new()); 5];
        own.push(Buf::Float(vec![1.5; 3]));
        let store = HostStore {
            slots,
            own,
            half: (0..40).map(|i| f16::from_f32(i as f32)).collect(),
            float: Vec::new(),
            aliases,
            versions: (1..=6).collect(),
            clock: 6,
        };
        (store, buffers)
    }

    fn values(v: &[f16]) -> Vec<f32> {
        v.iter().map(|h| h.to_f32()).collect()
    }

    #[test]
    fn an_op_writes_its_arena_range_in_place_while_it_reads_the_others() {
        let (mut s, bufs) = store(true);
        let index = |r: std::ops::Range<usize>| r.map(|i| i as f32).collect::<Vec<_>>();
        s.write_half(2, 10, &bufs, |range, reads| {
            // The range is `c`'s, in place: it holds the pool's values there.
            assert_eq!(values(range), index(20..30));
            // Buffers before and after it read as they are.
            assert_eq!(values(reads.half(0, &bufs)?), index(0..10));
            assert_eq!(values(reads.half(1, &bufs)?), index(10..20));
            assert_eq!(values(reads.half(4, &bufs)?), index(30..40));
            assert_eq!(reads.float(5, &bufs)?, [1.5; 3]);
            // `d` shares bytes with `c`: its read is refused, naming `c`.
            let e = reads.half(3, &bufs).unwrap_err().to_string();
            assert!(e.contains('d') && e.contains("`c`"), "{e}");
            for (i, v) in range.iter_mut().enumerate() {
                *v = f16::from_f32(100.0 + i as f32);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(values(s.half(2, &bufs).unwrap()), index(100..110));
        assert_eq!(values(s.half(4, &bufs).unwrap()), index(30..40));
        // `d` was overwritten by `c`'s write.
        assert!(s.half(3, &bufs).is_err());
        // Wrong lengths and buffers outside the `Half` pool are typed errors; the op never runs.
        let never = |_: &mut [f16], _: &StoreRead<'_, f16>| -> Result<()> {
            unreachable!("the op of a refused write ran")
        };
        assert!(s.write_half(2, 9, &bufs, never).is_err());
        assert!(s.write_half(5, 3, &bufs, never).is_err());
    }

    #[test]
    fn a_plan_that_missed_an_overlap_gives_a_typed_error_not_aliased_slices() {
        // Without the aliases, the stamps cannot tell; the split around the lent range does.
        let (mut s, bufs) = store(false);
        let r = s.write_half(2, 10, &bufs, |_, reads| {
            let e = reads.half(3, &bufs).unwrap_err().to_string();
            assert!(
                e.contains("which the op is writing") && e.contains("`c`"),
                "{e}"
            );
            assert!(reads.half(4, &bufs).is_ok());
            Ok(())
        });
        assert!(r.is_ok());
    }

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
