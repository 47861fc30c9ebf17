//! The CPU executor of a compiled network: every buffer in host memory, every step on the
//! reference ops, in FP16 storage (`T = f16`, the GPU's rounding points) or exact `f64`.

use super::compile::{BufId, CompiledNet, NetBuffer};
use super::exec::{run_pass, run_pass_observed, AfterStep, NetExecutor};
pub use super::host_store::Arena;
use super::host_store::{HostStore, StoreRead};
use super::spec::PoolSpec;
use crate::runtime::DataType;
use cudnn_cbr_fusion::cbr::{
    write_half_via_vec, BnSync, CpuElement, LayerIo, LayerRead, Pass, Src, WriteHalf,
};
use cudnn_cbr_fusion::reference::{ConvScratch, Element, Nhwc, Real};
use cudnn_cbr_fusion::{Error, Result};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// One host buffer: `Half` buffers in the storage type, `Float` ones in the arithmetic type.
#[derive(Debug, Clone, PartialEq)]
pub enum Buf<T: Element> {
    /// FP16 on the GPU.
    Half(Vec<T>),
    /// FP32 on the GPU.
    Float(Vec<T::Acc>),
}

/// A compiled network with its buffers in host memory ([`Arena`]: one vector each, or a
/// shared arena laid out by lifetime).
#[derive(Debug)]
pub struct CpuNet<T: CpuElement> {
    net: CompiledNet,
    /// The buffers, with a write stamp each ([`LayerIo::stamp`]).
    store: HostStore<T>,
    /// Each layer's conv scratch, kept from step to step ([`ConvScratch`]).
    scratch: Vec<ConvScratch<T>>,
    sync: Option<SyncSlot<T::Acc>>,
}

/// The synchronized-BN reducer of a replica ([`CpuNet::set_bn_sync`]).
struct SyncSlot<A>(Box<dyn BnSync<A> + Send>);

impl<A> std::fmt::Debug for SyncSlot<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BnSync({} replicas)", self.0.replicas())
    }
}

fn no_buffer(name: &str) -> Error {
    Error::Buffer {
        name: name.into(),
        problem: "is not a buffer of this network".into(),
    }
}

fn wrong_len(name: &str, got: usize, want: usize) -> Error {
    Error::Buffer {
        name: name.into(),
        problem: format!("takes {want} elements, got {got}"),
    }
}

impl<T: CpuElement> CpuNet<T> {
    /// Zeroed buffers for `net`, one vector each ([`Arena::Separate`]), with running
    /// variances at 1 (as every framework starts). The process aborts where the host cannot
    /// hold them; [`CpuNet::try_new`] returns an error instead.
    pub fn new(net: CompiledNet) -> Self {
        match Self::with_arena(net, Arena::Separate) {
            Ok(n) => n,
            Err(e) => panic!("cannot allocate the network's host buffers: {e}"),
        }
    }

    /// As [`CpuNet::new`], but a buffer the host cannot allocate is an error, not an abort.
    ///
    /// # Errors
    /// [`Error::Buffer`] naming the first buffer that could not be allocated and its size.
    pub fn try_new(net: CompiledNet) -> Result<Self> {
        Self::with_arena(net, Arena::Separate)
    }

    /// Zeroed buffers for `net` laid out as `arena` says: [`Arena::Shared`] keeps the
    /// activations, their gradients and the per-step scratch in an arena where buffers never
    /// alive together share memory (the layout of the GPU's tensor arena, with the same
    /// lifetimes), and gives the same results bit for bit.
    ///
    /// # Errors
    /// [`Error::Buffer`] naming a buffer or arena the host cannot allocate.
    pub fn with_arena(net: CompiledNet, arena: Arena) -> Result<Self> {
        let store = HostStore::new(&net, arena)?;
        let scratch = net.layers.iter().map(|_| ConvScratch::default()).collect();
        Ok(CpuNet {
            net,
            store,
            scratch,
            sync: None,
        })
    }

    /// Elements of the shared arena (FP16-storage pool, FP32 pool); zeros with the separate
    /// layout.
    pub fn arena_elems(&self) -> (usize, usize) {
        self.store.arena_elems()
    }

