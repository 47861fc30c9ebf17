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
//!
//! A plan executed while its stream captures a CUDA graph is recorded as a host node of that
//! graph (`record_replay`): the interpreter runs at every replay, in stream order, over the
//! variant pack bound at record time.
#![allow(unsafe_code)]

use crate::exec::Scalar;
use crate::graph::Graph;
use crate::interp::{Allocation, MemoryMap};
use cudarc::driver::sys;
use cudnn_cbr_runtime::stderr;
use std::ffi::{c_void, CStr, CString};
use std::os::raw::{c_char, c_int};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// The soname of the simulated driver (`tools/sim/build.sh`), distinct from `libcuda.so.1`.
pub const DRIVER_SONAME: &str = "libcudnn_cbr_sim_cuda.so";

/// `cudasim_allocation_of(ptr, *base, *len) -> int` (tools/sim/driver/api_sim.cc).
type AllocationOf = unsafe extern "C" fn(u64, *mut u64, *mut u64) -> c_int;
/// `cudasim_devprops_path() -> const char*` (tools/sim/driver/api_sim.cc).
type DevpropsPath = unsafe extern "C" fn() -> *const c_char;
/// `cudasim_fault(const char*)` (tools/sim/driver/api_sim.cc): faults the simulated context.
type Fault = unsafe extern "C" fn(*const c_char);

/// The simulated driver's lookups, from the copy the process already loaded.
struct Driver {
    /// Keeps the driver loaded while the function pointer is used (it is never unloaded).
    _lib: libloading::os::unix::Library,
    allocation_of: AllocationOf,
    fault: Fault,
    devprops: PathBuf,
}

/// Whether `CUDNN_CBR_DEVICE` selects the simulator.
fn selected() -> bool {
    std::env::var_os(cudnn_cbr_runtime::DEVICE_ENV).is_some_and(|v| v == "sim")
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
    // SAFETY: tools/sim/driver/api_sim.cc exports both with exactly these C signatures.
    let allocation_of = unsafe { lib.get::<AllocationOf>(b"cudasim_allocation_of\0") }.ok()?;
    let allocation_of = *allocation_of;
    // SAFETY: as above.
    let devprops_path = *unsafe { lib.get::<DevpropsPath>(b"cudasim_devprops_path\0") }.ok()?;
    // SAFETY: as above.
    let fault = *unsafe { lib.get::<Fault>(b"cudasim_fault\0") }.ok()?;
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
        fault,
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

/// The first failure of a replayed plan execution on a handle: (plan, problem). Shared by the
/// handle and every execution it recorded into a CUDA graph; set once, never cleared.
pub(crate) type ReplayFault = Arc<OnceLock<(String, String)>>;

/// A plan execution recorded into a CUDA graph: what the host node runs at each replay.
///
/// Ownership: [`record_replay`] boxes it and hands the box to a CUDA user object whose only
/// reference is moved to the capture's graph; the graph and every graph exec instantiated
/// from it hold references, and the box is dropped (by [`drop_replay`]) when the last of them
/// is destroyed. The host node only reads it. It holds addresses, not buffers: as with a
/// captured kernel's pointer arguments, the caller keeps the bound buffers alive while the
/// graph may be replayed, and the interpreter refuses (by uid and name) a tensor whose
/// address no longer falls in a live allocation large enough.
pub(crate) struct Replay {
    /// The plan's graph name (for errors).
    pub(crate) plan: String,
    /// The graph the interpreter runs (the plan's source graph, copied).
    pub(crate) graph: Graph,
    /// uid → device address, as bound at record time.
    pub(crate) pointers: Vec<(i64, u64)>,
    /// uid → by-value scalar, as bound at record time.
    pub(crate) scalars: Vec<(i64, Scalar)>,
    /// Where the first failure is kept for the recording handle.
    pub(crate) fault: ReplayFault,
}

impl Replay {
    /// Runs the interpreter over the recorded pack; the problem on failure.
    fn run(&self) -> Result<(), String> {
        let memory = SimMemory::new().ok_or("the simulated driver no longer answers")?;
        let pack = crate::interp::VariantPack {
            pointers: &self.pointers,
            scalars: &self.scalars,
        };
        // SAFETY: the host node runs in stream order on the simulator (what the graph
        // enqueued before it has run, nothing after it has started), and the simulator's
        // allocations are host memory live for their whole length while the table lists
        // them; the bound buffers are the caller's to keep alive and unaliased while the
        // graph replays (the CUDA-graph contract for every captured pointer), and the
        // interpreter checks each tensor's extent against the live allocation first.
        unsafe {
            crate::interp::execute(
                &self.graph,
                &pack,
                &memory,
                &crate::interp::Options::default(),
            )
        }
        .map_err(|e| e.to_string())
    }

    /// A failure at replay: kept for the handle (first one only) and reported to the
    /// simulated driver, which prints it and faults the context (docs/simulator.md).
    fn report(&self, problem: String) {
        let message = format!(
            "replay of plan `{}` (recorded in a CUDA graph): {problem}",
            self.plan
        );
        let _ = self.fault.set((self.plan.clone(), problem));
        match (driver(), CString::new(message.replace('\0', " "))) {
            // SAFETY: a NUL-terminated string that lives across the call; the driver copies
            // what it prints.
            (Some(d), Ok(text)) => unsafe { (d.fault)(text.as_ptr()) },
            _ => {
                stderr::line(&format!(
                    "cudnn-cbr: {message}; the simulated driver cannot be told: aborting"
                ));
                std::process::abort();
            }
        }
    }
}

/// The host node's function (`CUhostFn`): runs a [`Replay`].
extern "C" fn run_replay(data: *mut c_void) {
    let outcome = std::panic::catch_unwind(|| {
        // SAFETY: `data` is the box `record_replay` leaked, owned by the user object the
        // graph holds, so it is live while the graph (and so this node) can run; only
        // shared references are taken.
        let replay = unsafe { &*(data as *const Replay) };
        if let Err(problem) = replay.run() {
            replay.report(problem);
        }
    });
    if outcome.is_err() {
        stderr::line("cudnn-cbr: a replayed plan execution panicked; aborting");
        std::process::abort(); // unwinding into the driver is undefined
    }
}

/// The user object's destructor (`CUhostFn`): drops the [`Replay`] box.
extern "C" fn drop_replay(data: *mut c_void) {
    // SAFETY: called once, by the driver, when the last reference to the user object that
    // owns the box is released; nothing reads the box afterwards.
    let replay = unsafe { Box::from_raw(data as *mut Replay) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(replay))).is_err() {
        std::process::abort();
    }
}

