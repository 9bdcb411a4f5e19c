// XXH64 (the 64-bit xxHash), written from its specification: the disk store's checksums and
// file names. Header-only so that the inner loop inlines where payloads are hashed piece by
// piece (a piece hashed right after it is read, or right before it is written, is still in cache).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace lmc {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0) { reset(seed); }

  void reset(uint64_t seed) {
    acc_[0] = seed + kP1 + kP2;
    acc_[1] = seed + kP2;
    acc_[2] = seed;
    acc_[3] = seed - kP1;
    seed_ = seed;
    total_ = 0;
    buffered_ = 0;
  }

  void update(const void* data, size_t len) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    total_ += len;
    if (buffered_ > 0) {  // complete the stripe a previous call left unfinished
      const size_t take = len < kStripe - buffered_ ? len : kStripe - buffered_;
      std::memcpy(buf_ + buffered_, p, take);
      buffered_ += take;
      p += take;
      len -= take;
      if (buffered_ < kStripe) return;
      stripe(buf_);
      buffered_ = 0;
    }
    // Four independent lanes keep the multipliers busy; locals let the compiler keep them in
    // registers across the loop.
    uint64_t a0 = acc_[0], a1 = acc_[1], a2 = acc_[2], a3 = acc_[3];
    for (; len >= kStripe; p += kStripe, len -= kStripe) {
      a0 = round(a0, read64(p));
      a1 = round(a1, read64(p + 8));
      a2 = round(a2, read64(p + 16));
      a3 = round(a3, read64(p + 24));
    }
    acc_[0] = a0, acc_[1] = a1, acc_[2] = a2, acc_[3] = a3;
    if (len > 0) {
      std::memcpy(buf_, p, len);
      buffered_ = len;
    }
  }

  uint64_t digest() const {
    uint64_t h;
    if (total_ >= kStripe) {
      h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
      for (uint64_t a : acc_) h = (h ^ round(0, a)) * kP1 + kP4;
    } else {
      h = seed_ + kP5;
    }
    h += total_;
    const uint8_t* p = buf_;
    size_t len = buffered_;
    for (; len >= 8; p += 8, len -= 8) h = rotl(h ^ round(0, read64(p)), 27) * kP1 + kP4;
    if (len >= 4) {
      h = rotl(h ^ (read32(p) * kP1), 23) * kP2 + kP3;
      p += 4;
      len -= 4;
    }
    for (; len > 0; ++p, --len) h = rotl(h ^ (*p * kP5), 11) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
  }

 private:
  static constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
  static constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;
  static constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
  static constexpr uint64_t kP5 = 0x27D4EB2F165667C5ULL;
  static constexpr size_t kStripe = 32;

  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static uint64_t round(uint64_t acc, uint64_t lane) { return rotl(acc + lane * kP2, 31) * kP1; }
  // The algorithm reads little-endian words; assemble them byte by byte so that big-endian
  // hosts agree (compilers turn this into one load on little-endian ones).
  static uint64_t read64(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
  }
  static uint64_t read32(const uint8_t* p) {
    return uint64_t{p[0]} | uint64_t{p[1]} << 8 | uint64_t{p[2]} << 16 | uint64_t{p[3]} << 24;
  }
  void stripe(const uint8_t* p) {
    acc_[0] = round(acc_[0], read64(p));
    acc_[1] = round(acc_[1], read64(p + 8));
    acc_[2] = round(acc_[2], read64(p + 16));
    acc_[3] = round(acc_[3], read64(p + 24));
  }

  uint64_t acc_[4];
  uint64_t seed_ = 0;
  uint64_t total_ = 0;
  uint8_t buf_[kStripe];
  size_t buffered_ = 0;
};

inline uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0) {
  Xxh64 h(seed);
  h.update(data, len);
  return h.digest();
}

}  // namespace lmc
