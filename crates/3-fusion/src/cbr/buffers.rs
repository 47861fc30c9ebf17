//! Named buffers of a layer on the host (the CPU executor). The device tables are in
//! `device_buffers`.
//!
//! A layer's graphs bind real tensors to buffers by name (`y`, `eq_scale`, `dw`, ...; see
//! [`CbrLayer::buffers`](super::CbrLayer::buffers)).

use super::keys::Key;
use super::BufferSpec;
use crate::error::{Error, Result};
use crate::graph::DataType;
use half::f16;
use std::collections::BTreeMap;

/// One host buffer.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuffer {
    /// FP16 storage.
    F16(Vec<f16>),
    /// FP32 storage.
    F32(Vec<f32>),
}

impl HostBuffer {
    /// A zeroed buffer of the spec's type and length.
    pub fn zeros(spec: &BufferSpec) -> Self {
        match spec.dtype {
            DataType::Half => HostBuffer::F16(vec![f16::ZERO; spec.elems]),
            _ => HostBuffer::F32(vec![0.0; spec.elems]),
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            HostBuffer::F16(v) => v.len(),
            HostBuffer::F32(v) => v.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to f32 (for comparisons and reports).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HostBuffer::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostBuffer::F32(v) => v.clone(),
        }
    }
}

/// An element type a [`HostBuffer`] stores (FP16 or FP32): what lets [`HostBuffers::of`] take a
/// typed [`Key`] instead of a name.
pub trait HostElement: Sized {
    /// The name of the type in errors.
    const NAME: &'static str;
    /// The values, where `buffer` stores this type.
    fn values(buffer: &HostBuffer) -> Option<&[Self]>;
    /// The values for in-place update, where `buffer` stores this type.
    fn values_mut(buffer: &mut HostBuffer) -> Option<&mut Vec<Self>>;
}

impl HostElement for f16 {
    const NAME: &'static str = "FP16";
    fn values(buffer: &HostBuffer) -> Option<&[Self]> {
        match buffer {
            HostBuffer::F16(v) => Some(v),
            HostBuffer::F32(_) => None,
        }
    }
    fn values_mut(buffer: &mut HostBuffer) -> Option<&mut Vec<Self>> {
        match buffer {
            HostBuffer::F16(v) => Some(v),
            HostBuffer::F32(_) => None,
        }
    }
}

impl HostElement for f32 {
    const NAME: &'static str = "FP32";
    fn values(buffer: &HostBuffer) -> Option<&[Self]> {
        match buffer {
            HostBuffer::F32(v) => Some(v),
            HostBuffer::F16(_) => None,
        }
    }
    fn values_mut(buffer: &mut HostBuffer) -> Option<&mut Vec<Self>> {
        match buffer {
            HostBuffer::F32(v) => Some(v),
            HostBuffer::F16(_) => None,
        }
    }
}

/// A layer's host buffers by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostBuffers {
    map: BTreeMap<&'static str, HostBuffer>,
}

impl HostBuffers {
    /// Zeroed buffers for every spec.
    pub fn zeros(specs: &[BufferSpec]) -> Self {
        HostBuffers {
            map: specs
                .iter()
                .map(|s| (s.name, HostBuffer::zeros(s)))
                .collect(),
        }
    }

    /// Sets (or replaces) a buffer.
    pub fn set(&mut self, name: &'static str, buffer: HostBuffer) {
        self.map.insert(name, buffer);
    }

    /// A buffer by name.
    pub fn get(&self, name: &str) -> Option<&HostBuffer> {
        self.map.get(name)
    }

    /// Every buffer, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &HostBuffer)> {
        self.map.iter().map(|(k, v)| (*k, v))
    }

    /// The buffer of `key`, typed by the key (`keys::Y` gives `&[f16]`), or a typed error
    /// naming it: the typed form of [`HostBuffers::f16`] and [`HostBuffers::f32`].
    pub fn of<T: HostElement>(&self, key: Key<T>) -> Result<&[T]> {
        self.named(key.name())
    }

    /// The buffer of `key` for in-place update (as [`HostBuffers::of`]).
    pub fn of_mut<T: HostElement>(&mut self, key: Key<T>) -> Result<&mut Vec<T>> {
        self.named_mut(key.name())
    }

    /// An FP16 buffer, or a typed error naming it.
    pub fn f16(&self, name: &str) -> Result<&[f16]> {
        self.named(name)
    }

    /// An FP32 buffer, or a typed error naming it.
    pub fn f32(&self, name: &str) -> Result<&[f32]> {
        self.named(name)
    }

    /// An FP32 buffer for in-place update.
    pub fn f32_mut(&mut self, name: &str) -> Result<&mut Vec<f32>> {
        self.named_mut(name)
    }

    /// Buffer `name` as `T`s, or a typed error naming it.
    fn named<T: HostElement>(&self, name: &str) -> Result<&[T]> {
        let b = self
            .map
            .get(name)
            .ok_or_else(|| missing(name, "is not given"))?;
        T::values(b).ok_or_else(|| missing(name, &stored_as::<T>(b)))
    }

    /// Buffer `name` as `T`s for in-place update, or a typed error naming it.
    fn named_mut<T: HostElement>(&mut self, name: &str) -> Result<&mut Vec<T>> {
        let b = self
            .map
            .get_mut(name)
            .ok_or_else(|| missing(name, "is not given"))?;
        if T::values(b).is_none() {
            return Err(missing(name, &stored_as::<T>(b)));
        }
        T::values_mut(b).ok_or_else(|| missing(name, "is not of the expected type"))
    }
}

/// "is FP32, expected FP16": what buffer `b` holds against what a `T` reader expects.
fn stored_as<T: HostElement>(b: &HostBuffer) -> String {
    let stored = match b {
        HostBuffer::F16(_) => f16::NAME,
        HostBuffer::F32(_) => f32::NAME,
    };
    format!("is {stored}, expected {}", T::NAME)
}

pub(super) fn missing(name: &str, what: &str) -> Error {
    Error::Buffer {
        name: name.to_string(),
        problem: what.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cbr::keys;

    fn buffers() -> HostBuffers {
        let mut b = HostBuffers::default();
        b.set(keys::Y.name(), HostBuffer::F16(vec![f16::ONE; 3]));
        b.set(keys::SUM.name(), HostBuffer::F32(vec![2.0; 4]));
        b
    }

    #[test]
    fn a_typed_key_reads_the_buffer_its_name_reads() {
        let mut b = buffers();
        assert_eq!(b.of(keys::Y).unwrap(), b.f16(keys::Y.name()).unwrap());
        assert_eq!(b.of(keys::SUM).unwrap(), b.f32(keys::SUM.name()).unwrap());
        b.of_mut(keys::SUM).unwrap()[1] = 5.0;
        assert_eq!(b.f32(keys::SUM.name()).unwrap(), &[2.0, 5.0, 2.0, 2.0]);
    }

    #[test]
    fn a_key_over_a_missing_or_other_typed_buffer_is_an_error_naming_it() {
        let mut b = buffers();
        let e = b.of(keys::DY).unwrap_err().to_string();
        assert!(
            e.contains(keys::DY.name()) && e.contains("not given"),
            "{e}"
        );
        // A buffer stored in the other precision than its key says (set by name).
        b.set(keys::SUM.name(), HostBuffer::F16(vec![f16::ZERO; 4]));
        let e = b.of(keys::SUM).unwrap_err().to_string();
        assert!(e.contains("is FP16, expected FP32"), "{e}");
        let e = b.of_mut(keys::SUM).unwrap_err().to_string();
        assert!(e.contains("is FP16, expected FP32"), "{e}");
    }
}
