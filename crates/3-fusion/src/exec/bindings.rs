//! What a plan executes on: the pointers of its tensors (device buffers checked for
//! null, alignment, size and type; host scalars for by-value tensors), packed for cuDNN.
#![allow(unsafe_code)]

use super::TENSOR_ALIGNMENT;
use crate::backend::Descriptor;
use crate::error::{BindingProblem, Error, Result};
use crate::graph::{DataType, TensorId};
use crate::plan::ExecutionPlan;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, SyncOnDrop};
use cudnn_fe_sys as sys;
use std::os::raw::c_void;
use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendDescriptorType_t as K;

/// Element types a device buffer can have, mapped to graph data types.
pub trait DeviceElement: DeviceRepr {
    /// The graph type of this element.
    const DTYPE: DataType;
}

impl DeviceElement for half::f16 {
    const DTYPE: DataType = DataType::Half;
}
impl DeviceElement for f32 {
    const DTYPE: DataType = DataType::Float;
}
impl DeviceElement for f64 {
    const DTYPE: DataType = DataType::Double;
}
impl DeviceElement for i32 {
    const DTYPE: DataType = DataType::Int32;
}
impl DeviceElement for i64 {
    const DTYPE: DataType = DataType::Int64;
}

/// A host scalar for a by-value tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    /// FP32.
    F32(f32),
    /// FP64.
    F64(f64),
    /// INT64.
    I64(i64),
}

impl Scalar {
    fn dtype(self) -> DataType {
        match self {
            Scalar::F32(_) => DataType::Float,
            Scalar::F64(_) => DataType::Double,
            Scalar::I64(_) => DataType::Int64,
        }
    }

    /// The value's bytes in an 8-byte-aligned word (an FP32 value in its first four bytes),
    /// so cuDNN may read any scalar type through the pointer.
    fn word(self) -> u64 {
        let mut b = [0u8; 8];
        match self {
            Scalar::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
            Scalar::F64(v) => b = v.to_ne_bytes(),
            Scalar::I64(v) => b = v.to_ne_bytes(),
        }
        u64::from_ne_bytes(b)
    }
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Empty,
    Device {
        ptr: u64,
        bytes: usize,
        dtype: DataType,
    },
    Host(usize),
}

/// Pointers for every real tensor of one plan, in the plan's uid order (no map lookups at
/// execute time). Device pointers are raw: the caller keeps the buffers alive and unaliased
/// until the work finishes on the stream.
pub struct Bindings<'p> {
    plan: &'p ExecutionPlan,
    slots: Vec<Slot>,
    /// By-value scalars, one aligned word each.
    scalars: Vec<u64>,
    /// The same scalars as bound (for the graph interpreter's variant pack).
    values: Vec<Scalar>,
    /// cudarc's ordering guards of the buffers bound with [`Bindings::bind`]: they record the
    /// buffers' use on the stream when the bindings drop, after the work is enqueued.
    guards: Vec<SyncOnDrop<'p>>,
}