    /// Synchronized BN from now on: every layer's batch statistics (forward) and `dγ`, `dβ`
    /// (backward) summed over `sync`'s replicas ([`cudnn_cbr_fusion::cbr::BnSync`]). Every
    /// replica must then run the same passes in the same order.
    pub fn set_bn_sync(&mut self, sync: Box<dyn BnSync<T::Acc> + Send>) {
        self.sync = Some(SyncSlot(sync));
    }

    /// The compiled network.
    pub fn net(&self) -> &CompiledNet {
        &self.net
    }

    fn id(&self, name: &str) -> Result<BufId> {
        self.net.buffer_id(name).ok_or_else(|| no_buffer(name))
    }

    /// A `Half` buffer by name (`s0.b0.conv1.w`, `stem.out`, …).
    pub fn half(&self, name: &str) -> Result<&[T]> {
        self.half_id(self.id(name)?)
    }

    /// A `Float` buffer by name (`stem.gamma`, `stem.dgamma`, …).
    pub fn float(&self, name: &str) -> Result<&[T::Acc]> {
        self.store.float(self.id(name)?, &self.net.buffers)
    }

    /// Sets a `Half` buffer (its length must match).
    pub fn set_half(&mut self, name: &str, v: Vec<T>) -> Result<()> {
        let id = self.id(name)?;
        self.put(id, Buf::Half(v))
    }

    /// Sets a `Float` buffer (its length must match).
    pub fn set_float(&mut self, name: &str, v: Vec<T::Acc>) -> Result<()> {
        let id = self.id(name)?;
        self.put(id, Buf::Float(v))
    }

    /// A buffer widened to `f64`, whatever its kind.
    pub fn values(&self, name: &str) -> Result<Vec<f64>> {
        let id = self.id(name)?;
        Ok(match self.net.buffers[id].dtype {
            DataType::Half => self.half_id(id)?.iter().map(|x| x.to_f64()).collect(),
            _ => self
                .store
                .float(id, &self.net.buffers)?
                .iter()
                .map(|x| x.to_f64())
                .collect(),
        })
    }

    /// The last block's output after [`CpuNet::forward`].
    pub fn output(&self) -> &[T] {
        // The output keeps a vector of its own in every layout ([`Arena`]).
        self.half_id(self.net.output).unwrap_or(&[])
    }

    /// The forward pass on `images` (NHWC). The output is in [`CpuNet::output`].
    pub fn forward(&mut self, images: &[T]) -> Result<()> {
        self.set_input(images)?;
        run_pass(self, Pass::Forward)
    }

    /// The forward pass on `images` (NHWC) in evaluation mode: each BN normalizes with its
    /// layer's running statistics (`eq_scale = γ/sqrt(running_var + ε)`, `eq_bias = β −
    /// running_mean·eq_scale`: [`cudnn_cbr_fusion::reference::bn_eval_finalize`]), applied
    /// where training applies the batch statistics' coefficients. No statistics are written:
    /// the running statistics and the saved batch statistics keep their values. The output is
    /// in [`CpuNet::output`].
    ///
    /// # Errors
    /// Images of the wrong length; a running variance below `−ε` or not finite.
    pub fn evaluate(&mut self, images: &[T]) -> Result<()> {
        self.set_input(images)?;
        run_pass(self, Pass::Eval)
    }

    /// The backward pass from the gradient of the output (the head's backward). Leaves every
    /// layer's `dw`, `dgamma`, `dbeta` in its buffers.
    pub fn backward(&mut self, d_output: Vec<T>) -> Result<()> {
        self.backward_observed(d_output, &mut |_, _| Ok(()))
    }

    /// [`CpuNet::backward`], calling `after(net, i)` once backward step `i` has run (where a
    /// data-parallel step sums the gradient buckets that are final: [`super::GradSchedule`]).
    pub fn backward_observed(
        &mut self,
        d_output: Vec<T>,
        after: &mut AfterStep<'_, Self>,
    ) -> Result<()> {
        self.set_output_grad(d_output)?;
        run_pass_observed(self, Pass::Backward, after)
    }

