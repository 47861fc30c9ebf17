// Streams, events and graphs: eager execution in enqueue order (which honours every stream
// order and event wait), a stream under capture records instead and a graph launch replays
// what was recorded; or, in the adversarial mode, per-stream queues run only when something
// needs them, most recent first.
#include <stdio.h>
#include <string.h>

#include <condition_variable>

#include "driver.h"

namespace cudasim {

// ------------------------------------------------------------------ streams, events, graphs

Stream g_null_stream;
std::set<Stream*> g_streams;
int g_captures = 0;  // active captures
// A fault in work already enqueued (a host function reported one through cudasim_fault): as
// after a kernel fault on the device, the context is unusable and the calls that report
// asynchronous errors (synchronizes, queries, copies, launches) return it from then on.
CUresult g_fault = CUDA_SUCCESS;

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


void release_user_object(UserObject* o, unsigned n) {
  o->refs = n >= o->refs ? 0 : o->refs - n;
  if (o->refs == 0) {
    if (o->destroy) o->destroy(o->ptr);
    delete o;
  }
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
void hold_busy(Stream* s, std::thread::id by) {
  if (s && s->busy++ == 0) s->busy_for = by;
}
void release_busy(Stream* s) {
  if (s) --s->busy;
  wake();
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

// Runs an op just taken from the front of `s`'s queue. An event wait may release the driver
// deep inside (a host function of the stream it flushes blocks): `s` is busy meanwhile, so
// that no other thread runs its later work ahead of the wait, nor returns from a
// synchronize of it.
CUresult run_popped(Stream* s, const Op& op) {
  if (op.kind != Op::WAIT) return run_queued(s, op);
  hold_busy(s, op.by);
  const CUresult r = run_queued(s, op);
  release_busy(s);
  return r;
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
    CUresult r = run_popped(s, item.second);
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
    CUresult r = run_popped(pick, item.second);
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

}  // namespace cudasim
