//! The Conv+BN+ReLU building blocks: layer geometry and the graphs of a training step.

mod bn_sync;
mod buffers;
mod device_buffers;
pub mod graphs;
pub mod kernels;
pub mod keys;
mod layer;
// Test scaffolding (tests/deviceless_plans.rs, tests/common/gpu_shapes.rs), not part of the
// library's API: built only with the `testing` feature.
#[cfg(feature = "testing")]
pub mod resnet50;
mod role;
mod run;
mod shape;

pub use bn_sync::{sync_action, BnSide, BnSync, DeviceBnSync, SyncAction};
pub use buffers::{HostBuffer, HostBuffers, HostElement};
pub use device_buffers::{ArenaId, DeviceBuffer, DeviceBuffers, OwnedDeviceBuffers, Side};
pub use layer::{
    route_buffers, route_graphs, BufferSpec, CbrConfig, CbrLayer, GraphRole, InputKind, LayerGraph,
    LayerStep, Route, RouteKind, Src,
};
pub use run::{
    write_half_via_vec, CpuElement, LayerIo, LayerRead, PairIo, Pass, WriteHalf, RUNNING_COPIES,
};
pub use shape::ConvShape;
