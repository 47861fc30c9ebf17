//! [`MemoryPlanBuilder`]: registration, checks, and the layout pass of `finalize`.

use std::collections::HashSet;

use crate::error::PlanError;
use crate::plan::layout::{BucketInfo, MemoryPlan, ParamInfo};
use crate::plan::tensors::{lay_out, Lifetime};
use crate::plan::types::{
    fp16_slot_bytes, fp32_slot_bytes, Bucket, DataType, MemoryPlanOptions, ParamKind,
};

/// A parameter as registered, before layout.
#[derive(Debug, Clone)]
struct Pending {
    name: String,
    kind: ParamKind,
    shape: Vec<usize>,
    elems: usize,
    slot16: usize,
    bucket: Bucket,
}

/// Collects parameters and buckets, then lays them out with [`MemoryPlanBuilder::finalize`].
///
/// Registration checks each parameter on the spot (name, shape, rank for its kind, sizes) and
/// leaves the builder unchanged when it returns an error, so a caller can report and go on.
#[derive(Debug, Clone, Default)]
pub struct MemoryPlanBuilder {
    options: MemoryPlanOptions,
    buckets: Vec<String>,
    params: Vec<Pending>,
    /// Non-parameter buffers for the tensor arena: (name, dtype, elems, lifetime), in order.
    tensors: Vec<(String, DataType, usize, Lifetime)>,
    names: HashSet<String>,
    finalized: bool,
}

impl MemoryPlanBuilder {
    /// An empty builder with default options (momentum buffer on, EMA off).
    pub fn new() -> Self {
        Self::default()
    }

    /// Allocate (or not) the EMA regions E and E16.
    pub fn with_ema(mut self, on: bool) -> Self {
        self.options.ema = on;
        self
    }

    /// Allocate (or not) the momentum region M. Without it, SGD must run with momentum 0.
    pub fn with_momentum_buffer(mut self, on: bool) -> Self {
        self.options.momentum = on;
        self
    }

    /// The options the plan will be built with.
    pub fn options(&self) -> MemoryPlanOptions {
        self.options
    }

    /// Declares a bucket. Buckets are laid out in declaration order in every region.
    ///
    /// # Errors
    /// [`PlanError::BadBucketName`] for an empty or repeated name,
    /// [`PlanError::BucketAfterFinalize`] once the builder is finalized.
    pub fn bucket(&mut self, name: &str) -> Result<Bucket, PlanError> {
        if self.finalized {
            return Err(PlanError::BucketAfterFinalize {
                bucket: name.to_owned(),
            });
        }
        if name.is_empty() || self.buckets.iter().any(|b| b == name) {
            return Err(PlanError::BadBucketName {
                bucket: name.to_owned(),
            });
        }
        self.buckets.push(name.to_owned());
        Ok(Bucket(self.buckets.len() - 1))
    }

