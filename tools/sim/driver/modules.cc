// Modules: the program text an NVRTC image carries (tools/sim/nvrtc_shim.c) is translated
// (tools/sim/translate.cc), compiled for the host once (cached) and loaded.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "driver.h"

namespace cudasim {

// ------------------------------------------------------------------ modules and kernels

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

}  // namespace cudasim
