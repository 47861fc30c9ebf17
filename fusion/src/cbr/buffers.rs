//! Named buffers of a layer, on the host (CPU executor) and on the device (CUDA executor).
//!
//! A layer's graphs bind real tensors to buffers by name (`y`, `eq_scale`, `dw`, ...; see
//! [`CbrLayer::buffers`](super::CbrLayer::buffers)); these tables hold the buffers. Device
//! tables hold raw pointers, so the memory can come from cudarc slices or from amp's regions.

use super::BufferSpec;
use crate::error::{Error, Result};
use crate::exec::DeviceElement;
use crate::graph::DataType;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::f16;
use std::collections::BTreeMap;
use std::sync::Arc;

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

fn missing(name: &str, what: &str) -> Error {
    Error::Buffer {
        name: name.to_string(),
        problem: what.to_string(),
    }
}

/// A device buffer as a layer binds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuffer {
    /// Device address.
    pub ptr: u64,
    /// Bytes available from `ptr`.
    pub bytes: usize,
    /// Element type.
    pub dtype: DataType,
}

/// A layer's device buffers by name (raw pointers; the caller keeps the memory alive).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceBuffers {
    map: BTreeMap<&'static str, DeviceBuffer>,
}

impl DeviceBuffers {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a raw device buffer (e.g. a slot of an amp region).
    pub fn insert_raw(&mut self, name: &'static str, buffer: DeviceBuffer) {
        self.map.insert(name, buffer);
    }

    /// Adds a cudarc slice.
    pub fn insert<T: DeviceElement>(
        &mut self,
        name: &'static str,
        slice: &CudaSlice<T>,
        stream: &CudaStream,
    ) {
        let (ptr, _sync) = slice.device_ptr(stream);
        self.insert_raw(
            name,
            DeviceBuffer {
                ptr,
                bytes: slice.len() * std::mem::size_of::<T>(),
                dtype: T::DTYPE,
            },
        );
    }

    /// A buffer by name, or a typed error naming it.
    pub fn get(&self, name: &str) -> Result<DeviceBuffer> {
        self.map
            .get(name)
            .copied()
            .ok_or_else(|| missing(name, "is not given"))
    }
}

/// Device buffers a layer allocated for itself (zeroed), with their table.
#[derive(Debug)]
pub struct OwnedDeviceBuffers {
    slices: Vec<(&'static str, CudaSlice<u8>)>,
    table: DeviceBuffers,
}

impl OwnedDeviceBuffers {
    /// Allocates a zeroed buffer for every spec on `stream`.
    pub fn alloc(specs: &[BufferSpec], stream: &Arc<CudaStream>) -> Result<Self> {
        let mut slices = Vec::with_capacity(specs.len());
        let mut table = DeviceBuffers::new();
        for spec in specs {
            let slice =
                stream
                    .alloc_zeros::<u8>(spec.bytes().max(1))
                    .map_err(|e| Error::Driver {
                        what: format!("allocate buffer `{}`", spec.name),
                        message: e.to_string(),
                    })?;
            let ptr = {
                let (ptr, _sync) = slice.device_ptr(stream);
                ptr
            };
            table.insert_raw(
                spec.name,
                DeviceBuffer {
                    ptr,
                    bytes: spec.bytes(),
                    dtype: spec.dtype,
                },
            );
            slices.push((spec.name, slice));
        }
        Ok(OwnedDeviceBuffers { slices, table })
    }

    /// The table to pass to the layer.
    pub fn table(&self) -> &DeviceBuffers {
        &self.table
    }

    /// The raw byte slice of a buffer.
    pub fn slice(&self, name: &str) -> Option<&CudaSlice<u8>> {
        self.slices.iter().find(|(n, _)| *n == name).map(|(_, s)| s)
    }

    /// The raw byte slice of a buffer, for writing.
    pub fn slice_mut(&mut self, name: &str) -> Option<&mut CudaSlice<u8>> {
        self.slices
            .iter_mut()
            .find(|(n, _)| *n == name)
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
