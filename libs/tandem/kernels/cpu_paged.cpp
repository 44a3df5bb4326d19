// Paged attention on the CPU, reading K and V in place through the block table (no gather copy,
// no padding): decode rows (paged_decode) and prefill chunks (paged_prefill); the KV write of a
// step's new tokens; RMSNorm and the split and rotation of q and k; an int8 layer's product for a
// decode step's few rows (int8_mm); a bf16 or float32 layer's product for any rows, its weight
// bf16, float32 or int8 (packed_mm); and greedy sampling's argmax (argmax_rows). Built and loaded
// by cpu_extension.py; registered as torch.ops.tandem.*.
//
// Work split of paged_decode: one task per (sequence, kv head); the `group` query heads sharing
// that kv head are computed together, so each K and V row is read once: bf16 keys are scored as
// they are in the cache by bf16 dot products (products exact in float32), and each V row is
// widened into registers once for the whole group. Every op's arithmetic for a row is in a fixed
// order whatever the batch, so a row gets the same bits alone or in any company.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#endif

namespace {

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

// Asks for the `count` rows of `row_bytes` at `base`, `stride` elements apart, to be brought into
// the cache: the next block of a context is anywhere in the cache (the block table's choice), so
// the hardware prefetcher cannot guess it. Without AVX-512 (measured on an AMD EPYC with AVX2),
// into L2 (prefetcht1): a block's 64 lines asked for into L1 at once outrun its miss buffers, and
// SmolLM2's decode attention over 8 contexts of 100-460 tokens took 0.25-0.30 ms a layer (float32
// cache, 2 threads, cold) against 0.19-0.20 asked for into L2; 0.15-0.16 against 0.10-0.12 over a
// bf16 cache, at 32 contexts 1.03-1.17 against 0.73-0.84. An AVX-512 build keeps prefetcht0, as
// measured there.
#if defined(__AVX512F__)
constexpr int kPrefetchLocality = 3;
#else
constexpr int kPrefetchLocality = 2;
#endif
template <typename T>
inline void prefetch_rows(const T* base, int64_t count, int64_t stride, int64_t row_bytes) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t offset = 0; offset < row_bytes; offset += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(base + i * stride) + offset, 0, kPrefetchLocality);
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX512F__)
// {sum of v[0]'s lanes, ..., sum of v[7]'s}: the eight horizontal sums at once (about a third of
// the instructions of eight separate reductions).
inline __m256 sum_lanes8(const __m512* v) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));  // per 128-bit half: h0..h3's partial sums
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// out[i] = q . keys[i] for the `count` rows of HD floats, eight keys a time. Every key goes the
// same way (a missing eighth is a zero vector), so its score has the same bits wherever it sits.
template <int64_t HD>
inline void dot_keys(const float* q, const float* keys, int64_t count, float* out) {
  constexpr int64_t chunks = HD / 16;
  __m512 qv[chunks];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int64_t i0 = 0; i0 < count; i0 += 8) {
    __m512 v[8];
    for (int64_t j = 0; j < 8; ++j) {
      if (i0 + j >= count) {
        v[j] = _mm512_setzero_ps();
        continue;
      }
      const float* key = keys + (i0 + j) * HD;
      v[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
      for (int64_t c = 1; c < chunks; ++c) v[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(key + 16 * c), v[j]);
    }
    const __m256 sums = sum_lanes8(v);
    if (i0 + 8 <= count) {
      _mm256_storeu_ps(out + i0, sums);
    } else {
      alignas(32) float tail[8];
      _mm256_store_ps(tail, sums);
      for (int64_t j = 0; i0 + j < count; ++j) out[i0 + j] = tail[j];
    }
  }
}

#if defined(__AVX512BF16__)
// out[i] = scale * (q . keys[i]) for the `count` bf16 rows `stride` elements apart, read as they
// are in the cache: per key, HD / 32 bf16 dot products (each product exact in float32) into one
// vector, then eight keys' horizontal sums at once. A key's score depends on q and the key alone.
template <int64_t HD>
inline void dot_keys_bf16(const c10::BFloat16* q, const c10::BFloat16* keys, int64_t count, int64_t stride, float scale, float* out) {
  constexpr int64_t chunks = HD / 32;
  __m512bh qv[chunks];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 32 * c));
  const __m256 scales = _mm256_set1_ps(scale);
  for (int64_t i0 = 0; i0 < count; i0 += 8) {
    __m512 v[8];
    for (int64_t j = 0; j < 8; ++j) {
      v[j] = _mm512_setzero_ps();
      if (i0 + j >= count) continue;
      const c10::BFloat16* key = keys + (i0 + j) * stride;
      for (int64_t c = 0; c < chunks; ++c) v[j] = _mm512_dpbf16_ps(v[j], qv[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(key + 32 * c)));
    }
    const __m256 sums = _mm256_mul_ps(sum_lanes8(v), scales);
    if (i0 + 8 <= count) {
      _mm256_storeu_ps(out + i0, sums);
    } else {
      alignas(32) float tail[8];
      _mm256_store_ps(tail, sums);
      for (int64_t j = 0; i0 + j < count; ++j) out[i0 + j] = tail[j];
    }
  }
}
#endif

// Sixteen elements of a cache row as floats (each conversion is exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// Sixteen bf16 bit patterns as floats (exact: a bf16 is a float32's upper half).
inline __m512 bf16_bits_to_float(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
inline __m512 load16(const c10::BFloat16* p) { return bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

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

// accumulate_rows_shared for a decode task's `group` heads (weights at p + g * p_stride, sums at
// acc + g * HD), for the group sizes whose sums fit in registers (group x HD / 16 <= 16); false
// for any other, which the caller then takes head by head.
template <int64_t HD, typename T>
inline bool accumulate_group(int64_t group, const float* p, int64_t p_stride, const T* block, int64_t count, int64_t stride, float* acc) {
  constexpr int64_t chunks = HD / 16;
  constexpr int64_t kMaxGroup = 4;
  if (group > kMaxGroup || group * chunks > 16) return false;
  const float* weights[kMaxGroup];
  float* sums[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    weights[g] = p + g * p_stride;
    sums[g] = acc + g * HD;
  }
  switch (group) {
    case 1: accumulate_rows_shared<HD, 1>(weights, block, stride, count, sums); return true;
    case 2: accumulate_rows_shared<HD, 2>(weights, block, stride, count, sums); return true;
    case 3: if constexpr (3 * chunks <= 16) accumulate_rows_shared<HD, 3>(weights, block, stride, count, sums); return true;
    default: if constexpr (4 * chunks <= 16) accumulate_rows_shared<HD, 4>(weights, block, stride, count, sums); return true;
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// On a CPU with AVX2 but no AVX-512: eight-lane helpers for paged_decode's vector path (below) and
// paged_prefill.

// Eight elements of a cache row as floats (each conversion is exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

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

// {sum of v[0]'s lanes, ..., sum of v[3]'s}: four horizontal sums at once.
inline __m128 sum_lanes4(const __m256* v) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per 128-bit half: partial sums of v0..v3
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// paged_decode's vector path on a CPU with AVX2 but no AVX-512: the same functions as the AVX-512
// ones above, eight lanes at a time, for head sizes that are multiples of 64.

// out[i] = q . keys[i] for the `count` rows of HD floats, four keys a time. Every key goes the
// same way (a missing fourth is a zero vector), so its score has the same bits wherever it sits.
template <int64_t HD>
inline void dot_keys(const float* q, const float* keys, int64_t count, float* out) {
  constexpr int64_t chunks = HD / 8;
  for (int64_t i0 = 0; i0 < count; i0 += 4) {
    __m256 v[4];
    for (int64_t j = 0; j < 4; ++j) {
      if (i0 + j >= count) {
        v[j] = _mm256_setzero_ps();
        continue;
      }
      const float* key = keys + (i0 + j) * HD;
      v[j] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(key));
#pragma GCC unroll 16
      for (int64_t c = 1; c < chunks; ++c) v[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(key + 8 * c), v[j]);
    }
    const __m128 sums = sum_lanes4(v);
    if (i0 + 4 <= count) {
      _mm_storeu_ps(out + i0, sums);
    } else {
      alignas(16) float tail[4];
      _mm_store_ps(tail, sums);
      for (int64_t j = 0; i0 + j < count; ++j) out[i0 + j] = tail[j];
    }
  }
}

// dot_keys for three queries (HD floats each, one after the other at q) against the same `count`
// keys read in place from the cache (`stride` elements apart, widened to float as loaded): out[m *
// out_stride + i] = q_m . key i. Each key's part is loaded once for the three, and the twelve sums
// of four keys by three queries are twelve chains in flight where dot_keys has four. Every score is
// dot_keys's own arithmetic (a product, then fused multiply-adds over d in order, then the same
// four-key horizontal sum), so the same bits.
template <int64_t HD, typename C>
inline void dot_keys3(const float* q, const C* keys, int64_t stride, int64_t count, float* out, int64_t out_stride) {
  constexpr int64_t chunks = HD / 8;
  for (int64_t i0 = 0; i0 < count; i0 += 4) {
    const int64_t present = std::min<int64_t>(4, count - i0);
    __m256 v[3][4];
#pragma GCC unroll 4
    for (int64_t j = 0; j < 4; ++j) {
      const __m256 k = j < present ? load8(keys + (i0 + j) * stride) : _mm256_setzero_ps();
#pragma GCC unroll 3
      for (int64_t m = 0; m < 3; ++m) v[m][j] = j < present ? _mm256_mul_ps(_mm256_loadu_ps(q + m * HD), k) : _mm256_setzero_ps();
    }
#pragma GCC unroll 16
    for (int64_t c = 1; c < chunks; ++c)
#pragma GCC unroll 4
      for (int64_t j = 0; j < 4; ++j) {
        if (j >= present) continue;
        const __m256 k = load8(keys + (i0 + j) * stride + 8 * c);
#pragma GCC unroll 3
        for (int64_t m = 0; m < 3; ++m) v[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + m * HD + 8 * c), k, v[m][j]);
      }
#pragma GCC unroll 3
    for (int64_t m = 0; m < 3; ++m) {
      const __m128 sums = sum_lanes4(v[m]);
      float* o = out + m * out_stride + i0;
      if (present == 4) {
        _mm_storeu_ps(o, sums);
      } else {
        alignas(16) float tail[4];
        _mm_store_ps(tail, sums);
        for (int64_t j = 0; j < present; ++j) o[j] = tail[j];
      }
    }
  }
}

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

// The V sums of a decode task's `group` heads (weights at p + g * p_stride, sums at acc + g * HD),
// read in place from the block: three heads at a time share each row's load.
template <int64_t HD, typename T>
inline bool accumulate_group(int64_t group, const float* p, int64_t p_stride, const T* block, int64_t count, int64_t stride, float* acc) {
  int64_t g = 0;
  for (; g + 3 <= group; g += 3) {
    const float* weights[3] = {p + g * p_stride, p + (g + 1) * p_stride, p + (g + 2) * p_stride};
    float* sums[3] = {acc + g * HD, acc + (g + 1) * HD, acc + (g + 2) * HD};
    accumulate_rows8_shared3<HD>(weights, block, stride, count, sums);
  }
  for (; g < group; ++g) accumulate_rows8<HD>(p + g * p_stride, block, stride, count, acc + g * HD);
  return true;
}
#else
// Declared for the kernel's discarded `if constexpr (kVectorPath)` branches; never called.
template <int64_t HD>
void dot_keys(const float* q, const float* keys, int64_t count, float* out);
template <int64_t HD, typename T>
void rows_to_float(const T* src, int64_t count, int64_t stride, float* dst);
float softmax_numerators(float* scores, int64_t len);
template <int64_t HD>
void accumulate_rows(const float* p, const float* rows, int64_t count, float* acc);
template <int64_t HD, typename T>
bool accumulate_group(int64_t group, const float* p, int64_t p_stride, const T* block, int64_t count, int64_t stride, float* acc);
#endif

// HD: the head dimension when known at compile time (the loops over it unroll and a query's
// running output stays in registers), 0 for any other. T: q's and out's type; C: the cache's (T,
// or bf16 under float32 q: rows widened exactly to float as they are read).
template <typename T, typename C, int64_t HD>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seq_lens,
                   const at::Tensor& block_tables, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = HD > 0 ? HD : q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const T* q_ptr = q.data_ptr<T>();
  const C* k_ptr = k_cache.data_ptr<C>();
  const C* v_ptr = v_cache.data_ptr<C>();
  T* out_ptr = out.data_ptr<T>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t qs = q.stride(0), qh = q.stride(1);
  const int64_t os = out.stride(0), oh = out.stride(1);
  const float fscale = static_cast<float>(scale);
#if defined(__AVX512F__)
  // intrinsics throughout (rows_to_float ... accumulate_rows); double keeps the plain loops
  constexpr bool kVectorPath = HD > 0 && HD % 16 == 0 && !std::is_same_v<T, double>;
#elif defined(__AVX2__) && defined(__FMA__)
  // the same in eight lanes; the V sums go 64 dimensions at a time
  constexpr bool kVectorPath = HD > 0 && HD % 64 == 0 && !std::is_same_v<T, double>;
#else
  constexpr bool kVectorPath = false;
#endif
#if defined(__AVX512BF16__)
  // bf16 keys scored as they are in the cache, by bf16 dot products (dot_keys_bf16)
  constexpr bool kBf16Scores = kVectorPath && HD % 32 == 0 && std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool kBf16Scores = false;
#endif

  // Each thread takes the next task until none is left: contexts of mixed lengths spread evenly.
  const int64_t num_tasks = num_seqs * num_kv_heads;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> queries(group * head_dim), rows(block_size * head_dim), acc(group * head_dim), totals(group), scores;
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[s];
      const int32_t* table = tables + s * table_stride;
      for (int64_t g = 0; g < group; ++g) {
        float* qg = queries.data() + g * head_dim;
        to_float(q_ptr + s * qs + (h * group + g) * qh, qg, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qg[d] *= fscale;
      }
      // scores[g * len + t] = q_g . k_t, a block of K rows at a time
      scores.resize(group * len);
      const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(C));
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      prefetch_rows(k_ptr + table[0] * kb + h * kh, std::min(block_size, len), ks, row_bytes);
      for (int64_t first = 0; first < len; first += block_size) {
        const int64_t count = std::min(block_size, len - first);
        const int64_t next = first / block_size + 1;
        if (next < num_blocks)
          prefetch_rows(k_ptr + table[next] * kb + h * kh, std::min(block_size, len - next * block_size), ks, row_bytes);
        else
          prefetch_rows(v_ptr + table[0] * vb + h * vh, std::min(block_size, len), vs, row_bytes);
        const C* block = k_ptr + table[first / block_size] * kb + h * kh;
#if defined(__AVX512BF16__)
        if constexpr (kBf16Scores) {
          for (int64_t g = 0; g < group; ++g)
            dot_keys_bf16<HD>(q_ptr + s * qs + (h * group + g) * qh, block, count, ks, fscale, scores.data() + g * len + first);
          continue;
        }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if constexpr (kVectorPath) {
          if (group == 3) {  // SmolLM2's: the three heads score each key as it is read, in place
            dot_keys3<HD>(queries.data(), block, ks, count, scores.data() + first, len);
            continue;
          }
        }
#endif
        if constexpr (kVectorPath)
          rows_to_float<HD>(block, count, ks, rows.data());
        else
          for (int64_t i = 0; i < count; ++i) to_float(block + i * ks, rows.data() + i * head_dim, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = queries.data() + g * head_dim;
          if constexpr (kVectorPath) {
            dot_keys<HD>(qg, rows.data(), count, scores.data() + g * len + first);
            continue;
          }
          for (int64_t i = 0; i < count; ++i) {
            const float* key = rows.data() + i * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * key[d];
            scores[g * len + first + i] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        if constexpr (kVectorPath) {
          totals[g] = softmax_numerators(sg, len);
          continue;
        }
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) peak = std::max(peak, sg[t]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = exp_nonpositive(sg[t] - peak);
          total += sg[t];
        }
        totals[g] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0; first < len; first += block_size) {
        const int64_t count = std::min(block_size, len - first);
        const int64_t next = first / block_size + 1;
        if (next < num_blocks)
          prefetch_rows(v_ptr + table[next] * vb + h * vh, std::min(block_size, len - next * block_size), vs, row_bytes);
        const C* block = v_ptr + table[first / block_size] * vb + h * vh;
        if constexpr (kVectorPath)
          if (accumulate_group<HD>(group, scores.data() + first, len, block, count, vs, acc.data())) continue;
        if constexpr (kVectorPath)
          rows_to_float<HD>(block, count, vs, rows.data());
        else
          for (int64_t i = 0; i < count; ++i) to_float(block + i * vs, rows.data() + i * head_dim, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          float* ag = acc.data() + g * head_dim;
          const float* pg = scores.data() + g * len + first;
          if constexpr (kVectorPath) {
            accumulate_rows<HD>(pg, rows.data(), count, ag);
          } else if constexpr (HD > 0) {  // the same sums in the same order, in registers across the block
            float local[HD];
            for (int64_t d = 0; d < HD; ++d) local[d] = ag[d];
            for (int64_t i = 0; i < count; ++i) {
              const float p = pg[i];
              const float* value = rows.data() + i * HD;
#pragma omp simd
              for (int64_t d = 0; d < HD; ++d) local[d] += p * value[d];
            }
            for (int64_t d = 0; d < HD; ++d) ag[d] = local[d];
          } else {
            for (int64_t i = 0; i < count; ++i) {
              const float p = pg[i];
              const float* value = rows.data() + i * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * value[d];
            }
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out_ptr + s * os + (h * group + g) * oh;
        const float inverse = 1.f / totals[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d] * inverse);
      }
    }
  });
}

