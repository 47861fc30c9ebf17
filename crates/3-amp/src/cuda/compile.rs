//! NVRTC compilation of kernel sources ([`compile_ptx`], [`compile_cubin`]) and their
//! loading into a CUDA context as a [`KernelSet`] ([`KernelSet::load`]); amp's own set once
//! per context ([`AmpKernels::for_context`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, Ptx};

use crate::cuda::kernel_set::{KernelSet, BLOCKS_PER_SM};
use crate::cuda::launch::AmpKernels;
use crate::cuda::{cuda_include_dir, driver_error};
use crate::error::{AmpError, CudaError};
use crate::kernels::{self, CudaArch, KernelSource, Signatures};
use cudnn_cbr_runtime::kernel_cache::{CacheOutcome, KernelCache};
use cudnn_cbr_runtime::rtc::{self, cubin_flags, nvrtc_library_present, nvrtc_version};

/// Compiled kernels per CUDA context (keyed by the context handle; each entry holds an `Arc`
/// to its context, so a handle in the map can never be reused by another context).
fn cache() -> &'static Mutex<HashMap<usize, Arc<AmpKernels>>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<AmpKernels>>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// [`AmpError::NoNvrtc`] unless the NVRTC library can be loaded.
fn require_nvrtc() -> Result<(), AmpError> {
    if nvrtc_library_present() {
        Ok(())
    } else {
        Err(AmpError::NoNvrtc {
            reason: "the NVRTC library (libnvrtc) is not on the loader path".into(),
        })
    }
}

fn describe_compile_error(e: &CompileError) -> String {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}\n{}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

/// Compiles every source of `sources` (e.g. [`crate::kernels::ALL`]) to PTX for `arch` with
/// NVRTC, with the include directory of [`crate::cuda::cuda_include_dir`]. Needs no device:
/// this is what [`KernelSet::load`] loads where the device's architecture has no machine
/// code.
///
/// # Errors
/// [`AmpError::NoNvrtc`] without the NVRTC library, [`CudaError::Compile`] with NVRTC's log
/// when a source does not compile (e.g. `cuda_fp16.h` not found).
pub fn compile_ptx(
    sources: &[KernelSource],
    arch: CudaArch,
) -> Result<Vec<(KernelSource, String)>, AmpError> {
    require_nvrtc()?;
    let include = cuda_include_dir().and_then(|d| d.into_os_string().into_string().ok());
    sources
        .iter()
        .map(|source| {
            let opts = kernels::compile_options(source, arch, include.as_deref());
            compile_ptx_with_opts(source.program(), opts)
                .map(|ptx| (*source, ptx.to_src()))
                .map_err(|e| {
                    CudaError::Compile {
                        file: source.file,
                        arch: arch.sm_name(),
                        log: describe_compile_error(&e),
                    }
                    .into()
                })
        })
        .collect()
}

/// Compiles every source of `sources` to machine code (a cubin) for the real architecture
/// `real_arch` (e.g. `"sm_90"`, see [`rtc::real_arch`]) with NVRTC. Needs no device. This is
/// what [`KernelSet::load`] loads where it can: unlike PTX, a cubin does not depend on the
/// driver accepting the NVRTC's PTX version.
///
/// # Errors
/// As [`compile_ptx`].
pub fn compile_cubin(
    sources: &[KernelSource],
    real_arch: &'static str,
) -> Result<Cubins, AmpError> {
    require_nvrtc()?;
    let include = cuda_include_dir().and_then(|d| d.into_os_string().into_string().ok());
    let flags = cubin_flags(real_arch, include.as_deref());
    sources
        .iter()
        .map(|source| {
            rtc::compile_cubin(source.file, &source.program(), &flags)
                .map(|cubin| (*source, cubin))
                .map_err(|log| {
                    CudaError::Compile {
                        file: source.file,
                        arch: real_arch,
                        log,
                    }
                    .into()
                })
        })
        .collect()
}

/// One machine-code image per kernel source.
pub type Cubins = Vec<(KernelSource, Vec<u8>)>;

/// [`compile_cubin`] through a disk cache ([`KernelCache`]): loaded from `cache` when the
/// same sources were compiled with the same flags, architecture and NVRTC before, else
/// compiled and stored under `family` (e.g. `"amp"`: one entry per family and
/// architecture). Needs NVRTC either way (its version is part of the key).
///
/// # Errors
/// As [`compile_cubin`].
pub fn compile_cubin_cached(
    family: &str,
    sources: &[KernelSource],
    real_arch: &'static str,
    cache: Option<&KernelCache>,
) -> Result<(Cubins, CacheOutcome), AmpError> {
    require_nvrtc()?;
    let include = cuda_include_dir().and_then(|d| d.into_os_string().into_string().ok());
    let mut parts: Vec<Vec<u8>> = vec![
        format!("{family} cubins v1").into_bytes(),
        nvrtc_version().into_bytes(),
        real_arch.as_bytes().to_vec(),
    ];
    parts.extend(
        cubin_flags(real_arch, include.as_deref())
            .into_iter()
            .map(String::into_bytes),
    );
    for source in sources {
        parts.push(source.file.as_bytes().to_vec());
        parts.push(source.program().into_bytes());
    }
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let key = KernelCache::key(&refs);
    let (images, outcome) = KernelCache::get_or_compile(
        cache,
        &format!("{family}-{real_arch}"),
        key,
        sources.len(),
        || {
            Ok::<_, AmpError>(
                compile_cubin(sources, real_arch)?
                    .into_iter()
                    .map(|(_, c)| c)
                    .collect(),
            )
        },
    )?;
    Ok((sources.iter().copied().zip(images).collect(), outcome))
}

