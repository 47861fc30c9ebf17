//! A layer's device buffers for [`CbrLayer::run_gpu`](super::CbrLayer::run_gpu): borrowed
//! cudarc slices under typed keys, in two namespaces (this layer's and the previous layer's).
//!
//! The table borrows every buffer mutably for its lifetime, so a buffer cannot be freed,
//! moved or used elsewhere while a layer may still be handed its address, and the element
//! type is checked by the compiler ([`Key<T>`]). Addresses are taken only when a pass runs,
//! through cudarc's `DevicePtrMut`: with cudarc's event tracking on (several streams in a
//! context), the pass waits for the buffers' earlier work on other streams and records its
//! own use when it ends, as cudarc's own kernels do.
#![allow(unsafe_code)]

use super::buffers::{missing, HostBuffer};
use super::keys::{self, Key};
use super::BufferSpec;
use crate::error::{Error, Result};
use crate::exec::{Bindings, DeviceElement, Handle};
use crate::graph::{DataType, TensorId};
use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, SyncOnDrop};
use half::f16;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// Which layer's namespace a buffer is bound in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// This layer's buffers ([`CbrLayer::buffers`](super::CbrLayer::buffers)).
    This,
    /// The previous layer's ([`CbrLayer::prev_buffers`](super::CbrLayer::prev_buffers)).
    Prev,
}

/// A device buffer as a plan binds it: address, bytes from there, element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuffer {
    /// Device address.
    pub ptr: u64,
    /// Bytes available from `ptr`.
    pub bytes: usize,
    /// Element type.
    pub dtype: DataType,
}

/// Device memory a table borrows.
trait Memory {
    fn len_bytes(&self) -> usize;
    /// The address, with cudarc's ordering guard for a write on `stream`.
    fn ptr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>);
}

impl<T> Memory for CudaSlice<T> {
    fn len_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
    fn ptr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        self.device_ptr_mut(stream)
    }
}

impl<T> Memory for CudaViewMut<'_, T> {
    fn len_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
    fn ptr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        self.device_ptr_mut(stream)
    }
}

impl<M: Memory + ?Sized> Memory for &mut M {
    fn len_bytes(&self) -> usize {
        (**self).len_bytes()
    }
    fn ptr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        (**self).ptr_mut(stream)
    }
}

/// A byte allocation bound once to a table, in which several buffers are placed
/// ([`DeviceBuffers::arena`], [`DeviceBuffers::place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaId(usize);

#[derive(Debug, Clone, Copy)]
enum Place {
    /// `offset` bytes into a borrowed memory.
    Memory { index: usize, offset: usize },
    /// A raw address the caller vouched for ([`DeviceBuffers::insert_raw`]).
    Raw(u64),
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    place: Place,
    bytes: usize,
    dtype: DataType,
}

/// A layer's device buffers by typed key, borrowed for `'a`.
///
/// ```
/// use cudnn_cbr_fusion::cbr::{keys, DeviceBuffers};
/// # fn demo(x: &mut cudarc::driver::CudaSlice<half::f16>,
/// #         w: &mut cudarc::driver::CudaSlice<half::f16>,
/// #         y: &mut cudarc::driver::CudaSlice<half::f16>,
/// #         sum: &mut cudarc::driver::CudaSlice<f32>) {
/// let mut io = DeviceBuffers::new();
/// io.bind(keys::X, x).bind(keys::W, w).bind(keys::Y, y).bind(keys::SUM, sum);
/// # }
/// ```
///
/// A buffer of the wrong element type does not compile:
/// ```compile_fail
/// use cudnn_cbr_fusion::cbr::{keys, DeviceBuffers};
/// fn demo(sum: &mut cudarc::driver::CudaSlice<half::f16>) {
///     let mut io = DeviceBuffers::new();
///     io.bind(keys::SUM, sum); // Σy is FP32
/// }
/// ```
///
/// Nor does a buffer borrowed elsewhere while the table lives:
/// ```compile_fail
/// use cudnn_cbr_fusion::cbr::{keys, DeviceBuffers};
/// fn demo(y: &mut cudarc::driver::CudaSlice<half::f16>) {
///     let mut io = DeviceBuffers::new();
///     io.bind(keys::Y, y);
///     let peek = y.len(); // `y` is lent to the table
///     io.bind(keys::DY, y); // and cannot be bound twice
///     let _ = (peek, io);
/// }
/// ```
///
/// Nor a table that outlives its buffers:
/// ```compile_fail
/// use cudnn_cbr_fusion::cbr::{keys, DeviceBuffers};
/// fn demo(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> DeviceBuffers<'static> {
///     let mut y = stream.alloc_zeros::<half::f16>(8).unwrap();
///     let mut io = DeviceBuffers::new();
///     io.bind(keys::Y, &mut y);
///     io // `y` is freed here
/// }
/// ```
#[derive(Default)]
pub struct DeviceBuffers<'a> {
    memories: Vec<Box<dyn Memory + 'a>>,
    this: BTreeMap<&'static str, Entry>,
    prev: BTreeMap<&'static str, Entry>,
}

