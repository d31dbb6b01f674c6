/* A stand-in for the driver's libcuda.so.1 that reports a CUDA 12.4 driver and nothing else, so
   the offload benchmark's CUDA runtime (13.x, linked statically) meets a driver older than itself,
   as on a host whose driver was not updated with the toolkit.

   What the runtime asks of it was found by trying: it loads libcuda.so.1, resolves entry points
   through cuGetProcAddress (_v2 first), reads cuDriverGetVersion and, when that is older than
   itself, answers cudaErrorInsufficientDriver without calling anything else. Every other entry
   point is "not found" (CUDA_ERROR_NOT_FOUND, 500 in cuda.h), so a runtime that needed more
   would fail loudly, not silently. Built by tests/agent/test_offload_bench_build.py. */
#include <string.h>

#define DRIVER_CUDA_VERSION 12040 /* 1000 x major + 10 x minor, as cuDriverGetVersion gives it */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_FOUND 500

int cuDriverGetVersion(int *version) {
  *version = DRIVER_CUDA_VERSION;
  return CUDA_SUCCESS;
}

int cuInit(unsigned flags) {
  (void)flags;
  return CUDA_SUCCESS;
}

int cuGetProcAddress(const char *name, void **function, int version, unsigned long long flags) {
  (void)version;
  (void)flags;
  if (!strcmp(name, "cuDriverGetVersion")) *function = (void *)cuDriverGetVersion;
  else if (!strcmp(name, "cuInit")) *function = (void *)cuInit;
  else if (!strcmp(name, "cuGetProcAddress")) *function = (void *)cuGetProcAddress;
  else {
    *function = 0;
    return CUDA_ERROR_NOT_FOUND;
  }
  return CUDA_SUCCESS;
}

int cuGetProcAddress_v2(const char *name, void **function, int version, unsigned long long flags,
                        int *symbol_status) {
  if (symbol_status) *symbol_status = 0;
  return cuGetProcAddress(name, function, version, flags);
}
