//! Finding and loading cuDNN at run time.
//!
//! Search order (first hit wins):
//! 1. `$CUDNN_LIB_DIR/libcudnn.so.9` when the variable is set;
//! 2. the system loader (`libcudnn.so.9` by name: `LD_LIBRARY_PATH`, the ld cache, rpaths);
//! 3. pip-installed wheels, `…/site-packages/nvidia/cudnn/lib/libcudnn.so.9`, in `$VIRTUAL_ENV`,
//!    the user's site-packages, the system's site/dist-packages and virtualenvs under `/opt`
//!    (where a PyTorch install keeps its cuDNN).
//!
//! Loading never panics and never crashes the process: before `dlopen`, each file is checked to
//! be a complete shared object for this machine that defines cuDNN's symbols (read from the
//! file, so a foreign library's code never runs), and before cuDNN's first call, the
//! sub-libraries its graph API loads lazily are found and checked the same way, each for the
//! symbols of its own kind ([`SUBLIBRARY_SYMBOLS`]), and so is the CUDA
//! driver library cuDNN opens ([`DRIVER_LIBRARY`]). Every failure is a [`LoadError`] that
//! names the file and why it was rejected.

use crate::bindings::{cudnnStatus_t, CudnnLib};
use crate::status::c_str_lossy;
use cudnn_cbr_runtime::preflight;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Oldest cuDNN the bindings accept (the graph API as bound here is cuDNN 9's).
pub const MIN_VERSION: usize = 9_00_00;
/// First cuDNN that builds plans without a GPU (device-properties descriptors).
pub const DEVICELESS_MIN_VERSION: usize = 9_08_00;

const LIB_NAME: &str = "libcudnn.so.9";

/// The CUDA driver library cuDNN's graph library opens by name.
pub(crate) const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// The sub-libraries cuDNN's graph API loads: the backend itself, the heuristics, and both
/// engine families. (ops, cnn, adv, ext and tensor_ir serve the legacy and other APIs.)
pub const GRAPH_SUBLIBRARIES: [&str; 4] = [
    "libcudnn_graph.so.9",
    "libcudnn_heuristic.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
];

/// The sub-library that holds the backend API; it exports its own `cudnnGetVersion`.
pub const GRAPH_LIBRARY: &str = GRAPH_SUBLIBRARIES[0];

/// The dynamic symbols each graph-API sub-library must define, by file name: the graph
/// library's entry points the shim calls first, and the marker symbol the heuristics and
/// engine libraries export for cuDNN's own loader. A foreign shared object under one of
/// these names (right machine, wrong library) lacks them, and cuDNN would abort in its first
/// call or silently find no engine.
pub const SUBLIBRARY_SYMBOLS: [(&str, &[&str]); 4] = [
    (
        GRAPH_SUBLIBRARIES[0],
        &[
            "cudnnGetVersion",
            "cudnnBackendCreateDescriptor",
            "cudnnBackendExecute",
        ],
    ),
    (GRAPH_SUBLIBRARIES[1], &["dummyHeuristicSymbol"]),
    (
        GRAPH_SUBLIBRARIES[2],
        &["dummyBackendEnginesPreCompiledSymbol"],
    ),
    (
        GRAPH_SUBLIBRARIES[3],
        &["dummyBackendEnginesRuntimeCompiledSymbol"],
    ),
];

/// One place the loader looked, and why it did not use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadAttempt {
    /// A file path, or a bare library name handed to the system loader.
    pub candidate: String,
    /// Why it failed (file missing, dlopen error, missing symbol, ...).
    pub reason: String,
}

impl fmt::Display for LoadAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.candidate, self.reason)
    }
}

