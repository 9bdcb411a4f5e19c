// FP8 E4M3 codec of 16-bit KV with a power-of-two scale per group (kv_codec.h).
//
// Every step is exact or rounds to nearest even, so the AVX2 path and the plain one give the same
// bytes: the scale is a power of two (multiplying by it is exact), E4M3 codes come from the
// float's bits (normal range) or from a rounding conversion (subnormal range), and 16-bit results
// from the float's bits (bf16) or F16C's conversion (fp16, matched by half_from_float).
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
constexpr int kMinExp = -127, kMaxExp = 127;

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

// The scale exponent of a group whose largest finite magnitude is amax: the smallest e with
// amax * 2^-e <= 448.
inline int scale_exponent(float amax) {
  if (!(amax > 0.0f)) return 0;
  int k;
  const float m = std::frexp(amax, &k);  // amax = m * 2^k, m in [0.5, 1)
  const int e = k - 9 + (m > 0.875f ? 1 : 0);
  return std::clamp(e, kMinExp, kMaxExp);
}

// 2^e as two factors, each a normal float (e in [-127, 127]).
inline void pow2_halves(int e, float* a, float* b) {
  const int h = e / 2;
  *a = std::ldexp(1.0f, h);
  *b = std::ldexp(1.0f, e - h);
}

inline uint8_t e4m3_of(float x, float s1, float s2) {  // x scaled by s1 * s2, saturated, rounded
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return static_cast<uint8_t>(kNaNCode | sign);
  float y = std::fabs(x) * s1 * s2;
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

inline float value_of(uint8_t c, float s1, float s2) {
  const uint32_t mag = c & 0x7F;
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  if (mag == kNaNCode) return float_of(sign | 0x7FC00000u);
  const float v = mag >= 8 ? float_of((mag << 20) + (120u << 23)) : static_cast<float>(mag) * (1.0f / 512.0f);
  return float_of(bits_of(v * s1 * s2) | sign);
}

float group_amax(const uint16_t* src, size_t group, KvDtype dt) {
  float amax = 0.0f;
  for (size_t i = 0; i < group; ++i) {
    const float a = std::fabs(to_float(src[i], dt));
    if (a < INFINITY && a > amax) amax = a;  // NaN and inf leave the scale to the finite values
  }
  return amax;
}

void encode_plain(const uint16_t* src, size_t n, size_t group, KvDtype dt, uint8_t* codes, int8_t* exps) {
  for (size_t g = 0; g < n / group; ++g) {
    const uint16_t* in = src + g * group;
    const int e = scale_exponent(group_amax(in, group, dt));
    exps[g] = static_cast<int8_t>(e);
    float s1, s2;
    pow2_halves(-e, &s1, &s2);
    for (size_t i = 0; i < group; ++i) codes[g * group + i] = e4m3_of(to_float(in[i], dt), s1, s2);
  }
}

void decode_plain(const uint8_t* codes, const int8_t* exps, size_t n, size_t group, KvDtype dt, uint16_t* dst) {
  for (size_t g = 0; g < n / group; ++g) {
    float s1, s2;
    pow2_halves(exps[g], &s1, &s2);
    for (size_t i = 0; i < group; ++i) dst[g * group + i] = from_float(value_of(codes[g * group + i], s1, s2), dt);
  }
}

#ifdef LMC_X86
#define LMC_AVX2 __attribute__((target("avx2,f16c,fma")))

// Magnitude codes of eight finite values (as int32) that are, scaled by s, all at least E4M3's
// smallest normal and at most 448: every lane takes the normal path.
LMC_AVX2 inline __m256i magnitudes8(__m256 a, __m256 s) {
  const __m256i u = _mm256_castps_si256(_mm256_mul_ps(a, s));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFFF)), odd);
  return _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
}

LMC_AVX2 inline __m256 widen8(__m128i h, KvDtype dt) {
  if (dt == KvDtype::kFP16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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

// A group (a multiple of 32 values) whose values are all finite and scale into E4M3's normal range:
// signs taken from the 16-bit inputs, 32 values a step.
LMC_AVX2 void encode_normal(const uint16_t* in, size_t group, KvDtype dt, float scale, uint8_t* out) {
  const __m256i abs16 = _mm256_set1_epi16(0x7FFF);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 s = _mm256_set1_ps(scale);
  for (size_t i = 0; i < group; i += 32) {
    const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 16));
    __m256i sign = _mm256_packus_epi16(_mm256_srli_epi16(r0, 8), _mm256_srli_epi16(r1, 8));
    sign = _mm256_and_si256(_mm256_permute4x64_epi64(sign, 0xD8), _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i a0 = _mm256_and_si256(r0, abs16), a1 = _mm256_and_si256(r1, abs16);
    const __m256i c0 = magnitudes8(widen8(_mm256_castsi256_si128(a0), dt), s);
    const __m256i c1 = magnitudes8(widen8(_mm256_extracti128_si256(a0, 1), dt), s);
    const __m256i c2 = magnitudes8(widen8(_mm256_castsi256_si128(a1), dt), s);
    const __m256i c3 = magnitudes8(widen8(_mm256_extracti128_si256(a1, 1), dt), s);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_or_si256(_mm256_permutevar8x32_epi32(bytes, order), sign));
  }
}