impl std::fmt::Debug for Bindings<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bindings")
            .field("graph", &self.plan.graph_name())
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl<'p> Bindings<'p> {
    /// Empty bindings for `plan`.
    pub fn new(plan: &'p ExecutionPlan) -> Self {
        Bindings {
            plan,
            slots: vec![Slot::Empty; plan.real_tensors().len()],
            scalars: Vec::new(),
            values: Vec::new(),
            guards: Vec::new(),
        }
    }

    fn position(&self, t: TensorId) -> Result<usize> {
        self.plan
            .real_tensors()
            .iter()
            .position(|r| r.id == t)
            .ok_or_else(|| Error::Binding {
                graph: self.plan.graph_name().into(),
                tensor: format!("#{}", t.index()),
                problem: BindingProblem::NotInPlan,
            })
    }

    /// Binds a device buffer to a real tensor, borrowed mutably while the bindings live
    /// (cuDNN may write any tensor it is given). The address is taken through cudarc's
    /// `DevicePtrMut` on `stream` (the handle's): with cudarc's event tracking on, `stream`
    /// waits for the buffer's earlier work and the use is recorded when the bindings drop.
    pub fn bind<T: DeviceElement>(
        &mut self,
        t: TensorId,
        buffer: &'p mut CudaSlice<T>,
        stream: &'p CudaStream,
    ) -> Result<&mut Self> {
        let i = self.position(t)?;
        let bytes = buffer.len() * std::mem::size_of::<T>();
        let (ptr, guard) = buffer.device_ptr_mut(stream);
        self.guards.push(guard);
        self.slots[i] = Slot::Device {
            ptr,
            bytes,
            dtype: T::DTYPE,
        };
        Ok(self)
    }

    /// Binds a byte buffer as `dtype` elements (memory laid out by the caller, such as an amp
    /// region or a scratch buffer), borrowed as [`Bindings::bind`] borrows.
    pub fn bind_bytes(
        &mut self,
        t: TensorId,
        buffer: &'p mut CudaSlice<u8>,
        dtype: DataType,
        stream: &'p CudaStream,
    ) -> Result<&mut Self> {
        let i = self.position(t)?;
        let bytes = buffer.len();
        let (ptr, guard) = buffer.device_ptr_mut(stream);
        self.guards.push(guard);
        self.slots[i] = Slot::Device { ptr, bytes, dtype };
        Ok(self)
    }

    /// Binds a raw device pointer spanning `bytes` bytes of `dtype` elements.
    ///
    /// # Safety
    /// If the bindings are executed (or put in a CUDA graph): until that work has finished
    /// on the device, `ptr .. ptr + bytes` is live device memory of the handle's context
    /// holding `dtype` elements, that nothing frees and no other stream uses unless ordered
    /// with the handle's stream by the caller (cudarc's event tracking cannot see a raw
    /// address). Only checking them ([`Bindings::check`]) needs nothing.
    pub unsafe fn bind_raw(
        &mut self,
        t: TensorId,
        ptr: u64,
        bytes: usize,
        dtype: DataType,
    ) -> Result<&mut Self> {
        let i = self.position(t)?;
        self.slots[i] = Slot::Device { ptr, bytes, dtype };
        Ok(self)
    }

    /// Binds a host value to a by-value scalar tensor.
    pub fn bind_scalar(&mut self, t: TensorId, value: Scalar) -> Result<&mut Self> {
        let i = self.position(t)?;
        let real = &self.plan.real_tensors()[i];
        if real.dtype != value.dtype() {
            return Err(self.problem(
                i,
                BindingProblem::WrongType {
                    expected: real.dtype,
                    got: value.dtype(),
                },
            ));
        }
        self.scalars.push(value.word());
        self.values.push(value);
        self.slots[i] = Slot::Host(self.scalars.len() - 1);
        Ok(self)
    }

    fn problem(&self, i: usize, problem: BindingProblem) -> Error {
        Error::Binding {
            graph: self.plan.graph_name().into(),
            tensor: self.plan.real_tensors()[i].name.clone(),
            problem,
        }
    }

    /// Checks every binding (present, non-null, aligned, right type and kind, large enough)
    /// without running anything.
    pub fn check(&self) -> Result<()> {
        self.checked().map(|_| ())
    }

    /// Checks every binding and returns (uids, pointers) in uid order.
    fn checked(&self) -> Result<(Vec<i64>, Vec<*mut c_void>)> {
        let mut uids = Vec::with_capacity(self.slots.len());
        let mut ptrs = Vec::with_capacity(self.slots.len());
        for (i, (slot, real)) in self.slots.iter().zip(self.plan.real_tensors()).enumerate() {
            let ptr = match (*slot, real.by_value) {
                (Slot::Empty, _) => return Err(self.problem(i, BindingProblem::Missing)),
                (Slot::Host(k), true) => &self.scalars[k] as *const u64 as *mut c_void,
                (Slot::Device { ptr, bytes, dtype }, false) => {
                    if ptr == 0 {
                        return Err(self.problem(i, BindingProblem::Null));
                    }
                    if ptr % TENSOR_ALIGNMENT != 0 {
                        return Err(self.problem(
                            i,
                            BindingProblem::Misaligned {
                                address: ptr,
                                alignment: TENSOR_ALIGNMENT,
                            },
                        ));
                    }
                    if dtype != real.dtype {
                        return Err(self.problem(
                            i,
                            BindingProblem::WrongType {
                                expected: real.dtype,
                                got: dtype,
                            },
                        ));
                    }
                    if bytes < real.bytes {
                        return Err(self.problem(
                            i,
                            BindingProblem::TooSmall {
                                needed: real.bytes,
                                got: bytes,
                            },
                        ));
                    }
                    ptr as *mut c_void
                }
                _ => return Err(self.problem(i, BindingProblem::WrongKind)),
            };
            uids.push(real.uid);
            ptrs.push(ptr);
        }
        Ok((uids, ptrs))
    }

    /// The variant pack as the graph interpreter takes it ([`crate::interp::VariantPack`]):
    /// (uid, device address) of every device tensor and (uid, value) of every by-value one,
    /// in uid order, after the checks of [`Bindings::check`].
    #[allow(clippy::type_complexity)]
    pub fn pack(&self) -> Result<(Vec<(i64, u64)>, Vec<(i64, Scalar)>)> {
        self.check()?;
        let mut pointers = Vec::new();
        let mut scalars = Vec::new();
        for (slot, real) in self.slots.iter().zip(self.plan.real_tensors()) {
            match *slot {
                Slot::Device { ptr, .. } => pointers.push((real.uid, ptr)),
                Slot::Host(k) => scalars.push((real.uid, self.values[k])),
                Slot::Empty => {}
            }
        }
        Ok((pointers, scalars))
    }

    pub(super) fn variant_pack(&self, workspace: u64) -> Result<Descriptor> {
        let (uids, ptrs) = self.checked()?;
        let mut vp = Descriptor::new(K::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        vp.set(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?
            .set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &ptrs)?
            .set_one(
                A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                workspace as *mut c_void,
            )?;
        vp.finalize()?;
        Ok(vp)
    }
}
