//! The one owner of a cuDNN backend descriptor, and typed attribute access.

use crate::error::{Error, Result};
use cudnn_fe_sys as sys;
use std::os::raw::c_void;
#[cfg(feature = "testing")]
use std::sync::atomic::{AtomicU64, Ordering};

// Descriptor accounting, test scaffolding (the `testing` feature): counted only where it is on.
#[cfg(feature = "testing")]
static CREATED: AtomicU64 = AtomicU64::new(0);
#[cfg(feature = "testing")]
static DESTROYED: AtomicU64 = AtomicU64::new(0);

/// How many backend descriptors this process created and destroyed so far.
/// Tests use it to prove that every descriptor is freed (test scaffolding: built only with
/// the `testing` feature).
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorCounts {
    /// `cudnnBackendCreateDescriptor` calls that succeeded.
    pub created: u64,
    /// `cudnnBackendDestroyDescriptor` calls made by `Drop`.
    pub destroyed: u64,
}

/// Process-wide descriptor accounting (test scaffolding: built only with the `testing`
/// feature).
#[cfg(feature = "testing")]
pub fn descriptor_counts() -> DescriptorCounts {
    DescriptorCounts {
        created: CREATED.load(Ordering::SeqCst),
        destroyed: DESTROYED.load(Ordering::SeqCst),
    }
}

/// A Rust type that maps to one `CUDNN_TYPE_*` attribute type. Sealed: only the types below.
pub trait AttrValue: Copy + private::Sealed {
    /// The cuDNN attribute type tag for this Rust type.
    const TYPE: sys::cudnnBackendAttributeType_t;
    /// A neutral value to fill output buffers with before a get.
    fn zero() -> Self;
}

mod private {
    pub trait Sealed {}
}

macro_rules! attr_value {
    ($($t:ty => $tag:ident, $zero:expr;)*) => {$(
        impl private::Sealed for $t {}
        impl AttrValue for $t {
            const TYPE: sys::cudnnBackendAttributeType_t =
                sys::cudnnBackendAttributeType_t::$tag;
            fn zero() -> Self { $zero }
        }
    )*};
}

attr_value! {
    i64 => CUDNN_TYPE_INT64, 0;
    i32 => CUDNN_TYPE_INT32, 0;
    f32 => CUDNN_TYPE_FLOAT, 0.0;
    f64 => CUDNN_TYPE_DOUBLE, 0.0;
    bool => CUDNN_TYPE_BOOLEAN, false;
    u8 => CUDNN_TYPE_CHAR, 0;
    *mut c_void => CUDNN_TYPE_VOID_PTR, std::ptr::null_mut();
    sys::cudnnDataType_t => CUDNN_TYPE_DATA_TYPE, sys::cudnnDataType_t(0);
    sys::cudnnConvolutionMode_t => CUDNN_TYPE_CONVOLUTION_MODE, sys::cudnnConvolutionMode_t(0);
    sys::cudnnPointwiseMode_t => CUDNN_TYPE_POINTWISE_MODE, sys::cudnnPointwiseMode_t(0);
    sys::cudnnGenStatsMode_t => CUDNN_TYPE_GENSTATS_MODE, sys::cudnnGenStatsMode_t(0);
    sys::cudnnBnFinalizeStatsMode_t => CUDNN_TYPE_BN_FINALIZE_STATS_MODE, sys::cudnnBnFinalizeStatsMode_t(0);
    sys::cudnnBackendHeurMode_t => CUDNN_TYPE_HEUR_MODE, sys::cudnnBackendHeurMode_t(0);
    sys::cudnnBackendBehaviorNote_t => CUDNN_TYPE_BEHAVIOR_NOTE, sys::cudnnBackendBehaviorNote_t(0);
    sys::cudnnBackendNumericalNote_t => CUDNN_TYPE_NUMERICAL_NOTE, sys::cudnnBackendNumericalNote_t(0);
    sys::cudnnBackendNormMode_t => CUDNN_TYPE_NORM_MODE, sys::cudnnBackendNormMode_t(0);
    sys::cudnnBackendNormFwdPhase_t => CUDNN_TYPE_NORM_FWD_PHASE, sys::cudnnBackendNormFwdPhase_t(0);
    sys::cudnnReduceTensorOp_t => CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, sys::cudnnReduceTensorOp_t(0);
    sys::cudnnNanPropagation_t => CUDNN_TYPE_NAN_PROPOGATION, sys::cudnnNanPropagation_t(0);
    sys::cudnnBackendOperationGraphMode_t => CUDNN_TYPE_OPERATIONGRAPH_MODE, sys::cudnnBackendOperationGraphMode_t(0);
    sys::cudnnHandle_t => CUDNN_TYPE_HANDLE, std::ptr::null_mut();
    sys::cudnnBackendKnobType_t => CUDNN_TYPE_KNOB_TYPE, sys::cudnnBackendKnobType_t(0);
}

/// An owned, move-only cuDNN backend descriptor. `Drop` destroys it and never panics.
pub struct Descriptor {
    raw: sys::cudnnBackendDescriptor_t,
    kind: sys::cudnnBackendDescriptorType_t,
    lib: &'static sys::Library,
}

