// The simulator's own entry points, for fusion's graph interpreter (crates/3-fusion/src/sim.rs) and
// the simulated NCCL (tools/sim/nccl.cc).
#include <stdio.h>

#include "driver.h"

using namespace cudasim;

// ------------------------------------------------------------------ for fusion's graph interpreter
// crates/3-fusion/src/sim.rs looks these up in the loaded driver (by its soname) to confirm that the
// simulator is the driver in use, to build plans for the document the device's limits come
// from, and to bounds-check the tensors a plan execution reads and writes.

// The live allocation (device or page-locked host memory) holding the byte at `ptr`: its base
// and length in *base and *len, and 1; 0 when there is none (or the simulator is not selected).
API int cudasim_allocation_of(uint64_t ptr, uint64_t* base, uint64_t* len) {
  if (!sim_on() || !base || !len) return 0;
  DriverLock lk;
  uint64_t b = 0;
  const Alloc* a = find_alloc(ptr, 1, &b);
  if (!a) return 0;
  *base = b;
  *len = a->size;
  return 1;
}

// A host function's report that the work it ran failed (fusion's replay of a plan execution
// recorded in a capture): the message goes to stderr and the context faults, as after a
// kernel fault: the work still queued does not run and every later synchronize, query, copy
// or launch returns CUDA_ERROR_LAUNCH_FAILED. Only the first fault is kept.
API void cudasim_fault(const char* what) {
  if (!sim_on()) return;
  DriverLock lk;
  say("fault in enqueued work: %s", what ? what : "(no message)");
  if (g_fault == CUDA_SUCCESS) g_fault = CUDA_ERROR_LAUNCH_FAILED;
}

// For a host function that must wait for another thread's work (the simulated NCCL's
// collectives wait for every rank's contribution, tools/sim/nccl.cc): calls ready(arg) with the
// driver released, so that other threads enqueue and run their work, until it returns
// nonzero (ready may itself wait a little). Meanwhile the host function's stream is busy:
// another thread neither runs its later work nor returns from a synchronize of it. In the
// adversarial mode the waiting thread runs the other streams' queued work between calls of
// ready (what it waits for may be queued on a stream whose own thread waits too).
// Returns 1 once ready, 0 when the context has faulted meanwhile, and -1 without waiting
// when this thread runs the host function for a device-wide flush on behalf of the thread
// that enqueued it (see t_may_defer): the host function is then run again later, from the
// start, and must return at once.
API int cudasim_block(int (*ready)(void*), void* arg) {
  if (!sim_on() || !ready) return 0;
  DriverLock lk;
  int ok = 0;
  Stream* st = t_host_stream;
  hold_busy(st, t_host_for);  // (also while ready runs below: the stream's work is not done)
  if (t_may_defer) {
    const int d = release_driver();
    ok = ready(arg);
    retake_driver(d);
    release_busy(st);
    if (ok) return 1;
    t_deferred = true;
    return -1;
  }
  for (;;) {
    const int d = release_driver();
    ok = ready(arg);
    retake_driver(d);
    if (ok || g_fault != CUDA_SUCCESS) break;
    if (adversarial()) {
      // Its own stream is busy (skipped), and nothing run here may wait: work queued behind
      // this host function (an event wait on its stream) would wait for this very thread.
      const bool outer = t_may_defer;
      t_may_defer = true;
      flush_all();
      t_may_defer = outer;
    }
  }
  release_busy(st);
  return ok;
}

// The path of the device-properties document (devprops_path), valid for the process's life.
API const char* cudasim_devprops_path() {
  static const std::string path = devprops_path();
  return path.c_str();
}
