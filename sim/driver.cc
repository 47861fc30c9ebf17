// libcuda.so of the simulated device: the driver entry points cudarc calls, answered on the
// host (docs/simulator.md). Without CUDNN_CBR_DEVICE=sim every call says "no device", like
// scripts/nodriver/libcuda_stub.c. Its soname is not libcuda.so.1, so cuDNN (which opens
// libcuda.so.1) keeps getting the no-driver stand-in while cudarc (which tries libcuda.so
// first) gets this library.
//
// Execution is eager and in enqueue order (which honours every stream order and event wait);
// a stream under capture records instead, and a graph launch replays what was recorded.
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "include/cuda_on_cpu.h"
#include "translate.h"

// cuda.h maps these names to their _v2 versions; both are exported here.
#undef cuDeviceGetUuid
#undef cuEventElapsedTime

#define API extern "C" __attribute__((visibility("default")))

namespace {

std::recursive_mutex g_lock;
// How deep this thread holds g_lock, so that a host function that must wait for another
// thread (cudasim_block) can release it whole and take it back.
thread_local int t_depth = 0;
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

void say(const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  fprintf(stderr, "cudnn-cbr simulated device: ");
  vfprintf(stderr, f, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

bool sim_on() {
  const char* d = getenv("CUDNN_CBR_DEVICE");
  return d && strcmp(d, "sim") == 0;
}

// ------------------------------------------------------------------ device properties
struct Props {
  std::string name = "NVIDIA H200 (simulated)";
  long long grid[3] = {2147483647, 65535, 65535}, block[3] = {1024, 1024, 64};
  long long regs_per_block = 65536, sms = 132, warp = 32, shared = 49152, shared_optin = 232448;
  long long reserved_shared = 1024, regs_per_sm = 65536, ctas_per_sm = 32, threads_per_block = 1024;
  long long threads_per_sm = 2048, total_mem = 150754820096LL, clock = 1980000, mem_clock = 3201000;
  long long bus = 6144, l2 = 62914560, device_ver = 900;
};

std::string sim_dir() {
  Dl_info info;
  if (dladdr((void*)&sim_dir, &info) && info.dli_fname) {
    std::string p = info.dli_fname;
    const size_t s = p.rfind('/');
    return s == std::string::npos ? "." : p.substr(0, s);
  }
  return ".";
}

// Regular files only, opened without blocking: a FIFO given as CUDNN_CBR_SIM_DEVPROPS would
// otherwise block the process in fopen until a writer came.
bool read_file(const std::string& path, std::string& out) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return false;
  }
  FILE* f = fdopen(fd, "rb");
  if (!f) {
    close(fd);
    return false;
  }
  char buf[65536];
  size_t n;
  out.clear();
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  fclose(f);
  return true;
}

long long json_num(const std::string& j, const char* key, long long dflt, int index = -1) {
  const std::string k = std::string("\"") + key + "\"";
  size_t p = j.find(k);
  if (p == std::string::npos) return dflt;
  p = j.find(':', p) + 1;
  if (index >= 0) {
    p = j.find('[', p) + 1;
    for (int i = 0; i < index; ++i) p = j.find(',', p) + 1;
  }
  return strtoll(j.c_str() + p, nullptr, 10);
}

// The device-properties document the device's limits come from: CUDNN_CBR_SIM_DEVPROPS, or
// devprops.json next to this library.
std::string devprops_path() {
  const char* env = getenv("CUDNN_CBR_SIM_DEVPROPS");
  return env && *env ? env : sim_dir() + "/devprops.json";
}

const Props& props() {
  static Props p;
  static bool loaded = false;
  if (loaded) return p;
  loaded = true;
  const std::string path = devprops_path();
  std::string j;
  if (!read_file(path, j)) {
    say("no device-properties fixture (a regular file) at %s: using built-in H200 values",
        path.c_str());
    return p;
  }
  for (int i = 0; i < 3; ++i) {
    p.grid[i] = json_num(j, "maxGridSize", p.grid[i], i);
    p.block[i] = json_num(j, "maxBlockSize", p.block[i], i);
  }
  p.regs_per_block = json_num(j, "regsPerBlock", p.regs_per_block);
  p.sms = json_num(j, "multiProcessorCount", p.sms);
  p.warp = json_num(j, "warpSize", p.warp);
  p.shared = json_num(j, "maxSharedMemoryPerBlock", p.shared);
  p.shared_optin = json_num(j, "maxSharedMemoryPerBlockOptin", p.shared_optin);
  p.reserved_shared = json_num(j, "reservedSharedMemoryPerBlock", p.reserved_shared);
  p.regs_per_sm = json_num(j, "maxRegistersPerSM", p.regs_per_sm);
  p.ctas_per_sm = json_num(j, "maxCtasPerSM", p.ctas_per_sm);
  p.threads_per_block = json_num(j, "maxThreadsPerBlock", p.threads_per_block);
  p.threads_per_sm = json_num(j, "maxThreadsPerSM", p.threads_per_sm);
  p.total_mem = json_num(j, "totalGlobalMem", p.total_mem);
  p.clock = json_num(j, "smClockRateKHz", p.clock);
  p.mem_clock = json_num(j, "memClockRateKHz", p.mem_clock);
  p.bus = json_num(j, "memoryBusWidth", p.bus);
  p.l2 = json_num(j, "l2CacheSize", p.l2);
  p.device_ver = json_num(j, "deviceVer", p.device_ver);
  const size_t n = j.find("\"deviceName\"");
  if (n != std::string::npos) {
    const size_t a = j.find('"', j.find(':', n) + 1) + 1;
    p.name = j.substr(a, j.find('"', a) - a) + " (simulated)";
  }
  return p;
}

// ------------------------------------------------------------------ memory
struct Alloc {
  size_t size;
  bool host;  // page-locked host memory (cuMemHostAlloc)
};
std::map<uint64_t, Alloc> g_allocs;
std::map<uint64_t, size_t> g_freed;  // recently freed ranges, to name them in errors
size_t g_allocated = 0;

// The live allocation holding [p, p + n), or null.
const Alloc* find_alloc(uint64_t p, size_t n, uint64_t* base = nullptr) {
  auto it = g_allocs.upper_bound(p);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  if (p + n > it->first + it->second.size || p < it->first) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

std::string describe(uint64_t p) {
  char buf[160];
  auto it = g_freed.upper_bound(p);
  if (it != g_freed.begin()) {
    --it;
    if (p < it->first + it->second) {
      snprintf(buf, sizeof buf, "0x%llx lies in a freed allocation (0x%llx, %zu bytes)",
               (unsigned long long)p, (unsigned long long)it->first, it->second);
      return buf;
    }
  }
  snprintf(buf, sizeof buf, "0x%llx is not in any live allocation", (unsigned long long)p);
  return buf;
}

CUresult check_range(const char* op, uint64_t p, size_t n) {
  if (n == 0) return CUDA_SUCCESS;
  if (find_alloc(p, n)) return CUDA_SUCCESS;
  uint64_t base;
  if (const Alloc* a = find_alloc(p, 1, &base)) {
    say("%s: %zu bytes at 0x%llx overrun the allocation 0x%llx of %zu bytes", op, n,
        (unsigned long long)p, (unsigned long long)base, a->size);
  } else {
    say("%s: %s", op, describe(p).c_str());
  }
  return CUDA_ERROR_INVALID_VALUE;
}

constexpr size_t kPage = 4096;
struct Mapping {
  void* base;
  size_t len;
};
std::map<uint64_t, Mapping> g_maps;  // device allocation -> its mapping (data + guard page)
std::deque<Mapping> g_quarantine;    // freed device mappings, inaccessible
const char* volatile g_running = nullptr;  // the kernel running now, for fault reports
struct sigaction g_old_segv, g_old_bus;

// A fault in a guard page or a freed allocation: names it, then hands the fault to the
// handler that was there before (the process ends as it would have).
void on_fault(int sig, siginfo_t* info, void* uc) {
  const uint64_t a = (uint64_t)info->si_addr;
  char msg[512];
  int len = 0;
  for (const auto& [p, al] : g_allocs) {
    const auto m = g_maps.find(p);
    if (m == g_maps.end()) continue;
    const uint64_t end = (uint64_t)m->second.base + m->second.len;
    if (a >= p + al.size && a < end) {
      len = snprintf(msg, sizeof msg,
                     "cudnn-cbr simulated device: %s accessed 0x%llx, %llu bytes past the end "
                     "of the allocation 0x%llx of %zu bytes\n",
                     g_running ? g_running : "the host", (unsigned long long)a,
                     (unsigned long long)(a - p - al.size), (unsigned long long)p, al.size);
      break;
    }
  }
  if (len == 0) {
    for (const Mapping& m : g_quarantine) {
      if (a >= (uint64_t)m.base && a < (uint64_t)m.base + m.len) {
        len = snprintf(msg, sizeof msg,
                       "cudnn-cbr simulated device: %s accessed 0x%llx in freed device memory\n",
                       g_running ? g_running : "the host", (unsigned long long)a);
        break;
      }
    }
  }
  if (len > 0 && write(2, msg, (size_t)len) < 0) {
  }
  sigaction(SIGSEGV, &g_old_segv, nullptr);  // the fault recurs under the previous handler
  sigaction(SIGBUS, &g_old_bus, nullptr);
  (void)sig;
  (void)uc;
}

void install_fault_handler() {
  static bool done = false;
  if (done) return;
  done = true;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
}

CUresult do_alloc(uint64_t* out, size_t n, bool host) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (n == 0) n = 1;
  if (!host && g_allocated + n > (size_t)props().total_mem) return CUDA_ERROR_OUT_OF_MEMORY;
  const size_t rounded = (n + 255) / 256 * 256;
  void* p;
  if (host) {
    p = aligned_alloc(256, rounded);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    // Device memory ends (256-byte granularity) at an inaccessible guard page, so an access
    // past its end faults at once (reported by on_fault); freed memory becomes inaccessible.
    install_fault_handler();
    const size_t span = (rounded + kPage - 1) / kPage * kPage;
    void* m = mmap(nullptr, span + kPage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    mprotect(static_cast<char*>(m) + span, kPage, PROT_NONE);
    p = static_cast<char*>(m) + span - rounded;
    g_maps[(uint64_t)p] = Mapping{m, span + kPage};
  }
  // Fresh device memory holds 0xFF bytes (NaN as FP16 and FP32): a buffer read before it is
  // written or zeroed shows up instead of reading as zeros.
  memset(p, host ? 0 : 0xff, rounded);
  g_allocs[(uint64_t)p] = Alloc{n, host};
  g_freed.erase((uint64_t)p);
  if (!host) g_allocated += n;
  *out = (uint64_t)p;
  return CUDA_SUCCESS;
}

CUresult do_free(const char* op, uint64_t p, bool host) {
  if (p == 0) return CUDA_SUCCESS;
  auto it = g_allocs.find(p);
  if (it == g_allocs.end() || it->second.host != host) {
    say("%s: %s (a pointer cu%s returned is required)", op, describe(p).c_str(),
        host ? "MemHostAlloc" : "MemAlloc");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!host) g_allocated -= it->second.size;
  g_freed[p] = it->second.size;
  if (g_freed.size() > 100000) g_freed.erase(g_freed.begin());
  if (host) {
    free((void*)p);
  } else {
    const Mapping m = g_maps[p];
    g_maps.erase(p);
    mprotect(m.base, m.len, PROT_NONE);  // a use after free faults while it is quarantined
    g_quarantine.push_back(m);
    if (g_quarantine.size() > 4096) {  // bounds the process's mappings
      munmap(g_quarantine.front().base, g_quarantine.front().len);
      g_quarantine.pop_front();
    }
  }
  g_allocs.erase(it);
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------ modules and kernels
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

uint64_t fnv(const std::string& s, uint64_t h = 0xcbf29ce484222325ull) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

std::string cache_dir() {
  const char* c = getenv("CUDNN_CBR_SIM_CACHE");
  if (c && *c) return c;
  const char* x = getenv("XDG_CACHE_HOME");
  if (x && *x == '/') return std::string(x) + "/cudnn-cbr/sim";
  const char* h = getenv("HOME");
  if (h && *h) return std::string(h) + "/.cache/cudnn-cbr/sim";
  return "/tmp/cudnn-cbr-sim-" + std::to_string(getuid());
}

void mkdirs(const std::string& d) {
  for (size_t i = 1; i <= d.size(); ++i)
    if (i == d.size() || d[i] == '/') mkdir(d.substr(0, i).c_str(), 0755);
}

// The program text appended to an ELF image by the NVRTC stand-in (nvrtc_shim.c).
bool find_marker(const unsigned char* img, std::string& name, std::string& src) {
  static const char magic[] = "CUDNN_CBR_SIM_MODULE_V1\n";
  if (memcmp(img, "\x7f" "ELF", 4) != 0 || img[4] != 2) return false;  // ELF64 only
  // The image's end: the furthest of its header tables, sections and segments. The NVRTC
  // stand-in appends right there, so only the magic's length past it is read.
  uint64_t shoff, phoff;
  uint16_t phentsize, phnum, shentsize, shnum;
  memcpy(&phoff, img + 32, 8);
  memcpy(&shoff, img + 40, 8);
  memcpy(&phentsize, img + 54, 2);
  memcpy(&phnum, img + 56, 2);
  memcpy(&shentsize, img + 58, 2);
  memcpy(&shnum, img + 60, 2);
  uint64_t end = shoff + (uint64_t)shnum * shentsize;
  if (phoff + (uint64_t)phnum * phentsize > end) end = phoff + (uint64_t)phnum * phentsize;
  for (unsigned k = 0; k < shnum; ++k) {
    uint32_t type;
    uint64_t off, size;
    memcpy(&type, img + shoff + (uint64_t)k * shentsize + 4, 4);
    memcpy(&off, img + shoff + (uint64_t)k * shentsize + 24, 8);
    memcpy(&size, img + shoff + (uint64_t)k * shentsize + 32, 8);
    if (type != 8 /* SHT_NOBITS */ && off + size > end) end = off + size;
  }
  for (unsigned k = 0; k < phnum; ++k) {
    uint64_t off, filesz;
    memcpy(&off, img + phoff + (uint64_t)k * phentsize + 8, 8);
    memcpy(&filesz, img + phoff + (uint64_t)k * phentsize + 32, 8);
    if (off + filesz > end) end = off + filesz;
  }
  if (memcmp(img + end, magic, sizeof magic - 1) != 0) return false;
  const char* p = (const char*)img + end + sizeof magic - 1;
  const char* nl = strchr(p, '\n');
  name.assign(p, nl - p);
  char* after;
  const size_t len = strtoull(nl + 1, &after, 10);
  src.assign(after + 1, len);
  return true;
}

CUresult load_module(const void* image, Module** out) {
  std::string name, src;
  if (!image || !find_marker((const unsigned char*)image, name, src)) {
    say("cuModuleLoadData: the image carries no program text for the simulator (compile it "
        "with NVRTC with the simulator's libnvrtc.so first on LD_LIBRARY_PATH; a kernel "
        "cache filled without it must not be shared: set CUDNN_CBR_KERNEL_CACHE)");
    return CUDA_ERROR_INVALID_IMAGE;
  }
  std::string host, err;
  std::vector<std::string> kernels;
  if (!cudasim_translate(src, name, host, kernels, err)) {
    say("cuModuleLoadData: %s: %s", name.c_str(), err.c_str());
    return CUDA_ERROR_INVALID_IMAGE;
  }
  const std::string dir = sim_dir();
  std::string header;
  read_file(dir + "/include/cuda_on_cpu.h", header);
  const char* cxx = getenv("CUDNN_CBR_SIM_CXX");
  const std::string compiler = cxx && *cxx ? cxx : "g++";
  const std::string flags =
      "-std=c++17 -O2 -fPIC -shared -ffp-contract=off -fno-strict-aliasing -fvisibility=hidden "
      "-w";
  char key[32];
  snprintf(key, sizeof key, "%016llx",
           (unsigned long long)fnv(host, fnv(header, fnv(flags + compiler + dir))));
  const std::string cache = cache_dir();
  mkdirs(cache);
  const std::string so = cache + "/" + name + "-" + key + ".so";
  if (access(so.c_str(), R_OK) != 0) {
    const std::string tmp = so + ".tmp" + std::to_string(getpid());
    const std::string cc = tmp + ".cc";
    FILE* f = fopen(cc.c_str(), "wb");
    if (!f) {
      say("cuModuleLoadData: cannot write %s", cc.c_str());
      return CUDA_ERROR_INVALID_IMAGE;
    }
    fwrite(host.data(), 1, host.size(), f);
    fclose(f);
    const std::string cmd = compiler + " " + flags + " -I'" + dir + "/include' -include cuda_on_cpu.h -x c++ '" +
                            cc + "' -x none -o '" + tmp + "' -L'" + dir + "' -lcudasim_rt -Wl,-rpath,'" +
                            dir + "' 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string log;
    char buf[4096];
    size_t n;
    while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) log.append(buf, n);
    const int rc = p ? pclose(p) : -1;
    unlink(cc.c_str());
    if (rc != 0) {
      say("cuModuleLoadData: compiling %s for the host failed:\n%s", name.c_str(), log.c_str());
      unlink(tmp.c_str());
      return CUDA_ERROR_INVALID_IMAGE;
    }
    rename(tmp.c_str(), so.c_str());
  }
  void* h = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    say("cuModuleLoadData: %s", dlerror());
    return CUDA_ERROR_INVALID_IMAGE;
  }
  Module* m = new Module{h, {}};
  *out = m;
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------ streams, events, graphs
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
void release_user_object(UserObject* o, unsigned n) {
  o->refs = n >= o->refs ? 0 : o->refs - n;
  if (o->refs == 0) {
    if (o->destroy) o->destroy(o->ptr);
    delete o;
  }
}
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

Stream g_null_stream;
std::set<Stream*> g_streams;
int g_captures = 0;  // active captures
// A fault in work already enqueued (a host function reported one through cudasim_fault): as
// after a kernel fault on the device, the context is unusable and the calls that report
// asynchronous errors (synchronizes, queries, copies, launches) return it from then on.
CUresult g_fault = CUDA_SUCCESS;
#define STICKY() \
  if (g_fault != CUDA_SUCCESS) return g_fault

// The calling thread's per-thread default stream (CU_STREAM_PER_THREAD): a stream of its own,
// which may be captured (the legacy default stream may not). Its work and the legacy
// stream's stay in order with each other, as on the driver (both are blocking streams).
std::set<Stream*> g_per_thread;
Stream* per_thread_stream() {
  thread_local Stream* mine = nullptr;
  if (!mine) {
    mine = new Stream();  // kept for the process's life: an event may name it
    g_streams.insert(mine);
    g_per_thread.insert(mine);
  }
  return mine;
}

Stream* stream_of(CUstream s) {
  if (s == CU_STREAM_PER_THREAD) return per_thread_stream();
  if (s == nullptr || s == CU_STREAM_LEGACY) return &g_null_stream;
  return reinterpret_cast<Stream*>(s);
}

// A synchronizing or allocating call is refused, as the driver does, while a capture in
// global mode runs anywhere or one in thread-local mode runs on this thread; that capture is
// invalidated.
CUresult refuse_in_capture(const char* op) {
  if (g_captures == 0) return CUDA_SUCCESS;
  bool refused = false;
  for (Stream* s : g_streams) {
    if (!s->capture) continue;
    if (s->mode == CU_STREAM_CAPTURE_MODE_GLOBAL ||
        (s->mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL && s->thread == std::this_thread::get_id())) {
      s->invalidated = true;
      refused = true;
    }
  }
  if (!refused) return CUDA_SUCCESS;
  say("%s during stream capture: the driver refuses it (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) "
      "and invalidates the capture", op);
  return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

// The stream whose host function this thread is running, and the thread that enqueued it
// (for cudasim_block).
thread_local Stream* t_host_stream = nullptr;
thread_local std::thread::id t_host_for;
// This thread runs work it must not wait in: another thread's, for a device-wide flush
// (flush_all), or any, for the flush a blocked host function makes (cudasim_block). A host
// function that must wait for other threads is not waited for here (cudasim_block defers it,
// setting t_deferred), nor is a busy stream (flush defers the op that needs it); the deferred
// op goes back to the front of its queue. The simulated NCCL's ranks stand for separate
// devices: a device-wide synchronize of one rank must not wait for, nor wait in, another
// rank's collective.
thread_local bool t_may_defer = false;
thread_local bool t_deferred = false;

// Signalled (wake) when a blocked host function returns.
std::mutex g_wake_m;
std::condition_variable g_wake_cv;
uint64_t g_wake_gen = 0;  // under g_wake_m
uint64_t wake_gen() {
  std::lock_guard<std::mutex> l(g_wake_m);
  return g_wake_gen;
}
void wake() {
  {
    std::lock_guard<std::mutex> l(g_wake_m);
    ++g_wake_gen;
  }
  g_wake_cv.notify_all();
}
int release_driver() {
  const int d = t_depth;
  for (int i = 0; i < d; ++i) g_lock.unlock();
  t_depth = 0;
  return d;
}
void retake_driver(int d) {
  for (int i = 0; i < d; ++i) g_lock.lock();
  t_depth = d;
}
// Releases g_lock whole (this thread's depth), waits up to `ms` for a wake() after `seen`,
// and takes it back: for a thread waiting on another thread's host function.
void wait_unlocked(uint64_t seen, int ms = 5) {
  const int d = release_driver();
  {
    std::unique_lock<std::mutex> l(g_wake_m);
    g_wake_cv.wait_for(l, std::chrono::milliseconds(ms), [&] { return g_wake_gen != seen; });
  }
  retake_driver(d);
}
// Waits (the driver released) until no other thread runs a blocked host function of `s`.
void wait_not_busy(Stream* s) {
  while (s->busy) wait_unlocked(wake_gen());
}

CUresult run_op(const Op& op, Stream* on) {
  STICKY();  // a faulted context runs nothing more
  switch (op.kind) {
    case Op::COPY:
      memmove((void*)op.dst, (const void*)op.src, op.n);
      return CUDA_SUCCESS;
    case Op::SET:
      memset((void*)op.dst, op.value, op.n);
      return CUDA_SUCCESS;
    case Op::HOST: {
      Stream* outer = t_host_stream;
      const std::thread::id outer_for = t_host_for;
      t_host_stream = on;
      t_host_for = op.by;
      op.fn(op.data);
      t_host_stream = outer;
      t_host_for = outer_for;
      return CUDA_SUCCESS;
    }
    case Op::KERNEL: {
      std::vector<void*> ptrs;
      for (const auto& p : op.params) ptrs.push_back((void*)p.data());
      char err[768] = {0};
      cudasim_launch l{op.grid, op.block, op.shared, ptrs.data(), err, sizeof err};
      g_running = op.f->name.c_str();
      const int rc = op.f->launch(&l);
      g_running = nullptr;
      if (rc != 0) {
        say("kernel %s failed: %s", op.f->name.c_str(), err);
        return CUDA_ERROR_LAUNCH_FAILED;
      }
      return CUDA_SUCCESS;
    }
    case Op::RECORD:
    case Op::WAIT:
    case Op::FREE:
      return CUDA_SUCCESS;  // queue bookkeeping, handled by run_queued
  }
  return CUDA_SUCCESS;
}

// ---- the adversarial mode (CUDNN_CBR_SIM_ADVERSARIAL=1): each stream's work waits in its
// queue until something needs it (a synchronize, an event wait, a pageable copy to the host);
// then only that stream runs (and what its event waits need), and when every stream must
// run, the most recently enqueued runnable work goes first. So work on one stream that reads
// another's results without an event join runs before them and reads stale data.
bool adversarial() {
  static const bool on = [] {
    const char* a = getenv("CUDNN_CBR_SIM_ADVERSARIAL");
    return a && strcmp(a, "1") == 0;
  }();
  return on;
}
uint64_t g_seq = 0;
CUresult flush(Stream* s, const Event* until = nullptr, uint64_t gen = 0);

CUresult run_queued(Stream* s, const Op& op) {
  switch (op.kind) {
    case Op::RECORD:
      op.event->done = op.gen > op.event->done ? op.gen : op.event->done;
      op.event->at = std::chrono::steady_clock::now();
      return CUDA_SUCCESS;
    case Op::WAIT:
      // The stream of the record waited for, not the event's latest (cudarc records the
      // same event again on the waiting stream right after the wait).
      if (op.event->done < op.gen && op.from && op.from != s)
        return flush(op.from, op.event, op.gen);
      return CUDA_SUCCESS;
    case Op::FREE:
      return do_free("cuMemFreeAsync", op.dst, false);
    default:
      return run_op(op, s);
  }
}

// Runs `s`'s queue, all of it or until `until` has executed record `gen`. A synchronize
// returns only once the queue is empty and no host function of `s` is blocked: a host
// function another thread deferred goes back to the front of the queue, so the queue is
// checked again after each wait. Running for a device-wide flush on another thread's behalf
// (t_may_defer), it waits for nothing: at a busy stream, or when an op it runs is deferred,
// it puts that op back, sets t_deferred and returns, and its caller puts its own op back too.
CUresult flush(Stream* s, const Event* until, uint64_t gen) {
  CUresult first = CUDA_SUCCESS;
  for (;;) {
    if (until && until->done >= gen) break;
    if (s->busy) {  // another thread runs this stream's blocked host function
      if (t_may_defer) {
        t_deferred = true;
        break;
      }
      wait_unlocked(wake_gen());
      continue;
    }
    if (s->queue.empty()) break;
    std::pair<uint64_t, Op> item = std::move(s->queue.front());
    s->queue.pop_front();
    t_deferred = false;
    CUresult r = run_queued(s, item.second);
    if (t_deferred) {  // to be run again, first on its stream
      s->queue.push_front(std::move(item));
      break;
    }
    if (first == CUDA_SUCCESS) first = r;
  }
  return first;
}

// Runs every stream's queue, except a stream blocked in a host function that waits for other
// threads (busy, or deferred here: see t_may_defer), which this does not wait for, unless the
// host function is this thread's own work that another thread's flush holds for a moment: a
// device-wide synchronize (or cuMemFree) waits for everything its own thread enqueued.
CUresult flush_all() {
  CUresult first = CUDA_SUCCESS;
  std::set<Stream*> deferred;
  const std::thread::id me = std::this_thread::get_id();
  for (;;) {
    Stream* pick = nullptr;
    bool mine_busy = false;
    auto consider = [&](Stream* s) {
      if (s->busy && s->busy_for == me) mine_busy = true;
      if (!s->busy && !s->queue.empty() && !deferred.count(s) &&
          (!pick || s->queue.front().first > pick->queue.front().first))
        pick = s;
    };
    consider(&g_null_stream);
    for (Stream* s : g_streams) consider(s);
    if (!pick) {
      if (t_may_defer || !mine_busy) return first;
      wait_unlocked(wake_gen());
      continue;
    }
    std::pair<uint64_t, Op> item = std::move(pick->queue.front());
    pick->queue.pop_front();
    const bool outer = t_may_defer;
    t_may_defer = outer || item.second.by != std::this_thread::get_id();
    t_deferred = false;
    CUresult r = run_queued(pick, item.second);
    t_may_defer = outer;
    if (t_deferred) {  // to be run again, first on its stream
      t_deferred = false;
      pick->queue.push_front(std::move(item));
      deferred.insert(pick);
      continue;
    }
    if (first == CUDA_SUCCESS) first = r;
  }
}

CUresult submit(CUstream s, Op&& op) {
  Stream* st = stream_of(s);
  if (!st->capture) wait_not_busy(st);  // behind a host function blocked on another thread
  op.by = std::this_thread::get_id();
  if (st->capture) {
    if (op.kind <= Op::HOST) st->capture->ops.push_back(std::move(op));
    return CUDA_SUCCESS;
  }
  if (adversarial()) {
    // The legacy and the per-thread default streams run in order with each other.
    if (st == &g_null_stream) {
      for (Stream* p : g_per_thread)
        if (CUresult r = flush(p)) return r;
    } else if (g_per_thread.count(st)) {
      if (CUresult r = flush(&g_null_stream)) return r;
    }
    st->queue.emplace_back(++g_seq, std::move(op));
    return CUDA_SUCCESS;
  }
  if (op.kind > Op::HOST) return CUDA_SUCCESS;
  const bool outer = t_may_defer;
  t_may_defer = false;
  const CUresult r = run_op(op, st);
  t_may_defer = outer;
  return r;
}

bool is_pinned(uint64_t p, size_t n) {
  const Alloc* a = find_alloc(p, n);
  return a && a->host;
}

const char* err_name(CUresult e) {
  switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES";
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case CUDA_ERROR_ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
    default: return "CUDA_ERROR_UNKNOWN";
  }
}

int g_ctx_tag;  // the one context's handle points here
#define CTX reinterpret_cast<CUcontext>(&g_ctx_tag)
thread_local bool t_current = false;

}  // namespace

#define GUARD()                                  \
  if (!sim_on()) return CUDA_ERROR_NO_DEVICE;    \
  DriverLock lk

// ------------------------------------------------------------------ entry points
API CUresult cuGetErrorString(CUresult e, const char** s) {
  if (s) *s = sim_on() ? err_name(e) : "no CUDA device (simulated driver, CUDNN_CBR_DEVICE unset)";
  return CUDA_SUCCESS;
}
API CUresult cuGetErrorName(CUresult e, const char** s) {
  if (s) *s = err_name(sim_on() ? e : CUDA_ERROR_NO_DEVICE);
  return CUDA_SUCCESS;
}
API CUresult cuDriverGetVersion(int* v) {
  if (v) *v = 13000;
  return CUDA_SUCCESS;
}
API CUresult cuInit(unsigned) {
  GUARD();
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int* n) {
  if (n) *n = sim_on() ? 1 : 0;
  return sim_on() ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}
API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  GUARD();
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGetName(char* name, int len, CUdevice) {
  GUARD();
  snprintf(name, (size_t)len, "%s", props().name.c_str());
  return CUDA_SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t* b, CUdevice) {
  GUARD();
  *b = (size_t)props().total_mem;
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGetUuid(CUuuid* u, CUdevice) {
  GUARD();
  memset(u, 0x5a, sizeof *u);
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGetUuid_v2(CUuuid* u, CUdevice d) { return cuDeviceGetUuid(u, d); }
API CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
  GUARD();
  const Props& p = props();
  long long r = 0;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: r = p.threads_per_block; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: r = p.block[0]; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: r = p.block[1]; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: r = p.block[2]; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: r = p.grid[0]; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: r = p.grid[1]; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: r = p.grid[2]; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: r = p.shared; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: r = p.shared_optin; break;
    case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: r = p.reserved_shared; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: r = p.shared_optin + p.reserved_shared; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: r = p.warp; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: r = p.regs_per_block; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: r = p.regs_per_sm; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: r = p.sms; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: r = p.threads_per_sm; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: r = p.ctas_per_sm; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: r = p.clock; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: r = p.mem_clock; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: r = p.bus; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: r = p.l2; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: r = p.device_ver / 100; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: r = p.device_ver % 100 / 10; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: r = 1; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: r = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: r = 1; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: r = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: r = 1; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: r = 2; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: r = 65536; break;
    default: r = 0; break;
  }
  *v = (int)r;
  return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  GUARD();
  *c = CTX;
  return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { GUARD(); return CUDA_SUCCESS; }
API CUresult cuCtxSetCurrent(CUcontext c) {
  GUARD();
  if (c && c != CTX) return CUDA_ERROR_INVALID_CONTEXT;
  t_current = c != nullptr;
  return CUDA_SUCCESS;
}
API CUresult cuCtxGetCurrent(CUcontext* c) {
  GUARD();
  *c = t_current ? CTX : nullptr;
  return CUDA_SUCCESS;
}
API CUresult cuCtxPushCurrent_v2(CUcontext c) { return cuCtxSetCurrent(c); }
API CUresult cuCtxPopCurrent_v2(CUcontext* c) {
  GUARD();
  if (c) *c = t_current ? CTX : nullptr;
  return CUDA_SUCCESS;
}
API CUresult cuCtxGetDevice(CUdevice* d) { GUARD(); *d = 0; return CUDA_SUCCESS; }
API CUresult cuCtxSynchronize() {
  GUARD();
  STICKY();
  if (CUresult r = refuse_in_capture("cuCtxSynchronize")) return r;
  return flush_all();
}
API CUresult cuCtxSetFlags(unsigned) { GUARD(); return CUDA_SUCCESS; }
API CUresult cuCtxGetLimit(size_t* v, CUlimit) { GUARD(); *v = 0; return CUDA_SUCCESS; }
API CUresult cuCtxSetLimit(CUlimit, size_t) { GUARD(); return CUDA_SUCCESS; }
API CUresult cuCtxGetCacheConfig(CUfunc_cache* c) { GUARD(); *c = CU_FUNC_CACHE_PREFER_NONE; return CUDA_SUCCESS; }
API CUresult cuCtxSetCacheConfig(CUfunc_cache) { GUARD(); return CUDA_SUCCESS; }
API CUresult cuCtxGetStreamPriorityRange(int* lo, int* hi) {
  GUARD();
  if (lo) *lo = 0;
  if (hi) *hi = -5;
  return CUDA_SUCCESS;
}

API CUresult cuMemGetInfo_v2(size_t* free_b, size_t* total) {
  GUARD();
  *total = (size_t)props().total_mem;
  *free_b = *total - g_allocated;
  return CUDA_SUCCESS;
}
API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
  GUARD();
  if (CUresult r = refuse_in_capture("cuMemAlloc")) return r;
  return do_alloc(reinterpret_cast<uint64_t*>(p), n, false);
}
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream) {
  GUARD();
  if (CUresult r = refuse_in_capture("cuMemAllocAsync (graph memory nodes are not simulated)"))
    return r;
  return do_alloc(reinterpret_cast<uint64_t*>(p), n, false);
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
  GUARD();
  if (CUresult r = refuse_in_capture("cuMemFree")) return r;
  if (CUresult r = flush_all()) return r;  // cuMemFree waits for the device
  return do_free("cuMemFree", p, false);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
  GUARD();
  if (CUresult r = refuse_in_capture("cuMemFreeAsync (graph memory nodes are not simulated)"))
    return r;
  if (!adversarial()) return do_free("cuMemFreeAsync", p, false);
  Op o;
  o.kind = Op::FREE;  // stream-ordered: after the work already queued there
  o.dst = p;
  return submit(s, std::move(o));
}
API CUresult cuMemHostAlloc(void** p, size_t n, unsigned) {
  GUARD();
  uint64_t u;
  CUresult r = do_alloc(&u, n, true);
  if (r == CUDA_SUCCESS) *p = (void*)u;
  return r;
}
API CUresult cuMemAllocHost_v2(void** p, size_t n) { return cuMemHostAlloc(p, n, 0); }
API CUresult cuMemFreeHost(void* p) {
  GUARD();
  return do_free("cuMemFreeHost", (uint64_t)p, true);
}
API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned) {
  GUARD();
  *d = (CUdeviceptr)p;
  return CUDA_SUCCESS;
}

