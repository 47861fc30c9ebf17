//! The small value types of the memory plan: regions, dtypes, parameter kinds, buckets, byte
//! ranges, and the slot rule.

use std::fmt;

/// Every slot (and every region) starts on this many bytes: cuDNN and the vectorized range
/// kernels want at least 16, and 256 matches what `cudaMalloc` hands out, so an offset into a
/// region is as aligned as the region itself.
pub const SLOT_ALIGN: usize = 256;

/// Bytes of padding every FP16 slot keeps after its data (at least). They let a kernel that
/// works in 16-byte vectors run past a parameter's last element without touching the next one.
pub const SLOT_PAD: usize = 16;

/// Rounds `x` up to a multiple of `align`, or `None` on overflow or when `align` is not a
/// power of two.
pub fn align_up(x: usize, align: usize) -> Option<usize> {
    if !align.is_power_of_two() {
        return None;
    }
    Some(x.checked_add(align - 1)? & !(align - 1))
}

/// The slot rule for FP16 regions: `align_up(elems * 2 + 16, 256)` bytes, or `None` when that
/// does not fit in `usize`.
pub fn fp16_slot_bytes(elems: usize) -> Option<usize> {
    align_up(elems.checked_mul(2)?.checked_add(SLOT_PAD)?, SLOT_ALIGN)
}

/// The slot rule for FP32 regions: exactly twice the FP16 slot, so element `j` of an FP32
/// region sits at twice the byte offset of element `j` of its FP16 twin, and one kernel can
/// walk both with the same index.
pub fn fp32_slot_bytes(elems: usize) -> Option<usize> {
    fp16_slot_bytes(elems)?.checked_mul(2)
}

// Element type of a region (the workspace's one data type enum; regions use `Half` and
// `Float`).
pub(crate) use cudnn_cbr_runtime::DataType;

/// One contiguous device allocation of the AMP layer.
///
/// All parameter regions list the parameters in the same order. Offsets are kept in one
/// coordinate system, the FP16 layout: a parameter's byte offset in an FP16 region is its
/// FP16 offset, in an FP32 region exactly twice that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Region {
    /// FP32 master weights, every parameter.
    W,
    /// FP16 compute copy of W (what cuDNN and cuBLAS read), every parameter.
    A,
    /// FP32 gradients, every parameter. FC and BN gradients are written here directly;
    /// conv gradients are cast in from G16.
    G,
    /// FP16 conv weight gradients (cuDNN's fused wgrad writes FP16). Only conv parameters
    /// have a slot; see [`crate::plan::MemoryPlan::g16_cast_ranges`].
    G16,
    /// FP32 SGD momentum buffers, same layout as W (present unless turned off).
    M,
    /// FP32 EMA of the weights (optional).
    E,
    /// FP16 copy of E, for evaluating with the EMA weights (optional, with E).
    E16,
    /// FP32 gradient accumulator, same layout as G, for gradient accumulation over several
    /// micro-batches (optional: only a plan made with
    /// [`crate::plan::MemoryPlan::with_grad_accumulator`]). Each micro-batch's gradient is
    /// added into it; the last one's sum goes to G for the step ([`crate::range::accum_grads`]).
    GA,
    /// Device scalars: loss scale, overflow flag, counters. See [`crate::range::Scalars`].
    S,
}

impl Region {
    /// All regions, in arena order.
    pub const ALL: [Region; 9] = [
        Region::W,
        Region::A,
        Region::G,
        Region::G16,
        Region::M,
        Region::E,
        Region::E16,
        Region::GA,
        Region::S,
    ];

    /// The element type of a parameter region; `None` for S, which mixes types.
    pub const fn dtype(self) -> Option<DataType> {
        match self {
            Region::W | Region::G | Region::M | Region::E | Region::GA => Some(DataType::Float),
            Region::A | Region::G16 | Region::E16 => Some(DataType::Half),
            Region::S => None,
        }
    }

    /// Factor from an FP16-layout byte offset to this region's byte offset (1 or 2); `None`
    /// for S.
    pub const fn scale_from_fp16(self) -> Option<usize> {
        match self.dtype() {
            Some(DataType::Float) => Some(2),
            Some(DataType::Half) => Some(1),
            // S mixes types; no region holds another type.
            _ => None,
        }
    }

