//! Where each network buffer lives on the device (no device involved): its amp slot or an
//! allocation of its own, checked to hold it; what a layer's pass binds; whether
//! synchronized BN can run.

use crate::amp::plan::{MemoryPlan, Region};
use crate::amp::AmpError;
use crate::net::compile::{BufId, BufferRole, CompiledNet, NetBuffer};
use crate::net::layer_params::LayerParam;
use crate::runtime::DataType;
use cudnn_cbr_fusion::cbr::Side;

use super::{CudaNetError, Result};

/// Where a network buffer lives on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A parameter's slot in an amp region (`<layer>.<suffix>`).
    Param {
        /// The amp parameter.
        key: String,
        /// Its region.
        region: Region,
    },
    /// An allocation of its own.
    Own,
}

/// The amp parameter (`{layer}.{suffix}`) and region a network parameter buffer is bound to:
/// `{layer}.w` → the weight in A, `{layer}.dw` → its slot in G16, `{layer}.gamma`/`beta` → W,
/// `{layer}.dgamma`/`dbeta` → G.
pub fn param_slot(buffer: &str) -> Option<(String, Region)> {
    LayerParam::slot_of_buffer(buffer)
}

/// Where each network buffer lives (no device involved): with `amp_params`, parameters and
/// their gradients in the amp regions; everything else (and without it, everything) its own
/// allocation.
///
/// # Errors
/// A parameter buffer whose name maps to no amp parameter.
pub fn binding_plan(net: &CompiledNet, amp_params: bool) -> Result<Vec<Source>> {
    net.buffers
        .iter()
        .map(|b| match b.role {
            BufferRole::Param | BufferRole::ParamGrad if amp_params => param_slot(&b.name)
                .map(|(key, region)| Source::Param { key, region })
                .ok_or_else(|| {
                    CudaNetError::Binding(format!("parameter buffer `{}` has no amp slot", b.name))
                }),
            _ => Ok(Source::Own),
        })
        .collect()
}

/// Where a network buffer lives on the device, given an amp memory plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// An allocation of the network's own.
    Own,
    /// A parameter's (or its gradient's) slot in an amp region.
    Region {
        /// The region.
        region: Region,
        /// Byte offset in it.
        offset: usize,
        /// Bytes of data.
        bytes: usize,
    },
    /// A slot of the plan's tensor arena.
    Tensors {
        /// Byte offset in the arena.
        offset: usize,
        /// Bytes of data.
        bytes: usize,
    },
}

/// Where each buffer of `net` lives (no device involved): with `plan`, parameters and their
/// gradients in its regions and the buffers it registered in its tensor arena; everything
/// else an allocation of the network's own. Each slot is checked to hold its buffer.
///
/// # Errors
/// A parameter buffer without a slot; a slot of the wrong type or too small.
pub fn placement(net: &CompiledNet, plan: Option<&MemoryPlan>) -> Result<Vec<Placement>> {
    let sources = binding_plan(net, plan.is_some())?;
    net.buffers
        .iter()
        .zip(sources)
        .map(|(b, source)| match (source, plan) {
            (Source::Param { key, region }, Some(plan)) => {
                let v = plan.view(&key, region).map_err(AmpError::from)?;
                check_binding(b, v.len_bytes, v.dtype)?;
                Ok(Placement::Region {
                    region,
                    offset: v.offset_bytes,
                    bytes: v.len_bytes,
                })
            }
            (_, Some(plan)) if plan.tensor(&b.name).is_some() => {
                let t = plan.tensor(&b.name).expect("checked in the guard");
                check_binding(b, t.len_bytes(), t.dtype())?;
                Ok(Placement::Tensors {
                    offset: t.offset_bytes(),
                    bytes: t.len_bytes(),
                })
            }
            _ => Ok(Placement::Own),
        })
        .collect()
}

/// A binding's (bytes, type) must cover the buffer's.
pub fn check_binding(buffer: &NetBuffer, bytes: usize, dtype: DataType) -> Result<()> {
    let need = buffer.elems * buffer.dtype.size();
    if dtype != buffer.dtype || bytes < need {
        return Err(CudaNetError::Binding(format!(
            "buffer `{}` needs {need} bytes of {:?}, its binding has {bytes} of {dtype:?}",
            buffer.name, buffer.dtype,
        )));
    }
    Ok(())
}

/// The current running statistics (`{layer}.running_mean`, `{layer}.running_var`).
pub fn running_stats(net: &CompiledNet) -> impl Iterator<Item = BufId> + '_ {
    net.buffers.iter().enumerate().filter_map(|(id, b)| {
        let current = b.name.ends_with(".running_mean") || b.name.ends_with(".running_var");
        (b.role == BufferRole::Running && current).then_some(id)
    })
}

/// Whether synchronized BN can run on the GPU for `net` (no device involved): every layer on
/// a route whose BN sums can be reduced between its steps (fused or generic).
///
/// # Errors
/// [`cudnn_cbr_fusion::Error::BnSync`] naming the first layer whose route sums its BN
/// statistics inside one graph (the unfused route's NormForward / NormBackward).
pub fn check_bn_sync(net: &CompiledNet) -> Result<()> {
    for l in &net.layers {
        l.layer.check_gpu_bn_sync().map_err(|e| match e {
            cudnn_cbr_fusion::Error::BnSync(m) => {
                cudnn_cbr_fusion::Error::BnSync(format!("`{}`: {m}", l.name))
            }
            other => other,
        })?;
    }
    Ok(())
}

/// What one layer's pass binds: each of its buffer names (this layer's, and the previous
/// layer's that [`CbrLayer::prev_buffers`](cudnn_cbr_fusion::cbr::CbrLayer::prev_buffers)
/// lists) with the network buffer behind it.
///
/// # Errors
/// A previous-layer buffer the previous layer does not have.
pub fn layer_bindings(net: &CompiledNet, layer: usize) -> Result<Vec<(Side, &'static str, BufId)>> {
    let l = &net.layers[layer];
    let mut wanted: Vec<(Side, &'static str, BufId)> = l
        .table
        .iter()
        .map(|(&n, &id)| (Side::This, n, id))
        .collect();
    if let Some(p) = l.prev {
        let prev_table = &net.layers[p].table;
        for spec in l.layer.prev_buffers() {
            let id = *prev_table.get(spec.name).ok_or_else(|| {
                CudaNetError::Binding(format!(
                    "layer `{}` reads `{}` of layer `{}`, which has no such buffer",
                    l.name, spec.name, net.layers[p].name
                ))
            })?;
            wanted.push((Side::Prev, spec.name, id));
        }
    }
    Ok(wanted)
}
