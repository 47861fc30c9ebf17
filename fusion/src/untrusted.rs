//! Reading files the library does not control: device-properties documents, plan-cache
//! files, kernel-cache entries.
//!
//! [`read_regular`] opens a path only when it is a regular file (a FIFO would block the
//! process on open or read, a folder or device is no document), re-checks what it opened on
//! the open handle (the path may have been swapped in between), and reads at most a given
//! number of bytes. [`parse_strict_json`] parses JSON as `serde_json` does, except that an
//! object with a key given twice is an error: `serde_json` keeps the last value, another
//! parser (cuDNN's) may keep the first, and the two would then disagree about the document.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
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
