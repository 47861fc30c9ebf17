// The simulated device's memory: allocations end at a guard page, freed ones stay
// inaccessible for a while, and a fault in either is named before the process ends.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "driver.h"

namespace cudasim {

// ------------------------------------------------------------------ memory
std::map<uint64_t, Alloc> g_allocs;
std::map<uint64_t, size_t> g_freed;  // recently freed ranges, to name them in errors
size_t g_allocated = 0;

// The live allocation holding [p, p + n), or null.
const Alloc* find_alloc(uint64_t p, size_t n, uint64_t* base) {
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

struct Mapping {
  void* base;
  size_t len;
};
constexpr size_t kPage = 4096;
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

bool is_pinned(uint64_t p, size_t n) {
  const Alloc* a = find_alloc(p, n);
  return a && a->host;
}

}  // namespace cudasim
