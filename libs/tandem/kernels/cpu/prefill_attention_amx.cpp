// paged_prefill's AMX kernel (prefill_amx): bf16 queries over a bf16 cache, the scores and the V
// sums as tile products (amx.h), transposed: a tile of sums has 16 queries as its columns and 16
// keys (scores) or 16 dimensions (V sums) as its rows.
// - S^T = K Q^T: each kv head's keys are copied once a call into rows of their own (a 16-key tile
//   2 KB in one piece, where in the cache its rows lie among the other heads' and layers'; no
//   transposition); the pass's 16 queries are transposed once into a tile a step and stay in L1
//   (at 64 dimensions, in tiles 6 and 7 for the whole pass). Runs of two key tiles alternate
//   between two sets of tiles, so one run's products go on while the run before stores its sums
//   and the run before that has its largest scores taken.
// - The softmax takes one query a lane and one key a row: a query's largest score is a lane of a
//   vertical max (taken as the run's sums are stored), its sum of numerators a lane of vertical
//   adds in key order; its weights are written as the bf16 pairs of two consecutive keys, the
//   layout a tile product takes as B.
// - O^T = V^T P^T: V is transposed once a call into pairs of consecutive positions, 32 positions
//   by HD dimensions a 1 KB-per-tile block; 32 keys a step, four dimension tiles a run.
// On a 2-vCPU Xeon with AMX (bench/attention.py --dtype bf16, four alternated pairs), SmolLM2's
// attention over a 2,000-token prompt took 5.6-5.9 ms a layer against 5.9-6.4 for the
// untransposed tiles it replaced (48 queries by 32 keys a block, keys transposed into pairs), and
// two 512-token chunks among 62 decodes 3.0-3.2 against 3.3-3.5.
// A score's bits are a tile product's over its query and key alone, a weight's e^(scale (s - peak))
// rounded to bf16 with the query's own largest score, a sum over 32-key steps at positions fixed
// by the keys alone: the same bits however the prompt is chunked or its queries grouped.
//
// A sliding window and a soft-cap as in the vector kernel (prefill_attention.cpp): each query's
// keys before its window or past its context get weight zero; rows of V outside the chunk's keys
// are zeros, so a zero weight times a stale row adds nothing.

#include "amx.h"
#include "attention.h"
#include "ops.h"
#include "vector.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

namespace tandem::cpu {

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t kLanes = 16;      // queries a pass takes: one column tile of sums
constexpr int64_t kTileRows = 16;   // query rows a task takes (each with its group's heads)
constexpr int64_t kRunTiles = 4;    // tiles of sums a product run keeps: tiles 0-3 (4-5: A, 6: B)
constexpr int64_t kStepKeys = 32;   // keys a tile product of V sums takes (16 pairs)

// 2^t for t <= 0 on sixteen lanes, to about 3e-6 relative (the weights it makes are rounded to
// bf16, 4e-3): 2^floor(t) (vscalefps: 0 below the floats' range) times a degree-4 polynomial in
// the fraction t - floor(t) (vreduceps, one operation where a floor and a subtraction were two:
// the fraction rounded down, not to nearest, where -1 < t < 0).
inline __m512 exp2_nonpositive16(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF);  // [0, 1)
  __m512 p = _mm512_set1_ps(1.35206032e-2f);  // least squares in relative error on [0, 1): at most 2.7e-6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.20374288e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.41427493e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93006621e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000252f));
  return _mm512_scalef_ps(p, t);  // p 2^floor(t)
}

