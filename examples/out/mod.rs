//! The examples' standard output.

/// `println!` that ends the program quietly when its output is gone (a reader that closed the
/// pipe, as `cargo run --example … | head` does) instead of panicking on the failed write.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout().lock(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}
