//! NCCL: where the library is found, the communicator id ranks share, and [`NcclComm`],
//! the [`Collective`](crate::Collective) over device buffers.
//!
//! # Finding libnccl
//! [`nccl_library`] opens NCCL once per process, from the first of ([`nccl_candidates`]):
//! 1. `$NCCL_LIB_DIR/libnccl.so.2` (and `libnccl.so`) when [`NCCL_LIB_DIR_ENV`] is set;
//!    `$CUDNN_CBR_NCCL` ([`NCCL_PATH_ENV`]): the library file itself, or its folder;
//! 2. the loader's path, by name: `libnccl.so.2`, then `libnccl.so`;
//! 3. the `nvidia-nccl-cu13` pip wheel: `<site-packages>/nvidia/nccl/lib/libnccl.so.2` (or
//!    `nvidia/cu13/lib`), for the site-packages of the active virtualenv, the user's, the
//!    system's, virtualenvs under `/opt/*/{.venv,venv}`, and `python3`'s `purelib`.
//!
//! The library is opened globally and stays loaded for the process, so that whatever opens
//! `libnccl.so.2` by name later (a PyTorch in the same process) gets the same copy. When none
//! of these works the error ([`DistError::NcclUnavailable`]) lists every place tried and why.
//!
//! The NCCL entry points are resolved from the file that was found, not through cudarc's
//! loader: cudarc 0.19 opens NCCL only under the names `libnccl.so` and `libnccl.so.<CUDA
//! major>` (never `libnccl.so.2`, the only name the wheel ships) and panics when that fails.
//! cudarc's NCCL *types* are used (its `nccl` feature), so [`NcclComm`] takes the same element
//! types as `cudarc::nccl` ([`cudarc::nccl::NcclType`]: f32, f16, bf16, f64, u32, …).
//!
//! # The communicator id
//! Rank 0 makes an [`NcclId`] ([`NcclId::generate`], NCCL's `ncclGetUniqueId`; it needs the
//! library, not a GPU) and every rank must get the same 128 bytes before
//! [`NcclComm::new`]: [`crate::bootstrap::exchange_id`] ships them over a TCP store or a
//! shared file ([`NcclId::to_bytes`] / [`NcclId::from_bytes`]; [`NcclId::to_hex`] /
//! [`NcclId::from_hex`] for an environment variable or a log line).
//!
//! ```no_run
//! use std::time::Duration;
//! use cudnn_cbr_dist::bootstrap::{exchange_id, LaunchEnv};
//! use cudnn_cbr_dist::nccl::{NcclComm, NcclId};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let env = LaunchEnv::from_env()?;
//! let bytes = exchange_id(&env, || Ok(NcclId::generate()?.to_bytes()), Duration::from_secs(300))?;
//! let ctx = cudnn_cbr_runtime::cuda_device(env.local_rank.unwrap_or(0))?;
//! let comm_stream = ctx.new_stream()?;
//! let mut comm = NcclComm::new(comm_stream, env.rank, env.world, &NcclId::from_bytes(&bytes)?)?;
//! # let _ = &mut comm;
//! # Ok(())
//! # }
//! ```

use std::path::{Path, PathBuf};

use crate::DistError;

// The unsafe half: the library's entry points and the communicator.
mod comm;
mod library;

pub use comm::{NcclAbort, NcclComm};
pub use library::{nccl_library, NcclLibrary};

/// The environment variable naming the folder that holds `libnccl.so.2`, tried first.
pub const NCCL_LIB_DIR_ENV: &str = "NCCL_LIB_DIR";

/// The environment variable naming the NCCL library file (or its folder), tried after
/// [`NCCL_LIB_DIR_ENV`].
pub const NCCL_PATH_ENV: &str = "CUDNN_CBR_NCCL";

