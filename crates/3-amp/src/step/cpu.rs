//! [`CpuRegions`]: the regions of a plan in host memory, run by the CPU twins.

use std::sync::Arc;

use half::f16;

use crate::error::{AmpError, ExecError};
use crate::plan::{DataType, MemoryPlan, Region};
use crate::range::{self, Scalars, SgdConfig};
use crate::step::op::RangeOp;
use crate::step::{check_graph_owner, next_executor_id, validate_capture, AmpExecutor};

/// The regions of a memory plan in host memory: typed vectors, zeroed at creation, and S as
/// [`Scalars`]. Absent regions are empty.
///
/// Every op runs the CPU twin of its kernel, so a step here is bit for bit the step the CUDA
/// executor runs. It is the oracle of the GPU tests and the executor of machines without one.
#[derive(Debug)]
pub struct CpuRegions {
    id: u64,
    plan: Arc<MemoryPlan>,
    w: Vec<f32>,
    a: Vec<f16>,
    g: Vec<f32>,
    g16: Vec<f16>,
    m: Vec<f32>,
    e: Vec<f32>,
    e16: Vec<f16>,
    ga: Vec<f32>,
    s: Scalars,
    snapshot: Option<Scalars>,
}

impl Clone for CpuRegions {
    /// A copy of every region, as a new executor (its own id: graphs of the original do not
    /// replay on it).
    fn clone(&self) -> Self {
        CpuRegions {
            id: next_executor_id(),
            plan: self.plan.clone(),
            w: self.w.clone(),
            a: self.a.clone(),
            g: self.g.clone(),
            g16: self.g16.clone(),
            m: self.m.clone(),
            e: self.e.clone(),
            e16: self.e16.clone(),
            ga: self.ga.clone(),
            s: self.s,
            snapshot: self.snapshot,
        }
    }
}

/// A recorded op list of a [`CpuRegions`] (the CPU side of a CUDA graph).
#[derive(Debug, Clone, PartialEq)]
pub struct CpuGraph {
    owner: u64,
    ops: Vec<RangeOp>,
}

impl CpuGraph {
    /// The recorded ops.
    pub fn ops(&self) -> &[RangeOp] {
        &self.ops
    }
}

fn f32_view_error(op: &'static str, region: Region) -> AmpError {
    ExecError::WrongRegion {
        op,
        region,
        role: "FP32 view",
        needs: "an FP32 region (W, G, M, E, GA)",
    }
    .into()
}

fn f16_view_error(op: &'static str, region: Region) -> AmpError {
    ExecError::WrongRegion {
        op,
        region,
        role: "FP16 view",
        needs: "an FP16 region (A, G16, E16)",
    }
    .into()
}

impl CpuRegions {
    /// Zeroed regions for `plan`, S at the default policy's values.
    ///
    /// # Errors
    /// [`AmpError::OutOfMemory`] when the plan's regions do not fit in the host's available
    /// memory (checked before anything is allocated).
    pub fn new(plan: impl Into<Arc<MemoryPlan>>) -> Result<Self, AmpError> {
        let plan = plan.into();
        crate::memory::check_host("the memory plan's regions", plan.total_bytes() as u128)?;
        let f32s = |r: Region| vec![0.0f32; plan.region_len(r) / 4];
        let f16s = |r: Region| vec![f16::ZERO; plan.region_len(r) / 2];
        Ok(CpuRegions {
            id: next_executor_id(),
            w: f32s(Region::W),
            a: f16s(Region::A),
            g: f32s(Region::G),
            g16: f16s(Region::G16),
            m: f32s(Region::M),
            e: f32s(Region::E),
            e16: f16s(Region::E16),
            ga: f32s(Region::GA),
            s: Scalars::default(),
            snapshot: None,
            plan,
        })
    }

    /// The plan, shared.
    pub fn plan_arc(&self) -> &Arc<MemoryPlan> {
        &self.plan
    }

    /// The current S.
    pub fn scalars(&self) -> Scalars {
        self.s
    }

    fn f32_vec(&self, region: Region) -> Option<&Vec<f32>> {
        match region {
            Region::W => Some(&self.w),
            Region::G => Some(&self.g),
            Region::M => Some(&self.m),
            Region::E => Some(&self.e),
            Region::GA => Some(&self.ga),
            _ => None,
        }
    }

