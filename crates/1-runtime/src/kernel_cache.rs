//! A disk cache of compiled kernels: NVRTC's output kept across processes, so a run's first
//! step does not wait for the runtime compiler once the same kernels have been built for the
//! same architecture with the same NVRTC.
//!
//! An entry is one file named by what it holds and a 64-bit key (FNV-1a over everything the
//! compilation depends on: callers pass the full program text, every compiler option, the
//! architecture and the NVRTC version, see [`KernelCache::key`]). The file repeats the key and
//! ends with a checksum; a file that does not match is rebuilt and replaced. The checksum
//! catches accidents (a truncated or damaged file), not edits.
//!
//! What keeps an edited entry out is who can write it. As ssh does with `~/.ssh`, the folder
//! is used only when it and the folders above it are owned by this user or root and not
//! writable by group or others, and an entry is read only when it is owned by this user or
//! root and not writable by group or others ([`crate::untrusted::check_private_folder`]); a
//! folder that fails is reported once on stderr and the kernels are compiled and not cached.
//! An entry in a trusted folder is trusted as the user's own file, as ssh trusts `~/.ssh`:
//! whoever can write it could already change what the user runs. New folders are made `0700`
//! and entries written `0600`, through a temporary file of the writer's own renamed into
//! place, so a reader never sees half a file; a failed write leaves the compiled kernels in use
//! (only the next run pays).
//!
//! Where: `CUDNN_CBR_KERNEL_CACHE` (a folder; `off` turns the cache off), else
//! `$XDG_CACHE_HOME/cudnn-cbr/kernels`, else `~/.cache/cudnn-cbr/kernels`.

#![forbid(unsafe_code)]

use crate::untrusted::{
    check_private_folder, create_private_folder, read_private, warn_once, write_private,
};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The variable that moves the cache or turns it off (`off`).
pub const KERNEL_CACHE_ENV: &str = "CUDNN_CBR_KERNEL_CACHE";

const MAGIC: &[u8; 8] = b"CBRKERN1";

/// The most bytes of one entry (a few cubins); a larger file, or one that is not a regular
/// file (a FIFO, a folder), is not read and the kernels are compiled again.
pub const MAX_ENTRY_BYTES: u64 = 256 << 20;

/// A folder of cached kernel images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    dir: PathBuf,
}

/// What a cached compilation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Loaded from the cache: no compilation.
    Hit,
    /// Compiled and stored.
    Stored,
    /// Compiled; storing failed (the images are still used).
    NotStored,
    /// Compiled without a cache.
    Off,
}

impl KernelCache {
    /// A cache in `dir` (made on the first store).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// The cache the environment names (module docs); `None` when it is turned off or no
    /// folder can be named.
    pub fn from_env() -> Option<Self> {
        Self::from_vars(|v| std::env::var_os(v).map(PathBuf::from))
    }

    /// As [`KernelCache::from_env`], reading the variables from `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<PathBuf>) -> Option<Self> {
        if let Some(dir) = var(KERNEL_CACHE_ENV).filter(|d| !d.as_os_str().is_empty()) {
            return (dir != Path::new("off")).then(|| Self::at(dir));
        }
        let base = var("XDG_CACHE_HOME")
            .filter(|d| d.is_absolute())
            .or_else(|| var("HOME").map(|h| h.join(".cache")))?;
        Some(Self::at(base.join("cudnn-cbr").join("kernels")))
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of a compilation: FNV-1a (64-bit) over `parts`, each length-prefixed so that
    /// moving bytes between parts changes it. Callers give it everything the machine code
    /// depends on: the full program text, every option, the architecture, the NVRTC version
    /// (a fast hash: it tells compilations apart, it does not authenticate an entry).
    pub fn key(parts: &[&[u8]]) -> u64 {
        let mut h = Fnv::new();
        for p in parts {
            h.write(&(p.len() as u64).to_le_bytes());
            h.write(p);
        }
        h.0
    }

    fn path(&self, name: &str, key: u64) -> PathBuf {
        self.dir.join(format!("{name}-{key:016x}.bin"))
    }

    /// Whether the folder may be used: it exists, and it and the folders above it are owned by
    /// this user or root and not writable by group or others (module docs).
    ///
    /// # Errors
    /// What is wrong, naming the folder and its owner or mode.
    pub fn check_folder(&self) -> Result<(), String> {
        check_private_folder(&self.dir)
    }

    /// Whether the folder may be used now; a folder that exists and fails
    /// [`KernelCache::check_folder`] is reported once.
    fn trusted(&self) -> bool {
        match self.check_folder() {
            Ok(()) => true,
            Err(_) if !self.dir.exists() => false,
            Err(why) => {
                warn_once(&format!(
                    "warning: kernel cache: {} is not used: {why}; kernels are compiled and not cached",
                    self.dir.display()
                ));
                false
            }
        }
    }

