//! [`DevRange`] and [`DevRangeMut`]: byte ranges of device buffers checked to lie inside
//! them, and the element and S-range checks of the launches.

use std::fmt;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::error::{AmpError, ExecError};
use crate::plan::ByteRange;
use crate::range::s_layout;

// Named only by doc links.
#[cfg(doc)]
use cudarc::driver::CudaSlice;

/// A read-only byte range of a device buffer ([`CudaSlice`], [`cudarc::driver::CudaView`] or
/// [`cudarc::driver::CudaViewMut`] of bytes), checked to lie inside it.
pub struct DevRange<'a> {
    buf: &'a dyn DevicePtr<u8>,
    pub(super) range: ByteRange,
}

/// A writable byte range of a device buffer, checked to lie inside it.
pub struct DevRangeMut<'a> {
    buf: &'a mut dyn DevicePtrMut<u8>,
    pub(super) range: ByteRange,
}

impl fmt::Debug for DevRange<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevRange")
            .field("buffer_len", &self.buf.len())
            .field("range", &self.range)
            .finish()
    }
}

impl fmt::Debug for DevRangeMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevRangeMut")
            .field("buffer_len", &self.buf.len())
            .field("range", &self.range)
            .finish()
    }
}

fn check_bounds(range: ByteRange, len: usize) -> Result<(), AmpError> {
    if range.start > range.end || range.end > len {
        return Err(ExecError::OutOfBounds {
            op: "device range",
            what: "buffer".into(),
            start: range.start,
            end: range.end,
            len,
        }
        .into());
    }
    Ok(())
}

/// Elements of `dtype` in `range`, which must start and end on element boundaries.
pub(super) fn elems_of(
    op: &'static str,
    what: &'static str,
    range: ByteRange,
    size: usize,
) -> Result<usize, AmpError> {
    if !range.start.is_multiple_of(size) || !range.end.is_multiple_of(size) {
        return Err(ExecError::Misaligned {
            op,
            what: what.into(),
            start: range.start,
            end: range.end,
            align: size,
        }
        .into());
    }
    Ok(range.len() / size)
}

pub(super) fn same_count(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), AmpError> {
    if expected == got {
        Ok(())
    } else {
        Err(ExecError::ElemCount {
            op,
            what,
            expected,
            got,
        }
        .into())
    }
}

/// The S range of an op: 4-byte aligned start (the struct's alignment), at least the 20 bytes
/// in use.
pub(super) fn check_s(op: &'static str, range: ByteRange) -> Result<(), AmpError> {
    if !range.start.is_multiple_of(4) {
        return Err(ExecError::Misaligned {
            op,
            what: "S".into(),
            start: range.start,
            end: range.end,
            align: 4,
        }
        .into());
    }
    if range.len() < s_layout::USED {
        return Err(ExecError::OutOfBounds {
            op,
            what: format!("S (needs {} bytes)", s_layout::USED),
            start: range.start,
            end: range.end,
            len: range.len(),
        }
        .into());
    }
    Ok(())
}

impl<'a> DevRange<'a> {
    /// `range` of `buf`.
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when the range does not lie inside the buffer.
    pub fn new<P: DevicePtr<u8>>(buf: &'a P, range: ByteRange) -> Result<Self, AmpError> {
        check_bounds(range, buf.len())?;
        Ok(DevRange { buf, range })
    }

    /// All of `buf`.
    pub fn whole<P: DevicePtr<u8>>(buf: &'a P) -> Self {
        DevRange {
            range: ByteRange::new(0, buf.len()),
            buf,
        }
    }

    /// The byte range.
    pub fn range(&self) -> ByteRange {
        self.range
    }

    /// The stream the buffer was allocated on (for the context check).
    pub fn buf_stream(&self) -> &CudaStream {
        self.buf.stream()
    }

    /// The device address of the range's first byte, with cudarc's read guard (a no-op
    /// unless the context tracks events across several streams).
    pub fn addr<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        let (base, sync) = self.buf.device_ptr(stream);
        (base + self.range.start as u64, sync)
    }

    /// The range's elements of `size` bytes, for operand `what` of launch `op`.
    ///
    /// # Errors
    /// [`ExecError::Misaligned`] when the range does not start and end on element
    /// boundaries.
    pub fn elems(
        &self,
        op: &'static str,
        what: &'static str,
        size: usize,
    ) -> Result<usize, AmpError> {
        elems_of(op, what, self.range, size)
    }

    /// Checks that the range holds exactly `expected` elements of `size` bytes.
    ///
    /// # Errors
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`].
    pub fn expect_elems(
        &self,
        op: &'static str,
        what: &'static str,
        size: usize,
        expected: usize,
    ) -> Result<(), AmpError> {
        expect_elems(op, what, self.range, size, expected)
    }
}

impl<'a> DevRangeMut<'a> {
    /// `range` of `buf`.
    ///
    /// # Errors
    /// [`ExecError::OutOfBounds`] when the range does not lie inside the buffer.
    pub fn new<P: DevicePtrMut<u8>>(buf: &'a mut P, range: ByteRange) -> Result<Self, AmpError> {
        check_bounds(range, buf.len())?;
        Ok(DevRangeMut { buf, range })
    }

    /// All of `buf`.
    pub fn whole<P: DevicePtrMut<u8>>(buf: &'a mut P) -> Self {
        DevRangeMut {
            range: ByteRange::new(0, buf.len()),
            buf,
        }
    }

    /// The byte range.
    pub fn range(&self) -> ByteRange {
        self.range
    }

    /// The stream the buffer was allocated on (for the context check).
    pub fn buf_stream(&self) -> &CudaStream {
        self.buf.stream()
    }

    /// The device address of the range's first byte, with cudarc's write guard.
    pub fn addr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        let (base, sync) = self.buf.device_ptr_mut(stream);
        (base + self.range.start as u64, sync)
    }

    /// As [`DevRange::elems`].
    ///
    /// # Errors
    /// [`ExecError::Misaligned`].
    pub fn elems(
        &self,
        op: &'static str,
        what: &'static str,
        size: usize,
    ) -> Result<usize, AmpError> {
        elems_of(op, what, self.range, size)
    }

    /// As [`DevRange::expect_elems`].
    ///
    /// # Errors
    /// [`ExecError::Misaligned`], [`ExecError::ElemCount`].
    pub fn expect_elems(
        &self,
        op: &'static str,
        what: &'static str,
        size: usize,
        expected: usize,
    ) -> Result<(), AmpError> {
        expect_elems(op, what, self.range, size, expected)
    }
}

/// The range holds exactly `expected` elements of `size` bytes, on element boundaries.
pub(super) fn expect_elems(
    op: &'static str,
    what: &'static str,
    range: ByteRange,
    size: usize,
    expected: usize,
) -> Result<(), AmpError> {
    same_count(op, what, expected, elems_of(op, what, range, size)?)
}
