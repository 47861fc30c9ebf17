//! The CUDA C sources of the range ops, embedded, and how to compile them with NVRTC.
//!
//! Recipe (the kernel-launch module does this once per CUDA context and caches the module):
//! 1. Pick the device's [`CudaArch`] (or the nearest lower one: PTX JIT-compiles forward).
//! 2. For each [`KernelSource`] in [`ALL`], compile [`KernelSource::program`] with
//!    [`compile_options`] (cudarc's `nvrtc::compile_ptx_with_opts`).
//! 3. Load the PTX and look up each name in [`KernelSource::entry_points`].
//!
//! Each `.cu` file in `crates/3-amp/kernels/` holds one op family; [`COMMON_HEADER`]
//! (`amp_common.cuh`: the S layout, the conversion rules, the vector load/store helpers) is
//! prepended to each of them, because NVRTC cannot find our own headers on disk at run time.
//! The CPU twin of every entry point lives in [`crate::range`].

#![forbid(unsafe_code)]

use std::path::PathBuf;

use cudarc::nvrtc::CompileOptions;

use crate::error::KernelTableError;

/// Prelude prepended to every kernel source.
pub const COMMON_HEADER: &str = include_str!("../kernels/amp_common.cuh");

/// Environment variable naming the directory that holds `cuda_fp16.h` (the CUDA headers).
/// NVRTC needs it on machines where the headers are not in a default place.
pub const CUDA_INCLUDE_ENV: &str = "CUDNN_CBR_CUDA_INCLUDE";

/// Entry-point names, shared by the sources and the kernel-launch module.
pub mod entry {
    /// FP32 → FP16 cast over a range (W→A, E→E16). Twin: `range::cast_f32_to_f16`.
    pub const CAST_F32_TO_F16: &str = "amp_cast_f32_to_f16";
    /// FP16 → FP32 cast over a range (G16→G). Twin: `range::cast_f16_to_f32`.
    pub const CAST_F16_TO_F32: &str = "amp_cast_f16_to_f32";
    /// Gradient accumulation: G16 and G added into GA, or drained into G. Twin:
    /// `range::accum_grads`.
    pub const ACCUM_GRADS: &str = "amp_accum_grads";
    /// NaN/Inf check setting the flag. Twin: `range::check_nonfinite`.
    pub const CHECK_NONFINITE: &str = "amp_check_nonfinite";
    /// NaN check and Inf/large clip. Twin: `range::check_and_clip`.
    pub const CHECK_CLIP: &str = "amp_check_clip";
    /// Per-block sums of squares of G, in a fixed order. Twin: `range::grad_norm`.
    pub const GRAD_SUMSQ: &str = "amp_grad_sumsq";
    /// The global gradient norm from those sums (single thread). Twin: `range::grad_norm`.
    pub const GRAD_NORM: &str = "amp_grad_norm";
    /// Loss-scale update (single thread). Twin: `range::update_loss_scale`.
    pub const LOSS_SCALE_UPDATE: &str = "amp_loss_scale_update";
    /// Zero a byte range. Twin: `range::zero_bytes`.
    pub const ZERO_BYTES: &str = "amp_zero_bytes";
    /// SGD step with 1/scale, flag skip, FP16 copy. Twin: `range::sgd_step`.
    pub const SGD_STEP: &str = "amp_sgd_step";
    /// EMA update with FP16 copy and flag skip. Twin: `range::ema_update`.
    pub const EMA_UPDATE: &str = "amp_ema_update";
    /// Softmax cross-entropy backward seed. Twin: `range::softmax_xent_backward`.
    pub const SOFTMAX_XENT_BACKWARD: &str = "amp_softmax_xent_backward";
}

/// How a kernel parameter is passed: its PTX parameter type. Pointers and `size_t` are
/// `.u64`, `unsigned int` and `int` are `.u32`, `float` is `.f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamType {
    /// A 64-bit pointer or `size_t`.
    U64,
    /// A 32-bit integer (`unsigned int` or `int`).
    U32,
    /// A `float`.
    F32,
}

impl ParamType {
    /// The PTX declaration, e.g. `".u64"`.
    pub const fn ptx(self) -> &'static str {
        match self {
            ParamType::U64 => ".u64",
            ParamType::U32 => ".u32",
            ParamType::F32 => ".f32",
        }
    }
}

/// The parameter list of an entry point of a table's sources, `None` for a name that is not
/// one (e.g. [`signature`]).
pub type Signatures = fn(&str) -> Option<&'static [ParamType]>;

