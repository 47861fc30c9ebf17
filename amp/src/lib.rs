//! amp