#if defined(__AVX512F__)
constexpr int64_t kPrefillTileRows = 16;  // query rows a task takes (each with its group's heads)
constexpr int64_t kScoreQueries = 8;      // queries scored together against a block's 16 keys

constexpr int64_t kKeysAtOnce = 32;  // keys transposed together: two lanes-of-16 per query broadcast

// out[j][0 .. 16 B) = the scores of query j (HD floats at queries + j * HD) against B x 16
// transposed keys (keys_t[d * kKeysAtOnce + lane]): per lane one chain of fused multiply-adds
// over d from zero, the same for a query whichever N and B it is scored with.
template <int64_t HD, int64_t N, int64_t B>
inline void score_queries(const float* queries, const float* keys_t, float* out, int64_t out_stride) {
  __m512 sums[N][B];
  for (int64_t j = 0; j < N; ++j)
    for (int64_t b = 0; b < B; ++b) sums[j][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < HD; ++d) {
    __m512 kd[B];
    for (int64_t b = 0; b < B; ++b) kd[b] = _mm512_loadu_ps(keys_t + d * kKeysAtOnce + 16 * b);
    for (int64_t j = 0; j < N; ++j) {
      const __m512 qd = _mm512_set1_ps(queries[j * HD + d]);
      for (int64_t b = 0; b < B; ++b) sums[j][b] = _mm512_fmadd_ps(qd, kd[b], sums[j][b]);
    }
  }
  for (int64_t j = 0; j < N; ++j)
    for (int64_t b = 0; b < B; ++b) _mm512_storeu_ps(out + j * out_stride + 16 * b, sums[j][b]);
}

#if defined(__AVX512BF16__)
// score_queries for bf16 queries and keys as stored: queries as HD / 2 pairs each (an int32), keys
// transposed in pairs (keys_p[d2 * kKeysAtOnce + lane]: key `lane`'s dimensions 2 d2 and 2 d2 + 1),
// one bf16 dot product a pair (both products exact in float32), each lane's sums one chain over
// the pairs from zero, times `scale` at the end.
template <int64_t HD, int64_t N, int64_t B>
inline void score_query_pairs(const int32_t* queries, const int32_t* keys_p, float scale, float* out, int64_t out_stride) {
  __m512 sums[N][B];
  for (int64_t j = 0; j < N; ++j)
    for (int64_t b = 0; b < B; ++b) sums[j][b] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < HD / 2; ++d2) {
    __m512bh kd[B];
    for (int64_t b = 0; b < B; ++b) kd[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(keys_p + d2 * kKeysAtOnce + 16 * b));
    for (int64_t j = 0; j < N; ++j) {
      const __m512bh qd = reinterpret_cast<__m512bh>(_mm512_set1_epi32(queries[j * (HD / 2) + d2]));
      for (int64_t b = 0; b < B; ++b) sums[j][b] = _mm512_dpbf16_ps(sums[j][b], qd, kd[b]);
    }
  }
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t b = 0; b < B; ++b) _mm512_storeu_ps(out + j * out_stride + 16 * b, _mm512_mul_ps(sums[j][b], scaled));
}

// Two consecutive bf16 values as one int32 (a pair a bf16 dot product takes).
inline int32_t pair_at(const c10::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Two cache rows of HD bf16 values (positions 2 k2 and 2 k2 + 1) as HD pairs, dimension by
// dimension: out[d] holds (first[d], second[d]), the pair a bf16 dot product takes with a pair of
// weights (p[2 k2], p[2 k2 + 1]). A missing second row (past the context) is zeros.
template <int64_t HD>
inline void value_pairs(const c10::BFloat16* first, const c10::BFloat16* second, int32_t* out) {
  for (int64_t c = 0; c < HD / 16; ++c) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 16 * c)));
    const __m512i hi = second == nullptr ? _mm512_setzero_si512()
                                         : _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + 16 * c)));
    _mm512_storeu_si512(out + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

// acc[m][0 .. HD) += sum over the pairs k2 in [0, count) of weights[m][k2] . values[k2] for M
// queries: weights as bf16 pairs (an int32 each), values as value_pairs wrote them (HD int32 a
// pair), each pair of V rows loaded once for the M queries. Per lane one chain of bf16 dot
// products in pair order, the same for a query whichever M it is summed with.
template <int64_t HD, int64_t M>
inline void accumulate_pairs(const int32_t* const* weights, const int32_t* values, int64_t count, float* const* acc) {
  constexpr int64_t chunks = HD / 16;
  __m512 a[M][chunks];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c) a[m][c] = _mm512_loadu_ps(acc[m] + 16 * c);
  for (int64_t k2 = 0; k2 < count; ++k2) {
    __m512i row[chunks];
    for (int64_t c = 0; c < chunks; ++c) {
      row[c] = _mm512_loadu_si512(values + k2 * HD + 16 * c);
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh weight = reinterpret_cast<__m512bh>(_mm512_set1_epi32(weights[m][k2]));
      for (int64_t c = 0; c < chunks; ++c) a[m][c] = _mm512_dpbf16_ps(a[m][c], weight, reinterpret_cast<__m512bh>(row[c]));
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc[m] + 16 * c, a[m][c]);
}

// p[0 .. len) rounded to bf16 (to nearest, ties to even) at out, zeros from len to the next
// multiple of 16 (so the pair holding position len - 1 is whole).
inline void weights_to_bf16(const float* p, int64_t len, c10::BFloat16* out) {
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 m = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + t))));
  }
}
#endif