    fn f32_vec_mut(&mut self, region: Region) -> Option<&mut Vec<f32>> {
        match region {
            Region::W => Some(&mut self.w),
            Region::G => Some(&mut self.g),
            Region::M => Some(&mut self.m),
            Region::E => Some(&mut self.e),
            Region::GA => Some(&mut self.ga),
            _ => None,
        }
    }

    fn f16_vec(&self, region: Region) -> Option<&Vec<f16>> {
        match region {
            Region::A => Some(&self.a),
            Region::G16 => Some(&self.g16),
            Region::E16 => Some(&self.e16),
            _ => None,
        }
    }

    fn f16_vec_mut(&mut self, region: Region) -> Option<&mut Vec<f16>> {
        match region {
            Region::A => Some(&mut self.a),
            Region::G16 => Some(&mut self.g16),
            Region::E16 => Some(&mut self.e16),
            _ => None,
        }
    }

    fn present(&self, region: Region) -> Result<(), AmpError> {
        self.plan
            .region_range(region)
            .map(|_| ())
            .map_err(Into::into)
    }

    /// A whole FP32 region (W, G, M, E), padding included.
    ///
    /// # Errors
    /// [`ExecError::WrongRegion`] for an FP16 region or S, [`crate::PlanError::RegionAbsent`].
    pub fn f32_region(&self, region: Region) -> Result<&[f32], AmpError> {
        let v = self
            .f32_vec(region)
            .ok_or_else(|| f32_view_error("f32_region", region))?;
        self.present(region)?;
        Ok(v)
    }

    /// A whole FP32 region, mutable. Keep padding zero.
    ///
    /// # Errors
    /// As [`CpuRegions::f32_region`].
    pub fn f32_region_mut(&mut self, region: Region) -> Result<&mut [f32], AmpError> {
        self.present(region)?;
        self.f32_vec_mut(region)
            .map(Vec::as_mut_slice)
            .ok_or_else(|| f32_view_error("f32_region_mut", region))
    }

    /// A whole FP16 region (A, G16, E16), padding included.
    ///
    /// # Errors
    /// [`ExecError::WrongRegion`] for an FP32 region or S, [`crate::PlanError::RegionAbsent`].
    pub fn f16_region(&self, region: Region) -> Result<&[f16], AmpError> {
        let v = self
            .f16_vec(region)
            .ok_or_else(|| f16_view_error("f16_region", region))?;
        self.present(region)?;
        Ok(v)
    }

    /// A whole FP16 region, mutable. Keep padding (and G16's holes) zero.
    ///
    /// # Errors
    /// As [`CpuRegions::f16_region`].
    pub fn f16_region_mut(&mut self, region: Region) -> Result<&mut [f16], AmpError> {
        self.present(region)?;
        self.f16_vec_mut(region)
            .map(Vec::as_mut_slice)
            .ok_or_else(|| f16_view_error("f16_region_mut", region))
    }

    fn param_elems(
        &self,
        name: &str,
        region: Region,
        want: DataType,
    ) -> Result<std::ops::Range<usize>, AmpError> {
        let v = self.plan.view(name, region)?;
        if v.dtype != want {
            return Err(match want {
                DataType::Half => f16_view_error("param_f16", region),
                // Regions hold FP16 or FP32 only.
                _ => f32_view_error("param_f32", region),
            });
        }
        Ok(v.elem_offset()..v.elem_offset() + v.elems)
    }

    /// Parameter `name`'s data (no padding) in an FP32 region.
    ///
    /// # Errors
    /// [`crate::PlanError::UnknownParam`], [`crate::PlanError::NotInRegion`],
    /// [`ExecError::WrongRegion`] for an FP16 region.
    pub fn param_f32(&self, name: &str, region: Region) -> Result<&[f32], AmpError> {
        let r = self.param_elems(name, region, DataType::Float)?;
        Ok(&self.f32_region(region)?[r])
    }

    /// Parameter `name`'s data in an FP32 region, mutable (e.g. an FC gradient in G).
    ///
    /// # Errors
    /// As [`CpuRegions::param_f32`].
    pub fn param_f32_mut(&mut self, name: &str, region: Region) -> Result<&mut [f32], AmpError> {
        let r = self.param_elems(name, region, DataType::Float)?;
        Ok(&mut self.f32_region_mut(region)?[r])
    }

