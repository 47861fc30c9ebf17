//! Lines on stderr that cannot panic their caller.
//!
//! `eprintln!` panics when the write fails, as it does once a reader has closed the pipe
//! stderr goes to (`train_cbr 2>&1 | head -1`). A library warning or a tool's progress line is
//! not worth a panic inside a training step, so everything the workspace prints on stderr
//! goes through [`line()`] (tested by running the examples with their stderr closed:
//! `tests/examples_output.rs`, `crates/6-trainer/tests/train_cbr_output.rs`).

use std::io::Write as _;

/// Writes `text` and a newline to stderr, ignoring a failed write (nobody can read it).
pub fn line(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{text}");
}
