//! Whether this process runs on the simulated CUDA device (docs/simulator.md), and what
//! executing a plan there needs from the simulated driver.
//!
//! The simulator is in use when `CUDNN_CBR_DEVICE=sim` and the CUDA driver loaded in the
//! process is the simulated one: it is found by its soname ([`DRIVER_SONAME`]) among the
//! libraries already loaded (never loaded here), and must export the lookups below. Under
//! the simulator, [`crate::exec::Handle`] makes no cuDNN handle, plans are built for the
//! simulator's device-properties document (deviceless, real cuDNN plans), and
//! [`crate::plan::ExecutionPlan::execute`] runs the plan's graph in the graph interpreter
//! ([`crate::interp`]) over the simulator's allocations instead of `cudnnBackendExecute`.
#![allow(unsafe_code)]

use crate::interp::{Allocation, MemoryMap};
use std::ffi::CStr;
use std::os::raw::{c_char, c_int};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The soname of the simulated driver (`sim/build.sh`), distinct from `libcuda.so.1`.
pub const DRIVER_SONAME: &str = "libcudnn_cbr_sim_cuda.so";

/// `cudasim_allocation_of(ptr, *base, *len) -> int` (sim/driver.cc).
type AllocationOf = unsafe extern "C" fn(u64, *mut u64, *mut u64) -> c_int;
/// `cudasim_devprops_path() -> const char*` (sim/driver.cc).
type DevpropsPath = unsafe extern "C" fn() -> *const c_char;

/// The simulated driver's lookups, from the copy the process already loaded.
struct Driver {
    /// Keeps the driver loaded while the function pointer is used (it is never unloaded).
    _lib: libloading::os::unix::Library,
    allocation_of: AllocationOf,
    devprops: PathBuf,
}

/// Whether `CUDNN_CBR_DEVICE` selects the simulator.
fn selected() -> bool {
    std::env::var_os("CUDNN_CBR_DEVICE").is_some_and(|v| v == "sim")
}

/// The loaded simulated driver, once some code (cudarc) has loaded it. A failed lookup is
/// not remembered: the driver may be loaded later.
fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    if let Some(d) = DRIVER.get() {
        return Some(d);
    }
    // SAFETY: RTLD_NOLOAD only returns a library already loaded in the process (whose
    // initializers have run), loading nothing.
    let lib = unsafe {
        libloading::os::unix::Library::open(Some(DRIVER_SONAME), libc::RTLD_NOW | libc::RTLD_NOLOAD)
    }
    .ok()?;
    // SAFETY: sim/driver.cc exports both with exactly these C signatures.
    let allocation_of = unsafe { lib.get::<AllocationOf>(b"cudasim_allocation_of\0") }.ok()?;
    let allocation_of = *allocation_of;
    // SAFETY: as above.
    let devprops_path = *unsafe { lib.get::<DevpropsPath>(b"cudasim_devprops_path\0") }.ok()?;
    // SAFETY: the function takes nothing and returns a NUL-terminated string that lives as
    // long as the process (a function-local static), or null.
    let raw = unsafe { devprops_path() };
    if raw.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated (above).
    let devprops = PathBuf::from(
        unsafe { CStr::from_ptr(raw) }
            .to_string_lossy()
            .into_owned(),
    );
    Some(DRIVER.get_or_init(|| Driver {
        _lib: lib,
        allocation_of,
        devprops,
    }))
}

/// Whether the process runs on the simulated device: `CUDNN_CBR_DEVICE=sim` and the loaded
/// CUDA driver is the simulator (false before any CUDA driver call has loaded it).
pub fn active() -> bool {
    selected() && driver().is_some()
}

/// The simulator's device-properties document (`CUDNN_CBR_SIM_DEVPROPS`, or `devprops.json`
/// next to the simulated driver), when the simulator is [`active`].
pub fn devprops_path() -> Option<PathBuf> {
    if !selected() {
        return None;
    }
    driver().map(|d| d.devprops.clone())
}

/// The simulator's allocation table as the graph interpreter's [`MemoryMap`].
#[derive(Debug, Clone, Copy)]
pub struct SimMemory {
    allocation_of: AllocationOf,
}

impl SimMemory {
    /// The table of the loaded simulator, when it is [`active`].
    pub fn new() -> Option<Self> {
        if !selected() {
            return None;
        }
        driver().map(|d| SimMemory {
            allocation_of: d.allocation_of,
        })
    }
}

impl MemoryMap for SimMemory {
    fn allocation(&self, addr: u64) -> Option<Allocation> {
        let (mut base, mut len) = (0u64, 0u64);
        // SAFETY: valid out-pointers; the lookup takes the driver's lock and only reads its
        // allocation table.
        let found = unsafe { (self.allocation_of)(addr, &mut base, &mut len) };
        (found != 0).then_some(Allocation { base, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unless `CUDNN_CBR_DEVICE=sim` selects it, nothing is simulated, even with the
    /// simulated driver loaded; and the soname is the one sim/build.sh gives the driver.
    #[test]
    fn nothing_is_simulated_unless_selected() {
        if !selected() {
            assert!(!active());
            assert!(SimMemory::new().is_none());
            assert!(devprops_path().is_none());
        }
        let build = include_str!("../../sim/build.sh");
        assert!(build.contains(&format!("-soname,{DRIVER_SONAME}")));
    }
}