/// The parameter list of an entry point, in order: what the launch module passes, checked
/// before every launch; the NVRTC test checks it against the compiled PTX. `None` for a name
/// that is not an entry point.
pub fn signature(entry_point: &str) -> Option<&'static [ParamType]> {
    use ParamType::{F32, U32, U64};
    Some(match entry_point {
        // (src, dst, n)
        entry::CAST_F32_TO_F16 | entry::CAST_F16_TO_F32 => &[U64, U64, U64],
        // (g16, g, acc, n, n16, drain)
        entry::ACCUM_GRADS => &[U64, U64, U64, U64, U64, U32],
        // (g, n, s)
        entry::CHECK_NONFINITE => &[U64, U64, U64],
        // (g, n, bound, s)
        entry::CHECK_CLIP => &[U64, U64, F32, U64],
        // (g, n, s)
        entry::GRAD_SUMSQ => &[U64, U64, U64],
        // (s)
        entry::GRAD_NORM => &[U64],
        // (s, growth_interval, growth_factor, max_scale)
        entry::LOSS_SCALE_UPDATE => &[U64, U32, F32, F32],
        // (dst, nbytes)
        entry::ZERO_BYTES => &[U64, U64],
        // (w, m, g, a, s, nesterov, decay, n): lr, momentum, weight decay are read from s
        entry::SGD_STEP => &[U64, U64, U64, U64, U64, U32, U32, U64],
        // (e, e16, w, s, decay, n)
        entry::EMA_UPDATE => &[U64, U64, U64, U64, F32, U64],
        // (logits, labels, dlogits, loss, s, batch, classes)
        entry::SOFTMAX_XENT_BACKWARD => &[U64, U64, U64, U64, U64, U64, U64],
        _ => return None,
    })
}

/// One `.cu` file: one NVRTC program (amp's in `crates/3-amp/kernels/`; the network's own kernels,
/// in `crates/4-netops/kernels/`, are built from the same type, [`COMMON_HEADER`] included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// Short family name, e.g. `"cast"`.
    pub name: &'static str,
    /// File name (also the NVRTC program name, so compile logs name it).
    pub file: &'static str,
    /// The file's text, without [`COMMON_HEADER`].
    pub source: &'static str,
    /// The `extern "C" __global__` functions it defines.
    pub entry_points: &'static [&'static str],
}

impl KernelSource {
    /// The full program text handed to NVRTC: [`COMMON_HEADER`] then the file.
    pub fn program(&self) -> String {
        let mut text = String::with_capacity(COMMON_HEADER.len() + self.source.len() + 1);
        text.push_str(COMMON_HEADER);
        text.push('\n');
        text.push_str(self.source);
        text
    }
}

/// Casts between FP32 and FP16 regions, and gradient accumulation.
pub const CAST: KernelSource = KernelSource {
    name: "cast",
    file: "amp_cast.cu",
    source: include_str!("../kernels/amp_cast.cu"),
    entry_points: &[
        entry::CAST_F32_TO_F16,
        entry::CAST_F16_TO_F32,
        entry::ACCUM_GRADS,
    ],
};

/// Overflow check and check-and-clip.
pub const CHECK: KernelSource = KernelSource {
    name: "check",
    file: "amp_check.cu",
    source: include_str!("../kernels/amp_check.cu"),
    entry_points: &[entry::CHECK_NONFINITE, entry::CHECK_CLIP],
};

/// The global gradient norm (clipping by norm).
pub const NORM: KernelSource = KernelSource {
    name: "norm",
    file: "amp_norm.cu",
    source: include_str!("../kernels/amp_norm.cu"),
    entry_points: &[entry::GRAD_SUMSQ, entry::GRAD_NORM],
};

/// Loss-scale update.
pub const SCALE: KernelSource = KernelSource {
    name: "scale",
    file: "amp_scale.cu",
    source: include_str!("../kernels/amp_scale.cu"),
    entry_points: &[entry::LOSS_SCALE_UPDATE],
};

/// Zero, SGD, EMA.
pub const OPTIM: KernelSource = KernelSource {
    name: "optim",
    file: "amp_optim.cu",
    source: include_str!("../kernels/amp_optim.cu"),
    entry_points: &[entry::ZERO_BYTES, entry::SGD_STEP, entry::EMA_UPDATE],
};

/// Softmax cross-entropy backward (loss-gradient seed).
pub const SEED: KernelSource = KernelSource {
    name: "seed",
    file: "amp_seed.cu",
    source: include_str!("../kernels/amp_seed.cu"),
    entry_points: &[entry::SOFTMAX_XENT_BACKWARD],
};