    /// Parameter `name`'s data in an FP16 region.
    ///
    /// # Errors
    /// [`crate::PlanError::UnknownParam`], [`crate::PlanError::NotInRegion`] (e.g. an FC
    /// weight in G16), [`ExecError::WrongRegion`] for an FP32 region.
    pub fn param_f16(&self, name: &str, region: Region) -> Result<&[f16], AmpError> {
        let r = self.param_elems(name, region, DataType::Half)?;
        Ok(&self.f16_region(region)?[r])
    }

    /// Parameter `name`'s data in an FP16 region, mutable (e.g. a conv wgrad in G16).
    ///
    /// # Errors
    /// As [`CpuRegions::param_f16`].
    pub fn param_f16_mut(&mut self, name: &str, region: Region) -> Result<&mut [f16], AmpError> {
        let r = self.param_elems(name, region, DataType::Half)?;
        Ok(&mut self.f16_region_mut(region)?[r])
    }

    /// A region's bytes as the device holds them (little-endian); S is its 256-byte image.
    /// For comparing executors bit for bit.
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`].
    pub fn region_bytes(&self, region: Region) -> Result<Vec<u8>, AmpError> {
        self.present(region)?;
        if region == Region::S {
            return Ok(self.s.to_bytes().to_vec());
        }
        if let Some(v) = self.f32_vec(region) {
            return Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect());
        }
        let v = self.f16_vec(region).map(Vec::as_slice).unwrap_or_default();
        Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    /// Overwrites a region from its byte image (as [`CpuRegions::region_bytes`] gives it).
    ///
    /// # Errors
    /// [`crate::PlanError::RegionAbsent`], [`ExecError::OutOfBounds`] when `bytes` is not
    /// exactly the region's length; for S, [`crate::RangeOpError::InvalidConfig`] when its
    /// loss scale is NaN, infinite or ≤ 0 ([`Scalars::validate`]). The region is unchanged
    /// on error.
    pub fn load_region_bytes(&mut self, region: Region, bytes: &[u8]) -> Result<(), AmpError> {
        let len = self.plan.region_range(region)?.len();
        if bytes.len() != len {
            return Err(ExecError::OutOfBounds {
                op: "load_region_bytes",
                what: region.to_string(),
                start: 0,
                end: bytes.len(),
                len,
            }
            .into());
        }
        if region == Region::S {
            self.s = Scalars::from_bytes(bytes)?;
            return Ok(());
        }
        if let Some(v) = self.f32_vec_mut(region) {
            for (d, c) in v.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        } else if let Some(v) = self.f16_vec_mut(region) {
            for (d, c) in v.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = f16::from_le_bytes([c[0], c[1]]);
            }
        }
        Ok(())
    }

    /// Runs a validated op.
    fn exec(&mut self, op: &RangeOp) -> Result<(), AmpError> {
        match *op {
            RangeOp::Zero { region, span16 } => {
                let r = span16.elem_range(DataType::Half);
                if let Some(v) = self.f32_vec_mut(region) {
                    range::zero_f32(&mut v[r]);
                } else if let Some(v) = self.f16_vec_mut(region) {
                    range::zero_f16(&mut v[r]);
                }
            }
            RangeOp::CastF16ToF32 { src, dst, span16 } => {
                let r = span16.elem_range(DataType::Half);
                let mut out = std::mem::take(self.f32_vec_mut(dst).unwrap_or(&mut Vec::new()));
                let done = match self.f16_vec(src) {
                    Some(s) => range::cast_f16_to_f32(&s[r.clone()], &mut out[r]),
                    None => Ok(()),
                };
                if let Some(v) = self.f32_vec_mut(dst) {
                    *v = out;
                }
                done?;
            }
            RangeOp::CastF32ToF16 { src, dst, span16 } => {
                let r = span16.elem_range(DataType::Half);
                let mut out = std::mem::take(self.f16_vec_mut(dst).unwrap_or(&mut Vec::new()));
                let done = match self.f32_vec(src) {
                    Some(s) => range::cast_f32_to_f16(&s[r.clone()], &mut out[r]),
                    None => Ok(()),
                };
                if let Some(v) = self.f16_vec_mut(dst) {
                    *v = out;
                }
                done?;
            }
            RangeOp::CopyF32 { src, dst, span16 } => {
                let r = span16.elem_range(DataType::Half);
                let mut out = std::mem::take(self.f32_vec_mut(dst).unwrap_or(&mut Vec::new()));
                if let Some(s) = self.f32_vec(src) {
                    out[r.clone()].copy_from_slice(&s[r]);
                }
                if let Some(v) = self.f32_vec_mut(dst) {
                    *v = out;
                }
            }
            RangeOp::AccumGrads { drain, span16 } => {
                let r = span16.elem_range(DataType::Half);
                // G16 ends at the last conv parameter: the part of the span it covers.
                let end16 = self.g16.len().min(r.end);
                let g16 = self.g16.get(r.start..end16).unwrap_or_default();
                range::accum_grads(g16, &mut self.g[r.clone()], &mut self.ga[r], drain)?;
            }
            RangeOp::Check { policy, span16 } => {
                let r = span16.elem_range(DataType::Half);
                range::check_grads(&mut self.g[r], policy, &mut self.s)?;
            }
            RangeOp::GradNorm { span16 } => {
                let r = span16.elem_range(DataType::Half);
                range::grad_norm(&self.g[r], &mut self.s);
            }
            RangeOp::Sgd {
                nesterov,
                decay,
                momentum_buffer,
                span16,
            } => {
                let r = span16.elem_range(DataType::Half);
                let m = momentum_buffer.then(|| &mut self.m[r.clone()]);
                // A range without decay sees S's weight decay as 0 (the kernel's `decay` flag).
                let s = Scalars {
                    weight_decay: if decay { self.s.weight_decay } else { 0.0 },
                    ..self.s
                };
                range::sgd_step(
                    &mut self.w[r.clone()],
                    m,
                    &self.g[r.clone()],
                    &mut self.a[r],
                    &s,
                    nesterov,
                )?;
            }
            RangeOp::Ema { decay, span16 } => {
                let r = span16.elem_range(DataType::Half);
                range::ema_update(
                    &mut self.e[r.clone()],
                    &mut self.e16[r.clone()],
                    &self.w[r],
                    &self.s,
                    decay,
                )?;
            }
            RangeOp::LossScaleUpdate { policy } => {
                range::update_loss_scale(&mut self.s, &policy)?;
            }
        }
        Ok(())
    }
}

impl AmpExecutor for CpuRegions {
    type Graph = CpuGraph;

    fn id(&self) -> u64 {
        self.id
    }

    fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    fn run(&mut self, op: &RangeOp) -> Result<(), AmpError> {
        op.validate(&self.plan)?;
        self.exec(op)
    }

    fn capture(&mut self, ops: &[RangeOp]) -> Result<CpuGraph, AmpError> {
        validate_capture(&self.plan, ops)?;
        Ok(CpuGraph {
            owner: self.id,
            ops: ops.to_vec(),
        })
    }

    fn replay(&mut self, graph: &CpuGraph) -> Result<(), AmpError> {
        check_graph_owner(graph.owner, self.id)?;
        graph.ops.iter().try_for_each(|op| self.exec(op))
    }

    fn write_scalars(&mut self, s: &Scalars) -> Result<(), AmpError> {
        s.validate()?;
        self.s = *s;
        Ok(())
    }

    fn write_hyper(&mut self, sgd: &SgdConfig) -> Result<(), AmpError> {
        self.s = self.s.with_sgd(sgd);
        Ok(())
    }

    fn write_ranks(&mut self, ranks: u32) -> Result<(), AmpError> {
        self.s.ranks = ranks;
        Ok(())
    }

    fn write_clip_norm(&mut self, max_norm: f32) -> Result<(), AmpError> {
        self.s.clip_norm = max_norm;
        Ok(())
    }

    fn write_accum(&mut self, accum: u32) -> Result<(), AmpError> {
        self.s.accum = accum;
        Ok(())
    }

    fn request_scalars(&mut self) -> Result<(), AmpError> {
        self.snapshot = Some(self.s);
        Ok(())
    }

    fn poll_scalars(&mut self) -> Result<Option<Scalars>, AmpError> {
        Ok(self.snapshot)
    }
}
