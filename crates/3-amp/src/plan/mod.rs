//! The memory plan: where every parameter lives in every region.
//!
//! Recipe:
//! 1. `let mut b = MemoryPlanBuilder::new().with_ema(true);`
//! 2. Declare buckets in forward order: `let first = b.bucket("first")?;`
//! 3. Register parameters: `b.add("conv1.w", ParamKind::ConvWeight, &[64, 3, 3, 3], first)?;`
//! 4. `let plan = b.finalize()?;` lays them out (bucket by bucket, conv first) and checks
//!    the invariants with [`MemoryPlan::validate`].
//! 5. Allocate each region with [`MemoryPlan::region_len`] (or one arena with
//!    [`MemoryPlan::arena_layout`]), zero them, and upload S from
//!    [`crate::range::Scalars::to_bytes`].
//! 6. Optionally, register a network's other buffers (activations, gradients, statistics)
//!    with [`MemoryPlanBuilder::add_tensor`] (bytes of their own) or
//!    [`MemoryPlanBuilder::add_tensor_live`] (a [`Lifetime`]: buffers whose lifetimes never
//!    meet share bytes): they get 256-byte aligned slots in one tensor arena beside the regions
//!    ([`MemoryPlan::tensors`], [`MemoryPlan::tensor_bytes`]).
//! 7. Bind tensors with [`MemoryPlan::view`]; launch range ops over
//!    [`MemoryPlan::region_range`], [`MemoryPlan::bucket_range`] and
//!    [`MemoryPlan::g16_cast_ranges`].
//!
//! Slot rule: an FP16 slot is `align_up(elems * 2 + 16, 256)` bytes, the FP32 slot exactly
//! twice that. All parameter regions share one coordinate system, the FP16 layout: a
//! parameter's offset in an FP32 region is exactly twice its offset in an FP16 region, so
//! element `j` of W lines up with element `j` of A and one kernel covers a whole region.
//!
//! Regions: W, A, G always; M (momentum) unless turned off; E and E16 with EMA; S always
//! (256 bytes, see [`crate::range::Scalars`]). G16 holds conv parameters only (their
//! gradients come from cuDNN in FP16); FC and BN gradients are written FP32 straight into G
//! ([`GradPath`]). G16 still uses the FP16 layout, so it has holes where non-conv
//! parameters sit before the last conv: that is why the G16→G cast runs over
//! [`MemoryPlan::g16_cast_ranges`] and never over the whole region.
//!
//! ```
//! use cudnn_cbr_amp::plan::{MemoryPlanBuilder, ParamKind, Region};
//! let mut b = MemoryPlanBuilder::new();
//! let first = b.bucket("first")?;
//! let deep = b.bucket("deep")?;
//! b.add("conv1.w", ParamKind::ConvWeight, &[64, 3, 3, 3], first)?;
//! b.add("bn1.gamma", ParamKind::BnGamma, &[64], first)?;
//! b.add("fc.w", ParamKind::FcWeight, &[10, 64], deep)?;
//! let plan = b.finalize()?;
//! let a = plan.view("conv1.w", Region::A)?;
//! let w = plan.view("conv1.w", Region::W)?;
//! assert_eq!(w.offset_bytes, 2 * a.offset_bytes);
//! assert!(plan.view("fc.w", Region::G16).is_err());
//! # Ok::<(), cudnn_cbr_amp::PlanError>(())
//! ```

#![forbid(unsafe_code)]

mod builder;
mod layout;
mod tensors;
mod types;

pub use builder::MemoryPlanBuilder;
pub use layout::{BucketInfo, MemoryPlan, ParamInfo, ParamView, RegionLayout};
pub use tensors::{assign as assign_tensor_offsets, peak_live, Lifetime, TensorSlot};
// The element type has one public path, `cudnn_cbr_runtime::DataType`; this crate's modules name
// it from here.
pub(crate) use types::DataType;
pub use types::{
    align_up, fp16_slot_bytes, fp32_slot_bytes, Bucket, ByteRange, GradPath, MemoryPlanOptions,
    ParamKind, Region, SLOT_ALIGN, SLOT_PAD,
};
