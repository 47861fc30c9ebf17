//! Runtime compilation with NVRTC, shared by fusion's own kernels (`cbr::kernels`) and the
//! amp layer's: whether the library loads, its version, one source to machine code (a
//! cubin) for a real architecture (with its PTX), and the PTX entries' parameter lists that
//! launches are checked against ([`ptx_entry_params`], [`check_launch_params`]). Needs no
//! device.

// The thin NVRTC layer: each call's contract is stated where it is made.
#![allow(unsafe_code)]

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::ffi::CString;

/// Whether the NVRTC library can be loaded (never panics). Where the loader's path lacks it
/// but a CUDA wheel (a PyTorch virtualenv's) has it, it is loaded from there first
/// ([`crate::wheels::ensure_loadable`]).
pub fn nvrtc_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen NVRTC under its known names and drops
    // the handle again; it is called so that no later cudarc call panics on a missing library.
    let present = || unsafe { nvrtc_sys::is_culib_present() };
    present() || (crate::wheels::ensure_loadable("libnvrtc.so.13").is_ok() && present())
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
    let prog = compile_program(name, source, flags)?;
    cubin_of(&prog)
}

/// [`compile_cubin`], with the PTX of the same compilation: the text whose `.entry`
/// parameter lists ([`ptx_entry_params`]) say what each kernel of the cubin takes.
///
/// # Errors
/// As [`compile_cubin`].
pub fn compile_cubin_and_ptx(
    name: &str,
    source: &str,
    flags: &[String],
) -> Result<(Vec<u8>, String), String> {
    let prog = compile_program(name, source, flags)?;
    let cubin = cubin_of(&prog)?;
    let mut size = 0usize;
    // SAFETY: `prog.0` compiled successfully; `size` is a valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetPTXSize(prog.0, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetPTXSize: {e:?}"))?;
    let mut ptx = vec![0u8; size];
    // SAFETY: `ptx` has exactly the `size` bytes NVRTC asked for.
    unsafe { nvrtc_sys::nvrtcGetPTX(prog.0, ptx.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("nvrtcGetPTX: {e:?}"))?;
    let text = String::from_utf8_lossy(&ptx)
        .trim_end_matches('\0')
        .to_owned();
    Ok((cubin, text))
}

/// A compiled program (or NVRTC's error with its log).
fn compile_program(name: &str, source: &str, flags: &[String]) -> Result<Program, String> {
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
    Ok(prog)
}

/// The machine code of a compiled program.
fn cubin_of(prog: &Program) -> Result<Vec<u8>, String> {
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

/// How one kernel parameter is passed, as a PTX `.entry` declares it: its type and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PtxParam {
    /// `.u64`/`.s64`/`.b64`: a pointer, `size_t`, `long long`.
    Int64,
    /// `.u32`/`.s32`/`.b32`: `int`, `unsigned`.
    Int32,
    /// `.f32`: `float`.
    F32,
    /// `.f64`: `double`.
    F64,
    /// Any other scalar type, or an aggregate (`.b8 name[N]`: a struct by value), by size.
    Other {
        /// Bytes.
        bytes: usize,
    },
}

impl PtxParam {
    /// Its size in bytes.
    pub fn bytes(self) -> usize {
        match self {
            PtxParam::Int64 | PtxParam::F64 => 8,
            PtxParam::Int32 | PtxParam::F32 => 4,
            PtxParam::Other { bytes } => bytes,
        }
    }

    fn parse(decl: &str) -> Option<Self> {
        // `.param .u64 name`, `.param .align 8 .b8 name[16]`.
        // The type is the first word that is not a state space or alignment qualifier
        // (`.ptr .align 1` after a pointer's type); the name is the last word.
        let words: Vec<&str> = decl.split_whitespace().collect();
        let name = *words.last()?;
        let mut ty = None;
        let mut i = 0;
        while i + 1 < words.len() {
            match words[i] {
                ".align" => i += 2,
                ".ptr" | ".global" | ".const" | ".shared" | ".local" => i += 1,
                w => {
                    ty = Some(w);
                    break;
                }
            }
        }
        let ty = ty?;
        let count = match (name.find('['), name.find(']')) {
            (Some(a), Some(b)) if a < b => name[a + 1..b].parse::<usize>().ok()?,
            _ => 1,
        };
        let elem = match ty {
            ".u64" | ".s64" | ".b64" => PtxParam::Int64,
            ".u32" | ".s32" | ".b32" => PtxParam::Int32,
            ".f32" => PtxParam::F32,
            ".f64" => PtxParam::F64,
            ".u16" | ".s16" | ".b16" | ".f16" => PtxParam::Other { bytes: 2 },
            ".u8" | ".s8" | ".b8" => PtxParam::Other { bytes: 1 },
            _ => return None,
        };
        Some(if count == 1 {
            elem
        } else {
            PtxParam::Other {
                bytes: elem.bytes() * count,
            }
        })
    }
}

impl std::fmt::Display for PtxParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PtxParam::Int64 => f.write_str("a 64-bit integer or pointer"),
            PtxParam::Int32 => f.write_str("a 32-bit integer"),
            PtxParam::F32 => f.write_str("an f32"),
            PtxParam::F64 => f.write_str("an f64"),
            PtxParam::Other { bytes } => write!(f, "{bytes} bytes"),
        }
    }
}

