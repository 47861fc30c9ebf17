// libnccl.so.2 of the simulated device (docs/simulator.md): the NCCL entry points amp calls,
// for communicators whose ranks are threads of this process, on the simulated driver
// (tools/sim/driver/). Without CUDNN_CBR_DEVICE=sim it makes no ids and no communicators.
//
// - Ids are 128 random bytes. ncclCommInitRank joins the group of its id (a process-wide
//   registry) and blocks until all nranks ranks have joined, as NCCL's does.
// - A collective is checked at the call (the buffers lie in live allocations, the
//   arguments are valid) and enqueued on the caller's stream as a host function
//   (cuLaunchHostFunc), so it runs in stream order and a capture records it (each replay
//   runs it again). When it runs it takes the communicator's next sequence number; the
//   collectives of the ranks with the same number form one collective. Each rank's host
//   function waits (cudasim_block: the driver released, its stream busy) until every rank's
//   has run; the last one computes the result from every rank's send buffer, in rank order,
//   and each then writes its own receive buffer.
// - ncclCommAbort ends the waits of its group (the peers record an asynchronous error);
//   ncclCommGetAsyncError reports a communicator's.
#include <cuda.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#define API extern "C" __attribute__((visibility("default")))

// nccl.h's types (2.x), declared here: the stand-in needs no NCCL headers.
typedef struct {
  char internal[128];
} ncclUniqueId;
struct ncclComm;
typedef struct ncclComm* ncclComm_t;
enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};
enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
};
enum { kAllReduce = 0, kBroadcast = 1 };

// The version reported: NCCL 2.27.3, whose semantics these calls follow.
constexpr int kVersion = 22703;

namespace {

thread_local std::string t_last;  // ncclGetLastError

// Records `f` as the last error and returns `code`; `loud` also prints it on stderr.
int fail(int code, bool loud, const char* f, ...) __attribute__((format(printf, 3, 4)));
int fail(int code, bool loud, const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  t_last = buf;
  if (loud) fprintf(stderr, "cudnn-cbr simulated NCCL: %s\n", buf);
  return code;
}

bool sim_on() {
  const char* d = getenv("CUDNN_CBR_DEVICE");
  return d && strcmp(d, "sim") == 0;
}

int not_simulated(const char* op) {
  return fail(ncclInvalidUsage, false,
              "%s: the simulated NCCL runs only on the simulated device (CUDNN_CBR_DEVICE=sim)", op);
}

// ------------------------------------------------------------------ the simulated driver
struct Driver {
  CUresult (*launch_host)(CUstream, CUhostFn, void*);
  CUresult (*is_capturing)(CUstream, CUstreamCaptureStatus*);
  int (*allocation_of)(uint64_t, uint64_t*, uint64_t*);
  void (*fault)(const char*);
  int (*block)(int (*)(void*), void*);  // 1 ready, 0 the context faulted, -1 deferred
};

// The simulated driver this process uses (loaded by cudarc under its soname; else the
// libcuda.so next to this library), or null with why in t_last.
const Driver* driver() {
  static Driver d;
  static std::string why;
  static const bool ok = [] {
    void* h = dlopen("libcudnn_cbr_sim_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    if (!h) {
      Dl_info info;
      std::string dir = ".";
      if (dladdr((void*)&driver, &info) && info.dli_fname) {
        dir = info.dli_fname;
        const size_t s = dir.rfind('/');
        dir = s == std::string::npos ? "." : dir.substr(0, s);
      }
      h = dlopen((dir + "/libcuda.so").c_str(), RTLD_NOW);
    }
    if (!h) {
      why = std::string("the simulated driver is not loadable: ") + dlerror();
      return false;
    }
    bool all = true;
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      if (!f) {
        why = std::string("the simulated driver lacks ") + name;
        all = false;
      }
    };
    sym(d.launch_host, "cuLaunchHostFunc");
    sym(d.is_capturing, "cuStreamIsCapturing");
    sym(d.allocation_of, "cudasim_allocation_of");
    sym(d.fault, "cudasim_fault");
    sym(d.block, "cudasim_block");
    return all;
  }();
  if (!ok) {
    t_last = why;
    return nullptr;
  }
  return &d;
}