// Sums tiles 0 .. TILES-1 = the product over `steps` of A tile i (at a_rows[i] + s * a_step, rows
// `a_stride` bytes apart) by B (at b + s * b_step, 64 bytes a row), stored at c + i * c_step, 64
// bytes a row. A tiles alternate between tiles 4 and 5, so one loads while the other multiplies.
template <int TILES>
inline void product_run(const char* const* a_rows, int64_t a_stride, int64_t a_step, const char* b, int64_t b_step, int64_t steps, float* c,
                        int64_t c_step) {
  _tile_zero(0);
  if constexpr (TILES > 1) _tile_zero(1);
  if constexpr (TILES > 2) _tile_zero(2);
  if constexpr (TILES > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, b + s * b_step, 64);
    _tile_loadd(4, a_rows[0] + s * a_step, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TILES > 1) {
      _tile_loadd(5, a_rows[1] + s * a_step, a_stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (TILES > 2) {
      _tile_loadd(4, a_rows[2] + s * a_step, a_stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (TILES > 3) {
      _tile_loadd(5, a_rows[3] + s * a_step, a_stride);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (TILES > 1) _tile_stored(1, c + c_step, 64);
  if constexpr (TILES > 2) _tile_stored(2, c + 2 * c_step, 64);
  if constexpr (TILES > 3) _tile_stored(3, c + 3 * c_step, 64);
}

inline void product_run(int64_t tiles, const char* const* a_rows, int64_t a_stride, int64_t a_step, const char* b, int64_t b_step, int64_t steps,
                        float* c, int64_t c_step) {
  if (tiles == 4) product_run<4>(a_rows, a_stride, a_step, b, b_step, steps, c, c_step);
  else if (tiles == 3) product_run<3>(a_rows, a_stride, a_step, b, b_step, steps, c, c_step);
  else if (tiles == 2) product_run<2>(a_rows, a_stride, a_step, b, b_step, steps, c, c_step);
  else product_run<1>(a_rows, a_stride, a_step, b, b_step, steps, c, c_step);
}

// The scores of one or two key tiles (16 keys each, at `first` and `second` (nullptr: none), their
// rows `stride` bytes apart) with a pass's 16 queries (Q^T at queries, one 1 KB tile a 32-dimension
// step), over `steps` steps, stored at sums (a key's 16 lanes a row, the second tile's 16 rows on).
// Consecutive runs alternate between two sets of tiles (sums 0-1, A 4, B 6 and sums 2-3, A 5, B 7),
// so a run's products go on while the run before stores its sums. (A macro: the tile instructions
// take their tile numbers as literals.)
#define TANDEM_SCORE_RUN(NAME, SUM0, SUM1, A, B)                                                                               \
  inline void NAME(const char* first, const char* second, int64_t stride, const char* queries, int64_t steps, float* sums) { \
    _tile_zero(SUM0);                                                                                                         \
    if (second != nullptr) _tile_zero(SUM1);                                                                                  \
    for (int64_t s = 0; s < steps; ++s) {                                                                                     \
      _tile_loadd(B, queries + s * 1024, 64);                                                                                 \
      _tile_loadd(A, first + s * 64, stride);                                                                                 \
      _tile_dpbf16ps(SUM0, A, B);                                                                                             \
      if (second != nullptr) {                                                                                                \
        _tile_loadd(A, second + s * 64, stride);                                                                              \
        _tile_dpbf16ps(SUM1, A, B);                                                                                           \
      }                                                                                                                       \
    }                                                                                                                         \
    _tile_stored(SUM0, sums, 64);                                                                                             \
    if (second != nullptr) _tile_stored(SUM1, sums + 16 * kLanes, 64);                                                        \
  }
TANDEM_SCORE_RUN(score_run_even, 0, 1, 4, 6)
TANDEM_SCORE_RUN(score_run_odd, 2, 3, 5, 7)
#undef TANDEM_SCORE_RUN

// The same for 64 dimensions (two steps), the pass's Q^T held in tiles 6 and 7 from one run to the
// next (loaded once a pass, not once a run).
#define TANDEM_SCORE_RUN_64(NAME, SUM0, SUM1, A)                                           \
  inline void NAME(const char* first, const char* second, int64_t stride, float* sums) { \
    _tile_zero(SUM0);                                                                   \
    _tile_loadd(A, first, stride);                                                      \
    _tile_dpbf16ps(SUM0, A, 6);                                                         \
    if (second != nullptr) {                                                            \
      _tile_zero(SUM1);                                                                 \
      _tile_loadd(A, second, stride);                                                   \
      _tile_dpbf16ps(SUM1, A, 6);                                                       \
    }                                                                                   \
    _tile_loadd(A, first + 64, stride);                                                 \
    _tile_dpbf16ps(SUM0, A, 7);                                                         \
    if (second != nullptr) {                                                            \
      _tile_loadd(A, second + 64, stride);                                              \
      _tile_dpbf16ps(SUM1, A, 7);                                                       \
    }                                                                                   \
    _tile_stored(SUM0, sums, 64);                                                       \
    if (second != nullptr) _tile_stored(SUM1, sums + 16 * kLanes, 64);                  \
  }
TANDEM_SCORE_RUN_64(score_run_64_even, 0, 1, 4)
TANDEM_SCORE_RUN_64(score_run_64_odd, 2, 3, 5)
#undef TANDEM_SCORE_RUN_64

// The lanes (queries) that attend to key `key`: first <= key < len.
inline __mmask16 attending(__m512i firsts, __m512i lens, int64_t key) {
  const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(key));
  return _mm512_cmp_epi32_mask(firsts, k, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(k, lens, _MM_CMPINT_LT);
}

}  // namespace

template <int64_t HD>
void prefill_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* table, int64_t seq_len, double scale,
                 int64_t window, float softcap, at::Tensor& out) {
  using BF = c10::BFloat16;
  static_assert(HD % 32 == 0, "whole 32-dimension steps");
  const int64_t q_len = q.size(0), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, start = seq_len - q_len;
  const BF* q_ptr = q.data_ptr<BF>();
  const BF* k_ptr = k_cache.data_ptr<BF>();
  const BF* v_ptr = v_cache.data_ptr<BF>();
  BF* out_ptr = out.data_ptr<BF>();
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t qs = q.stride(0), qh = q.stride(1), os = out.stride(0), oh = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t padded_len = (seq_len + kStepKeys - 1) / kStepKeys * kStepKeys, pairs = padded_len / 2;
  const int64_t chunk_first = window_start(start, window);  // the first key any row reads
  // Once a call, per kv head and 32 positions (16 pairs), in one pass:
  // - V^T in pairs: values_t[((h G + g) HD + d) 16 + i] = (v[32 g + 2 i][d], v[32 g + 2 i + 1][d])
  //   (G: 32-position groups), zeros outside [chunk_first, seq_len): a tile of 16 dimensions is
  //   1 KB in one piece, not 16 rows a page apart;
  // - K with its rows contiguous (HD bf16 a key; zeros past seq_len): a key tile is 2 KB in one
  //   piece, not 16 rows among the other heads' and layers' in the cache.
  // Groups before every row's window are never read and left out.
  const int64_t pair_groups = pairs / 16;
  aligned_vector<int32_t> values_t(num_kv_heads * pair_groups * HD * 16);
  aligned_vector<BF> keys(num_kv_heads * padded_len * HD);
  at::parallel_for(0, num_kv_heads * pair_groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t block[16 * HD];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / pair_groups, key0 = (item % pair_groups) * kStepKeys;
      if (key0 + kStepKeys <= chunk_first / kStepKeys * kStepKeys) continue;
      for (int64_t key = key0; key < key0 + kStepKeys; ++key) {
        BF* dst = keys.data() + (h * padded_len + key) * HD;
        if (key < seq_len) std::copy_n(k_ptr + table[key / block_size] * kb + (key % block_size) * ks + h * kh, HD, dst);
        else std::fill_n(dst, HD, BF(0.f));
      }
      const auto row_at = [&](int64_t p) { return p >= chunk_first && p < seq_len ? v_ptr + table[p / block_size] * vb + (p % block_size) * vs + h * vh : nullptr; };
      for (int64_t i = 0; i < 16; ++i) value_pairs<HD>(row_at(key0 + 2 * i), row_at(key0 + 2 * i + 1), block + i * HD);
      for (int64_t c = 0; c < HD / 16; ++c) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_load_si512(block + i * HD + 16 * c);
        transpose16(r, values_t.data() + (item * HD + 16 * c) * 16, 16);
      }
    }
  });
  const int64_t num_tiles = (q_len + kTileRows - 1) / kTileRows, num_tasks = num_tiles * num_kv_heads;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t max_queries = (kTileRows * group + kLanes - 1) / kLanes * kLanes;
    aligned_vector<int32_t> query_pairs(max_queries * HD / 2), queries_t(HD / 2 * kLanes), weights(pairs * kLanes);
    aligned_vector<float> scores(padded_len * kLanes), sums_t(HD * kLanes);
    alignas(64) int32_t lens[kLanes], firsts[kLanes];
    alignas(64) float totals[kLanes];
    amx::configure(amx::kRows);
    // Tasks from the longest contexts down (the last tiles): the short ones fill in at the end.
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t tile = num_tiles - 1 - task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first_row = tile * kTileRows, end_row = std::min(q_len, first_row + kTileRows);
      const int64_t num_queries = (end_row - first_row) * group;
      for (int64_t index = 0; index < num_queries; ++index) {
        const BF* row = q_ptr + (first_row + index / group) * qs + (h * group + index % group) * qh;
        for (int64_t d2 = 0; d2 < HD / 2; ++d2) query_pairs[index * (HD / 2) + d2] = pair_at(row + 2 * d2);
      }
      for (int64_t lane0 = 0; lane0 < num_queries; lane0 += kLanes) {
        const int64_t lanes = std::min(kLanes, num_queries - lane0);
        // the pass's queries: their windows, and the keys all of them (a run's middle) or any attend to
        int64_t any_first = seq_len, all_first = 0, all_end = seq_len, any_end = 0;
        for (int64_t i = 0; i < kLanes; ++i) {
          const int64_t position = start + first_row + (lane0 + i) / group;
          lens[i] = i < lanes ? static_cast<int32_t>(position + 1) : 0;
          firsts[i] = i < lanes ? static_cast<int32_t>(window_start(position, window)) : 0;
          if (i >= lanes) continue;
          any_first = std::min<int64_t>(any_first, firsts[i]), all_first = std::max<int64_t>(all_first, firsts[i]);
          any_end = std::max<int64_t>(any_end, lens[i]), all_end = std::min<int64_t>(all_end, lens[i]);
        }
        const __m512i lens_v = _mm512_load_si512(lens), firsts_v = _mm512_load_si512(firsts);
        const __mmask16 real = static_cast<__mmask16>((1u << lanes) - 1);
        // Q^T, one tile a 32-dimension step: row d2 of step s holds the lanes' pairs 16 s + d2
        for (int64_t s = 0; s < HD / 32; ++s) {
          __m512i r[16];
          for (int64_t i = 0; i < 16; ++i)
            r[i] = i < lanes ? _mm512_loadu_si512(query_pairs.data() + (lane0 + i) * (HD / 2) + 16 * s) : _mm512_setzero_si512();
          transpose16(r, queries_t.data() + s * 16 * kLanes, kLanes);
        }
        // S^T from the first 32 keys any lane reads to the last 16 any lane reads, two key tiles of
        // the head's copied keys a run; each lane's largest score as its rows are stored
        const int64_t w_first = any_first / kStepKeys * kStepKeys, w_end = (any_end + kStepKeys - 1) / kStepKeys * kStepKeys;
        const int64_t score_end = (any_end + 15) / 16 * 16;
        __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        const auto take_peaks = [&](int64_t from, int64_t to) {  // keys [from, to): their rows are stored
          for (int64_t key = from; key < to; ++key) {
            const __m512 row = _mm512_load_ps(scores.data() + (key - w_first) * kLanes);
            if (key >= all_first && key < all_end) peak = _mm512_max_ps(peak, row);
            else peak = _mm512_mask_max_ps(peak, attending(firsts_v, lens_v, key), peak, row);
          }
        };
        const auto key_rows = [&](int64_t key) { return reinterpret_cast<const char*>(keys.data() + (h * padded_len + key) * HD); };
        const char* queries_b = reinterpret_cast<const char*>(queries_t.data());
        if constexpr (HD == 64) {
          _tile_loadd(6, queries_b, 64);
          _tile_loadd(7, queries_b + 1024, 64);
        }
        for (int64_t key0 = w_first, run = 0; key0 < score_end; key0 += 32, ++run) {
          const bool two = key0 + 16 < score_end;
          const char* second = two ? key_rows(key0 + 16) : nullptr;
          float* sums = scores.data() + (key0 - w_first) * kLanes;
          if constexpr (HD == 64) {
            if (run % 2 == 0) score_run_64_even(key_rows(key0), second, HD * 2, sums);
            else score_run_64_odd(key_rows(key0), second, HD * 2, sums);
          } else if (run % 2 == 0) {
            score_run_even(key_rows(key0), second, HD * 2, queries_b, HD / 32, sums);
          } else {
            score_run_odd(key_rows(key0), second, HD * 2, queries_b, HD / 32, sums);
          }
          // the run before's peaks while this run's products go on
          if (softcap == 0.f && run > 0) take_peaks(std::max(key0 - 32, any_first), std::min(key0, any_end));
        }
        if (softcap == 0.f) take_peaks(std::max((score_end - 1 - w_first) / 32 * 32 + w_first, any_first), any_end);
        float row_scale = fscale;
        if (softcap > 0.f) {  // capped after scaling: scaled here, the softmax's scale 1
          const int64_t count = (score_end - w_first) * kLanes;
          for (int64_t t = 0; t < count; t += 16) _mm512_store_ps(scores.data() + t, _mm512_mul_ps(_mm512_load_ps(scores.data() + t), _mm512_set1_ps(fscale)));
          cap_scores(scores.data(), 0, count, softcap);
          row_scale = 1.f;
          take_peaks(any_first, any_end);
        }
        peak = _mm512_mask_blend_ps(real, _mm512_setzero_ps(), peak);  // lanes past the queries: finite, never read
        // Weights e^(scale (s - peak)) = 2^(s c - peak c), c = scale log2(e), rounded to bf16 in pairs
        // of consecutive keys; each lane's numerators summed in key order before rounding
        const __m512 times = _mm512_set1_ps(row_scale * 1.44269504f), shift = _mm512_mul_ps(peak, _mm512_set1_ps(-row_scale * 1.44269504f));
        const auto weight = [&](int64_t key) {
          if (key >= all_first && key < all_end)
            return exp2_nonpositive16(_mm512_fmadd_ps(_mm512_load_ps(scores.data() + (key - w_first) * kLanes), times, shift));
          const __mmask16 m = key < any_end ? attending(firsts_v, lens_v, key) : static_cast<__mmask16>(0);
          if (m == 0) return _mm512_setzero_ps();
          return _mm512_maskz_mov_ps(m, exp2_nonpositive16(_mm512_fmadd_ps(_mm512_load_ps(scores.data() + (key - w_first) * kLanes), times, shift)));
        };
        const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                                    1, 16, 0);
        __m512 total = _mm512_setzero_ps();
        for (int64_t key = w_first; key < w_end; key += 2) {
          const __m512 even = weight(key), odd = weight(key + 1);
          total = _mm512_add_ps(_mm512_add_ps(total, even), odd);
          // both rounded to bf16 (the even key's in the low half), then interleaved lane by lane
          const __m512i rounded = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
          _mm512_store_si512(weights.data() + (key - w_first) / 2 * kLanes, _mm512_permutexvar_epi16(interleave, rounded));
        }
        _mm512_store_ps(totals, total);
        // O^T = V^T P^T, four dimension tiles a run, 32 keys a step
        for (int64_t d0 = 0; d0 < HD; d0 += kRunTiles * 16) {
          const int64_t tiles = std::min<int64_t>(kRunTiles, (HD - d0) / 16);
          const char* a_rows[kRunTiles];
          for (int64_t t = 0; t < tiles; ++t)
            a_rows[t] = reinterpret_cast<const char*>(values_t.data() + ((h * pair_groups + w_first / kStepKeys) * HD + d0 + 16 * t) * 16);
          product_run(tiles, a_rows, 64, HD * 64, reinterpret_cast<const char*>(weights.data()), 16 * kLanes * 4, (w_end - w_first) / kStepKeys,
                      sums_t.data() + d0 * kLanes, 16 * kLanes);
        }
        // each lane's sums back to a row of HD, over its total, rounded to bf16 (to nearest even)
        alignas(64) int32_t sums[kLanes * HD];
        for (int64_t c = 0; c < HD / 16; ++c) {
          __m512i r[16];
          for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_load_si512(sums_t.data() + (16 * c + i) * kLanes);
          transpose16(r, sums + 16 * c, HD);
        }
        for (int64_t i = 0; i < lanes; ++i) {
          const int64_t index = lane0 + i;
          BF* dst = out_ptr + (first_row + index / group) * os + (h * group + index % group) * oh;
          const __m512 inverse = _mm512_set1_ps(1.f / totals[i]);
          for (int64_t d = 0; d < HD; d += 16) {
            const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_load_si512(sums + i * HD + d)), inverse);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(value)));
          }
        }
      }
    }
    _tile_release();
  });
}

template void prefill_amx<64>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int32_t*, int64_t, double, int64_t, float, at::Tensor&);
template void prefill_amx<96>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int32_t*, int64_t, double, int64_t, float, at::Tensor&);
template void prefill_amx<128>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int32_t*, int64_t, double, int64_t, float, at::Tensor&);
template void prefill_amx<256>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int32_t*, int64_t, double, int64_t, float, at::Tensor&);
#endif

}  // namespace tandem::cpu
