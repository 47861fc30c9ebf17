//! Checks made before a library file is handed to `dlopen` or before cuDNN's first call.
//!
//! These faults otherwise kill the process or break it silently instead of returning an
//! error:
//! - a truncated shared object: `dlopen` maps segments past the end of the file and the
//!   process dies of SIGBUS while relocating it;
//! - a `libcudnn.so.9` whose sub-libraries are missing: the shim loads them lazily and
//!   aborts inside the first cuDNN call ("Invalid handle. Cannot load symbol ...");
//! - a foreign shared object under a sub-library's name: the shim aborts when the symbol it
//!   looks up is absent (the graph library), or cuDNN finds no engine for any graph (the
//!   heuristics and engine libraries).
//!
//! So every file is checked to be a complete ELF shared object for this machine (headers,
//! program headers and every loadable segment inside the file) that defines the symbols of
//! its kind ([`missing_symbols`], read from the file), and sub-libraries are found the way a
//! shim with RPATH `$ORIGIN` looks for them: next to it first, then the system loader's
//! folders ([`locate_sublibrary`]). Which libraries and symbols cuDNN needs is cudnn-fe-sys's
//! knowledge (its loader); NCCL's loader (amp) and the launcher bootstrap use the same checks.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];
const ET_DYN: u16 = 3;
const PT_LOAD: u32 = 1;

#[cfg(target_arch = "x86_64")]
const HOST_MACHINE: Option<u16> = Some(62);
#[cfg(target_arch = "aarch64")]
const HOST_MACHINE: Option<u16> = Some(183);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const HOST_MACHINE: Option<u16> = None;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Opens `path` for reading only when it is a regular file (symbolic links followed). A FIFO
/// would block a plain open until a writer came (and `dlopen` with it), so the open is
/// non-blocking and the type is checked on the handle it gave. Returns why not.
pub fn open_regular(path: &Path) -> Result<File, String> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot open: {e}"))?;
    let t = file
        .metadata()
        .map_err(|e| format!("cannot stat: {e}"))?
        .file_type();
    let kind = if t.is_file() {
        return Ok(file);
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_dir() {
        "a folder"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a file"
    };
    Err(format!("is {kind}, not a regular file"))
}

/// Checks that `path` is a complete 64-bit little-endian ELF shared object for this machine:
/// every byte its headers and loadable segments name lies inside the file. Returns why not.
pub fn check_shared_object(path: &Path) -> Result<(), String> {
    let mut file = open_regular(path)?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot stat: {e}"))?
        .len();
    let mut header = [0u8; 64];
    file.read_exact(&mut header).map_err(|_| {
        format!("not a shared library: {len} bytes, shorter than an ELF header (truncated?)")
    })?;
    if header[..4] != ELF_MAGIC {
        return Err("not a shared library: no ELF magic number".into());
    }
    if header[4] != 2 || header[5] != 1 {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let e_type = u16_at(&header, 16);
    if e_type != ET_DYN {
        return Err(format!("ELF type {e_type} is not a shared object (3)"));
    }
    let machine = u16_at(&header, 18);
    if let Some(host) = HOST_MACHINE {
        if machine != host {
            return Err(format!(
                "built for ELF machine {machine}, this machine is {host}"
            ));
        }
    }
    let truncated = |what: &str, end: Option<u64>| -> Result<(), String> {
        match end {
            Some(end) if end <= len => Ok(()),
            Some(end) => Err(format!(
                "truncated: the {what} ends at byte {end}, the file has {len}"
            )),
            None => Err(format!("corrupt: the {what} has an offset past 2^64")),
        }
    };
    let (phoff, phentsize, phnum) = (
        u64_at(&header, 32),
        u64::from(u16_at(&header, 54)),
        u64::from(u16_at(&header, 56)),
    );
    let (shoff, shentsize, shnum) = (
        u64_at(&header, 40),
        u64::from(u16_at(&header, 58)),
        u64::from(u16_at(&header, 60)),
    );
    if phnum == 0 || phentsize < 56 {
        return Err("corrupt: no program headers".into());
    }
    let ph_end = phentsize
        .checked_mul(phnum)
        .and_then(|n| n.checked_add(phoff));
    truncated("program header table", ph_end)?;
    if shoff != 0 {
        let sh_end = shentsize
            .checked_mul(shnum)
            .and_then(|n| n.checked_add(shoff));
        truncated("section header table", sh_end)?;
    }
    // The program headers: every loadable segment's file bytes must be present.
    let table_len = usize::try_from(phentsize * phnum).map_err(|_| "corrupt: huge table")?;
    let mut table = vec![0u8; table_len];
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(phoff))
        .and_then(|_| file.read_exact(&mut table))
        .map_err(|e| format!("cannot read the program headers: {e}"))?;
    for (i, ph) in table.chunks_exact(phentsize as usize).enumerate() {
        if u32_at(ph, 0) != PT_LOAD {
            continue;
        }
        let (offset, filesz) = (u64_at(ph, 8), u64_at(ph, 32));
        truncated(&format!("loadable segment {i}"), offset.checked_add(filesz))?;
    }
    Ok(())
}