// ------------------------------------------------------------------ element types
size_t type_size(int t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

float bits_to_float(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
uint32_t float_to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

// binary16 <-> float, rounding to nearest even (NaN canonical), as the GPU's cvt.
float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {
    const float v = std::ldexp((float)m, -24);
    return sign ? -v : v;
  }
  if (e == 31) return bits_to_float(sign | 0x7f800000u | (m << 13));
  return bits_to_float(sign | ((e - 15 + 127) << 23) | (m << 13));
}
uint16_t float_to_half(float f) {
  const uint32_t x = float_to_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00;  // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00;  // from 65520 up: infinity
  if (ax < 0x38800000u) {                       // below 2^-14: a subnormal (or zero)
    // A multiple of 2^-24: the scaling is exact, nearbyint rounds to even.
    return sign | (uint16_t)std::nearbyint(bits_to_float(ax) * 16777216.0f);
  }
  uint32_t h = ((((ax >> 23) - 127 + 15)) << 10) | ((ax & 0x7fffff) >> 13);
  const uint32_t rest = ax & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry rounds into the exponent
  return sign | (uint16_t)h;
}
float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }
uint16_t float_to_bf16(float f) {
  const uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  // quiet NaN
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

template <class T>
T apply(int op, T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // sums and products wrap, as on the device
    switch (op) {
      case ncclProd: return (T)(U)((U)a * (U)b);
      case ncclMax: return a > b ? a : b;
      case ncclMin: return a < b ? a : b;
      default: return (T)(U)((U)a + (U)b);  // ncclSum, ncclAvg (divided after)
    }
  } else {
    switch (op) {
      case ncclProd: return a * b;
      case ncclMax: return std::fmax(a, b);
      case ncclMin: return std::fmin(a, b);
      default: return a + b;
    }
  }
}

// out[i] = in[0][i] op in[1][i] op ... in rank order, each step in T's arithmetic. ncclAvg as
// NCCL's: integers summed then divided; floating inputs first multiplied by 1/nranks.
template <class T>
void reduce_native(int op, const std::vector<const void*>& in, void* out, size_t count) {
  const size_t n = in.size();
  T* o = static_cast<T*>(out);
  const T scale = std::is_integral_v<T> ? T(1) : T(1) / T(n);
  auto load = [&](size_t r, size_t i) {
    T v;
    memcpy(&v, static_cast<const char*>(in[r]) + i * sizeof(T), sizeof(T));
    if constexpr (!std::is_integral_v<T>)
      if (op == ncclAvg) v = v * scale;
    return v;
  };
  for (size_t i = 0; i < count; ++i) {
    T acc = load(0, i);
    for (size_t r = 1; r < n; ++r) acc = apply<T>(op, acc, load(r, i));
    if constexpr (std::is_integral_v<T>)
      if (op == ncclAvg) acc = (T)(acc / (T)n);
    memcpy(&o[i], &acc, sizeof(T));
  }
}

// The same for a 16-bit floating type: each step converts to float, applies the op in float
// and rounds the result back to the type (nearest even), as NCCL's __hadd/__hmax do.
void reduce_half(int op, const std::vector<const void*>& in, void* out, size_t count, bool bf16) {
  auto to_f = bf16 ? bf16_to_float : half_to_float;
  auto to_h = bf16 ? float_to_bf16 : float_to_half;
  const size_t n = in.size();
  const float scale = to_f(to_h(1.0f / (float)n));
  auto load = [&](size_t r, size_t i) {
    uint16_t v;
    memcpy(&v, static_cast<const char*>(in[r]) + 2 * i, 2);
    return op == ncclAvg ? to_h(to_f(v) * scale) : v;
  };
  uint16_t* o = static_cast<uint16_t*>(out);
  for (size_t i = 0; i < count; ++i) {
    uint16_t acc = load(0, i);
    for (size_t r = 1; r < n; ++r) acc = to_h(apply<float>(op, to_f(acc), to_f(load(r, i))));
    memcpy(&o[i], &acc, 2);
  }
}

