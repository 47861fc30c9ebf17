//! Runtime compilation with NVRTC, shared by our own kernels ([`crate::cbr::kernels`]) and the
//! amp layer's: whether the library loads, its version, and one source to machine code (a
//! cubin) for a real architecture. Needs no device.

// The thin NVRTC layer: each call's contract is stated where it is made.
#![allow(unsafe_code)]

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::ffi::CString;

/// Whether the NVRTC library can be loaded (never panics). Where the loader's path lacks it
/// but a CUDA wheel (a PyTorch virtualenv's) has it, it is loaded from there first
/// ([`cudnn_fe_sys::wheels::ensure_loadable`]).
pub fn nvrtc_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen NVRTC under its known names and drops
    // the handle again; it is called so that no later cudarc call panics on a missing library.
    let present = || unsafe { nvrtc_sys::is_culib_present() };
    present() || (cudnn_fe_sys::wheels::ensure_loadable("libnvrtc.so.13").is_ok() && present())
}

/// The loaded NVRTC's version, e.g. `"13.0"`; `"unknown"` when it does not say or cannot be
/// loaded.
pub fn nvrtc_version() -> String {
    if !nvrtc_library_present() {
        return "unknown".into();
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); both out-pointers are valid.
    let rc = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    if rc == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        "unknown".into()
    }
}

/// The real architecture `sm_XY` of a device of compute capability `major.minor`, for which
/// NVRTC can emit machine code (a cubin), or `None` for one this list does not know.
///
/// Machine code is preferred to PTX because the driver JIT-compiles PTX only up to its own PTX
/// version: PTX from an NVRTC newer than the driver does not load, while a cubin for the
/// device's architecture from any NVRTC of the same major version does.
pub const fn real_arch(major: u32, minor: u32) -> Option<&'static str> {
    Some(match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (10, 3) => "sm_103",
        (12, 0) => "sm_120",
        _ => return None,
    })
}

/// NVRTC's flags for machine code for `real_arch` (see [`real_arch`]): IEEE arithmetic as
/// written (no flush to zero, exact division and square root, no contracted multiply-add), so
/// a kernel computes what its CPU twin computes; `include` adds a header folder.
pub fn cubin_flags(real_arch: &str, include: Option<&str>) -> Vec<String> {
    let mut flags = vec![
        "--ftz=false".to_owned(),
        "--prec-sqrt=true".to_owned(),
        "--prec-div=true".to_owned(),
        "--fmad=false".to_owned(),
    ];
    flags.extend(include.map(|d| format!("--include-path={d}")));
    flags.push(format!("--gpu-architecture={real_arch}"));
    flags
}

/// Destroys an NVRTC program on every path.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

/// Compiles `source` (named `name` in NVRTC's messages) with `flags` (which name the real
/// architecture, `--gpu-architecture=sm_XX`) to a cubin. The caller checks
/// [`nvrtc_library_present`] first.
///
/// # Errors
/// NVRTC's error with its log (the compiler's messages), as text for the caller's error type.
pub fn compile_cubin(name: &str, source: &str, flags: &[String]) -> Result<Vec<u8>, String> {
    let text = CString::new(source).map_err(|e| e.to_string())?;
    let name = CString::new(name).map_err(|e| e.to_string())?;
    let prog = Program(nvrtc::create_program(&text, Some(&name)).map_err(|e| format!("{e:?}"))?);
    // SAFETY: `prog.0` is a live program (dropped only after this function).
    if let Err(e) = unsafe { nvrtc::compile_program(prog.0, flags) } {
        // SAFETY: as above; the log exists after a failed compile.
        let log = unsafe { nvrtc::get_program_log(prog.0) }
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                String::from_utf8_lossy(&bytes)
                    .trim_end_matches('\0')
                    .to_owned()
            })
            .unwrap_or_default();
        return Err(format!("{e:?}\n{log}"));
    }
    let mut size = 0usize;
    // SAFETY: `prog.0` compiled successfully; `size` is a valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    if size == 0 {
        return Err("NVRTC produced an empty cubin".into());
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the `size` bytes NVRTC asked for.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    Ok(cubin)
}
