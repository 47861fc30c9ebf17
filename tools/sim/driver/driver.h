// libcuda.so of the simulated device (docs/simulator.md): the driver entry points cudarc
// calls, answered on the host. Without CUDNN_CBR_DEVICE=sim every call says "no device", like
// scripts/nodriver/libcuda_stub.c. Its soname is not libcuda.so.1, so cuDNN (which opens
// libcuda.so.1) keeps getting the no-driver stand-in while cudarc (which tries libcuda.so
// first) gets this library.
//
// This header holds the internals the files of tools/sim/driver/ share: the lock, the device's
// properties (device.cc), memory (memory.cc), modules (modules.cc), streams, events and
// graphs (queue.cc); the entry points are api_*.cc. Only the entry points marked API are
// exported (the library is built with -fvisibility=hidden).
#pragma once

#include <cuda.h>
#include <stdint.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../include/cuda_on_cpu.h"
#include "../translate.h"

// cuda.h maps these names to their _v2 versions; both are exported here.
#undef cuDeviceGetUuid
#undef cuEventElapsedTime

#define API extern "C" __attribute__((visibility("default")))

namespace cudasim {

// ------------------------------------------------------------------ the lock (device.cc)
// Every entry point holds it (GUARD). t_depth: how deep this thread holds it, so that a host
// function that must wait for another thread (cudasim_block) can release it whole and take
// it back.
extern std::recursive_mutex g_lock;
extern thread_local int t_depth;
struct DriverLock {
  DriverLock() {
    g_lock.lock();
    ++t_depth;
  }
  ~DriverLock() {
    --t_depth;
    g_lock.unlock();
  }
  DriverLock(const DriverLock&) = delete;
  DriverLock& operator=(const DriverLock&) = delete;
};

void say(const char* f, ...) __attribute__((format(printf, 1, 2)));
bool sim_on();

// ------------------------------------------------------------------ device properties (device.cc)
struct Props {
  std::string name = "NVIDIA H200 (simulated)";
  long long grid[3] = {2147483647, 65535, 65535}, block[3] = {1024, 1024, 64};
  long long regs_per_block = 65536, sms = 132, warp = 32, shared = 49152, shared_optin = 232448;
  long long reserved_shared = 1024, regs_per_sm = 65536, ctas_per_sm = 32, threads_per_block = 1024;
  long long threads_per_sm = 2048, total_mem = 150754820096LL, clock = 1980000, mem_clock = 3201000;
  long long bus = 6144, l2 = 62914560, device_ver = 900;
};
const Props& props();
// The folder this library was loaded from.
std::string sim_dir();
// Reads a regular file whole (see device.cc).
bool read_file(const std::string& path, std::string& out);
// The device-properties document the device's limits come from.
std::string devprops_path();

// ------------------------------------------------------------------ memory (memory.cc)
struct Alloc {
  size_t size;
  bool host;  // page-locked host memory (cuMemHostAlloc)
};
extern size_t g_allocated;
// The kernel running now, for fault reports.
extern const char* volatile g_running;
// The live allocation holding [p, p + n), or null.
const Alloc* find_alloc(uint64_t p, size_t n, uint64_t* base = nullptr);
// Where `p` lies: in a freed allocation (named), or in none.
std::string describe(uint64_t p);
// CUDA_ERROR_INVALID_VALUE (said) unless [p, p + n) lies in one live allocation.
CUresult check_range(const char* op, uint64_t p, size_t n);
CUresult do_alloc(uint64_t* out, size_t n, bool host);
CUresult do_free(const char* op, uint64_t p, bool host);
// [p, p + n) lies in page-locked host memory.
bool is_pinned(uint64_t p, size_t n);

// ------------------------------------------------------------------ modules (modules.cc)
struct Function {
  std::string name;
  int (*launch)(const cudasim_launch*);
  const cudasim_signature* sig;
  int max_dynamic_shared = -1;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
};
struct Module {
  void* so;
  std::map<std::string, Function*> functions;
};
// Compiles the program text an image carries for the host (cached) and loads it.
CUresult load_module(const void* image, Module** out);

// ------------------------------------------------------------------ streams, events, graphs (queue.cc)
struct Op {
  // RECORD, WAIT and FREE exist only in the adversarial mode's stream queues.
  enum Kind { KERNEL, COPY, SET, HOST, RECORD, WAIT, FREE } kind = KERNEL;
  Function* f = nullptr;
  dim3 grid, block;
  unsigned shared = 0;
  std::vector<std::vector<char>> params;
  uint64_t dst = 0, src = 0;
  size_t n = 0;
  unsigned char value = 0;
  CUhostFn fn = nullptr;
  void* data = nullptr;
  std::shared_ptr<std::vector<char>> staged;  // pageable host data copied at enqueue time
  struct Event* event = nullptr;
  uint64_t gen = 0;  // RECORD: this record's number; WAIT: the record it waits for
  std::thread::id by;  // the thread that enqueued it
  struct Stream* from = nullptr;  // WAIT: the stream its record was enqueued on
};
// A user object (cuUserObjectCreate): a resource whose destructor runs when its last
// reference is released, by its creator or by the graphs that retain it.
struct UserObject {
  void* ptr;
  CUhostFn destroy;
  unsigned refs;
};
void release_user_object(UserObject* o, unsigned n);
struct Graph {
  std::vector<Op> ops;
  // The user objects this graph (or graph exec) holds references to, and how many each; an
  // instantiation takes its own references, so a graph exec outlives its graph safely.
  std::map<UserObject*, unsigned> owned;
  Graph() = default;
  Graph(const Graph& g) : ops(g.ops), owned(g.owned) {
    for (auto& [o, n] : owned) o->refs += n;
  }
  Graph& operator=(const Graph&) = delete;
  void retain(UserObject* o, unsigned n, bool moved) {
    if (!moved) o->refs += n;
    owned[o] += n;
  }
  ~Graph() {
    for (auto& [o, n] : owned) release_user_object(o, n);
  }
};
struct Stream {
  Graph* capture = nullptr;  // recording into this graph
  bool invalidated = false;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  std::thread::id thread;  // the thread that began the capture
  Stream* origin = nullptr;  // the stream the capture began on (itself, or one it joined)
  std::deque<std::pair<uint64_t, Op>> queue;  // adversarial mode: work not run yet, by number
  // A host function of this stream is blocked in cudasim_block (the driver released): no
  // other thread runs this stream's later work, and a synchronize of it waits.
  int busy = 0;
  std::thread::id busy_for;  // the thread that enqueued that host function
};
struct Event {
  bool recorded = false;
  std::chrono::steady_clock::time_point at;
  uint64_t enqueued = 0, done = 0;  // records enqueued, records executed
  Stream* where = nullptr;          // the stream of the last record
  Graph* captured = nullptr;        // the capture its last record belongs to, if any
};

extern Stream g_null_stream;
extern std::set<Stream*> g_streams;
extern std::set<Stream*> g_per_thread;
extern int g_captures;  // active captures
// A fault in work already enqueued (a host function reported one through cudasim_fault): as
// after a kernel fault on the device, the context is unusable and the calls that report
// asynchronous errors (synchronizes, queries, copies, launches) return it from then on.
extern CUresult g_fault;
#define STICKY() \
  if (g_fault != CUDA_SUCCESS) return g_fault

Stream* stream_of(CUstream s);
CUresult refuse_in_capture(const char* op);
// The stream whose host function this thread is running, the thread that enqueued it, and
// whether what this thread runs may be deferred (see queue.cc).
extern thread_local Stream* t_host_stream;
extern thread_local std::thread::id t_host_for;
extern thread_local bool t_may_defer;
extern thread_local bool t_deferred;
void wake();
// A stream is busy while a thread runs an op of it that releases the driver (a blocked host
// function, an event wait): no other thread runs its later work or returns from a
// synchronize of it. `by`: the thread whose work it is (see flush_all).
void hold_busy(Stream* s, std::thread::id by);
void release_busy(Stream* s);
int release_driver();
void retake_driver(int d);
CUresult run_op(const Op& op, Stream* on);
bool adversarial();
CUresult flush(Stream* s, const Event* until = nullptr, uint64_t gen = 0);
CUresult flush_all();
CUresult submit(CUstream s, Op&& op);

// ------------------------------------------------------------------ the context (api_device.cc)
extern int g_ctx_tag;  // the one context's handle points here
#define CTX reinterpret_cast<CUcontext>(&::cudasim::g_ctx_tag)
extern thread_local bool t_current;

}  // namespace cudasim

#define GUARD()                                            \
  if (!::cudasim::sim_on()) return CUDA_ERROR_NO_DEVICE; \
  ::cudasim::DriverLock lk