void reduce(int type, int op, const std::vector<const void*>& in, void* out, size_t count) {
  switch (type) {
    case ncclInt8: return reduce_native<int8_t>(op, in, out, count);
    case ncclUint8: return reduce_native<uint8_t>(op, in, out, count);
    case ncclInt32: return reduce_native<int32_t>(op, in, out, count);
    case ncclUint32: return reduce_native<uint32_t>(op, in, out, count);
    case ncclInt64: return reduce_native<int64_t>(op, in, out, count);
    case ncclUint64: return reduce_native<uint64_t>(op, in, out, count);
    case ncclFloat16: return reduce_half(op, in, out, count, false);
    case ncclFloat32: return reduce_native<float>(op, in, out, count);
    case ncclFloat64: return reduce_native<double>(op, in, out, count);
    case ncclBfloat16: return reduce_half(op, in, out, count, true);
  }
}

const char* op_name(int kind) { return kind == kAllReduce ? "ncclAllReduce" : "ncclBroadcast"; }

// ------------------------------------------------------------------ groups and collectives
struct Collective {
  int kind = -1, type = 0, op = 0, root = 0;
  size_t count = 0;
  std::vector<const void*> send;
  int arrived = 0, finished = 0;
  bool done = false;
  std::string problem;       // set when the ranks' calls disagree
  std::vector<char> result;  // computed by the last rank to arrive
};

struct Group {
  int nranks;
  std::vector<ncclComm*> members;
  int joined = 0;
  bool formed = false;
  std::string aborted;  // why the group's collectives end unfinished (a rank aborted)
  std::map<uint64_t, Collective> running;  // by sequence number
};

// The registry's lock: the groups, communicators and collectives. Nothing calls the driver
// while holding it (the driver's lock may be held when it is taken, never the reverse).
// Never destroyed: a thread may still wait on it when the process ends (a group that never
// formed).
std::mutex& M = *new std::mutex;
std::condition_variable& CV = *new std::condition_variable;
std::map<std::string, Group*>& g_forming = *new std::map<std::string, Group*>;

}  // namespace

// One rank's communicator. Kept for the process's life (so that a replay of a captured
// collective after ncclCommDestroy is reported, not a use after free).
struct ncclComm {
  Group* group = nullptr;
  int rank = 0;
  uint64_t next = 0;  // the sequence number of the next collective to run
  bool aborted = false, destroyed = false;
  int async = ncclSuccess;
  std::string async_message;
};