    /// Copies `images` (NHWC) into the network's input: what a forward or evaluation pass
    /// ([`run_pass`]) reads.
    pub(crate) fn set_input(&mut self, images: &[T]) -> Result<()> {
        self.put(self.net.input, Buf::Half(images.to_vec()))
    }

    /// Sets the gradient of the output: what a backward pass ([`run_pass`]) starts from.
    pub(crate) fn set_output_grad(&mut self, d_output: Vec<T>) -> Result<()> {
        self.put(self.net.output_grad, Buf::Half(d_output))
    }

    fn half_id(&self, id: BufId) -> Result<&[T]> {
        self.store.half(id, &self.net.buffers)
    }

    fn put(&mut self, id: BufId, v: Buf<T>) -> Result<()> {
        self.store.put(id, v, &self.net.buffers)
    }
}

impl<T: CpuElement> NetExecutor for CpuNet<T> {
    type Error = Error;

    fn compiled(&self) -> &CompiledNet {
        &self.net
    }

    fn layer_pass(&mut self, layer: usize, pass: Pass) -> Result<()> {
        let l = &self.net.layers[layer];
        let mut io = NetIo {
            store: &mut self.store,
            buffers: &self.net.buffers,
            names: LayerNames {
                this: &l.table,
                prev: l.prev.map(|p| &self.net.layers[p].table),
                layer: &l.name,
            },
            scratch: &mut self.scratch[layer],
        };
        let sync = self
            .sync
            .as_mut()
            .map(|s| &mut *s.0 as &mut dyn BnSync<T::Acc>);
        l.layer
            .run_cpu_io_synced(pass, &mut io, sync)
            .map_err(|e| at_layer(&l.name, e))
    }

    fn add(&mut self, a: BufId, b: BufId, out: BufId) -> Result<()> {
        let (x, y) = (self.half_id(a)?, self.half_id(b)?);
        if x.len() != y.len() {
            return Err(wrong_len(&self.net.buffers[b].name, y.len(), x.len()));
        }
        // The reference op (blocked, vectorized, parallel): `a + b` in the arithmetic type,
        // stored once, element by element (one "channel" per element is all it needs here).
        let shape = Nhwc::new(x.len(), 1, 1, 1);
        if !x.is_empty() && out != a && out != b && self.store.in_half_arena(out) {
            // Into the arena in place.
            let buffers = &self.net.buffers;
            return self
                .store
                .write_half(out, shape.elems(), buffers, |dst, store| {
                    let (x, y) = (store.half(a, buffers)?, store.half(b, buffers)?);
                    Ok(cudnn_cbr_fusion::reference::add_into_slice(
                        &shape, x, y, dst,
                    )?)
                });
        }
        let sum = if x.is_empty() {
            Vec::new()
        } else {
            // The output's storage reused (every element is overwritten), unless the output
            // is also an operand.
            let storage = if out != a && out != b {
                self.store.take_half(out, &self.net.buffers)?
            } else {
                Vec::new()
            };
            let (x, y) = (self.half_id(a)?, self.half_id(b)?);
            cudnn_cbr_fusion::reference::add_into(&shape, x, y, storage)?
        };
        self.put(out, Buf::Half(sum))
    }

    fn max_pool(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        output: BufId,
    ) -> Result<()> {
        let out = max_pool(pool, shape, self.half_id(input)?)?;
        self.put(output, Buf::Half(out))
    }

    fn max_pool_backward(
        &mut self,
        pool: &PoolSpec,
        shape: &Nhwc,
        input: BufId,
        grad_output: BufId,
        grad_input: BufId,
    ) -> Result<()> {
        let d = max_pool_backward(
            pool,
            shape,
            self.half_id(input)?,
            self.half_id(grad_output)?,
        )?;
        self.put(grad_input, Buf::Half(d))
    }
}

fn at_layer(layer: &str, e: Error) -> Error {
    match e {
        Error::Buffer { name, problem } => Error::Buffer {
            name: format!("{layer}: {name}"),
            problem,
        },
        other => other,
    }
}

/// One layer's view of the network's buffers: its own names and its prologue layer's.
struct NetIo<'a, T: Element> {
    store: &'a mut HostStore<T>,
    buffers: &'a [NetBuffer],
    names: LayerNames<'a>,
    scratch: &'a mut ConvScratch<T>,
}

