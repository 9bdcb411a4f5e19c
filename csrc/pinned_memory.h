// Page-locking host memory for the copy engines (a no-op failure when built without CUDA).
#pragma once

#include <cstddef>
#include <string>

namespace lmc {

// Registers [ptr, ptr+bytes) as pinned, device-mapped memory. Returns false and sets *error on
// failure.
bool pin_host_memory(void* ptr, size_t bytes, std::string* error);
void unpin_host_memory(void* ptr);
// True when this build can pin memory and a CUDA device is present.
bool pinning_available();

}  // namespace lmc