// A prefill chunk of one sequence: q (T, heads, HD) are its last T tokens, row j attending to
// positions 0 .. start + j (start = seq_len - T). One task per (kv head, tile of rows). Keys are
// widened to float and transposed (lane i: key i), so a query's 16 scores are one chain of HD
// fused multiply-adds, dimension by dimension, and the tile's queries share every key they load
// (bf16 queries over a bf16 cache: keys transposed in bf16 pairs, scored by bf16 dot products of
// the values as stored, a chain of HD / 2; one layer's 2,000-token prefill attention 25.9 ms
// against 32.8 with float32 FMAs, the same error against a float64 reference); each query then
// takes its own softmax over its own context (softmax_numerators) and sums the V rows in key
// order (accumulate_rows). For kPairs the sum too is bf16 dot products: the numerators rounded
// to bf16, V as stored in pairs of positions, two positions a product (accumulate_pairs; the
// float32 FMAs ran at half the rate of bf16 dot products: one layer's 2,000-token prefill
// attention 16-17 ms against 25; against a float64 reference, random q, k and v, the largest
// error 0.0080 against 0.0076, the mean 1.2e-4 against 0.8e-4). Every step of a query's
// arithmetic depends on its own row, position and context alone: the same bits however the
// prompt is chunked or tiled.
template <typename T, typename C, int64_t HD>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* table, int64_t seq_len,
                    double scale, at::Tensor& out) {
  const int64_t q_len = q.size(0), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, start = seq_len - q_len;
  const T* q_ptr = q.data_ptr<T>();
  const C* k_ptr = k_cache.data_ptr<C>();
  const C* v_ptr = v_cache.data_ptr<C>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t qs = q.stride(0), qh = q.stride(1);
  const int64_t os = out.stride(0), oh = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t num_tiles = (q_len + kPrefillTileRows - 1) / kPrefillTileRows;
  const int64_t num_tasks = num_tiles * num_kv_heads;
  const int64_t padded_len = (seq_len + kKeysAtOnce - 1) / kKeysAtOnce * kKeysAtOnce, key_groups = padded_len / kKeysAtOnce;
#if defined(__AVX512BF16__)
  // bf16 queries over a bf16 cache are scored by bf16 dot products of the values as stored.
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  // Every kv head's keys transposed once, kKeysAtOnce at a time (lanes past seq_len zero), for all
  // the tiles that read them (done per tile, it took about as long as the scoring): widened to
  // float32, or in bf16 pairs for kPairs.
  std::vector<float> all_keys_t(kPairs ? 0 : num_kv_heads * key_groups * HD * kKeysAtOnce);
  std::vector<int32_t> all_keys_p(kPairs ? num_kv_heads * key_groups * (HD / 2) * kKeysAtOnce : 0);
  // For kPairs, the V rows too, as pairs of consecutive positions (value_pairs; zeros past
  // seq_len): weighted by bf16 pairs of a query's softmax numerators, two positions a dot product.
  std::vector<int32_t> all_values_p(kPairs ? num_kv_heads * padded_len * HD / 2 : 0);
  at::parallel_for(0, num_kv_heads * key_groups, 1, [&](int64_t begin, int64_t end) {
    float row[HD];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_groups, key0 = (item % key_groups) * kKeysAtOnce;
      float* keys_t = kPairs ? nullptr : all_keys_t.data() + item * HD * kKeysAtOnce;
      int32_t* keys_p = kPairs ? all_keys_p.data() + item * (HD / 2) * kKeysAtOnce : nullptr;
      if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        for (int64_t position = key0; position < key0 + kKeysAtOnce; position += 2) {
          int32_t* pairs = all_values_p.data() + (h * padded_len + position) * HD / 2;
          if (position >= seq_len) {
            std::fill(pairs, pairs + HD, 0);
            continue;
          }
          const C* first = v_ptr + table[position / block_size] * vb + (position % block_size) * vs + h * vh;
          const C* second = position + 1 < seq_len ? v_ptr + table[(position + 1) / block_size] * vb + ((position + 1) % block_size) * vs + h * vh : nullptr;
          value_pairs<HD>(first, second, pairs);
        }
#endif
      }
      for (int64_t i = 0; i < kKeysAtOnce; ++i) {
        const int64_t position = key0 + i;
        const C* key = position < seq_len ? k_ptr + table[position / block_size] * kb + (position % block_size) * ks + h * kh : nullptr;
        if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          for (int64_t d2 = 0; d2 < HD / 2; ++d2) keys_p[d2 * kKeysAtOnce + i] = key == nullptr ? 0 : pair_at(key + 2 * d2);
#endif
        } else if (key != nullptr) {
          for (int64_t c = 0; c < HD / 16; ++c) _mm512_storeu_ps(row + 16 * c, load16(key + 16 * c));
          for (int64_t d = 0; d < HD; ++d) keys_t[d * kKeysAtOnce + i] = row[d];
        } else {
          for (int64_t d = 0; d < HD; ++d) keys_t[d * kKeysAtOnce + i] = 0.f;
        }
      }
    }
  });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t max_queries = kPrefillTileRows * group;
    std::vector<float> queries(max_queries * HD), rows(kPairs ? 0 : block_size * HD), acc(max_queries * HD), totals(max_queries);
    std::vector<int32_t> query_pairs(kPairs ? max_queries * HD / 2 : 0);
    std::vector<float> scores(max_queries * padded_len);
    std::vector<c10::BFloat16> weights(kPairs ? max_queries * padded_len : 0);  // bf16 numerators, for kPairs
    std::vector<int64_t> lens(max_queries);
    // Tasks from the longest contexts down (the last tiles): the short ones fill in at the end.
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t tile = num_tiles - 1 - task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first_row = tile * kPrefillTileRows, end_row = std::min(q_len, first_row + kPrefillTileRows);
      const int64_t num_queries = (end_row - first_row) * group, context = start + end_row;  // keys the tile's last row sees
      for (int64_t r = first_row; r < end_row; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t index = (r - first_row) * group + g;
          if constexpr (kPairs) {
#if defined(__AVX512BF16__)
            for (int64_t d2 = 0; d2 < HD / 2; ++d2) query_pairs[index * (HD / 2) + d2] = pair_at(q_ptr + r * qs + (h * group + g) * qh + 2 * d2);
#endif
          } else {
            float* qg = queries.data() + index * HD;
            for (int64_t c = 0; c < HD / 16; ++c)
              _mm512_storeu_ps(qg + 16 * c, _mm512_mul_ps(load16(q_ptr + r * qs + (h * group + g) * qh + 16 * c), _mm512_set1_ps(fscale)));
          }
          lens[index] = start + r + 1;
        }
      // Scores, 32 keys (one lane each) at a time; the scores of keys past `context` are never read.
      for (int64_t key0 = 0; key0 < context; key0 += kKeysAtOnce) {
        const int64_t count = std::min<int64_t>(kKeysAtOnce, context - key0);
        float* out = scores.data() + key0;
        int64_t q0 = 0;
        if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          const int32_t* keys_p = all_keys_p.data() + (h * key_groups + key0 / kKeysAtOnce) * (HD / 2) * kKeysAtOnce;
          const int32_t* qp = query_pairs.data();
          if (count > 16) {
            for (; q0 + kScoreQueries <= num_queries; q0 += kScoreQueries)
              score_query_pairs<HD, kScoreQueries, 2>(qp + q0 * (HD / 2), keys_p, fscale, out + q0 * padded_len, padded_len);
            for (; q0 < num_queries; ++q0) score_query_pairs<HD, 1, 2>(qp + q0 * (HD / 2), keys_p, fscale, out + q0 * padded_len, padded_len);
          } else {
            for (; q0 + kScoreQueries <= num_queries; q0 += kScoreQueries)
              score_query_pairs<HD, kScoreQueries, 1>(qp + q0 * (HD / 2), keys_p, fscale, out + q0 * padded_len, padded_len);
            for (; q0 < num_queries; ++q0) score_query_pairs<HD, 1, 1>(qp + q0 * (HD / 2), keys_p, fscale, out + q0 * padded_len, padded_len);
          }
#endif
          continue;
        }
        const float* keys_t = all_keys_t.data() + (h * key_groups + key0 / kKeysAtOnce) * HD * kKeysAtOnce;
        if (count > 16) {
          for (; q0 + kScoreQueries <= num_queries; q0 += kScoreQueries)
            score_queries<HD, kScoreQueries, 2>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
          for (; q0 < num_queries; ++q0) score_queries<HD, 1, 2>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
        } else {
          for (; q0 + kScoreQueries <= num_queries; q0 += kScoreQueries)
            score_queries<HD, kScoreQueries, 1>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
          for (; q0 < num_queries; ++q0) score_queries<HD, 1, 1>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
        }
      }
      for (int64_t index = 0; index < num_queries; ++index) totals[index] = softmax_numerators(scores.data() + index * padded_len, lens[index]);
      std::fill(acc.begin(), acc.begin() + num_queries * HD, 0.f);
      if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        // Each query's numerators rounded to bf16 (zero past its own context, to a whole pair),
        // then summed against the V pairs by bf16 dot products: up to its shortest member's
        // context a group of queries shares every pair it loads, then each goes on alone.
        for (int64_t index = 0; index < num_queries; ++index)
          weights_to_bf16(scores.data() + index * padded_len, lens[index], weights.data() + index * padded_len);
        const int32_t* values = all_values_p.data() + h * padded_len * HD / 2;
        const auto pairs_of = [&](int64_t index) { return reinterpret_cast<const int32_t*>(weights.data() + index * padded_len); };
        constexpr int64_t shared = HD <= 64 ? 4 : 2;  // queries a V pair is loaded for (their sums in registers)
        int64_t index = 0;
        for (; index + shared <= num_queries; index += shared) {
          const int64_t common = (lens[index] + 1) / 2;  // lens grow with index
          const int32_t* w[shared];
          float* a[shared];
          for (int64_t m = 0; m < shared; ++m) {
            w[m] = pairs_of(index + m);
            a[m] = acc.data() + (index + m) * HD;
          }
          accumulate_pairs<HD, shared>(w, values, common, a);
          for (int64_t m = 0; m < shared; ++m) {
            const int64_t own = (lens[index + m] + 1) / 2;
            const int32_t* wm = w[m] + common;
            float* am = a[m];
            if (own > common) accumulate_pairs<HD, 1>(&wm, values + common * HD, own - common, &am);
          }
        }
        for (; index < num_queries; ++index) {
          const int32_t* w = pairs_of(index);
          float* a = acc.data() + index * HD;
          accumulate_pairs<HD, 1>(&w, values, (lens[index] + 1) / 2, &a);
        }
