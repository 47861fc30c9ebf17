//! The simulated device's build folder for the sim_* tests: `CUDNN_CBR_SIM_DIR` when it names
//! a built simulator, else built once here (sim/build.sh) into the test target's folder.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A folder holding the built simulator (sim/build.sh's output).
pub fn built() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::var_os("CUDNN_CBR_SIM_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sim"));
        // build.sh rebuilds only what is stale, so this is quick when the folder is current.
        let status = Command::new("bash")
            .arg(repo().join("sim/build.sh"))
            .arg(&dir)
            .status()
            .expect("run sim/build.sh");
        assert!(status.success(), "sim/build.sh {} failed", dir.display());
        dir
    })
    .clone()
}