namespace {

// One enqueued collective: the host function's data. Freed after it runs, unless a capture
// recorded it (then it is kept for the replays, for the process's life).
struct Call {
  ncclComm* comm;
  int kind, type, op, root;
  const void* send;
  void* recv;
  size_t count;
  bool captured;
  bool joined = false;  // this run has its collective's sequence number (`seq`)
  uint64_t seq = 0;
};

// Where [p, p + n) fails to lie in one live allocation, or "".
std::string out_of_bounds(const Driver* d, const char* what, const void* p, size_t n) {
  uint64_t base = 0, len = 0;
  char buf[256];
  if (!d->allocation_of((uint64_t)p, &base, &len)) {
    snprintf(buf, sizeof buf, "%s 0x%llx is not in any live allocation", what,
             (unsigned long long)(uintptr_t)p);
    return buf;
  }
  if ((uint64_t)p + n > base + len) {
    snprintf(buf, sizeof buf,
             "%s: %zu bytes at 0x%llx overrun the allocation 0x%llx of %llu bytes (%llu bytes "
             "past its end)",
             what, n, (unsigned long long)(uintptr_t)p, (unsigned long long)base,
             (unsigned long long)len, (unsigned long long)((uint64_t)p + n - base - len));
    return buf;
  }
  return "";
}

// The buffer problems of a call, or "".
std::string check_buffers(const Driver* d, const Call& c, int nranks) {
  const size_t bytes = c.count * type_size(c.type);
  char who[128];
  snprintf(who, sizeof who, "%s (rank %d of %d): ", op_name(c.kind), c.comm->rank, nranks);
  const bool reads = c.kind == kAllReduce || c.comm->rank == c.root;
  if (reads) {
    std::string s = out_of_bounds(d, "sendbuff", c.send, bytes);
    if (!s.empty()) return who + s;
  }
  std::string r = out_of_bounds(d, "recvbuff", c.recv, bytes);
  if (!r.empty()) return who + r;
  const char* a = static_cast<const char*>(c.send);
  const char* b = static_cast<const char*>(c.recv);
  if (reads && a != b && a < b + bytes && b < a + bytes)
    return who + std::string("sendbuff and recvbuff overlap without being the same (in place)");
  return "";
}

struct Wait {
  Group* g;
  uint64_t seq;
};
// cudasim_block's test: the collective is complete (or the group aborted). Waits a little.
int ready(void* arg) {
  const Wait* w = static_cast<const Wait*>(arg);
  std::unique_lock<std::mutex> l(M);
  auto done = [&] { return w->g->running[w->seq].done || !w->g->aborted.empty(); };
  CV.wait_for(l, std::chrono::milliseconds(5), done);
  return done();
}

// The host function: one rank's part of a collective, in stream order. False when the
// driver deferred it (run by a device-wide flush for another thread): it is run again,
// already joined, and waits then.
bool run(Call& c) {
  const Driver* d = driver();
  ncclComm* comm = c.comm;
  Group* g = comm->group;
  std::unique_lock<std::mutex> l(M, std::defer_lock);
  if (!c.joined) {
    // Checked again at each run: the buffers may be gone at a replay.
    const std::string problem = check_buffers(d, c, g->nranks);
    l.lock();
    if (comm->aborted) return true;  // pending work of an aborted communicator does not run
    if (comm->destroyed && c.captured) {  // (work enqueued before the destroy still runs)
      l.unlock();
      char msg[160];
      snprintf(msg, sizeof msg, "%s on a destroyed communicator (rank %d of %d), replayed from "
               "a CUDA graph", op_name(c.kind), comm->rank, g->nranks);
      d->fault(msg);
      return true;
    }
    c.seq = comm->next++;
    c.joined = true;
    Collective& k = g->running[c.seq];
    if (k.kind < 0) {
      k.kind = c.kind, k.type = c.type, k.op = c.op, k.root = c.root, k.count = c.count;
      k.send.assign(g->nranks, nullptr);
    } else if (k.problem.empty() && (k.kind != c.kind || k.type != c.type || k.op != c.op ||
                                     k.root != c.root || k.count != c.count)) {
      char msg[256];
      snprintf(msg, sizeof msg,
               "collective %llu: rank %d called %s (type %d, op %d, root %d, count %zu), "
               "another rank %s (type %d, op %d, root %d, count %zu)",
               (unsigned long long)c.seq, comm->rank, op_name(c.kind), c.type, c.op, c.root,
               c.count, op_name(k.kind), k.type, k.op, k.root, k.count);
      k.problem = msg;
    }
    if (!problem.empty() && k.problem.empty()) k.problem = problem;
    k.send[comm->rank] = c.send;
    if (++k.arrived == g->nranks) {
      if (k.problem.empty()) {
        k.result.resize(k.count * type_size(k.type));
        if (k.kind == kAllReduce)
          reduce(k.type, k.op, k.send, k.result.data(), k.count);
        else
          memcpy(k.result.data(), k.send[k.root], k.result.size());
      }
      k.done = true;
      CV.notify_all();
    }
  } else {
    l.lock();
  }
  Collective& k = g->running[c.seq];
  if (!k.done && g->aborted.empty() && !comm->aborted) {
    l.unlock();
    Wait w{g, c.seq};
    const int ok = d->block(ready, &w);  // the driver released, this stream busy
    l.lock();
    if (ok < 0) return false;  // deferred: run again later
    if (ok == 0) {             // the context faulted: nothing more runs
      c.joined = false;
      return true;
    }
  }
  c.joined = false;
  if (comm->aborted) return true;
  if (!k.done) {  // a rank aborted the group
    comm->async = ncclRemoteError;
    comm->async_message = g->aborted;
    return true;
  }
  std::string report;
  if (!k.problem.empty()) {
    comm->async = ncclInvalidUsage;
    comm->async_message = k.problem;
    if (k.finished == 0) report = k.problem;  // the first rank to finish reports it
  } else {
    memcpy(c.recv, k.result.data(), k.result.size());
  }
  if (++k.finished == g->nranks) g->running.erase(c.seq);
  l.unlock();
  if (!report.empty()) d->fault(report.c_str());
  return true;
}

void run_call(void* data) {
  Call* c = static_cast<Call*>(data);
  if (run(*c) && !c->captured) delete c;
}

int enqueue(int kind, const void* send, void* recv, size_t count, int type, int op, int root,
            ncclComm_t comm, CUstream stream) {
  const char* name = op_name(kind);
  if (!sim_on()) return not_simulated(name);
  const Driver* d = driver();
  if (!d) return fail(ncclSystemError, true, "%s: %s", name, t_last.c_str());
  if (!comm) return fail(ncclInvalidArgument, true, "%s: comm is null", name);
  int nranks;
  {
    std::lock_guard<std::mutex> l(M);
    if (comm->aborted || comm->destroyed)
      return fail(ncclInvalidUsage, true, "%s: the communicator (rank %d) was %s", name,
                  comm->rank, comm->aborted ? "aborted" : "destroyed");
    nranks = comm->group->nranks;
  }
  if (type_size(type) == 0)
    return fail(ncclInvalidArgument, true, "%s: datatype %d is not simulated", name, type);
  if (kind == kAllReduce && (op < ncclSum || op > ncclAvg))
    return fail(ncclInvalidArgument, true, "%s: reduction op %d is not simulated", name, op);
  if (kind == kBroadcast && (root < 0 || root >= nranks))
    return fail(ncclInvalidArgument, true, "%s: root %d is not a rank of %d", name, root, nranks);
  if (count == 0) return ncclSuccess;  // nothing is enqueued, as NCCL does
  Call* c = new Call{comm, kind, type, op, root, send, recv, count, false};
  const std::string problem = check_buffers(d, *c, nranks);
  if (!problem.empty()) {
    delete c;
    return fail(ncclInvalidArgument, true, "%s", problem.c_str());
  }
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (d->is_capturing(stream, &status) != CUDA_SUCCESS) {
    delete c;
    return fail(ncclUnhandledCudaError, true, "%s: cuStreamIsCapturing failed", name);
  }
  c->captured = status != CU_STREAM_CAPTURE_STATUS_NONE;
  if (CUresult r = d->launch_host(stream, run_call, c)) {
    delete c;
    return fail(ncclUnhandledCudaError, true, "%s: cuLaunchHostFunc failed (CUresult %d)", name,
                (int)r);
  }
  return ncclSuccess;
}

}  // namespace

