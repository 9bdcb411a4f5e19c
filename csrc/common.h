// Shared helpers for the data plane: argument checks that raise clear errors.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace lmc {

// Raised for bad arguments; surfaces in Python as ValueError.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace lmc

#define LMC_CHECK_ARG(cond, ...)                                   \
  do {                                                              \
    if (!(cond)) throw ::lmc::InvalidArgument(::lmc::concat(__VA_ARGS__)); \
  } while (0)