/// Why cuDNN could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// No candidate could be loaded; each attempt says why.
    #[error("cuDNN not found (set CUDNN_LIB_DIR to the folder holding {LIB_NAME}); tried:\n{}",
        attempts.iter().map(|a| format!("  - {a}")).collect::<Vec<_>>().join("\n"))]
    NotFound {
        /// Every candidate, in search order.
        attempts: Vec<LoadAttempt>,
    },
    /// A library loaded but reports a version older than [`MIN_VERSION`].
    #[error("cuDNN at {path} is version {version}; cudnn-cbr needs 9.0 or newer")]
    TooOld {
        /// Where it was loaded from.
        path: String,
        /// `cudnnGetVersion()`.
        version: usize,
    },

    /// A cuDNN whose sub-libraries are missing or unusable; calling into it would abort.
    #[error("cuDNN at {path} cannot be used: its sub-library {sublibrary} {reason}")]
    Incomplete {
        /// Where the main library was found.
        path: String,
        /// The sub-library's file name, e.g. `libcudnn_graph.so.9`.
        sublibrary: String,
        /// What is wrong with it (not found where the shim looks, truncated, ...).
        reason: String,
    },
    /// The CUDA driver library cuDNN opens (even to plan without a GPU) is not where the
    /// system loader looks, or is not a usable shared object.
    #[error(
        "cuDNN at {path} cannot be used: the CUDA driver library {DRIVER_LIBRARY} {reason} \
         (cuDNN opens it even to plan without a GPU: install the NVIDIA driver, or put a \
         {DRIVER_LIBRARY} on LD_LIBRARY_PATH)"
    )]
    NoDriver {
        /// Where the main library was found.
        path: String,
        /// What is wrong (not found where the loader looks, truncated, ...).
        reason: String,
    },
    /// The main library and its graph sub-library are different cuDNN versions.
    #[error(
        "cuDNN at {path} is version {version} but its sub-library {sublibrary} is {sub_version}; \
         install matching libraries"
    )]
    VersionMismatch {
        /// Where the main library was found.
        path: String,
        /// `cudnnGetVersion()` of the main library.
        version: usize,
        /// The sub-library's path.
        sublibrary: String,
        /// Its own `cudnnGetVersion()`.
        sub_version: usize,
    },
}

/// A loaded cuDNN: the function table plus where it came from and its version.
pub struct Library {
    /// The bound functions.
    pub api: CudnnLib,
    path: String,
    version: usize,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl Library {
    /// Where the library was loaded from (a path, or the name the system loader resolved).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `cudnnGetVersion()`, e.g. 92801 for 9.28.1.
    pub fn version(&self) -> usize {
        self.version
    }

    /// (major, minor, patch) of [`Library::version`].
    pub fn version_triple(&self) -> (usize, usize, usize) {
        (
            self.version / 10_000,
            (self.version / 100) % 100,
            self.version % 100,
        )
    }

    /// Whether this cuDNN can build plans deviceless (from device-properties JSON, ≥ 9.8).
    pub fn supports_deviceless(&self) -> bool {
        self.version >= DEVICELESS_MIN_VERSION
    }

    /// `cudnnGetErrorString(status)`.
    pub fn error_string(&self, status: cudnnStatus_t) -> String {
        // SAFETY: cudnnGetErrorString accepts any status value and returns a static string.
        unsafe { c_str_lossy((self.api.cudnnGetErrorString)(status)) }
    }

    /// `cudnnGetLastErrorString()`: cuDNN's explanation of the most recent failure on this thread.
    pub fn last_error_string(&self) -> String {
        let mut buf = vec![0 as std::os::raw::c_char; 4096];
        // SAFETY: buf is writable for buf.len() bytes; cuDNN writes at most max_size bytes
        // including the terminating NUL.
        unsafe { (self.api.cudnnGetLastErrorString)(buf.as_mut_ptr(), buf.len()) };
        *buf.last_mut().expect("buffer is not empty") = 0;
        // SAFETY: buf is NUL-terminated (last byte forced to 0) and outlives the call.
        unsafe { c_str_lossy(buf.as_ptr()) }
    }
}

/// Where to look for cuDNN. [`SearchPaths::from_env`] is the documented default order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SearchPaths {
    /// Explicit folder (from `CUDNN_LIB_DIR`), tried first.
    pub lib_dir: Option<PathBuf>,
    /// Whether to ask the system loader for `libcudnn.so.9` by name.
    pub system_loader: bool,
    /// `site-packages` folders to look in for `nvidia/cudnn/lib/libcudnn.so.9`, in order.
    pub site_packages: Vec<PathBuf>,
}

