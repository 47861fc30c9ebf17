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
use cudnn_cbr_fusion::Result;
use half::f16;

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

const STEM: usize = 0;
const B1A: usize = 1;
const B1B: usize = 2;
const TRANS: usize = 3;
const B2A: usize = 4;
const B2B: usize = 5;

impl Net {
    /// The network for `batch` images of `hw`×`hw`×`channels`, base width `width`.
    pub fn new(batch: usize, hw: usize, channels: usize, width: usize, fused: bool) -> Self {
        let (n, hw, c, w) = (batch as i64, hw as i64, channels as i64, width as i64);
        let half = hw / 2;
        let configs: [(&'static str, CbrConfig); 6] = [
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
                CbrConfig::new(ConvShape::square(n, w, hw, w, 3, 1, 1))
                    .with_apply(ApplyResidual::Add),
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
        ];
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
            last_hw: half as usize,
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
        // Global average pool in FP32.
        let a = self.layers[B2B].bufs.f16("a")?;
        let (f, pix) = (self.features, self.last_hw * self.last_hw);
        let n = a.len() / (f * pix);
        let mut pooled = vec![0f32; n * f];
        for (img, out) in a.chunks_exact(f * pix).zip(pooled.chunks_exact_mut(f)) {
            for px in img.chunks_exact(f) {
                for (o, v) in out.iter_mut().zip(px) {
                    *o += v.to_f32();
                }
            }
            out.iter_mut().for_each(|o| *o /= pix as f32);
        }
        self.pooled.clone_from(&pooled);
        Ok(pooled)
    }

    /// The pooled features of the last forward pass.
    pub fn pooled(&self) -> &[f32] {
        &self.pooled
    }

    /// Backward pass from the gradient of the pooled features `[N, features]` (already scaled
    /// by the loss scale). Leaves dW, dγ, dβ in each layer's buffers.
    pub fn backward(&mut self, dpooled: &[f32]) -> Result<()> {
        let (f, pix) = (self.features, self.last_hw * self.last_hw);
        let da3: Vec<f16> = dpooled
            .chunks_exact(f)
            .flat_map(|g| {
                (0..pix).flat_map(move |_| g.iter().map(move |v| f16::from_f32(v / pix as f32)))
            })
            .collect();
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
