//! [`RangeOp`]: one range op over the regions of a memory plan, as data.
//!
//! A step is a list of these; each executor runs the list its own way (the CPU executor calls
//! the twins in [`crate::range`], the CUDA executor launches the kernels of
//! [`crate::kernels`], or records them into a CUDA graph). Because both executors interpret
//! the same list, they cannot disagree about which ranges a step covers.
//!
//! Every parameter-region range is given as `span16`: bytes of the FP16 layout, the plan's
//! one coordinate system. An FP16 region (A, G16, E16) uses `span16` as is; an FP32 region
//! (W, G, M, E) uses it at twice the offsets ([`ByteRange::to_fp32`]). Element `j` of the op is
//! element `span16.start / 2 + j` of every region it touches.

use crate::error::{AmpError, ExecError, RangeOpError};
use crate::plan::{ByteRange, DataType, MemoryPlan, Region};
use crate::range::{LossScalePolicy, OverflowPolicy};

/// One range op, with everything an executor needs to run it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RangeOp {
    /// Zero `span16` of `region` (kernel `amp_zero_bytes`).
    Zero {
        /// A parameter region (not S).
        region: Region,
        /// FP16-layout bytes.
        span16: ByteRange,
    },
    /// FP16 → FP32 cast (`amp_cast_f16_to_f32`), e.g. G16 → G.
    CastF16ToF32 {
        /// An FP16 region.
        src: Region,
        /// An FP32 region.
        dst: Region,
        /// FP16-layout bytes.
        span16: ByteRange,
    },
    /// FP32 → FP16 cast (`amp_cast_f32_to_f16`), e.g. W → A, E → E16.
    CastF32ToF16 {
        /// An FP32 region.
        src: Region,
        /// An FP16 region.
        dst: Region,
        /// FP16-layout bytes.
        span16: ByteRange,
    },
    /// Byte copy between two FP32 regions (a device-to-device copy on CUDA), e.g. W → E to
    /// start the EMA from the initial weights.
    CopyF32 {
        /// An FP32 region.
        src: Region,
        /// Another FP32 region.
        dst: Region,
        /// FP16-layout bytes.
        span16: ByteRange,
    },
    /// Gradient accumulation (`amp_accum_grads`): this micro-batch's gradient (G, plus G16
    /// cast to FP32 where G16 reaches) added into GA; with `drain` (the last micro-batch of
    /// a step) the sum is written into G instead and GA is zeroed.
    AccumGrads {
        /// Write the sum into G and zero GA (the step's last micro-batch).
        drain: bool,
        /// FP16-layout bytes (of G and GA; G16 where it reaches).
        span16: ByteRange,
    },
    /// Overflow check over G by `policy` (`amp_check_nonfinite` or `amp_check_clip`); sets
    /// the flag in S.
    Check {
        /// What counts as an overflow.
        policy: OverflowPolicy,
        /// FP16-layout bytes (of G).
        span16: ByteRange,
    },
    /// The global L2 norm of G's unscaled gradients into S (`amp_grad_sumsq`, then
    /// `amp_grad_norm`), for clipping by norm: SGD reads it when S's `clip_norm` is set.
    GradNorm {
        /// FP16-layout bytes (of G): the whole region, so that the norm is global.
        span16: ByteRange,
    },
    /// SGD over W, M, G → W, M, A (`amp_sgd_step`); skipped on the device when the flag is
    /// set. The learning rate, momentum and weight decay are read from S when the op runs
    /// (so a captured step follows a schedule); what is fixed here is the structure.
    Sgd {
        /// Nesterov momentum.
        nesterov: bool,
        /// Whether this range takes S's weight decay (false: BN and bias ranges, no decay).
        decay: bool,
        /// Whether the op has a momentum buffer (the plan's M region); without one, S's
        /// momentum must stay 0.
        momentum_buffer: bool,
        /// FP16-layout bytes.
        span16: ByteRange,
    },
    /// EMA of W into E and E16 (`amp_ema_update`); skipped when the flag is set.
    Ema {
        /// `e = decay * e + (1 - decay) * w`, decay in [0, 1].
        decay: f32,
        /// FP16-layout bytes.
        span16: ByteRange,
    },
    /// The loss-scale update (`amp_loss_scale_update`): backs off or grows, counts, clears
    /// the flag.
    LossScaleUpdate {
        /// The policy whose arguments the kernel gets.
        policy: LossScalePolicy,
    },
}