impl SearchPaths {
    /// The default search order, read from the environment.
    pub fn from_env() -> Self {
        SearchPaths {
            lib_dir: std::env::var_os("CUDNN_LIB_DIR")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            system_loader: true,
            site_packages: cudnn_cbr_runtime::wheels::site_packages_dirs(),
        }
    }

    /// Every candidate, in order: file paths, or the bare name for the system loader.
    pub fn candidates(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(dir) = &self.lib_dir {
            out.push(dir.join(LIB_NAME).display().to_string());
        }
        if self.system_loader {
            out.push(LIB_NAME.to_string());
        }
        for sp in &self.site_packages {
            let p = sp.join("nvidia/cudnn/lib").join(LIB_NAME);
            let p = p.display().to_string();
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }

    /// Tries every candidate in order; the first that loads with every symbol and a new
    /// enough version wins.
    pub fn load(&self) -> Result<Library, LoadError> {
        let mut attempts = Vec::new();
        for candidate in self.candidates() {
            let is_path = candidate.contains('/');
            if is_path && !Path::new(&candidate).exists() {
                attempts.push(LoadAttempt {
                    candidate,
                    reason: "no such file".into(),
                });
                continue;
            }
            match load_from(&candidate) {
                Ok(lib) => return Ok(lib),
                // A cuDNN was found but cannot be used: say so rather than silently taking
                // one from further down the search order.
                Err(LoadError::NotFound { attempts: mut a }) => attempts.append(&mut a),
                Err(other) => return Err(other),
            }
        }
        Err(LoadError::NotFound { attempts })
    }
}

/// Loads cuDNN from one path (or a bare name for the system loader), checking every bound
/// symbol and the version. Does not touch the process-wide library of [`library()`].
pub fn load_from(candidate: impl AsRef<Path>) -> Result<Library, LoadError> {
    let candidate = candidate.as_ref();
    let shown = candidate.display().to_string();
    let fail = |reason: String| LoadError::NotFound {
        attempts: vec![LoadAttempt {
            candidate: shown.clone(),
            reason,
        }],
    };
    // A bare name is checked where the system loader will find it (when that can be told).
    let file = if shown.contains('/') {
        Some(candidate.to_path_buf())
    } else {
        preflight::resolve_by_name(&shown)
    };
    if let Some(file) = &file {
        preflight::check_shared_object(file).map_err(fail)?;
        // Read from the file, so a foreign library's initialisers never run.
        let missing = preflight::missing_symbols(file, &["cudnnGetVersion"]).map_err(fail)?;
        if !missing.is_empty() {
            return Err(fail(format!(
                "not cuDNN: it does not define {}",
                missing.join(", ")
            )));
        }
    }
    // SAFETY: the file is a complete shared object for this machine (checked above, so the
    // dynamic loader maps no byte past its end); loading runs its initialisers, which are
    // sound to run on any thread. CudnnLib checks that every bound symbol exists
    // (require_all), so no call can reach a missing function.
    let api = unsafe { CudnnLib::new(candidate.as_os_str()) }.map_err(|e| fail(e.to_string()))?;
    let main = file.or_else(|| loaded_path(&api)).ok_or_else(|| {
        fail("loaded, but its file could not be located to check its sub-libraries".into())
    })?;
    let graph = check_sublibraries(&main, &shown)?;
    check_driver(&graph, &shown)?;
    // SAFETY: cudnnGetVersion takes no arguments and has no preconditions; the sub-libraries
    // it loads were found and checked above (files and symbols).
    let version = unsafe { (api.cudnnGetVersion)() };
    let sub_version = sublibrary_version(&graph).map_err(|reason| LoadError::Incomplete {
        path: shown.clone(),
        sublibrary: GRAPH_LIBRARY.into(),
        reason,
    })?;
    if sub_version != version {
        return Err(LoadError::VersionMismatch {
            path: shown,
            version,
            sublibrary: graph.display().to_string(),
            sub_version,
        });
    }
    if version < MIN_VERSION {
        return Err(LoadError::TooOld {
            path: shown,
            version,
        });
    }
    Ok(Library {
        api,
        path: shown,
        version,
    })
}

/// Finds and checks every sub-library the graph API needs; returns the graph library's path.
fn check_sublibraries(main: &Path, shown: &str) -> Result<PathBuf, LoadError> {
    let mut graph = None;
    for name in GRAPH_SUBLIBRARIES {
        let incomplete = |reason: String| LoadError::Incomplete {
            path: shown.to_string(),
            sublibrary: name.to_string(),
            reason,
        };
        let found = preflight::locate_sublibrary(main, name).ok_or_else(|| {
            incomplete(format!(
                "is missing: not in {} nor in the system loader's folders",
                main.parent().unwrap_or(Path::new("/")).display()
            ))
        })?;
        preflight::check_shared_object(&found)
            .map_err(|why| incomplete(format!("at {} is unusable: {why}", found.display())))?;
        let wanted = SUBLIBRARY_SYMBOLS
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(&[][..], |(_, s)| *s);
        let missing = preflight::missing_symbols(&found, wanted)
            .map_err(|why| incomplete(format!("at {} is unusable: {why}", found.display())))?;
        if !missing.is_empty() {
            return Err(incomplete(format!(
                "at {} is not cuDNN's {name}: it does not define {}",
                found.display(),
                missing.join(", ")
            )));
        }
        graph.get_or_insert(found);
    }
    Ok(graph.expect("the list of sub-libraries is not empty"))
}

/// Checks that the CUDA driver library is where the graph library at `graph` will open it
/// (beside it, else the system loader's folders) and is a complete shared object: without it
/// every cuDNN call fails later with a status that blames whatever it was given.
fn check_driver(graph: &Path, shown: &str) -> Result<(), LoadError> {
    let no_driver = |reason: String| LoadError::NoDriver {
        path: shown.to_string(),
        reason,
    };
    match preflight::locate_sublibrary(graph, DRIVER_LIBRARY) {
        Some(found) => preflight::check_shared_object(&found)
            .map_err(|why| no_driver(format!("at {} is unusable: {why}", found.display()))),
        // The loader's cache may know folders its configuration does not list: ask it.
        // SAFETY: is_culib_present only tries to dlopen the driver library by name (what
        // cuDNN itself will do).
        None if unsafe { cudarc::driver::sys::is_culib_present() } => Ok(()),
        None => Err(no_driver(format!(
            "is missing: not beside {} nor in the system loader's folders",
            graph.display()
        ))),
    }
}

/// The graph sub-library's own `cudnnGetVersion()`.
fn sublibrary_version(path: &Path) -> Result<usize, String> {
    // SAFETY: the file was checked to be a complete shared object; the graph library's
    // initialisers are cuDNN's own (already about to be loaded by the main library).
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|e| format!("at {} does not load: {e}", path.display()))?;
    // SAFETY: the symbol is cuDNN's `size_t cudnnGetVersion(void)`.
    let get: libloading::Symbol<unsafe extern "C" fn() -> usize> =
        unsafe { lib.get(b"cudnnGetVersion\0") }
            .map_err(|e| format!("at {} has no version: {e}", path.display()))?;
    // SAFETY: cudnnGetVersion takes no arguments and has no preconditions.
    let version = unsafe { get() };
    // Keep it loaded: the main library will use this very copy.
    std::mem::forget(lib);
    Ok(version)
}