/// The folders the system loader searches for a bare library name, in its order as far as
/// it can be read without calling it: `LD_LIBRARY_PATH`, the folders configured in
/// `/etc/ld.so.conf` (one level of `include`), then the default folders.
pub fn system_search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| {
            std::env::split_paths(&v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default();
    let mut conf_files = vec![PathBuf::from("/etc/ld.so.conf")];
    let mut i = 0;
    while i < conf_files.len() {
        let text = std::fs::read_to_string(&conf_files[i]).unwrap_or_default();
        for line in text.lines().map(str::trim) {
            if let Some(pattern) = line.strip_prefix("include ") {
                // Only the `dir/*.conf` form is expanded (what distributions ship).
                let pattern = Path::new(pattern.trim());
                if i == 0 {
                    if let (Some(dir), Some(ext)) = (pattern.parent(), pattern.extension()) {
                        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                            .into_iter()
                            .flatten()
                            .flatten()
                            .map(|e| e.path())
                            .filter(|p| p.extension() == Some(ext))
                            .collect();
                        found.sort();
                        conf_files.extend(found);
                    }
                }
            } else if line.starts_with('/') {
                dirs.push(PathBuf::from(line));
            }
        }
        i += 1;
    }
    for d in [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/lib64",
        "/usr/lib64",
        "/lib",
        "/usr/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// Where the system loader would find a bare library name, if it can be told. Any entry
/// counts, not only regular files: the loader opens the first it meets, and a FIFO there
/// must be reported by [`check_shared_object`] rather than skipped and then block `dlopen`.
pub fn resolve_by_name(name: &str) -> Option<PathBuf> {
    system_search_dirs()
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
}

/// Where the shim at `main` will find sub-library `name`: next to it, else by name.
pub fn locate_sublibrary(main: &Path, name: &str) -> Option<PathBuf> {
    let beside = main.parent().map(|d| d.join(name));
    beside
        .filter(|p| p.exists())
        .or_else(|| resolve_by_name(name))
}

/// Reads at most this many bytes of one symbol or string table (cuDNN's largest, the graph
/// library's, is a few MiB).
const MAX_TABLE_BYTES: u64 = 256 << 20;

/// Which of `wanted` the shared object at `path` does not define in its dynamic symbol
/// table, read from the file without loading it (so none of its code runs). Call after
/// [`check_shared_object`] passed. Returns why the table cannot be read.
pub fn missing_symbols(path: &Path, wanted: &[&str]) -> Result<Vec<String>, String> {
    use std::io::{Seek, SeekFrom};
    const SHT_DYNSYM: u32 = 11;
    const SYM_SIZE: usize = 24;
    let mut file = open_regular(path)?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot stat: {e}"))?
        .len();
    let mut read_at = |offset: u64, size: u64, what: &str| -> Result<Vec<u8>, String> {
        match offset.checked_add(size) {
            Some(end) if end <= len && size <= MAX_TABLE_BYTES => {}
            _ => return Err(format!("corrupt: the {what} lies outside the file")),
        }
        let mut buf = vec![0u8; size as usize];
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| format!("cannot read the {what}: {e}"))?;
        Ok(buf)
    };
    let header = read_at(0, 64, "ELF header")?;
    let (shoff, shentsize, shnum) = (
        u64_at(&header, 40),
        u64::from(u16_at(&header, 58)),
        u64::from(u16_at(&header, 60)),
    );
    if shoff == 0 || shnum == 0 || shentsize < 64 {
        return Err("has no section headers to read its symbols from".into());
    }
    let table = read_at(
        shoff,
        shentsize.saturating_mul(shnum),
        "section header table",
    )?;
    let section = |i: usize| table.chunks_exact(shentsize as usize).nth(i);
    let dynsym = table
        .chunks_exact(shentsize as usize)
        .find(|sh| u32_at(sh, 4) == SHT_DYNSYM)
        .ok_or("has no dynamic symbol table")?;
    let strtab = section(u32_at(dynsym, 40) as usize)
        .ok_or("corrupt: the dynamic symbol table names no string table")?;
    let syms = read_at(
        u64_at(dynsym, 24),
        u64_at(dynsym, 32),
        "dynamic symbol table",
    )?;
    let strs = read_at(
        u64_at(strtab, 24),
        u64_at(strtab, 32),
        "dynamic string table",
    )?;
    let mut missing: Vec<&str> = wanted.to_vec();
    for sym in syms.chunks_exact(SYM_SIZE) {
        // An undefined entry (section index 0) is an import, not an export.
        if u16_at(sym, 6) == 0 {
            continue;
        }
        let start = u32_at(sym, 0) as usize;
        let Some(rest) = strs.get(start..) else {
            continue;
        };
        let name = &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())];
        missing.retain(|w| w.as_bytes() != name);
        if missing.is_empty() {
            break;
        }
    }
    Ok(missing.into_iter().map(String::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("cudnn-fe-sys-preflight-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    /// A shared object every Linux machine has (the C library).
    fn some_system_library() -> PathBuf {
        resolve_by_name("libc.so.6").expect("libc.so.6 in the system loader's folders")
    }

    #[test]
    fn exported_symbols_are_read_from_the_file() {
        let libc = some_system_library();
        let missing = missing_symbols(&libc, &["printf", "cudnnGetVersion", "malloc"]).unwrap();
        assert_eq!(missing, vec!["cudnnGetVersion".to_string()]);
        let text = scratch("symbols-text.so");
        std::fs::write(&text, [b'x'; 200]).unwrap();
        assert!(missing_symbols(&text, &["printf"]).is_err());
    }

    #[test]
    fn a_real_shared_object_passes() {
        check_shared_object(&some_system_library()).unwrap();
    }

    #[test]
    fn truncations_are_named_before_dlopen_can_crash() {
        let bytes = std::fs::read(some_system_library()).unwrap();
        for keep in [0, 10, 63, 64, 1000, bytes.len() / 2, bytes.len() - 1] {
            let path = scratch(&format!("trunc-{keep}.so"));
            std::fs::write(&path, &bytes[..keep]).unwrap();
            let why = check_shared_object(&path).unwrap_err();
            assert!(
                why.contains("truncated") || why.contains("shorter"),
                "{keep} bytes: {why}"
            );
        }
    }

    #[test]
    fn non_elf_and_foreign_files_are_rejected() {
        let path = scratch("text.so");
        std::fs::write(&path, [b'x'; 200]).unwrap();
        assert!(check_shared_object(&path)
            .unwrap_err()
            .contains("ELF magic"));
        let mut bytes = std::fs::read(some_system_library()).unwrap();
        bytes[4] = 1; // ELFCLASS32
        let path = scratch("class32.so");
        std::fs::write(&path, &bytes).unwrap();
        assert!(check_shared_object(&path).unwrap_err().contains("64-bit"));
        let mut bytes = std::fs::read(some_system_library()).unwrap();
        bytes[18] = 0x28; // ARM (40)
        bytes[19] = 0;
        let path = scratch("arm.so");
        std::fs::write(&path, &bytes).unwrap();
        assert!(check_shared_object(&path).unwrap_err().contains("machine"));
        assert!(check_shared_object(&scratch("absent.so"))
            .unwrap_err()
            .contains("cannot open"));
    }

    /// A FIFO would block a plain open until a writer came: it is refused at once.
    #[test]
    fn fifos_folders_and_devices_are_refused_without_blocking() {
        let fifo = scratch("libcudnn-fifo.so.9");
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo failed");
        for check in [check_shared_object, |p: &Path| {
            missing_symbols(p, &["x"]).map(drop)
        }] {
            assert_eq!(
                check(&fifo).unwrap_err(),
                "is a FIFO (named pipe), not a regular file"
            );
        }
        let dir = scratch("folder.so");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(
            check_shared_object(&dir).unwrap_err(),
            "is a folder, not a regular file"
        );
        assert_eq!(
            check_shared_object(Path::new("/dev/null")).unwrap_err(),
            "is a character device, not a regular file"
        );
    }
}
