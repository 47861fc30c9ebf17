//! CPU reference executor (placeholder; being written).
