#include "spin_poll.h"

#include <poll.h>

#include <cerrno>
#include <chrono>

#include <system_error>

namespace lmc {

namespace {

std::vector<int> ready(const std::vector<pollfd>& p) {
  std::vector<int> out;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i].revents) out.push_back(static_cast<int>(i));
  return out;
}

}  // namespace

std::vector<int> spin_poll(const std::vector<int>& fds, int64_t spin_us, int timeout_ms) {
  std::vector<pollfd> p(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) p[i] = pollfd{fds[i], POLLIN, 0};
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  do {
    const int n = poll(p.data(), p.size(), 0);
    if (n > 0) return ready(p);
    if (n < 0 && errno != EINTR) throw std::system_error(errno, std::generic_category(), "poll");
    cpu_relax();
  } while (std::chrono::steady_clock::now() < until);
  for (;;) {
    const int n = poll(p.data(), p.size(), timeout_ms);
    if (n >= 0) return ready(p);
    if (errno != EINTR) throw std::system_error(errno, std::generic_category(), "poll");
  }
}

}  // namespace lmc