impl RangeOp {
    /// Short name for messages and tables (the kernel's entry point, or `"copy_f32"`).
    pub fn name(&self) -> &'static str {
        use crate::kernels::entry;
        match self {
            RangeOp::Zero { .. } => entry::ZERO_BYTES,
            RangeOp::CastF16ToF32 { .. } => entry::CAST_F16_TO_F32,
            RangeOp::CastF32ToF16 { .. } => entry::CAST_F32_TO_F16,
            RangeOp::CopyF32 { .. } => "copy_f32",
            RangeOp::AccumGrads { .. } => entry::ACCUM_GRADS,
            RangeOp::Check {
                policy: OverflowPolicy::NanOrInf,
                ..
            } => entry::CHECK_NONFINITE,
            RangeOp::Check { .. } => entry::CHECK_CLIP,
            RangeOp::GradNorm { .. } => entry::GRAD_SUMSQ,
            RangeOp::Sgd { .. } => entry::SGD_STEP,
            RangeOp::Ema { .. } => entry::EMA_UPDATE,
            RangeOp::LossScaleUpdate { .. } => entry::LOSS_SCALE_UPDATE,
        }
    }

    /// The FP16-layout span the op covers (`None` for the loss-scale update).
    pub fn span16(&self) -> Option<ByteRange> {
        match *self {
            RangeOp::Zero { span16, .. }
            | RangeOp::CastF16ToF32 { span16, .. }
            | RangeOp::CastF32ToF16 { span16, .. }
            | RangeOp::CopyF32 { span16, .. }
            | RangeOp::AccumGrads { span16, .. }
            | RangeOp::Check { span16, .. }
            | RangeOp::GradNorm { span16 }
            | RangeOp::Sgd { span16, .. }
            | RangeOp::Ema { span16, .. } => Some(span16),
            RangeOp::LossScaleUpdate { .. } => None,
        }
    }

    /// Elements the op covers (0 for the loss-scale update).
    pub fn elems(&self) -> usize {
        self.span16().map_or(0, |s| s.len() / 2)
    }

    /// Nominal device-memory traffic of the op in bytes (read + written), for bandwidth
    /// figures. Assumes the flag is clear (SGD and EMA run), gradients are finite (a clean
    /// clip check only reads) and counts M only when momentum is on.
    pub fn traffic_bytes(&self) -> usize {
        let n = self.elems();
        match *self {
            RangeOp::Zero { region, .. } => n * region.dtype().map_or(0, DataType::size),
            RangeOp::CastF16ToF32 { .. } | RangeOp::CastF32ToF16 { .. } => n * 6,
            RangeOp::CopyF32 { .. } => n * 8,
            // Reads G, GA (and G16 where it reaches); writes GA (or G and GA).
            RangeOp::AccumGrads { drain, .. } => n * (8 + 2 + if drain { 8 } else { 4 }),
            RangeOp::Check { .. } | RangeOp::GradNorm { .. } => n * 4,
            // Reads W, G (+M); writes W, A (+M).
            RangeOp::Sgd {
                momentum_buffer: true,
                ..
            } => n * (12 + 10),
            RangeOp::Sgd { .. } => n * (8 + 6),
            // Reads E, W; writes E, E16.
            RangeOp::Ema { .. } => n * (8 + 6),
            RangeOp::LossScaleUpdate { .. } => 20 * 2,
        }
    }

    /// Checks the op against `plan` without running it: every region it touches is
    /// allocated and of the right element type, the span lies inside each of them and is
    /// whole elements, and the configuration is one the kernels accept.
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`], [`ExecError::WrongRegion`],
    /// [`ExecError::OutOfBounds`], [`ExecError::Misaligned`], [`ExecError::MissingRegion`], or
    /// [`RangeOpError::InvalidConfig`] naming the bad field.
    pub fn validate(&self, plan: &MemoryPlan) -> Result<(), AmpError> {
        let op = self.name();
        match *self {
            RangeOp::Zero { region, span16 } => span_in(op, plan, region, "region", span16, None),
            RangeOp::CastF16ToF32 { src, dst, span16 } => {
                span_in(op, plan, src, "source", span16, Some(DataType::Half))?;
                span_in(op, plan, dst, "destination", span16, Some(DataType::Float))
            }
            RangeOp::CastF32ToF16 { src, dst, span16 } => {
                span_in(op, plan, src, "source", span16, Some(DataType::Float))?;
                span_in(op, plan, dst, "destination", span16, Some(DataType::Half))
            }
            RangeOp::CopyF32 { src, dst, span16 } => {
                span_in(op, plan, src, "source", span16, Some(DataType::Float))?;
                span_in(op, plan, dst, "destination", span16, Some(DataType::Float))?;
                if src == dst {
                    return Err(ExecError::WrongRegion {
                        op,
                        region: dst,
                        role: "destination",
                        needs: "a region other than the source",
                    }
                    .into());
                }
                Ok(())
            }
            RangeOp::AccumGrads { span16, .. } => {
                if !plan.has_region(Region::GA) {
                    return Err(ExecError::MissingRegion {
                        what: "gradient accumulation".into(),
                        region: Region::GA,
                    }
                    .into());
                }
                span_in(
                    op,
                    plan,
                    Region::G,
                    "gradients",
                    span16,
                    Some(DataType::Float),
                )?;
                span_in(
                    op,
                    plan,
                    Region::GA,
                    "accumulator",
                    span16,
                    Some(DataType::Float),
                )
            }
            RangeOp::Check { policy, span16 } => {
                policy.validate()?;
                span_in(
                    op,
                    plan,
                    Region::G,
                    "gradients",
                    span16,
                    Some(DataType::Float),
                )
            }
            RangeOp::GradNorm { span16 } => span_in(
                op,
                plan,
                Region::G,
                "gradients",
                span16,
                Some(DataType::Float),
            ),
            RangeOp::Sgd {
                momentum_buffer,
                span16,
                ..
            } => {
                if momentum_buffer && !plan.has_region(Region::M) {
                    return Err(ExecError::MissingRegion {
                        what: "an SGD op with a momentum buffer".into(),
                        region: Region::M,
                    }
                    .into());
                }
                span_in(
                    op,
                    plan,
                    Region::W,
                    "weights",
                    span16,
                    Some(DataType::Float),
                )?;
                span_in(
                    op,
                    plan,
                    Region::G,
                    "gradients",
                    span16,
                    Some(DataType::Float),
                )?;
                span_in(
                    op,
                    plan,
                    Region::A,
                    "compute weights",
                    span16,
                    Some(DataType::Half),
                )?;
                if momentum_buffer {
                    span_in(
                        op,
                        plan,
                        Region::M,
                        "momentum",
                        span16,
                        Some(DataType::Float),
                    )?;
                }
                Ok(())
            }
            RangeOp::Ema { decay, span16 } => {
                validate_decay(decay)?;
                for (region, role) in [(Region::E, "EMA"), (Region::E16, "EMA copy")] {
                    if !plan.has_region(region) {
                        return Err(ExecError::MissingRegion {
                            what: format!("EMA with decay {decay}"),
                            region,
                        }
                        .into());
                    }
                    span_in(op, plan, region, role, span16, region.dtype())?;
                }
                span_in(
                    op,
                    plan,
                    Region::W,
                    "weights",
                    span16,
                    Some(DataType::Float),
                )
            }
            RangeOp::LossScaleUpdate { policy } => Ok(policy.validate()?),
        }
    }
}

/// Checks an EMA decay the way the kernel needs it: in [0, 1].
pub(crate) fn validate_decay(decay: f32) -> Result<(), RangeOpError> {
    if (0.0..=1.0).contains(&decay) {
        Ok(())
    } else {
        Err(RangeOpError::InvalidConfig {
            op: "ema_update",
            field: "decay",
            value: decay.to_string(),
            why: "must be in [0, 1]",
        })
    }
}

/// `span16` must lie inside `region` (allocated, of `dtype` when given, not S) in whole FP16
/// elements.
fn span_in(
    op: &'static str,
    plan: &MemoryPlan,
    region: Region,
    role: &'static str,
    span16: ByteRange,
    dtype: Option<DataType>,
) -> Result<(), AmpError> {
    let (Some(have), Some(scale)) = (region.dtype(), region.scale_from_fp16()) else {
        return Err(ExecError::WrongRegion {
            op,
            region,
            role,
            needs: "a parameter region, not S",
        }
        .into());
    };
    if let Some(want) = dtype {
        if want != have {
            return Err(ExecError::WrongRegion {
                op,
                region,
                role,
                needs: match want {
                    DataType::Half => "an FP16 region (A, G16, E16)",
                    // Regions hold FP16 or FP32 only.
                    _ => "an FP32 region (W, G, M, E)",
                },
            }
            .into());
        }
    }
    let len = plan.region_range(region)?.len();
    let what = || format!("{region} (FP16-layout span)");
    if !span16.start.is_multiple_of(2) || !span16.end.is_multiple_of(2) {
        return Err(ExecError::Misaligned {
            op,
            what: what(),
            start: span16.start,
            end: span16.end,
            align: 2,
        }
        .into());
    }
    if span16.start > span16.end || span16.end > len / scale {
        return Err(ExecError::OutOfBounds {
            op,
            what: what(),
            start: span16.start,
            end: span16.end,
            len: len / scale,
        }
        .into());
    }
    Ok(())
}
