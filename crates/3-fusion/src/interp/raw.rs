//! The interpreter's only raw-pointer code: byte copies from and to addresses the caller's
//! [`MemoryMap`] vouches for (the simulated device's host-backed allocations).
#![allow(unsafe_code)]

use super::memory::{Access, MemoryMap};

/// Byte access at raw addresses, each range re-checked against the map before it is touched.
pub(super) struct RawAccess<'a> {
    map: &'a dyn MemoryMap,
}

impl<'a> RawAccess<'a> {
    /// # Safety
    /// Every allocation `map` reports is live host memory, readable and writable for its
    /// whole length, that nothing else reads or writes while this value exists.
    pub(super) unsafe fn new(map: &'a dyn MemoryMap) -> Self {
        RawAccess { map }
    }

    fn mapped(&self, addr: u64, len: usize) -> bool {
        self.map
            .allocation(addr)
            .is_some_and(|a| a.contains(addr, len as u64))
    }
}

impl Access for RawAccess<'_> {
    fn map(&self) -> &dyn MemoryMap {
        self.map
    }

    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        if !self.mapped(addr, len) {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: `[addr, addr + len)` lies inside an allocation the map reports, which the
        // constructor's contract makes live, readable and unaliased; `out` is a fresh buffer
        // of `len` bytes, so the ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
        Some(out)
    }

    fn write(&mut self, addr: u64, bytes: &[u8]) -> bool {
        if !self.mapped(addr, bytes.len()) {
            return false;
        }
        // SAFETY: `[addr, addr + len)` lies inside an allocation the map reports, which the
        // constructor's contract makes live, writable and unaliased; `bytes` is Rust-owned
        // memory, not part of any mapped allocation the interpreter writes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
        true
    }
}
