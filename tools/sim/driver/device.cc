// The simulated driver's lock, its messages, whether the simulator is selected, and the
// device's properties (from a device-properties document).
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "driver.h"

namespace cudasim {

std::recursive_mutex g_lock;
// How deep this thread holds g_lock, so that a host function that must wait for another
// thread (cudasim_block) can release it whole and take it back.
thread_local int t_depth = 0;

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

}  // namespace cudasim