/// Every kernel source of the AMP layer.
pub const ALL: [KernelSource; 6] = [CAST, CHECK, NORM, SCALE, OPTIM, SEED];

/// Checks a kernel table against its sources: each entry point is defined in its file as
/// `extern "C" __global__ void <name>(...)` with as many parameters as `signatures` gives it,
/// no file exports a kernel its table does not list, and no entry point is listed twice.
///
/// `KernelSet::load` (in [`crate::cuda`]) runs it before compiling: launches are checked
/// against the signatures only, so a count that differs from the source would otherwise
/// reach the driver unnoticed. Each table's tests run it without a device. Parameters are
/// counted by their commas, so a parameter's type must not hold one.
///
/// # Errors
/// The first disagreement found, as a [`KernelTableError`].
pub fn check_table(
    sources: &[KernelSource],
    signatures: Signatures,
) -> Result<(), KernelTableError> {
    let mut seen = std::collections::HashSet::new();
    for k in sources {
        for &entry in k.entry_points {
            if !seen.insert(entry) {
                return Err(KernelTableError::Duplicate { entry });
            }
            let sig = signatures(entry).ok_or(KernelTableError::NoSignature { entry })?;
            let decl = format!("extern \"C\" __global__ void {entry}(");
            let not_defined = KernelTableError::NotDefined {
                file: k.file,
                entry,
            };
            let start = k.source.find(&decl).ok_or(not_defined.clone())? + decl.len();
            let len = k.source[start..].find(')').ok_or(not_defined)?;
            let params = k.source[start..start + len].trim();
            let declared = if params.is_empty() || params == "void" {
                0
            } else {
                params.split(',').count()
            };
            if declared != sig.len() {
                return Err(KernelTableError::ParamCount {
                    file: k.file,
                    entry,
                    declared,
                    signature: sig.len(),
                });
            }
        }
        // A kernel the table does not list could never be launched: a stale table.
        let exported = k.source.matches("extern \"C\" __global__").count();
        if exported != k.entry_points.len() {
            return Err(KernelTableError::ExportCount {
                file: k.file,
                exported,
                listed: k.entry_points.len(),
            });
        }
    }
    Ok(())
}

/// GPU architectures we build PTX for (tier 3 compiles all of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaArch {
    /// A100.
    Sm80,
    /// H100 / H200.
    Sm90,
    /// B200.
    Sm100,
}

impl CudaArch {
    /// All supported architectures, oldest first.
    pub const ALL: [CudaArch; 3] = [CudaArch::Sm80, CudaArch::Sm90, CudaArch::Sm100];

    /// The architecture to build PTX for on a device of compute capability `major.minor`:
    /// the newest supported one not newer than the device (PTX is JIT-compiled forward, so
    /// an sm_89 device runs the sm_80 PTX). `None` below 8.0, which we do not support.
    pub const fn for_compute_capability(major: u32, minor: u32) -> Option<CudaArch> {
        let _ = minor; // every minor revision of a major one runs the same PTX here
        match major {
            0..=7 => None,
            8 => Some(CudaArch::Sm80),
            9 => Some(CudaArch::Sm90),
            _ => Some(CudaArch::Sm100),
        }
    }

    /// The virtual architecture NVRTC targets, e.g. `"compute_90"`. A virtual arch makes
    /// NVRTC emit PTX (a real `sm_XX` would make it emit a cubin instead).
    pub const fn compute_name(self) -> &'static str {
        match self {
            CudaArch::Sm80 => "compute_80",
            CudaArch::Sm90 => "compute_90",
            CudaArch::Sm100 => "compute_100",
        }
    }

    /// The `sm_XX` name, for messages.
    pub const fn sm_name(self) -> &'static str {
        match self {
            CudaArch::Sm80 => "sm_80",
            CudaArch::Sm90 => "sm_90",
            CudaArch::Sm100 => "sm_100",
        }
    }

    /// The PTX `.target` directive value the compiled module carries, e.g. `"sm_90"`.
    pub const fn ptx_target(self) -> &'static str {
        self.sm_name()
    }
}

/// NVRTC options for `source` on `arch`, with `cuda_include` (the directory holding
/// `cuda_fp16.h`) on the include path when given.
///
/// Denormals are kept and division and square root are IEEE (`--ftz=false`,
/// `--prec-div=true`, `--prec-sqrt=true`), and no FMA contraction (`--fmad=false`): the CPU
/// twins assume exactly that arithmetic. The kernels also spell the critical operations with
/// `__fmul_rn`/`__fadd_rn`, so bit-exactness does not rest on these flags alone.
pub fn compile_options(
    source: &KernelSource,
    arch: CudaArch,
    cuda_include: Option<&str>,
) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        include_paths: cuda_include.map(str::to_owned).into_iter().collect(),
        arch: Some(arch.compute_name()),
        name: Some(source.file.to_owned()),
        ..CompileOptions::default()
    }
}

