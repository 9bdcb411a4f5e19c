// FP8 E4M3 codec of 16-bit KV with a bf16 scale per group (kv_codec.h).
//
// The AVX2 path and the plain one give the same bytes: both compute the same IEEE operations in
// the same order (a scaled value is |x| * (1 / s), one rounding; a decoded one code * s, one
// rounding), E4M3 codes come from the float's bits (normal range) or from a rounding conversion
// (subnormal range), and 16-bit results from the float's bits (bf16) or F16C's conversion (fp16,
// matched by fp16_of).
#include "kv_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LMC_X86 1
#endif

namespace lmc {
namespace {

constexpr float kMaxE4M3 = 448.0f;
constexpr uint8_t kNaNCode = 0x7F;
constexpr float kMinNormal = 0.015625f;  // 2^-6, E4M3's smallest normal
constexpr uint16_t kOne = 0x3F80;        // bf16 1.0: the scale of a group of zeros

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float from_bf16(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline float from_fp16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (mant << 13));  // inf, NaN
  if (exp == 0) {  // zero, subnormal: mant * 2^-24, exact
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t bf16_of(float f) {  // round to nearest even; NaN made quiet
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

inline uint16_t fp16_of(float f) {  // round to nearest even, as F16C's conversion does
  uint32_t x = bits_of(f);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint16_t o;
  if (x >= (143u << 23)) {  // 65536 and up, inf, NaN
    o = x > 0x7F800000u ? static_cast<uint16_t>(0x7E00 | ((x >> 13) & 0x3FF)) : 0x7C00;
  } else if (x < (113u << 23)) {  // fp16 subnormal or zero: let float addition round
    const float magic = float_of(((127 - 15) + (23 - 10) + 1) << 23);
    o = static_cast<uint16_t>(bits_of(float_of(x) + magic) - bits_of(magic));
  } else {
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFF + ((x >> 13) & 1);
    o = static_cast<uint16_t>(x >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

inline float to_float(uint16_t h, KvDtype dt) { return dt == KvDtype::kBF16 ? from_bf16(h) : from_fp16(h); }
inline uint16_t from_float(float f, KvDtype dt) { return dt == KvDtype::kBF16 ? bf16_of(f) : fp16_of(f); }

// The bf16 scale of a group whose largest finite magnitude is amax: amax / 448 rounded up (at
// least the smallest normal, so that 1 / s is finite).
inline uint16_t scale_of(float amax) {
  if (!(amax > 0.0f)) return kOne;
  uint32_t u = std::max(bits_of(amax / kMaxE4M3), 0x00800000u);
  return static_cast<uint16_t>((u + 0xFFFFu) >> 16);
}

inline uint8_t e4m3_of(float x, float inv) {  // x / s, saturated, rounded to nearest even
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return static_cast<uint8_t>(kNaNCode | sign);
  float y = std::fabs(x) * inv;
  y = y < kMaxE4M3 ? y : kMaxE4M3;
  uint32_t code;
  if (y >= kMinNormal) {
    const uint32_t u = bits_of(y);
    code = ((u + 0x7FFFFu + ((u >> 20) & 1)) >> 20) - (120u << 3);
  } else {
    code = static_cast<uint32_t>(std::nearbyint(y * 512.0f));
  }
  return static_cast<uint8_t>(code | sign);
}

inline float value_of(uint8_t c, float s) {
  const uint32_t mag = c & 0x7F;
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  if (mag == kNaNCode) return float_of(sign | 0x7FC00000u);
  const float v = mag >= 8 ? float_of((mag << 20) + (120u << 23)) : static_cast<float>(mag) * (1.0f / 512.0f);
  return float_of(bits_of(v * s) | sign);
}

inline uint16_t load_scale(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
inline void store_scale(uint8_t* p, uint16_t s) {
  p[0] = static_cast<uint8_t>(s);
  p[1] = static_cast<uint8_t>(s >> 8);
}

void encode_group_plain(const uint16_t* in, size_t group, KvDtype dt, uint8_t* out, uint8_t* scale) {
  float amax = 0.0f;
  for (size_t i = 0; i < group; ++i) {
    const float a = std::fabs(to_float(in[i], dt));
    if (a < INFINITY && a > amax) amax = a;  // NaN and inf leave the scale to the finite values
  }
  const uint16_t s = scale_of(amax);
  store_scale(scale, s);
  const float inv = 1.0f / from_bf16(s);
  for (size_t i = 0; i < group; ++i) out[i] = e4m3_of(to_float(in[i], dt), inv);
}

void decode_group_plain(const uint8_t* in, size_t group, KvDtype dt, uint16_t* out, const uint8_t* scale) {
  const float s = from_bf16(load_scale(scale));
  for (size_t i = 0; i < group; ++i) out[i] = from_float(value_of(in[i], s), dt);
}

#ifdef LMC_X86
#define LMC_AVX2 __attribute__((target("avx2,f16c,fma")))

LMC_AVX2 inline __m256 widen8(__m128i h, KvDtype dt) {
  if (dt == KvDtype::kFP16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Magnitude codes (as int32) of eight finite, non-negative values scaled by inv; `normal`: all of
// them scale into E4M3's normal range (no subnormal lane to compute).
template <bool kNormal>
LMC_AVX2 inline __m256i magnitudes8(__m256 a, __m256 inv) {
  const __m256 y = _mm256_min_ps(_mm256_mul_ps(a, inv), _mm256_set1_ps(kMaxE4M3));
  const __m256i u = _mm256_castps_si256(y);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFFF)), odd);
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
  if (kNormal) return normal;
  const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(y, _mm256_set1_ps(512.0f)));  // nearest even
  const __m256 is_normal = _mm256_cmp_ps(y, _mm256_set1_ps(kMinNormal), _CMP_GE_OQ);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(sub), _mm256_castsi256_ps(normal), is_normal));
}

// A group of finite values (a multiple of 32 of them): signs from the 16-bit inputs, 32 values a step.
template <bool kNormal>
LMC_AVX2 void encode_finite(const uint16_t* in, size_t group, KvDtype dt, float inv_f, uint8_t* out) {
  const __m256i abs16 = _mm256_set1_epi16(0x7FFF);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 inv = _mm256_set1_ps(inv_f);
  for (size_t i = 0; i < group; i += 32) {
    const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 16));
    __m256i sign = _mm256_packus_epi16(_mm256_srli_epi16(r0, 8), _mm256_srli_epi16(r1, 8));
    sign = _mm256_and_si256(_mm256_permute4x64_epi64(sign, 0xD8), _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i a0 = _mm256_and_si256(r0, abs16), a1 = _mm256_and_si256(r1, abs16);
    const __m256i c0 = magnitudes8<kNormal>(widen8(_mm256_castsi256_si128(a0), dt), inv);
    const __m256i c1 = magnitudes8<kNormal>(widen8(_mm256_extracti128_si256(a0, 1), dt), inv);
    const __m256i c2 = magnitudes8<kNormal>(widen8(_mm256_castsi256_si128(a1), dt), inv);
    const __m256i c3 = magnitudes8<kNormal>(widen8(_mm256_extracti128_si256(a1, 1), dt), inv);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_or_si256(_mm256_permutevar8x32_epi32(bytes, order), sign));
  }
}

LMC_AVX2 inline uint16_t hmax_u16(__m256i v) {
  __m128i m = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 8));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 4));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 2));
  return static_cast<uint16_t>(_mm_cvtsi128_si32(m));
}