static CUresult copy(const char* op, CUstream s, uint64_t dst, uint64_t src, size_t n, bool dst_dev,
                     bool src_dev, bool sync) {
  STICKY();
  if (sync)
    if (CUresult r = refuse_in_capture(op)) return r;
  if (dst_dev)
    if (CUresult r = check_range(op, dst, n)) return r;
  if (src_dev)
    if (CUresult r = check_range(op, src, n)) return r;
  Op o;
  o.kind = Op::COPY;
  o.dst = dst;
  o.src = src;
  o.n = n;
  Stream* st = stream_of(s);
  if (adversarial() && !st->capture) {
    if (sync || (!dst_dev && !is_pinned(dst, n))) {
      // A synchronous copy, or one into pageable memory: done when the call returns.
      if (CUresult r = sync ? flush_all() : flush(st)) return r;
      return run_op(o, st);
    }
    if (!src_dev && !is_pinned(src, n)) {  // pageable source: staged at the call
      o.staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + n);
      o.src = (uint64_t)o.staged->data();
    }
  }
  return submit(s, std::move(o));
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, size_t n) {
  GUARD();
  return copy("cuMemcpyHtoD", nullptr, d, (uint64_t)h, n, true, false, true);
}
API CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, size_t n) {
  GUARD();
  return copy("cuMemcpyDtoH", nullptr, (uint64_t)h, d, n, false, true, true);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr a, CUdeviceptr b, size_t n) {
  GUARD();
  return copy("cuMemcpyDtoD", nullptr, a, b, n, true, true, true);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, size_t n, CUstream s) {
  GUARD();
  return copy("cuMemcpyHtoDAsync", s, d, (uint64_t)h, n, true, false, false);
}
API CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, size_t n, CUstream s) {
  GUARD();
  return copy("cuMemcpyDtoHAsync", s, (uint64_t)h, d, n, false, true, false);
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s) {
  GUARD();
  return copy("cuMemcpyDtoDAsync", s, a, b, n, true, true, false);
}
static CUresult set8(const char* op, CUstream s, CUdeviceptr d, unsigned char v, size_t n, bool sync) {
  if (sync)
    if (CUresult r = refuse_in_capture(op)) return r;
  if (CUresult r = check_range(op, d, n)) return r;
  Op o;
  o.kind = Op::SET;
  o.dst = d;
  o.value = v;
  o.n = n;
  if (sync && adversarial()) {
    if (CUresult r = flush_all()) return r;
    return run_op(o, stream_of(s));
  }
  return submit(s, std::move(o));
}
API CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
  GUARD();
  return set8("cuMemsetD8", nullptr, d, v, n, true);
}
API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
  GUARD();
  return set8("cuMemsetD8Async", s, d, v, n, false);
}

