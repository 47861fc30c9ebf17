//! Typed errors of the AMP layer.
//!
//! Two families, wrapped by [`AmpError`]:
//! 1. [`PlanError`]: a bad parameter registration or a plan query that cannot be answered.
//!    Every variant about a parameter carries its `name`, and the message names it too, so
//!    a failure in a 200-parameter network points at the culprit.
//! 2. [`RangeOpError`]: a CPU range op called with slices that disagree in length, or with a
//!    configuration the kernels would not accept (a NaN learning rate, a zero growth
//!    interval, ...).

use thiserror::Error;

use crate::plan::{ParamKind, Region};

/// Any error of the AMP layer.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AmpError {
    /// Building or querying a memory plan failed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A range op (CPU twin) or its configuration was rejected.
    #[error(transparent)]
    RangeOp(#[from] RangeOpError),
}

/// Errors from [`crate::plan::MemoryPlanBuilder`] and [`crate::plan::MemoryPlan`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A parameter was registered with an empty name; `index` is its registration index.
    #[error("parameter #{index} has an empty name")]
    EmptyName {
        /// Registration index (0-based) of the nameless parameter.
        index: usize,
    },
    /// Two parameters share a name; names key every view, so they must be unique.
    #[error("parameter `{name}` is registered twice")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A shape with no dimensions: a scalar parameter has shape `[1]`, not `[]`.
    #[error("parameter `{name}` has an empty shape (use [1] for a single value)")]
    EmptyShape {
        /// The parameter.
        name: String,
    },
    /// A shape with a zero dimension would give a parameter with no elements.
    #[error("parameter `{name}` has a zero dimension in shape {shape:?}")]
    ZeroDim {
        /// The parameter.
        name: String,
        /// Its shape as registered.
        shape: Vec<usize>,
    },
    /// The shape's rank does not fit the parameter kind (e.g. a 2-D BN gamma).
    #[error("parameter `{name}` is a {kind:?} and needs rank {expected}, got shape {shape:?}")]
    RankMismatch {
        /// The parameter.
        name: String,
        /// Its kind.
        kind: ParamKind,
        /// The accepted rank(s), in words, e.g. `"1"` or `"3 to 5"`.
        expected: &'static str,
        /// Its shape as registered.
        shape: Vec<usize>,
    },
    /// The element count, a slot size or a region size does not fit in `usize` bytes.
    #[error("parameter `{name}` (shape {shape:?}) makes a size overflow: {what}")]
    SizeOverflow {
        /// The parameter whose size (or whose addition to a region) overflowed.
        name: String,
        /// Its shape as registered.
        shape: Vec<usize>,
        /// Which size overflowed.
        what: &'static str,
    },
    /// A registration after `finalize`: the plan handed out would silently lack it.
    #[error("parameter `{name}` registered after the plan was finalized")]
    RegisterAfterFinalize {
        /// The late parameter.
        name: String,
    },
    /// A bucket declared after `finalize`.
    #[error("bucket `{bucket}` declared after the plan was finalized")]
    BucketAfterFinalize {
        /// The late bucket's name.
        bucket: String,
    },
    /// `finalize` called a second time on the same builder.
    #[error("the memory plan builder was already finalized")]
    AlreadyFinalized,
    /// A bucket name declared twice, or an empty bucket name.
    #[error("bucket name `{bucket}` is empty or declared twice")]
    BadBucketName {
        /// The offending bucket name.
        bucket: String,
    },
    /// A parameter refers to a bucket handle this builder never made.
    #[error("parameter `{name}` refers to unknown bucket #{bucket}")]
    UnknownBucket {
        /// The parameter.
        name: String,
        /// The bucket's index.
        bucket: usize,
    },
    /// A plan query used a bucket handle the plan does not have.
    #[error("the memory plan has no bucket #{bucket}")]
    NoSuchBucket {
        /// The bucket's index.
        bucket: usize,
    },
    /// A declared bucket got no parameters; its ranges would be empty and a reduction over
    /// it would do nothing, which is almost always a registration mistake.
    #[error("bucket `{bucket}` has no parameters")]
    EmptyBucket {
        /// The bucket's name.
        bucket: String,
    },
    /// `finalize` with no parameters at all.
    #[error("the memory plan has no parameters")]
    EmptyPlan,
    /// A view or range was asked for a parameter name the plan does not know.
    #[error("no parameter named `{name}` in the plan")]
    UnknownParam {
        /// The name asked for.
        name: String,
    },
    /// A view was asked in a region the parameter does not live in (e.g. an FC weight in
    /// G16, or any parameter in E when EMA is off).
    #[error("parameter `{name}` has no slot in region {region:?}")]
    NotInRegion {
        /// The parameter.
        name: String,
        /// The region asked for.
        region: Region,
    },
    /// A range was asked in a region this plan does not allocate.
    #[error("region {region:?} is not part of this plan")]
    RegionAbsent {
        /// The region asked for.
        region: Region,
    },
    /// `validate` found a broken invariant (a bug in the planner, never a user error).
    #[error("memory plan invariant broken at parameter `{name}`: {what}")]
    Invariant {
        /// The parameter (or, for bucket checks, the bucket) where the check failed; empty
        /// for plan-wide checks.
        name: String,
        /// The invariant, in words.
        what: String,
    },
}

/// Errors from the CPU range ops and their configurations.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RangeOpError {
    /// Two slices that must cover the same elements have different lengths.
    #[error("{op}: `{what}` has {got} elements, expected {expected}")]
    LengthMismatch {
        /// The range op.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A configuration value the kernels would not accept.
    #[error("{op}: invalid {field} = {value}: {why}")]
    InvalidConfig {
        /// The range op or policy.
        op: &'static str,
        /// The field.
        field: &'static str,
        /// The value, printed.
        value: String,
        /// What is required.
        why: &'static str,
    },
    /// The S-region byte image is too short to hold the scalars.
    #[error("S region image has {got} bytes, needs at least {needed}")]
    ScalarsTooShort {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        needed: usize,
    },
}
