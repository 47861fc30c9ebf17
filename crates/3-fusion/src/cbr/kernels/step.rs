//! A layer step our kernel runs ([`KernelStep`]): which kernel computes a step's graph, and
//! where each of its arguments comes from.

use super::launch::{enqueue, KernelArg, Launch};
use super::{kernel_error, module::Loaded, OwnKernel, Size};
use crate::cbr::device_buffers::{DeviceBuffer, Resolved, Side};
use crate::cbr::layer::{CbrConfig, LayerGraph, RouteKind, Src};
use crate::error::{Error, Result};
use crate::exec::{Handle, Scalar};
use crate::graph::{DataType, Node, TensorId};

/// The shared memory a block of the statistics kernel may use (the default per-block limit).
const STATS_SHARED_LIMIT: usize = 48 * 1024;

/// One argument of a planned kernel step.
#[derive(Debug, Clone, PartialEq)]
struct Arg {
    src: Src,
    dtype: DataType,
    elems: usize,
}

/// A layer step our kernel runs: the kernel, where each argument comes from, the tensor size.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelStep {
    kernel: OwnKernel,
    arch: &'static str,
    /// Inputs in argument order, then the output.
    args: Vec<Arg>,
    elems: u64,
    channels: u32,
}

impl KernelStep {
    /// The step for `lg` when one of our kernels computes its graph with the element types
    /// it was written for, else `None` (cuDNN plans it). `arch` is what the kernels are
    /// compiled for ([`prepare`](super::prepare)).
    pub fn for_graph(lg: &LayerGraph, arch: &'static str) -> Option<Self> {
        Self::with_kernel(lg, OwnKernel::for_graph(&lg.graph)?, arch)
    }

    /// The step for `lg`, a graph of layer `config` on route `kind`, where its role's entry in
    /// the per-role table names the own kernel its graph is written for (and the graph is
    /// that kernel's: [`OwnKernel::for_graph`]), prepared as [`KernelStep::for_graph`]
    /// prepares it; else `None` (cuDNN plans it).
    pub(crate) fn for_role(
        lg: &LayerGraph,
        config: &CbrConfig,
        kind: RouteKind,
        arch: &'static str,
    ) -> Option<Self> {
        let kernel = (lg.role.def().kernel)(config, kind)?;
        if OwnKernel::for_graph(&lg.graph)? != kernel {
            return None;
        }
        Self::with_kernel(lg, kernel, arch)
    }

    /// [`KernelStep::for_graph`] with the kernel chosen.
    fn with_kernel(lg: &LayerGraph, kernel: OwnKernel, arch: &'static str) -> Option<Self> {
        let g = &lg.graph;
        let src_of = |t: TensorId| lg.bindings.iter().find(|(b, _)| *b == t).map(|(_, s)| *s);
        let elems_of = |t: TensorId| {
            g.get(t)
                .and_then(|a| usize::try_from(a.dims.iter().product::<i64>()).ok())
        };
        let mut args = Vec::new();
        let mut inputs = Vec::new();
        for p in kernel.params() {
            let t = g
                .tensors()
                .iter()
                .position(|a| a.name == p.name && !a.is_virtual)
                .map(|i| TensorId(i as u32))?;
            if g.dtype(t)? != p.dtype {
                return None;
            }
            inputs.push(t);
            args.push(Arg {
                src: src_of(t)?,
                dtype: p.dtype,
                elems: if p.size == Size::Scalar {
                    1
                } else {
                    elems_of(t)?
                },
            });
        }
        // Sizes come from the first input, a full tensor in every kernel.
        let dims = &g.get(*inputs.first()?)?.dims;
        let elems = elems_of(inputs[0])?;
        let channels = u32::try_from(*dims.get(1)?).ok().filter(|&c| c > 0)?;
        let per_channel = channels as usize;
        let sizes_agree = args.iter().zip(kernel.params()).all(|(a, p)| match p.size {
            Size::Full => a.elems == elems,
            Size::PerChannel => a.elems == per_channel,
            Size::Scalar => matches!(a.src, Src::Scalar(Scalar::F32(_))),
        });
        // The outputs, in argument order: for the statistics Σy then Σy² (the reduction that
        // reads Y itself comes first); for the dBN reduction dγ then dβ (the reduction that
        // reads dZ itself is dβ); for the coefficients A, B, C as the layer binds them; all
        // FP32 per channel. Otherwise the one bound tensor that is not an input, FP16 like the
        // inputs.
        let reductions: Vec<(TensorId, TensorId)> = g
            .nodes()
            .iter()
            .filter_map(|n| match n {
                Node::Reduction { x, y, .. } => Some((*x, *y)),
                _ => None,
            })
            .collect();
        let vector_out = |t: TensorId| (t, DataType::Float, per_channel);
        let outputs: Vec<(TensorId, DataType, usize)> = match kernel {
            OwnKernel::ChannelStats | OwnKernel::DbnReduce => {
                // The reduction of an input itself: Σy (statistics) or Σdz = dβ (dBN).
                let direct = if kernel == OwnKernel::ChannelStats {
                    inputs[0]
                } else {
                    inputs[1]
                };
                let own = reductions.iter().find(|(x, _)| *x == direct)?.1;
                let other = reductions.iter().find(|(x, _)| *x != direct)?.1;
                // Two FP32 accumulators per channel in a block's shared memory.
                if reductions.len() != 2 || per_channel * 8 > STATS_SHARED_LIMIT {
                    return None;
                }
                if kernel == OwnKernel::ChannelStats {
                    vec![vector_out(own), vector_out(other)]
                } else {
                    vec![vector_out(other), vector_out(own)]
                }
            }
            OwnKernel::DbnCoefficients => lg
                .bindings
                .iter()
                .filter(|(t, _)| !inputs.contains(t))
                .map(|(t, _)| vector_out(*t))
                .collect(),
            _ => {
                let mut rest = lg.bindings.iter().filter(|(t, _)| !inputs.contains(t));
                let (out, _) = *rest.next()?;
                vec![(out, DataType::Half, elems)]
            }
        };
        if !sizes_agree || lg.bindings.len() != inputs.len() + outputs.len() {
            return None;
        }
        for (t, dtype, n) in outputs {
            if g.dtype(t)? != dtype || elems_of(t)? != n {
                return None;
            }
            args.push(Arg {
                src: src_of(t)?,
                dtype,
                elems: n,
            });
        }
        Some(KernelStep {
            kernel,
            arch,
            args,
            elems: elems as u64,
            channels,
        })
    }

