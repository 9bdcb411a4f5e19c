// Waiting for file descriptors without paying a wake-up: a thread that expects an event soon
// polls without sleeping for a while first. A sleeping thread (an idle core, or a halted vCPU)
// takes tens to hundreds of microseconds to run again; a request's whole fixed cost is of that order.
#pragma once

#include <cstdint>
#include <vector>

namespace lmc {

// A few hundred cycles between polls: fewer system calls, and a hyperthread sibling keeps its core.
inline void cpu_relax() {
  for (int i = 0; i < 16; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

// Returns the indices of the fds that are readable (or closed): polls them without sleeping for up
// to spin_us, then sleeps in poll(2) for up to timeout_ms more (negative: no limit). Empty on timeout.
std::vector<int> spin_poll(const std::vector<int>& fds, int64_t spin_us, int timeout_ms);

}  // namespace lmc