    /// The region a cast range op pairs this one with: W↔A, G↔G16, E↔E16.
    pub const fn cast_twin(self) -> Option<Region> {
        match self {
            Region::W => Some(Region::A),
            Region::A => Some(Region::W),
            Region::G => Some(Region::G16),
            Region::G16 => Some(Region::G),
            Region::E => Some(Region::E16),
            Region::E16 => Some(Region::E),
            Region::M | Region::GA | Region::S => None,
        }
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// What a parameter is; it decides its regions, its gradient path and its place in a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// Convolution filter (rank 3 to 5, e.g. KRSC). Its gradient comes from cuDNN's wgrad in
    /// FP16 and goes through G16.
    ConvWeight,
    /// BatchNorm scale (rank 1). Gradient FP32 from BN backward, straight into G.
    BnGamma,
    /// BatchNorm shift (rank 1). Gradient FP32 from BN backward, straight into G.
    BnBeta,
    /// Fully connected weight (rank 2). cuBLAS writes its gradient FP32 straight into G.
    FcWeight,
    /// Fully connected bias (rank 1). Gradient FP32 straight into G.
    FcBias,
}

/// How a parameter's gradient reaches the FP32 G region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GradPath {
    /// Written FP16 into G16, then cast into G by one range op (conv weights).
    ViaG16,
    /// Written FP32 straight into G by its producer (cuBLAS, BN backward).
    DirectF32,
}

impl ParamKind {
    /// How this kind's gradient reaches G.
    pub const fn grad_path(self) -> GradPath {
        match self {
            ParamKind::ConvWeight => GradPath::ViaG16,
            _ => GradPath::DirectF32,
        }
    }

    /// Whether weight decay applies by convention (weights yes; BN affine and biases no).
    /// The plan puts decayed kinds first in each bucket so both groups are single ranges.
    pub const fn decays(self) -> bool {
        matches!(self, ParamKind::ConvWeight | ParamKind::FcWeight)
    }

    /// Place within a bucket: conv first (so G16's part of a bucket is one run at the
    /// bucket's start), then the other decayed kinds, then the rest.
    pub(crate) const fn group(self) -> u8 {
        match self {
            ParamKind::ConvWeight => 0,
            ParamKind::FcWeight => 1,
            ParamKind::BnGamma | ParamKind::BnBeta | ParamKind::FcBias => 2,
        }
    }

    /// Accepted ranks, as (min, max, words for the error message).
    pub(crate) const fn rank_range(self) -> (usize, usize, &'static str) {
        match self {
            ParamKind::ConvWeight => (3, 5, "3 to 5"),
            ParamKind::FcWeight => (2, 2, "2"),
            ParamKind::BnGamma | ParamKind::BnBeta | ParamKind::FcBias => (1, 1, "1"),
        }
    }
}

/// Handle to a bucket declared with [`crate::plan::MemoryPlanBuilder::bucket`].
///
/// A bucket is a group of parameters whose ranges are contiguous in every region, so the
/// gradients of one bucket can be checked or reduced while later buckets still compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket(pub(crate) usize);

impl Bucket {
    /// Declaration index of the bucket (its rank in every region).
    pub const fn index(self) -> usize {
        self.0
    }
}

/// A half-open byte range `[start, end)` inside one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ByteRange {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl ByteRange {
    /// The range `[start, end)`.
    pub const fn new(start: usize, end: usize) -> Self {
        ByteRange { start, end }
    }

    /// Length in bytes (0 if `end <= start`).
    pub const fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// Whether the range holds no bytes.
    pub const fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    /// Number of whole elements of `dtype` in the range.
    pub const fn elems(&self, dtype: DataType) -> usize {
        self.len() / dtype.size()
    }

    /// The matching range in an FP32 region when `self` is in an FP16 region (both ends ×2).
    /// Saturates instead of overflowing; ranges from a finalized plan never saturate because
    /// the plan checked every FP32 size.
    pub const fn to_fp32(&self) -> ByteRange {
        ByteRange {
            start: self.start.saturating_mul(2),
            end: self.end.saturating_mul(2),
        }
    }

    /// The same range as element indices of `dtype` (`start / size .. end / size`).
    pub const fn elem_range(&self, dtype: DataType) -> std::ops::Range<usize> {
        self.start / dtype.size()..self.end / dtype.size()
    }
}

/// Which optional regions a plan allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryPlanOptions {
    /// Allocate M (SGD momentum). Default on; turn off for momentum-free SGD.
    pub momentum: bool,
    /// Allocate E and E16 (weight EMA). Default off.
    pub ema: bool,
    /// Allocate GA (the FP32 gradient accumulator of gradient accumulation). Default off.
    pub grad_accumulator: bool,
}

impl Default for MemoryPlanOptions {
    fn default() -> Self {
        MemoryPlanOptions {
            momentum: true,
            ema: false,
            grad_accumulator: false,
        }
    }
}
