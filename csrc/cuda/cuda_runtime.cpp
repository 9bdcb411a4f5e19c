#include "cuda/cuda_runtime.h"

#include <cuda.h>

#include <cstring>
#include <optional>
#include <stdexcept>

#include "common.h"
#include "pinned_memory.h"

namespace lmc::cuda {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(concat(what, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
  }
}

DeviceGuard::DeviceGuard(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  // Always set it, even when it already is "current": on a thread that has made no CUDA call,
  // that only makes the device's context current, and driver calls (cuMemGetAddressRange)
  // need a current context.
  check(cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear: no driver or no device is not an error for us
    return 0;
  }
  return n;
}

std::string device_uuid(int device) {
  cudaDeviceProp p;
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  return std::string(p.uuid.bytes, sizeof(p.uuid.bytes));
}

std::string device_name(int device) {
  cudaDeviceProp p;
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  return p.name;
}

std::string device_pci_bus_id(int device) {
  char buf[64] = {0};
  check(cudaDeviceGetPCIBusId(buf, sizeof(buf), device), "cudaDeviceGetPCIBusId");
  return buf;
}

int device_by_uuid(const std::string& uuid) {
  const int n = device_count();
  for (int i = 0; i < n; ++i)
    if (device_uuid(i) == uuid) return i;
  return -1;
}

int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) cudaGetLastError();
  return v;
}

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

namespace {
// cuMemGetAddressRange through the runtime's driver entry point: no link against libcuda.
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
GetAddressRangeFn address_range_fn() {
  static GetAddressRangeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    check(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q),
          "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)");
    if (q != cudaDriverEntryPointSuccess || !p) throw std::runtime_error("cuMemGetAddressRange is unavailable");
    return reinterpret_cast<GetAddressRangeFn>(p);
  }();
  return fn;
}
}  // namespace

MemoryExport export_memory(uintptr_t ptr) {
  cudaPointerAttributes attr;
  check(cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(ptr)), "cudaPointerGetAttributes");
  LMC_CHECK_ARG(attr.type == cudaMemoryTypeDevice, "address ", ptr, " is not CUDA device memory");
  DeviceGuard g(attr.device);
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = address_range_fn()(&base, &size, static_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) throw std::runtime_error(concat("cuMemGetAddressRange failed with code ", r));
  cudaIpcMemHandle_t h;
  cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(concat("cudaIpcGetMemHandle failed: ", cudaGetErrorString(e),
                                    ". KV caches must be plain cudaMalloc allocations (PyTorch's "
                                    "expandable_segments allocator cannot be shared this way)"));
  }
  MemoryExport out;
  out.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  out.offset = ptr - static_cast<uintptr_t>(base);
  out.alloc_bytes = size;
  out.device = attr.device;
  return out;
}

std::pair<uintptr_t, uint64_t> address_range(uintptr_t ptr, int device) {
  std::optional<DeviceGuard> guard;
  if (device >= 0) guard.emplace(device);  // the driver call needs a current context
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = address_range_fn()(&base, &size, static_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) throw std::runtime_error(concat("cuMemGetAddressRange failed with code ", r));
  return {static_cast<uintptr_t>(base), size};
}

uintptr_t open_memory(const std::string& handle, int device) {
  LMC_CHECK_ARG(handle.size() == sizeof(cudaIpcMemHandle_t), "IPC memory handle must be ", sizeof(cudaIpcMemHandle_t),
                " bytes, got ", handle.size());
  DeviceGuard g(device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<uintptr_t>(p);
}

void close_memory(uintptr_t base, int device) {
  DeviceGuard g(device);
  check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(base)), "cudaIpcCloseMemHandle");
}

uintptr_t create_event(int device, bool interprocess, bool blocking) {
  DeviceGuard g(device);
  unsigned flags = cudaEventDisableTiming;
  if (interprocess) flags |= cudaEventInterprocess;
  if (blocking) flags |= cudaEventBlockingSync;
  cudaEvent_t ev;
  check(cudaEventCreateWithFlags(&ev, flags), "cudaEventCreateWithFlags");
  return reinterpret_cast<uintptr_t>(ev);
}

void destroy_event(uintptr_t event) { cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)); }

std::string event_ipc_handle(uintptr_t event) {
  cudaIpcEventHandle_t h;
  check(cudaIpcGetEventHandle(&h, reinterpret_cast<cudaEvent_t>(event)), "cudaIpcGetEventHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

uintptr_t open_event(const std::string& handle, int device) {
  LMC_CHECK_ARG(handle.size() == sizeof(cudaIpcEventHandle_t), "IPC event handle must be ",
                sizeof(cudaIpcEventHandle_t), " bytes, got ", handle.size());
  DeviceGuard g(device);
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t ev;
  check(cudaIpcOpenEventHandle(&ev, h), "cudaIpcOpenEventHandle");
  return reinterpret_cast<uintptr_t>(ev);
}

void record_event(uintptr_t event, uintptr_t stream) {
  check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
}

void stream_wait_event(uintptr_t stream, uintptr_t event) {
  check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), reinterpret_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

void event_synchronize(uintptr_t event) {
  check(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

bool event_query(uintptr_t event) {
  cudaError_t e = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) return false;
  check(e, "cudaEventQuery");
  return true;
}

uintptr_t create_stream(int device, bool high_priority) {
  DeviceGuard g(device);
  int least = 0, greatest = 0;
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t s;
  check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, high_priority ? greatest : least),
        "cudaStreamCreateWithPriority");
  return reinterpret_cast<uintptr_t>(s);
}

void destroy_stream(uintptr_t stream) { cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream)); }

bool stream_query(uintptr_t stream) {
  cudaError_t e = cudaStreamQuery(reinterpret_cast<cudaStream_t>(stream));
  if (e == cudaErrorNotReady) return false;
  check(e, "cudaStreamQuery");
  return true;
}

void stream_synchronize(uintptr_t stream) {
  check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

}  // namespace lmc::cuda

namespace lmc {

bool pin_host_memory(void* ptr, size_t bytes, std::string* error) {
  cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (error) *error = concat("cudaHostRegister: ", cudaGetErrorString(e));
    return false;
  }
  return true;
}

void unpin_host_memory(void* ptr) {
  if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
}

bool pinning_available() { return cuda::device_count() > 0; }

}  // namespace lmc