#endif
      } else {
        for (int64_t first = 0; first < context; first += block_size) {
          const int64_t count = std::min(block_size, context - first);
          rows_to_float<HD>(v_ptr + table[first / block_size] * vb + h * vh, count, vs, rows.data());
          constexpr int64_t shared = HD <= 64 ? 4 : 2;  // queries a V row is loaded for (their sums in registers)
          int64_t index = 0;
          for (; index + shared <= num_queries && lens[index] >= first + count; index += shared) {  // lens grow with index
            const float* p[shared];
            float* a[shared];
            for (int64_t m = 0; m < shared; ++m) {
              p[m] = scores.data() + (index + m) * padded_len + first;
              a[m] = acc.data() + (index + m) * HD;
            }
            accumulate_rows_shared<HD, shared>(p, rows.data(), HD, count, a);
          }
          for (; index < num_queries; ++index) {
            const int64_t own = std::min(count, lens[index] - first);  // this query's keys in the block
            if (own > 0) accumulate_rows<HD>(scores.data() + index * padded_len + first, rows.data(), own, acc.data() + index * HD);
          }
        }
      }
      for (int64_t r = first_row; r < end_row; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t index = (r - first_row) * group + g;
          T* dst = out_ptr + r * os + (h * group + g) * oh;
          const float inverse = 1.f / totals[index];
          for (int64_t d = 0; d < HD; ++d) dst[d] = static_cast<T>(acc[index * HD + d] * inverse);
        }
    }
  });
}
#elif defined(__AVX2__) && defined(__FMA__)
// paged_prefill on a CPU with AVX2 but no AVX-512: the kernel above in eight lanes. A tile's
// queries are scored against 16 transposed keys at a time (per key one chain of fused
// multiply-adds over d from zero), each query's softmax goes eight lanes at a time in an order
// fixed by its context's length, and its V rows are summed in key order, read in place from the
// cache: every step of a query's arithmetic depends on its own row, position and context alone.
constexpr int64_t kPrefillTileRows = 16;  // query rows a task takes (each with its group's heads)
constexpr int64_t kScoreQueries = 6;      // queries scored together (12 sums in registers)
constexpr int64_t kKeysAtOnce = 16;       // keys transposed together: two vectors of 8 per query broadcast

// out[j][0 .. 16) = the scores of query j (HD floats at queries + j * HD) against 16 transposed
// keys (keys_t[d * kKeysAtOnce + lane]).
template <int64_t HD, int64_t N>
inline void score_queries(const float* queries, const float* keys_t, float* out, int64_t out_stride) {
  __m256 sums[N][2];
#pragma GCC unroll 8
  for (int64_t j = 0; j < N; ++j) sums[j][0] = sums[j][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < HD; ++d) {
    const __m256 low = _mm256_loadu_ps(keys_t + d * kKeysAtOnce), high = _mm256_loadu_ps(keys_t + d * kKeysAtOnce + 8);
#pragma GCC unroll 8
    for (int64_t j = 0; j < N; ++j) {
      const __m256 qd = _mm256_broadcast_ss(queries + j * HD + d);
      sums[j][0] = _mm256_fmadd_ps(qd, low, sums[j][0]);
      sums[j][1] = _mm256_fmadd_ps(qd, high, sums[j][1]);
    }
  }
#pragma GCC unroll 8
  for (int64_t j = 0; j < N; ++j) {
    _mm256_storeu_ps(out + j * out_stride, sums[j][0]);
    _mm256_storeu_ps(out + j * out_stride + 8, sums[j][1]);
  }
}

template <typename T, typename C, int64_t HD>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* table, int64_t seq_len,
                    double scale, at::Tensor& out) {
  static_assert(HD % 64 == 0, "the V sums go 64 dimensions at a time");
  const int64_t q_len = q.size(0), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, start = seq_len - q_len;
  const T* q_ptr = q.data_ptr<T>();
  const C* k_ptr = k_cache.data_ptr<C>();
  const C* v_ptr = v_cache.data_ptr<C>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t qs = q.stride(0), qh = q.stride(1);
  const int64_t os = out.stride(0), oh = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t num_tiles = (q_len + kPrefillTileRows - 1) / kPrefillTileRows;
  const int64_t num_tasks = num_tiles * num_kv_heads;
  const int64_t padded_len = (seq_len + kKeysAtOnce - 1) / kKeysAtOnce * kKeysAtOnce, key_groups = padded_len / kKeysAtOnce;
  // Every kv head's keys widened and transposed once (lanes past seq_len zero), as above.
  std::vector<float> all_keys_t(num_kv_heads * key_groups * HD * kKeysAtOnce);
  at::parallel_for(0, num_kv_heads * key_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_groups, key0 = (item % key_groups) * kKeysAtOnce;
      float* keys_t = all_keys_t.data() + item * HD * kKeysAtOnce;
      for (int64_t i = 0; i < kKeysAtOnce; ++i) {
        const int64_t position = key0 + i;
        if (position < seq_len) {
          const C* key = k_ptr + table[position / block_size] * kb + (position % block_size) * ks + h * kh;
          for (int64_t d = 0; d < HD; ++d) keys_t[d * kKeysAtOnce + i] = static_cast<float>(key[d]);
        } else {
          for (int64_t d = 0; d < HD; ++d) keys_t[d * kKeysAtOnce + i] = 0.f;
        }
      }
    }
  });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t max_queries = kPrefillTileRows * group;
    std::vector<float> queries(max_queries * HD), acc(max_queries * HD), totals(max_queries);
    std::vector<float> scores(max_queries * padded_len);
    std::vector<int64_t> lens(max_queries);
    // Tasks from the longest contexts down (the last tiles): the short ones fill in at the end.
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t tile = num_tiles - 1 - task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first_row = tile * kPrefillTileRows, end_row = std::min(q_len, first_row + kPrefillTileRows);
      const int64_t num_queries = (end_row - first_row) * group, context = start + end_row;  // keys the tile's last row sees
      for (int64_t r = first_row; r < end_row; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t index = (r - first_row) * group + g;
          const T* src = q_ptr + r * qs + (h * group + g) * qh;
          for (int64_t d = 0; d < HD; ++d) queries[index * HD + d] = static_cast<float>(src[d]) * fscale;
          lens[index] = start + r + 1;
        }
      // Scores, 16 keys (one lane each) at a time; the scores of keys past `context` are never read.
      for (int64_t key0 = 0; key0 < context; key0 += kKeysAtOnce) {
        const float* keys_t = all_keys_t.data() + (h * key_groups + key0 / kKeysAtOnce) * HD * kKeysAtOnce;
        float* out = scores.data() + key0;
        int64_t q0 = 0;
        for (; q0 + kScoreQueries <= num_queries; q0 += kScoreQueries)
          score_queries<HD, kScoreQueries>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
        for (; q0 < num_queries; ++q0) score_queries<HD, 1>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
      }
      for (int64_t index = 0; index < num_queries; ++index) totals[index] = softmax_numerators8(scores.data() + index * padded_len, lens[index]);
      std::fill(acc.begin(), acc.begin() + num_queries * HD, 0.f);
      for (int64_t first = 0; first < context; first += block_size) {
        const int64_t count = std::min(block_size, context - first);
        const C* block = v_ptr + table[first / block_size] * vb + h * vh;
        int64_t index = 0;
        for (; index + 3 <= num_queries && lens[index] >= first + count; index += 3) {  // lens grow with index
          const float* p[3];
          float* a[3];
          for (int64_t m = 0; m < 3; ++m) {
            p[m] = scores.data() + (index + m) * padded_len + first;
            a[m] = acc.data() + (index + m) * HD;
          }
          accumulate_rows8_shared3<HD>(p, block, vs, count, a);
        }
        for (; index < num_queries; ++index) {
          const int64_t own = std::min(count, lens[index] - first);  // this query's keys in the block
          if (own > 0) accumulate_rows8<HD>(scores.data() + index * padded_len + first, block, vs, own, acc.data() + index * HD);
        }
      }
      for (int64_t r = first_row; r < end_row; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t index = (r - first_row) * group + g;
          T* dst = out_ptr + r * os + (h * group + g) * oh;
          const float inverse = 1.f / totals[index];
          for (int64_t d = 0; d < HD; ++d) dst[d] = static_cast<T>(acc[index * HD + d] * inverse);
        }
    }
  });
}
#endif

// A cache holds q's dtype, or bf16 under float32 q (half the bytes to read; float32 arithmetic).
bool is_bf16_cache_of_float(const at::Tensor& cache, const at::Tensor& q) {
  return cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kFloat;
}

void check_cache(const at::Tensor& cache, const at::Tensor& q, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, name, " must be (blocks, block_size, kv_heads, head_dim) with unit last stride");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type() || is_bf16_cache_of_float(cache, q), name, " dtype must equal q's (or be bf16 under float32)");
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seq_lens,
                        const at::Tensor& block_tables, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q must be a CPU (seqs, heads, head_dim) tensor with unit last stride");
  check_cache(k_cache, q, "k_cache");
  check_cache(v_cache, q, "v_cache");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && v_cache.sizes() == k_cache.sizes(), "cache shapes must match q's head_dim and each other");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(seq_lens.device().is_cpu() && block_tables.device().is_cpu(), "seq_lens and block_tables must be on the CPU");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == q.size(0), "seq_lens: int32, one per sequence");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) == q.size(0),
              "block_tables: int32 (seqs, max_blocks) with unit last stride");
  // Every block a context covers must be in the cache: the kernel reads them unchecked.
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lens[s] > 0 && lens[s] <= block_tables.size(1) * block_size, "sequence ", s, ": context of ", lens[s], " tokens outside its block table");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[s * block_tables.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, ": block ", block, " outside the cache's ", num_blocks);
    }
  }
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const auto run = [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    if (q.size(2) == 64)
      decode_kernel<T, C, 64>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
    else if (q.size(2) == 128)
      decode_kernel<T, C, 128>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
    else
      decode_kernel<T, C, 0>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
  };
  if (is_bf16_cache_of_float(k_cache, q))
    run(float{}, c10::BFloat16{});
  else
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] { run(scalar_t{}, scalar_t{}); });
  return out;
}

// x (M, K) bf16 @ (w8 (N, K) int8 * scale (N,)).T for the few rows of a decode step, reading the
// int8 weight once: 32 weights widened to bf16 (exact: |w| <= 127) and multiplied with 32 of
// each row's values by AVX512-BF16 dot products into float32 lanes, two channels at a time for up
// to eight rows. out[m][n] = bf16(sum * scale[n]), the sum in an order fixed by K alone: a row's
// bits do not depend on the other rows, their number, or the threads.
#if defined(__AVX512BF16__)
inline __m512bh int8_to_bf16x32(const int8_t* w) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo, 16-31 from hi: k order
}

template <int64_t R>
inline void int8_rows(const c10::BFloat16* x, int64_t xs, const int8_t* w, const c10::BFloat16* scale, c10::BFloat16* out, int64_t os, int64_t n0,
                      int64_t n1, int64_t K) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    __m512 acc[R][2];
    for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int8_t* w0 = w + n * K;
    const int8_t* w1 = w0 + K;
    for (int64_t k = 0; k < K; k += 32) {
      if (k % 64 == 0) {  // the next pair of channels, a cache line each per two steps
        __builtin_prefetch(w0 + 2 * K + k);
        __builtin_prefetch(w1 + 2 * K + k);
      }
      const __m512bh b0 = int8_to_bf16x32(w0 + k), b1 = int8_to_bf16x32(w1 + k);
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * xs + k));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      }
    }
    const float s0 = static_cast<float>(scale[n]), s1 = static_cast<float>(scale[n + 1]);
    for (int64_t r = 0; r < R; ++r) {
      out[r * os + n] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][0]) * s0);
      out[r * os + n + 1] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][1]) * s1);
    }
  }
  for (; n < n1; ++n) {  // an odd last channel: the same chain as either channel of a pair
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh b = int8_to_bf16x32(w + n * K + k);
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * xs + k)), b);
    }
    for (int64_t r = 0; r < R; ++r) out[r * os + n] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r]) * static_cast<float>(scale[n]));
  }
}
#endif

constexpr int64_t kInt8MaxRows = 16;

