//! [`MemoryPlan`]: the finalized layout, its views and ranges, and its self-check.

use std::collections::HashMap;

use crate::error::PlanError;
use crate::plan::tensors::TensorSlot;
use crate::plan::types::{
    fp16_slot_bytes, Bucket, ByteRange, DataType, MemoryPlanOptions, ParamKind, Region, SLOT_ALIGN,
    SLOT_PAD,
};
use crate::range::S_REGION_BYTES;

/// One parameter as laid out by the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    pub(crate) name: String,
    pub(crate) kind: ParamKind,
    pub(crate) shape: Vec<usize>,
    pub(crate) elems: usize,
    pub(crate) bucket: Bucket,
    pub(crate) plan_index: usize,
    pub(crate) registration_index: usize,
    /// Byte offset in the FP16 layout (A, G16, E16); FP32 regions use twice this.
    pub(crate) offset16: usize,
    /// FP16 slot size; FP32 slots are twice this.
    pub(crate) slot16: usize,
}

impl ParamInfo {
    /// The registered name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The registered kind.
    pub fn kind(&self) -> ParamKind {
        self.kind
    }
    /// The registered shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of elements (product of the shape).
    pub fn elems(&self) -> usize {
        self.elems
    }
    /// The bucket it was registered in.
    pub fn bucket(&self) -> Bucket {
        self.bucket
    }
    /// Position in every region (0 = first).
    pub fn plan_index(&self) -> usize {
        self.plan_index
    }
    /// Position in registration order.
    pub fn registration_index(&self) -> usize {
        self.registration_index
    }
    /// Byte offset of its slot in any FP16 region.
    pub fn offset16(&self) -> usize {
        self.offset16
    }
    /// Size of its slot in any FP16 region (FP32 slots are twice this).
    pub fn slot16(&self) -> usize {
        self.slot16
    }
}

/// A bucket as laid out by the plan. Ranges are in FP16-layout bytes; use
/// [`MemoryPlan::bucket_range`] for a given region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketInfo {
    bucket: Bucket,
    name: String,
    params: std::ops::Range<usize>,
    span16: ByteRange,
    conv16: ByteRange,
    decay16: ByteRange,
}

impl BucketInfo {
    /// Collects the bucket's contiguous run of `params` (plan order).
    pub(crate) fn from_params(bucket: Bucket, name: String, params: &[ParamInfo]) -> Self {
        let first = params.iter().position(|p| p.bucket == bucket).unwrap_or(0);
        let count = params[first..]
            .iter()
            .take_while(|p| p.bucket == bucket)
            .count();
        let run = &params[first..first + count];
        let start = run.first().map_or(0, |p| p.offset16);
        let end_of = |pred: fn(&ParamInfo) -> bool| {
            run.iter()
                .take_while(|p| pred(p))
                .last()
                .map_or(start, |p| p.offset16 + p.slot16)
        };
        BucketInfo {
            bucket,
            name,
            params: first..first + count,
            span16: ByteRange::new(start, end_of(|_| true)),
            conv16: ByteRange::new(start, end_of(|p| p.kind == ParamKind::ConvWeight)),
            decay16: ByteRange::new(start, end_of(|p| p.kind.decays())),
        }
    }

    /// The bucket handle.
    pub fn bucket(&self) -> Bucket {
        self.bucket
    }
    /// The declared name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Its parameters, as plan indices.
    pub fn params(&self) -> std::ops::Range<usize> {
        self.params.clone()
    }
    /// All its slots, FP16-layout bytes.
    pub fn span16(&self) -> ByteRange {
        self.span16
    }
    /// Its conv slots (a prefix of `span16`; empty when it has no conv parameter).
    pub fn conv16(&self) -> ByteRange {
        self.conv16
    }
    /// Its weight-decayed slots (conv and FC weights; a prefix of `span16`).
    pub fn decay16(&self) -> ByteRange {
        self.decay16
    }
}

/// A typed window on one parameter's slot in one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamView<'a> {
    /// Parameter name.
    pub name: &'a str,
    /// Parameter shape.
    pub shape: &'a [usize],
    /// Element count.
    pub elems: usize,
    /// Parameter kind.
    pub kind: ParamKind,
    /// Bucket.
    pub bucket: Bucket,
    /// The region this view is in.
    pub region: Region,
    /// The region's element type.
    pub dtype: DataType,
    /// Byte offset of the data from the region's start (a multiple of 256).
    pub offset_bytes: usize,
    /// Bytes of data: `elems * dtype.size()`.
    pub len_bytes: usize,
    /// Bytes of the whole slot (data + zero padding).
    pub slot_bytes: usize,
}