/// The CUDA include directory from [`CUDA_INCLUDE_ENV`], if set and non-empty.
pub fn cuda_include_dir() -> Option<PathBuf> {
    std::env::var_os(CUDA_INCLUDE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudnn_cbr_runtime::rtc::{cubin_flags, real_arch};

    #[test]
    fn cubin_flags_keep_the_ptx_arithmetic() {
        let opts = compile_options(&ALL[0], CudaArch::Sm90, None);
        assert_eq!(
            (opts.ftz, opts.prec_sqrt, opts.prec_div, opts.fmad),
            (Some(false), Some(true), Some(true), Some(false))
        );
        let flags = cubin_flags("sm_90", Some("/inc"));
        for f in [
            "--ftz=false",
            "--prec-sqrt=true",
            "--prec-div=true",
            "--fmad=false",
            "--include-path=/inc",
            "--gpu-architecture=sm_90",
        ] {
            assert!(flags.iter().any(|x| x == f), "{f} missing from {flags:?}");
        }
        assert_eq!(real_arch(9, 0), Some("sm_90"));
        assert_eq!(real_arch(7, 5), None);
    }

    #[test]
    fn the_table_matches_its_sources_and_signatures() {
        assert_eq!(check_table(&ALL, signature), Ok(()));
        assert_eq!(signature("nope"), None);
    }

    #[test]
    fn check_table_finds_each_disagreement() {
        fn sig(e: &str) -> Option<&'static [ParamType]> {
            match e {
                "k" | "j" => Some(&[ParamType::U64, ParamType::U32]),
                "z" => Some(&[]),
                _ => None,
            }
        }
        let src = |source, entry_points| KernelSource {
            name: "t",
            file: "t.cu",
            source,
            entry_points,
        };
        let two = "extern \"C\" __global__ void k(float* a, int n) {}";
        assert_eq!(check_table(&[src(two, &["k"])], sig), Ok(()));
        let none = "extern \"C\" __global__ void z() {}";
        assert_eq!(check_table(&[src(none, &["z"])], sig), Ok(()));
        let three = "extern \"C\" __global__ void k(float* a, int n, int m) {}";
        assert_eq!(
            check_table(&[src(three, &["k"])], sig),
            Err(KernelTableError::ParamCount {
                file: "t.cu",
                entry: "k",
                declared: 3,
                signature: 2
            })
        );
        assert_eq!(
            check_table(&[src(two, &["j"])], sig),
            Err(KernelTableError::NotDefined {
                file: "t.cu",
                entry: "j"
            })
        );
        assert_eq!(
            check_table(&[src(two, &["x"])], sig),
            Err(KernelTableError::NoSignature { entry: "x" })
        );
        assert_eq!(
            check_table(&[src(two, &[])], sig),
            Err(KernelTableError::ExportCount {
                file: "t.cu",
                exported: 1,
                listed: 0
            })
        );
        assert_eq!(
            check_table(&[src(two, &["k"]), src(two, &["k"])], sig),
            Err(KernelTableError::Duplicate { entry: "k" })
        );
    }

    #[test]
    fn compute_capability_picks_the_newest_arch_not_newer_than_the_device() {
        assert_eq!(CudaArch::for_compute_capability(7, 5), None);
        assert_eq!(CudaArch::for_compute_capability(8, 0), Some(CudaArch::Sm80));
        assert_eq!(CudaArch::for_compute_capability(8, 9), Some(CudaArch::Sm80));
        assert_eq!(CudaArch::for_compute_capability(9, 0), Some(CudaArch::Sm90));
        assert_eq!(
            CudaArch::for_compute_capability(10, 0),
            Some(CudaArch::Sm100)
        );
        assert_eq!(
            CudaArch::for_compute_capability(12, 0),
            Some(CudaArch::Sm100)
        );
    }

    #[test]
    fn options_carry_arch_include_and_exact_math() {
        let o = compile_options(&CAST, CudaArch::Sm90, Some("/inc"));
        assert_eq!(o.arch, Some("compute_90"));
        assert_eq!(o.include_paths, vec!["/inc".to_owned()]);
        assert_eq!(o.fmad, Some(false));
        assert_eq!(o.ftz, Some(false));
        assert_eq!(o.name.as_deref(), Some("amp_cast.cu"));
    }
}