API CUresult cuStreamCreate(CUstream* s, unsigned) {
  GUARD();
  Stream* st = new Stream();
  g_streams.insert(st);
  *s = reinterpret_cast<CUstream>(st);
  return CUDA_SUCCESS;
}
API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned f, int) { return cuStreamCreate(s, f); }
API CUresult cuStreamDestroy_v2(CUstream s) {
  GUARD();
  Stream* st = stream_of(s);
  if (st == &g_null_stream || g_per_thread.count(st) || !g_streams.count(st))
    return CUDA_ERROR_INVALID_HANDLE;
  flush(st);  // the work already queued still completes
  g_streams.erase(st);
  if (!adversarial()) delete st;  // an event may still name it as its last stream
  return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize(CUstream s) {
  GUARD();
  STICKY();
  if (CUresult r = refuse_in_capture("cuStreamSynchronize")) return r;
  return flush(stream_of(s));
}
API CUresult cuStreamQuery(CUstream s) {
  GUARD();
  STICKY();
  if (stream_of(s)->capture) return refuse_in_capture("cuStreamQuery");
  return flush(stream_of(s));
}
API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
  GUARD();
  // Eager execution: what the event marks has already run. Adversarial: a queued wait.
  Event* ev = reinterpret_cast<Event*>(e);
  Stream* st = stream_of(s);
  Stream* origin = nullptr;  // the capture the event's last record belongs to, still open
  if (ev->captured && !st->capture)
    for (Stream* o : g_streams)
      if (o->capture == ev->captured && o->origin == o) origin = o;
  if (origin) {
    // Waiting on an event recorded in a capture joins that capture, as the driver does:
    // the stream's later work is recorded into the same graph (in enqueue order).
    st->capture = ev->captured;
    st->origin = origin;
    st->mode = origin->mode;
    st->thread = origin->thread;
    return CUDA_SUCCESS;
  }
  Op o;
  o.kind = Op::WAIT;
  o.event = ev;
  o.gen = ev->enqueued;
  o.from = ev->where;
  return submit(s, std::move(o));
}
API CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
  GUARD();
  Stream* st = stream_of(s);
  if (st == &g_null_stream) {
    say("cuStreamBeginCapture on the legacy default stream is not permitted");
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  if (st->capture) return CUDA_ERROR_ILLEGAL_STATE;
  st->capture = new Graph();
  st->invalidated = false;
  st->mode = mode;
  st->thread = std::this_thread::get_id();
  st->origin = st;
  ++g_captures;
  return CUDA_SUCCESS;
}
API CUresult cuStreamEndCapture(CUstream s, CUgraph* g) {
  GUARD();
  Stream* st = stream_of(s);
  if (!st->capture) return CUDA_ERROR_ILLEGAL_STATE;
  if (st->origin != st) {
    say("cuStreamEndCapture on a stream that joined a capture, not the one that began it");
    return CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
  }
  Graph* graph = st->capture;
  bool bad = st->invalidated;
  for (Stream* o : g_streams) {  // the joined streams leave the capture with it
    if (o != st && o->capture == graph) {
      bad = bad || o->invalidated;
      o->capture = nullptr;
      o->invalidated = false;
      o->origin = nullptr;
    }
  }
  st->capture = nullptr;
  st->invalidated = false;
  st->origin = nullptr;
  --g_captures;
  if (bad) {
    delete graph;
    *g = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  *g = reinterpret_cast<CUgraph>(graph);
  return CUDA_SUCCESS;
}
// The capture's graph is the one being recorded (user objects retained by it are owned by
// the graph that cuStreamEndCapture returns); no node handles are simulated (none, 0).
API CUresult cuStreamGetCaptureInfo_v3(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id,
                                       CUgraph* graph, const CUgraphNode** deps,
                                       const CUgraphEdgeData** edges, size_t* ndeps) {
  GUARD();
  Stream* st = stream_of(s);
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  *status = !st->capture ? CU_STREAM_CAPTURE_STATUS_NONE
                         : (st->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                            : CU_STREAM_CAPTURE_STATUS_ACTIVE);
  if (id) *id = reinterpret_cast<uintptr_t>(st->capture);
  if (graph) *graph = reinterpret_cast<CUgraph>(st->capture);
  if (deps) *deps = nullptr;
  if (edges) *edges = nullptr;
  if (ndeps) *ndeps = 0;
  return CUDA_SUCCESS;
}
API CUresult cuStreamGetCaptureInfo_v2(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id,
                                       CUgraph* graph, const CUgraphNode** deps, size_t* ndeps) {
  return cuStreamGetCaptureInfo_v3(s, status, id, graph, deps, nullptr, ndeps);
}
API CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status) {
  GUARD();
  Stream* st = stream_of(s);
  *status = !st->capture ? CU_STREAM_CAPTURE_STATUS_NONE
                         : (st->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                            : CU_STREAM_CAPTURE_STATUS_ACTIVE);
  return CUDA_SUCCESS;
}

