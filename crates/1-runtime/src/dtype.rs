//! The element types the workspace speaks of: cuDNN's tensor data types (the graph frontend)
//! and the storage types of the mixed-precision layer's regions (FP16 and FP32 among them),
//! one enum for both.

/// Element types a tensor or a memory region can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DataType {
    /// IEEE half precision.
    Half,
    /// bfloat16.
    BFloat16,
    /// IEEE single precision.
    Float,
    /// IEEE double precision.
    Double,
    /// 32-bit signed integer.
    Int32,
    /// 64-bit signed integer (e.g. BN finalize's element count).
    Int64,
    /// Boolean (e.g. a ReLU mask).
    Boolean,
}

impl DataType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DataType::Half | DataType::BFloat16 => 2,
            DataType::Float | DataType::Int32 => 4,
            DataType::Double | DataType::Int64 => 8,
            DataType::Boolean => 1,
        }
    }

    /// Short name used in signatures and messages.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::Half => "f16",
            DataType::BFloat16 => "bf16",
            DataType::Float => "f32",
            DataType::Double => "f64",
            DataType::Int32 => "i32",
            DataType::Int64 => "i64",
            DataType::Boolean => "bool",
        }
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
