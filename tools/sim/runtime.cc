// libcudasim_rt: runs a kernel's grid on the calling OS thread, block after block, each
// block's threads as fibers (a hand-rolled context switch on x86-64, ucontext elsewhere).
//
// A thread runs until it finishes or reaches a rendezvous (__syncthreads, a warp
// collective); only then does the next thread start, so a kernel without rendezvous runs
// its threads one after another on one reused stack, and one with them keeps alive only the
// threads a rendezvous holds. Every rule the hardware leaves undefined that we can see is an
// error with a message: a barrier or shuffle some threads never reach (deadlock), a shuffle
// mask naming a lane that exited, does not exist or disagrees with its partners' mask, a
// source lane outside the mask.
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <string>
#include <vector>

#include "include/cuda_on_cpu.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

extern "C" {
thread_local uint3 cudasim_thread_idx;
thread_local uint3 cudasim_block_idx;
thread_local dim3 cudasim_block_dim;
thread_local dim3 cudasim_grid_dim;
}

namespace {

#if defined(__x86_64__)
// Saves the callee-saved registers and the FP control words on the current stack, stores
// the stack pointer in *save, and resumes the context whose stack pointer is `load`.
extern "C" void cudasim_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .globl cudasim_switch
  .hidden cudasim_switch
  .type cudasim_switch,@function
cudasim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cudasim_switch, .-cudasim_switch
)");
#endif

constexpr size_t kStack = 256 * 1024;  // per simulated thread; kernels keep small frames
constexpr size_t kGuard = 4096;

enum State { READY, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
  char* stack = nullptr;  // base of the usable stack (a guard page lies below)
  uint3 tid{};
  State state = READY;
  int op = 0;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 32;
  uint64_t result = 0;
};

struct Sched {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
  std::vector<Fiber> fibers;
  std::vector<char*> free_stacks;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  Fiber* cur = nullptr;
  std::vector<unsigned char> dyn_shared;
  unsigned dyn_bytes = 0;
  uint64_t started = 0;  // statistics: fibers started, stacks allocated
  uint64_t stacks = 0;
};

thread_local Sched* g_sched = nullptr;

// Releases an OS thread's scheduler and fiber stacks when the thread ends (test harnesses
// start a thread per test: leaked stacks would pile up mappings).
struct SchedOwner {
  ~SchedOwner() {
    if (!g_sched) return;
    for (char* st : g_sched->free_stacks) munmap(st - kGuard, kStack + kGuard);
    delete g_sched;
    g_sched = nullptr;
  }
};
thread_local SchedOwner g_sched_owner;

Sched& sched() {
  if (!g_sched) {
    g_sched = new Sched();  // lives as long as its OS thread (stacks reused across launches)
    (void)&g_sched_owner;   // constructs the owner, so its destructor runs at thread exit
  }
  return *g_sched;
}

char* take_stack(Sched& s) {
  if (!s.free_stacks.empty()) {
    char* p = s.free_stacks.back();
    s.free_stacks.pop_back();
    return p;
  }
  void* m = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  mprotect(m, kGuard, PROT_NONE);  // a stack overflow faults instead of corrupting memory
  ++s.stacks;
  return static_cast<char*>(m) + kGuard;
}

[[noreturn]] void fiber_main() {
  Sched& s = *g_sched;
  s.body(s.ctx);
  Fiber* f = s.cur;
  f->state = DONE;
#if defined(__x86_64__)
  cudasim_switch(&f->sp, s.sp);
#else
  swapcontext(&f->uc, &s.uc);
#endif
  abort();  // a finished fiber is never resumed
}

#if !defined(__x86_64__)
void fiber_main_uc() { fiber_main(); }
#endif

void start_fiber(Sched& s, Fiber& f) {
#if defined(__x86_64__)
  uint64_t* sp = reinterpret_cast<uint64_t*>(f.stack + kStack);
  uint32_t mxcsr = 0;
  uint16_t fcw = 0;
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(fcw));
  *--sp = 0;                                          // keeps fiber_main's frame aligned
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);    // where cudasim_switch returns
  for (int i = 0; i < 6; ++i) *--sp = 0;              // rbp rbx r12 r13 r14 r15
  *--sp = (uint64_t)mxcsr | ((uint64_t)fcw << 32);  // mxcsr, x87 control word
  f.sp = sp;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = kStack;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, fiber_main_uc, 0);
#endif
  (void)s;
}

void resume(Sched& s, Fiber& f) {
  s.cur = &f;
  cudasim_thread_idx = f.tid;
#if defined(__x86_64__)
  cudasim_switch(&s.sp, f.sp);
#else
  swapcontext(&s.uc, &f.uc);
#endif
}