bool int8_mm_supported(int64_t rows, int64_t in_features, at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  return rows >= 1 && rows <= kInt8MaxRows && in_features % 32 == 0 && dtype == at::kBFloat16;
#else
  return false;
#endif
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), "x, weight and scale must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, in_features) with unit last stride");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kChar && weight.size(1) == x.size(1),
              "weight must be a contiguous int8 (out_features, in_features)");
  TORCH_CHECK(scale.dim() == 1 && scale.is_contiguous() && scale.size(0) == weight.size(0) && scale.scalar_type() == x.scalar_type(),
              "scale must be a contiguous (out_features,) tensor in x's dtype");
  TORCH_CHECK(int8_mm_supported(x.size(0), x.size(1), x.scalar_type()), "int8_mm does not serve ", x.size(0), " rows of ", x.size(1), " ",
              x.scalar_type(), " here");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* x_ptr = x.data_ptr<c10::BFloat16>();
  const auto* s_ptr = scale.data_ptr<c10::BFloat16>();
  auto* o_ptr = out.data_ptr<c10::BFloat16>();
  const int8_t* w_ptr = weight.data_ptr<int8_t>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    // Channels in blocks whose int8 rows stay in the cache while each group of up to 8 rows passes.
    for (int64_t n0 = begin; n0 < end; n0 += 16) {
      const int64_t n1 = std::min(end, n0 + 16);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const c10::BFloat16* xr = x_ptr + m0 * xs;
        c10::BFloat16* orow = o_ptr + m0 * N;
        switch (std::min<int64_t>(8, M - m0)) {
          case 1: int8_rows<1>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
          case 2: int8_rows<2>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
          case 3: int8_rows<3>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
          case 4: int8_rows<4>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
          case 5: int8_rows<5>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
          case 6: int8_rows<6>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
          case 7: int8_rows<7>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
          default: int8_rows<8>(xr, xs, w_ptr, s_ptr, orow, N, n0, n1, K); break;
        }
      }
    }
  });
#endif
  return out;
}

// x (M, K) bf16 @ W.T for any number of rows, W (N, K) packed once (pack_weight) as (N / 16, K / 2,
// 16) pairs: for each group of 16 channels, for each pair of inputs k, k + 1, the 16 channels' two
// weights side by side. W is bf16, or int8 with a bf16 scale per channel (W = w8 * scale[:, None]),
// whose groups a task widens to bf16 (exact: |w| <= 127) once for all its rows. A tile of up to 8
// rows by 48 channels keeps its sums in 24 registers: per pair of inputs, each row's two values
// are broadcast and multiplied into its sums by an AVX512-BF16 dot product (one 64-byte load holds
// the pair for 16 channels). Every output's sum is one chain over the pairs in k order, from zero,
// times its scale (int8) and rounded to bf16 once at the end: its bits depend on its row and the
// weights alone, not on the rows beside it, how many, the tiling or the threads, so a row alone,
// in a decode step of many or among a prefill chunk's rows gets the same.
constexpr int64_t kPackedGroup = 16;  // channels a packed group holds (one float32 vector of sums)
constexpr int64_t kTileRows = 8;
constexpr int64_t kTileGroups = 3;
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
constexpr bool kInt8SignMagnitude = true;  // int8 weights for bf16 rows packed as int8_rows_to_bf16 reads them
#else
constexpr bool kInt8SignMagnitude = false;
#endif

#if defined(__AVX512BF16__)
// The 16 channels' pairs at a packed row: bf16 ones as they are, int8 ones widened.
inline __m512bh packed_pairs(const int32_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
inline __m512bh packed_pairs(const int8_t* p) { return int8_to_bf16x32(p); }

#if defined(__AVX512VBMI__)
// With byte permutes (AVX512-VBMI), int8 weights for bf16 rows are packed for a cheaper widening:
// sign and magnitude (bit 7 the sign, bits 0-6 |w| <= 127), and each two packed rows' 64 bytes in
// 8-byte chunks taken from one row and the other in turn. Two table lookups give the bf16 bits'
// low and high bytes of |w| (exact), the sign joins the high byte, and the bytes' interleave
// within each 128-bit lane gives both rows in order: five operations for 64 weights, against ten
// through float32 (widening had made a decode step's int8 products compute-bound).

constexpr uint16_t bf16_bits_of_small(int m) {  // bf16 of 0 <= m <= 127: exact, 7 significant bits at most
  if (m == 0) return 0;
  int e = 0;
  while ((2 << e) <= m) ++e;
  return static_cast<uint16_t>(((127 + e) << 7) | ((m << (7 - e)) & 0x7F));
}

struct Bf16ByteTables {
  __m512i low0, low1, high0, high1;  // bytes of bf16(m) for m = 0-63 and 64-127
};

inline Bf16ByteTables bf16_byte_tables() {
  alignas(64) static const auto bytes = [] {
    std::array<uint8_t, 256> t{};
    for (int m = 0; m < 128; ++m) {
      t[m] = static_cast<uint8_t>(bf16_bits_of_small(m) & 0xFF);
      t[128 + m] = static_cast<uint8_t>(bf16_bits_of_small(m) >> 8);
    }
    return t;
  }();
  return {_mm512_load_si512(bytes.data()), _mm512_load_si512(bytes.data() + 64), _mm512_load_si512(bytes.data() + 128),
          _mm512_load_si512(bytes.data() + 192)};
}

// Two packed rows of sign-magnitude int8 weights (64 bytes, pack_weight's chunks) -> their bf16 pairs.
inline void int8_rows_to_bf16(const int8_t* p, const Bf16ByteTables& t, __m512bh& first, __m512bh& second) {
  const __m512i w = _mm512_loadu_si512(p);
  const __m512i low = _mm512_permutex2var_epi8(t.low0, w, t.low1);  // indexes bits 0-6: |w|
  const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.high0, w, t.high1), w, _mm512_set1_epi8(static_cast<char>(0x80)),
                                                 0xF8);  // a | (b & c): the sign bit joins
  first = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(low, high));
  second = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(low, high));
}
#endif

// Packed rows ahead of an int8 tile of 1-2 rows that it asks for its groups' weights (1 KB): it
// widens them as it reads, slowly enough that the hardware's prefetch falls behind (SmolLM2's 120
// int8 projections at 1 row, alternated in one process on an AMD EPYC with AVX512-BF16: 4.8-5.4
// ms against 5.3-6.0 at 16 or 32 rows ahead, even at 64; bf16 weights gained nothing).
constexpr int64_t kInt8PairsAhead = 32;

// panel: NR groups of `pairs` rows of 16 channels' pairs (an int32 or 32 int8 each), one group
// after the other; scale: NR x 16 floats, or null.
template <int64_t MR, int64_t NR, typename P>
inline void packed_tile(const c10::BFloat16* x, int64_t xs, const P* panel, int64_t pairs, const float* scale, c10::BFloat16* out, int64_t os) {
  constexpr int64_t kRow = std::is_same_v<P, int8_t> ? 2 * kPackedGroup : kPackedGroup;  // elements of P per packed row
  __m512 acc[MR][NR];
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
#if defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<P, int8_t>) {  // two packed rows at a time (pairs is even)
    const Bf16ByteTables tables = bf16_byte_tables();
    for (int64_t p = 0; p < pairs; p += 2) {
      if constexpr (MR <= 2) {  // past the end of its groups, the next tile's (they follow)
        const int64_t ahead = p + kInt8PairsAhead;
        for (int64_t j = 0; j < NR; ++j)
          __builtin_prefetch(panel + (ahead < pairs ? j * pairs + ahead : (NR + j) * pairs + ahead - pairs) * kRow);
      }
      __m512bh first[NR], second[NR];
      for (int64_t j = 0; j < NR; ++j) int8_rows_to_bf16(panel + (j * pairs + p) * kRow, tables, first[j], second[j]);
      for (int64_t m = 0; m < MR; ++m) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_at(x + m * xs + 2 * p)));
        for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, first[j]);
        const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_at(x + m * xs + 2 * p + 2)));
        for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b, second[j]);
      }
    }
  } else
#endif
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NR];
    if constexpr (std::is_same_v<P, int8_t> && MR <= 2) {
      if (p % 2 == 0) {  // a line holds two packed rows; past the end of its groups, the next tile's (they follow)
        const int64_t ahead = p + kInt8PairsAhead;
        for (int64_t j = 0; j < NR; ++j)
          __builtin_prefetch(panel + (ahead < pairs ? j * pairs + ahead : (NR + j) * pairs + ahead - pairs) * kRow);
      }
    }
    for (int64_t j = 0; j < NR; ++j) b[j] = packed_pairs(panel + (j * pairs + p) * kRow);
    for (int64_t m = 0; m < MR; ++m) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_at(x + m * xs + 2 * p)));
      for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
    }
  }
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t j = 0; j < NR; ++j) {
      const __m512 sum = scale == nullptr ? acc[m][j] : _mm512_mul_ps(acc[m][j], _mm512_loadu_ps(scale + j * kPackedGroup));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * os + j * kPackedGroup), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
    }
}

template <int64_t NR, typename P>
inline void packed_rows(const c10::BFloat16* x, int64_t xs, int64_t rows, const P* panel, int64_t pairs, const float* scale, c10::BFloat16* out,
                        int64_t os) {
  switch (rows) {
    case 1: packed_tile<1, NR>(x, xs, panel, pairs, scale, out, os); break;
    case 2: packed_tile<2, NR>(x, xs, panel, pairs, scale, out, os); break;
    case 3: packed_tile<3, NR>(x, xs, panel, pairs, scale, out, os); break;
    case 4: packed_tile<4, NR>(x, xs, panel, pairs, scale, out, os); break;
    case 5: packed_tile<5, NR>(x, xs, panel, pairs, scale, out, os); break;
    case 6: packed_tile<6, NR>(x, xs, panel, pairs, scale, out, os); break;
    case 7: packed_tile<7, NR>(x, xs, panel, pairs, scale, out, os); break;
    default: packed_tile<8, NR>(x, xs, panel, pairs, scale, out, os); break;
  }
}

// Every tile of rows against one panel of `width` groups.
template <typename P>
inline void packed_panel(const c10::BFloat16* x, int64_t xs, int64_t M, int64_t width, const P* panel, int64_t pairs, const float* scale,
                         c10::BFloat16* out, int64_t os) {
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, M - m0);
    if (width == 3) packed_rows<3>(x + m0 * xs, xs, rows, panel, pairs, scale, out + m0 * os, os);
    else if (width == 2) packed_rows<2>(x + m0 * xs, xs, rows, panel, pairs, scale, out + m0 * os, os);
    else packed_rows<1>(x + m0 * xs, xs, rows, panel, pairs, scale, out + m0 * os, os);
  }
}