    /// The images stored under `name` and `key`, when the folder is trusted and a whole,
    /// matching regular file of at most [`MAX_ENTRY_BYTES`], owned by this user or root and
    /// not writable by others, is there.
    pub fn load(&self, name: &str, key: u64) -> Option<Vec<Vec<u8>>> {
        if !self.trusted() {
            return None;
        }
        let bytes = read_private(&self.path(name, key), MAX_ENTRY_BYTES).ok()?;
        decode(&bytes, key)
    }

    /// Stores `images` under `name` and `key`, atomically, in a file only this user can write
    /// (the folder is made `0700` when missing).
    ///
    /// # Errors
    /// The file system's error (no folder, no space, read-only), or
    /// [`io::ErrorKind::PermissionDenied`] naming the problem when the folder is not trusted.
    pub fn store(&self, name: &str, key: u64, images: &[&[u8]]) -> io::Result<()> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        create_private_folder(&self.dir)?;
        self.check_folder()
            .map_err(|why| io::Error::new(io::ErrorKind::PermissionDenied, why))?;
        let path = self.path(name, key);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        write_private(&path, &tmp, &encode(key, images))
    }

    /// `compile`'s images, from the cache when `name`/`key` is stored there with `count`
    /// images, else compiled and stored.
    ///
    /// # Errors
    /// `compile`'s error.
    pub fn get_or_compile<E>(
        cache: Option<&Self>,
        name: &str,
        key: u64,
        count: usize,
        compile: impl FnOnce() -> Result<Vec<Vec<u8>>, E>,
    ) -> Result<(Vec<Vec<u8>>, CacheOutcome), E> {
        let Some(cache) = cache else {
            return Ok((compile()?, CacheOutcome::Off));
        };
        if let Some(images) = cache.load(name, key).filter(|i| i.len() == count) {
            return Ok((images, CacheOutcome::Hit));
        }
        let images = compile()?;
        if cache.dir.exists() && !cache.trusted() {
            return Ok((images, CacheOutcome::NotStored));
        }
        let refs: Vec<&[u8]> = images.iter().map(Vec::as_slice).collect();
        let outcome = match cache.store(name, key, &refs) {
            Ok(()) => CacheOutcome::Stored,
            Err(_) => CacheOutcome::NotStored,
        };
        Ok((images, outcome))
    }
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn encode(key: u64, images: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&(images.len() as u64).to_le_bytes());
    for i in images {
        out.extend_from_slice(&(i.len() as u64).to_le_bytes());
        out.extend_from_slice(i);
    }
    let mut h = Fnv::new();
    h.write(&out);
    out.extend_from_slice(&h.0.to_le_bytes());
    out
}

