// Built without CUDA: nothing can be pinned.
#include "pinned_memory.h"

namespace lmc {

bool pin_host_memory(void*, size_t, std::string* error) {
  if (error) *error = "lmcache-mp was built without CUDA";
  return false;
}
void unpin_host_memory(void*) {}
bool pinning_available() { return false; }

}  // namespace lmc