    /// Registers a parameter of `kind` with `shape` in `bucket`.
    ///
    /// # Errors
    /// In the order checked: [`PlanError::RegisterAfterFinalize`], [`PlanError::EmptyName`],
    /// [`PlanError::DuplicateName`], [`PlanError::UnknownBucket`], [`PlanError::EmptyShape`],
    /// [`PlanError::ZeroDim`], [`PlanError::RankMismatch`], [`PlanError::SizeOverflow`].
    pub fn add(
        &mut self,
        name: &str,
        kind: ParamKind,
        shape: &[usize],
        bucket: Bucket,
    ) -> Result<(), PlanError> {
        let owned = || name.to_owned();
        if self.finalized {
            return Err(PlanError::RegisterAfterFinalize { name: owned() });
        }
        if name.is_empty() {
            return Err(PlanError::EmptyName {
                index: self.params.len(),
            });
        }
        if self.names.contains(name) {
            return Err(PlanError::DuplicateName { name: owned() });
        }
        if bucket.0 >= self.buckets.len() {
            return Err(PlanError::UnknownBucket {
                name: owned(),
                bucket: bucket.0,
            });
        }
        if shape.is_empty() {
            return Err(PlanError::EmptyShape { name: owned() });
        }
        if shape.contains(&0) {
            return Err(PlanError::ZeroDim {
                name: owned(),
                shape: shape.to_vec(),
            });
        }
        let (min_rank, max_rank, expected) = kind.rank_range();
        if shape.len() < min_rank || shape.len() > max_rank {
            return Err(PlanError::RankMismatch {
                name: owned(),
                kind,
                expected,
                shape: shape.to_vec(),
            });
        }
        let overflow = |what| PlanError::SizeOverflow {
            name: owned(),
            shape: shape.to_vec(),
            what,
        };
        let elems = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| overflow("element count"))?;
        let slot16 = fp16_slot_bytes(elems).ok_or_else(|| overflow("FP16 slot"))?;
        // Checked here so that every FP32 offset the plan derives (×2) is known to fit.
        fp32_slot_bytes(elems).ok_or_else(|| overflow("FP32 slot"))?;
        self.names.insert(owned());
        self.params.push(Pending {
            name: owned(),
            kind,
            shape: shape.to_vec(),
            elems,
            slot16,
            bucket,
        });
        Ok(())
    }

    /// Registers a non-parameter buffer (an activation, a gradient, a statistic) of `elems`
    /// elements of `dtype` in the tensor arena, with bytes of its own for the whole step.
    /// Names share one namespace with parameters.
    ///
    /// # Errors
    /// [`PlanError::RegisterAfterFinalize`], [`PlanError::EmptyName`],
    /// [`PlanError::DuplicateName`], [`PlanError::ZeroDim`] for zero elements,
    /// [`PlanError::SizeOverflow`].
    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: DataType,
        elems: usize,
    ) -> Result<(), PlanError> {
        self.add_tensor_live(name, dtype, elems, Lifetime::Whole)
    }

    /// [`MemoryPlanBuilder::add_tensor`] for a buffer needed only during `live`: it may share
    /// bytes with tensors whose lifetimes do not meet its own (module `tensors`: the interval
    /// assignment, and the check that proves it).
    ///
    /// # Errors
    /// As [`MemoryPlanBuilder::add_tensor`]; [`PlanError::Invariant`] for a span that ends
    /// before it starts.
    pub fn add_tensor_live(
        &mut self,
        name: &str,
        dtype: DataType,
        elems: usize,
        live: Lifetime,
    ) -> Result<(), PlanError> {
        if let Lifetime::Span { first, last } = live {
            if last < first {
                return Err(PlanError::Invariant {
                    name: name.to_owned(),
                    what: format!("its lifetime ends at {last}, before it starts at {first}"),
                });
            }
        }
        let owned = || name.to_owned();
        if self.finalized {
            return Err(PlanError::RegisterAfterFinalize { name: owned() });
        }
        if name.is_empty() {
            return Err(PlanError::EmptyName {
                index: self.params.len() + self.tensors.len(),
            });
        }
        if self.names.contains(name) {
            return Err(PlanError::DuplicateName { name: owned() });
        }
        if elems == 0 {
            return Err(PlanError::ZeroDim {
                name: owned(),
                shape: vec![0],
            });
        }
        if elems.checked_mul(dtype.size()).is_none() {
            return Err(PlanError::SizeOverflow {
                name: owned(),
                shape: vec![elems],
                what: "tensor bytes",
            });
        }
        self.names.insert(owned());
        self.tensors.push((owned(), dtype, elems, live));
        Ok(())
    }

    /// Number of parameters registered so far.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether no parameter is registered yet.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Lays the parameters out and seals the builder.
    ///
    /// Order in every region: bucket by bucket (declaration order); inside a bucket conv
    /// weights first, then FC weights, then BN gamma/beta and FC biases; registration order
    /// within each of those groups. Conv-first makes a bucket's G16 part one run at the
    /// bucket's start; weights-before-the-rest makes the weight-decayed part one range.
    ///
    /// On success the builder is sealed: later `add`/`bucket`/`finalize` calls return errors
    /// instead of silently describing parameters the returned plan lacks. On error nothing
    /// is sealed and the caller may fix the registration and try again.
    ///
    /// # Errors
    /// [`PlanError::AlreadyFinalized`], [`PlanError::EmptyPlan`], [`PlanError::EmptyBucket`],
    /// [`PlanError::SizeOverflow`] when a region or the whole arena would not fit in `usize`
    /// (naming the parameter at which the running total overflowed).
    pub fn finalize(&mut self) -> Result<MemoryPlan, PlanError> {
        if self.finalized {
            return Err(PlanError::AlreadyFinalized);
        }
        if self.params.is_empty() {
            return Err(PlanError::EmptyPlan);
        }
        for (i, name) in self.buckets.iter().enumerate() {
            if !self.params.iter().any(|p| p.bucket.0 == i) {
                return Err(PlanError::EmptyBucket {
                    bucket: name.clone(),
                });
            }
        }

        // Stable sort keeps registration order within (bucket, group).
        let mut order: Vec<usize> = (0..self.params.len()).collect();
        order.sort_by_key(|&i| (self.params[i].bucket.0, self.params[i].kind.group()));

        let mut params = Vec::with_capacity(order.len());
        let mut offset16 = 0usize;
        let mut g16_end = 0usize;
        for (plan_index, &reg_index) in order.iter().enumerate() {
            let p = &self.params[reg_index];
            let end16 = offset16.checked_add(p.slot16);
            let arena = end16.and_then(|end| {
                let g16 = if p.kind == ParamKind::ConvWeight {
                    end
                } else {
                    g16_end
                };
                MemoryPlan::arena_bytes_for(self.options, end, g16)
            });
            let end16 = match (end16, arena) {
                (Some(end), Some(_)) => end,
                _ => {
                    return Err(PlanError::SizeOverflow {
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                        what: "region or arena total",
                    })
                }
            };
            params.push(ParamInfo {
                name: p.name.clone(),
                kind: p.kind,
                shape: p.shape.clone(),
                elems: p.elems,
                bucket: p.bucket,
                plan_index,
                registration_index: reg_index,
                offset16,
                slot16: p.slot16,
            });
            if p.kind == ParamKind::ConvWeight {
                g16_end = end16;
            }
            offset16 = end16;
        }

        let buckets = self
            .buckets
            .iter()
            .enumerate()
            .map(|(i, name)| BucketInfo::from_params(Bucket(i), name.clone(), &params))
            .collect();
        let (tensors, tensor_bytes) = lay_out(&self.tensors)?;
        let plan = MemoryPlan::from_parts(self.options, params, buckets, offset16, g16_end)
            .with_tensors(tensors, tensor_bytes);
        // The planner's own self-check: a failure here is a bug in this module.
        plan.validate()?;
        self.finalized = true;
        Ok(plan)
    }
}
