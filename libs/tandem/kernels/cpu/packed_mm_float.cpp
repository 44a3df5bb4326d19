// packed_mm's kernel for float32 rows (AVX2 and FMA).
//
// The float path: x (M, K) float32 @ W.T, W packed once as (N / 16, K, 16) (for each group of 16
// channels, per input k, the 16 channels' weights side by side): float32, or int8 with a float32
// scale per channel, widened to float (exact) as loaded for a tile's few rows or once per panel
// for more. A tile of up to 6 rows keeps its 16 channels' sums in 12 AVX2 registers (up to 2 rows:
// 3 groups, so that enough chains are in flight); per input k each row's value is broadcast and
// multiplied into its sums by fused multiply-adds. Every output is again one chain over k in
// order from zero, times its scale (int8): a row's bits its own in any call.

#include "packed_mm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem::cpu {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t kFloatTileRows = 6;
// Inputs ahead of a one-group tile whose weights it prefetches (32 cache lines, 2 KB): that tile
// meets each weight first, from memory, and multiplies at the rate the lines arrive unless asked for
// early (SmolLM2's float32 projections and logits at 4, 8 and 64 rows were faster so; at 1 and 2
// rows, three groups in one pass, the hardware's own prefetch keeps up and asking changed nothing
// measurable).
constexpr int64_t kFloatPrefetch = 32;
// Inputs ahead of an int8 tile of 1-2 rows over three groups that it asks for its weights (each
// group's line, 1 KB ahead, once per line): widening int8 to float makes such a tile slow enough
// that the hardware's prefetch falls behind, as it does not for float32 (SmolLM2's int8
// projections at 1 and 2 rows were faster so, alternated in one process; 32 to 256 inputs ahead
// all gained about as much).
constexpr int64_t kInt8Prefetch = 64;

// The 16 channels' weights at packed row k, as two vectors of 8 floats (int8 ones widened from two
// 8-byte loads, which fold into the widening instruction: faster at 1 row than one 16-byte load
// split by a shuffle).
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

}  // namespace

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

}  // namespace tandem::cpu