LMC_AVX2 void encode_avx2(const uint16_t* src, size_t n, size_t group, KvDtype dt, uint8_t* codes, int8_t* exps) {
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
    if (top < first_odd) {
      const int e = scale_exponent(to_float(top, dt));
      float f1, f2;
      pow2_halves(-e, &f1, &f2);
      if (to_float(hmin_u16(lo), dt) * f1 * f2 >= kMinNormal) {
        exps[g] = static_cast<int8_t>(e);
        encode_normal(in, group, dt, f1 * f2, out);  // (f1 * f2 is 2^-e: its values are within a float's)
        continue;
      }
    }
    encode_plain(in, group, group, dt, out, exps + g);  // NaN, inf, or values below the normal range
  }
}

LMC_AVX2 inline __m256 values8(__m128i bytes8, __m256 s1, __m256 s2) {
  const __m256i c = _mm256_cvtepu8_epi32(bytes8);
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7)));
  __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_blendv_ps(sub, normal, is_normal), s1), s2);
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

// A group whose codes are all zero or normal, and whose values are normal 16-bit numbers: the
// 16-bit result is the code's bits moved into place with the exponents added (exact, no rounding),
// 16 values an instruction.
LMC_AVX2 void decode_normal(const uint8_t* in, size_t group, int bias, uint16_t* out, int shift) {
  const __m256i mag_mask = _mm256_set1_epi16(0x7F), zero = _mm256_setzero_si256();
  const __m256i add = _mm256_set1_epi16(static_cast<short>(bias << (shift + 3)));
  for (size_t i = 0; i < group; i += 16) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    const __m256i mag = _mm256_and_si256(c, mag_mask);
    __m256i v = _mm256_add_epi16(_mm256_slli_epi16(mag, shift), add);
    v = _mm256_andnot_si256(_mm256_cmpeq_epi16(mag, zero), v);  // zero stays zero
    v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_andnot_si256(mag_mask, c), 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), v);
  }
}

// The largest magnitude of a group's codes, and the smallest one that is not zero.
LMC_AVX2 inline void code_range(const uint8_t* in, size_t group, int* top, int* low) {
  const __m256i mag_mask = _mm256_set1_epi8(0x7F), zero = _mm256_setzero_si256();
  __m256i hi = zero, lo = _mm256_set1_epi8(-1);
  for (size_t i = 0; i < group; i += 32) {
    const __m256i m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)), mag_mask);
    hi = _mm256_max_epu8(hi, m);
    lo = _mm256_min_epu8(lo, _mm256_or_si256(m, _mm256_cmpeq_epi8(m, zero)));
  }
  __m128i h = _mm_max_epu8(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  __m128i l = _mm_min_epu8(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
#define LMC_FOLD(k) h = _mm_max_epu8(h, _mm_srli_si128(h, k)), l = _mm_min_epu8(l, _mm_srli_si128(l, k))
  LMC_FOLD(8);
  LMC_FOLD(4);
  LMC_FOLD(2);
  LMC_FOLD(1);
#undef LMC_FOLD
  *top = _mm_cvtsi128_si32(h) & 0xFF;
  *low = _mm_cvtsi128_si32(l) & 0xFF;
}

LMC_AVX2 void decode_avx2(const uint8_t* codes, const int8_t* exps, size_t n, size_t group, KvDtype dt,
                          uint16_t* dst) {
  const bool bf16 = dt == KvDtype::kBF16;
  for (size_t g = 0; g < n / group; ++g) {
    if (group % 32 == 0) {
      int top, low;
      code_range(codes + g * group, group, &top, &low);
      // 16-bit exponent fields of the smallest and largest value: E4M3's (bias 7) plus the scale's
      const int bias = (bf16 ? 120 : 8) + exps[g];
      if (top < kNaNCode && low >= 8 && (low >> 3) + bias >= 1 && (top >> 3) + bias <= (bf16 ? 254 : 30)) {
        decode_normal(codes + g * group, group, bias, dst + g * group, bf16 ? 4 : 7);
        continue;
      }
    }
    float f1, f2;
    pow2_halves(exps[g], &f1, &f2);
    const __m256 s1 = _mm256_set1_ps(f1), s2 = _mm256_set1_ps(f2);
    const uint8_t* in = codes + g * group;
    uint16_t* out = dst + g * group;
    for (size_t i = 0; i < group; i += 8) {
      const __m256 v = values8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + i)), s1, s2);
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
  int8_t* exps = reinterpret_cast<int8_t*>(dst + n);
#ifdef LMC_X86
  if (simd && group % 32 == 0 && cpu_has_avx2()) return encode_avx2(src, n, group, dtype, dst, exps);
#endif
  encode_plain(src, n, group, dtype, dst, exps);
}

void fp8_decode(const uint8_t* src, size_t n, size_t group, KvDtype dtype, uint16_t* dst, bool simd) {
  const int8_t* exps = reinterpret_cast<const int8_t*>(src + n);
#ifdef LMC_X86
  if (simd && group % 8 == 0 && cpu_has_avx2()) return decode_avx2(src, exps, n, group, dtype, dst);
#endif
  decode_plain(src, exps, n, group, dtype, dst);
}

}  // namespace lmc
