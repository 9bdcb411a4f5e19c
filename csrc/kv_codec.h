// The KV codec of the L2 tiers: 16-bit KV (bf16, fp16) to FP8 E4M3 with a scale per group of
// `group` consecutive values (a group never spans two tokens: the caller picks a group that
// divides a token's row, e.g. one attention head), and back.
//
// Encoded layout for n values in n / group groups: the n E4M3 codes (one byte each), then one
// bf16 scale s per group (a value is code * s). s is the group's largest finite magnitude over
// 448 (E4M3's largest), rounded up to bf16: the largest value is (nearly) exact and every other
// keeps E4M3's 3 mantissa bits relative to its group. NaN stays NaN (E4M3's 0x7F); infinities
// saturate to +-448 * s. A non-finite value only ever affects its own group: the scale comes from
// the finite values.
//
// Torch-free, raw pointers; AVX2 (with F16C) where the CPU has it, plain C++ elsewhere; the
// result is bit-identical either way.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lmc {

enum class KvDtype : int { kBF16 = 0, kFP16 = 1 };

// Bytes of the encoding of n values in groups of `group` (n must be a multiple of group).
inline size_t fp8_encoded_bytes(size_t n, size_t group) { return n + 2 * (n / group); }

// simd=false takes the plain path (for tests: both give the same bytes).
void fp8_encode(const uint16_t* src, size_t n, size_t group, KvDtype dtype, uint8_t* dst, bool simd = true);
void fp8_decode(const uint8_t* src, size_t n, size_t group, KvDtype dtype, uint16_t* dst, bool simd = true);

// Whether the vectorised path runs on this CPU.
bool fp8_simd();

}  // namespace lmc
