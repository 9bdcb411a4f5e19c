// Shared helpers for the data plane: argument checks that raise clear errors.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace lmc {

// Raised for bad arguments; surfaces in Python as ValueError.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Message formatting without iostreams: std::ostringstream crashed in the extension on one
// GPU machine's toolchain (its locale machinery), and error paths must never crash.
// Numbers and enums (e.g. CUresult codes) are written as decimal numbers, never as raw chars:
// a message must stay valid UTF-8 to become a Python exception.
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(static_cast<long long>(v));
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace lmc

#define LMC_CHECK_ARG(cond, ...)                                   \
  do {                                                              \
    if (!(cond)) throw ::lmc::InvalidArgument(::lmc::concat(__VA_ARGS__)); \
  } while (0)