impl AmpKernels {
    /// The kernels for `ctx`: compiled and loaded on the first call for a context, shared
    /// afterwards. The first call takes about a second (NVRTC) unless the machine code is in
    /// the disk cache ([`cudnn_cbr_runtime::kernel_cache`]; [`AmpKernels::code`] says which).
    ///
    /// # Errors
    /// [`AmpError::NoNvrtc`] without the NVRTC library, [`CudaError::UnsupportedArch`] below
    /// sm_80, [`CudaError::Compile`] when NVRTC rejects a source (e.g. no `cuda_fp16.h`),
    /// [`CudaError::Driver`] when the driver cannot load the PTX.
    pub fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<AmpKernels>, AmpError> {
        let key = ctx.cu_ctx() as usize;
        // Compiling under the lock keeps two threads from compiling the same context twice.
        let mut map = cache().lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = map.get(&key) {
            return Ok(k.clone());
        }
        let set = KernelSet::load(ctx, "amp", &kernels::ALL, kernels::signature)?;
        let k = Arc::new(AmpKernels { set });
        map.insert(key, k.clone());
        Ok(k)
    }
}

impl KernelSet {
    /// Compiles `sources` for `ctx`'s device and loads them there: machine code for the
    /// device's own architecture where NVRTC knows it (through the disk cache,
    /// [`cudnn_cbr_runtime::kernel_cache`], under `family`), else PTX for the driver to JIT.
    /// The table is checked first ([`kernels::check_table`]); every launch is checked against
    /// `signatures`. Each call compiles and loads anew: a set's owner keeps one per context
    /// (as [`AmpKernels::for_context`] does).
    ///
    /// # Errors
    /// [`CudaError::Table`] when `sources` disagree with their entry points or `signatures`,
    /// [`AmpError::NoNvrtc`] without the NVRTC library, [`CudaError::UnsupportedArch`] below
    /// sm_80, [`CudaError::Compile`] when NVRTC rejects a source (e.g. no `cuda_fp16.h`),
    /// [`CudaError::Driver`] when the driver cannot load the code or an entry point is
    /// missing from it.
    pub fn load(
        ctx: &Arc<CudaContext>,
        family: &str,
        sources: &[KernelSource],
        signatures: Signatures,
    ) -> Result<KernelSet, AmpError> {
        // A table at odds with its sources is a bug on any machine, so it is found first.
        kernels::check_table(sources, signatures).map_err(CudaError::Table)?;
        require_nvrtc()?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver_error("query the compute capability", e))?;
        let cc = u32::try_from(major).ok().zip(u32::try_from(minor).ok());
        let arch = cc
            .and_then(|(ma, mi)| CudaArch::for_compute_capability(ma, mi))
            .ok_or(CudaError::UnsupportedArch { major, minor })?;
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("query the SM count", e))?;
        // Machine code for the device's own architecture where NVRTC knows it, else PTX for
        // the driver to JIT (see `rtc::real_arch` for why machine code comes first).
        let real = cc.and_then(|(ma, mi)| rtc::real_arch(ma, mi));
        let (images, code): (Vec<(KernelSource, Ptx)>, String) = match real {
            Some(sm) => {
                let cache = KernelCache::from_env();
                let (cubins, outcome) = compile_cubin_cached(family, sources, sm, cache.as_ref())?;
                let from = match (outcome, &cache) {
                    (CacheOutcome::Hit, Some(c)) => {
                        format!("from the kernel cache {}", c.dir().display())
                    }
                    (CacheOutcome::Stored, Some(c)) => {
                        format!("compiled, cached in {}", c.dir().display())
                    }
                    (CacheOutcome::NotStored, Some(c)) => {
                        format!(
                            "compiled; the kernel cache {} could not be written",
                            c.dir().display()
                        )
                    }
                    _ => "compiled, no kernel cache".to_string(),
                };
                (
                    cubins
                        .into_iter()
                        .map(|(s, c)| (s, Ptx::from_binary(c)))
                        .collect(),
                    format!("{sm} machine code ({from})"),
                )
            }
            None => (
                compile_ptx(sources, arch)?
                    .into_iter()
                    .map(|(s, p)| (s, Ptx::from_src(p)))
                    .collect(),
                format!("{} PTX, JIT-compiled by the driver", arch.compute_name()),
            ),
        };
        let code = format!("{code}, NVRTC {}", nvrtc_version());
        let mut functions: HashMap<&'static str, CudaFunction> = HashMap::new();
        for (source, image) in images {
            let module = ctx
                .load_module(image)
                .map_err(|e| driver_error(format!("load the {code} of {}", source.file), e))?;
            for &name in source.entry_points {
                let f = module
                    .load_function(name)
                    .map_err(|e| driver_error(format!("look up kernel {name}"), e))?;
                functions.insert(name, f);
            }
        }
        // Every entry point must have been found: a launch looks it up by name.
        for name in sources.iter().flat_map(|s| s.entry_points) {
            if !functions.contains_key(name) {
                return Err(CudaError::Driver {
                    op: format!("look up kernel {name}"),
                    code: "not in the compiled module".into(),
                }
                .into());
            }
        }
        Ok(KernelSet {
            ctx: ctx.clone(),
            arch,
            code,
            max_blocks: u32::try_from(sms.max(1))
                .unwrap_or(1)
                .saturating_mul(BLOCKS_PER_SM),
            functions,
            signatures,
        })
    }
}
