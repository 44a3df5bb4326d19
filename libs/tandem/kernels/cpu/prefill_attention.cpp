// Paged prefill attention (paged_prefill): a prompt chunk's query rows against their causal
// contexts, K and V read in place through the block table, with AVX-512 (and AVX512-BF16 for bf16
// queries over a bf16 cache) or AVX2 and FMA; prefill_supported says where it serves. Where the
// CPU has AMX, bf16 queries over a bf16 cache take its tiles by default (prefill_amx_supported;
// prefill_attention_amx.cpp), the same bits however the prompt is chunked.
//
// A sliding window (window > 0): row j attends to positions max(0, start + j + 1 - window) ..
// start + j. A tile scores and sums from its first row's window start (rounded down to the key
// group and block), each row's softmax over its own window, its weights before the window zero;
// keys before the chunk's first window are never transposed. A soft-cap (softcap > 0): one pass
// over a row's scores before its softmax. Both branch outside the inner loops: window 0 and
// softcap 0 run as without them.

#include "amx.h"
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
#include <type_traits>
#include <vector>

namespace tandem::cpu {
namespace {

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
// the values as stored, a chain of HD / 2: a long prompt's prefill attention faster than with
// float32 FMAs, with the same error against a float64 reference); each query then
// takes its own softmax over its own context (softmax_numerators) and sums the V rows in key
// order (accumulate_rows). For kPairs the sum too is bf16 dot products: the numerators rounded
// to bf16, V as stored in pairs of positions, two positions a product (accumulate_pairs; the
// float32 FMAs ran at half the rate of bf16 dot products, and a long prompt's prefill attention
// was faster so; against a float64 reference, random q, k and v, the largest and the mean error
// stayed close to float32's). Every step of a query's
// arithmetic depends on its own row, position and context alone: the same bits however the
// prompt is chunked or tiled.
template <typename T, typename C, int64_t HD>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* table, int64_t seq_len,
                    double scale, int64_t window, float softcap, at::Tensor& out) {
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
  const int64_t chunk_first = window_start(start, window);  // the first key any row reads
#if defined(__AVX512BF16__)
  // bf16 queries over a bf16 cache are scored by bf16 dot products of the values as stored.
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  // Every kv head's keys transposed once, kKeysAtOnce at a time (lanes past seq_len zero), for all
  // the tiles that read them (done per tile, it took about as long as the scoring): widened to
  // float32, or in bf16 pairs for kPairs.
  aligned_vector<float> all_keys_t(kPairs ? 0 : num_kv_heads * key_groups * HD * kKeysAtOnce);
  aligned_vector<int32_t> all_keys_p(kPairs ? num_kv_heads * key_groups * (HD / 2) * kKeysAtOnce : 0);
  // For kPairs, the V rows too, as pairs of consecutive positions (value_pairs; zeros past
  // seq_len): weighted by bf16 pairs of a query's softmax numerators, two positions a dot product.
  aligned_vector<int32_t> all_values_p(kPairs ? num_kv_heads * padded_len * HD / 2 : 0);
  at::parallel_for(0, num_kv_heads * key_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_groups, key0 = (item % key_groups) * kKeysAtOnce;
      if (key0 + kKeysAtOnce <= chunk_first) continue;  // before every row's window
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
          // (a weight of zero times a row before the window could still be NaN: such rows are never read)
          const auto row_at = [&](int64_t p) { return p >= chunk_first && p < seq_len ? v_ptr + table[p / block_size] * vb + (p % block_size) * vs + h * vh : nullptr; };
          value_pairs<HD>(row_at(position), row_at(position + 1), pairs);
        }
#endif
      }
      // 16 keys at a time, 16 of their float dimensions or bf16 pairs a transpose (zeros past seq_len)
      for (int64_t i0 = 0; i0 < kKeysAtOnce; i0 += 16) {
        const C* keys[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t position = key0 + i0 + i;
          keys[i] = position < seq_len ? k_ptr + table[position / block_size] * kb + (position % block_size) * ks + h * kh : nullptr;
        }
        __m512i r[16];
        if constexpr (kPairs) {
          for (int64_t c = 0; c < HD / 32; ++c) {
            for (int64_t i = 0; i < 16; ++i) r[i] = keys[i] == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(keys[i] + 32 * c);
            transpose16(r, keys_p + 16 * c * kKeysAtOnce + i0, kKeysAtOnce);
          }
        } else {
          for (int64_t c = 0; c < HD / 16; ++c) {
            for (int64_t i = 0; i < 16; ++i) r[i] = keys[i] == nullptr ? _mm512_setzero_si512() : _mm512_castps_si512(load16(keys[i] + 16 * c));
            transpose16(r, reinterpret_cast<int32_t*>(keys_t) + 16 * c * kKeysAtOnce + i0, kKeysAtOnce);
          }
        }
      }
    }
  });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t max_queries = kPrefillTileRows * group;
    aligned_vector<float> queries(max_queries * HD), rows(kPairs ? 0 : block_size * HD), acc(max_queries * HD), totals(max_queries);
    aligned_vector<int32_t> query_pairs(kPairs ? max_queries * HD / 2 : 0);
    aligned_vector<float> scores(max_queries * padded_len);
    aligned_vector<c10::BFloat16> weights(kPairs ? max_queries * padded_len : 0);  // bf16 numerators, for kPairs
    std::vector<int64_t> lens(max_queries), firsts(max_queries);
    // Tasks from the longest contexts down (the last tiles): the short ones fill in at the end.
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t tile = num_tiles - 1 - task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first_row = tile * kPrefillTileRows, end_row = std::min(q_len, first_row + kPrefillTileRows);
      const int64_t num_queries = (end_row - first_row) * group, context = start + end_row;  // keys the tile's last row sees
      const int64_t tile_first = window_start(start + first_row, window);                    // the first key its first row sees
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
          firsts[index] = window_start(start + r, window);
        }
      // Scores, 32 keys (one lane each) at a time; the scores of keys past `context` (or before a
      // query's window) are never read.
      for (int64_t key0 = tile_first / kKeysAtOnce * kKeysAtOnce; key0 < context; key0 += kKeysAtOnce) {
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
      // Each query's softmax over its window; its weights from the tile's first V row (a block or a
      // pair's start) to its own window's start zero, so the shared sums below add nothing there.
      const int64_t v_first = kPairs ? tile_first / 2 * 2 : tile_first / block_size * block_size;
      for (int64_t index = 0; index < num_queries; ++index) {
        float* row = scores.data() + index * padded_len;
        if (softcap > 0.f) cap_scores(row, firsts[index], lens[index], softcap);
        totals[index] = softmax_numerators(row + firsts[index], lens[index] - firsts[index]);
        std::fill(row + v_first, row + firsts[index], 0.f);
      }
      std::fill(acc.begin(), acc.begin() + num_queries * HD, 0.f);
      if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        // Each query's numerators rounded to bf16 (zero past its own context, to a whole pair),
        // then summed against the V pairs by bf16 dot products: up to its shortest member's
        // context a group of queries shares every pair it loads, then each goes on alone.
        const int64_t pair_first = v_first / 2, convert_first = v_first / 16 * 16;
        for (int64_t index = 0; index < num_queries; ++index)
          weights_to_bf16(scores.data() + index * padded_len + convert_first, lens[index] - convert_first,
                          weights.data() + index * padded_len + convert_first);
        const int32_t* values = all_values_p.data() + h * padded_len * HD / 2 + pair_first * HD;
        const auto pairs_of = [&](int64_t index) { return reinterpret_cast<const int32_t*>(weights.data() + index * padded_len) + pair_first; };
        constexpr int64_t shared = HD <= 64 ? 4 : 2;  // queries a V pair is loaded for (their sums in registers)
        int64_t index = 0;
        for (; index + shared <= num_queries; index += shared) {
          const int64_t common = (lens[index] + 1) / 2 - pair_first;  // lens grow with index
          const int32_t* w[shared];
          float* a[shared];
          for (int64_t m = 0; m < shared; ++m) {
            w[m] = pairs_of(index + m);
            a[m] = acc.data() + (index + m) * HD;
          }
          accumulate_pairs<HD, shared>(w, values, common, a);
          for (int64_t m = 0; m < shared; ++m) {
            const int64_t own = (lens[index + m] + 1) / 2 - pair_first;
            const int32_t* wm = w[m] + common;
            float* am = a[m];
            if (own > common) accumulate_pairs<HD, 1>(&wm, values + common * HD, own - common, &am);
          }
        }
        for (; index < num_queries; ++index) {
          const int32_t* w = pairs_of(index);
          float* a = acc.data() + index * HD;
          accumulate_pairs<HD, 1>(&w, values, (lens[index] + 1) / 2 - pair_first, &a);
        }
#endif
      } else {
        for (int64_t first = v_first; first < context; first += block_size) {
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
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {  // rounded to nearest even, as the cast below
            for (int64_t d = 0; d < HD; d += 16) {
              const __m512 value = _mm512_mul_ps(_mm512_loadu_ps(acc.data() + index * HD + d), _mm512_set1_ps(inverse));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(value)));
            }
            continue;
          }
