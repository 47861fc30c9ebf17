//! Tests of the CPU reference executor (tier 1): every op against a naive `f64` definition,
//! finite-difference gradient checks of whole chains, the fused and unfused routes against each
//! other, FP16 against f64, and the typed errors.

mod chains;
mod direct_tiles;
mod errors;
mod fast_paths;
mod gradcheck;
mod naive;
mod ops_bn;
mod ops_conv;
mod util;
