// The steps paged_decode (decode_attention.cpp) and paged_prefill (prefill_attention.cpp) share:
// a row of scores' softmax numerators (exp_nonpositive, and the same steps on sixteen or eight
// lanes), cache rows widened to float, and V rows summed by their weights, for one query or for
// several sharing each row's load. Each goes in an order fixed by the row alone, so a query's bits
// are the same in either kernel and in any company.
#pragma once

#include "vector.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem::cpu {

// A prefill row's window start: the first position that position `last` attends to (0 without a
// window), for paged_prefill's kernels (prefill_attention.cpp, prefill_attention_amx.cpp).
inline int64_t window_start(int64_t last, int64_t window) { return window > 0 ? std::max<int64_t>(0, last + 1 - window) : 0; }

// e^x for x <= 0 (a softmax's shifted scores), written so the compiler vectorizes a loop of it:
// x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error about
// 2e-7), 2^n put in the exponent bits. Below -87 the result is 0, as expf's underflows to.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  const float n = std::floor(clamped * 1.44269504f + 0.5f);
  const float r = clamped - n * 0.693145752f - n * 1.42860677e-6f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f + r * (8.33333333e-3f + r * 1.38888889e-3f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.f ? 0.f : p * two_n;
}

#if defined(__AVX512F__)
// The `count` rows of HD elements at `src`, `stride` elements apart, as floats in `dst`.
template <int64_t HD, typename T>
inline void rows_to_float(const T* src, int64_t count, int64_t stride, float* dst) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t c = 0; c < HD / 16; ++c) _mm512_storeu_ps(dst + i * HD + 16 * c, load16(src + i * stride + 16 * c));
}

// exp_nonpositive on sixteen lanes: the same steps, each lane's result independent of the others.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 low = _mm512_set1_ps(-87.f);
  const __m512 clamped = _mm512_max_ps(x, low);
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), clamped));
  __m512 p = _mm512_set1_ps(1.38888889e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(bits));
}