void park() {
  Sched& s = *g_sched;
  Fiber* f = s.cur;
#if defined(__x86_64__)
  cudasim_switch(&f->sp, s.sp);
#else
  swapcontext(&f->uc, &s.uc);
#endif
  cudasim_thread_idx = f->tid;
}

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

const char* op_name(int op) {
  switch (op) {
    case CUDASIM_WARP_SYNC: return "__syncwarp";
    case CUDASIM_WARP_SHFL: return "__shfl_sync";
    case CUDASIM_WARP_UP: return "__shfl_up_sync";
    case CUDASIM_WARP_DOWN: return "__shfl_down_sync";
    case CUDASIM_WARP_XOR: return "__shfl_xor_sync";
    default: return "__ballot_sync";
  }
}

// The source lane of `lane` in a shuffle, or -1 for "own value".
int source_lane(int op, int lane, int arg, int width) {
  const int seg = (lane / width) * width;
  switch (op) {
    case CUDASIM_WARP_SHFL: return seg + (((arg % width) + width) % width);
    case CUDASIM_WARP_UP: return (lane - seg) < arg ? lane : lane - arg;
    case CUDASIM_WARP_DOWN: return (lane - seg) + arg >= width ? lane : lane + arg;
    case CUDASIM_WARP_XOR: {
      const int src = lane ^ arg;
      return (src >= seg + width || src > 31 || src < 0) ? lane : src;
    }
    default: return lane;
  }
}

// Lane `lane` of warp `warp` has arrived at a collective: completes it when every lane of
// its mask is there. Returns an error message, or "" (complete or still waiting).
std::string warp_arrive(Sched& s, unsigned n, unsigned warp, std::vector<unsigned>& ready) {
  const unsigned base = warp * 32;
  Fiber& me = s.fibers[s.cur - s.fibers.data()];
  const unsigned lane = (unsigned)(&me - s.fibers.data()) - base;
  const unsigned mask = me.mask;
  if (!(mask >> lane & 1u))
    return fmt("%s by lane %u of warp %u with mask 0x%08x, which does not include the lane",
               op_name(me.op), lane, warp, mask);
  if (me.width <= 0 || me.width > 32 || (me.width & (me.width - 1)))
    return fmt("%s with width %d (a power of two up to 32 is required)", op_name(me.op),
               me.width);
  for (unsigned l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    if (base + l >= n)
      return fmt("%s with mask 0x%08x in warp %u names lane %u, which the block (%u threads) "
                 "does not have",
                 op_name(me.op), mask, warp, l, n);
    const Fiber& o = s.fibers[base + l];
    if (o.state == DONE)
      return fmt("%s with mask 0x%08x in warp %u: lane %u has already exited", op_name(me.op),
                 mask, warp, l);
    if (o.state != AT_WARP) return "";  // not there yet (a later fiber, or at __syncthreads)
    if (o.mask != mask || o.op != me.op)
      return fmt("warp %u: lane %u is in %s with mask 0x%08x, lane %u in %s with mask 0x%08x",
                 warp, lane, op_name(me.op), mask, l, op_name(o.op), o.mask);
  }
  uint64_t ballot = 0;
  for (unsigned l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && s.fibers[base + l].value) ballot |= 1ull << l;
  for (unsigned l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    Fiber& f = s.fibers[base + l];
    if (me.op == CUDASIM_WARP_BALLOT) {
      f.result = ballot;
    } else if (me.op == CUDASIM_WARP_SYNC) {
      f.result = 0;
    } else {
      const int src = source_lane(me.op, (int)l, f.arg, f.width);
      if (!(mask >> src & 1u))
        return fmt("%s in warp %u: lane %u reads lane %d, which is not in the mask 0x%08x",
                   op_name(me.op), warp, l, src, mask);
      f.result = s.fibers[base + src].value;
    }
  }
  for (unsigned l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    s.fibers[base + l].state = READY;
    ready.push_back(base + l);
  }
  return "";
}

std::string deadlock(Sched& s, unsigned n) {
  unsigned at_barrier = 0, at_warp = 0;
  std::string warps;
  for (unsigned i = 0; i < n; ++i) {
    if (s.fibers[i].state == AT_BARRIER) ++at_barrier;
    if (s.fibers[i].state == AT_WARP) {
      if (at_warp++ < 4)
        warps += fmt(" thread %u waits in %s (mask 0x%08x);", i, op_name(s.fibers[i].op),
                     s.fibers[i].mask);
    }
  }
  return fmt("deadlock: %u threads wait at __syncthreads, %u in warp collectives that never "
             "complete;%s a barrier or collective not reached by every thread it needs",
             at_barrier, at_warp, warps.c_str());
}