API CUresult cuEventCreate(CUevent* e, unsigned) {
  GUARD();
  *e = reinterpret_cast<CUevent>(new Event());
  return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(CUevent e) {
  GUARD();
  // A queued wait may still name the event (adversarial mode): keep it, as the driver keeps
  // what a pending wait needs.
  if (!adversarial()) delete reinterpret_cast<Event*>(e);
  return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s) {
  GUARD();
  Event* ev = reinterpret_cast<Event*>(e);
  ev->recorded = true;
  ev->at = std::chrono::steady_clock::now();
  Stream* st = stream_of(s);
  ev->captured = st->capture;
  if (st->capture) return CUDA_SUCCESS;
  ev->where = st;
  Op o;
  o.kind = Op::RECORD;
  o.event = ev;
  o.gen = ++ev->enqueued;
  if (!adversarial()) ev->done = o.gen;
  return submit(s, std::move(o));
}
static CUresult event_wait(CUevent e) {
  Event* ev = reinterpret_cast<Event*>(e);
  if (ev->done >= ev->enqueued || !ev->where) return CUDA_SUCCESS;
  return flush(ev->where, ev, ev->enqueued);
}
API CUresult cuEventSynchronize(CUevent e) {
  GUARD();
  STICKY();
  if (CUresult r = refuse_in_capture("cuEventSynchronize")) return r;
  return event_wait(e);
}
API CUresult cuEventQuery(CUevent e) {
  GUARD();
  STICKY();
  return event_wait(e);  // never "not ready": a caller polling it would spin forever
}
API CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) {
  GUARD();
  Event* x = reinterpret_cast<Event*>(a);
  Event* y = reinterpret_cast<Event*>(b);
  if (!x->recorded || !y->recorded) return CUDA_ERROR_INVALID_HANDLE;
  *ms = std::chrono::duration<float, std::milli>(y->at - x->at).count();
  return CUDA_SUCCESS;
}
API CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime_v2(ms, a, b); }

