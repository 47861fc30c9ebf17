//! The memory a graph runs over: the caller's allocation table ([`MemoryMap`]), the byte
//! access the interpreter needs ([`Access`]), and [`HostMemory`], Vec-backed allocations with
//! no unsafe code (tests, and running a user's graph on the CPU).

/// One allocation: `len` bytes from `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// First byte's address.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Allocation {
    /// Whether `[addr, addr + bytes)` lies inside the allocation (overflow-checked).
    pub fn contains(&self, addr: u64, bytes: u64) -> bool {
        let Some(end) = addr.checked_add(bytes) else {
            return false;
        };
        addr >= self.base && end <= self.base.saturating_add(self.len)
    }
}

/// The caller's allocation table: which allocation an address falls in.
///
/// The simulated driver answers it from its own table; [`HostMemory`] from its buffers.
pub trait MemoryMap {
    /// The live allocation containing `addr`, or `None`.
    fn allocation(&self, addr: u64) -> Option<Allocation>;
}

/// Byte access over memory a [`MemoryMap`] describes. The interpreter calls `read` and
/// `write` only on ranges it has checked lie inside one allocation; implementations check
/// again and answer `false`/`None` rather than touch anything outside.
pub(crate) trait Access {
    /// The allocation table.
    fn map(&self) -> &dyn MemoryMap;
    /// A copy of `len` bytes from `addr`.
    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>>;
    /// Stores `bytes` at `addr`; false when the range is not mapped.
    fn write(&mut self, addr: u64, bytes: &[u8]) -> bool;
}

/// Host allocations handed out as addresses, 256-byte aligned like `cudaMalloc`'s.
#[derive(Debug, Default)]
pub struct HostMemory {
    allocs: Vec<HostAlloc>,
}

#[derive(Debug)]
struct HostAlloc {
    /// Storage with room for the alignment pad; never resized, so addresses stay put.
    storage: Vec<u8>,
    /// Offset of the aligned base in `storage`.
    offset: usize,
    len: usize,
}

impl HostAlloc {
    fn base(&self) -> u64 {
        self.storage.as_ptr() as u64 + self.offset as u64
    }
}

/// The alignment of [`HostMemory`]'s allocations.
const HOST_ALIGN: usize = 256;

impl HostMemory {
    /// No allocations.
    pub fn new() -> Self {
        Self::default()
    }

    /// A zeroed allocation of `len` bytes (at least one byte is reserved, so every
    /// allocation has its own address); returns its base address.
    pub fn alloc(&mut self, len: usize) -> u64 {
        let storage = vec![0u8; len.max(1) + HOST_ALIGN];
        let addr = storage.as_ptr() as usize;
        let offset = (HOST_ALIGN - addr % HOST_ALIGN) % HOST_ALIGN;
        let a = HostAlloc {
            storage,
            offset,
            len,
        };
        let base = a.base();
        self.allocs.push(a);
        base
    }

    /// An allocation holding a copy of `bytes`; returns its base address.
    pub fn alloc_from(&mut self, bytes: &[u8]) -> u64 {
        let base = self.alloc(bytes.len());
        let ok = self.write_bytes(base, bytes);
        debug_assert!(ok, "a fresh allocation holds its own bytes");
        base
    }

    fn find(&self, addr: u64, bytes: u64) -> Option<&HostAlloc> {
        self.allocs.iter().find(|a| {
            Allocation {
                base: a.base(),
                len: a.len as u64,
            }
            .contains(addr, bytes)
        })
    }

    /// A copy of `len` bytes from `addr`, or `None` when the range is not inside one
    /// allocation.
    pub fn read_bytes(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let a = self.find(addr, len as u64)?;
        let start = a.offset + (addr - a.base()) as usize;
        a.storage.get(start..start + len).map(<[u8]>::to_vec)
    }

    /// Stores `bytes` at `addr`; false (nothing written) when the range is not inside one
    /// allocation.
    pub fn write_bytes(&mut self, addr: u64, bytes: &[u8]) -> bool {
        let Some(i) = self.allocs.iter().position(|a| {
            Allocation {
                base: a.base(),
                len: a.len as u64,
            }
            .contains(addr, bytes.len() as u64)
        }) else {
            return false;
        };
        let a = &mut self.allocs[i];
        let start = a.offset + (addr - a.base()) as usize;
        match a.storage.get_mut(start..start + bytes.len()) {
            Some(dst) => {
                dst.copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }
}

impl MemoryMap for HostMemory {
    fn allocation(&self, addr: u64) -> Option<Allocation> {
        self.find(addr, 0).map(|a| Allocation {
            base: a.base(),
            len: a.len as u64,
        })
    }
}

impl Access for HostMemory {
    fn map(&self) -> &dyn MemoryMap {
        self
    }
    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        self.read_bytes(addr, len)
    }
    fn write(&mut self, addr: u64, bytes: &[u8]) -> bool {
        self.write_bytes(addr, bytes)
    }
}
