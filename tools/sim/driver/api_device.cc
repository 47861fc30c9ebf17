// Entry points: errors, the device, the context, memory and copies.
#include <stdio.h>
#include <string.h>

#include "driver.h"

using namespace cudasim;

static const char* err_name(CUresult e) {
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

namespace cudasim {
int g_ctx_tag;
thread_local bool t_current = false;
}  // namespace cudasim

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