fn decode(bytes: &[u8], key: u64) -> Option<Vec<Vec<u8>>> {
    let (body, sum) = bytes.split_at(bytes.len().checked_sub(8)?);
    let mut h = Fnv::new();
    h.write(body);
    if h.0.to_le_bytes() != sum {
        return None;
    }
    let mut at = body.strip_prefix(MAGIC)?;
    fn word(at: &mut &[u8]) -> Option<u64> {
        let (w, rest) = at.split_first_chunk::<8>()?;
        *at = rest;
        Some(u64::from_le_bytes(*w))
    }
    if word(&mut at)? != key {
        return None;
    }
    let count = usize::try_from(word(&mut at)?).ok()?;
    let mut images = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let len = usize::try_from(word(&mut at)?).ok()?;
        let (image, rest) = (at.get(..len)?, at.get(len..)?);
        images.push(image.to_vec());
        at = rest;
    }
    at.is_empty().then_some(images)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cbr-kcache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_stored_entry_loads_back_and_a_damaged_one_does_not() {
        let dir = temp("roundtrip");
        let cache = KernelCache::at(&dir);
        let key = KernelCache::key(&[b"src", b"sm_90"]);
        assert_eq!(cache.load("amp", key), None);
        cache.store("amp", key, &[b"one", b"", b"three"]).unwrap();
        let back = cache.load("amp", key).unwrap();
        assert_eq!(back, vec![b"one".to_vec(), vec![], b"three".to_vec()]);
        // Another key (another source or arch) is another file.
        assert_eq!(cache.load("amp", key ^ 1), None);
        // Every single-byte change and every truncation is refused.
        let path = cache.path("amp", key);
        let good = std::fs::read(&path).unwrap();
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x40;
            std::fs::write(&path, &bad).unwrap();
            assert_eq!(cache.load("amp", key), None, "flipped byte {i}");
            std::fs::write(&path, &good[..i]).unwrap();
            assert_eq!(cache.load("amp", key), None, "truncated at {i}");
        }
        std::fs::write(&path, &good).unwrap();
        assert!(cache.load("amp", key).is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn get_or_compile_compiles_once_then_hits_and_rebuilds_a_bad_file() {
        let dir = temp("get");
        let cache = KernelCache::at(&dir);
        let compiles = std::cell::Cell::new(0);
        let run = |cache: Option<&KernelCache>| {
            KernelCache::get_or_compile::<()>(cache, "amp", 7, 2, || {
                compiles.set(compiles.get() + 1);
                Ok(vec![vec![1, 2], vec![3]])
            })
            .unwrap()
        };
        assert_eq!(run(Some(&cache)).1, CacheOutcome::Stored);
        let (images, outcome) = run(Some(&cache));
        assert_eq!(
            (images, outcome),
            (vec![vec![1, 2], vec![3]], CacheOutcome::Hit)
        );
        std::fs::write(cache.path("amp", 7), b"garbage").unwrap();
        assert_eq!(run(Some(&cache)).1, CacheOutcome::Stored);
        assert_eq!(run(None).1, CacheOutcome::Off);
        assert_eq!(
            compiles.get(),
            3,
            "stored, rebuilt, off: the hit compiled nothing"
        );
        // A folder that cannot be made: compiled, used, not stored.
        let blocked = KernelCache::at(dir.join("amp-7.bin-is-a-file").join("x"));
        std::fs::write(dir.join("amp-7.bin-is-a-file"), b"").unwrap();
        assert_eq!(run(Some(&blocked)).1, CacheOutcome::NotStored);
        assert_eq!(compiles.get(), 4);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_folder_and_entries_this_user_alone_controls_are_used() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let chmod = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        let base = temp("trust");
        let dir = base.join("kernels");
        let cache = KernelCache::at(&dir);
        let key = KernelCache::key(&[b"program text", b"--opt", b"sm_90", b"nvrtc 13.5"]);
        cache.store("amp", key, &[b"image"]).unwrap();
        // Made private: folders 0700, entries 0600.
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&base), 0o700);
        let entry = cache.path("amp", key);
        assert_eq!(mode(&entry), 0o600);
        assert!(cache.load("amp", key).is_some());

        // An entry others can write is not read (the folder is still fine).
        chmod(&entry, 0o620);
        assert_eq!(cache.load("amp", key), None);
        chmod(&entry, 0o600);

        // A folder its group can write: refused with a message naming it, nothing loaded or
        // stored, the kernels compiled.
        chmod(&dir, 0o770);
        let why = cache.check_folder().unwrap_err();
        assert!(
            why.contains("writable by its group") && why.contains("kernels"),
            "{why}"
        );
        assert_eq!(cache.load("amp", key), None);
        let err = cache.store("amp", key ^ 1, &[b"x"]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        let compiled = KernelCache::get_or_compile::<()>(Some(&cache), "amp", key, 1, || {
            Ok(vec![b"fresh".to_vec()])
        })
        .unwrap();
        assert_eq!(compiled, (vec![b"fresh".to_vec()], CacheOutcome::NotStored));
        assert!(!cache.path("amp", key ^ 1).exists());
        chmod(&dir, 0o700);
        // A folder above that others can write (and is not sticky) is refused too.
        chmod(&base, 0o777);
        assert!(cache.check_folder().unwrap_err().contains("writable by"));
        chmod(&base, 0o1777);
        assert_eq!(
            cache.check_folder(),
            Ok(()),
            "a sticky folder above is fine"
        );
        chmod(&base, 0o700);

        // Owned by another user (only root can give a file away): refused.
        if crate::untrusted::effective_uid() == 0 {
            const NOBODY: u32 = 65534;
            std::os::unix::fs::chown(&entry, Some(NOBODY), None).unwrap();
            assert_eq!(
                cache.load("amp", key),
                None,
                "another user's entry was read"
            );
            std::os::unix::fs::chown(&entry, Some(0), None).unwrap();
            assert!(cache.load("amp", key).is_some());
            std::os::unix::fs::chown(&dir, Some(NOBODY), None).unwrap();
            let why = cache.check_folder().unwrap_err();
            assert!(why.contains("owned by user 65534"), "{why}");
            assert_eq!(cache.load("amp", key), None);
        } else {
            println!("SKIP the other-owner case: giving a file away needs root");
        }
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn the_environment_names_the_folder_or_turns_it_off() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |v: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == v)
                    .map(|(_, p)| PathBuf::from(p))
            }
        };
        assert_eq!(
            KernelCache::from_vars(vars(&[(KERNEL_CACHE_ENV, "/tmp/k"), ("HOME", "/h")])),
            Some(KernelCache::at("/tmp/k"))
        );
        assert_eq!(
            KernelCache::from_vars(vars(&[(KERNEL_CACHE_ENV, "off")])),
            None
        );
        assert_eq!(
            KernelCache::from_vars(vars(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            Some(KernelCache::at("/x/cudnn-cbr/kernels"))
        );
        assert_eq!(
            KernelCache::from_vars(vars(&[("XDG_CACHE_HOME", "rel"), ("HOME", "/h")])),
            Some(KernelCache::at("/h/.cache/cudnn-cbr/kernels"))
        );
        assert_eq!(KernelCache::from_vars(vars(&[])), None);
    }
}
