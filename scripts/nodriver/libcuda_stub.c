/*
 * No-driver stand-in for libcuda.so.1, for test machines WITHOUT an NVIDIA driver only.
 *
 * cuDNN looks these symbols up while it plans runtime-compiled engines; when any is missing
 * it silently drops every such engine ("cannot load libcuda"). Every entry point here reports
 * CUDA_ERROR_NO_DEVICE (100), except the few that must succeed for cuDNN to carry on planning
 * deviceless. Never install this where a real driver exists: scripts/setup-test-deps.sh
 * builds it only when no libcuda.so.1 is found.
 */
#include <stddef.h>

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NO_DEVICE 100

static const char no_device_msg[] = "no CUDA driver (no-driver stand-in for deviceless tests)";

CUresult cuGetErrorString(CUresult error, const char **str) {
  (void)error;
  if (str) *str = no_device_msg;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
  (void)error;
  if (str) *str = "CUDA_ERROR_NO_DEVICE";
  return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
  if (version) *version = 13000;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  if (count) *count = 0;
  return CUDA_ERROR_NO_DEVICE;
}

/* Everything else: no device. Arguments are ignored, so one variadic-free shape suffices on
 * the x86-64 and aarch64 ABIs (callers pass arguments in registers the callee never reads). */
#define NO_DEVICE(name) \
  CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuInit)
NO_DEVICE(cuGetProcAddress)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuModuleLoadData)
NO_DEVICE(cuModuleUnload)
NO_DEVICE(cuTensorMapEncodeIm2col)
NO_DEVICE(cuTensorMapEncodeTiled)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxGetLimit)
NO_DEVICE(cuCtxPopCurrent)
NO_DEVICE(cuCtxPushCurrent)
NO_DEVICE(cuStreamGetCtx)
NO_DEVICE(cuLinkCreate)
NO_DEVICE(cuLinkAddData)
NO_DEVICE(cuLinkComplete)
NO_DEVICE(cuLinkDestroy)
NO_DEVICE(cuLaunchKernel)
NO_DEVICE(cuLaunchCooperativeKernel)
NO_DEVICE(cuLaunchKernelEx)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuLibraryLoadData)
NO_DEVICE(cuLibraryLoadFromFile)
NO_DEVICE(cuLibraryGetKernel)
NO_DEVICE(cuLibraryUnload)
NO_DEVICE(cuKernelSetAttribute)
NO_DEVICE(cuKernelGetAttribute)
NO_DEVICE(cuKernelGetFunction)
NO_DEVICE(cuOccupancyMaxPotentialClusterSize)
