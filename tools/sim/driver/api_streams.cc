// Entry points: streams, stream capture and events.
#include <string.h>

#include "driver.h"

using namespace cudasim;

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