/// The names NCCL is looked up under on the loader's path, in order.
pub const NCCL_SONAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Where the NCCL wheels put the library, under a site-packages folder.
const WHEEL_LIB_DIRS: [&str; 2] = ["nvidia/nccl/lib", "nvidia/cu13/lib"];

/// How many bytes an NCCL unique id has (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_ID_BYTES: usize = 128;

/// One place to look for NCCL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NcclCandidate {
    /// A file, opened by its path.
    Path(PathBuf),
    /// A name the system loader resolves (its path, `LD_LIBRARY_PATH`, the ld cache).
    Name(&'static str),
}

impl std::fmt::Display for NcclCandidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NcclCandidate::Path(p) => write!(f, "{}", p.display()),
            NcclCandidate::Name(n) => write!(f, "{n} (loader path)"),
        }
    }
}

/// The places NCCL is looked for, in order (see the module docs): the variables read
/// through `var` (so that tests need not touch the process environment), the loader's
/// names, then `<sp>/nvidia/nccl/lib/libnccl.so.2` and `<sp>/nvidia/cu13/lib/libnccl.so.2`
/// for each folder of `site_packages`.
pub fn nccl_candidates(
    var: impl Fn(&str) -> Option<String>,
    site_packages: &[PathBuf],
) -> Vec<NcclCandidate> {
    let mut out = Vec::new();
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(NCCL_LIB_DIR_ENV) {
        out.extend(
            NCCL_SONAMES
                .iter()
                .map(|n| NcclCandidate::Path(dir.join(n))),
        );
    }
    if let Some(path) = set(NCCL_PATH_ENV) {
        if path.is_dir() {
            out.extend(
                NCCL_SONAMES
                    .iter()
                    .map(|n| NcclCandidate::Path(path.join(n))),
            );
        } else {
            out.push(NcclCandidate::Path(path));
        }
    }
    out.extend(NCCL_SONAMES.iter().map(|n| NcclCandidate::Name(n)));
    for sp in site_packages {
        for dir in WHEEL_LIB_DIRS {
            let p = NcclCandidate::Path(sp.join(dir).join(NCCL_SONAMES[0]));
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// The site-packages folders the NCCL wheel is looked for in: those
/// [`cudnn_cbr_runtime::wheels::site_packages_dirs`] knows (active virtualenv, user, system,
/// `/opt` virtualenvs), then `python3`'s `purelib` when `python3` runs.
pub fn nccl_site_packages() -> Vec<PathBuf> {
    let mut dirs = cudnn_cbr_runtime::wheels::site_packages_dirs();
    if let Some(purelib) = python_purelib() {
        if !dirs.contains(&purelib) {
            dirs.push(purelib);
        }
    }
    dirs
}

/// `python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'`, if it answers
/// with a folder.
fn python_purelib() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let dir = PathBuf::from(text.trim());
    Path::new(&dir).is_dir().then_some(dir)
}

/// The id every rank of one NCCL communicator is created with: 128 opaque bytes made by
/// rank 0 ([`NcclId::generate`]) and shipped to the others (bytes or hex).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; NCCL_ID_BYTES]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id holds rank 0's address; its first bytes are enough to tell ids apart.
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id from NCCL (`ncclGetUniqueId`): call it on rank 0 only.
    ///
    /// # Errors
    /// [`DistError::NcclUnavailable`] without the library; [`DistError::Nccl`] when NCCL
    /// fails (e.g. no usable network interface).
    pub fn generate() -> Result<Self, DistError> {
        nccl_library()?.unique_id().map(NcclId)
    }

    /// The id's bytes, as NCCL made them.
    pub fn to_bytes(&self) -> [u8; NCCL_ID_BYTES] {
        self.0
    }

    /// The id from its bytes.
    ///
    /// # Errors
    /// [`DistError::InvalidId`] unless `bytes` has exactly [`NCCL_ID_BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DistError> {
        let arr: [u8; NCCL_ID_BYTES] = bytes.try_into().map_err(|_| DistError::InvalidId {
            problem: format!("{} bytes, expected {NCCL_ID_BYTES}", bytes.len()),
        })?;
        Ok(NcclId(arr))
    }

    /// The id as 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        use std::fmt::Write;
        self.0
            .iter()
            .fold(String::with_capacity(2 * NCCL_ID_BYTES), |mut s, b| {
                let _ = write!(s, "{b:02x}");
                s
            })
    }

    /// The id from 256 hex digits (either case).
    ///
    /// # Errors
    /// [`DistError::InvalidId`] for another length or a character that is not a hex digit.
    pub fn from_hex(hex: &str) -> Result<Self, DistError> {
        let hex = hex.trim();
        if hex.len() != 2 * NCCL_ID_BYTES {
            return Err(DistError::InvalidId {
                problem: format!("{} hex digits, expected {}", hex.len(), 2 * NCCL_ID_BYTES),
            });
        }
        let mut out = [0u8; NCCL_ID_BYTES];
        for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
            let digits = std::str::from_utf8(pair).ok();
            out[i] = digits
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(|| DistError::InvalidId {
                    problem: format!(
                        "not a hex byte at offset {}: {:?}",
                        2 * i,
                        String::from_utf8_lossy(pair)
                    ),
                })?;
        }
        Ok(NcclId(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> NcclId {
        let mut b = [0u8; NCCL_ID_BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(37).wrapping_add(5);
        }
        NcclId(b)
    }

    #[test]
    fn an_id_survives_bytes_and_hex() {
        let id = id();
        assert_eq!(NcclId::from_bytes(&id.to_bytes()).unwrap(), id);
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert!(hex.starts_with("052a4f74"), "{hex}");
        assert_eq!(NcclId::from_hex(&hex).unwrap(), id);
        assert_eq!(NcclId::from_hex(&hex.to_uppercase()).unwrap(), id);
    }

    #[test]
    fn a_bad_id_is_a_typed_error() {
        let e = NcclId::from_bytes(&[0u8; 127]).unwrap_err();
        assert!(
            matches!(&e, DistError::InvalidId { problem } if problem.contains("127 bytes")),
            "{e}"
        );
        let e = NcclId::from_hex("00ff").unwrap_err();
        assert!(e.to_string().contains("4 hex digits"), "{e}");
        let mut hex = id().to_hex();
        hex.replace_range(10..12, "zz");
        let e = NcclId::from_hex(&hex).unwrap_err();
        assert!(e.to_string().contains("offset 10"), "{e}");
        // A multi-byte character is not a panic at a char boundary.
        let odd = format!("é{}", &id().to_hex()[2..]);
        assert!(NcclId::from_hex(&odd).is_err());
    }

    #[test]
    fn candidates_follow_the_documented_order() {
        let vars = |v: &str| match v {
            NCCL_LIB_DIR_ENV => Some("/x/nccl".to_string()),
            NCCL_PATH_ENV => Some("/y/libnccl.so.2.27".to_string()),
            _ => None,
        };
        let sp = [PathBuf::from("/venv/site-packages")];
        let c = nccl_candidates(vars, &sp);
        let text: Vec<String> = c.iter().map(|c| c.to_string()).collect();
        assert_eq!(
            text,
            [
                "/x/nccl/libnccl.so.2",
                "/x/nccl/libnccl.so",
                "/y/libnccl.so.2.27",
                "libnccl.so.2 (loader path)",
                "libnccl.so (loader path)",
                "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2",
                "/venv/site-packages/nvidia/cu13/lib/libnccl.so.2",
            ]
        );
        // Unset or empty variables add nothing.
        let none = nccl_candidates(|_| Some(String::new()), &[]);
        assert_eq!(
            none,
            [
                NcclCandidate::Name("libnccl.so.2"),
                NcclCandidate::Name("libnccl.so")
            ]
        );
    }
}