// ------------------------------------------------------------------ entry points
API int ncclGetVersion(int* version) {
  if (!version) return fail(ncclInvalidArgument, false, "ncclGetVersion: version is null");
  *version = kVersion;
  return ncclSuccess;
}

API int ncclGetUniqueId(ncclUniqueId* id) {
  if (!sim_on()) return not_simulated("ncclGetUniqueId");
  if (!id) return fail(ncclInvalidArgument, true, "ncclGetUniqueId: id is null");
  static std::mutex m;
  static std::mt19937_64* rng = [] {
    std::random_device rd;
    std::seed_seq seed{rd(), rd(), rd(), rd(), rd(), rd(), rd(), rd()};
    return new std::mt19937_64(seed);
  }();
  std::lock_guard<std::mutex> l(m);
  for (size_t i = 0; i < sizeof id->internal; i += 8) {
    const uint64_t v = (*rng)();
    memcpy(id->internal + i, &v, 8);
  }
  return ncclSuccess;
}

// Joins the group of `id` as `rank` of `nranks` and blocks until every rank has joined.
API int ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  if (!sim_on()) return not_simulated("ncclCommInitRank");
  if (!out) return fail(ncclInvalidArgument, true, "ncclCommInitRank: comm is null");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(ncclInvalidArgument, true, "ncclCommInitRank: rank %d is not a rank of %d", rank,
                nranks);
  const std::string key(id.internal, sizeof id.internal);
  std::unique_lock<std::mutex> l(M);
  Group*& g = g_forming[key];
  if (!g) {
    g = new Group();
    g->nranks = nranks;
    g->members.assign(nranks, nullptr);
  }
  Group* group = g;
  if (group->nranks != nranks)
    return fail(ncclInvalidArgument, true,
                "ncclCommInitRank: rank %d joins with nranks %d, the group of this id has %d",
                rank, nranks, group->nranks);
  if (group->members[rank])
    return fail(ncclInvalidUsage, true,
                "ncclCommInitRank: rank %d of %d joined the group of this id twice", rank, nranks);
  ncclComm* c = new ncclComm();
  c->group = group;
  c->rank = rank;
  group->members[rank] = c;
  if (++group->joined == nranks) {
    group->formed = true;
    g_forming.erase(key);  // the id is spent: a later init with it makes a new group
    CV.notify_all();
  }
  CV.wait(l, [&] { return group->formed; });  // like NCCL's: no timeout
  *out = c;
  return ncclSuccess;
}

