/*
 * libnvrtc.so of the simulated device: every NVRTC call is the real NVRTC's (this library
 * depends on libnvrtc.so.13, whose symbols the loader finds through it), so the real compile
 * and its diagnostics happen. Under CUDNN_CBR_DEVICE=sim, the machine code a program yields
 * additionally carries the program's text after the ELF image:
 *   "CUDNN_CBR_SIM_MODULE_V1\n" <name> "\n" <length in decimal> "\n" <program text>
 * which the simulated driver (tools/sim/driver/modules.cc) compiles for the host when the module is loaded.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvrtcResult;
typedef struct _nvrtcProgram* nvrtcProgram;

struct entry {
  nvrtcProgram prog;
  char* marker;
  size_t marker_len;
  struct entry* next;
};

static struct entry* entries;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void* real(const char* name) {
  static void* lib;
  if (!lib) lib = dlopen("libnvrtc.so.13", RTLD_NOW | RTLD_LOCAL);
  void* f = lib ? dlsym(lib, name) : NULL;
  if (!f) {
    fprintf(stderr, "cudnn-cbr simulated NVRTC: the real NVRTC (libnvrtc.so.13) lacks %s\n", name);
    abort();
  }
  return f;
}

static int sim_on(void) {
  const char* d = getenv("CUDNN_CBR_DEVICE");
  return d && strcmp(d, "sim") == 0;
}

static struct entry* find(nvrtcProgram p) {
  struct entry* e;
  for (e = entries; e; e = e->next)
    if (e->prog == p) return e;
  return NULL;
}

nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char* src, const char* name,
                               int num_headers, const char* const* headers,
                               const char* const* include_names) {
  typedef nvrtcResult (*F)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                           const char* const*);
  nvrtcResult r = ((F)real("nvrtcCreateProgram"))(prog, src, name, num_headers, headers,
                                                  include_names);
  if (r != 0 || !sim_on() || !src) return r;
  if (!name) name = "default_program";
  size_t n = strlen(src);
  struct entry* e = calloc(1, sizeof *e);
  char head[128];
  int h = snprintf(head, sizeof head, "%zu\n", n);
  e->marker_len = strlen("CUDNN_CBR_SIM_MODULE_V1\n") + strlen(name) + 1 + (size_t)h + n;
  e->marker = malloc(e->marker_len + 1);
  snprintf(e->marker, e->marker_len + 1, "CUDNN_CBR_SIM_MODULE_V1\n%s\n%s", name, head);
  memcpy(e->marker + e->marker_len - n, src, n);
  e->prog = *prog;
  pthread_mutex_lock(&lock);
  e->next = entries;
  entries = e;
  pthread_mutex_unlock(&lock);
  return r;
}

nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog) {
  pthread_mutex_lock(&lock);
  struct entry** pp;
  for (pp = &entries; *pp; pp = &(*pp)->next) {
    if ((*pp)->prog == *prog) {
      struct entry* e = *pp;
      *pp = e->next;
      free(e->marker);
      free(e);
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  typedef nvrtcResult (*F)(nvrtcProgram*);
  return ((F)real("nvrtcDestroyProgram"))(prog);
}

nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t* size) {
  typedef nvrtcResult (*F)(nvrtcProgram, size_t*);
  nvrtcResult r = ((F)real("nvrtcGetCUBINSize"))(prog, size);
  if (r != 0 || !size) return r;
  pthread_mutex_lock(&lock);
  struct entry* e = find(prog);
  if (e) *size += e->marker_len;
  pthread_mutex_unlock(&lock);
  return r;
}

nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char* cubin) {
  typedef nvrtcResult (*S)(nvrtcProgram, size_t*);
  typedef nvrtcResult (*F)(nvrtcProgram, char*);
  size_t real_size = 0;
  nvrtcResult r = ((S)real("nvrtcGetCUBINSize"))(prog, &real_size);
  if (r != 0) return r;
  r = ((F)real("nvrtcGetCUBIN"))(prog, cubin);
  if (r != 0 || !cubin) return r;
  pthread_mutex_lock(&lock);
  struct entry* e = find(prog);
  if (e) memcpy(cubin + real_size, e->marker, e->marker_len);
  pthread_mutex_unlock(&lock);
  return r;
}
