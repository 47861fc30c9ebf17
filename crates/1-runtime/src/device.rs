//! Opening a CUDA device without the panic cudarc gives where no driver library exists: the
//! one device opener of the workspace (the frontend and the mixed-precision layer convert
//! its error into theirs).

// cudarc's driver-library probe is an unsafe call (stated where it is made).
#![allow(unsafe_code)]

use cudarc::driver::CudaContext;
use std::sync::Arc;

/// Why no CUDA device could be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no CUDA device: {reason}")]
pub struct NoCudaDevice {
    /// What failed: no driver library, or the driver's refusal (no device, a stand-in driver,
    /// an ordinal past the device count).
    pub reason: String,
}

/// The variable that selects the simulated device (`sim`); unset or empty for a real one.
pub const DEVICE_ENV: &str = "CUDNN_CBR_DEVICE";

/// Refuses a [`DEVICE_ENV`] value that selects nothing: a typo (`CUDNN_CBR_DEVICE=simm`) would
/// otherwise run on whatever driver is loaded, silently.
fn check_device_env() -> Result<(), NoCudaDevice> {
    match std::env::var_os(DEVICE_ENV) {
        None => Ok(()),
        Some(v) if v.is_empty() || v == "sim" => Ok(()),
        Some(v) => Err(NoCudaDevice {
            reason: format!(
                "{DEVICE_ENV} is `{}`; expected `sim` (the simulated device) or unset",
                v.to_string_lossy()
            ),
        }),
    }
}

/// Opens CUDA device `ordinal` (its primary context). Checks that a driver library exists
/// before touching cudarc, which panics without one.
///
/// # Errors
/// [`NoCudaDevice`] naming why (also for a [`DEVICE_ENV`] value other than `sim`).
pub fn cuda_device(ordinal: usize) -> Result<Arc<CudaContext>, NoCudaDevice> {
    check_device_env()?;
    // SAFETY: is_culib_present only tries to dlopen the driver library by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NoCudaDevice {
            reason: "no CUDA driver library (libcuda) on this machine".into(),
        });
    }
    CudaContext::new(ordinal).map_err(|e| NoCudaDevice {
        reason: format!("CUDA device {ordinal} cannot be opened: {e}"),
    })
}

/// How many CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`), without the panic
/// cudarc gives where no driver library exists.
///
/// # Errors
/// [`NoCudaDevice`] when there is no driver library, or the driver refuses (or as
/// [`cuda_device`], for [`DEVICE_ENV`]).
pub fn cuda_device_count() -> Result<usize, NoCudaDevice> {
    check_device_env()?;
    // SAFETY: is_culib_present only tries to dlopen the driver library by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NoCudaDevice {
            reason: "no CUDA driver library (libcuda) on this machine".into(),
        });
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(e) => Err(NoCudaDevice {
            reason: format!("the CUDA driver cannot count its devices: {e}"),
        }),
    }
}