void packed_kernel(const at::Tensor& x, const at::Tensor& packed, const c10::BFloat16* scale, at::Tensor& out) {
  const int64_t M = x.size(0), groups = packed.size(0), pairs = packed.size(1), N = groups * kPackedGroup;
  const bool is_int8 = packed.scalar_type() == at::kChar;
  // Up to one tile of rows widens int8 weights as it loads them; more rows share a widened copy.
  const bool widens_once = is_int8 && M > kTileRows;
  const auto* x_ptr = x.data_ptr<c10::BFloat16>();
  auto* o_ptr = out.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  const int64_t tiles = (groups + kTileGroups - 1) / kTileGroups;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> widened(widens_once ? kTileGroups * pairs * kPackedGroup : 0);
    float tile_scale[kTileGroups * kPackedGroup];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group0 = t * kTileGroups, width = std::min(kTileGroups, groups - group0);
      c10::BFloat16* o = o_ptr + group0 * kPackedGroup;
      if (!is_int8) {
        const auto* panel = reinterpret_cast<const int32_t*>(packed.data_ptr<c10::BFloat16>()) + group0 * pairs * kPackedGroup;
        packed_panel(x_ptr, xs, M, width, panel, pairs, nullptr, o, N);
        continue;
      }
      for (int64_t c = 0; c < width * kPackedGroup; ++c) tile_scale[c] = static_cast<float>(scale[group0 * kPackedGroup + c]);
      const int8_t* panel = packed.data_ptr<int8_t>() + group0 * pairs * 2 * kPackedGroup;
      if (!widens_once) {
        packed_panel(x_ptr, xs, M, width, panel, pairs, tile_scale, o, N);
        continue;
      }
#if defined(__AVX512VBMI__)
      const Bf16ByteTables tables = bf16_byte_tables();
      for (int64_t i = 0; i < width * pairs; i += 2) {
        __m512bh first, second;
        int8_rows_to_bf16(panel + i * 2 * kPackedGroup, tables, first, second);
        _mm512_storeu_si512(widened.data() + i * kPackedGroup, reinterpret_cast<__m512i>(first));
        _mm512_storeu_si512(widened.data() + (i + 1) * kPackedGroup, reinterpret_cast<__m512i>(second));
      }
#else
      for (int64_t i = 0; i < width * pairs; ++i)
        _mm512_storeu_si512(widened.data() + i * kPackedGroup, reinterpret_cast<__m512i>(int8_to_bf16x32(panel + i * 2 * kPackedGroup)));
#endif
      packed_panel(x_ptr, xs, M, width, static_cast<const int32_t*>(widened.data()), pairs, tile_scale, o, N);
    }
  });
}
#endif

// The float path: x (M, K) float32 @ W.T, W packed once as (N / 16, K, 16) (for each group of 16
// channels, per input k, the 16 channels' weights side by side): float32, or int8 with a float32
// scale per channel, widened to float (exact) as loaded for a tile's few rows or once per panel
// for more. A tile of up to 6 rows keeps its 16 channels' sums in 12 AVX2 registers (up to 2 rows:
// 3 groups, so that enough chains are in flight); per input k each row's value is broadcast and
// multiplied into its sums by fused multiply-adds. Every output is again one chain over k in
// order from zero, times its scale (int8): a row's bits its own in any call.
#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kFloatTileRows = 6;
// Inputs ahead of a one-group tile whose weights it prefetches (32 cache lines, 2 KB): that tile
// meets each weight first, from memory, and multiplies at the rate the lines arrive unless asked for
// early (SmolLM2's float32 projections and logits at 8 rows: 24-25 ms against 33, at 4 rows 16-17
// against 23, at 64 rows 120-123 against 131; at 1 and 2 rows, three groups in one pass, the
// hardware's own prefetch keeps up and asking changed nothing measurable).
constexpr int64_t kFloatPrefetch = 32;
// Inputs ahead of an int8 tile of 1-2 rows over three groups that it asks for its weights (each
// group's line, 1 KB ahead, once per line): widening int8 to float makes such a tile slow enough
// that the hardware's prefetch falls behind, as it does not for float32 (SmolLM2's 120 int8
// projections at 1 row: 4.9-5.3 ms against 5.7-6.3, at 2 rows 5.9 against 6.9, alternated in one
// process; 32 to 256 inputs ahead all gained 12-16 %).
constexpr int64_t kInt8Prefetch = 64;

// The 16 channels' weights at packed row k, as two vectors of 8 floats (int8 ones widened from two
// 8-byte loads, which fold into the widening instruction: 6 % faster at 1 row than one 16-byte
// load split by a shuffle).
inline void packed_floats(const float* p, __m256& low, __m256& high) {
  low = _mm256_loadu_ps(p);
  high = _mm256_loadu_ps(p + 8);
}
inline void packed_floats(const int8_t* p, __m256& low, __m256& high) {
  low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
}

// Inputs [k0, k1) of a tile: panel holds NR groups of K rows of 16 weights, one group after the
// other. The sums start from zero at k0 == 0, else from what `out` holds (the chain so far,
// stored exactly); at k1 == K they are multiplied by `scale` (NR x 16 floats) unless it is null.
template <int64_t MR, int64_t NR, typename P>
inline void float_tile(const float* x, int64_t xs, const P* panel, int64_t K, int64_t k0, int64_t k1, const float* scale, float* out,
                       int64_t os) {
  // (Every loop over the registers unrolled, so the compiler keeps the sums in registers.)
  __m256 acc[MR][2 * NR];
#pragma GCC unroll 8
  for (int64_t m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int64_t c = 0; c < 2 * NR; ++c) acc[m][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * os + 8 * c);
  for (int64_t k = k0; k < k1; ++k) {
    __m256 w[2 * NR];
    if constexpr (NR == 1) __builtin_prefetch(panel + (k + kFloatPrefetch) * kPackedGroup);  // past the panel's end: harmless
    else if constexpr (std::is_same_v<P, int8_t>) {
      if (k % (64 / kPackedGroup) == 0) {  // a line holds 4 inputs' weights
#pragma GCC unroll 8
        for (int64_t j = 0; j < NR; ++j) __builtin_prefetch(panel + (j * K + k + kInt8Prefetch) * kPackedGroup);
      }
    }
#pragma GCC unroll 8
    for (int64_t j = 0; j < NR; ++j) packed_floats(panel + (j * K + k) * kPackedGroup, w[2 * j], w[2 * j + 1]);
#pragma GCC unroll 8
    for (int64_t m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(x + m * xs + k);
#pragma GCC unroll 8
      for (int64_t c = 0; c < 2 * NR; ++c) acc[m][c] = _mm256_fmadd_ps(a, w[c], acc[m][c]);
    }
  }
  const bool scales = k1 == K && scale != nullptr;
#pragma GCC unroll 8
  for (int64_t m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int64_t c = 0; c < 2 * NR; ++c)
      _mm256_storeu_ps(out + m * os + 8 * c, scales ? _mm256_mul_ps(acc[m][c], _mm256_loadu_ps(scale + 8 * c)) : acc[m][c]);
}

constexpr int64_t kFloatStep = 128;  // inputs a many-row tile takes before the next tile (its weights and rows stay in L1)

// Rows [0, M) against the panel's `width` groups: up to two rows over three groups at once, all K
// in one go; more rows six (or fewer) at a time over one group, kFloatStep inputs at a time.
template <typename P>
inline void float_panel(const float* x, int64_t xs, int64_t M, int64_t width, const P* panel, int64_t K, const float* scale, float* out,
                        int64_t os) {
  if (M <= 2 && width == 3) {
    if (M == 1) float_tile<1, 3>(x, xs, panel, K, 0, K, scale, out, os);
    else float_tile<2, 3>(x, xs, panel, K, 0, K, scale, out, os);
    return;
  }
  for (int64_t j = 0; j < width; ++j) {
    const P* group = panel + j * K * kPackedGroup;
    const float* group_scale = scale == nullptr ? nullptr : scale + j * kPackedGroup;
    float* o = out + j * kPackedGroup;
    for (int64_t k0 = 0; k0 < K; k0 += kFloatStep) {
      const int64_t k1 = std::min(K, k0 + kFloatStep);
      for (int64_t m0 = 0; m0 < M; m0 += kFloatTileRows) {
        const float* xm = x + m0 * xs;
        float* om = o + m0 * os;
        switch (std::min(kFloatTileRows, M - m0)) {
          case 1: float_tile<1, 1>(xm, xs, group, K, k0, k1, group_scale, om, os); break;
          case 2: float_tile<2, 1>(xm, xs, group, K, k0, k1, group_scale, om, os); break;
          case 3: float_tile<3, 1>(xm, xs, group, K, k0, k1, group_scale, om, os); break;
          case 4: float_tile<4, 1>(xm, xs, group, K, k0, k1, group_scale, om, os); break;
          case 5: float_tile<5, 1>(xm, xs, group, K, k0, k1, group_scale, om, os); break;
          default: float_tile<6, 1>(xm, xs, group, K, k0, k1, group_scale, om, os); break;
        }
      }
    }
  }
}

// Rows a task takes through a panel before the next rows: as many as keep their inputs within
// kFloatBlockBytes (in L2), a multiple of a tile's, at most kFloatBlockRows.
constexpr int64_t kFloatBlockRows = 96;
constexpr int64_t kFloatBlockBytes = 192 * 1024;

void float_packed_kernel(const at::Tensor& x, const at::Tensor& packed, const float* scale, at::Tensor& out) {
  const int64_t M = x.size(0), groups = packed.size(0), K = packed.size(1), N = groups * kPackedGroup;
  const bool is_int8 = packed.scalar_type() == at::kChar;
  const bool widens_once = is_int8 && M > 2;  // more rows than a tile that reads int8 as it goes
  const float* x_ptr = x.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const int64_t tiles = (groups + kTileGroups - 1) / kTileGroups;
  const int64_t block_rows = std::clamp<int64_t>(kFloatBlockBytes / (K * 4) / kFloatTileRows * kFloatTileRows, kFloatTileRows, kFloatBlockRows);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(widens_once ? kTileGroups * K * kPackedGroup : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group0 = t * kTileGroups, width = std::min(kTileGroups, groups - group0);
      const float* tile_scale = scale == nullptr ? nullptr : scale + group0 * kPackedGroup;
      const int64_t offset = group0 * K * kPackedGroup;
      if (!is_int8) {
        const float* panel = packed.data_ptr<float>() + offset;
        for (int64_t m0 = 0; m0 < M; m0 += block_rows)
          float_panel(x_ptr + m0 * xs, xs, std::min(block_rows, M - m0), width, panel, K, tile_scale, o_ptr + m0 * N + group0 * kPackedGroup, N);
        continue;
      }
      const int8_t* panel = packed.data_ptr<int8_t>() + offset;
      if (!widens_once) {
        float_panel(x_ptr, xs, M, width, panel, K, tile_scale, o_ptr + group0 * kPackedGroup, N);
        continue;
      }
      for (int64_t i = 0; i < width * K; ++i) {
        __m256 low, high;
        packed_floats(panel + i * kPackedGroup, low, high);
        _mm256_storeu_ps(widened.data() + i * kPackedGroup, low);
        _mm256_storeu_ps(widened.data() + i * kPackedGroup + 8, high);
      }
      for (int64_t m0 = 0; m0 < M; m0 += block_rows)
        float_panel(x_ptr + m0 * xs, xs, std::min(block_rows, M - m0), width, static_cast<const float*>(widened.data()), K, tile_scale,
                    o_ptr + m0 * N + group0 * kPackedGroup, N);
    }
  });
}
#endif

// Whether packed_mm serves a weight of this shape and type for rows of x_dtype here: bf16 rows
// (AVX512-BF16) with bf16 weights, K even, or int8 ones, K a multiple of 4; float32 rows (AVX2
// and FMA) with float32 or int8 weights; N a multiple of 16 either way.
bool packed_mm_supported(int64_t out_features, int64_t in_features, at::ScalarType dtype, at::ScalarType x_dtype) {
  if (out_features <= 0 || out_features % kPackedGroup != 0 || in_features <= 0) return false;
#if defined(__AVX512BF16__)
  if (x_dtype == at::kBFloat16 && dtype == at::kBFloat16 && in_features % 2 == 0) return true;
  if (x_dtype == at::kBFloat16 && dtype == at::kChar && in_features % 4 == 0) return true;  // pairs of pairs (int8_rows_to_bf16)
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (x_dtype == at::kFloat && (dtype == at::kFloat || dtype == at::kChar)) return true;
#endif
  return false;
}