impl fmt::Debug for DeviceBuffers<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffers")
            .field("memories", &self.memories.len())
            .field("this", &self.this)
            .field("prev", &self.prev)
            .finish()
    }
}

impl<'a> DeviceBuffers<'a> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    fn side_mut(&mut self, side: Side) -> &mut BTreeMap<&'static str, Entry> {
        match side {
            Side::This => &mut self.this,
            Side::Prev => &mut self.prev,
        }
    }

    fn push_memory(&mut self, m: Box<dyn Memory + 'a>) -> usize {
        self.memories.push(m);
        self.memories.len() - 1
    }

    fn bind_memory(
        &mut self,
        side: Side,
        name: &'static str,
        m: Box<dyn Memory + 'a>,
        dtype: DataType,
    ) -> &mut Self {
        let bytes = m.len_bytes();
        let index = self.push_memory(m);
        let entry = Entry {
            place: Place::Memory { index, offset: 0 },
            bytes,
            dtype,
        };
        self.side_mut(side).insert(name, entry);
        self
    }

    /// Binds this layer's buffer `key` (replacing an earlier binding of that key).
    pub fn bind<T: DeviceElement>(&mut self, key: Key<T>, buf: &'a mut CudaSlice<T>) -> &mut Self {
        self.bind_memory(Side::This, key.name(), Box::new(buf), T::DTYPE)
    }

    /// Binds the previous layer's buffer `key` (its `y`, BN statistics and parameters, and
    /// the gradients this layer's backward writes for it).
    pub fn bind_prev<T: DeviceElement>(
        &mut self,
        key: Key<T>,
        buf: &'a mut CudaSlice<T>,
    ) -> &mut Self {
        self.bind_memory(Side::Prev, key.name(), Box::new(buf), T::DTYPE)
    }

    /// Binds a view (part of a larger allocation) under `key` in `side`'s namespace.
    pub fn bind_view<T: DeviceElement>(
        &mut self,
        side: Side,
        key: Key<T>,
        view: CudaViewMut<'a, T>,
    ) -> &mut Self {
        self.bind_memory(side, key.name(), Box::new(view), T::DTYPE)
    }

    /// Borrows an allocation in which buffers are then placed with
    /// [`DeviceBuffers::place`] (one borrow for many buffers: a network's arena, or amp's
    /// regions, where one allocation holds several of a layer's buffers).
    pub fn arena<T>(&mut self, memory: &'a mut CudaSlice<T>) -> ArenaId {
        ArenaId(self.push_memory(Box::new(memory)))
    }

    /// Places the buffer `name` at `offset..offset + bytes` of an arena, as `dtype`.
    ///
    /// # Errors
    /// [`Error::Buffer`] when `name` has no key, `dtype` is not its key's type, or the range
    /// is outside the arena.
    pub fn place(
        &mut self,
        side: Side,
        name: &'static str,
        arena: ArenaId,
        offset: usize,
        bytes: usize,
        dtype: DataType,
    ) -> Result<&mut Self> {
        let want = keys::dtype_of(name).ok_or_else(|| missing(name, "has no key"))?;
        if want != dtype {
            return Err(missing(name, &format!("is {want:?}, placed as {dtype:?}")));
        }
        let len = self
            .memories
            .get(arena.0)
            .map(|m| m.len_bytes())
            .ok_or_else(|| missing(name, "is placed in an arena of another table"))?;
        if offset.checked_add(bytes).is_none_or(|end| end > len) {
            return Err(missing(
                name,
                &format!("is placed at bytes {offset}+{bytes}, past its arena's {len}"),
            ));
        }
        let entry = Entry {
            place: Place::Memory {
                index: arena.0,
                offset,
            },
            bytes,
            dtype,
        };
        self.side_mut(side).insert(name, entry);
        Ok(self)
    }

    /// Adds a buffer by raw device address.
    ///
    /// # Safety
    /// Until the last pass run with this table has finished on the device:
    /// - `buffer.ptr .. buffer.ptr + buffer.bytes` is one live device allocation (or part
    ///   of one) of the handle's context, holding `buffer.dtype` elements;
    /// - nothing frees it, and no other stream reads or writes it unless ordered with the
    ///   handle's stream by the caller (cudarc's event tracking cannot see raw addresses);
    /// - it overlaps no other buffer the same pass writes, unless the graphs allow that.
    pub unsafe fn insert_raw(
        &mut self,
        side: Side,
        name: &'static str,
        buffer: DeviceBuffer,
    ) -> &mut Self {
        let entry = Entry {
            place: Place::Raw(buffer.ptr),
            bytes: buffer.bytes,
            dtype: buffer.dtype,
        };
        self.side_mut(side).insert(name, entry);
        self
    }

    /// Whether `name` is bound in `side`'s namespace.
    pub fn contains(&self, side: Side, name: &str) -> bool {
        match side {
            Side::This => self.this.contains_key(name),
            Side::Prev => self.prev.contains_key(name),
        }
    }

    /// Whether anything is bound in the previous layer's namespace.
    pub fn has_prev(&self) -> bool {
        !self.prev.is_empty()
    }

    /// Every buffer's address for a pass on `stream`. Each borrowed memory is asked once:
    /// cudarc makes `stream` wait for its earlier work elsewhere, and the returned guards
    /// record this use when dropped (after the pass is enqueued).
    pub(crate) fn resolve<'s>(&'s mut self, stream: &'s CudaStream) -> Resolved<'s> {
        let mut bases = Vec::with_capacity(self.memories.len());
        let mut guards = Vec::with_capacity(self.memories.len());
        for m in self.memories.iter_mut() {
            let (ptr, guard) = m.ptr_mut(stream);
            bases.push(ptr);
            guards.push(guard);
        }
        let resolve = |map: &BTreeMap<&'static str, Entry>| {
            map.iter()
                .map(|(&name, e)| {
                    let ptr = match e.place {
                        Place::Memory { index, offset } => bases[index] + offset as u64,
                        Place::Raw(ptr) => ptr,
                    };
                    let buf = DeviceBuffer {
                        ptr,
                        bytes: e.bytes,
                        dtype: e.dtype,
                    };
                    (name, buf)
                })
                .collect()
        };
        Resolved {
            this: resolve(&self.this),
            prev: resolve(&self.prev),
            _guards: guards,
        }
    }
}

