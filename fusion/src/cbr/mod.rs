//! The Conv+BN+ReLU building blocks: layer geometry and the graphs of a training step.

pub mod graphs;
mod layer;
mod shape;

pub use layer::{
    layer_buffers, route_graphs, BufferSpec, CbrConfig, CbrLayer, GraphRole, InputKind, Route,
};
pub use shape::ConvShape;
