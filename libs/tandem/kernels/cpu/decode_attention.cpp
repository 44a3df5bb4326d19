// Paged decode attention (paged_decode): each sequence's new query row against its context, K and V
// read in place through the block table (no gather copy, no padding).
//
// Work split: one task per (sequence, kv head); the `group` query heads sharing that kv head are
// computed together, so each K and V row is read once: bf16 keys are scored as they are in the
// cache by bf16 dot products (products exact in float32), and each V row is widened into
// registers once for the whole group. A row's arithmetic is in a fixed order whatever the batch,
// so it gets the same bits alone or in any company.
//
// A sliding window (window > 0): a row reads only from the block holding its window's first key
// on (the block table read from there, as if the context began at that block), the keys before
// the window in that block masked. A soft-cap (softcap > 0): one pass over a row's scores. Both
// sit outside the inner loops, so window 0 and softcap 0 run the plain kernel.

#include "attention.h"
#include "kv_cache.h"
#include "ops.h"
#include "vector.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace tandem::cpu {
namespace {

// Asks for the `count` rows of `row_bytes` at `base`, `stride` elements apart, to be brought into
// the cache: the next block of a context is anywhere in the cache (the block table's choice), so
// the hardware prefetcher cannot guess it. Without AVX-512 (measured on an AMD EPYC with AVX2),
// into L2 (prefetcht1): a block's 64 lines asked for into L1 at once outrun its miss buffers, and
// SmolLM2's decode attention was clearly slower that way than asked for into L2, over float32 and
// bf16 caches and at small and large batches alike. An AVX-512 build keeps prefetcht0, as
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
// {sum of v[0]'s lanes, ..., sum of v[3]'s}: four horizontal sums at once.
inline __m128 sum_lanes4(const __m256* v) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per 128-bit half: partial sums of v0..v3
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// paged_decode's vector path on a CPU with AVX2 but no AVX-512: the same functions as the AVX-512
// ones above, eight lanes at a time, for head sizes that are multiples of 64 (the rest of them in
// attention.h).

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
bool accumulate_group(int64_t group, const float* p, int64_t p_stride, const T* block, int64_t count, int64_t stride, float* acc);
#endif

// scores[g * len + t] for the group's `group` rows of `len` scores: capped (softcap * tanh(score /
// softcap)) where softcap > 0, and -infinity for the first `num_masked` (keys before the window).
inline void cap_and_mask(float* scores, int64_t group, int64_t len, int64_t num_masked, float softcap) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    if (softcap > 0.f) cap_scores(sg, num_masked, len, softcap);
    for (int64_t t = 0; t < num_masked; ++t) sg[t] = -std::numeric_limits<float>::infinity();
  }
}

// HD: the head dimension when known at compile time (the loops over it unroll and a query's
// running output stays in registers), 0 for any other. T: q's and out's type; C: the cache's (T,
// bf16 under float32 q, or FP8 e4m3: rows widened exactly to float as they are read).
template <typename T, typename C, int64_t HD>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seq_lens,
                   const at::Tensor& block_tables, double scale, int64_t window, float softcap, at::Tensor& out) {
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
      // The keys read: from the block holding the window's first key (position lens[s] - window)
      // to the end, its keys before the window masked; the whole context without a window.
      const int64_t window_start = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
      const int64_t span_start = window_start / block_size * block_size, num_masked = window_start - span_start;
      const int64_t len = lens[s] - span_start;
      const int32_t* table = tables + s * table_stride + span_start / block_size;
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
      if (softcap > 0.f || num_masked > 0) cap_and_mask(scores.data(), group, len, num_masked, softcap);
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

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seq_lens,
                        const at::Tensor& block_tables, double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
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
    const float cap = static_cast<float>(softcap);
    if (q.size(2) == 64)
      decode_kernel<T, C, 64>(q, k_cache, v_cache, seq_lens, block_tables, scale, window, cap, out);
    else if (q.size(2) == 96)  // Phi-3's
      decode_kernel<T, C, 96>(q, k_cache, v_cache, seq_lens, block_tables, scale, window, cap, out);
    else if (q.size(2) == 128)
      decode_kernel<T, C, 128>(q, k_cache, v_cache, seq_lens, block_tables, scale, window, cap, out);
    else if (q.size(2) == 256)  // Gemma 2's
      decode_kernel<T, C, 256>(q, k_cache, v_cache, seq_lens, block_tables, scale, window, cap, out);
    else
      decode_kernel<T, C, 0>(q, k_cache, v_cache, seq_lens, block_tables, scale, window, cap, out);
  };
  if (is_bf16_cache_of_float(k_cache, q))
    run(float{}, c10::BFloat16{});
  else if (is_fp8_cache(k_cache, q) && q.scalar_type() == at::kFloat)
    run(float{}, c10::Float8_e4m3fn{});
  else if (is_fp8_cache(k_cache, q))
    run(c10::BFloat16{}, c10::Float8_e4m3fn{});
  else
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] { run(scalar_t{}, scalar_t{}); });
  return out;
}

}  // namespace tandem::cpu