// scores[0..len) = e^(score - max score), in place; returns their sum. Sixteen at a time, the
// tail under a mask: a score's bits and the order of the sum depend on len alone.
inline float softmax_numerators(float* scores, int64_t len) {
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 m = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1);
    peak = _mm512_mask_max_ps(peak, m, peak, _mm512_maskz_loadu_ps(m, scores + t));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 m = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift)));
    _mm512_mask_storeu_ps(scores + t, m, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// acc[0..HD) += sum over the `count` rows of p[i] * rows[i], in row order, in registers.
template <int64_t HD>
inline void accumulate_rows(const float* p, const float* rows, int64_t count, float* acc) {
  constexpr int64_t chunks = HD / 16;
  __m512 a[chunks];
  for (int64_t c = 0; c < chunks; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t i = 0; i < count; ++i) {
    const __m512 weight = _mm512_set1_ps(p[i]);
    for (int64_t c = 0; c < chunks; ++c) a[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(rows + i * HD + 16 * c), a[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

// accumulate_rows for M queries over the same `count` rows (`stride` elements apart; float, or a
// cache's rows widened as loaded), each row loaded once and kept in registers: query m's sums, at
// acc[m] with weights p[m], in the same order as accumulate_rows gives them, so the same bits.
template <int64_t HD, int64_t M, typename T>
inline void accumulate_rows_shared(const float* const* p, const T* rows, int64_t stride, int64_t count, float* const* acc) {
  constexpr int64_t chunks = HD / 16;
  __m512 a[M][chunks];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c) a[m][c] = _mm512_loadu_ps(acc[m] + 16 * c);
  for (int64_t i = 0; i < count; ++i) {
    __m512 row[chunks];
    for (int64_t c = 0; c < chunks; ++c) {
      row[c] = load16(rows + i * stride + 16 * c);
      asm("" : "+v"(row[c]));  // kept in a register for the M queries, not loaded again by each FMA
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512 weight = _mm512_set1_ps(p[m][i]);
      for (int64_t c = 0; c < chunks; ++c) a[m][c] = _mm512_fmadd_ps(weight, row[c], a[m][c]);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc[m] + 16 * c, a[m][c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// On a CPU with AVX2 but no AVX-512: eight-lane helpers for paged_decode's vector path and
// paged_prefill.

// exp_nonpositive on eight lanes: the same steps, each lane's result independent of the others.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.f);
  const __m256 clamped = _mm256_max_ps(x, low);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), clamped));
  __m256 p = _mm256_set1_ps(1.38888889e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// Lanes [0, n) of eight set (all bits), the rest clear.
inline __m256 first_lanes(int64_t n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

inline float sum_lanes(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

// scores[0..len) = e^(score - max score), in place; returns their sum. Eight at a time; the row
// is padded to a multiple of 8 (its lanes past len are read and written, never used): a score's
// bits and the order of the sum depend on len alone.
inline float softmax_numerators8(float* scores, int64_t len) {
  const __m256 minus_infinity = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 peak = minus_infinity;
  for (int64_t t = 0; t < len; t += 8)
    peak = _mm256_max_ps(peak, _mm256_blendv_ps(minus_infinity, _mm256_loadu_ps(scores + t), first_lanes(len - t)));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const __m256 shift = _mm256_set1_ps(_mm_cvtss_f32(half));
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 e = _mm256_and_ps(first_lanes(len - t), exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift)));
    _mm256_storeu_ps(scores + t, e);
    total = _mm256_add_ps(total, e);
  }
  return sum_lanes(total);
}

// acc[0 .. HD) += sum over the `count` rows (`stride` elements apart) of p[i] * rows[i], in row
// order, 64 dimensions at a time in registers.
template <int64_t HD, typename T>
inline void accumulate_rows8(const float* p, const T* rows, int64_t stride, int64_t count, float* acc) {
  for (int64_t d0 = 0; d0 < HD; d0 += 64) {
    __m256 sums[8];
#pragma GCC unroll 8
    for (int64_t c = 0; c < 8; ++c) sums[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
    for (int64_t i = 0; i < count; ++i) {
      const __m256 pi = _mm256_broadcast_ss(p + i);
      const T* row = rows + i * stride + d0;
#pragma GCC unroll 8
      for (int64_t c = 0; c < 8; ++c) sums[c] = _mm256_fmadd_ps(pi, load8(row + 8 * c), sums[c]);
    }
#pragma GCC unroll 8
    for (int64_t c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, sums[c]);
  }
}

// accumulate_rows8 for three queries over the same rows (weights p[m], sums at acc[m]), 32
// dimensions at a time, each V row's part loaded once for the three: the same sums in the same
// order as accumulate_rows8 gives each, so the same bits.
template <int64_t HD, typename T>
inline void accumulate_rows8_shared3(const float* const* p, const T* rows, int64_t stride, int64_t count, float* const* acc) {
  for (int64_t d0 = 0; d0 < HD; d0 += 32) {
    __m256 sums[3][4];
#pragma GCC unroll 8
    for (int64_t m = 0; m < 3; ++m)
#pragma GCC unroll 8
      for (int64_t c = 0; c < 4; ++c) sums[m][c] = _mm256_loadu_ps(acc[m] + d0 + 8 * c);
    for (int64_t i = 0; i < count; ++i) {
      const T* row = rows + i * stride + d0;
      __m256 v[4];
#pragma GCC unroll 8
      for (int64_t c = 0; c < 4; ++c) v[c] = load8(row + 8 * c);
#pragma GCC unroll 8
      for (int64_t m = 0; m < 3; ++m) {
        const __m256 pi = _mm256_broadcast_ss(p[m] + i);
#pragma GCC unroll 8
        for (int64_t c = 0; c < 4; ++c) sums[m][c] = _mm256_fmadd_ps(pi, v[c], sums[m][c]);
      }
    }
#pragma GCC unroll 8
    for (int64_t m = 0; m < 3; ++m)
#pragma GCC unroll 8
      for (int64_t c = 0; c < 4; ++c) _mm256_storeu_ps(acc[m] + d0 + 8 * c, sums[m][c]);
  }
}

// Lanes [0, n) of eight as an integer mask (all bits set), for masked loads and stores.
inline __m256i first_lanes_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// paged_decode's vector path on a CPU with AVX2 but no AVX-512: the same functions as the AVX-512
// ones above, eight lanes at a time, for head sizes that are multiples of 64 (dot_keys and
// accumulate_group in decode_attention.cpp).

// The `count` rows of HD elements at `src`, `stride` elements apart, as floats in `dst`.
template <int64_t HD, typename T>
inline void rows_to_float(const T* src, int64_t count, int64_t stride, float* dst) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t c = 0; c < HD / 8; ++c) _mm256_storeu_ps(dst + i * HD + 8 * c, load8(src + i * stride + 8 * c));
}

// scores[0..len) = e^(score - max score), in place; returns their sum. Eight at a time, the tail
// under a mask (nothing past len is read or written): a score's bits and the order of the sum
// depend on len alone.
inline float softmax_numerators(float* scores, int64_t len) {
  const __m256 minus_infinity = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 peak = minus_infinity;
  for (int64_t t = 0; t < len; t += 8) {
    const __m256i m = first_lanes_mask(len - t);
    peak = _mm256_max_ps(peak, _mm256_blendv_ps(minus_infinity, _mm256_maskload_ps(scores + t, m), _mm256_castsi256_ps(m)));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const __m256 shift = _mm256_set1_ps(_mm_cvtss_f32(half));
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; t += 8) {
    const __m256i m = first_lanes_mask(len - t);
    const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(m), exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(scores + t, m), shift)));
    _mm256_maskstore_ps(scores + t, m, e);
    total = _mm256_add_ps(total, e);
  }
  return sum_lanes(total);
}

// acc[0..HD) += sum over the `count` rows of p[i] * rows[i], in row order, in registers.
template <int64_t HD>
inline void accumulate_rows(const float* p, const float* rows, int64_t count, float* acc) {
  accumulate_rows8<HD>(p, rows, HD, count, acc);
}
#else
// Declared for paged_decode's discarded `if constexpr (kVectorPath)` branches; never called.
template <int64_t HD, typename T>
void rows_to_float(const T* src, int64_t count, int64_t stride, float* dst);
float softmax_numerators(float* scores, int64_t len);
template <int64_t HD>
void accumulate_rows(const float* p, const float* rows, int64_t count, float* acc);
#endif

// row[first .. end) soft-capped: softcap * tanh(score / softcap), with tanh |x| = (1 - e^-2|x|) /
// (1 + e^-2|x|) by the lanes' exp_nonpositive and the sign put back (std::tanh's calls made a
// capped prefill several times slower). Absolute error about 1e-7 softcap. A score's bits depend
// on it alone.
inline void cap_scores(float* row, int64_t first, int64_t end, float softcap) {
  const float inverse = 1.f / softcap;
#if defined(__AVX512F__)
  const __m512 sign_bit = _mm512_set1_ps(-0.f), one = _mm512_set1_ps(1.f), cap = _mm512_set1_ps(softcap), scaled = _mm512_set1_ps(-2.f * inverse);
  for (int64_t t = first; t < end; t += 16) {
    const __mmask16 m = end - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - t)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, row + t);
    const __m512 e = exp_nonpositive16(_mm512_mul_ps(_mm512_andnot_ps(sign_bit, x), scaled));
    const __m512 magnitude = _mm512_div_ps(_mm512_mul_ps(cap, _mm512_sub_ps(one, e)), _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(row + t, m, _mm512_or_ps(magnitude, _mm512_and_ps(sign_bit, x)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 sign_bit = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f), cap = _mm256_set1_ps(softcap), scaled = _mm256_set1_ps(-2.f * inverse);
  for (int64_t t = first; t < end; t += 8) {
    const __m256i m = first_lanes_mask(end - t);
    const __m256 x = _mm256_maskload_ps(row + t, m);
    const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, x), scaled));
    const __m256 magnitude = _mm256_div_ps(_mm256_mul_ps(cap, _mm256_sub_ps(one, e)), _mm256_add_ps(one, e));
    _mm256_maskstore_ps(row + t, m, _mm256_or_ps(magnitude, _mm256_and_ps(sign_bit, x)));
  }