/// A layer's buffer names: its own and its prologue layer's.
#[derive(Clone, Copy)]
struct LayerNames<'a> {
    this: &'a BTreeMap<&'static str, BufId>,
    prev: Option<&'a BTreeMap<&'static str, BufId>>,
    layer: &'a str,
}

impl LayerNames<'_> {
    fn resolve(&self, src: Src) -> Result<BufId> {
        let (table, name, side) = match src {
            Src::This(n) => (Some(self.this), n, ""),
            Src::Prev(n) => (self.prev, n, "prev."),
            Src::Scalar(_) => {
                return Err(Error::Buffer {
                    name: format!("{}: <scalar>", self.layer),
                    problem: "is a by-value scalar, not a buffer".into(),
                })
            }
        };
        table
            .and_then(|t| t.get(name).copied())
            .ok_or_else(|| Error::Buffer {
                name: format!("{side}{name}"),
                problem: format!("is not bound for layer {}", self.layer),
            })
    }
}

impl<T: Element> LayerRead<T> for NetIo<'_, T> {
    fn half(&self, src: Src) -> Result<&[T]> {
        self.store.half(self.names.resolve(src)?, self.buffers)
    }
    fn float(&self, src: Src) -> Result<&[T::Acc]> {
        self.store.float(self.names.resolve(src)?, self.buffers)
    }
    fn stamp(&self, src: Src) -> Option<u64> {
        self.names.resolve(src).ok().map(|id| self.store.stamp(id))
    }
}

/// A layer's reads while one of its outputs is written in place ([`HostStore::write_half`]).
struct ArenaReads<'a, 's, T: Element> {
    store: &'a StoreRead<'s, T>,
    buffers: &'a [NetBuffer],
    names: LayerNames<'a>,
}

impl<T: Element> LayerRead<T> for ArenaReads<'_, '_, T> {
    fn half(&self, src: Src) -> Result<&[T]> {
        self.store.half(self.names.resolve(src)?, self.buffers)
    }
    fn float(&self, src: Src) -> Result<&[T::Acc]> {
        self.store.float(self.names.resolve(src)?, self.buffers)
    }
    fn stamp(&self, src: Src) -> Option<u64> {
        self.names.resolve(src).ok().map(|id| self.store.stamp(id))
    }
}

impl<T: Element> LayerIo<T> for NetIo<'_, T> {
    fn write_half(&mut self, out: Src, len: usize, f: &mut WriteHalf<'_, T>) -> Result<()> {
        let id = self.names.resolve(out)?;
        if !self.store.in_half_arena(id) {
            return write_half_via_vec(self, out, len, f);
        }
        let (buffers, names) = (self.buffers, self.names);
        self.store.write_half(id, len, buffers, |range, store| {
            f(
                range,
                &ArenaReads {
                    store,
                    buffers,
                    names,
                },
            )
        })
    }
    fn set_half(&mut self, src: Src, v: Vec<T>) -> Result<()> {
        let id = self.names.resolve(src)?;
        self.store.put(id, Buf::Half(v), self.buffers)
    }
    fn set_float(&mut self, src: Src, v: Vec<T::Acc>) -> Result<()> {
        let id = self.names.resolve(src)?;
        self.store.put(id, Buf::Float(v), self.buffers)
    }
    fn take_half(&mut self, src: Src) -> Result<Vec<T>> {
        let id = self.names.resolve(src)?;
        self.store.take_half(id, self.buffers)
    }
    fn take_scratch(&mut self) -> ConvScratch<T> {
        std::mem::take(self.scratch)
    }
    fn put_scratch(&mut self, scratch: ConvScratch<T>) {
        *self.scratch = scratch;
    }
}

/// Output size of the pool over `input` pixels.
fn pooled(input: usize, p: &PoolSpec) -> usize {
    (input + 2 * p.pad - p.kernel) / p.stride + 1
}