LMC_AVX2 inline uint16_t hmin_u16(__m256i v) {
  __m128i m = _mm_min_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  return static_cast<uint16_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(m)));
}

LMC_AVX2 void encode_avx2(const uint16_t* src, size_t n, size_t group, KvDtype dt, uint8_t* codes, uint8_t* scales) {
  const __m256i abs16 = _mm256_set1_epi16(0x7FFF);
  const uint16_t first_odd = dt == KvDtype::kBF16 ? 0x7F80 : 0x7C00;  // magnitude bits of inf
  for (size_t g = 0; g < n / group; ++g) {
    const uint16_t* in = src + g * group;
    uint8_t* out = codes + g * group;
    // the 16-bit magnitudes order like the values: their largest and smallest, in 16 lanes
    __m256i hi = _mm256_setzero_si256(), lo = abs16;
    for (size_t i = 0; i < group; i += 16) {
      const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)), abs16);
      hi = _mm256_max_epu16(hi, a);
      lo = _mm256_min_epu16(lo, a);
    }
    const uint16_t top = hmax_u16(hi);
    if (top >= first_odd) {  // NaN or inf among them: the plain path
      encode_group_plain(in, group, dt, out, scales + 2 * g);
      continue;
    }
    const uint16_t s = scale_of(to_float(top, dt));
    store_scale(scales + 2 * g, s);
    const float inv = 1.0f / from_bf16(s);
    if (to_float(hmin_u16(lo), dt) * inv >= kMinNormal)
      encode_finite<true>(in, group, dt, inv, out);
    else
      encode_finite<false>(in, group, dt, inv, out);
  }
}

LMC_AVX2 inline __m256 values8(__m128i bytes8, __m256 s) {
  const __m256i c = _mm256_cvtepu8_epi32(bytes8);
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7)));
  __m256 v = _mm256_mul_ps(_mm256_blendv_ps(sub, normal, is_normal), s);
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(kNaNCode)));
  v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

LMC_AVX2 inline __m128i bf16x8(__m256 v) {  // round to nearest even; NaN quiet
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan));
  const __m256i packed = _mm256_packus_epi32(r, r);  // (values fit in 16 bits)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

LMC_AVX2 void decode_avx2(const uint8_t* codes, const uint8_t* scales, size_t n, size_t group, KvDtype dt,
                          uint16_t* dst) {
  for (size_t g = 0; g < n / group; ++g) {
    const __m256 s = _mm256_set1_ps(from_bf16(load_scale(scales + 2 * g)));
    const uint8_t* in = codes + g * group;
    uint16_t* out = dst + g * group;
    for (size_t i = 0; i < group; i += 8) {
      const __m256 v = values8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + i)), s);
      const __m128i h = dt == KvDtype::kFP16 ? _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT) : bf16x8(v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    }
  }
}

bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
}
#else
bool cpu_has_avx2() { return false; }
#endif

}  // namespace

bool fp8_simd() { return cpu_has_avx2(); }

void fp8_encode(const uint16_t* src, size_t n, size_t group, KvDtype dtype, uint8_t* dst, bool simd) {
  uint8_t* scales = dst + n;
#ifdef LMC_X86
  if (simd && group % 32 == 0 && cpu_has_avx2()) return encode_avx2(src, n, group, dtype, dst, scales);
#endif
  for (size_t g = 0; g < n / group; ++g)
    encode_group_plain(src + g * group, group, dtype, dst + g * group, scales + 2 * g);
}

void fp8_decode(const uint8_t* src, size_t n, size_t group, KvDtype dtype, uint16_t* dst, bool simd) {
  const uint8_t* scales = src + n;
#ifdef LMC_X86
  if (simd && group % 8 == 0 && cpu_has_avx2()) return decode_avx2(src, scales, n, group, dtype, dst);
#endif
  for (size_t g = 0; g < n / group; ++g)
    decode_group_plain(src + g * group, group, dtype, dst + g * group, scales + 2 * g);
}

}  // namespace lmc