API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  GUARD();
  Module* mod;
  CUresult r = load_module(image, &mod);
  if (r == CUDA_SUCCESS) *m = reinterpret_cast<CUmodule>(mod);
  return r;
}
API CUresult cuModuleUnload(CUmodule m) {
  GUARD();
  Module* mod = reinterpret_cast<Module*>(m);
  for (auto& f : mod->functions) delete f.second;
  // The host code stays loaded: a captured graph may still name its kernels.
  delete mod;
  return CUDA_SUCCESS;
}
API CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  GUARD();
  Module* mod = reinterpret_cast<Module*>(m);
  auto it = mod->functions.find(name);
  if (it == mod->functions.end()) {
    auto launch = (int (*)(const cudasim_launch*))dlsym(mod->so, (std::string("cudasim_launch_") + name).c_str());
    auto sig = (const cudasim_signature* (*)())dlsym(mod->so, (std::string("cudasim_signature_") + name).c_str());
    if (!launch || !sig) {
      say("cuModuleGetFunction: the module has no extern \"C\" __global__ function %s", name);
      return CUDA_ERROR_NOT_FOUND;
    }
    it = mod->functions.emplace(name, new Function{name, launch, sig()}).first;
  }
  *f = reinterpret_cast<CUfunction>(it->second);
  return CUDA_SUCCESS;
}
API CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction f) {
  GUARD();
  Function* fn = reinterpret_cast<Function*>(f);
  switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = (int)props().threads_per_block; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 32; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
      *v = fn->max_dynamic_shared >= 0 ? fn->max_dynamic_shared : (int)props().shared;
      break;
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}
API CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  GUARD();
  if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (v < 0 || v > props().shared_optin) return CUDA_ERROR_INVALID_VALUE;
    reinterpret_cast<Function*>(f)->max_dynamic_shared = v;
  }
  return CUDA_SUCCESS;
}
API CUresult cuFuncSetCacheConfig(CUfunction, CUfunc_cache) { GUARD(); return CUDA_SUCCESS; }

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, CUstream s, void** params,
                            void** extra) {
  GUARD();
  Function* fn = reinterpret_cast<Function*>(f);
  const Props& p = props();
  const unsigned long long threads = (unsigned long long)bx * by * bz;
  const long long shared_limit = fn->max_dynamic_shared >= 0 ? fn->max_dynamic_shared : p.shared;
  if (extra) {
    say("launch %s: the `extra` parameter buffer is not simulated", fn->name.c_str());
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (threads == 0 || threads > (unsigned long long)p.threads_per_block || bx > p.block[0] ||
      by > p.block[1] || bz > p.block[2] || gx == 0 || gy == 0 || gz == 0 || gx > p.grid[0] ||
      gy > p.grid[1] || gz > p.grid[2]) {
    say("launch %s refused: grid (%u,%u,%u) block (%u,%u,%u) = %llu threads per block, beyond "
        "the device's limits (%lld threads per block, block (%lld,%lld,%lld), grid (%lld,%lld,%lld))",
        fn->name.c_str(), gx, gy, gz, bx, by, bz, threads, p.threads_per_block, p.block[0],
        p.block[1], p.block[2], p.grid[0], p.grid[1], p.grid[2]);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if ((long long)shared > shared_limit) {
    say("launch %s refused: %u bytes of dynamic shared memory, the limit is %lld", fn->name.c_str(),
        shared, shared_limit);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!params && fn->sig->count) return CUDA_ERROR_INVALID_VALUE;
  Op o;
  o.kind = Op::KERNEL;
  o.f = fn;
  o.grid = dim3(gx, gy, gz);
  o.block = dim3(bx, by, bz);
  o.shared = shared;
  for (unsigned i = 0; i < fn->sig->count; ++i) {
    const cudasim_param& pr = fn->sig->params[i];
    std::vector<char> v(pr.size + 16);
    memcpy(v.data(), params[i], pr.size);
    if (pr.pointee_align) {
      uint64_t addr;
      memcpy(&addr, params[i], 8);
      if (addr != 0 && !find_alloc(addr, 1)) {
        say("launch %s refused: argument %u: %s", fn->name.c_str(), i, describe(addr).c_str());
        return CUDA_ERROR_INVALID_VALUE;
      }
      if (addr % pr.pointee_align) {
        say("launch %s refused: argument %u (0x%llx) is not aligned to its type's %u bytes",
            fn->name.c_str(), i, (unsigned long long)addr, pr.pointee_align);
        return CUDA_ERROR_MISALIGNED_ADDRESS;
      }
    }
    o.params.push_back(std::move(v));
  }
  return submit(s, std::move(o));
}
// Recorded as a host node while the stream captures (run at each replay, in stream order).
API CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void* data) {
  GUARD();
  STICKY();
  Op o;
  o.kind = Op::HOST;
  o.fn = fn;
  o.data = data;
  return submit(s, std::move(o));
}
API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, CUfunction, int block, size_t) {
  GUARD();
  *n = block > 0 ? (int)(props().threads_per_sm / block) : 0;
  return CUDA_SUCCESS;
}

