// The simulated NCCL (tools/sim/nccl.cc) with several ranks in one process: each rank a thread
// with its own communicator and stream on the simulated device, as amp's multi-GPU tests
// use them. Loads the driver and NCCL stand-ins from this binary's folder (where
// tools/sim/build.sh puts all three). `nccl-check` runs every check, printing `ok <check>` lines,
// and exits nonzero naming the first failure. Run it with CUDNN_CBR_DEVICE=sim, and with
// CUDNN_CBR_SIM_ADVERSARIAL=1 for the adversarial stream order.
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

typedef struct {
  char internal[128];
} ncclUniqueId;
typedef struct ncclComm* ncclComm_t;
enum { Sum = 0, Prod = 1, Max = 2, Min = 3, Avg = 4 };
enum { I8 = 0, U8 = 1, I32 = 2, U32 = 3, I64 = 4, U64 = 5, F16 = 6, F32 = 7, F64 = 8, BF16 = 9 };

namespace {

struct Api {
  CUresult (*init)(unsigned);
  CUresult (*retain)(CUcontext*, CUdevice);
  CUresult (*set_current)(CUcontext);
  CUresult (*alloc)(CUdeviceptr*, size_t);
  CUresult (*free)(CUdeviceptr);
  CUresult (*htod)(CUdeviceptr, const void*, size_t);
  CUresult (*dtoh)(void*, CUdeviceptr, size_t);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*stream_sync)(CUstream);
  CUresult (*ctx_sync)();
  CUresult (*stream_destroy)(CUstream);
  CUresult (*begin_capture)(CUstream, CUstreamCaptureMode);
  CUresult (*end_capture)(CUstream, CUgraph*);
  CUresult (*instantiate)(CUgraphExec*, CUgraph, unsigned long long);
  CUresult (*graph_launch)(CUgraphExec, CUstream);
  CUresult (*exec_destroy)(CUgraphExec);
  CUresult (*graph_destroy)(CUgraph);
  CUresult (*event_create)(CUevent*, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_destroy)(CUevent);
  CUresult (*event_sync)(CUevent);
  CUresult (*stream_wait)(CUstream, CUevent, unsigned);
  CUresult (*dtod_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  int (*get_id)(ncclUniqueId*);
  int (*comm_init)(ncclComm_t*, int, ncclUniqueId, int);
  int (*all_reduce)(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
  int (*broadcast)(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
  int (*destroy)(ncclComm_t);
  int (*abort)(ncclComm_t);
  int (*async_error)(ncclComm_t, int*);
  const char* (*last_error)(ncclComm_t);
} A;
CUcontext g_ctx;
thread_local bool t_aborted = false;  // the rank's communicator was aborted (not destroyed)

[[noreturn]] void die(const char* what, int line) {
  printf("FAIL (line %d): %s\n", line, what);
  fflush(stdout);
  _exit(1);
}
#define CHECK(c) \
  if (!(c)) die(#c, __LINE__)
#define CU(x) CHECK((x) == CUDA_SUCCESS)
#define NC(x)                                                         \
  do {                                                                \
    if (int rc_ = (x)) {                                              \
      printf("NCCL %d: %s\n", rc_, A.last_error(nullptr));            \
      die(#x, __LINE__);                                              \
    }                                                                 \
  } while (0)

void load() {
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  CHECK(n > 0);
  exe[n] = 0;
  std::string dir(exe);
  dir = dir.substr(0, dir.rfind('/'));
  void* cu = dlopen((dir + "/libcuda.so").c_str(), RTLD_NOW);
  void* nc = dlopen((dir + "/libnccl.so.2").c_str(), RTLD_NOW);
  if (!cu || !nc) die(dlerror(), __LINE__);
  auto sym = [](void* h, auto& f, const char* name) {
    f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
    if (!f) die(name, __LINE__);
  };
  sym(cu, A.init, "cuInit");
  sym(cu, A.retain, "cuDevicePrimaryCtxRetain");
  sym(cu, A.set_current, "cuCtxSetCurrent");
  sym(cu, A.alloc, "cuMemAlloc_v2");
  sym(cu, A.free, "cuMemFree_v2");
  sym(cu, A.htod, "cuMemcpyHtoD_v2");
  sym(cu, A.dtoh, "cuMemcpyDtoH_v2");
  sym(cu, A.stream_create, "cuStreamCreate");
  sym(cu, A.stream_sync, "cuStreamSynchronize");
  sym(cu, A.ctx_sync, "cuCtxSynchronize");
  sym(cu, A.stream_destroy, "cuStreamDestroy_v2");
  sym(cu, A.begin_capture, "cuStreamBeginCapture_v2");
  sym(cu, A.end_capture, "cuStreamEndCapture");
  sym(cu, A.instantiate, "cuGraphInstantiateWithFlags");
  sym(cu, A.graph_launch, "cuGraphLaunch");
  sym(cu, A.exec_destroy, "cuGraphExecDestroy");
  sym(cu, A.graph_destroy, "cuGraphDestroy");
  sym(cu, A.event_create, "cuEventCreate");
  sym(cu, A.event_record, "cuEventRecord");
  sym(cu, A.event_destroy, "cuEventDestroy_v2");
  sym(cu, A.event_sync, "cuEventSynchronize");
  sym(cu, A.stream_wait, "cuStreamWaitEvent");
  sym(cu, A.dtod_async, "cuMemcpyDtoDAsync_v2");
  sym(nc, A.get_id, "ncclGetUniqueId");
  sym(nc, A.comm_init, "ncclCommInitRank");
  sym(nc, A.all_reduce, "ncclAllReduce");
  sym(nc, A.broadcast, "ncclBroadcast");
  sym(nc, A.destroy, "ncclCommDestroy");
  sym(nc, A.abort, "ncclCommAbort");
  sym(nc, A.async_error, "ncclCommGetAsyncError");
  sym(nc, A.last_error, "ncclGetLastError");
}

CUdeviceptr upload(const void* host, size_t bytes) {
  CUdeviceptr d;
  CU(A.alloc(&d, bytes));
  CU(A.htod(d, host, bytes));
  return d;
}
template <class T>
std::vector<T> download(CUdeviceptr d, size_t n) {
  std::vector<T> v(n);
  CU(A.dtoh(v.data(), d, n * sizeof(T)));
  return v;
}

// Runs f(rank, comm, stream) on `n` threads, one rank each, of a fresh communicator; each
// waits for its stream, destroys its communicator and its stream.
void ranks(int n, const std::function<void(int, ncclComm_t, CUstream)>& f) {
  ncclUniqueId id;
  NC(A.get_id(&id));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      CU(A.set_current(g_ctx));
      ncclComm_t c;
      NC(A.comm_init(&c, n, id, r));
      CUstream s;
      CU(A.stream_create(&s, 0));
      f(r, c, s);
      CU(A.stream_sync(s));
      if (!t_aborted) NC(A.destroy(c));
      CU(A.stream_destroy(s));
    });
  for (auto& t : ts) t.join();
}

uint16_t h_bits(_Float16 h) {
  uint16_t b;
  memcpy(&b, &h, 2);
  return b;
}
_Float16 h_of(uint16_t b) {
  _Float16 h;
  memcpy(&h, &b, 2);
  return h;
}

// An all-reduce of `count` elements of T over 3 ranks, in place when `in_place`; returns
// each rank's result.
template <class T>
std::vector<std::vector<T>> all_reduce3(const std::vector<std::vector<T>>& in, int type, int op,
                                        bool in_place) {
  std::vector<std::vector<T>> out(3);
  const size_t count = in[0].size(), bytes = count * sizeof(T);
  ranks(3, [&](int r, ncclComm_t c, CUstream s) {
    CUdeviceptr send = upload(in[r].data(), bytes);
    CUdeviceptr recv = in_place ? send : upload(std::vector<char>(bytes, 0x5a).data(), bytes);
    NC(A.all_reduce((void*)send, (void*)recv, count, type, op, c, s));
    CU(A.stream_sync(s));
    out[r] = download<T>(recv, count);
    if (!in_place) CHECK(download<T>(send, count) == in[r]);  // the source is unchanged
    CU(A.free(send));
    if (!in_place) CU(A.free(recv));
  });
  return out;
}

void check_f16_sum() {
  std::mt19937 rng(7);
  std::vector<std::vector<uint16_t>> in(3, std::vector<uint16_t>(4096));
  for (auto& v : in)
    for (auto& x : v) x = h_bits((_Float16)(float)((int)(rng() % 4096) - 2048) / (_Float16)64.0f);
  // 2048 + 1 + 1: rounded after each add (NCCL's __hadd) it stays 2048; the exact sum
  // rounded once would be 2050.
  in[0][0] = h_bits((_Float16)2048.0f), in[1][0] = h_bits((_Float16)1.0f);
  in[2][0] = h_bits((_Float16)1.0f);
  for (bool in_place : {false, true}) {
    auto out = all_reduce3(in, F16, Sum, in_place);
    for (size_t i = 0; i < in[0].size(); ++i) {
      _Float16 acc = h_of(in[0][i]);
      for (int r = 1; r < 3; ++r) acc = (_Float16)((float)acc + (float)h_of(in[r][i]));
      for (int r = 0; r < 3; ++r) CHECK(out[r][i] == h_bits(acc));
    }
    CHECK(out[0][0] == h_bits((_Float16)2048.0f));
  }
  printf("ok f16 sum: 3 ranks, 4096 values, each add rounded to nearest even in rank order, "
         "in and out of place\n");
}

void check_other_types_and_ops() {
  // bf16: 256 + 1 + 1 stays 256 (8-bit significand, ties to even), 1.5 + 2 + 4 = 7.5.
  auto b = all_reduce3<uint16_t>({{0x4380, 0x3fc0}, {0x3f80, 0x4000}, {0x3f80, 0x4080}}, BF16,
                                 Sum, false);
  CHECK(b[1][0] == 0x4380 && b[1][1] == 0x40f0);
  auto mx = all_reduce3<float>({{1, -5, 3}, {2, -6, 0}, {-1, -4, 9}}, F32, Max, true);
  CHECK((mx[2] == std::vector<float>{2, -4, 9}));
  auto mn = all_reduce3<float>({{1, -5, 3}, {2, -6, 0}, {-1, -4, 9}}, F32, Min, false);
  CHECK((mn[0] == std::vector<float>{-1, -6, 0}));
  auto pr = all_reduce3<double>({{1.5, 2}, {2, -3}, {4, 0.5}}, F64, Prod, false);
  CHECK((pr[1] == std::vector<double>{12, -3}));
  auto av = all_reduce3<float>({{1, 0.1f}, {2, 0.2f}, {3, 0.7f}}, F32, Avg, false);
  const float s = 1.0f / 3.0f;  // NCCL's ncclAvg for floats: each input times 1/nranks
  CHECK(av[0][0] == 1 * s + 2 * s + 3 * s && av[0][1] == 0.1f * s + 0.2f * s + 0.7f * s);
  auto i32 = all_reduce3<int32_t>({{INT32_MAX, 5}, {1, -7}, {0, 2}}, I32, Sum, false);
  CHECK(i32[0][0] == INT32_MIN && i32[0][1] == 0);  // wraps, as on the device
  auto u8 = all_reduce3<uint8_t>({{200, 9}, {100, 3}, {1, 7}}, U8, Sum, true);
  CHECK(u8[2][0] == 45 && u8[2][1] == 19);
  auto i64 = all_reduce3<int64_t>({{10, -10}, {20, -20}, {31, -31}}, I64, Avg, false);
  CHECK(i64[0][0] == 20 && i64[0][1] == -20);  // summed, then divided (truncating)
  auto u32 = all_reduce3<uint32_t>({{7, 1}, {3, 9}, {5, 4}}, U32, Max, false);
  CHECK(u32[1][0] == 7 && u32[1][1] == 9);
  auto i8 = all_reduce3<int8_t>({{-128, 4}, {-1, 5}, {0, -3}}, I8, Min, false);
  CHECK(i8[0][0] == -128 && i8[0][1] == -3);
  auto u64 = all_reduce3<uint64_t>({{1ull << 40}, {1ull << 30}, {2}}, U64, Prod, false);
  CHECK(u64[2][0] == 0);  // 2^71 wraps to 0
  printf("ok bf16 sum, f32 max/min/avg, f64 prod, i32/u8 wrapping sums, i64 avg, u32 max, "
         "i8 min, u64 prod\n");
}

void check_broadcast() {
  std::vector<std::vector<float>> got(3);
  ranks(3, [&](int r, ncclComm_t c, CUstream s) {
    std::vector<float> mine(100);
    for (int i = 0; i < 100; ++i) mine[i] = (float)(r * 1000 + i);
    CUdeviceptr send = upload(mine.data(), 400);
    CUdeviceptr recv = upload(std::vector<float>(100, -1).data(), 400);
    NC(A.broadcast((void*)send, (void*)recv, 100, F32, 1, c, s));  // out of place, root 1
    NC(A.broadcast((void*)send, (void*)send, 50, F32, 2, c, s));   // in place, root 2
    CU(A.stream_sync(s));
    got[r] = download<float>(recv, 100);
    auto in_place = download<float>(send, 100);
    for (int i = 0; i < 100; ++i)
      CHECK(in_place[i] == (i < 50 ? (float)(2000 + i) : mine[i]));
    CU(A.free(send));
    CU(A.free(recv));
  });
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 100; ++i) CHECK(got[r][i] == (float)(1000 + i));
  printf("ok broadcast: root 1 out of place, root 2 in place over half the buffer\n");
}

void check_capture_and_replay() {
  ranks(3, [&](int r, ncclComm_t c, CUstream s) {
    std::vector<float> v(64, (float)(r + 1));
    CUdeviceptr buf = upload(v.data(), 256);
    CU(A.begin_capture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    NC(A.all_reduce((void*)buf, (void*)buf, 64, F32, Sum, c, s));
    CUgraph g;
    CU(A.end_capture(s, &g));
    CUgraphExec e;
    CU(A.instantiate(&e, g, 0));
    CHECK(download<float>(buf, 64) == v);  // recorded, not run
    CU(A.graph_launch(e, s));
    CU(A.stream_sync(s));
    CHECK(download<float>(buf, 64) == std::vector<float>(64, 6));
    CU(A.graph_launch(e, s));  // each replay sums again: 6 + 6 + 6
    CU(A.stream_sync(s));
    CHECK(download<float>(buf, 64) == std::vector<float>(64, 18));
    CU(A.exec_destroy(e));
    CU(A.graph_destroy(g));
    CU(A.free(buf));
  });
  printf("ok a captured all-reduce runs at each replay, not at capture\n");
}

// A rank's collective blocks (its peer comes 100 ms later) while a second stream of the same
// rank waits on an event recorded behind it: the device-wide flush the blocked host function
// makes must skip that wait, not wait for its own thread (it used to hang here).
void check_event_wait_behind_a_blocked_collective() {
  ranks(2, [&](int r, ncclComm_t c, CUstream s) {
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::vector<float> v(16, (float)(r + 1));
    CUdeviceptr buf = upload(v.data(), 64);
    CUdeviceptr copy = upload(std::vector<float>(16, -1).data(), 64);
    CUstream side;
    CU(A.stream_create(&side, 0));
    CUevent e;
    CU(A.event_create(&e, 0));
    NC(A.all_reduce((void*)buf, (void*)buf, 16, F32, Sum, c, s));
    CU(A.event_record(e, s));
    CU(A.stream_wait(side, e, 0));
    CU(A.dtod_async(copy, buf, 64, side));  // reads the sum: behind the wait
    CU(A.stream_sync(s));
    CU(A.stream_sync(side));
    CHECK(download<float>(copy, 16) == std::vector<float>(16, 3));
    CU(A.event_destroy(e));
    CU(A.stream_destroy(side));
    CU(A.free(buf));
    CU(A.free(copy));
  });
  printf("ok an event wait queued behind a blocked collective of the same rank runs after it\n");
}

// A second thread of rank 0 waits for an event behind a stream's event wait, and so runs
// that wait, which blocks in rank 0's collective (rank 1 comes 150 ms later). Meanwhile rank
// 0 synchronizes the waiting stream: the copy queued behind the wait must not run before
// the collective (it did: the stream was not busy while another thread ran its wait).
void check_a_wait_run_by_another_thread_holds_its_stream() {
  ranks(2, [&](int r, ncclComm_t c, CUstream s) {
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(150));
    CUdeviceptr buf = upload(std::vector<float>(16, (float)(r + 1)).data(), 64);
    CUdeviceptr copy = upload(std::vector<float>(16, -1).data(), 64);
    CUstream side;
    CU(A.stream_create(&side, 0));
    CUevent summed, copied;
    CU(A.event_create(&summed, 0));
    CU(A.event_create(&copied, 0));
    NC(A.all_reduce((void*)buf, (void*)buf, 16, F32, Sum, c, s));
    CU(A.event_record(summed, s));
    CU(A.stream_wait(side, summed, 0));
    CU(A.dtod_async(copy, buf, 64, side));
    CU(A.event_record(copied, side));
    std::thread waiter;
    if (r == 0) {
      waiter = std::thread([&] {
        CU(A.set_current(g_ctx));
        CU(A.event_sync(copied));
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // it is in the wait
    }
    CU(A.stream_sync(side));
    std::vector<float> got(16);
    memcpy(got.data(), (const void*)copy, 64);  // straight from memory, as above
    CHECK(got == std::vector<float>(16, 3));
    if (waiter.joinable()) waiter.join();
    CU(A.stream_sync(s));
    CU(A.event_destroy(summed));
    CU(A.event_destroy(copied));
    CU(A.stream_destroy(side));
    CU(A.free(buf));
    CU(A.free(copy));
  });
  printf("ok a stream whose event wait another thread runs stays busy until the wait is over\n");
}

// Two ranks run 60 all-reduces, each checked, while a third thread keeps flushing the whole
// device (synchronous copies) and so runs the ranks' queued collectives on their behalf,
// deferring those that must wait. A synchronize must not return while its stream still holds
// a deferred collective (it did: a stale read, or a write into a buffer freed after it), nor
// may a device-wide one (a synchronous copy, cuCtxSynchronize) while the flusher holds the
// rank's own collective (it did not wait for a stream busy on another thread).
void check_syncs_with_a_device_wide_flusher() {
  std::atomic<bool> stop{false};
  CUdeviceptr probe = upload(std::vector<float>(1, 0).data(), 4);
  std::thread flusher([&] {
    CU(A.set_current(g_ctx));
    float x;
    while (!stop) {  // (with pauses, so that the ranks get the driver between its flushes)
      CU(A.dtoh(&x, probe, 4));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  ranks(2, [&](int r, ncclComm_t c, CUstream s) {
    std::mt19937 rng(11 + r);
    for (int i = 0; i < 60; ++i) {
      const float mine = (float)(i * 2 + r);
      CUdeviceptr buf = upload(std::vector<float>(8, mine).data(), 32);
      // Rank 1 often comes more than 5 ms late (a deferring flush waits that long for the
      // peers); rank 0 synchronizes 1 ms after its call, so the flusher has usually taken
      // its collective by then and is about to defer it.
      if (r == 1) std::this_thread::sleep_for(std::chrono::microseconds(2000 + rng() % 6000));
      NC(A.all_reduce((void*)buf, (void*)buf, 8, F32, Sum, c, s));
      if (r == 0) std::this_thread::sleep_for(std::chrono::microseconds(1000));
      float x;
      switch (i % 3) {  // three ways to wait for the collective
        case 0: CU(A.stream_sync(s)); break;
        case 1: CU(A.dtoh(&x, probe, 4)); break;
        default: CU(A.ctx_sync()); break;
      }
      // Read straight from the simulated device's memory (host memory): a copy would flush
      // the device first and hide a synchronize that returned early.
      std::vector<float> got(8);
      memcpy(got.data(), (const void*)buf, 32);
      if (got != std::vector<float>(8, (float)(4 * i + 1))) {
        printf("rank %d, all-reduce %d: read %g, the sum is %d\n", r, i, got[0], 4 * i + 1);
        die("a synchronize returned before its collective ran", __LINE__);
      }
      CU(A.free(buf));
    }
  });
  stop = true;
  flusher.join();
  CU(A.free(probe));
  printf("ok 2 ranks x 60 all-reduces, each read after a synchronize (of its stream, a copy, "
         "the context), beside a thread flushing the whole device\n");
}

void check_abort_ends_a_wait() {
  ranks(2, [&](int r, ncclComm_t c, CUstream s) {
    if (r == 1) {  // never joins the collective: aborts after a while
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      NC(A.abort(c));
      t_aborted = true;
      return;
    }
    std::vector<float> v(8, 3);
    CUdeviceptr buf = upload(v.data(), 32);
    NC(A.all_reduce((void*)buf, (void*)buf, 8, F32, Sum, c, s));
    CU(A.stream_sync(s));  // returns once the peer has aborted
    int state = -1;
    NC(A.async_error(c, &state));
    CHECK(state == 6);  // ncclRemoteError
    CHECK(strstr(A.last_error(c), "rank 1 of 2 aborted") != nullptr);
    CHECK(download<float>(buf, 8) == v);
    CU(A.free(buf));
  });
  printf("ok an abort ends a peer's wait with ncclRemoteError\n");
}

void check_refusals() {
  // A group of 2 being formed: a third nranks, a duplicate rank and a rank out of range.
  ncclUniqueId id;
  NC(A.get_id(&id));
  ncclComm_t c0 = nullptr, c1 = nullptr, bad = nullptr;
  std::thread first([&] { NC(A.comm_init(&c0, 2, id, 0)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0 has joined
  CHECK(A.comm_init(&bad, 3, id, 1) == 4);  // ncclInvalidArgument
  CHECK(strstr(A.last_error(nullptr), "nranks 3, the group of this id has 2"));
  CHECK(A.comm_init(&bad, 2, id, 2) == 4);
  CHECK(strstr(A.last_error(nullptr), "rank 2 is not a rank of 2"));
  CHECK(A.comm_init(&bad, 2, id, 0) == 5);  // ncclInvalidUsage: rank 0 is there already
  CHECK(strstr(A.last_error(nullptr), "joined the group of this id twice"));
  NC(A.comm_init(&c1, 2, id, 1));
  first.join();
  CHECK(c0 && c1 && !bad);
  // The planted bugs: a receive buffer 4 bytes past its allocation, a freed send buffer.
  CUstream s;
  CU(A.stream_create(&s, 0));
  CUdeviceptr small, big, freed;
  CU(A.alloc(&small, 4096));
  CU(A.alloc(&big, 8192));
  CU(A.alloc(&freed, 4100));
  CU(A.free(freed));
  CHECK(A.all_reduce((void*)big, (void*)small, 1025, F32, Sum, c0, s) == 4);
  printf("planted: %s\n", A.last_error(c0));
  CHECK(strstr(A.last_error(c0), "recvbuff: 4100 bytes at"));
  CHECK(strstr(A.last_error(c0), "overrun the allocation"));
  CHECK(A.all_reduce((void*)freed, (void*)small, 16, F32, Sum, c0, s) == 4);
  printf("planted: %s\n", A.last_error(c0));
  CHECK(strstr(A.last_error(c0), "sendbuff 0x"));
  CHECK(strstr(A.last_error(c0), "is not in any live allocation"));
  CHECK(A.all_reduce((void*)small, (void*)small, 16, 10, Sum, c0, s) == 4);  // fp8: not here
  CU(A.free(small));
  CU(A.free(big));
  CU(A.stream_destroy(s));
  NC(A.destroy(c0));
  NC(A.destroy(c1));
  printf("ok refused: a mismatching nranks, a rank out of range, a duplicate rank, a receive "
         "buffer past its allocation, a freed send buffer\n");
}

}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  load();
  // Unselected, the stand-in makes no ids.
  const char* dev = getenv("CUDNN_CBR_DEVICE");
  CHECK(dev && strcmp(dev, "sim") == 0);
  unsetenv("CUDNN_CBR_DEVICE");
  ncclUniqueId id;
  CHECK(A.get_id(&id) != 0);
  CHECK(strstr(A.last_error(nullptr), "runs only on the simulated device"));
  setenv("CUDNN_CBR_DEVICE", "sim", 1);
  CU(A.init(0));
  CU(A.retain(&g_ctx, 0));
  CU(A.set_current(g_ctx));
  check_f16_sum();
  check_other_types_and_ops();
  check_broadcast();
  check_capture_and_replay();
  check_event_wait_behind_a_blocked_collective();
  check_a_wait_run_by_another_thread_holds_its_stream();
  check_syncs_with_a_device_wide_flusher();
  check_abort_ends_a_wait();
  check_refusals();
  printf("all simulated NCCL checks passed\n");
  return 0;
}
