//! A small ResNet-style network built only from CBR layers, run by the CPU executor:
//!
//! ```text
//! stem 3×3 (C→w) ─► A0 ─► [b1a 3×3 ─► b1b 3×3, + A0] ─► A1 ─► trans 3×3 s2 (w→2w) ─► A2
//!      ─► [b2a 3×3 ─► b2b 3×3, + A2] ─► A3 ─► global average pool ─► FC ─► logits
//! ```
//!
//! Inside a block, the first conv's BN apply + ReLU is the second conv's prologue (never
//! stored); block outputs are materialized by the apply graph with the residual add.

use cudnn_cbr_fusion::cbr::graphs::ApplyResidual;
use cudnn_cbr_fusion::cbr::{CbrConfig, CbrLayer, ConvShape, HostBuffer, HostBuffers, Pass};
use cudnn_cbr_fusion::reference::{self, Nhwc};
use cudnn_cbr_fusion::{Error, Result};
use half::f16;

use crate::amp::range::{self, HeadShape};

fn head_error(name: &str, e: crate::amp::RangeOpError) -> Error {
    Error::Buffer {
        name: name.into(),
        problem: e.to_string(),
    }
}

/// One conv layer of the network with its host buffers.
#[derive(Debug)]
pub struct NetLayer {
    /// Parameter-name prefix, e.g. `b1a`.
    pub name: &'static str,
    /// The layer.
    pub layer: CbrLayer,
    /// Its buffers.
    pub bufs: HostBuffers,
}

/// The network.
#[derive(Debug)]
pub struct Net {
    /// Conv layers in order: stem, b1a, b1b, trans, b2a, b2b.
    pub layers: Vec<NetLayer>,
    /// Channels of the pooled features.
    pub features: usize,
    /// Spatial size of the last stage (pooled over).
    pub last_hw: usize,
    pooled: Vec<f32>,
}

pub(crate) const STEM: usize = 0;
pub(crate) const B1A: usize = 1;
pub(crate) const B1B: usize = 2;
pub(crate) const TRANS: usize = 3;
pub(crate) const B2A: usize = 4;
pub(crate) const B2B: usize = 5;