/// For each output element, the flat input index of its window's first maximum (window order:
/// rows, then columns; padding never wins).
fn argmax<T: Element>(p: &PoolSpec, s: &Nhwc, x: &[T]) -> Result<Vec<usize>> {
    s.validate("maxpool input")?;
    if x.len() != s.elems() {
        return Err(wrong_len("maxpool input", x.len(), s.elems()));
    }
    // A stride of 0 would divide by zero, a window larger than the padded input would wrap
    // the output size, and padding past half the window would pool padding alone.
    super::compile::validate_pool("maxpool", p)?;
    let padded = |x: usize| x.checked_add(2 * p.pad).filter(|&x| x >= p.kernel);
    if padded(s.h).is_none() || padded(s.w).is_none() {
        return Err(Error::InvalidConfig {
            layer: "maxpool".into(),
            field: "kernel".into(),
            problem: format!(
                "a {0}x{0} window is larger than its {1}x{2} input padded by {3}",
                p.kernel, s.h, s.w, p.pad
            ),
        });
    }
    let (oh, ow) = (pooled(s.h, p), pooled(s.w, p));
    let (c, image) = (s.c, s.h * s.w * s.c);
    // Window positions are kept as 32-bit offsets within an image.
    if u32::try_from(image).is_err() {
        return Err(Error::InvalidConfig {
            layer: "maxpool".into(),
            field: "input".into(),
            problem: format!("an image of {image} elements is over 2^32"),
        });
    }
    // Image by image in parallel (each widened once), every window's positions in window
    // order with all channels at once: per channel the same comparisons in the same order.
    let per_image: Vec<Vec<usize>> = x
        .par_chunks(image.max(1))
        .enumerate()
        .map(|(n, xn)| {
            let mut wide = vec![T::Acc::ZERO; xn.len()];
            T::widen_into(xn, &mut wide);
            let mut out = Vec::with_capacity(oh * ow * c);
            let (mut best_v, mut best_at) = (vec![T::Acc::ZERO; c], vec![0u32; c]);
            for i in 0..oh {
                for j in 0..ow {
                    let mut seen = false;
                    for di in 0..p.kernel {
                        let Some(h) = (i * p.stride + di).checked_sub(p.pad).filter(|&h| h < s.h)
                        else {
                            continue;
                        };
                        for dj in 0..p.kernel {
                            let Some(w) =
                                (j * p.stride + dj).checked_sub(p.pad).filter(|&w| w < s.w)
                            else {
                                continue;
                            };
                            let base = (h * s.w + w) * c;
                            let v = &wide[base..base + c];
                            if !seen {
                                // The window's first real pixel: every channel's first best.
                                best_v.copy_from_slice(v);
                                for (k, at) in best_at.iter_mut().enumerate() {
                                    *at = (base + k) as u32;
                                }
                                seen = true;
                                continue;
                            }
                            // Selects rather than branches, and positions as 32-bit
                            // offsets in the image (as wide as an FP32 lane), so the channels
                            // go in vector lanes: the same comparisons, the same winners.
                            let (bv, at) = (&mut best_v[..c], &mut best_at[..c]);
                            let from = base as u32;
                            for k in 0..c {
                                let better = v[k] > bv[k];
                                let mask = u32::from(better).wrapping_neg();
                                bv[k] = if better { v[k] } else { bv[k] };
                                at[k] = (at[k] & !mask) | (from.wrapping_add(k as u32) & mask);
                            }
                        }
                    }
                    // pad < kernel (validated) puts at least one real pixel in every window.
                    match seen {
                        true => out.extend(best_at.iter().map(|&at| n * image + at as usize)),
                        false => out.extend(std::iter::repeat_n(0, c)),
                    }
                }
            }
            out
        })
        .collect();
    Ok(per_image.concat())
}

/// Max-pool forward over NHWC `x`.
pub fn max_pool<T: Element>(p: &PoolSpec, s: &Nhwc, x: &[T]) -> Result<Vec<T>> {
    Ok(argmax(p, s, x)?.into_iter().map(|at| x[at]).collect())
}

