//! An interpreter of the graph IR: runs any [`Graph`] on the CPU over raw memory, node by
//! node, as cuDNN's documented op definitions say (docs/graph-interpreter.md).
//!
//! It is what executing a plan runs under the simulated CUDA device, and it runs any graph a
//! user builds without a GPU. It shares no code with the CPU executor's per-step code
//! (`cbr::run`, `reference`): it computes what each graph *says*, so a wiring error in a
//! graph shows up as a mismatch against what the CPU executor *intends*.
//!
//! - Real tensors are read and written at the variant pack's addresses, with their own dims,
//!   strides and element types; each one's extent is bounds-checked against the allocation
//!   the caller's [`MemoryMap`] says it falls in, and its address checked for the 16-byte
//!   alignment cuDNN is told ([`crate::exec::TENSOR_ALIGNMENT`]). Outputs may not overlap any
//!   other real tensor. Errors ([`InterpError`]) name the tensor's uid and name.
//! - Virtual tensors live in scratch; by-value tensors take the pack's scalars.
//! - Compute is FP32; every value a tensor holds is rounded to its element type (FP16 tensors
//!   to FP16). Sums (conv dot products, statistics, reductions) run in `f64` and are rounded
//!   once, so results do not depend on the thread split.
//!
//! [`execute_host`] runs over [`HostMemory`] (safe); [`execute`] over raw addresses (the
//! simulator's allocations).

mod bn;
mod conv;
mod error;
mod exec;
mod memory;
mod pointwise;
mod raw;
mod tensor;
#[cfg(test)]
mod tests;

pub use error::InterpError;
pub(crate) use error::Result;
pub use memory::{Allocation, HostMemory, MemoryMap};

use crate::exec::Scalar;
use crate::graph::Graph;

/// What a graph's real tensors bind to, by uid (as [`crate::lower::real_tensor_layout`]
/// assigns them, the uids of the plan's variant pack).
#[derive(Debug, Clone, Copy)]
pub struct VariantPack<'a> {
    /// Address of every real tensor that is not by-value.
    pub pointers: &'a [(i64, u64)],
    /// Value of every by-value tensor.
    pub scalars: &'a [(i64, Scalar)],
}

/// How the interpreter runs a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Round each convolution operand to the graph's I/O type (FP16) before the conv: the
    /// FP16 tensor-core convs consume FP16 operands, so a virtual FP32 operand (the fused
    /// prologue's `relu(x·s + b)`) is rounded on the way in, as crates/3-fusion/src/reference/fused.rs
    /// also assumes. On by default.
    pub round_conv_operands: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            round_conv_operands: true,
        }
    }
}

/// Runs `graph` over `memory`, whose allocations every address of `pack` must fall in.
///
/// # Errors
/// [`InterpError`]: an invalid graph, an unbound, null, misaligned, unmapped, out-of-bounds
/// or overlapping tensor, a scalar of the wrong type, a node whose shapes or values it
/// cannot run. Nothing is written unless every binding checks out.
pub fn execute_host(
    graph: &Graph,
    pack: &VariantPack<'_>,
    memory: &mut HostMemory,
    options: &Options,
) -> Result<()> {
    exec::run(graph, pack, memory, options)
}

/// Runs `graph` over raw addresses: for the simulated device, whose allocations are host
/// memory handed out as device pointers. Checks as [`execute_host`].
///
/// # Safety
/// Every allocation `map` reports is live host memory, readable and writable for its whole
/// length, that nothing else reads or writes until this call returns.
///
/// # Errors
/// As [`execute_host`].
#[allow(unsafe_code)]
pub unsafe fn execute(
    graph: &Graph,
    pack: &VariantPack<'_>,
    map: &dyn MemoryMap,
    options: &Options,
) -> Result<()> {
    // SAFETY: the caller's contract is the constructor's.
    let mut access = unsafe { raw::RawAccess::new(map) };
    exec::run(graph, pack, &mut access, options)
}
