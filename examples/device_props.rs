//! Serializes the live GPU's device properties (as cuDNN reports them) to JSON and compares
//! them with a fixture, key by key.
//!
//! `cargo run --example device_props -- [out.json] [fixture.json]`

use cudnn_cbr::fusion::exec::{cuda_device, Handle};
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let out = args.next().unwrap_or_else(|| "device-props.json".into());
    let fixture = args.next().unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/devprops/h200-sm90.json"
        )
        .into()
    });
    let run = || -> cudnn_cbr::fusion::Result<()> {
        let ctx = cuda_device(0)?;
        let handle = Handle::new(ctx.default_stream())?;
        let props = handle.device_props()?;
        std::fs::write(&out, props.json()).map_err(|e| cudnn_cbr::fusion::Error::CacheFile {
            path: out.clone(),
            reason: e.to_string(),
        })?;
        println!(
            "{} (sm_{}{}) properties written to {out}",
            props.name(),
            props.compute_capability().0,
            props.compute_capability().1
        );
        let live: serde_json::Value = serde_json::from_str(props.json()).unwrap_or_default();
        let want: serde_json::Value = std::fs::read_to_string(&fixture)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let mut differ = 0;
        for key in cudnn_cbr::fusion::REQUIRED_KEYS {
            if live.get(key) != want.get(key) {
                differ += 1;
                println!(
                    "  {key}: device {} vs fixture {}",
                    live.get(key).unwrap_or(&serde_json::Value::Null),
                    want.get(key).unwrap_or(&serde_json::Value::Null)
                );
            }
        }
        println!(
            "{differ} of {} keys differ from {fixture}",
            cudnn_cbr::fusion::REQUIRED_KEYS.len()
        );
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("device_props: {e}");
            ExitCode::FAILURE
        }
    }
}
