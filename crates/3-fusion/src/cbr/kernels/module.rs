//! Compiling [`SOURCE`] with NVRTC (once per process and architecture, through the disk
//! kernel cache) and loading it into a CUDA context.

use super::{kernel_error, OwnKernel, Pointwise, SOURCE};
use crate::error::{Error, Result};
use crate::exec::driver;
use crate::Target;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use cudnn_cbr_runtime::kernel_cache::{CacheOutcome, KernelCache};
use cudnn_cbr_runtime::rtc::{self, PtxParam};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

/// The module compiled for one architecture.
#[derive(Debug)]
pub struct Compiled {
    /// `sm_90`…
    pub arch: &'static str,
    /// The machine code.
    pub cubin: Vec<u8>,
    /// Each entry's parameters in order, from the PTX of the same compilation: what a launch
    /// must pass ([`Launch::check`](super::Launch::check)).
    pub params: HashMap<String, Vec<PtxParam>>,
    /// Whether it came from the disk cache.
    pub outcome: CacheOutcome,
    /// Seconds spent compiling or loading it.
    pub seconds: f64,
}

/// Compiles [`SOURCE`] for `arch` (`sm_90`…) with NVRTC, through the disk kernel cache the
/// environment names ([`KernelCache::from_env`]), once per process, architecture and cache
/// folder.
///
/// # Errors
/// [`Error::Kernel`] without NVRTC or when NVRTC rejects the source (with its log).
pub fn compile(arch: &'static str) -> Result<Arc<Compiled>> {
    type Done = HashMap<(&'static str, Option<PathBuf>), Arc<Compiled>>;
    static DONE: OnceLock<Mutex<Done>> = OnceLock::new();
    let cache = KernelCache::from_env();
    // Keyed by the cache folder too: a process that moves the folder compiles (or loads)
    // again, as a fresh process would.
    let key = (arch, cache.as_ref().map(|c| c.dir().to_path_buf()));
    let mut done = DONE
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(c) = done.get(&key) {
        return Ok(c.clone());
    }
    let c = Arc::new(compile_uncached(arch, cache.as_ref())?);
    done.insert(key, c.clone());
    Ok(c)
}

/// [`compile`] without the per-process memo, through `cache` (or none): for tests and
/// benchmarks that measure a cold or a cached compile.
///
/// # Errors
/// As [`compile`].
pub fn compile_uncached(arch: &'static str, cache: Option<&KernelCache>) -> Result<Compiled> {
    let fail = |problem: String| Error::Kernel {
        kernel: format!("module for {arch}"),
        problem,
    };
    if !rtc::nvrtc_library_present() {
        return Err(fail("the NVRTC library (libnvrtc) cannot be loaded".into()));
    }
    let start = Instant::now();
    // No headers to include: the source declares what it uses.
    let flags = rtc::cubin_flags(arch, None);
    let version = rtc::nvrtc_version();
    // v2: the PTX is kept beside the machine code (its entries' parameter lists).
    let mut parts: Vec<&[u8]> = vec![b"cbr kernels v2", version.as_bytes(), arch.as_bytes()];
    parts.extend(flags.iter().map(|f| f.as_bytes()));
    parts.push(SOURCE.as_bytes());
    let key = KernelCache::key(&parts);
    let (images, outcome) =
        KernelCache::get_or_compile(cache, &format!("cbr-{arch}"), key, 2, || {
            rtc::compile_cubin_and_ptx("kernel_source.cu", SOURCE, &flags)
                .map(|(cubin, ptx)| vec![cubin, ptx.into_bytes()])
        })
        .map_err(fail)?;
    let [cubin, ptx]: [Vec<u8>; 2] = images
        .try_into()
        .map_err(|_| fail("not one machine-code image and its PTX".into()))?;
    let ptx = String::from_utf8(ptx).map_err(|_| fail("the PTX is not UTF-8".into()))?;
    let params: HashMap<String, Vec<PtxParam>> = rtc::ptx_entry_params(&ptx)
        .map_err(fail)?
        .into_iter()
        .collect();
    if let Some(k) = OwnKernel::ALL
        .iter()
        .find(|k| !params.contains_key(k.entry()))
    {
        return Err(kernel_error(*k, format!("is not in the {arch} PTX")));
    }
    Ok(Compiled {
        arch,
        cubin,
        params,
        outcome,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The architecture our kernels are compiled for on `target` when `pointwise` asks for them,
/// compiling them now (once per process); `None` where cuDNN's graphs run instead: with
/// [`Pointwise::Cudnn`], without NVRTC, or for an architecture with no machine-code target.
///
/// # Errors
/// [`Error::Kernel`] when NVRTC rejects the source.
pub fn prepare(target: &Target, pointwise: Pointwise) -> Result<Option<&'static str>> {
    let arch = arch_for(target, pointwise);
    if let Some(arch) = arch {
        compile(arch)?;
    }
    Ok(arch)
}

/// The architecture [`prepare`] would compile for, without compiling.
pub fn arch_for(target: &Target, pointwise: Pointwise) -> Option<&'static str> {
    let (major, minor) = target.props().compute_capability();
    match (pointwise, rtc::real_arch(major, minor)) {
        (Pointwise::Own, Some(arch)) if rtc::nvrtc_library_present() => Some(arch),
        _ => None,
    }
}

/// The module loaded into one CUDA context.
pub(super) struct Loaded {
    _ctx: Arc<CudaContext>,
    /// The device's architecture.
    pub(super) arch: &'static str,
    /// Each kernel with its PTX parameters (every launch is checked against them).
    pub(super) functions: HashMap<&'static str, (CudaFunction, Vec<PtxParam>)>,
    pub(super) sms: u32,
}

impl Loaded {
    /// Loaded once per context (the map holds the context, so its handle is never reused);
    /// refused for a step planned for another architecture than the device's.
    pub(super) fn for_context(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Arc<Loaded>> {
        let loaded = Self::load(ctx)?;
        if loaded.arch != arch {
            return Err(Error::Kernel {
                kernel: format!("module for {arch}"),
                problem: format!(
                    "the layer was planned for {arch}, but this device is {}: plan it for this \
                     device",
                    loaded.arch
                ),
            });
        }
        Ok(loaded)
    }

    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Arc<Loaded>> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Loaded>>>> = OnceLock::new();
        let key = ctx.cu_ctx() as usize;
        let mut map = LOADED
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = map.get(&key) {
            return Ok(l.clone());
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("query the compute capability", e))?;
        let arch = u32::try_from(major)
            .ok()
            .zip(u32::try_from(minor).ok())
            .and_then(|(ma, mi)| rtc::real_arch(ma, mi))
            .ok_or_else(|| Error::Kernel {
                kernel: "module".into(),
                problem: format!(
                    "compute capability {major}.{minor} has no machine-code target here; plan \
                     the layer for this device (cuDNN then runs every step)"
                ),
            })?;
        let compiled = compile(arch)?;
        let module = ctx
            .load_module(Ptx::from_binary(compiled.cubin.clone()))
            .map_err(|e| driver(&format!("load our {arch} kernels"), e))?;
        let mut functions = HashMap::new();
        for k in OwnKernel::ALL {
            let f = module
                .load_function(k.entry())
                .map_err(|e| driver(&format!("look up kernel {}", k.entry()), e))?;
            let params = compiled
                .params
                .get(k.entry())
                .ok_or_else(|| kernel_error(k, format!("is not in the {arch} PTX")))?;
            functions.insert(k.entry(), (f, params.clone()));
        }
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver("query the SM count", e))?;
        let l = Arc::new(Loaded {
            _ctx: ctx.clone(),
            arch,
            functions,
            sms: u32::try_from(sms).unwrap_or(1).max(1),
        });
        map.insert(key, l.clone());
        Ok(l)
    }
}