impl ParamView<'_> {
    /// The data bytes, `[offset, offset + len)`.
    pub fn data_range(&self) -> ByteRange {
        ByteRange::new(self.offset_bytes, self.offset_bytes + self.len_bytes)
    }
    /// The whole slot, padding included.
    pub fn slot_range(&self) -> ByteRange {
        ByteRange::new(self.offset_bytes, self.offset_bytes + self.slot_bytes)
    }
    /// Index of the first element when the region is seen as a slice of `dtype`.
    pub fn elem_offset(&self) -> usize {
        self.offset_bytes / self.dtype.size()
    }
}

/// Where a region sits if all regions share one allocation (an arena).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionLayout {
    /// The region.
    pub region: Region,
    /// Its byte length.
    pub len_bytes: usize,
    /// Its offset in the arena (a multiple of 256).
    pub arena_offset: usize,
}

/// The finalized memory plan: every parameter's slot in every region it lives in.
///
/// Built by [`crate::plan::MemoryPlanBuilder::finalize`]; immutable afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    options: MemoryPlanOptions,
    params: Vec<ParamInfo>,
    buckets: Vec<BucketInfo>,
    by_name: HashMap<String, usize>,
    /// Length of every full FP16 region (A, E16); FP32 regions are twice this.
    total16: usize,
    /// Length of G16: end of the last conv slot (0 without conv parameters).
    g16_len: usize,
    /// The tensor arena's slots ([`MemoryPlanBuilder::add_tensor`](crate::plan::MemoryPlanBuilder::add_tensor)).
    tensors: Vec<TensorSlot>,
    /// The tensor arena's size (0 without tensors).
    tensor_bytes: usize,
}

impl MemoryPlan {
    pub(crate) fn from_parts(
        options: MemoryPlanOptions,
        params: Vec<ParamInfo>,
        buckets: Vec<BucketInfo>,
        total16: usize,
        g16_len: usize,
    ) -> Self {
        let by_name = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        MemoryPlan {
            options,
            params,
            buckets,
            by_name,
            total16,
            g16_len,
            tensors: Vec::new(),
            tensor_bytes: 0,
        }
    }

    pub(crate) fn with_tensors(mut self, tensors: Vec<TensorSlot>, tensor_bytes: usize) -> Self {
        self.tensors = tensors;
        self.tensor_bytes = tensor_bytes;
        self
    }

    /// The tensor arena's slots, in registration order.
    pub fn tensors(&self) -> &[TensorSlot] {
        &self.tensors
    }

    /// A tensor slot by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorSlot> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Bytes of the tensor arena (a multiple of 256; 0 without tensors). Not part of
    /// [`MemoryPlan::total_bytes`], which counts the regions.
    pub fn tensor_bytes(&self) -> usize {
        self.tensor_bytes
    }

    /// Arena size for the given layout totals, or `None` on overflow. Shared by the builder
    /// (to find which parameter makes the total overflow) and [`MemoryPlan::total_bytes`].
    pub(crate) fn arena_bytes_for(
        options: MemoryPlanOptions,
        total16: usize,
        g16: usize,
    ) -> Option<usize> {
        let fp32 = total16.checked_mul(2)?;
        let mut sum = fp32.checked_add(total16)?.checked_add(fp32)?; // W, A, G
        sum = sum.checked_add(g16)?;
        if options.momentum {
            sum = sum.checked_add(fp32)?;
        }
        if options.ema {
            sum = sum.checked_add(fp32)?.checked_add(total16)?;
        }
        if options.grad_accumulator {
            sum = sum.checked_add(fp32)?;
        }
        sum.checked_add(S_REGION_BYTES)
    }

    /// The options the plan was built with.
    pub fn options(&self) -> MemoryPlanOptions {
        self.options
    }

    /// All parameters, in plan (= region) order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// A parameter by name.
    pub fn param(&self, name: &str) -> Option<&ParamInfo> {
        self.by_name.get(name).map(|&i| &self.params[i])
    }

    /// All buckets, in declaration (= region) order.
    pub fn buckets(&self) -> &[BucketInfo] {
        &self.buckets
    }

    /// Total element count over all parameters.
    pub fn total_elems(&self) -> usize {
        // Cannot overflow: each slot holds more bytes than elements and their sum fits.
        self.params.iter().map(|p| p.elems).sum()
    }

    /// Whether the plan allocates `region`.
    pub fn has_region(&self, region: Region) -> bool {
        match region {
            Region::W | Region::A | Region::G | Region::S => true,
            Region::G16 => self.g16_len > 0,
            Region::M => self.options.momentum,
            Region::E | Region::E16 => self.options.ema,
            Region::GA => self.options.grad_accumulator,
        }
    }

