//! CUDA libraries and headers from pip's wheels (`site-packages/nvidia/...`), for processes
//! whose loader path does not name them: a PyTorch virtualenv carries cuDNN, NVRTC, cuBLAS and
//! the CUDA headers this way, and PyTorch loads them from there itself.

// Loading a wheel's library runs its initialisers: each call's contract is stated where it is made.
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};

/// The libraries cuDNN opens by name after it is loaded: NVRTC (runtime-compiled engines,
/// and amp's kernels) and cuBLASLt (heuristics). These are the ones [`ensure_loadable`]
/// accepts.
pub const CUDNN_COMPANIONS: [&str; 2] = ["libnvrtc.so.13", "libcublasLt.so.13"];

/// Where the CUDA 13 wheels put their files, under a site-packages folder.
const CUDA_WHEEL_DIR: &str = "nvidia/cu13";

/// site-packages folders where pip puts the nvidia wheels: the active virtualenv, the user's,
/// the system's, and virtualenvs under /opt.
pub fn site_packages_dirs() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        prefixes.push(PathBuf::from(venv));
    }
    if let Some(home) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.push("/usr/local".into());
    prefixes.push("/usr".into());
    if let Ok(entries) = std::fs::read_dir("/opt") {
        let mut opt: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .flat_map(|e| [e.path().join(".venv"), e.path().join("venv"), e.path()])
            .collect();
        opt.sort();
        prefixes.extend(opt);
    }
    let mut out = Vec::new();
    for prefix in prefixes {
        for lib in ["lib", "lib64"] {
            let Ok(entries) = std::fs::read_dir(prefix.join(lib)) else {
                continue;
            };
            let mut pythons: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .map(|e| e.path())
                .collect();
            pythons.sort();
            for py in pythons.into_iter().rev() {
                for sub in ["site-packages", "dist-packages"] {
                    let sp = py.join(sub);
                    if sp.is_dir() && !out.contains(&sp) {
                        out.push(sp);
                    }
                }
            }
        }
    }
    out
}

/// The CUDA 13 wheel folders (`<site-packages>/nvidia/cu13`) that exist, in search order.
pub fn cuda_wheel_dirs() -> Vec<PathBuf> {
    wheel_dirs_in(&site_packages_dirs())
}

fn wheel_dirs_in(site_packages: &[PathBuf]) -> Vec<PathBuf> {
    site_packages
        .iter()
        .map(|sp| sp.join(CUDA_WHEEL_DIR))
        .filter(|d| d.is_dir())
        .collect()
}

/// The first `<wheel dir>/lib/<soname>` that exists.
fn find_in(soname: &str, wheel_dirs: &[PathBuf]) -> Option<PathBuf> {
    wheel_dirs
        .iter()
        .map(|d| d.join("lib").join(soname))
        .find(|p| p.is_file())
}

/// Makes `soname` (`"libnvrtc.so.13"` or `"libcublasLt.so.13"`) loadable by name in this
/// process: `Ok(None)` when the system loader already finds it (it then stays loaded); else, when a CUDA wheel has it, loads it from there
/// (globally, for the life of the process, so that a later `dlopen` by name gets this copy)
/// and returns its path.
///
/// # Errors
/// Why neither worked, naming the wheel folders looked in; any other name is refused.
pub fn ensure_loadable(soname: &str) -> Result<Option<PathBuf>, String> {
    if !CUDNN_COMPANIONS.contains(&soname) {
        return Err(format!(
            "{soname} is not one of the CUDA libraries loaded from wheels ({})",
            CUDNN_COMPANIONS.join(", ")
        ));
    }
    // SAFETY: `soname` is one of NVIDIA's CUDA libraries (checked above), whose initialisers
    // are sound to run on any thread; nothing is called through the handle, which is kept
    // (the library stays loaded for whoever asked for it next).
    if let Ok(lib) = unsafe { libloading::Library::new(soname) } {
        std::mem::forget(lib);
        return Ok(None);
    }
    let dirs = cuda_wheel_dirs();
    let Some(path) = find_in(soname, &dirs) else {
        let looked: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        return Err(format!(
            "{soname} is not on the loader path nor in a CUDA wheel (looked in: {})",
            if looked.is_empty() {
                "no wheel folders".into()
            } else {
                looked.join(", ")
            }
        ));
    };
    load_globally(&path)?;
    Ok(Some(path))
}

fn load_globally(path: &Path) -> Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // A truncated file would crash dlopen; name it instead.
    crate::preflight::check_shared_object(path)
        .map_err(|why| format!("{}: {why}", path.display()))?;
    // SAFETY: as above; the library stays loaded for the rest of the process (the handle is
    // deliberately leaked) so the addresses later users resolve never go away.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("{}: {e}", path.display()))?;
    std::mem::forget(lib);
    Ok(())
}

/// The CUDA headers' folders in the wheels (`<wheel dir>/include`) that hold `header`.
pub fn cuda_wheel_include_dirs(header: &str) -> Vec<PathBuf> {
    cuda_wheel_dirs()
        .into_iter()
        .map(|d| d.join("include"))
        .filter(|d| d.join(header).is_file())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wheel_library_is_found_in_the_first_site_packages_that_has_it() {
        let root = std::env::temp_dir().join(format!("cudnn-fe-sys-wheels-{}", std::process::id()));
        let (a, b) = (root.join("a/site-packages"), root.join("b/site-packages"));
        std::fs::create_dir_all(b.join("nvidia/cu13/lib")).unwrap();
        std::fs::create_dir_all(&a).unwrap();
        std::fs::write(b.join("nvidia/cu13/lib/libnvrtc.so.13"), b"").unwrap();
        let dirs = wheel_dirs_in(&[a.clone(), b.clone()]);
        assert_eq!(dirs, vec![b.join("nvidia/cu13")]);
        assert_eq!(
            find_in("libnvrtc.so.13", &dirs),
            Some(b.join("nvidia/cu13/lib/libnvrtc.so.13"))
        );
        assert_eq!(find_in("libcublasLt.so.13", &dirs), None);
        // Not a library: loading it is an error that names the file, not a panic.
        let err = load_globally(&b.join("nvidia/cu13/lib/libnvrtc.so.13")).unwrap_err();
        assert!(err.contains("libnvrtc.so.13"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn only_the_cuda_companions_are_loaded() {
        let err = ensure_loadable("libc.so.6").unwrap_err();
        assert!(err.contains("not one of the CUDA libraries"), "{err}");
        // NVRTC is on the loader path where the test libraries are set up (.deps/env.sh);
        // elsewhere it is found in a wheel or the error names where it was looked for.
        match ensure_loadable("libnvrtc.so.13") {
            Ok(_) => {}
            Err(e) => assert!(e.contains("libnvrtc.so.13"), "{e}"),
        }
    }
}