// (N, K) weight -> packed_mm's layout for rows of x_dtype, of the weight's type: for bf16 rows
// (N / 16, K / 2, 32), pairs of inputs side by side; for float32 rows (N / 16, K, 16).
at::Tensor pack_weight(const at::Tensor& weight, at::ScalarType x_dtype) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "weight must be a CPU (out_features, in_features) tensor");
  TORCH_CHECK(packed_mm_supported(weight.size(0), weight.size(1), weight.scalar_type(), x_dtype), "pack_weight does not serve a ",
              weight.size(0), "x", weight.size(1), " ", weight.scalar_type(), " weight for ", x_dtype, " rows here");
  const int64_t N = weight.size(0), K = weight.size(1);
  if (x_dtype == at::kFloat) return weight.reshape({N / kPackedGroup, kPackedGroup, K}).permute({0, 2, 1}).contiguous();
  const at::Tensor pairs = weight.reshape({N / kPackedGroup, kPackedGroup, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  if (weight.scalar_type() == at::kChar)
    TORCH_CHECK(weight.min().item<int8_t>() > -128, "an int8 weight for bf16 rows must lie in -127..127 (exact in bf16's 8 bits)");
  if (weight.scalar_type() != at::kChar || !kInt8SignMagnitude) return pairs.reshape({N / kPackedGroup, K / 2, 2 * kPackedGroup});
  // int8_rows_to_bf16's packing: sign and magnitude, two packed rows in alternate 8-byte chunks
  const at::Tensor chunked = pairs.reshape({N / kPackedGroup, K / 4, 2, 4, 8}).permute({0, 1, 3, 2, 4}).contiguous();
  const at::Tensor magnitude = chunked.abs();
  return at::where(chunked < 0, magnitude.bitwise_or(-128), magnitude).reshape({N / kPackedGroup, K / 2, 2 * kPackedGroup});
}

at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and the packed weight must be on the CPU");
  const auto x_dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x_dtype == at::kBFloat16 || x_dtype == at::kFloat),
              "x must be bf16 or float32 (rows, in_features) with unit last stride");
  const bool is_int8 = packed.scalar_type() == at::kChar;
  const bool floats = x_dtype == at::kFloat;
  const int64_t per_row = floats ? 1 : 2;  // inputs a packed row holds per channel
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && (is_int8 || packed.scalar_type() == x_dtype) &&
                  packed.size(2) == per_row * kPackedGroup && packed.size(1) * per_row == x.size(1),
              "the weight must be pack_weight's for ", x_dtype, " rows: (out_features / 16, in_features",
              floats ? ", 16)" : " / 2, 32)");
  const int64_t N = packed.size(0) * kPackedGroup;
  TORCH_CHECK(packed_mm_supported(N, x.size(1), packed.scalar_type(), x_dtype), "packed_mm does not serve ", x_dtype, " rows with a ",
              packed.scalar_type(), " weight here");
  TORCH_CHECK(is_int8 == scale.has_value(), "an int8 weight takes a scale per channel, a ", x_dtype, " one none");
  if (is_int8)
    TORCH_CHECK(scale->device().is_cpu() && scale->dim() == 1 && scale->is_contiguous() && scale->size(0) == N && scale->scalar_type() == x_dtype,
                "scale must be a contiguous ", x_dtype, " CPU (out_features,) tensor");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
#if defined(__AVX2__) && defined(__FMA__)
  if (floats) {
    float_packed_kernel(x, packed, is_int8 ? scale->data_ptr<float>() : nullptr, out);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  packed_kernel(x, packed, is_int8 ? scale->data_ptr<c10::BFloat16>() : nullptr, out);
#endif
  return out;
}

// Whether paged_prefill serves q of this head size and dtype here (AVX-512, or AVX2 and FMA; a
// head size of 64 or 128; a floating type other than double); the caller takes another path when not.
bool prefill_supported(int64_t head_dim, at::ScalarType dtype) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return (head_dim == 64 || head_dim == 128) && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
#else
  return false;
#endif
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table, int64_t seq_len,
                         double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q must be a CPU (tokens, heads, head_dim) tensor with unit last stride");
  check_cache(k_cache, q, "k_cache");
  check_cache(v_cache, q, "v_cache");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && v_cache.sizes() == k_cache.sizes(), "cache shapes must match q's head_dim and each other");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kInt && block_table.dim() == 1 && block_table.is_contiguous(),
              "block_table: one sequence's contiguous int32 CPU row");
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(q.size(0) > 0 && seq_len >= q.size(0) && seq_len <= block_table.size(0) * block_size, "a chunk of ", q.size(0), " tokens in a context of ",
              seq_len, " outside its block table");
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block ", table[b], " outside the cache's ", num_blocks);
  // (after the checks of its input, so a malformed call is named as such on every CPU)
  TORCH_CHECK(prefill_supported(q.size(2), q.scalar_type()), "paged_prefill does not serve head_dim ", q.size(2), " in ", q.scalar_type(), " here");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const auto run = [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    if constexpr (!std::is_same_v<T, double>) {
      if (q.size(2) == 64)
        prefill_kernel<T, C, 64>(q, k_cache, v_cache, table, seq_len, scale, out);
      else
        prefill_kernel<T, C, 128>(q, k_cache, v_cache, table, seq_len, scale, out);
    }
  };
  if (is_bf16_cache_of_float(k_cache, q))
    run(float{}, c10::BFloat16{});
  else
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] { run(scalar_t{}, scalar_t{}); });
#endif
  return out;
}

// k_cache[slot / block_size, slot % block_size] = k[token] for each new token's slot, and v alike.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache(k_cache, k, "k_cache");
  check_cache(v_cache, v, "v_cache");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k and v must be (tokens, kv_heads, head_dim) of the cache's heads");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && slot_mapping.device().is_cpu(), "k, v and slot_mapping must be on the CPU");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == k.size(0),
              "slot_mapping: int64, one per token");
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t token = 0; token < k.size(0); ++token)
    TORCH_CHECK(slots[token] >= 0 && slots[token] < num_slots, "slot ", slots[token], " outside the cache's ", num_slots);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must have unit last stride");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "k and v, and the caches, must share a dtype");
  const int64_t num_kv_heads = k.size(1), row_bytes = k.size(2) * k.element_size();
  if (is_bf16_cache_of_float(k_cache, k)) {  // each value rounded to bf16 (to nearest even, as torch's .to())
    auto round_rows = [&](const at::Tensor& src, at::Tensor& cache) {
      const float* from = src.data_ptr<float>();
      c10::BFloat16* to = cache.data_ptr<c10::BFloat16>();
      for (int64_t token = 0; token < src.size(0); ++token) {
        const int64_t block = slots[token] / block_size, offset = slots[token] % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const float* row = from + token * src.stride(0) + h * src.stride(1);
          c10::BFloat16* dst = to + block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2);
          for (int64_t d = 0; d < src.size(2); ++d) dst[d] = c10::BFloat16(row[d]);
        }
      }
    };
    round_rows(k, k_cache);
    round_rows(v, v_cache);
    return;
  }
  auto copy_rows = [&](const at::Tensor& src, at::Tensor& cache) {
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(cache.data_ptr());
    const int64_t item = src.element_size();
    for (int64_t token = 0; token < src.size(0); ++token) {
      const int64_t block = slots[token] / block_size, offset = slots[token] % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        std::memcpy(to + (block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2)) * item,
                    from + (token * src.stride(0) + h * src.stride(1)) * item, row_bytes);
    }
  };
  copy_rows(k, k_cache);
  copy_rows(v, v_cache);
}

#if defined(__AVX512BF16__)
// 16 bf16 values widened to float32.
inline __m512 bf16x16_to_float(__m256bh v) { return bf16_bits_to_float(reinterpret_cast<__m256i>(v)); }
#endif

#if defined(__AVX512F__)
// Sixteen floats rounded to bf16 as c10 and torch's vectorized conversion round them: to nearest,
// ties to even, denormals kept, NaN as 0xffff.
inline __m256i float_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 is_number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_number, _mm512_set1_epi32(0xffff), rounded));
}
#endif

// The sum of a row's squares, in the order the vectorizer picks: one compiled body (never inlined)
// for every caller, so rms_norm and add_rms_norm sum a row the same way.
__attribute__((noinline)) float sum_of_squares(const float* row, int64_t width) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) squares += row[i] * row[i];
  return squares;
}

// RMSNorm as models/layers.RMSNorm computes it, one row per token: the row's mean square in
// float32, the row scaled by its reciprocal root in float32 and rounded to the dtype, then
// multiplied by the weight (the product rounded to the dtype), into out. A row's bits depend on
// it alone. With `added` (a tensor like x), the RMSNorm of x + added instead, the sum rounded to
// T as torch's add rounds it (in float32, to nearest) and written to `sum`.
template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out, const at::Tensor* added = nullptr,
                     at::Tensor* sum = nullptr) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* x_ptr = x.data_ptr<T>();
  const T* added_ptr = added == nullptr ? nullptr : added->data_ptr<T>();
  T* sum_ptr = sum == nullptr ? nullptr : sum->data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      if (added_ptr != nullptr) {
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {  // the loop below 16 at a time
          for (; i + 16 <= width; i += 16) {
            const __m512 total = _mm512_add_ps(load16(x_ptr + r * width + i), load16(added_ptr + r * width + i));
            if constexpr (std::is_same_v<T, float>) {
              _mm512_storeu_ps(sum_ptr + r * width + i, total);
              _mm512_storeu_ps(row.data() + i, total);
            } else {
              const __m256i rounded = float_to_bf16(total);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(sum_ptr + r * width + i), rounded);
              _mm512_storeu_ps(row.data() + i, bf16_bits_to_float(rounded));
            }
          }
        }
#endif
        for (; i < width; ++i) {
          const T total = static_cast<T>(static_cast<float>(x_ptr[r * width + i]) + static_cast<float>(added_ptr[r * width + i]));
          sum_ptr[r * width + i] = total;
          row[i] = static_cast<float>(total);
        }
      } else {
        to_float(x_ptr + r * width, row.data(), width);
      }
      const float inverse = 1.f / std::sqrt(sum_of_squares(row.data(), width) / static_cast<float>(width) + feps);
      T* dst = out_ptr + r * width;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      // The loop below 16 at a time (the same roundings, but a denormal result flushed to zero).
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const __m512 scaled = _mm512_set1_ps(inverse);
        for (; i + 16 <= width; i += 16) {
          const __m512 normed = bf16x16_to_float(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), scaled)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(load16(w_ptr + i), normed))));
        }
      }
#endif
      for (; i < width; ++i) {
        const T normed = static_cast<T>(row[i] * inverse);
        dst[i] = static_cast<T>(static_cast<float>(w_ptr[i]) * static_cast<float>(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU (tokens, hidden) tensor");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a CPU (hidden,) tensor in x's dtype");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] { rms_norm_kernel<scalar_t>(x, weight, eps, out); });
  return out;
}

#if defined(__AVX512F__)
// out = silu(gate) * up, 16 columns a time, as torch computes F.silu(gate) * up with its AVX-512
// kernels: x / (1 + e^-x) in float32 with SLEEF's e^x (the one torch's vectorized silu calls),
// rounded to T, then the product in float32 rounded to T.
template <typename T>
void silu_mul_kernel(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1), in_stride = gate_up.stride(0);
  const T* in_ptr = gate_up.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  // torch's grain: below 32,768 elements one thread (a decode step's few rows)
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in_ptr + r * in_stride;
      const T* up = gate + width;
      T* dst = out_ptr + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        const __m512 x = load16(gate + i);
        __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(x, sign))));
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          silu = bf16_bits_to_float(float_to_bf16(silu));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), float_to_bf16(_mm512_mul_ps(silu, load16(up + i))));
        } else {
          _mm512_storeu_ps(dst + i, _mm512_mul_ps(silu, load16(up + i)));
        }
      }
    }
  });
}
#endif

