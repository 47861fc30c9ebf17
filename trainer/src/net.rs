//! The main job's network on the CPU executor: a compiled [`cudnn_cbr::net`] network (the preset
//! of [`TrainConfig::net`]) whose buffers live in host memory, with the pooling of the head.
//!
//! The network itself (which conv takes whose BN as its prologue, what is stored, where
//! gradients join) comes from the network compiler; nothing here wires layers by hand.

use super::{TrainConfig, TrainError};
use cudnn_cbr::amp::range::{self, HeadShape};
use cudnn_cbr::amp::AmpError;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::{compile, CompiledNet, CpuNet, RoutePolicy};
use half::f16;

/// The network `cfg` describes, compiled with `policy`.
///
/// # Errors
/// [`TrainError::Fusion`] naming the layer and field of an impossible configuration (and any
/// planning failure of a planned policy).
pub fn compile_net(cfg: &TrainConfig, policy: &RoutePolicy<'_>) -> Result<CompiledNet, TrainError> {
    let spec = cfg.net.spec(cfg.channels, cfg.classes, cfg.width);
    Ok(compile(&spec, cfg.batch, cfg.hw, policy)?)
}

/// The CPU routes of `cfg`: the fused route everywhere, or the unfused one.
pub fn cpu_policy(cfg: &TrainConfig) -> RoutePolicy<'static> {
    RoutePolicy::Uniform(if cfg.fused {
        RouteKind::Fused
    } else {
        RouteKind::Unfused
    })
}

/// The network with its host buffers (FP16 storage) and the pooled features of the last
/// forward pass.
#[derive(Debug)]
pub struct Net {
    cpu: CpuNet<f16>,
    shape: HeadShape,
    pooled: Vec<f32>,
}

impl Net {
    /// The network of `cfg` on the CPU routes of `cfg`.
    ///
    /// # Errors
    /// As [`compile_net`].
    pub fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        let net = compile_net(cfg, &cpu_policy(cfg))?;
        let shape = HeadShape::new(
            cfg.batch,
            net.out_hw * net.out_hw,
            net.features,
            cfg.classes,
        );
        Ok(Net {
            cpu: CpuNet::new(net),
            shape,
            pooled: Vec::new(),
        })
    }

    /// The compiled network.
    pub fn compiled(&self) -> &CompiledNet {
        self.cpu.net()
    }

    /// Its buffers, by name (`{layer}.w`, `{layer}.dgamma`, `stem.out`, …).
    pub fn buffers(&mut self) -> &mut CpuNet<f16> {
        &mut self.cpu
    }

    /// The head's shape (batch, pooled pixels, features, classes).
    pub fn head_shape(&self) -> HeadShape {
        self.shape
    }

    /// Forward pass; returns the pooled features `[N, features]` (FP32), pooled by the twin of
    /// the CUDA executor's kernel.
    pub fn forward(&mut self, images: &[f16]) -> Result<Vec<f32>, TrainError> {
        self.cpu.forward(images)?;
        let mut pooled = vec![0f32; self.shape.pooled_elems()];
        range::gap_forward(&self.shape, self.cpu.output(), &mut pooled).map_err(AmpError::from)?;
        self.pooled.clone_from(&pooled);
        Ok(pooled)
    }

    /// The pooled features of the last forward pass.
    pub fn pooled(&self) -> &[f32] {
        &self.pooled
    }

    /// Backward pass from the gradient of the pooled features `[N, features]` (already scaled
    /// by the loss scale). Leaves dW, dγ, dβ in each layer's buffers.
    pub fn backward(&mut self, dpooled: &[f32]) -> Result<(), TrainError> {
        let mut da = vec![f16::ZERO; self.shape.activation_elems()];
        range::gap_backward(&self.shape, dpooled, &mut da).map_err(AmpError::from)?;
        Ok(self.cpu.backward(da)?)
    }
}
