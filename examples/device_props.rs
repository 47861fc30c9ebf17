//! Serializes the live GPU's device properties (as cuDNN reports them) to JSON and compares
//! them with a fixture, key by key.
//!
//! `cargo run --example device_props -- [out.json] [fixture.json]`
//!
//! The raw document is written first, before any check, so that a document with unexpected
//! keys is still there to read; keys the deviceless planner needs but the device's document
//! lacks make the run fail after the comparison.

#[macro_use]
mod out;

use clap::Parser;
use cudnn_cbr::fusion::exec::Handle;
use cudnn_cbr::fusion::{DeviceProps, Error, REQUIRED_KEYS};
use cudnn_cbr::runtime::cuda_device;
use serde_json::Value;
use std::collections::BTreeSet;
use std::process::ExitCode;

/// Write the live GPU's device properties to JSON and compare them with a fixture.
#[derive(Debug, Parser)]
#[command(name = "device_props")]
struct Args {
    /// Where to write the document.
    #[arg(default_value = "device-props.json")]
    out: String,
    /// The fixture to compare with [default: tests/fixtures/devprops/h200-sm90.json].
    fixture: Option<String>,
}

fn main() -> ExitCode {
    // Usage errors exit 2 and `--help` exits 0 (clap's conventions).
    let args = Args::parse();
    let out = args.out;
    let fixture = args.fixture.unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/devprops/h200-sm90.json"
        )
        .into()
    });
    let run = || -> cudnn_cbr::fusion::Result<bool> {
        let ctx = cuda_device(0)?;
        let handle = Handle::new(ctx.default_stream())?;
        let json = handle.device_props_json()?;
        std::fs::write(&out, &json).map_err(|e| Error::CacheFile {
            path: out.clone(),
            reason: e.to_string(),
        })?;
        let props = DeviceProps::from_live_json(&json)?;
        out!(
            "{} (sm_{}{}, {} SMs) properties written to {out}",
            props.name(),
            props.compute_capability().0,
            props.compute_capability().1,
            props.sm_count()
        );
        let live: Value = serde_json::from_str(&json).unwrap_or_default();
        let want: Value = std::fs::read_to_string(&fixture)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let keys: BTreeSet<&str> = [&live, &want]
            .iter()
            .filter_map(|v| v.as_object())
            .flat_map(|o| o.keys().map(String::as_str))
            .chain(REQUIRED_KEYS)
            .collect();
        let mut differ = 0;
        for key in &keys {
            if live.get(key) != want.get(key) {
                differ += 1;
                out!(
                    "  {key}: device {} vs fixture {}",
                    live.get(key).unwrap_or(&Value::Null),
                    want.get(key).unwrap_or(&Value::Null)
                );
            }
        }
        out!("{differ} of {} keys differ from {fixture}", keys.len());
        let missing = props.missing_keys();
        if !missing.is_empty() {
            note!(
                "device_props: the device's document lacks keys deviceless planning needs: {}",
                missing.join(", ")
            );
        }
        Ok(missing.is_empty())
    };
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            note!("device_props: {e}");
            ExitCode::FAILURE
        }
    }
}