/// Every `.entry` of a PTX module with its parameter list in order, by entry name.
///
/// # Errors
/// Text naming the entry whose declaration cannot be read.
pub fn ptx_entry_params(ptx: &str) -> Result<Vec<(String, Vec<PtxParam>)>, String> {
    let mut out = Vec::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        let decl = &rest[at + ".entry ".len()..];
        let open = decl
            .find('(')
            .ok_or_else(|| "a `.entry` without a parameter list".to_string())?;
        let name = decl[..open].trim().to_string();
        let close = decl[open..]
            .find(')')
            .map(|i| open + i)
            .ok_or_else(|| format!("entry {name}: unterminated parameter list"))?;
        let params = decl[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let p = p
                    .strip_prefix(".param")
                    .ok_or_else(|| format!("entry {name}: `{p}` is not a `.param`"))?;
                PtxParam::parse(p).ok_or_else(|| format!("entry {name}: cannot read `{p}`"))
            })
            .collect::<Result<Vec<_>, String>>()?;
        out.push((name, params));
        rest = &decl[close..];
    }
    Ok(out)
}

/// Checks the arguments a launch passes (`got`, in order) against the parameters the compiled
/// entry `entry` declares (`expected`, from [`ptx_entry_params`]).
///
/// # Errors
/// Text naming the entry, the first parameter (by index from 0) whose type or size differs,
/// or the counts when one list is longer.
pub fn check_launch_params(
    entry: &str,
    expected: &[PtxParam],
    got: &[PtxParam],
) -> Result<(), String> {
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        if e != g {
            return Err(format!(
                "kernel {entry}: parameter {i} is {e} in the compiled kernel, but the launch \
                 passes {g}"
            ));
        }
    }
    if expected.len() != got.len() {
        return Err(format!(
            "kernel {entry}: the compiled kernel takes {} parameters, the launch passes {}",
            expected.len(),
            got.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The declarations NVRTC writes (scalars, pointers, a struct by value), read in order.
    #[test]
    fn entry_parameters_are_read_in_order_with_their_sizes() {
        let ptx = "
.version 8.8
.target sm_90
.address_size 64

.visible .entry first(
\t.param .u64 .ptr .align 1 first_param_0,
\t.param .u64 first_param_1,
\t.param .u32 first_param_2,
\t.param .f32 first_param_3,
\t.param .align 8 .b8 first_param_4[24]
)
{
\tret;
}
.visible .entry second()
{
\tret;
}
";
        let entries = ptx_entry_params(ptx).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].0, "first");
        assert_eq!(
            entries[0].1,
            [
                PtxParam::Int64,
                PtxParam::Int64,
                PtxParam::Int32,
                PtxParam::F32,
                PtxParam::Other { bytes: 24 }
            ]
        );
        assert_eq!(entries[1], ("second".to_string(), vec![]));
        let bad = ptx_entry_params(".entry broken(\n\t.param .q13 x\n)").unwrap_err();
        assert!(bad.contains("broken"), "{bad}");
    }

    #[test]
    fn a_mismatch_names_the_entry_and_the_parameter() {
        use PtxParam::{Int32, Int64, F32};
        assert!(check_launch_params("k", &[Int64, F32], &[Int64, F32]).is_ok());
        let e = check_launch_params("k", &[Int64, F32, Int32], &[Int64, Int32, Int32]).unwrap_err();
        assert!(e.contains("kernel k") && e.contains("parameter 1"), "{e}");
        let e = check_launch_params("k", &[Int64], &[Int64, Int32]).unwrap_err();
        assert!(e.contains("takes 1") && e.contains("passes 2"), "{e}");
    }
}
