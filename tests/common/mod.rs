//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The device-properties fixtures shipped in tests/fixtures/devprops, as (label, path).
pub fn devprops_fixtures() -> Vec<(&'static str, PathBuf)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/devprops");
    vec![
        ("H200 sm_90", dir.join("h200-sm90.json")),
        ("A100 sm_80", dir.join("a100-sm80.json")),
        ("B200 sm_100", dir.join("b200-sm100.json")),
    ]
}

/// cuDNN for a tier-2 (deviceless) test. Without it: under CI the test fails (CI must really
/// run tier 2); elsewhere it prints one SKIP line naming what is missing and returns None.
pub fn cudnn_or_skip(test: &str) -> Option<&'static cudnn_cbr::sys::Library> {
    match cudnn_cbr::sys::library() {
        Ok(lib) => Some(lib),
        Err(e) => {
            if std::env::var_os("CI").is_some() {
                panic!("{test}: cuDNN is required when CI is set, but it could not be loaded: {e}");
            }
            println!("SKIP {test}: cuDNN not loadable ({}); run scripts/setup-test-deps.sh and source .deps/env.sh",
                e.to_string().lines().next().unwrap_or_default());
            None
        }
    }
}