    /// The kernel.
    pub fn kernel(&self) -> OwnKernel {
        self.kernel
    }

    /// Where each argument comes from, in the kernel's order: its inputs (buffers and by-value
    /// scalars), then its outputs.
    pub fn sources(&self) -> Vec<Src> {
        self.args.iter().map(|a| a.src).collect()
    }

    /// How many of [`KernelStep::sources`] are outputs (the last ones).
    pub fn output_count(&self) -> usize {
        self.args.len() - self.kernel.params().len()
    }

    /// The architecture its machine code was compiled for (`sm_90`…).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Enqueues the kernel on the handle's stream over the resolved buffers, after checking
    /// each one (present, element type, size) and the argument list against the compiled
    /// kernel's parameters.
    pub(crate) fn launch(&self, handle: &Handle, r: &Resolved<'_>) -> Result<()> {
        let launch = self.launch_with(|side, name| r.get(side, name))?;
        let stream = handle.stream();
        let loaded = Loaded::for_context(stream.context(), self.arch)?;
        enqueue(&loaded, stream, &launch)
    }

    /// The launch of this step over the buffers `buffer` gives for each (side, name): the
    /// arguments in the kernel's order, each buffer checked first (element type, size). No
    /// device is needed: this is the list `KernelStep::launch` pushes to the driver.
    ///
    /// # Errors
    /// `buffer`'s error for a buffer it lacks; [`Error::Buffer`] for one of another element
    /// type or too short; [`Error::Kernel`] for a by-value scalar that is not FP32.
    pub fn launch_with(
        &self,
        buffer: impl Fn(Side, &'static str) -> Result<DeviceBuffer>,
    ) -> Result<Launch> {
        let mut values = Vec::with_capacity(self.args.len());
        for a in &self.args {
            let (side, name) = match a.src {
                Src::This(n) => (Side::This, n),
                Src::Prev(n) => (Side::Prev, n),
                Src::Scalar(Scalar::F32(v)) => {
                    values.push(KernelArg::F32(v));
                    continue;
                }
                Src::Scalar(other) => {
                    return Err(kernel_error(
                        self.kernel,
                        format!("takes FP32 scalars, got {other:?}"),
                    ))
                }
            };
            let buf = buffer(side, name)?;
            let shown = || match side {
                Side::This => name.to_string(),
                Side::Prev => format!("prev.{name}"),
            };
            if buf.dtype != a.dtype {
                return Err(Error::Buffer {
                    name: shown(),
                    problem: format!(
                        "is {}; kernel {} reads {}",
                        buf.dtype,
                        self.kernel.entry(),
                        a.dtype
                    ),
                });
            }
            let need = a.elems * a.dtype.size();
            if buf.bytes < need {
                return Err(Error::Buffer {
                    name: shown(),
                    problem: format!(
                        "has {} bytes; kernel {} needs {need}",
                        buf.bytes,
                        self.kernel.entry()
                    ),
                });
            }
            values.push(KernelArg::Ptr(buf.ptr));
        }
        Ok(Launch::new(self.kernel, values, self.elems, self.channels))
    }
}
