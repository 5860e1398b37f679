/* A stand-in for the NVIDIA driver library (libcuda.so.1), for the oracle tier only
 * (docs/oracle.md). vLLM's and torch's compiled extensions link against libcuda.so.1, so they
 * cannot even be imported on a machine without the driver. This library exports the driver
 * symbols they reference (found with `nm -D --undefined-only` on vLLM 0.33.0's *.so), and every
 * call fails with CUDA_ERROR_NO_DEVICE: start-up sizing never launches a kernel, and a call that
 * would need a GPU fails loudly instead of pretending. Build: gcc -shared -fPIC -o libcuda.so.1 */
#include <stddef.h>

#define CUDA_ERROR_NO_DEVICE 100
#define STUB(name) int name() { return CUDA_ERROR_NO_DEVICE; }

STUB(cuInit)
STUB(cuCtxGetCurrent) STUB(cuCtxSetCurrent) STUB(cuDeviceGet) STUB(cuDeviceGetAttribute)
STUB(cuDeviceGetCount) STUB(cuDevicePrimaryCtxGetState) STUB(cuDevicePrimaryCtxRetain)
STUB(cuFuncGetAttribute) STUB(cuFuncSetAttribute) STUB(cuFuncSetCacheConfig)
STUB(cuGetProcAddress) STUB(cuGetProcAddress_v2) STUB(cuLaunchCooperativeKernel) STUB(cuLaunchKernel)
STUB(cuLinkAddData_v2) STUB(cuLinkComplete) STUB(cuLinkCreate_v2) STUB(cuLinkDestroy)
STUB(cuMemAddressFree) STUB(cuMemAddressReserve) STUB(cuMemCreate) STUB(cuMemGetAllocationGranularity)
STUB(cuMemMap) STUB(cuMemRelease) STUB(cuMemSetAccess) STUB(cuMemUnmap)
STUB(cuModuleGetFunction) STUB(cuModuleLoad) STUB(cuModuleLoadData) STUB(cuModuleLoadDataEx)
STUB(cuModuleUnload) STUB(cuOccupancyMaxActiveBlocksPerMultiprocessor) STUB(cuPointerGetAttribute)
STUB(cuTensorMapEncodeTiled) STUB(cuMemGetInfo) STUB(cuMemGetInfo_v2) STUB(cuStreamGetCtx)
STUB(cuKernelGetFunction) STUB(cuLibraryLoadData) STUB(cuLibraryGetKernel) STUB(cuLibraryUnload)

int cuDriverGetVersion(int *version) {
    if (version) *version = 13000;
    return 0;
}

int cuGetErrorString(int error, const char **str) {
    if (str) *str = "no CUDA device (vllmfit oracle stub libcuda)";
    return 0;
}

int cuGetErrorName(int error, const char **str) {
    if (str) *str = "CUDA_ERROR_NO_DEVICE";
    return 0;
}
