// Thin, checked wrappers over the CUDA runtime: devices, IPC memory and events, streams.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

namespace lmc::cuda {

// Throws std::runtime_error naming the call and CUDA's message when err != cudaSuccess.
void check(cudaError_t err, const char* what);

// Makes `device` current for the calling thread and restores the previous one on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

int device_count();                   // 0 when there is no driver or no device
std::string device_uuid(int device);  // 16 raw bytes
std::string device_name(int device);
std::string device_pci_bus_id(int device);
int device_by_uuid(const std::string& uuid);  // -1 when this process cannot see it
int driver_version();
int runtime_version();

struct MemoryExport {
  std::string handle;  // cudaIpcMemHandle_t bytes
  uint64_t offset = 0;      // of the pointer inside its allocation
  uint64_t alloc_bytes = 0;  // size of the allocation
  int device = -1;
};
MemoryExport export_memory(uintptr_t ptr);
// (base, bytes) of the allocation holding a device address (mapped IPC memory included).
std::pair<uintptr_t, uint64_t> address_range(uintptr_t ptr, int device = -1);
uintptr_t open_memory(const std::string& handle, int device);  // base address of the allocation
void close_memory(uintptr_t base, int device);

// Inter-process events (no timing). blocking: host waits sleep instead of spinning.
uintptr_t create_event(int device, bool interprocess, bool blocking);
void destroy_event(uintptr_t event);
std::string event_ipc_handle(uintptr_t event);
uintptr_t open_event(const std::string& handle, int device);
void record_event(uintptr_t event, uintptr_t stream);
void stream_wait_event(uintptr_t stream, uintptr_t event);
void event_synchronize(uintptr_t event);  // call without the GIL
bool event_query(uintptr_t event);

uintptr_t create_stream(int device, bool high_priority);
void destroy_stream(uintptr_t stream);
// Whether every piece of work queued so far on the stream has finished.
bool stream_query(uintptr_t stream);
void stream_synchronize(uintptr_t stream);

}  // namespace lmc::cuda