// SAFETY: a backend descriptor is plain heap memory owned by this value; cuDNN keeps no
// thread affinity for it. Mutation goes through &mut self, so sharing &Descriptor across threads
// only permits cuDNN's read-only calls (get attribute, execute with a finalized plan).
unsafe impl Send for Descriptor {}
// SAFETY: see above; all `&self` methods only read the descriptor.
unsafe impl Sync for Descriptor {}

impl std::fmt::Debug for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Descriptor({})", kind_name(self.kind))
    }
}

impl Descriptor {
    /// Creates a descriptor of `kind` (loads cuDNN on first use).
    pub fn new(kind: sys::cudnnBackendDescriptorType_t) -> Result<Self> {
        let lib = sys::library()?;
        let mut raw: sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; on success cuDNN stores a new descriptor there,
        // which this value then owns and destroys exactly once in Drop.
        unsafe { (lib.api.cudnnBackendCreateDescriptor)(kind, &mut raw) }
            .result()
            .map_err(|e| Error::cudnn(format!("create {}", kind_name(kind)), e))?;
        #[cfg(feature = "testing")]
        CREATED.fetch_add(1, Ordering::SeqCst);
        Ok(Descriptor { raw, kind, lib })
    }

    /// The raw handle, for passing to cuDNN. Stays owned by `self`.
    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.raw
    }

    /// The descriptor type.
    pub fn kind(&self) -> sys::cudnnBackendDescriptorType_t {
        self.kind
    }

    /// The loaded cuDNN this descriptor belongs to.
    pub fn library(&self) -> &'static sys::Library {
        self.lib
    }

    /// Sets an attribute to `values` (the slice carries the element count).
    pub fn set<T: AttrValue>(
        &mut self,
        name: sys::cudnnBackendAttributeName_t,
        values: &[T],
    ) -> Result<&mut Self> {
        // SAFETY: `values` is a live slice of `values.len()` elements of the Rust type that
        // matches `T::TYPE` in size and representation; cuDNN copies them before returning.
        unsafe {
            (self.lib.api.cudnnBackendSetAttribute)(
                self.raw,
                name,
                T::TYPE,
                values.len() as i64,
                values.as_ptr().cast(),
            )
        }
        .result()
        .map_err(|e| {
            Error::cudnn(
                format!("set attribute {} on {}", name.0, kind_name(self.kind)),
                e,
            )
        })?;
        Ok(self)
    }

    /// Sets a one-element attribute.
    pub fn set_one<T: AttrValue>(
        &mut self,
        name: sys::cudnnBackendAttributeName_t,
        value: T,
    ) -> Result<&mut Self> {
        self.set(name, std::slice::from_ref(&value))
    }

    /// Sets an attribute that refers to other descriptors.
    pub fn set_descriptors(
        &mut self,
        name: sys::cudnnBackendAttributeName_t,
        descs: &[&Descriptor],
    ) -> Result<&mut Self> {
        let raws: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.raw).collect();
        // SAFETY: `raws` holds live descriptors owned by the callers' `Descriptor`s for the
        // duration of the call; the type tag says they are descriptors.
        unsafe {
            (self.lib.api.cudnnBackendSetAttribute)(
                self.raw,
                name,
                sys::cudnnBackendAttributeType_t::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                raws.len() as i64,
                raws.as_ptr().cast(),
            )
        }
        .result()
        .map_err(|e| {
            Error::cudnn(
                format!("set attribute {} on {}", name.0, kind_name(self.kind)),
                e,
            )
        })?;
        Ok(self)
    }

    /// Finalizes the descriptor; after this it is read-only.
    pub fn finalize(&mut self) -> Result<()> {
        // SAFETY: `self.raw` is a live descriptor owned by `self`.
        unsafe { (self.lib.api.cudnnBackendFinalize)(self.raw) }
            .result()
            .map_err(|e| Error::cudnn(format!("finalize {}", kind_name(self.kind)), e))
    }

    /// Reads up to `max` elements of an attribute.
    pub fn get<T: AttrValue>(
        &self,
        name: sys::cudnnBackendAttributeName_t,
        max: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::zero(); max];
        let mut count: i64 = 0;
        // SAFETY: `out` has room for `max` elements of T (matching T::TYPE); `count` is a valid
        // out-pointer; cuDNN writes at most `max` elements.
        unsafe {
            (self.lib.api.cudnnBackendGetAttribute)(
                self.raw,
                name,
                T::TYPE,
                max as i64,
                &mut count,
                out.as_mut_ptr().cast(),
            )
        }
        .result()
        .map_err(|e| {
            Error::cudnn(
                format!("get attribute {} of {}", name.0, kind_name(self.kind)),
                e,
            )
        })?;
        out.truncate((count.max(0) as usize).min(max));
        Ok(out)
    }

    /// Reads one element of an attribute.
    pub fn get_one<T: AttrValue>(&self, name: sys::cudnnBackendAttributeName_t) -> Result<T> {
        self.get::<T>(name, 1)?.into_iter().next().ok_or_else(|| {
            Error::cudnn_msg(format!(
                "get attribute {} of {}: no value",
                name.0,
                kind_name(self.kind)
            ))
        })
    }

    /// The element count cuDNN reports for an attribute (a get with room for none).
    pub fn count(
        &self,
        name: sys::cudnnBackendAttributeName_t,
        ty: sys::cudnnBackendAttributeType_t,
    ) -> Result<usize> {
        let mut count: i64 = 0;
        // SAFETY: requesting 0 elements: cuDNN only writes the count through a valid pointer.
        unsafe {
            (self.lib.api.cudnnBackendGetAttribute)(
                self.raw,
                name,
                ty,
                0,
                &mut count,
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| {
            Error::cudnn(
                format!("count attribute {} of {}", name.0, kind_name(self.kind)),
                e,
            )
        })?;
        Ok(count.max(0) as usize)
    }

    /// Reads a descriptor-valued attribute into `max` fresh descriptors of `kind`;
    /// returns only those cuDNN filled.
    pub fn get_descriptors(
        &self,
        name: sys::cudnnBackendAttributeName_t,
        kind: sys::cudnnBackendDescriptorType_t,
        max: usize,
    ) -> Result<Vec<Descriptor>> {
        let mut descs = (0..max)
            .map(|_| Descriptor::new(kind))
            .collect::<Result<Vec<_>>>()?;
        let raws: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.raw).collect();
        let mut count: i64 = 0;
        // SAFETY: `raws` holds `max` live descriptors of the requested kind, owned by `descs`;
        // cuDNN fills up to `max` of them in place.
        unsafe {
            (self.lib.api.cudnnBackendGetAttribute)(
                self.raw,
                name,
                sys::cudnnBackendAttributeType_t::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                max as i64,
                &mut count,
                raws.as_ptr() as *mut c_void,
            )
        }
        .result()
        .map_err(|e| {
            Error::cudnn(
                format!("get attribute {} of {}", name.0, kind_name(self.kind)),
                e,
            )
        })?;
        descs.truncate((count.max(0) as usize).min(max));
        Ok(descs)
    }

    /// Reads a CHAR attribute (JSON representations) as a string.
    pub fn get_string(&self, name: sys::cudnnBackendAttributeName_t) -> Result<String> {
        let n = self.count(name, sys::cudnnBackendAttributeType_t::CUDNN_TYPE_CHAR)?;
        let bytes = self.get::<u8>(name, n)?;
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        Ok(String::from_utf8_lossy(&bytes[..end]).into_owned())
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: `self.raw` was created by cudnnBackendCreateDescriptor and is destroyed only
        // here, once. A failing destroy cannot be reported from Drop and is ignored.
        let _ = unsafe { (self.lib.api.cudnnBackendDestroyDescriptor)(self.raw) };
        #[cfg(feature = "testing")]
        DESTROYED.fetch_add(1, Ordering::SeqCst);
    }
}