#endif
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
                    double scale, int64_t window, float softcap, at::Tensor& out) {
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
  const int64_t chunk_first = window_start(start, window);  // the first key any row reads
  // Every kv head's keys widened and transposed once (lanes past seq_len zero), as above.
  std::vector<float> all_keys_t(num_kv_heads * key_groups * HD * kKeysAtOnce);
  at::parallel_for(0, num_kv_heads * key_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_groups, key0 = (item % key_groups) * kKeysAtOnce;
      if (key0 + kKeysAtOnce <= chunk_first) continue;  // before every row's window
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
    std::vector<int64_t> lens(max_queries), firsts(max_queries);
    // Tasks from the longest contexts down (the last tiles): the short ones fill in at the end.
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t tile = num_tiles - 1 - task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first_row = tile * kPrefillTileRows, end_row = std::min(q_len, first_row + kPrefillTileRows);
      const int64_t num_queries = (end_row - first_row) * group, context = start + end_row;  // keys the tile's last row sees
      const int64_t tile_first = window_start(start + first_row, window);                    // the first key its first row sees
      for (int64_t r = first_row; r < end_row; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t index = (r - first_row) * group + g;
          const T* src = q_ptr + r * qs + (h * group + g) * qh;
          for (int64_t d = 0; d < HD; ++d) queries[index * HD + d] = static_cast<float>(src[d]) * fscale;
          lens[index] = start + r + 1;
          firsts[index] = window_start(start + r, window);
        }
      // Scores, 16 keys (one lane each) at a time; the scores of keys past `context` (or before a
      // query's window) are never read.
      for (int64_t key0 = tile_first / kKeysAtOnce * kKeysAtOnce; key0 < context; key0 += kKeysAtOnce) {
        const float* keys_t = all_keys_t.data() + (h * key_groups + key0 / kKeysAtOnce) * HD * kKeysAtOnce;
        float* out = scores.data() + key0;
        int64_t q0 = 0;
        for (; q0 + kScoreQueries <= num_queries; q0 += kScoreQueries)
          score_queries<HD, kScoreQueries>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
        for (; q0 < num_queries; ++q0) score_queries<HD, 1>(queries.data() + q0 * HD, keys_t, out + q0 * padded_len, padded_len);
      }
      // As above: each query's softmax over its window (the masked softmax_numerators where it does
      // not start at 0: softmax_numerators8 reads and writes whole lanes of eight past the end),
      // its weights from the tile's first block to its window zero.
      const int64_t v_first = tile_first / block_size * block_size;
      for (int64_t index = 0; index < num_queries; ++index) {
        float* row = scores.data() + index * padded_len;
        if (softcap > 0.f) cap_scores(row, firsts[index], lens[index], softcap);
        totals[index] = firsts[index] == 0 ? softmax_numerators8(row, lens[index]) : softmax_numerators(row + firsts[index], lens[index] - firsts[index]);
        std::fill(row + v_first, row + firsts[index], 0.f);
      }
      std::fill(acc.begin(), acc.begin() + num_queries * HD, 0.f);
      for (int64_t first = v_first; first < context; first += block_size) {
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

}  // namespace

// Whether paged_prefill serves q of this head size and dtype here (AVX-512 with a head size of 64,
// 96, 128 or 256, or AVX2 and FMA with 64, 128 or 256: its V sums go 64 dimensions at a time; a
// floating type other than double); the caller takes another path when not.
bool prefill_supported(int64_t head_dim, at::ScalarType dtype) {
  const bool is_served_type = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
#if defined(__AVX512F__)
  return (head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256) && is_served_type;
#elif defined(__AVX2__) && defined(__FMA__)
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && is_served_type;
#else
  return false;
#endif
}

// Whether paged_prefill's AMX kernel serves bf16 queries over a bf16 cache of this head size here
// (AMX's bf16 tiles, the process permitted to use them, a head size of whole 32-dimension steps).
bool prefill_amx_supported(int64_t head_dim, at::ScalarType dtype, at::ScalarType cache_dtype) {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return dtype == at::kBFloat16 && cache_dtype == at::kBFloat16 && prefill_supported(head_dim, dtype) && head_dim % 32 == 0 && amx::permitted();
#else
  (void)head_dim, (void)dtype, (void)cache_dtype;
  return false;
#endif
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table, int64_t seq_len,
                         double scale, int64_t window, double softcap, int64_t kernel) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(kernel == kPrefillDefault || kernel == kPrefillVector || kernel == kPrefillAmx, "kernel must be -1 (the default), 0 (vector) or 1 (AMX), not ",
              kernel);
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
  const bool amx_serves = prefill_amx_supported(q.size(2), q.scalar_type(), k_cache.scalar_type());
  TORCH_CHECK(kernel != kPrefillAmx || amx_serves, "paged_prefill's AMX kernel does not serve head_dim ", q.size(2), " in ", q.scalar_type(), " over a ",
              k_cache.scalar_type(), " cache here");
  // (its softmax shifts by the largest raw score, which is the largest scaled one only for scale > 0)
  TORCH_CHECK(kernel != kPrefillAmx || scale > 0, "paged_prefill's AMX kernel takes a scale > 0, not ", scale);
  const bool use_amx = amx_serves && kernel != kPrefillVector && scale > 0;
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (use_amx) {
    const float cap = static_cast<float>(softcap);
    if (q.size(2) == 64) prefill_amx<64>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
    else if (q.size(2) == 96) prefill_amx<96>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
    else if (q.size(2) == 128) prefill_amx<128>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
    else prefill_amx<256>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
    return out;
  }
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const auto run = [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    if constexpr (!std::is_same_v<T, double>) {
      const float cap = static_cast<float>(softcap);
      if (q.size(2) == 64)
        prefill_kernel<T, C, 64>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
#if defined(__AVX512F__)
      else if (q.size(2) == 96)
        prefill_kernel<T, C, 96>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
#endif
      else if (q.size(2) == 128)
        prefill_kernel<T, C, 128>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
      else
        prefill_kernel<T, C, 256>(q, k_cache, v_cache, table, seq_len, scale, window, cap, out);
    }
  };
  if (is_bf16_cache_of_float(k_cache, q))
    run(float{}, c10::BFloat16{});
  else if (is_fp8_cache(k_cache, q) && q.scalar_type() == at::kFloat)
    run(float{}, c10::Float8_e4m3fn{});
  else if (is_fp8_cache(k_cache, q))
    run(c10::BFloat16{}, c10::Float8_e4m3fn{});
  else
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] { run(scalar_t{}, scalar_t{}); });
#endif
  return out;
}

}  // namespace tandem::cpu
