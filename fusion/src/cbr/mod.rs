//! The Conv+BN+ReLU building blocks: layer geometry and the graphs of a training step.

pub mod graphs;
mod shape;

pub use shape::ConvShape;
