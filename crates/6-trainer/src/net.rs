//! The main job's network: the preset of [`TrainConfig::net`] compiled by [`cudnn_cbr::net`],
//! and the CPU executor's routes.
//!
//! The network itself (which conv takes whose BN as its prologue, what is stored, where
//! gradients join) comes from the network compiler; nothing here wires layers by hand.

use super::{TrainConfig, TrainError};
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::{compile, CompiledNet, RoutePolicy};

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
