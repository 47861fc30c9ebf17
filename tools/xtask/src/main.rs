//! Project chores. `cargo xtask gen-bindings` regenerates `crates/2-cudnn-fe-sys/src/bindings.rs` from the
//! pinned cuDNN headers; `cargo xtask gen-bindings --check` fails when the checked-in file differs
//! from what the headers produce (and skips, saying why, where libclang is missing).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod bindings;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("gen-bindings") => bindings::run(&args[1..]),
        _ => Err(format!(
            "usage: cargo xtask gen-bindings [--check] [--include DIR]\n\
             got: {args:?}"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("xtask: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (xtask lives two levels below it, in tools/xtask).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
