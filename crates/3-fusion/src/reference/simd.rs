//! The widest SIMD the CPU executor may use: the CPU's own, or less where
//! [`CPU_SIMD_ENV`] says so (to compare the paths on one machine, or to run as a machine
//! without AVX-512 would). Every path gives the same bits (`convert.rs`, `direct.rs`,
//! `sums.rs`, `prologue.rs`), so the limit changes only the speed.

use std::sync::OnceLock;

use super::error::{ReferenceError, Result};

/// The environment variable that caps the CPU executor's SIMD: `avx512` (no cap, the
/// default), `avx2` (AVX2 conv tiles, F16C conversions and prologue, AVX channel sums) or
/// `portable` (the gather and the `gemm` crate, `half`'s conversions, scalar loops).
pub const CPU_SIMD_ENV: &str = "CUDNN_CBR_CPU_SIMD";

/// A cap on the CPU executor's SIMD (see [`CPU_SIMD_ENV`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuSimd {
    /// No SIMD paths of our own.
    Portable,
    /// AVX2 (and F16C, FMA) at most.
    Avx2,
    /// AVX-512F at most: the widest we have, so no cap.
    Avx512,
}

impl CpuSimd {
    /// Parses a [`CPU_SIMD_ENV`] value.
    ///
    /// # Errors
    /// [`ReferenceError::Env`] naming the variable, the value and the accepted ones.
    pub fn parse(value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "avx512" => Ok(CpuSimd::Avx512),
            "avx2" => Ok(CpuSimd::Avx2),
            "portable" => Ok(CpuSimd::Portable),
            _ => Err(ReferenceError::Env {
                var: CPU_SIMD_ENV,
                value: value.to_string(),
                expected: "avx512, avx2 or portable",
            }),
        }
    }
}

/// The cap [`CPU_SIMD_ENV`] sets, `None` when it is unset.
///
/// # Errors
/// [`ReferenceError::Env`] for a value [`CpuSimd::parse`] refuses, or one that is not
/// UTF-8. (The executor itself then ignores the variable: call this at start-up to refuse it.)
pub fn cpu_simd_from_env() -> Result<Option<CpuSimd>> {
    match std::env::var_os(CPU_SIMD_ENV) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Some(s) => CpuSimd::parse(s).map(Some),
            None => Err(ReferenceError::Env {
                var: CPU_SIMD_ENV,
                value: v.to_string_lossy().into_owned(),
                expected: "avx512, avx2 or portable (UTF-8)",
            }),
        },
    }
}

/// The cap in force: [`cpu_simd_from_env`] read once per process, no cap where it is unset or
/// refused.
pub(crate) fn cap() -> CpuSimd {
    #[cfg(test)]
    if let Some(cap) = forced::get() {
        return cap;
    }
    static CAP: OnceLock<CpuSimd> = OnceLock::new();
    *CAP.get_or_init(|| {
        cpu_simd_from_env()
            .ok()
            .flatten()
            .unwrap_or(CpuSimd::Avx512)
    })
}

/// Tests run the ops under a chosen cap (every cap gives the same bits, so other tests
/// running meanwhile are unaffected; a path the CPU lacks falls back as without a cap).
#[cfg(test)]
pub(crate) mod forced {
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::sync::Mutex;

    use super::CpuSimd;

    static CAP: AtomicU8 = AtomicU8::new(0);
    /// Held by a test while it forces a cap.
    pub(crate) static HELD: Mutex<()> = Mutex::new(());

    pub(crate) fn get() -> Option<CpuSimd> {
        match CAP.load(Ordering::Relaxed) {
            1 => Some(CpuSimd::Portable),
            2 => Some(CpuSimd::Avx2),
            3 => Some(CpuSimd::Avx512),
            _ => None,
        }
    }

    /// Forces `cap` (`None`: the environment's again).
    pub(crate) fn set(cap: Option<CpuSimd>) {
        let code = match cap {
            None => 0,
            Some(CpuSimd::Portable) => 1,
            Some(CpuSimd::Avx2) => 2,
            Some(CpuSimd::Avx512) => 3,
        };
        CAP.store(code, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_and_others_are_refused_naming_the_variable() {
        assert_eq!(CpuSimd::parse("avx512").unwrap(), CpuSimd::Avx512);
        assert_eq!(CpuSimd::parse(" AVX2 ").unwrap(), CpuSimd::Avx2);
        assert_eq!(CpuSimd::parse("portable").unwrap(), CpuSimd::Portable);
        let err = CpuSimd::parse("sse4").unwrap_err().to_string();
        assert!(err.contains(CPU_SIMD_ENV) && err.contains("sse4"), "{err}");
    }
}