fn check(what: &str, r: sys::CUresult) -> Result<(), String> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(format!("{what}: {e:?}")),
    }
}

/// Records `replay` on `stream`, which is capturing: a host node that runs it at each
/// replay of the graph, in stream order, owned by the capture's graph (see [`Replay`]).
pub(crate) fn record_replay(stream: sys::CUstream, replay: Replay) -> Result<(), String> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the optional outputs are null.
    check("cuStreamGetCaptureInfo", unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            std::ptr::null_mut(),
            &mut graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
        return Err(format!("the stream's capture is not active ({status:?})"));
    }
    let data = Box::into_raw(Box::new(replay)) as *mut c_void;
    let mut object: sys::CUuserObject = std::ptr::null_mut();
    // SAFETY: `data` is a live box; the destructor frees it exactly once, when the object's
    // last reference is released.
    let made = unsafe {
        sys::cuUserObjectCreate(
            &mut object,
            data,
            Some(drop_replay),
            1,
            sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32,
        )
    };
    if let Err(e) = check("cuUserObjectCreate", made) {
        // SAFETY: no object owns the box: it is still ours.
        drop(unsafe { Box::from_raw(data as *mut Replay) });
        return Err(e);
    }
    // SAFETY: `graph` is the capture's live graph; our one reference moves to it.
    let retained = unsafe {
        sys::cuGraphRetainUserObject(
            graph,
            object,
            1,
            sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32,
        )
    };
    if let Err(e) = check("cuGraphRetainUserObject", retained) {
        // SAFETY: our reference was not moved; releasing it runs the destructor.
        let _ = unsafe { sys::cuUserObjectRelease(object, 1) };
        return Err(e);
    }
    // SAFETY: `data` lives as long as the graph that will hold this node (above); the
    // function only reads it.
    check("cuLaunchHostFunc", unsafe {
        sys::cuLaunchHostFunc(stream, Some(run_replay), data)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unless `CUDNN_CBR_DEVICE=sim` selects it, nothing is simulated, even with the
    /// simulated driver loaded; and the soname is the one tools/sim/build.sh gives the driver.
    #[test]
    fn nothing_is_simulated_unless_selected() {
        if !selected() {
            assert!(!active());
            assert!(SimMemory::new().is_none());
            assert!(devprops_path().is_none());
        }
        let build = include_str!("../../../tools/sim/build.sh");
        assert!(build.contains(&format!("-soname,{DRIVER_SONAME}")));
    }
}
