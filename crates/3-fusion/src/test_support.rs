//! What this crate's unit tests share: the H200 fixture and the cuDNN check.

use crate::target::{DeviceProps, Target};

/// The H200 device-properties fixture.
pub(crate) const H200: &str = include_str!("../../../tests/fixtures/devprops/h200-sm90.json");

/// Whether cuDNN loads. When it does not: a panic under CI (where a check that cannot run is a
/// failure), else one SKIP line naming `test`.
pub(crate) fn cudnn_or_skip(test: &str) -> bool {
    match cudnn_fe_sys::library() {
        Ok(_) => true,
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{test}: cuDNN is required when CI is set: {e}")
        }
        Err(e) => {
            let e = e.to_string();
            println!(
                "SKIP {test}: cuDNN not loadable ({})",
                e.lines().next().unwrap_or("")
            );
            false
        }
    }
}

/// A deviceless target for the H200 fixture.
pub(crate) fn h200() -> Target {
    Target::deviceless(DeviceProps::from_json(H200).expect("the fixture parses"))
        .expect("a deviceless target")
}