/// A table's addresses for one pass, with cudarc's ordering guards (dropped after the pass).
pub(crate) struct Resolved<'s> {
    this: BTreeMap<&'static str, DeviceBuffer>,
    prev: BTreeMap<&'static str, DeviceBuffer>,
    _guards: Vec<SyncOnDrop<'s>>,
}

impl Resolved<'_> {
    /// A buffer, or a typed error naming it.
    pub(crate) fn get(&self, side: Side, name: &str) -> Result<DeviceBuffer> {
        let (map, shown) = match side {
            Side::This => (&self.this, name.to_string()),
            Side::Prev => (&self.prev, format!("prev.{name}")),
        };
        map.get(name)
            .copied()
            .ok_or_else(|| missing(&shown, "is not given"))
    }

    /// Binds the buffer to a plan's tensor `t`.
    pub(crate) fn bind(
        &self,
        b: &mut Bindings<'_>,
        t: TensorId,
        side: Side,
        name: &str,
    ) -> Result<()> {
        let buf = self.get(side, name)?;
        // SAFETY: the address comes from memory the table borrows mutably for at least as
        // long as `self` lives (or from `insert_raw`, whose caller vouched for it), and the
        // guards in `self` order its use on the handle's stream with cudarc's tracking; the
        // bindings are checked (type, size, alignment) before anything runs.
        unsafe { b.bind_raw(t, buf.ptr, buf.bytes, buf.dtype) }?;
        Ok(())
    }

    /// Zeroes the buffer on the handle's stream.
    pub(crate) fn zero(&self, handle: &Handle, side: Side, name: &str) -> Result<()> {
        let buf = self.get(side, name)?;
        // SAFETY: as in `bind`: `buf.bytes` bytes at `buf.ptr` are borrowed memory of the
        // table (its size was taken from the allocation or checked by `place`).
        unsafe { handle.zero_device_bytes(buf.ptr, buf.bytes) }
    }

    /// Writes `values` (FP16, from the host) over the start of this layer's `name` and waits
    /// for the copy (evaluation mode's coefficients, [`super::Pass::Eval`]).
    pub(crate) fn upload_half(&self, handle: &Handle, name: &str, values: &[f16]) -> Result<()> {
        let dst = self.get(Side::This, name)?;
        let bytes = 2 * values.len();
        if dst.dtype != DataType::Half || dst.bytes < bytes {
            return Err(missing(
                name,
                &format!(
                    "must hold {} FP16 values, has {} bytes of {}",
                    values.len(),
                    dst.bytes,
                    dst.dtype
                ),
            ));
        }
        if values.is_empty() {
            return Ok(());
        }
        let stream = handle.stream();
        let upload = stream
            .clone_htod(values)
            .map_err(|e| crate::exec::driver("upload FP16 values", e))?;
        {
            let (src, _record) = upload.device_ptr(stream);
            // SAFETY: `dst` is borrowed memory of the table holding at least `bytes` bytes
            // (checked above); `src` is `upload`'s own allocation of exactly `bytes` bytes and
            // cannot overlap it; the copy is ordered on the handle's stream, which cudarc's
            // guard `_record` marks as `upload`'s last user.
            unsafe { handle.copy_device_bytes(dst.ptr, src, bytes) }?;
        }
        // `upload` is freed when dropped: the copy must have run by then.
        stream
            .synchronize()
            .map_err(|e| crate::exec::driver("wait for an upload", e))
    }

    /// Copies this layer's `src` over `dst` (the running-statistics copy after a forward).
    pub(crate) fn copy(&self, handle: &Handle, dst: &str, src: &str) -> Result<()> {
        let (d, s) = (self.get(Side::This, dst)?, self.get(Side::This, src)?);
        if d.dtype != s.dtype {
            return Err(missing(
                dst,
                &format!("is {:?}, `{src}` is {:?}", d.dtype, s.dtype),
            ));
        }
        let (d_end, s_end) = (d.ptr + d.bytes as u64, s.ptr + s.bytes as u64);
        if d.ptr < s_end && s.ptr < d_end {
            return Err(missing(dst, &format!("overlaps `{src}`")));
        }
        // SAFETY: both ranges are borrowed memory of the table (as in `bind`) and were just
        // checked not to overlap; the copy is ordered on the handle's stream.
        unsafe { handle.copy_device_bytes(d.ptr, s.ptr, d.bytes.min(s.bytes)) }
    }
}

