//! The examples' standard output and error output.

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

/// `eprintln!` that never panics: a closed stderr (its reader gone, as with `… 2>&1 | head`)
/// is ignored (`cudnn_cbr::runtime::stderr::line`).
#[allow(unused_macros)] // custom_trainer writes nothing on stderr
macro_rules! note {
    ($($arg:tt)*) => {
        cudnn_cbr::runtime::stderr::line(&format!($($arg)*))
    };
}