// Each row's index of its largest value: the first of equal ones, or the first NaN where there is
// one, as torch.argmax answers; int64 (rows,). Float32 or bf16 rows, sixteen lanes at a time, each
// lane keeping the first index of its largest value, then the lowest index among the lanes that
// hold the row's largest (torch's own reduction took 660 us for a batch-32 step's float32 logits
// over SmolLM2's 49,152 tokens; this one 126).
#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

template <typename T>
int64_t row_argmax(const T* row, int64_t len) {
  constexpr int64_t kChains = 4;  // independent maxima in flight, each a lane's chain of compares
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best[kChains];
  __m512i best_index[kChains], index[kChains];
  for (int64_t c = 0; c < kChains; ++c) {
    // -inf at the lane's first index: a lane whose values are all -inf answers its first (and one
    // past the row's end is never below a real index holding the same)
    best[c] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    best_index[c] = index[c] = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(16 * c)));
  }
  const __m512i step = _mm512_set1_epi32(16 * kChains);
  __mmask16 nan_seen = 0;
  int64_t i = 0;
  for (; i + 16 * kChains <= len; i += 16 * kChains) {
    for (int64_t c = 0; c < kChains; ++c) {
      const __m512 v = load16(row + i + 16 * c, 0xFFFF);
      nan_seen |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, best[c], _CMP_GT_OQ);  // strictly: the first of equals stays
      best[c] = _mm512_mask_mov_ps(best[c], larger, v);
      best_index[c] = _mm512_mask_mov_epi32(best_index[c], larger, index[c]);
      index[c] = _mm512_add_epi32(index[c], step);
    }
  }
  for (int64_t c = 0; i < len; i += 16, c = (c + 1) % kChains) {  // the tail, a vector at a time in chain order
    const __mmask16 present = len - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - i)) - 1);
    const __m512 v = load16(row + i, present);
    nan_seen |= _mm512_mask_cmp_ps_mask(present, v, v, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_mask_cmp_ps_mask(present, v, best[c], _CMP_GT_OQ);
    best[c] = _mm512_mask_mov_ps(best[c], larger, v);
    best_index[c] = _mm512_mask_mov_epi32(best_index[c], larger, index[c]);
    index[c] = _mm512_add_epi32(index[c], step);
  }
  if (nan_seen != 0) {
    for (int64_t j = 0; j < len; ++j)
      if (std::isnan(static_cast<float>(row[j]))) return j;
  }
  __m512 top = best[0];
  for (int64_t c = 1; c < kChains; ++c) top = _mm512_max_ps(top, best[c]);
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512i first = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  for (int64_t c = 0; c < kChains; ++c)
    first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(best[c], peak, _CMP_EQ_OQ), first, best_index[c]);
  return _mm512_reduce_min_epi32(first);
}
#endif

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.size(1) > 0, "logits must be a CPU (rows, vocab) tensor with a vocab");
#if defined(__AVX512F__)
  const at::ScalarType dtype = logits.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && logits.stride(1) == 1 && logits.size(1) < (int64_t{1} << 31)) {
    const int64_t rows = logits.size(0), len = logits.size(1), stride = logits.stride(0);
    at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
    int64_t* o = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        o[r] = dtype == at::kFloat ? row_argmax(logits.data_ptr<float>() + r * stride, len)
                                   : row_argmax(logits.data_ptr<c10::BFloat16>() + r * stride, len);
    });
    return out;
  }
#endif
  return at::argmax(logits, 1);
}

// silu(gate) * up for gate_up (tokens, 2 intermediate) = [gate | up] per row (an MLP's fused
// projection), torch's F.silu(gate) * up bit for bit in one call without its two launches and the
// SiLU's intermediate tensor. The kernel serves float32 and bf16 rows whose halves are a multiple
// of 64 wide (where torch's vectorized loops take every element, none its scalar tail) with
// AVX-512; anything else takes the torch ops themselves.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be a CPU (tokens, 2 * intermediate) tensor");
  const int64_t width = gate_up.size(1) / 2;
#if defined(__AVX512F__)
  const at::ScalarType dtype = gate_up.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && width > 0 && width % 64 == 0 && gate_up.stride(1) == 1) {
    at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
    if (dtype == at::kFloat)
      silu_mul_kernel<float>(gate_up, out);
    else
      silu_mul_kernel<c10::BFloat16>(gate_up, out);
    return out;
  }
#endif
  return at::mul(at::silu(gate_up.slice(1, 0, width)), gate_up.slice(1, width));
}

// h + added (torch's add, rounded to h's dtype) and that sum's RMSNorm in one call: a residual
// add and the norm after it, as vLLM's fused_add_rms_norm; the two ops' bits.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& added, const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.device().is_cpu() && h.dim() == 2 && h.is_contiguous(), "h must be a contiguous CPU (tokens, hidden) tensor");
  TORCH_CHECK(added.device().is_cpu() && added.sizes() == h.sizes() && added.is_contiguous() && added.scalar_type() == h.scalar_type(),
              "added must be a contiguous CPU tensor of h's shape and dtype");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == h.size(1) && weight.scalar_type() == h.scalar_type(),
              "weight must be a CPU (hidden,) tensor in h's dtype");
  at::Tensor sum = at::empty_like(h), out = at::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm",
                                  [&] { rms_norm_kernel<scalar_t>(h, weight, eps, out, &added, &sum); });
  return {sum, out};
}

// q and k of a fused qkv projection's output (tokens, (heads + 2 kv_heads) * head_dim), rotated
// as models/rotary.apply_rotary does ("rotate_half": dimension i pairs with i + head_dim/2, in
// float32, rounded to the dtype; bit for bit apply_rotary's), each returned contiguous: (tokens,
// heads, head_dim) and (tokens, kv_heads, head_dim). cos and sin: (tokens, 1, head_dim/2) float32.
// Products rounded before the sum (no fused multiply-add), as torch's elementwise ops compute them.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_pairs(const float* first, const float* second, const float* c, const float* s, T* dst,
                                                                int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    dst[i] = static_cast<T>(first[i] * c[i] - second[i] * s[i]);
    dst[half + i] = static_cast<T>(second[i] * c[i] + first[i] * s[i]);
  }
}

template <typename T>
void rotary_kernel(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q, at::Tensor& k) {
  const int64_t tokens = qkv.size(0), num_heads = q.size(1), num_kv_heads = k.size(1), head_dim = q.size(2), half = head_dim / 2;
  const T* src = qkv.data_ptr<T>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  T* q_ptr = q.data_ptr<T>();
  T* k_ptr = k.data_ptr<T>();
  const int64_t src_stride = qkv.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> first(half), second(half);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + t * cos_stride;
      const float* s = sin_ptr + t * sin_stride;
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
        const T* in = src + t * src_stride + head * head_dim;
        T* dst = head < num_heads ? q_ptr + (t * num_heads + head) * head_dim : k_ptr + (t * num_kv_heads + head - num_heads) * head_dim;
        to_float(in, first.data(), half);
        to_float(in + half, second.data(), half);
        rotate_pairs(first.data(), second.data(), c, s, dst, half);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                             int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be a CPU (tokens, width) tensor with unit last stride");
  const int64_t head_dim = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  TORCH_CHECK(head_dim % 2 == 0 && head_dim * (num_heads + 2 * num_kv_heads) == qkv.size(1), "qkv's width must be (heads + 2 kv_heads) * even head_dim");
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == at::kFloat && table->dim() == 3 && table->size(0) == qkv.size(0) && table->size(1) == 1 &&
                    table->size(2) == head_dim / 2 && table->stride(2) == 1,
                "cos and sin must be CPU float32 (tokens, 1, head_dim/2) with unit last stride");
  at::Tensor q = at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({qkv.size(0), num_kv_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_qk", [&] { rotary_kernel<scalar_t>(qkv, cos, sin, q, k); });
  return {q, k};
}

// A decode step's decoder layers in one call: what models/llama.LlamaModel runs for a step whose
// every sequence has one new token, on a CPU with these kernels and every projection packed, op
// for op in the same order (the same kernels, silu_mul and add_rms_norm among them), so every
// output has the Python path's bits; without Python between ops (50-90 us a layer of a
// SmolLM2 batch-1 step). weights: per layer its input norm's weight, packed qkv, packed o, post-
// attention norm's weight, packed gate_up and packed down; scales: per layer the four
// projections' int8 scales (or none). Returns the hidden state before the final norm.
at::Tensor decode_layers(const at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  constexpr int64_t kWeights = 6, kScales = 4;
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeights;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeights && static_cast<int64_t>(scales.size()) == layers * kScales,
              "decode_layers takes 6 weights and 4 scales a layer");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be (tokens, hidden_size)");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == layers && kv_cache.size(2) == 2,
              "kv_cache must be (blocks, layers, 2, block_size, kv_heads, head_dim) with one layer per 6 weights");
  const int64_t tokens = hidden.size(0), head_dim = kv_cache.size(5);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::Tensor k_caches = kv_cache.select(2, 0), v_caches = kv_cache.select(2, 1);
  at::Tensor h = hidden, normed = layers > 0 ? rms_norm(hidden, weights[0], eps) : hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeights;
    const auto scale_of = [&](int64_t i) { return scales.get(l * kScales + i); };
    const at::Tensor qkv = packed_mm(normed, w[1], scale_of(0));
    auto [q, k] = rotary_qk(qkv, cos, sin, num_heads, num_kv_heads);
    const at::Tensor v = qkv.slice(1, q_size + kv_size).view({-1, num_kv_heads, head_dim});
    at::Tensor k_cache = k_caches.select(1, l), v_cache = v_caches.select(1, l);
    write_kv(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attended = paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale);
    std::tie(h, normed) = add_rms_norm(h, packed_mm(attended.reshape({tokens, q_size}), w[2], scale_of(1)), w[3], eps);
    const at::Tensor down = packed_mm(silu_mul(packed_mm(normed, w[4], scale_of(2))), w[5], scale_of(3));
    if (l + 1 < layers)
      std::tie(h, normed) = add_rms_norm(h, down, weights[(l + 1) * kWeights], eps);  // the next layer's input norm
    else
      h = at::add(h, down);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, Tensor block_tables, float scale) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int seq_len, float scale) -> Tensor");
  m.def("prefill_supported(int head_dim, ScalarType dtype) -> bool", &prefill_supported);  // no tensor: not dispatched by device
  m.def("int8_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("int8_mm_supported(int rows, int in_features, ScalarType dtype) -> bool", &int8_mm_supported);
  m.def("packed_mm(Tensor x, Tensor packed, Tensor? scale=None) -> Tensor");
  m.def("pack_weight(Tensor weight, ScalarType x_dtype) -> Tensor");
  m.def("packed_mm_supported(int out_features, int in_features, ScalarType dtype, ScalarType x_dtype) -> bool", &packed_mm_supported);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor added, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] scales, Tensor cos, Tensor sin, Tensor kv_cache, Tensor slot_mapping, "
      "Tensor seq_lens, Tensor block_tables, int num_heads, int num_kv_heads, float scale, float eps) -> Tensor");
  m.def("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { 
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("int8_mm", &int8_mm);
  m.impl("packed_mm", &packed_mm);
  m.impl("pack_weight", &pack_weight);
  m.impl("write_kv", &write_kv);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("decode_layers", &decode_layers);
  m.impl("rotary_qk", &rotary_qk);
}