API CUresult cuGraphCreate(CUgraph* g, unsigned flags) {
  GUARD();
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  *g = reinterpret_cast<CUgraph>(new Graph());  // empty (cuDNN's populate is not simulated)
  return CUDA_SUCCESS;
}
API CUresult cuGraphInstantiateWithFlags(CUgraphExec* e, CUgraph g, unsigned long long) {
  GUARD();
  *e = reinterpret_cast<CUgraphExec>(new Graph(*reinterpret_cast<Graph*>(g)));
  return CUDA_SUCCESS;
}
API CUresult cuGraphLaunch(CUgraphExec e, CUstream s) {
  GUARD();
  const Graph* g = reinterpret_cast<Graph*>(e);
  Stream* st = stream_of(s);
  STICKY();
  if (st->capture) {
    for (const Op& op : g->ops) st->capture->ops.push_back(op);
    for (auto& [o, n] : g->owned) st->capture->retain(o, n, false);  // its host nodes' data
    return CUDA_SUCCESS;
  }
  for (const Op& op : g->ops) {
    Op copy = op;
    if (CUresult r = submit(s, std::move(copy))) return r;
  }
  return CUDA_SUCCESS;
}
API CUresult cuGraphUpload(CUgraphExec, CUstream) { GUARD(); return CUDA_SUCCESS; }