    /// This plan with the gradient accumulator GA allocated (an FP32 region laid out as G):
    /// the plan of a step that accumulates gradients over several micro-batches
    /// ([`crate::step::StepConfig::with_accum`]). Nothing else moves: GA only adds a region.
    ///
    /// # Errors
    /// [`PlanError::SizeOverflow`] (naming the last parameter) when the regions with GA no
    /// longer fit in `usize`.
    pub fn with_grad_accumulator(mut self) -> Result<Self, PlanError> {
        let options = MemoryPlanOptions {
            grad_accumulator: true,
            ..self.options
        };
        if Self::arena_bytes_for(options, self.total16, self.g16_len).is_none() {
            let last = self.params.last();
            return Err(PlanError::SizeOverflow {
                name: last.map(|p| p.name.clone()).unwrap_or_default(),
                shape: last.map(|p| p.shape.clone()).unwrap_or_default(),
                what: "the regions' total with the gradient accumulator GA",
            });
        }
        self.options = options;
        Ok(self)
    }

    /// Byte length of `region` (0 when absent). Always a multiple of 256.
    pub fn region_len(&self, region: Region) -> usize {
        if !self.has_region(region) {
            return 0;
        }
        match region {
            // The builder checked every FP32 total with checked_mul.
            Region::W | Region::G | Region::M | Region::E | Region::GA => self.total16 * 2,
            Region::A | Region::E16 => self.total16,
            Region::G16 => self.g16_len,
            Region::S => S_REGION_BYTES,
        }
    }

    /// The whole of `region` as a range, `[0, region_len)`.
    ///
    /// # Errors
    /// [`PlanError::RegionAbsent`] when the plan does not allocate it.
    pub fn region_range(&self, region: Region) -> Result<ByteRange, PlanError> {
        if !self.has_region(region) {
            return Err(PlanError::RegionAbsent { region });
        }
        Ok(ByteRange::new(0, self.region_len(region)))
    }

    /// Every allocated region with its length and its offset in a single arena.
    pub fn arena_layout(&self) -> Vec<RegionLayout> {
        let mut offset = 0;
        Region::ALL
            .iter()
            .filter(|&&r| self.has_region(r))
            .map(|&region| {
                let len_bytes = self.region_len(region);
                let layout = RegionLayout {
                    region,
                    len_bytes,
                    arena_offset: offset,
                };
                offset += len_bytes;
                layout
            })
            .collect()
    }

    /// Bytes of all regions together (the arena size).
    pub fn total_bytes(&self) -> usize {
        // The builder proved this fits; `unwrap_or` only keeps the function panic-free.
        Self::arena_bytes_for(self.options, self.total16, self.g16_len).unwrap_or(usize::MAX)
    }

    /// Whether `param` has a slot in `region`.
    pub fn lives_in(&self, param: &ParamInfo, region: Region) -> bool {
        match region {
            Region::W | Region::A | Region::G => true,
            Region::G16 => param.kind == ParamKind::ConvWeight,
            Region::M => self.options.momentum,
            Region::E | Region::E16 => self.options.ema,
            Region::GA => self.options.grad_accumulator,
            Region::S => false,
        }
    }

    fn view_of<'a>(&'a self, p: &'a ParamInfo, region: Region) -> Result<ParamView<'a>, PlanError> {
        let (Some(dtype), Some(scale)) = (region.dtype(), region.scale_from_fp16()) else {
            return Err(PlanError::NotInRegion {
                name: p.name.clone(),
                region,
            });
        };
        if !self.lives_in(p, region) {
            return Err(PlanError::NotInRegion {
                name: p.name.clone(),
                region,
            });
        }
        Ok(ParamView {
            name: &p.name,
            shape: &p.shape,
            elems: p.elems,
            kind: p.kind,
            bucket: p.bucket,
            region,
            dtype,
            offset_bytes: p.offset16 * scale,
            len_bytes: p.elems * dtype.size(),
            slot_bytes: p.slot16 * scale,
        })
    }

