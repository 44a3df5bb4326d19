// The loads and conversions more than one kernel file takes: a row's elements (float32, bf16,
// half or FP8 e4m3) as float32, in plain loops or sixteen (AVX-512) or eight (AVX2) lanes at a time; sixteen
// floats rounded to bf16 as torch rounds them; and the bf16 pairs of AVX512-BF16's dot products.
// Each widening is exact, so a kernel's arithmetic is the same whichever type it reads.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem::cpu {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// FP8 e4m3 bytes as floats, exactly, by bit arithmetic: a normal byte's exponent and mantissa
// bits moved to a float32's places and the exponent rebiased (+120); a subnormal's (exponent 0)
// mantissa m is m * 2^-9; the sign bit moved to the top. (A NaN byte, 0x7f or 0xff, reads as
// +-480: write_kv saturates, so the cache holds none.)
constexpr float kFp8SubnormalUnit = 1.f / 512.f;

#if defined(__AVX512F__)
inline __m512 fp8_bits_to_float(__m512i bytes) {
  const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi32(0x7f));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(kFp8SubnormalUnit));
  const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8));
  const __m512 value = _mm512_mask_blend_ps(is_subnormal, normal, subnormal);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 fp8_bits_to_float(__m256i bytes) {
  const __m256i magnitude = _mm256_and_si256(bytes, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(kFp8SubnormalUnit));
  const __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
  const __m256 value = _mm256_blendv_ps(normal, subnormal, is_subnormal);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign));
}
#endif

#if defined(__AVX512F__)
// Sixteen elements of a cache row as floats (each conversion is exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// Sixteen bf16 bit patterns as floats (exact: a bf16 is a float32's upper half).
inline __m512 bf16_bits_to_float(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
inline __m512 load16(const c10::BFloat16* p) { return bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::Float8_e4m3fn* p) { return fp8_bits_to_float(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }

// Sixteen floats rounded to bf16 as c10 and torch's vectorized conversion round them: to nearest,
// ties to even, denormals kept, NaN as 0xffff.
inline __m256i float_to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  // The instruction rounds a normal or infinite float (or zero) the same way in one step, but takes
  // a denormal as zero and writes its own NaN: lanes of those (rare) take the steps below.
  if (_mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) == 0) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // QNaN, denormal, SNaN
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 is_number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_number, _mm512_set1_epi32(0xffff), rounded));
}
#elif defined(__AVX2__) && defined(__FMA__)
// Eight elements of a cache row as floats (each conversion is exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const c10::Float8_e4m3fn* p) { return fp8_bits_to_float(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
#endif

#if defined(__AVX512BF16__)
// Two consecutive bf16 values as one int32 (a pair a bf16 dot product takes).
inline int32_t pair_at(const c10::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 32 int8 weights widened to bf16 (exact: |w| <= 127), in k order.
inline __m512bh int8_to_bf16x32(const int8_t* w) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo, 16-31 from hi: k order
}
#endif

}  // namespace tandem::cpu