API CUresult cuUserObjectCreate(CUuserObject* out, void* ptr, CUhostFn destroy, unsigned refs,
                                unsigned flags) {
  GUARD();
  if (!out || refs == 0 || flags != CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)
    return CUDA_ERROR_INVALID_VALUE;
  *out = reinterpret_cast<CUuserObject>(new UserObject{ptr, destroy, refs});
  return CUDA_SUCCESS;
}
API CUresult cuUserObjectRetain(CUuserObject o, unsigned n) {
  GUARD();
  if (!o || n == 0) return CUDA_ERROR_INVALID_VALUE;
  reinterpret_cast<UserObject*>(o)->refs += n;
  return CUDA_SUCCESS;
}
API CUresult cuUserObjectRelease(CUuserObject o, unsigned n) {
  GUARD();
  if (!o || n == 0) return CUDA_ERROR_INVALID_VALUE;
  release_user_object(reinterpret_cast<UserObject*>(o), n);
  return CUDA_SUCCESS;
}
// CU_GRAPH_USER_OBJECT_MOVE moves the caller's references to the graph; otherwise new ones.
API CUresult cuGraphRetainUserObject(CUgraph g, CUuserObject o, unsigned n, unsigned flags) {
  GUARD();
  if (!g || !o || n == 0 || (flags & ~CU_GRAPH_USER_OBJECT_MOVE)) return CUDA_ERROR_INVALID_VALUE;
  reinterpret_cast<Graph*>(g)->retain(reinterpret_cast<UserObject*>(o), n,
                                      flags & CU_GRAPH_USER_OBJECT_MOVE);
  return CUDA_SUCCESS;
}
API CUresult cuGraphReleaseUserObject(CUgraph g, CUuserObject o, unsigned n) {
  GUARD();
  if (!g || !o || n == 0) return CUDA_ERROR_INVALID_VALUE;
  Graph* graph = reinterpret_cast<Graph*>(g);
  UserObject* obj = reinterpret_cast<UserObject*>(o);
  auto it = graph->owned.find(obj);
  if (it == graph->owned.end() || it->second < n) return CUDA_ERROR_INVALID_VALUE;
  if ((it->second -= n) == 0) graph->owned.erase(it);
  release_user_object(obj, n);
  return CUDA_SUCCESS;
}
API CUresult cuGraphDestroy(CUgraph g) {
  GUARD();
  delete reinterpret_cast<Graph*>(g);
  return CUDA_SUCCESS;
}
API CUresult cuGraphExecDestroy(CUgraphExec e) {
  GUARD();
  // A launch still queued (adversarial mode) completes first, as the driver lets a launched
  // graph finish (its host nodes' data, user objects, must outlive it).
  if (adversarial()) flush_all();
  delete reinterpret_cast<Graph*>(e);
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------ for fusion's graph interpreter
// fusion/src/sim.rs looks these up in the loaded driver (by its soname) to confirm that the
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
// collectives wait for every rank's contribution, sim/nccl.cc): calls ready(arg) with the
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
  if (st && st->busy++ == 0)  // (also while ready runs below: the stream's work is not done)
    st->busy_for = t_host_for;
  if (t_may_defer) {
    const int d = release_driver();
    ok = ready(arg);
    retake_driver(d);
    if (st) --st->busy;
    wake();
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
  if (st) --st->busy;
  wake();
  return ok;
}

// The path of the device-properties document (devprops_path), valid for the process's life.
API const char* cudasim_devprops_path() {
  static const std::string path = devprops_path();
  return path.c_str();
}