    /// The view of parameter `name` in `region`.
    ///
    /// # Errors
    /// [`PlanError::UnknownParam`], or [`PlanError::NotInRegion`] when it has no slot there
    /// (S, G16 for non-conv kinds, M/E/E16 when not allocated).
    pub fn view(&self, name: &str, region: Region) -> Result<ParamView<'_>, PlanError> {
        let p = self.param(name).ok_or_else(|| PlanError::UnknownParam {
            name: name.to_owned(),
        })?;
        self.view_of(p, region)
    }

    /// Views of every parameter that lives in `region`, in region order.
    pub fn views(&self, region: Region) -> Vec<ParamView<'_>> {
        self.params
            .iter()
            .filter_map(|p| self.view_of(p, region).ok())
            .collect()
    }

    /// The layout of `bucket`.
    ///
    /// # Errors
    /// [`PlanError::NoSuchBucket`].
    pub fn bucket_info(&self, bucket: Bucket) -> Result<&BucketInfo, PlanError> {
        self.buckets
            .get(bucket.0)
            .ok_or(PlanError::NoSuchBucket { bucket: bucket.0 })
    }

    fn scaled(&self, r16: ByteRange, region: Region) -> Result<ByteRange, PlanError> {
        let scale = region
            .scale_from_fp16()
            .filter(|_| self.has_region(region))
            .ok_or(PlanError::RegionAbsent { region })?;
        Ok(ByteRange::new(r16.start * scale, r16.end * scale))
    }

    /// The byte range of `bucket` in `region`: all its slots, or in G16 its conv run (which
    /// starts at the bucket's start; an empty range if the bucket has no conv parameter).
    ///
    /// # Errors
    /// [`PlanError::NoSuchBucket`], or [`PlanError::RegionAbsent`] (S included: it is not
    /// split into buckets).
    pub fn bucket_range(&self, bucket: Bucket, region: Region) -> Result<ByteRange, PlanError> {
        let b = self.bucket_info(bucket)?;
        let r16 = if region == Region::G16 {
            // A bucket without conv parameters after the last conv one starts past G16's
            // end: clamp both ends so it is an empty range at the end, not a range beyond it.
            let start = b.conv16.start.min(self.g16_len);
            ByteRange::new(start, b.conv16.end.min(self.g16_len).max(start))
        } else {
            b.span16
        };
        self.scaled(r16, region)
    }

    /// The weight-decayed part of `bucket` in `region` (conv and FC weights). The rest of
    /// the bucket, `[decay.end, bucket.end)`, holds BN affine parameters and biases.
    ///
    /// # Errors
    /// As [`MemoryPlan::bucket_range`].
    pub fn decay_range(&self, bucket: Bucket, region: Region) -> Result<ByteRange, PlanError> {
        let b = self.bucket_info(bucket)?;
        self.scaled(b.decay16, region)
    }

    /// The ranges of G16 that the FP16→FP32 cast must cover, in G16 bytes (the G range is
    /// each one [`ByteRange::to_fp32`]). One per bucket with conv parameters, adjacent ones
    /// merged: with one bucket this is a single launch.
    ///
    /// The cast must NOT cover the whole G16 region: between buckets G16 has holes where
    /// non-conv parameters sit in the FP16 layout, and their G slots are written FP32 by
    /// cuBLAS / BN backward, which a cast would overwrite.
    pub fn g16_cast_ranges(&self) -> Vec<ByteRange> {
        let mut out: Vec<ByteRange> = Vec::new();
        for b in &self.buckets {
            if b.conv16.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.end == b.conv16.start => last.end = b.conv16.end,
                _ => out.push(b.conv16),
            }
        }
        out
    }

    /// Bytes of G16 that belong to no parameter: the FP16 slots of non-conv parameters that
    /// sit before the last conv parameter. Since the plan puts each bucket's convs first,
    /// these are only the non-conv parameters of buckets before the last bucket with a conv
    /// (typically small BN vectors; the FC layer, in the last bucket, costs nothing).
    pub fn g16_hole_bytes(&self) -> usize {
        let used: usize = self
            .params
            .iter()
            .filter(|p| p.kind == ParamKind::ConvWeight)
            .map(|p| p.slot16)
            .sum();
        self.g16_len.saturating_sub(used)
    }

    /// Checks every layout invariant; `finalize` runs it, tests run it on random plans.
    ///
    /// 1. Slots: each FP16 slot is `align_up(elems*2 + 16, 256)`, holds its data plus at
    ///    least 16 padding bytes, and starts on 256 bytes.
    /// 2. Order and no overlap: slots are dense and ascending in plan order, in every region.
    /// 3. 2:1: in every FP32 region a parameter's offset and slot are twice those in FP16.
    /// 4. Buckets: contiguous, in declaration order, covering every region; inside a bucket
    ///    conv weights first, then FC weights, then the rest.
    /// 5. G16 holds exactly the conv parameters and ends at the last one.
    /// 6. Names are unique and index the right parameter.
    ///
    /// # Errors
    /// [`PlanError::Invariant`], naming the parameter where a check failed.
    pub fn validate(&self) -> Result<(), PlanError> {
        let broken = |name: &str, what: String| {
            Err(PlanError::Invariant {
                name: name.to_owned(),
                what,
            })
        };
        if self.params.is_empty() {
            return broken("", "plan has no parameters".into());
        }
        crate::plan::tensors::check(&self.tensors, self.tensor_bytes)?;
        let mut expect16 = 0usize;
        let mut last_conv_end = 0usize;
        for (i, p) in self.params.iter().enumerate() {
            // 6.
            if self.by_name.get(&p.name) != Some(&i) || p.plan_index != i {
                return broken(
                    &p.name,
                    format!("name index does not point at plan slot {i}"),
                );
            }
            // 1.
            if fp16_slot_bytes(p.elems) != Some(p.slot16) {
                return broken(
                    &p.name,
                    format!("FP16 slot {} breaks the slot rule", p.slot16),
                );
            }
            if p.offset16 % SLOT_ALIGN != 0 {
                return broken(&p.name, format!("offset {} not 256-aligned", p.offset16));
            }
            if p.elems * 2 + SLOT_PAD > p.slot16 {
                return broken(&p.name, "slot lacks 16 bytes of padding".into());
            }
            // 2.
            if p.offset16 != expect16 {
                return broken(
                    &p.name,
                    format!("offset {} != {} (overlap or gap)", p.offset16, expect16),
                );
            }
            expect16 = expect16.saturating_add(p.slot16);
            // 4. Non-decreasing (bucket, group).
            if let Some(prev) = i.checked_sub(1).map(|j| &self.params[j]) {
                if (prev.bucket, prev.kind.group()) > (p.bucket, p.kind.group()) {
                    return broken(&p.name, "out of bucket/kind order".into());
                }
            }
            if p.kind == ParamKind::ConvWeight {
                last_conv_end = p.offset16 + p.slot16;
            }
            // 3. and 5.: compare each region's view against its FP16 twin.
            for region in Region::ALL {
                let Ok(v) = self.view_of(p, region) else {
                    if region == Region::G16 && p.kind == ParamKind::ConvWeight {
                        return broken(&p.name, "conv parameter missing from G16".into());
                    }
                    continue;
                };
                if region == Region::G16 && p.kind != ParamKind::ConvWeight {
                    return broken(&p.name, "non-conv parameter in G16".into());
                }
                if v.slot_range().end > self.region_len(region) {
                    return broken(&p.name, format!("slot runs past the end of {region}"));
                }
                if v.dtype == DataType::Float
                    && (v.offset_bytes != 2 * p.offset16 || v.slot_bytes != 2 * p.slot16)
                {
                    return broken(&p.name, format!("{region} is not 2:1 with its FP16 twin"));
                }
            }
        }
        if expect16 != self.total16 {
            return broken(
                "",
                format!("FP16 total {} != sum of slots {}", self.total16, expect16),
            );
        }
        if last_conv_end != self.g16_len {
            return broken(
                "",
                format!(
                    "G16 length {} != end of last conv {}",
                    self.g16_len, last_conv_end
                ),
            );
        }
        // 4. Buckets tile the layout in order.
        let mut next = ByteRange::default();
        let mut next_param = 0usize;
        for (i, b) in self.buckets.iter().enumerate() {
            let name = &b.name;
            if b.bucket.0 != i || b.span16.start != next.end || b.params.start != next_param {
                return broken(
                    name,
                    format!("bucket `{name}` is not contiguous after the previous one"),
                );
            }
            if b.params.is_empty()
                || self.params[b.params.clone()]
                    .iter()
                    .any(|p| p.bucket != b.bucket)
            {
                return broken(
                    name,
                    format!("bucket `{name}` holds foreign or no parameters"),
                );
            }
            if b.conv16.start != b.span16.start
                || b.conv16.end > b.span16.end
                || b.decay16.start != b.span16.start
                || b.decay16.end > b.span16.end
                || b.conv16.end > b.decay16.end
            {
                return broken(name, format!("bucket `{name}` sub-ranges are not prefixes"));
            }
            for r in Region::ALL {
                if let Ok(range) = self.bucket_range(b.bucket, r) {
                    if range.end > self.region_len(r) || range.start > range.end {
                        return broken(name, format!("bucket `{name}` range runs past {r}"));
                    }
                }
            }
            next = b.span16;
            next_param = b.params.end;
        }
        if next.end != self.total16 || next_param != self.params.len() {
            return broken("", "buckets do not cover every parameter".into());
        }
        for r in Region::ALL {
            if !self.region_len(r).is_multiple_of(SLOT_ALIGN) {
                return broken("", format!("{r} length not a multiple of 256"));
            }
        }
        Ok(())
    }
}