API int ncclAllReduce(const void* send, void* recv, size_t count, int type, int op,
                      ncclComm_t comm, CUstream stream) {
  return enqueue(kAllReduce, send, recv, count, type, op, 0, comm, stream);
}

API int ncclBroadcast(const void* send, void* recv, size_t count, int type, int root,
                      ncclComm_t comm, CUstream stream) {
  return enqueue(kBroadcast, send, recv, count, type, 0, root, comm, stream);
}

// Frees the communicator (kept for the process, marked destroyed): the collectives enqueued
// before still run; a captured one replayed afterwards faults the context.
API int ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  std::lock_guard<std::mutex> l(M);
  if (comm->destroyed) return fail(ncclInvalidUsage, true, "ncclCommDestroy: destroyed twice");
  comm->destroyed = true;
  return ncclSuccess;
}

// Ends the communicator without waiting for its peers: its pending collectives do not run,
// and those of its group that wait for it end (each peer records ncclRemoteError).
API int ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  std::lock_guard<std::mutex> l(M);
  comm->aborted = true;
  comm->destroyed = true;
  Group* g = comm->group;
  if (g->aborted.empty()) {
    char msg[128];
    snprintf(msg, sizeof msg, "rank %d of %d aborted its communicator", comm->rank, g->nranks);
    g->aborted = msg;
  }
  CV.notify_all();
  return ncclSuccess;
}

API int ncclCommGetAsyncError(ncclComm_t comm, int* state) {
  if (!comm || !state) return fail(ncclInvalidArgument, false, "ncclCommGetAsyncError: null");
  std::lock_guard<std::mutex> l(M);
  *state = comm->async;
  if (comm->async != ncclSuccess) t_last = comm->async_message;
  return ncclSuccess;
}

API int ncclCommCount(ncclComm_t comm, int* count) {
  if (!comm || !count) return fail(ncclInvalidArgument, false, "ncclCommCount: null");
  *count = comm->group->nranks;
  return ncclSuccess;
}

API int ncclCommUserRank(ncclComm_t comm, int* rank) {
  if (!comm || !rank) return fail(ncclInvalidArgument, false, "ncclCommUserRank: null");
  *rank = comm->rank;
  return ncclSuccess;
}

API const char* ncclGetErrorString(int code) {
  switch (code) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

API const char* ncclGetLastError(ncclComm_t) { return t_last.c_str(); }
