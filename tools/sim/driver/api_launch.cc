// Entry points: modules, functions, kernel and host-function launches, graphs and user
// objects.
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "driver.h"

using namespace cudasim;

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
