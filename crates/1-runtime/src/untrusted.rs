//! Reading files the library does not control: device-properties documents, plan-cache
//! files, kernel-cache entries.
//!
//! [`read_regular`] opens a path only when it is a regular file (a FIFO would block the
//! process on open or read, a folder or device is no document), re-checks what it opened on
//! the open handle (the path may have been swapped in between), and reads at most a given
//! number of bytes. [`parse_strict_json`] parses JSON as `serde_json` does, except that an
//! object with a key given twice is an error: `serde_json` keeps the last value, another
//! parser (cuDNN's) may keep the first, and the two would then disagree about the document.
//!
//! Cache folders follow ssh's rule for `~/.ssh` (`StrictModes`): [`check_private_folder`]
//! trusts a folder only when it, and every folder above it, is owned by this process's user
//! or root and cannot be written by group or others (a folder above may be writable by
//! others when its sticky bit is set, as `/tmp` is: others cannot rename what is ours
//! there); [`read_private`] reads a file only when the same holds for the file itself. A
//! trusted folder's files are then taken as the user's own, as ssh takes `~/.ssh`: what they
//! say is still checked (the plan cache rebuilds every operation from our own graph), but
//! not doubted. [`create_private_folder`] makes folders `0700` and [`write_private`]
//! writes files `0600`.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;
use std::io::Read;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Why an untrusted file was not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileProblem {
    /// Nothing is at the path.
    NotFound,
    /// The path is a FIFO (named pipe): reading it would wait for a writer.
    Fifo,
    /// The path is a folder.
    Folder,
    /// The path is a socket, a character or block device, or another non-regular file.
    NotRegular {
        /// What it is (e.g. "a character device").
        kind: &'static str,
    },
    /// The file holds more bytes than its kind of document may.
    TooLarge {
        /// Its size in bytes (at least `limit + 1` when it grew while being read).
        size: u64,
        /// The most bytes accepted.
        limit: u64,
    },
    /// The file is not UTF-8 text where text is expected.
    NotText,
    /// The operating system refused (permissions, I/O error).
    Io(String),
    /// The file could have been written by another user: what [`check_private`] says.
    NotPrivate(String),
}

impl fmt::Display for FileProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileProblem::NotFound => write!(f, "no such file"),
            FileProblem::Fifo => write!(f, "is a FIFO (named pipe), not a regular file"),
            FileProblem::Folder => write!(f, "is a folder, not a regular file"),
            FileProblem::NotRegular { kind } => write!(f, "is {kind}, not a regular file"),
            FileProblem::TooLarge { size, limit } => {
                write!(f, "is too large: {size} bytes, at most {limit} accepted")
            }
            FileProblem::NotText => write!(f, "is not UTF-8 text"),
            FileProblem::Io(e) => write!(f, "cannot read: {e}"),
            FileProblem::NotPrivate(why) => write!(f, "is not trusted: {why}"),
        }
    }
}

fn classify(t: std::fs::FileType) -> Option<FileProblem> {
    if t.is_file() {
        None
    } else if t.is_fifo() {
        Some(FileProblem::Fifo)
    } else if t.is_dir() {
        Some(FileProblem::Folder)
    } else if t.is_socket() {
        Some(FileProblem::NotRegular { kind: "a socket" })
    } else if t.is_char_device() {
        Some(FileProblem::NotRegular {
            kind: "a character device",
        })
    } else if t.is_block_device() {
        Some(FileProblem::NotRegular {
            kind: "a block device",
        })
    } else {
        Some(FileProblem::NotRegular { kind: "not a file" })
    }
}

fn io_problem(e: std::io::Error) -> FileProblem {
    match e.kind() {
        std::io::ErrorKind::NotFound => FileProblem::NotFound,
        _ => FileProblem::Io(e.to_string()),
    }
}