// Runs one block; returns "" or the error.
std::string run_block(Sched& s, unsigned n) {
  const dim3 bd = cudasim_block_dim;
  if (s.fibers.size() < n) s.fibers.resize(n);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = s.fibers[i];
    f.state = READY;
    f.stack = nullptr;
    f.tid = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
  }
  if (s.dyn_bytes) memset(s.dyn_shared.data(), 0xff, s.dyn_bytes);  // NaN poison: never zero
  std::vector<unsigned> ready;  // FIFO as a vector with a read index
  size_t head = 0;
  unsigned next = 0, live = n, at_barrier = 0;
  std::string err;
  while (err.empty()) {
    unsigned i;
    if (head < ready.size()) {
      i = ready[head++];
      if (head == ready.size()) ready.clear(), head = 0;
    } else if (next < n) {
      i = next++;
      Fiber& f = s.fibers[i];
      f.stack = take_stack(s);
      if (!f.stack) return "out of memory for a simulated thread's stack";
      start_fiber(s, f);
      ++s.started;
    } else if (live == 0) {
      break;
    } else {
      err = deadlock(s, n);
      break;
    }
    Fiber& f = s.fibers[i];
    resume(s, f);
    switch (f.state) {
      case DONE:
        --live;
        s.free_stacks.push_back(f.stack);
        f.stack = nullptr;
        break;
      case AT_BARRIER:
        ++at_barrier;
        break;
      case AT_WARP:
        err = warp_arrive(s, n, i / 32, ready);
        break;
      case READY:
        break;
    }
    if (err.empty() && at_barrier > 0 && at_barrier == live && next == n) {
      for (unsigned j = 0; j < n; ++j) {
        if (s.fibers[j].state == AT_BARRIER) {
          s.fibers[j].state = READY;
          ready.push_back(j);
        }
      }
      at_barrier = 0;
    }
  }
  // An abandoned block's fibers never resume: their stacks go back to the pool as they are.
  for (unsigned j = 0; j < n; ++j) {
    if (s.fibers[j].stack) s.free_stacks.push_back(s.fibers[j].stack);
    s.fibers[j].stack = nullptr;
  }
  return err;
}

}  // namespace

extern "C" {

void cudasim_syncthreads(void) {
  g_sched->cur->state = AT_BARRIER;
  park();
}

uint64_t cudasim_warp(int op, unsigned mask, uint64_t value, int arg, int width) {
  Fiber* f = g_sched->cur;
  f->op = op;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
  f->state = AT_WARP;
  park();
  return f->result;
}

void* cudasim_dynamic_shared(void) { return g_sched->dyn_shared.data(); }

void cudasim_trap(const char* what) {
  fprintf(stderr, "cudnn-cbr simulated device: kernel thread (%u,%u,%u) of block (%u,%u,%u): %s\n",
          cudasim_thread_idx.x, cudasim_thread_idx.y, cudasim_thread_idx.z, cudasim_block_idx.x,
          cudasim_block_idx.y, cudasim_block_idx.z, what);
  abort();
}

int cudasim_run_grid(const cudasim_launch* l, void (*thread_body)(void*), void* ctx) {
  Sched& s = sched();
  auto fail = [&](const std::string& m) {
    if (l->error && l->error_len) snprintf(l->error, l->error_len, "%s", m.c_str());
    return 1;
  };
  if (s.body) return fail("a kernel launched from inside a kernel (not simulated)");
  const uint64_t n = (uint64_t)l->block.x * l->block.y * l->block.z;
  if (n == 0 || n > 1024 || l->grid.x == 0 || l->grid.y == 0 || l->grid.z == 0)
    return fail(fmt("invalid launch geometry grid (%u,%u,%u) block (%u,%u,%u)", l->grid.x,
                    l->grid.y, l->grid.z, l->block.x, l->block.y, l->block.z));
  s.body = thread_body;
  s.ctx = ctx;
  s.dyn_bytes = l->dynamic_shared;
  if (s.dyn_shared.size() < s.dyn_bytes + 16) s.dyn_shared.resize(s.dyn_bytes + 16);
  cudasim_grid_dim = l->grid;
  cudasim_block_dim = l->block;
  std::string err;
  for (unsigned z = 0; z < l->grid.z && err.empty(); ++z)
    for (unsigned y = 0; y < l->grid.y && err.empty(); ++y)
      for (unsigned x = 0; x < l->grid.x && err.empty(); ++x) {
        cudasim_block_idx = uint3{x, y, z};
        err = run_block(s, (unsigned)n);
        if (!err.empty()) err = fmt("block (%u,%u,%u): ", x, y, z) + err;
      }
  s.body = nullptr;
  s.ctx = nullptr;
  return err.empty() ? 0 : fail(err);
}

// Statistics of the calling OS thread: fibers started and stacks allocated so far.
void cudasim_runtime_stats(uint64_t* started, uint64_t* stacks) {
  Sched& s = sched();
  *started = s.started;
  *stacks = s.stacks;
}
}