#else
  for (int64_t t = first; t < end; ++t) {
    const float e = exp_nonpositive(-2.f * inverse * std::fabs(row[t]));
    row[t] = std::copysign(softcap * ((1.f - e) / (1.f + e)), row[t]);
  }
#endif
}


#if defined(__AVX512F__)
// dst[j * dst_stride + i] = r[i][j] for 16 rows of 16 32-bit values (a key's float dimensions or
// bf16 pairs of them), transposed in registers: pairs of rows interleaved by 32 and by 64 bits,
// then the 128-bit lanes gathered.
inline void transpose16(const __m512i (&r)[16], int32_t* dst, int64_t dst_stride) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], 128-bit lane L: rows i .. i + 3 of column 4 L + c
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i even_low = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), even_high = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd_low = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD), odd_high = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    _mm512_storeu_si512(dst + c * dst_stride, _mm512_shuffle_i32x4(even_low, even_high, 0x88));
    _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(even_low, even_high, 0xDD));
    _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(odd_low, odd_high, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(odd_low, odd_high, 0xDD));
  }
}
#endif

#if defined(__AVX512BF16__)
// Two cache rows of HD bf16 values (positions 2 k2 and 2 k2 + 1) as HD pairs, dimension by
// dimension: out[d] holds (first[d], second[d]), the pair a bf16 dot product takes with a pair of
// weights (p[2 k2], p[2 k2 + 1]). A missing row (before a window, past the context) is zeros.
template <int64_t HD>
inline void value_pairs(const c10::BFloat16* first, const c10::BFloat16* second, int32_t* out) {
  for (int64_t c = 0; c < HD / 16; ++c) {
    const __m512i lo = first == nullptr ? _mm512_setzero_si512()
                                        : _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 16 * c)));
    const __m512i hi = second == nullptr ? _mm512_setzero_si512()
                                         : _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + 16 * c)));
    _mm512_storeu_si512(out + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}
#endif

}  // namespace tandem::cpu