/// The file the dynamic loader resolved `api` from (for a library loaded by bare name).
fn loaded_path(api: &CudnnLib) -> Option<PathBuf> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    let addr = api.cudnnGetVersion as *const libc::c_void;
    // SAFETY: dladdr only reads the loader's tables for an address inside a loaded object
    // and writes `info`; it is not called through.
    let found = unsafe { libc::dladdr(addr, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while the
    // library stays loaded (it is: `api` holds it).
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(name.to_string_lossy().into_owned());
    path.is_absolute().then_some(path)
}

static LIBRARY: OnceLock<Result<Library, LoadError>> = OnceLock::new();

/// The process-wide cuDNN, loaded on first use with [`SearchPaths::from_env`].
/// Later calls return the same library (or the same error).
///
/// cuDNN opens NVRTC (runtime-compiled engines) and cuBLASLt (heuristics) by name later on;
/// where the loader's path lacks them but pip's CUDA wheels have them, they are loaded from
/// there first ([`cudnn_cbr_runtime::wheels::ensure_loadable`]), as a PyTorch install arranges for itself.
pub fn library() -> Result<&'static Library, LoadError> {
    LIBRARY
        .get_or_init(|| {
            let lib = SearchPaths::from_env().load()?;
            for soname in cudnn_cbr_runtime::wheels::CUDNN_COMPANIONS {
                // A failure here is cuDNN's to report when it needs the library.
                let _ = cudnn_cbr_runtime::wheels::ensure_loadable(soname);
            }
            Ok(lib)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The process-wide library if it has been loaded successfully.
pub(crate) fn loaded() -> Option<&'static Library> {
    LIBRARY.get().and_then(|r| r.as_ref().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_everywhere_is_a_typed_error_listing_each_path() {
        let dir = std::env::temp_dir().join("cudnn-fe-sys-empty-dir");
        std::fs::create_dir_all(&dir).unwrap();
        let paths = SearchPaths {
            lib_dir: Some(dir.clone()),
            system_loader: false,
            site_packages: vec![PathBuf::from("/nonexistent/site-packages")],
        };
        let err = paths.load().unwrap_err();
        let LoadError::NotFound { attempts } = &err else {
            panic!("expected NotFound, got {err:?}");
        };
        assert_eq!(attempts.len(), 2);
        assert!(attempts[0].candidate.starts_with(dir.to_str().unwrap()));
        assert_eq!(attempts[0].reason, "no such file");
        assert!(attempts[1]
            .candidate
            .contains("nvidia/cudnn/lib/libcudnn.so.9"));
        let text = err.to_string();
        assert!(text.contains("CUDNN_LIB_DIR"), "{text}");
        assert!(text.contains("/nonexistent/site-packages"), "{text}");
    }

    #[test]
    fn a_library_without_the_symbols_is_rejected_by_name() {
        // libm exists on every Linux machine and has none of cuDNN's symbols.
        let err = load_from("libm.so.6").unwrap_err();
        let LoadError::NotFound { attempts } = &err else {
            panic!("expected NotFound, got {err:?}");
        };
        assert!(attempts[0].reason.contains("cudnnGetVersion"), "{err}");
    }

    #[test]
    fn a_file_that_is_not_a_library_is_rejected() {
        let dir = std::env::temp_dir().join("cudnn-fe-sys-bogus-lib");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(LIB_NAME), b"not an ELF file").unwrap();
        let paths = SearchPaths {
            lib_dir: Some(dir),
            system_loader: false,
            site_packages: vec![],
        };
        let err = paths.load().unwrap_err();
        let LoadError::NotFound { attempts } = &err else {
            panic!("expected NotFound, got {err:?}");
        };
        assert_eq!(attempts.len(), 1);
        assert_ne!(attempts[0].reason, "no such file");
    }

    #[test]
    fn candidates_follow_the_documented_order() {
        let paths = SearchPaths {
            lib_dir: Some("/x".into()),
            system_loader: true,
            site_packages: vec!["/sp".into(), "/sp".into()],
        };
        assert_eq!(
            paths.candidates(),
            vec![
                "/x/libcudnn.so.9".to_string(),
                "libcudnn.so.9".to_string(),
                "/sp/nvidia/cudnn/lib/libcudnn.so.9".to_string()
            ]
        );
    }
}