/// The bytes of the regular file at `path` (symbolic links followed), at most `limit` of them.
///
/// # Errors
/// What the path is when it is not a regular file (checked before opening, and again on the
/// opened handle, which is opened non-blocking so that a FIFO swapped in cannot block), a
/// file of more than `limit` bytes, or the operating system's error.
pub fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, FileProblem> {
    read_checked(path, limit, false)
}

fn read_checked(path: &Path, limit: u64, private: bool) -> Result<Vec<u8>, FileProblem> {
    let before = std::fs::metadata(path).map_err(io_problem)?;
    if let Some(p) = classify(before.file_type()) {
        return Err(p);
    }
    if before.len() > limit {
        return Err(FileProblem::TooLarge {
            size: before.len(),
            limit,
        });
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(io_problem)?;
    let opened = file.metadata().map_err(io_problem)?;
    if let Some(p) = classify(opened.file_type()) {
        return Err(p);
    }
    // Checked on the open handle: the path may name another file by now.
    if let Some(why) = private
        .then(|| check_private(path, &opened, false))
        .flatten()
    {
        return Err(FileProblem::NotPrivate(why));
    }
    if opened.len() > limit {
        return Err(FileProblem::TooLarge {
            size: opened.len(),
            limit,
        });
    }
    let mut bytes = Vec::with_capacity(usize::try_from(opened.len()).unwrap_or(0));
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_problem)?;
    let read = bytes.len() as u64;
    if read > limit {
        return Err(FileProblem::TooLarge { size: read, limit });
    }
    Ok(bytes)
}

/// This process's effective user id.
#[allow(unsafe_code)]
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why `meta` (of `path`) could have been written by someone other than this process's user
/// or root: an owner who is neither, or a group/other write bit (allowed with the sticky bit
/// when `sticky_ok`, for the folders above a cache folder). `None` when it could not.
pub fn check_private(path: &Path, meta: &std::fs::Metadata, sticky_ok: bool) -> Option<String> {
    let (uid, me) = (meta.uid(), effective_uid());
    if uid != me && uid != 0 {
        return Some(format!(
            "{} is owned by user {uid}, not by this user ({me}) or root",
            path.display()
        ));
    }
    let mode = meta.mode();
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !(sticky_ok && sticky && meta.is_dir()) {
        return Some(format!(
            "{} is writable by {} (mode {:o}); `chmod go-w` it",
            path.display(),
            match mode & 0o022 {
                0o020 => "its group",
                0o002 => "others",
                _ => "its group and others",
            },
            mode & 0o7777
        ));
    }
    None
}

/// Whether `dir` is a folder only this user (or root) could have put files in: it and every
/// folder above it pass [`check_private`] (a folder above may be sticky and writable by all).
///
/// # Errors
/// What is wrong, naming the folder: it does not exist or is no folder, or the first folder
/// on the way that fails the rule.
pub fn check_private_folder(dir: &Path) -> Result<(), String> {
    let real = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let meta = std::fs::metadata(&real).map_err(|e| format!("{}: {e}", real.display()))?;
    if !meta.is_dir() {
        return Err(format!("{} is not a folder", real.display()));
    }
    if let Some(why) = check_private(&real, &meta, false) {
        return Err(why);
    }
    for above in real.ancestors().skip(1) {
        let meta = std::fs::metadata(above).map_err(|e| format!("{}: {e}", above.display()))?;
        if let Some(why) = check_private(above, &meta, true) {
            return Err(why);
        }
    }
    Ok(())
}

