//! Tensor values and their memory layout: every tensor is held as a dense FP32 array in
//! logical (row-major over its dims: N,C,H,W) order; real tensors are gathered from and
//! scattered to memory through their own strides and element type.

use crate::graph::DataType;
use half::{bf16, f16};

/// A tensor's values in logical order.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Value {
    /// Dims (as the graph declares them).
    pub dims: Vec<usize>,
    /// `dims.iter().product()` values, row-major over `dims`.
    pub data: Vec<f32>,
    /// A by-value scalar's exact value (an INT64 count loses nothing in `f64`).
    pub exact: Option<f64>,
}

impl Value {
    /// A dense value.
    pub fn new(dims: Vec<usize>, data: Vec<f32>) -> Self {
        Value {
            dims,
            data,
            exact: None,
        }
    }

    /// The dims as N,C,H,W, when the tensor has four.
    pub fn nchw(&self) -> Option<[usize; 4]> {
        <[usize; 4]>::try_from(self.dims.as_slice()).ok()
    }
}

/// The value an element of `dtype` stores for `v` (round to nearest even for FP16/BF16,
/// 0/1 for Boolean, truncation toward zero for integers).
pub(super) fn round_to(dtype: DataType, v: f32) -> f32 {
    match dtype {
        DataType::Half => f16::from_f32(v).to_f32(),
        DataType::BFloat16 => bf16::from_f32(v).to_f32(),
        DataType::Float | DataType::Double => v,
        DataType::Int32 | DataType::Int64 => v.trunc(),
        DataType::Boolean => f32::from(u8::from(v != 0.0)),
    }
}

/// Decodes one little-endian element.
pub(super) fn decode(dtype: DataType, b: &[u8]) -> f32 {
    let n = dtype.size();
    let mut w = [0u8; 8];
    w[..n].copy_from_slice(&b[..n]);
    match dtype {
        DataType::Half => f16::from_le_bytes([w[0], w[1]]).to_f32(),
        DataType::BFloat16 => bf16::from_le_bytes([w[0], w[1]]).to_f32(),
        DataType::Float => f32::from_le_bytes([w[0], w[1], w[2], w[3]]),
        DataType::Double => f64::from_le_bytes(w) as f32,
        DataType::Int32 => i32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f32,
        DataType::Int64 => i64::from_le_bytes(w) as f32,
        DataType::Boolean => f32::from(u8::from(w[0] != 0)),
    }
}

/// Encodes one element (rounded to `dtype`) into `out` (little-endian).
pub(super) fn encode(dtype: DataType, v: f32, out: &mut [u8]) {
    match dtype {
        DataType::Half => out[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        DataType::BFloat16 => out[..2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        DataType::Float => out[..4].copy_from_slice(&v.to_le_bytes()),
        DataType::Double => out[..8].copy_from_slice(&f64::from(v).to_le_bytes()),
        DataType::Int32 => out[..4].copy_from_slice(&(v as i32).to_le_bytes()),
        DataType::Int64 => out[..8].copy_from_slice(&(v as i64).to_le_bytes()),
        DataType::Boolean => out[0] = u8::from(v != 0.0),
    }
}

/// The most elements one tensor may have (2^31: 8 GiB of FP32 values).
const MAX_ELEMS: usize = 1 << 31;

/// Where a real tensor's elements lie: element offsets from its address.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Layout {
    pub dims: Vec<usize>,
    pub strides: Vec<usize>,
    pub dtype: DataType,
    /// Bytes from the first to one past the last element reached.
    pub span: u64,
}

impl Layout {
    /// The layout of `dims`/`strides` (elements) of `dtype`, or what is wrong with it.
    pub fn new(dims: &[i64], strides: &[i64], dtype: DataType) -> Result<Self, String> {
        if dims.len() != strides.len() {
            return Err(format!("{} dims but {} strides", dims.len(), strides.len()));
        }
        let mut last = 0u64;
        let mut du = Vec::with_capacity(dims.len());
        let mut su = Vec::with_capacity(dims.len());
        for (i, (&d, &s)) in dims.iter().zip(strides).enumerate() {
            if d < 1 {
                return Err(format!("dim {i} is {d}"));
            }
            if s < 0 {
                return Err(format!(
                    "stride {i} is {s}; negative strides are not supported"
                ));
            }
            let reach = (d as u64 - 1)
                .checked_mul(s as u64)
                .and_then(|r| last.checked_add(r))
                .ok_or_else(|| format!("dims {dims:?} with strides {strides:?} overflow"))?;
            last = reach;
            du.push(usize::try_from(d).map_err(|_| format!("dim {i} is too large"))?);
            su.push(usize::try_from(s).map_err(|_| format!("stride {i} is too large"))?);
        }
        // Zero strides let a small extent describe many elements; each is held as FP32.
        let elems = du.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if elems.is_none_or(|e| e > MAX_ELEMS) {
            return Err(format!(
                "dims {dims:?} hold more than {MAX_ELEMS} elements, the interpreter's limit"
            ));
        }
        let span = last
            .checked_add(1)
            .and_then(|e| e.checked_mul(dtype.size() as u64))
            .ok_or_else(|| format!("dims {dims:?} with strides {strides:?} overflow"))?;
        Ok(Layout {
            dims: du,
            strides: su,
            dtype,
            span,
        })
    }

    /// Element offsets (from the address) of every element, in logical order.
    pub fn offsets(&self) -> Vec<usize> {
        let total: usize = self.dims.iter().product();
        let mut out = Vec::with_capacity(total);
        let mut idx = vec![0usize; self.dims.len()];
        for _ in 0..total {
            out.push(idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum());
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < self.dims[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        out
    }

    /// The tensor's values from the bytes of its span.
    pub fn gather(&self, bytes: &[u8]) -> Vec<f32> {
        let size = self.dtype.size();
        self.offsets()
            .into_iter()
            .map(|o| decode(self.dtype, &bytes[o * size..(o + 1) * size]))
            .collect()
    }

    /// Stores `data` (logical order) into the bytes of its span, leaving the bytes between
    /// strided elements as they were.
    pub fn scatter(&self, data: &[f32], bytes: &mut [u8]) {
        let size = self.dtype.size();
        for (o, &v) in self.offsets().into_iter().zip(data) {
            encode(self.dtype, v, &mut bytes[o * size..(o + 1) * size]);
        }
    }
}
