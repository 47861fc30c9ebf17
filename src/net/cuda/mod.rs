//! The CUDA executor of a compiled network: one device allocation per network buffer (or a
//! parameter's slot in the amp regions), each layer's table built per pass over borrowed
//! memory (no address is kept), layers on their cuDNN plans and the gradient joins on the
//! network's own `add_f16` kernel ([`crate::netops::cuda::NetKernels`]), all on the handle's
//! stream.
//!
//! # Recipe
//! 1. Compile with a planned [`RoutePolicy`](super::RoutePolicy) on the device's target.
//! 2. [`CudaNet::new`] with the handle (the network's own kernels are loaded into its stream's
//!    context) and, for training, the memory plan whose regions hold the parameters (`None`:
//!    the parameters get allocations of their own).
//!    A layer whose plans were built for another target (a deviceless fixture, another
//!    device or cuDNN) is planned again for the handle's device first ([`replan_for`]),
//!    saying so once on stderr.
//! 3. [`CudaNet::upload`] the input (and parameters when they are its own), then
//!    [`CudaNet::forward`] (or [`CudaNet::forward_with`] the amp regions, borrowed for the
//!    pass); write the output's gradient and [`CudaNet::backward`] (`backward_with`).
//!
//! The stem's max-pool runs on the network's pool kernels (`crates/4-netops/kernels/net_pool.cu`, the
//! same choice rule as the CPU executor).

mod binding;
mod net;
mod pass;
mod replan;

pub use binding::{
    binding_plan, check_binding, check_bn_sync, layer_bindings, param_slot, placement,
    running_stats, Placement, Source,
};
pub use net::CudaNet;
pub use pass::CudaNetPass;
pub use replan::{layers_to_replan, replan_for, Replanned};

use crate::amp::AmpError;

/// What the CUDA executor of a network can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CudaNetError {
    /// A layer's cuDNN plans failed.
    #[error(transparent)]
    Fusion(#[from] cudnn_cbr_fusion::Error),
    /// An amp kernel or region refused.
    #[error(transparent)]
    Amp(#[from] AmpError),
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed while trying to {what}: {message}")]
    Driver {
        /// What the executor was doing.
        what: String,
        /// The driver's error.
        message: String,
    },
    /// A buffer cannot be bound or reached as asked.
    #[error("{0}")]
    Binding(String),
    /// A layer planned for another target could not be planned again for the live device.
    #[error(transparent)]
    Replan(Box<ReplanFailure>),
}

/// Why [`replan_for`] could not plan a layer for the live device (boxed in
/// [`CudaNetError::Replan`]: it is the largest error here).
#[derive(Debug, thiserror::Error)]
#[error("network `{net}`, layer {layer}: planned for {planned_for}; planning its route again for the live device {live} failed: {source}")]
pub struct ReplanFailure {
    /// The network.
    pub net: String,
    /// The layer.
    pub layer: String,
    /// The target identities its plans were built for.
    pub planned_for: String,
    /// The live device's target identity.
    pub live: String,
    /// Why planning failed (compile the network for the live target instead).
    pub source: cudnn_cbr_fusion::Error,
}

fn driver(what: String, e: impl std::fmt::Display) -> CudaNetError {
    CudaNetError::Driver {
        what,
        message: e.to_string(),
    }
}

type Result<T> = std::result::Result<T, CudaNetError>;