/// Makes `dir` and the folders above it that are missing, each `0700` (an existing folder
/// keeps its mode).
///
/// # Errors
/// The file system's error.
pub fn create_private_folder(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `bytes` to `path` through `tmp` (a name no other writer uses), created `0600`, and
/// renames it into place: a reader never sees half a file. `tmp` is removed on failure.
///
/// # Errors
/// The file system's error.
pub fn write_private(path: &Path, tmp: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(tmp)
        .and_then(|mut f| f.write_all(bytes))
        .and_then(|()| std::fs::rename(tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    written
}

/// As [`read_regular`], and only when the opened file passes [`check_private`] (its owner is
/// this user or root, no group/other write bit): for files in a cache folder.
///
/// # Errors
/// [`read_regular`]'s, and [`FileProblem::NotPrivate`] naming the owner or mode.
pub fn read_private(path: &Path, limit: u64) -> Result<Vec<u8>, FileProblem> {
    read_checked(path, limit, true)
}

/// As [`read_private`], for a text file.
///
/// # Errors
/// [`read_private`]'s, and [`FileProblem::NotText`] for bytes that are not UTF-8.
pub fn read_private_text(path: &Path, limit: u64) -> Result<String, FileProblem> {
    String::from_utf8(read_private(path, limit)?).map_err(|_| FileProblem::NotText)
}

/// Prints `warning` on stderr the first time this process gives it (a refused folder is
/// reported once, not on every lookup).
pub fn warn_once(warning: &str) {
    static WARNED: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let first = WARNED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(warning.to_string());
    if first {
        crate::stderr::line(warning);
    }
}

/// As [`read_regular`], for a text file.
///
/// # Errors
/// [`read_regular`]'s, and [`FileProblem::NotText`] for bytes that are not UTF-8.
pub fn read_regular_text(path: &Path, limit: u64) -> Result<String, FileProblem> {
    String::from_utf8(read_regular(path, limit)?).map_err(|_| FileProblem::NotText)
}

/// Parses one JSON document, rejecting an object that gives a key twice (at any depth).
///
/// # Errors
/// `serde_json`'s error for text that is not one JSON document; for a duplicated key, an
/// error whose text starts "duplicate key `KEY`" and says where.
pub fn parse_strict_json(text: &str) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = StrictValue.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// A [`Value`] seed that refuses duplicate keys.
struct StrictValue;

impl<'de> DeserializeSeed<'de> for StrictValue {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom(format!("the number {v} is not finite")))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictValue)? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut obj = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if obj.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key `{key}`")));
            }
            let v = map.next_value_seed(StrictValue)?;
            obj.insert(key, v);
        }
        Ok(Value::Object(obj))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("cbr-untrusted-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn duplicate_keys_are_refused_at_any_depth_and_the_rest_parses_as_serde_json_does() {
        let text = r#"{"a": [1, -2, 3.5, "x", null, true], "b": {"c": {}}}"#;
        assert_eq!(
            parse_strict_json(text).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
        for (doc, key) in [
            (r#"{"a": 1, "a": 2}"#, "a"),
            (r#"{"x": {"b": 1, "c": 2, "b": 3}}"#, "b"),
            (r#"[{"k": 1}, {"k": 1, "k": 1}]"#, "k"),
        ] {
            let e = parse_strict_json(doc).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("duplicate key `{key}`")),
                "{doc}: {e}"
            );
        }
        assert!(parse_strict_json(r#"{"a": 1} {"b": 2}"#).is_err());
        assert!(parse_strict_json("").is_err());
    }

    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        let d = scratch("read");
        let file = d.join("f.json");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_regular(&file, 10).unwrap(), b"0123456789");
        assert_eq!(
            read_regular(&file, 9),
            Err(FileProblem::TooLarge { size: 10, limit: 9 })
        );
        assert_eq!(read_regular(&d, 10), Err(FileProblem::Folder));
        assert_eq!(
            read_regular(&d.join("none"), 10),
            Err(FileProblem::NotFound)
        );
        let fifo = d.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            assert_eq!(read_regular(&fifo, 10), Err(FileProblem::Fifo));
        }
        assert_eq!(
            read_regular(Path::new("/dev/null"), 10),
            Err(FileProblem::NotRegular {
                kind: "a character device"
            })
        );
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        assert_eq!(read_regular_text(&file, 10), Err(FileProblem::NotText));
        let _ = std::fs::remove_dir_all(&d);
    }
}