/// A readable name for the descriptor kinds we create (for error messages).
pub fn kind_name(kind: sys::cudnnBackendDescriptorType_t) -> String {
    use sys::cudnnBackendDescriptorType_t as K;
    let name = match kind {
        K::CUDNN_BACKEND_TENSOR_DESCRIPTOR => "TENSOR",
        K::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR => "CONVOLUTION",
        K::CUDNN_BACKEND_POINTWISE_DESCRIPTOR => "POINTWISE",
        K::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR => {
            "OPERATION_CONVOLUTION_FORWARD"
        }
        K::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR => {
            "OPERATION_CONVOLUTION_BACKWARD_DATA"
        }
        K::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR => {
            "OPERATION_CONVOLUTION_BACKWARD_FILTER"
        }
        K::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR => "OPERATION_POINTWISE",
        K::CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR => "OPERATION_GEN_STATS",
        K::CUDNN_BACKEND_OPERATION_BN_FINALIZE_STATISTICS_DESCRIPTOR => {
            "OPERATION_BN_FINALIZE_STATISTICS"
        }
        K::CUDNN_BACKEND_OPERATION_BN_BWD_WEIGHTS_DESCRIPTOR => "OPERATION_BN_BWD_WEIGHTS",
        K::CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR => "OPERATION_NORM_FORWARD",
        K::CUDNN_BACKEND_OPERATION_NORM_BACKWARD_DESCRIPTOR => "OPERATION_NORM_BACKWARD",
        K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR => "OPERATIONGRAPH",
        K::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR => "ENGINEHEUR",
        K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR => "ENGINECFG",
        K::CUDNN_BACKEND_ENGINE_DESCRIPTOR => "ENGINE",
        K::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR => "EXECUTION_PLAN",
        K::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR => "VARIANT_PACK",
        K::CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR => "DEVICEPROP",
        K::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR => "KNOB_CHOICE",
        K::CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR => "KNOB_INFO",
        _ => return format!("descriptor type {}", kind.0),
    };
    format!("CUDNN_BACKEND_{name}_DESCRIPTOR")
}
