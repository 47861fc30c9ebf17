//! What the host and the device have free, checked before a plan's regions are allocated:
//! an allocation that cannot be satisfied aborts the process (Rust's allocator) or fails deep
//! inside the driver, while a check beforehand is a typed error naming the sizes.

use crate::AmpError;

/// Host memory available now (`MemAvailable` of `/proc/meminfo`), in bytes; `None` where it
/// cannot be read (then nothing is checked).
pub fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Checks that `need` bytes fit in the host's available memory.
///
/// # Errors
/// [`AmpError::OutOfMemory`] naming `what`, the need and what is free.
pub fn check_host(what: &str, need: u128) -> Result<(), AmpError> {
    match host_memory_available() {
        Some(have) if need > u128::from(have) => Err(AmpError::OutOfMemory {
            what: what.to_string(),
            place: "host",
            need,
            have: u128::from(have),
        }),
        // Beyond what an address space can hold, whatever /proc says.
        _ if need > isize::MAX as u128 => Err(AmpError::OutOfMemory {
            what: what.to_string(),
            place: "host",
            need,
            have: isize::MAX as u128,
        }),
        _ => Ok(()),
    }
}
