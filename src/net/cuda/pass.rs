//! One pass of a [`CudaNet`] with the amp regions borrowed: the executor the network's
//! steps walk ([`NetExecutor`]), binding each step's buffers for its kernel.

use crate::amp::cuda::{CudaRegions, CudaSlice, CudaStream, DevRange, DevRangeMut};
use crate::amp::plan::ByteRange;
use crate::net::compile::{BufId, CompiledNet};
use crate::net::exec::NetExecutor;
use crate::net::spec::PoolSpec;
use crate::netops::cuda::NetKernels;
use crate::netops::pool::PoolShape;
use cudnn_cbr_fusion::cbr::Pass;
use cudnn_cbr_fusion::reference::Nhwc;
use half::f16;

use super::net::{CudaNet, Home};
use super::{CudaNetError, Result};

/// One pass of a [`CudaNet`]: the network with the amp regions (where its parameters live)
/// and the caller's input borrowed, as the executor [`crate::net::run_pass`] walks. Made by the
/// CUDA classifier's backend ([`crate::classifier::CudaBackend`]) for each network pass.
pub struct CudaNetPass<'n> {
    pub(super) net: &'n mut CudaNet,
    pub(super) regions: Option<&'n mut CudaRegions>,
    /// The caller's input, read instead of the network's own input buffer.
    pub(super) input: Option<&'n mut CudaSlice<f16>>,
}

impl std::fmt::Debug for CudaNetPass<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaNetPass")
            .field("network", &self.net.net.spec.name)
            .field("regions", &self.regions.is_some())
            .field("caller_input", &self.input.is_some())
            .finish()
    }
}

impl NetExecutor for CudaNetPass<'_> {
    type Error = CudaNetError;

    fn compiled(&self) -> &CompiledNet {
        &self.net.net
    }

    fn layer_pass(&mut self, layer: usize, pass: Pass) -> Result<()> {
        self.net.layer_pass(
            self.regions.as_deref_mut(),
            self.input.as_deref_mut(),
            layer,
            pass,
        )
    }

    fn add(&mut self, a: BufId, b: BufId, out: BufId) -> Result<()> {
        self.with_io(out, &[a, b], |k, stream, ins, o| {
            let [a, b] = two(ins)?;
            Ok(k.add_f16(stream, a, b, o)?)
        })
    }

    fn max_pool(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        output: BufId,
    ) -> Result<()> {
        let p = pool_shape(pool, shape);
        self.with_io(output, &[input], |k, stream, ins, y| {
            let x = ins.into_iter().next().expect("one input given");
            Ok(k.max_pool_forward(stream, &p, x, y)?)
        })
    }

    fn max_pool_backward(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        grad_output: BufId,
        grad_input: BufId,
    ) -> Result<()> {
        let p = pool_shape(pool, shape);
        self.with_io(grad_input, &[input, grad_output], |k, stream, ins, dx| {
            let [x, dy] = two(ins)?;
            Ok(k.max_pool_backward(stream, &p, x, dy, dx)?)
        })
    }
}

/// Two kernel inputs out of a list of two.
fn two(ins: Vec<DevRange<'_>>) -> Result<[DevRange<'_>; 2]> {
    <[DevRange<'_>; 2]>::try_from(ins)
        .map_err(|v| CudaNetError::Binding(format!("a step has {} inputs, expected 2", v.len())))
}

impl CudaNetPass<'_> {
    /// Runs `f` with `out` writable and `inputs` readable, each the network's own allocation
    /// or a slot of the amp plan's tensor arena (the output's slot split off the arena, so the
    /// inputs around it stay readable). `out` must be none of `inputs`.
    fn with_io(
        &mut self,
        out: BufId,
        inputs: &[BufId],
        f: impl FnOnce(&NetKernels, &CudaStream, Vec<DevRange<'_>>, DevRangeMut<'_>) -> Result<()>,
    ) -> Result<()> {
        let net = &mut *self.net;
        if inputs.contains(&out) {
            return Err(CudaNetError::Binding(format!(
                "a step writes `{}`, which it also reads",
                net.net.buffers[out].name
            )));
        }
        let (kernels, stream) = (net.kernels.clone(), net.stream.clone());
        let arena = self
            .regions
            .as_deref_mut()
            .and_then(|r| r.tensor_arena_mut());
        let absent = |id: BufId| {
            CudaNetError::Binding(format!(
                "`{}` lives in the amp plan's tensor arena: run the pass with the regions",
                net.net.buffers[id].name
            ))
        };
        if let Some((Home::Tensors, start, len)) = net.slots[out] {
            let arena = arena.ok_or_else(|| absent(out))?;
            let (left, mut rest) = arena.split_at_mut(start);
            let (mut mid, right) = rest.split_at_mut(len);
            let mut ins = Vec::with_capacity(inputs.len());
            for &i in inputs {
                ins.push(match net.slots[i] {
                    Some((Home::Tensors, o, l)) if o + l <= start => {
                        DevRange::new(&left, ByteRange::new(o, o + l))?
                    }
                    Some((Home::Tensors, o, l)) if o >= start + len => {
                        let at = o - start - len;
                        DevRange::new(&right, ByteRange::new(at, at + l))?
                    }
                    Some(_) => {
                        return Err(CudaNetError::Binding(format!(
                            "`{}` overlaps the output `{}`",
                            net.net.buffers[i].name, net.net.buffers[out].name
                        )))
                    }
                    None => DevRange::whole(net.bufs[i].as_ref().ok_or_else(|| absent(i))?),
                });
            }
            return f(&kernels, &stream, ins, DevRangeMut::whole(&mut mid));
        }
        let mut o = net.bufs[out].take().ok_or_else(|| net.not_own(out))?;
        let done = own_output(net, arena.as_deref(), inputs, |ins| {
            f(&kernels, &stream, ins, DevRangeMut::whole(&mut o))
        });
        net.bufs[out] = Some(o);
        done
    }
}

/// The inputs of a step whose output is an allocation of the network's own (taken out of
/// `net` for the call): each an allocation or a slot of the tensor arena.
fn own_output(
    net: &CudaNet,
    arena: Option<&CudaSlice<u8>>,
    inputs: &[BufId],
    f: impl FnOnce(Vec<DevRange<'_>>) -> Result<()>,
) -> Result<()> {
    let mut ins = Vec::with_capacity(inputs.len());
    for &i in inputs {
        ins.push(match (net.slots[i], arena) {
            (Some((Home::Tensors, o, l)), Some(a)) => DevRange::new(a, ByteRange::new(o, o + l))?,
            _ => DevRange::whole(net.bufs[i].as_ref().ok_or_else(|| net.not_own(i))?),
        });
    }
    f(ins)
}

/// The pool kernels' shape of a compiled max-pool step.
fn pool_shape(pool: &PoolSpec, shape: &Nhwc) -> PoolShape {
    PoolShape {
        batch: shape.n,
        h: shape.h,
        w: shape.w,
        channels: shape.c,
        kernel: pool.kernel,
        stride: pool.stride,
        pad: pool.pad,
    }
}