/// Device buffers a layer allocated for itself (zeroed), one allocation per buffer.
#[derive(Debug)]
pub struct OwnedDeviceBuffers {
    slices: Vec<(BufferSpec, CudaSlice<u8>)>,
}

impl OwnedDeviceBuffers {
    /// Allocates a zeroed buffer for every spec on `stream`.
    pub fn alloc(specs: &[BufferSpec], stream: &Arc<CudaStream>) -> Result<Self> {
        let mut slices = Vec::with_capacity(specs.len());
        for spec in specs {
            let slice =
                stream
                    .alloc_zeros::<u8>(spec.bytes().max(1))
                    .map_err(|e| Error::Driver {
                        what: format!("allocate buffer `{}`", spec.name),
                        message: e.to_string(),
                    })?;
            slices.push((spec.clone(), slice));
        }
        Ok(OwnedDeviceBuffers { slices })
    }

    /// Binds every buffer into `io` in `side`'s namespace.
    pub fn bind_into<'a>(&'a mut self, io: &mut DeviceBuffers<'a>, side: Side) -> Result<()> {
        for (spec, slice) in &mut self.slices {
            let arena = io.arena(slice);
            io.place(side, spec.name, arena, 0, spec.bytes(), spec.dtype)?;
        }
        Ok(())
    }

    /// A table of these buffers as this layer's, and `prev`'s as the previous layer's.
    pub fn io<'a>(
        &'a mut self,
        prev: Option<&'a mut OwnedDeviceBuffers>,
    ) -> Result<DeviceBuffers<'a>> {
        let mut io = DeviceBuffers::new();
        self.bind_into(&mut io, Side::This)?;
        if let Some(p) = prev {
            p.bind_into(&mut io, Side::Prev)?;
        }
        Ok(io)
    }

    /// The raw byte slice of a buffer.
    pub fn slice(&self, name: &str) -> Option<&CudaSlice<u8>> {
        self.slices
            .iter()
            .find(|(s, _)| s.name == name)
            .map(|(_, s)| s)
    }

    /// The raw byte slice of a buffer, for writing.
    pub fn slice_mut(&mut self, name: &str) -> Option<&mut CudaSlice<u8>> {
        self.slices
            .iter_mut()
            .find(|(s, _)| s.name == name)
            .map(|(_, s)| s)
    }

    /// Copies a host buffer in (lengths and types must match the spec).
    pub fn upload(
        &mut self,
        name: &str,
        host: &HostBuffer,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let bytes: Vec<u8> = match host {
            HostBuffer::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            HostBuffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        let slice = self
            .slice_mut(name)
            .ok_or_else(|| missing(name, "is not a buffer of this layer"))?;
        if slice.len() < bytes.len() {
            return Err(missing(name, "is smaller than the host data"));
        }
        stream
            .memcpy_htod(&bytes, slice)
            .map_err(|e| Error::Driver {
                what: format!("upload `{name}`"),
                message: e.to_string(),
            })
    }

    /// Copies a buffer out as the spec's type.
    pub fn download(&self, spec: &BufferSpec, stream: &Arc<CudaStream>) -> Result<HostBuffer> {
        let slice = self
            .slice(spec.name)
            .ok_or_else(|| missing(spec.name, "is not a buffer of this layer"))?;
        let bytes: Vec<u8> = stream.clone_dtoh(slice).map_err(|e| Error::Driver {
            what: format!("download `{}`", spec.name),
            message: e.to_string(),
        })?;
        Ok(match spec.dtype {
            DataType::Half => HostBuffer::F16(
                bytes[..spec.bytes()]
                    .chunks_exact(2)
                    .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            ),
            _ => HostBuffer::F32(
                bytes[..spec.bytes()]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
        })
    }
}

/// Synchronized BN's device scratch ([`super::CbrLayer::run_gpu_synced`]): two runs of
/// per-channel FP32 values copied out of a layer's buffers, summed over the replicas in place,
/// then copied back or read by our coefficients kernel. The layer's own buffers are never
/// handed to the collective.
pub(crate) struct SyncScratch {
    values: CudaSlice<f32>,
    stream: Arc<CudaStream>,
}

impl SyncScratch {
    /// `len` zeroed FP32 values on `stream`.
    pub(crate) fn new(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let values = stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| crate::exec::driver("allocate synchronized BN's scratch", e))?;
        Ok(SyncScratch {
            values,
            stream: stream.clone(),
        })
    }

    /// The values, for the collective.
    pub(crate) fn slice_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.values
    }

    /// The two per-channel FP32 buffers `runs` (`n` values each) checked against the scratch,
    /// each with its byte offset in it.
    fn runs(
        &self,
        r: &Resolved<'_>,
        runs: [(Side, &'static str); 2],
        n: usize,
    ) -> Result<[(DeviceBuffer, usize); 2]> {
        if 2 * n > self.values.len() {
            return Err(missing(
                "synchronized BN's scratch",
                &format!("holds {} values, {} asked", self.values.len(), 2 * n),
            ));
        }
        let mut out = [
            (r.get(runs[0].0, runs[0].1)?, 0),
            (r.get(runs[1].0, runs[1].1)?, 0),
        ];
        for (i, ((buf, at), (_, name))) in out.iter_mut().zip(runs).enumerate() {
            if buf.dtype != DataType::Float || buf.bytes < 4 * n {
                return Err(missing(
                    name,
                    &format!(
                        "must hold {n} FP32 values, has {} bytes of {}",
                        buf.bytes, buf.dtype
                    ),
                ));
            }
            *at = 4 * n * i;
        }
        Ok(out)
    }

    /// Copies the two buffers `runs` (`n` FP32 values each) into the scratch, one after the
    /// other, on the handle's stream.
    pub(crate) fn gather(
        &mut self,
        handle: &Handle,
        r: &Resolved<'_>,
        runs: [(Side, &'static str); 2],
        n: usize,
    ) -> Result<()> {
        self.transfer(handle, r, runs, n, true)
    }

    /// Copies the scratch's two runs back over the buffers `runs`.
    pub(crate) fn scatter(
        &mut self,
        handle: &Handle,
        r: &Resolved<'_>,
        runs: [(Side, &'static str); 2],
        n: usize,
    ) -> Result<()> {
        self.transfer(handle, r, runs, n, false)
    }

    fn transfer(
        &mut self,
        handle: &Handle,
        r: &Resolved<'_>,
        runs: [(Side, &'static str); 2],
        n: usize,
        inward: bool,
    ) -> Result<()> {
        let checked = self.runs(r, runs, n)?;
        let (base, _record) = self.values.device_ptr_mut(&self.stream);
        for (buf, at) in checked {
            let scratch = base + at as u64;
            let (dst, src) = if inward {
                (scratch, buf.ptr)
            } else {
                (buf.ptr, scratch)
            };
            // SAFETY: the buffer is borrowed memory of the table holding at least `4n` bytes
            // (checked in `runs`); the scratch run is this value's own allocation, `2n` values
            // long (checked); they cannot overlap; the copy is ordered on the handle's stream,
            // which cudarc's guard `_record` marks as the scratch's last user.
            unsafe { handle.copy_device_bytes(dst, src, 4 * n) }?;
        }
        Ok(())
    }

    /// Our `cbr_dbn_coefficients` kernel over `inputs` (γ, 1/σ, μ), the scratch's two runs as
    /// the summed dγ and dβ, and `-1/count`, into `outputs` (A, B, C), `n` channels.
    pub(crate) fn coefficients(
        &mut self,
        handle: &Handle,
        inputs: [DeviceBuffer; 3],
        neg_inv_count: f32,
        outputs: [DeviceBuffer; 3],
        n: usize,
    ) -> Result<()> {
        if 2 * n > self.values.len() {
            return Err(missing("synchronized BN's scratch", "is too short"));
        }
        let (base, _record) = self.values.device_ptr_mut(&self.stream);
        let run = |i: u64| DeviceBuffer {
            ptr: base + 4 * n as u64 * i,
            bytes: 4 * n,
            dtype: DataType::Float,
        };
        let [gamma, inv_std, mean] = inputs;
        super::kernels::launch_dbn_coefficients(
            handle,
            [gamma, inv_std, mean, run(0), run(1)],
            neg_inv_count,
            outputs,
            n,
        )
    }
}
