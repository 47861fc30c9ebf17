//! Named buffers of a layer on the host (the CPU executor). The device tables are in
//! `device_buffers`.
//!
//! A layer's graphs bind real tensors to buffers by name (`y`, `eq_scale`, `dw`, ...; see
//! [`CbrLayer::buffers`](super::CbrLayer::buffers)).

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

    /// An FP16 buffer, or a typed error naming it.
    pub fn f16(&self, name: &str) -> Result<&[f16]> {
        match self.map.get(name) {
            Some(HostBuffer::F16(v)) => Ok(v),
            Some(HostBuffer::F32(_)) => Err(missing(name, "is FP32, expected FP16")),
            None => Err(missing(name, "is not given")),
        }
    }

    /// An FP32 buffer, or a typed error naming it.
    pub fn f32(&self, name: &str) -> Result<&[f32]> {
        match self.map.get(name) {
            Some(HostBuffer::F32(v)) => Ok(v),
            Some(HostBuffer::F16(_)) => Err(missing(name, "is FP16, expected FP32")),
            None => Err(missing(name, "is not given")),
        }
    }

    /// An FP32 buffer for in-place update.
    pub fn f32_mut(&mut self, name: &str) -> Result<&mut Vec<f32>> {
        match self.map.get_mut(name) {
            Some(HostBuffer::F32(v)) => Ok(v),
            Some(HostBuffer::F16(_)) => Err(missing(name, "is FP16, expected FP32")),
            None => Err(missing(name, "is not given")),
        }
    }
}

pub(super) fn missing(name: &str, what: &str) -> Error {
    Error::Buffer {
        name: name.to_string(),
        problem: what.to_string(),
    }
}