/// Max-pool backward: each output gradient goes to its window's first maximum; overlapping
/// windows add up (in the arithmetic type, rounded once).
pub fn max_pool_backward<T: Element>(p: &PoolSpec, s: &Nhwc, x: &[T], dy: &[T]) -> Result<Vec<T>> {
    let idx = argmax(p, s, x)?;
    if dy.len() != idx.len() {
        return Err(wrong_len("maxpool gradient", dy.len(), idx.len()));
    }
    let mut acc = vec![T::Acc::ZERO; x.len()];
    // Image by image in parallel: a window's maximum lies in its own image, and within an
    // image the gradients are added in output order, as one loop over all of them would.
    let image = x.len() / s.n.max(1);
    let out_image = idx.len() / s.n.max(1);
    if image > 0 && out_image > 0 {
        acc.par_chunks_mut(image)
            .zip(idx.par_chunks(out_image).zip(dy.par_chunks(out_image)))
            .enumerate()
            .for_each(|(n, (acc, (idx, dy)))| {
                for (&at, g) in idx.iter().zip(dy) {
                    acc[at - n * image] += g.to_acc();
                }
            });
    }
    Ok(T::store_slice(&acc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netops::pool::PoolShape;
    use half::f16;

    #[test]
    fn a_window_that_cannot_pool_is_a_typed_error() {
        let s = Nhwc::new(1, 4, 4, 1);
        let x = vec![f16::ONE; s.elems()];
        for (kernel, stride, pad, field) in [
            (3, 0, 1, "stem.max_pool"),
            (0, 1, 0, "stem.max_pool"),
            (3, 1, 2, "stem.max_pool"),
            (9, 1, 2, "kernel"),
        ] {
            let p = PoolSpec {
                kernel,
                stride,
                pad,
            };
            for e in [
                max_pool(&p, &s, &x).unwrap_err(),
                max_pool_backward(&p, &s, &x, &x).unwrap_err(),
            ] {
                assert!(
                    matches!(&e, Error::InvalidConfig { field: f, .. } if f == field),
                    "{p:?}: {e:?}"
                );
            }
        }
        // A window larger than the unpadded input but inside the padded one pools (PyTorch
        // allows it: every window still holds a real pixel).
        let p = PoolSpec {
            kernel: 5,
            stride: 2,
            pad: 2,
        };
        let s2 = Nhwc::new(1, 3, 3, 1);
        assert_eq!(max_pool(&p, &s2, &x[..9]).unwrap().len(), 4);
    }

    /// The CPU executor's max-pool (generic over the precision) and the CUDA kernel's CPU
    /// twin agree bit for bit in FP16: same choice rule, same summation order.
    #[test]
    fn the_fp16_max_pool_is_the_kernels_twin() {
        let mut state = 5u64;
        // Channel counts under, at and past the vector lanes the argmax's channel loop runs in.
        let shapes = [
            (2, 9, 3, 3, 2, 1),
            (3, 8, 4, 3, 2, 1),
            (2, 6, 2, 2, 2, 0),
            (2, 7, 40, 3, 2, 1),
            (1, 8, 64, 3, 2, 1),
        ];
        for (n, hw, c, k, s, p) in shapes {
            let shape = Nhwc::new(n, hw, hw, c);
            let pool = PoolSpec {
                kernel: k,
                stride: s,
                pad: p,
            };
            // Half zeros (ties), half small integers (more ties).
            let x: Vec<f16> = (0..shape.elems())
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let v = ((state >> 33) % 7) as f32 - 3.0;
                    f16::from_f32(v.max(0.0))
                })
                .collect();
            let twin = PoolShape {
                batch: n,
                h: hw,
                w: hw,
                channels: c,
                kernel: k,
                stride: s,
                pad: p,
            };
            let y = max_pool(&pool, &shape, &x).unwrap();
            let mut y2 = vec![f16::ZERO; twin.output_elems()];
            crate::netops::pool::max_pool_forward(&twin, &x, &mut y2).unwrap();
            assert_eq!(y, y2);
            let dy: Vec<f16> = (0..y.len())
                .map(|i| f16::from_f32(0.1 * i as f32 - 2.0))
                .collect();
            let dx = max_pool_backward(&pool, &shape, &x, &dy).unwrap();
            let mut dx2 = vec![f16::ZERO; x.len()];
            crate::netops::pool::max_pool_backward(&twin, &x, &dy, &mut dx2).unwrap();
            assert_eq!(
                dx.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                dx2.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