/// The six conv layers of the network, in order, with their parameter-name prefixes: the
/// one definition both executors plan or build.
pub fn layer_configs(
    batch: usize,
    hw: usize,
    channels: usize,
    width: usize,
) -> [(&'static str, CbrConfig); 6] {
    let (n, hw, c, w) = (batch as i64, hw as i64, channels as i64, width as i64);
    let half = hw / 2;
    [
        (
            "stem",
            CbrConfig::first(ConvShape::square(n, c, hw, w, 3, 1, 1))
                .with_apply(ApplyResidual::None),
        ),
        (
            "b1a",
            CbrConfig::after_activation(ConvShape::square(n, w, hw, w, 3, 1, 1)),
        ),
        (
            "b1b",
            CbrConfig::new(ConvShape::square(n, w, hw, w, 3, 1, 1)).with_apply(ApplyResidual::Add),
        ),
        (
            "trans",
            CbrConfig::after_activation(ConvShape::square(n, w, hw, 2 * w, 3, 1, 2))
                .with_apply(ApplyResidual::None),
        ),
        (
            "b2a",
            CbrConfig::after_activation(ConvShape::square(n, 2 * w, half, 2 * w, 3, 1, 1)),
        ),
        (
            "b2b",
            CbrConfig::new(ConvShape::square(n, 2 * w, half, 2 * w, 3, 1, 1))
                .with_apply(ApplyResidual::Add),
        ),
    ]
}

/// The layer whose buffers a layer's prologue reads (`prev` of [`CbrLayer::run_cpu`] and
/// `run_gpu`): b1b reads b1a, b2b reads b2a; the others read none.
pub const fn prev_of(layer: usize) -> Option<usize> {
    match layer {
        B1B => Some(B1A),
        B2B => Some(B2A),
        _ => None,
    }
}

impl Net {
    /// The network for `batch` images of `hw`×`hw`×`channels`, base width `width`.
    pub fn new(batch: usize, hw: usize, channels: usize, width: usize, fused: bool) -> Self {
        let configs = layer_configs(batch, hw, channels, width);
        let layers = configs
            .into_iter()
            .map(|(name, cfg)| {
                let layer = CbrLayer::for_cpu(cfg, fused);
                let bufs = HostBuffers::zeros(layer.buffers());
                NetLayer { name, layer, bufs }
            })
            .collect();
        Net {
            layers,
            features: 2 * width,
            last_hw: hw / 2,
            pooled: Vec::new(),
        }
    }

    fn copy_f16(
        &mut self,
        from: usize,
        name: &str,
        to: usize,
        as_name: &'static str,
    ) -> Result<()> {
        let v = self.layers[from].bufs.f16(name)?.to_vec();
        self.layers[to].bufs.set(as_name, HostBuffer::F16(v));
        Ok(())
    }

    fn run(&mut self, i: usize, pass: Pass, prev: Option<usize>) -> Result<()> {
        match prev {
            Some(p) => {
                let (lo, hi) = self.layers.split_at_mut(i);
                let this = &mut hi[0];
                this.layer
                    .run_cpu(pass, &mut this.bufs, Some(&mut lo[p].bufs))
            }
            None => {
                let this = &mut self.layers[i];
                this.layer.run_cpu(pass, &mut this.bufs, None)
            }
        }
    }

    /// Forward pass; returns the pooled features `[N, features]` (FP32).
    pub fn forward(&mut self, images: &[f16]) -> Result<Vec<f32>> {
        self.layers[STEM]
            .bufs
            .set("x", HostBuffer::F16(images.to_vec()));
        self.run(STEM, Pass::Forward, None)?;
        self.copy_f16(STEM, "a", B1A, "x")?;
        self.run(B1A, Pass::Forward, None)?;
        self.copy_f16(STEM, "a", B1B, "residual")?;
        self.run(B1B, Pass::Forward, Some(B1A))?;
        self.copy_f16(B1B, "a", TRANS, "x")?;
        self.run(TRANS, Pass::Forward, None)?;
        self.copy_f16(TRANS, "a", B2A, "x")?;
        self.run(B2A, Pass::Forward, None)?;
        self.copy_f16(TRANS, "a", B2B, "residual")?;
        self.run(B2B, Pass::Forward, Some(B2A))?;
        // Global average pool in FP32 (the CUDA executor runs the kernel of the same twin).
        let a = self.layers[B2B].bufs.f16("a")?;
        let shape = self.head_shape(a.len() / (self.features * self.pixels()));
        let mut pooled = vec![0f32; shape.pooled_elems()];
        range::gap_forward(&shape, a, &mut pooled).map_err(|e| head_error("pooled", e))?;
        self.pooled.clone_from(&pooled);
        Ok(pooled)
    }

    fn pixels(&self) -> usize {
        self.last_hw * self.last_hw
    }

    /// The pooling's shape for `batch` images (classes unused here: 1).
    fn head_shape(&self, batch: usize) -> HeadShape {
        HeadShape::new(batch, self.pixels(), self.features, 1)
    }

    /// The pooled features of the last forward pass.
    pub fn pooled(&self) -> &[f32] {
        &self.pooled
    }

    /// Backward pass from the gradient of the pooled features `[N, features]` (already scaled
    /// by the loss scale). Leaves dW, dγ, dβ in each layer's buffers.
    pub fn backward(&mut self, dpooled: &[f32]) -> Result<()> {
        let shape = self.head_shape(dpooled.len() / self.features);
        let mut da3 = vec![f16::ZERO; shape.activation_elems()];
        range::gap_backward(&shape, dpooled, &mut da3).map_err(|e| head_error("da", e))?;
        self.layers[B2B].bufs.set("da", HostBuffer::F16(da3));
        self.run(B2B, Pass::Backward, Some(B2A))?;
        self.run(B2A, Pass::Backward, None)?;
        // A2 feeds b2a's conv and b2b's shortcut: its gradient is the sum.
        self.sum_into(TRANS, "da", [(B2A, "dx"), (B2B, "dpre")])?;
        self.run(TRANS, Pass::Backward, None)?;
        self.copy_f16(TRANS, "dx", B1B, "da")?;
        self.run(B1B, Pass::Backward, Some(B1A))?;
        self.run(B1A, Pass::Backward, None)?;
        self.sum_into(STEM, "da", [(B1A, "dx"), (B1B, "dpre")])?;
        self.run(STEM, Pass::Backward, None)?;
        Ok(())
    }

    fn sum_into(&mut self, to: usize, name: &'static str, parts: [(usize, &str); 2]) -> Result<()> {
        let s = self.layers[to].layer.config().shape;
        let shape = Nhwc::new(s.n as usize, s.p() as usize, s.q() as usize, s.k as usize);
        let sum = reference::add(
            &shape,
            self.layers[parts[0].0].bufs.f16(parts[0].1)?,
            self.layers[parts[1].0].bufs.f16(parts[1].1)?,
        )?;
        self.layers[to].bufs.set(name, HostBuffer::F16(sum));
        Ok(())
    }
}
