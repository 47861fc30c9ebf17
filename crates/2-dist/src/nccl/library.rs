//! Opening libnccl once per process and resolving the entry points [`super::NcclComm`] calls.

// The crate denies unsafe code everywhere else; FFI into libnccl cannot avoid it.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::nccl::sys::{ncclComm_t, ncclUniqueId};
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use super::{nccl_candidates, nccl_site_packages, NcclCandidate};
use crate::DistError;

// NCCL's C entry points. `ncclResult_t`, `ncclDataType_t` and `ncclRedOp_t` are C enums,
// passed and returned as `int`: a result code this build does not know is then a number,
// never an invalid Rust enum.
type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    ncclComm_t,
    *mut c_void,
) -> c_int;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    ncclComm_t,
    *mut c_void,
) -> c_int;
type CommFn = unsafe extern "C" fn(ncclComm_t) -> c_int;
type AsyncErrorFn = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(ncclComm_t) -> *const c_char;

/// The NCCL library this process uses, opened once ([`nccl_library`]), with the entry points
/// [`super::NcclComm`] calls.
pub struct NcclLibrary {
    pub(super) path: String,
    pub(super) version: i32,
    pub(super) get_unique_id: GetUniqueIdFn,
    pub(super) comm_init_rank: CommInitRankFn,
    pub(super) all_reduce: AllReduceFn,
    pub(super) broadcast: BroadcastFn,
    pub(super) comm_destroy: CommFn,
    pub(super) comm_abort: CommFn,
    pub(super) async_error: AsyncErrorFn,
    pub(super) error_string: ErrorStringFn,
    pub(super) last_error: Option<LastErrorFn>,
    /// Keeps the entry points above valid: the library is never closed.
    _lib: Library,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// The process's NCCL, opened on first use from the first place of
/// [`crate::nccl::nccl_candidates`] that holds a working library (process environment,
/// [`crate::nccl::nccl_site_packages`]); the outcome is kept for the process.
///
/// # Errors
/// [`DistError::NcclUnavailable`], listing every place tried and why each failed.
pub fn nccl_library() -> Result<&'static NcclLibrary, DistError> {
    static LIB: OnceLock<Result<NcclLibrary, DistError>> = OnceLock::new();
    LIB.get_or_init(|| {
        let env = |v: &str| std::env::var(v).ok();
        // The wheel folders are only looked for (python3 only run) when the environment's
        // and the loader's places fail.
        let first = nccl_candidates(env, &[]);
        let tried = match NcclLibrary::open_first(&first) {
            Err(DistError::NcclUnavailable { tried }) => tried,
            done => return done,
        };
        let more: Vec<NcclCandidate> = nccl_candidates(env, &nccl_site_packages())
            .into_iter()
            .filter(|c| !first.contains(c))
            .collect();
        match NcclLibrary::open_first(&more) {
            Err(DistError::NcclUnavailable { tried: t }) => Err(DistError::NcclUnavailable {
                tried: tried.into_iter().chain(t).collect(),
            }),
            done => done,
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl NcclLibrary {
    /// Opens the first of `candidates` that is a working NCCL (its entry points resolve and
    /// `ncclGetVersion` answers). A file is checked to be a complete shared object before it
    /// is opened. Each library opened stays loaded for the process.
    ///
    /// # Errors
    /// [`DistError::NcclUnavailable`] naming every candidate with why it failed.
    pub fn open_first(candidates: &[NcclCandidate]) -> Result<NcclLibrary, DistError> {
        let mut tried = Vec::new();
        for c in candidates {
            match Self::open(c) {
                Ok(lib) => return Ok(lib),
                Err(why) => tried.push(format!("{c}: {why}")),
            }
        }
        if tried.is_empty() {
            tried.push("(no candidate places)".to_string());
        }
        Err(DistError::NcclUnavailable { tried })
    }

    fn open(c: &NcclCandidate) -> Result<NcclLibrary, String> {
        let lib = match c {
            NcclCandidate::Path(p) => {
                if !p.exists() {
                    return Err("no such file".into());
                }
                cudnn_cbr_runtime::preflight::check_shared_object(p)?;
                // SAFETY: `p` is a complete ELF shared object (checked above) in a place
                // named for NCCL; opening it runs NCCL's initialisers, which are sound on any
                // thread. The handle is kept for the process (never closed) so the entry
                // points resolved from it stay valid.
                unsafe { Library::open(Some(p), RTLD_NOW | RTLD_GLOBAL) }
            }
            NcclCandidate::Name(n) => {
                // Checked where the loader will find it (when that can be told): a FIFO
                // there would block dlopen.
                if let Some(p) = cudnn_cbr_runtime::preflight::resolve_by_name(n) {
                    cudnn_cbr_runtime::preflight::check_shared_object(&p)
                        .map_err(|why| format!("{}: {why}", p.display()))?;
                }
                // SAFETY: as above, for NCCL's names on the loader's path.
                unsafe { Library::open(Some(n), RTLD_NOW | RTLD_GLOBAL) }
            }
        }
        .map_err(|e| e.to_string())?;
        /// One entry point; its type is the one NCCL's `nccl.h` declares.
        fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
            // SAFETY: every `T` this is called with below is the `extern "C"` signature
            // `nccl.h` (2.x) declares for `name`; the library outlives the copied pointer
            // (it is stored next to it and never closed).
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| format!("missing {name}: {e}"))
        }
        let get_version: GetVersionFn = sym(&lib, "ncclGetVersion")?;
        let mut version: c_int = 0;
        // SAFETY: `ncclGetVersion` writes one int through the pointer, a live local.
        let code = unsafe { get_version(&mut version) };
        if code != 0 {
            return Err(format!("ncclGetVersion returned {code}"));
        }
        if nccl_major(version) < 2 {
            return Err(format!("NCCL version code {version} is older than 2.x"));
        }
        Ok(NcclLibrary {
            path: c.to_string(),
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank: sym(&lib, "ncclCommInitRank")?,
            all_reduce: sym(&lib, "ncclAllReduce")?,
            broadcast: sym(&lib, "ncclBroadcast")?,
            comm_destroy: sym(&lib, "ncclCommDestroy")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            async_error: sym(&lib, "ncclCommGetAsyncError")?,
            error_string: sym(&lib, "ncclGetErrorString")?,
            last_error: sym(&lib, "ncclGetLastError").ok(),
            _lib: lib,
        })
    }

    /// Where the library was found (a path, or a name the loader resolved).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NCCL's version code (`ncclGetVersion`: 22703 for 2.27.3).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// A fresh unique id (`ncclGetUniqueId`).
    pub(crate) fn unique_id(&self) -> Result<[u8; 128], DistError> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: `ncclGetUniqueId` fills the 128-byte struct behind the pointer, a live local.
        let code = unsafe { (self.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", code, None)?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// `Ok` for `ncclSuccess`; else NCCL's message for `code` (and the communicator's last
    /// error, where NCCL has `ncclGetLastError`).
    pub(super) fn check(
        &self,
        op: &'static str,
        code: c_int,
        comm: Option<ncclComm_t>,
    ) -> Result<(), DistError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: `ncclGetErrorString` returns a static NUL-terminated string (or null) for
        // any code.
        let mut message = unsafe { c_str((self.error_string)(code)) };
        if let Some(last) = self.last_error {
            // SAFETY: `comm` is null or a live communicator of this library; NCCL returns a
            // NUL-terminated string it owns (or null), copied right away.
            let detail = unsafe { c_str(last(comm.unwrap_or(std::ptr::null_mut()))) };
            if !detail.is_empty() {
                message = format!("{message}: {detail}");
            }
        }
        Err(DistError::Nccl {
            op,
            code: Some(code),
            message,
        })
    }
}

/// The major version of an NCCL version code (`22703` for 2.27.3; before 2.9, `2408` for
/// 2.4.8).
pub(super) fn nccl_major(code: i32) -> i32 {
    if code >= 10_000 {
        code / 10_000
    } else {
        code / 1000
    }
}

/// A copy of a C string NCCL returned; empty for null.
///
/// # Safety
/// `p` is null or points at a NUL-terminated string that lives through the call.
unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated, by the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::NcclId;

    #[test]
    fn version_codes_of_both_styles_give_the_major() {
        assert_eq!(nccl_major(22703), 2);
        assert_eq!(nccl_major(2408), 2);
        assert_eq!(nccl_major(1999), 1);
    }

    #[test]
    fn a_file_that_is_not_nccl_is_named_with_why() {
        let dir = std::env::temp_dir().join(format!("amp-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("libnccl.so.2");
        std::fs::write(&fake, b"not an ELF file").unwrap();
        let missing = dir.join("nowhere/libnccl.so.2");
        let err = NcclLibrary::open_first(&[
            NcclCandidate::Path(missing.clone()),
            NcclCandidate::Path(fake.clone()),
        ])
        .unwrap_err();
        let DistError::NcclUnavailable { tried } = &err else {
            panic!("{err}");
        };
        assert_eq!(tried.len(), 2, "{tried:?}");
        assert!(
            tried[0].starts_with(&missing.display().to_string()),
            "{tried:?}"
        );
        assert!(tried[0].contains("no such file"), "{tried:?}");
        assert!(
            tried[1].starts_with(&fake.display().to_string()),
            "{tried:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("nvidia-nccl-cu13") && text.contains("NCCL_LIB_DIR"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_process_library_is_found_or_its_absence_is_typed() {
        // Either outcome is checked: a found library answers with a 2.x version and makes
        // ids; an absent one lists the loader names and says how to install it.
        match nccl_library() {
            Ok(lib) => {
                assert_eq!(nccl_major(lib.version()), 2, "{lib:?}");
                let a = NcclId::generate().unwrap();
                let b = NcclId::generate().unwrap();
                assert_ne!(a, b);
            }
            Err(e) => {
                let DistError::NcclUnavailable { tried } = &e else {
                    panic!("{e}");
                };
                assert!(
                    tried
                        .iter()
                        .any(|t| t.starts_with("libnccl.so.2 (loader path)")),
                    "{tried:?}"
                );
                assert!(matches!(
                    NcclId::generate(),
                    Err(DistError::NcclUnavailable { .. })
                ));
                assert!(
                    e.to_string().contains("pip install nvidia-nccl-cu13"),
                    "{e}"
                );
            }
        }
    }
}
