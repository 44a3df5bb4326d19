// packed_mm's kernel for bf16 rows (AVX512-BF16).
//
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

#include "amx.h"
#include "packed_mm.h"
#include "silu.h"
#include "vector.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>


namespace tandem::cpu {

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kTileRows = 8;

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
// widens them as it reads, slowly enough that the hardware's prefetch falls behind (SmolLM2's
// int8 projections at 1 row, alternated in one process on an AMD EPYC with AVX512-BF16, were
// faster so than at 16 rows ahead, even at 64; bf16 weights gained nothing).
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


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The AMX kernel: the same packed weights, the same sums. A packed group's 16 rows of pairs are
// one weight tile (16 pairs of inputs by 16 channels, 64 bytes a row), 16 rows of x by 32 inputs
// one row tile, and a tile product adds each pair's two products into each output's float32 sum,
// pair after pair in k order, as the AVX512-BF16 kernel's dot product does: an output's bits
// still depend on its row and the weights alone, not on the tile's other rows or how many there
// are. Tiles 0-3 hold a 2 x 2 block of sums (rows 0-15 and 16-31 by the panel's two groups), 4-5
// the two row tiles and 6-7 the two weight tiles.

constexpr int64_t kAmxRows = amx::kRows;
constexpr int64_t kAmxPairs = amx::kPairs;
constexpr int64_t kAmxChunkRows = 256;  // rows a task takes against one panel (their x stays in the core's cache)
// With one row tile, the weight tiles this many pairs ahead are prefetched: a tile product waits
// on its loads, and the hardware's prefetch alone left one row slower than the dot products.
constexpr int64_t kAmxPairsAhead = 4 * kAmxPairs;

// RB row tiles (of the configured rows) by GB groups of sums (the packed groups at `panel` and
// `second`), over every pair, stored to sums (kAmxRows * RB rows of 32 floats). `meanwhile` runs
// once the tile products are issued, before their sums are stored: vector work (the block
// before's rounding) that goes on while they run.
template <int RB, int GB, typename F>
inline void amx_block(const c10::BFloat16* x, int64_t xs, const int32_t* panel, const int32_t* second, int64_t pairs, float* sums, F&& meanwhile) {
  _tile_zero(0);
  if constexpr (GB > 1) _tile_zero(1);
  if constexpr (RB > 1) _tile_zero(2);
  if constexpr (RB > 1 && GB > 1) _tile_zero(3);
  const int64_t x_bytes = xs * 2;
  for (int64_t p = 0; p < pairs; p += kAmxPairs) {
    if constexpr (RB == 1) {  // few rows: the weights stream from memory, a tile's worth asked for ahead
      const int64_t ahead = std::min(p + kAmxPairsAhead, pairs - kAmxPairs);
      for (int64_t line = 0; line < kAmxPairs; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(panel + (ahead + line) * kPackedGroup), _MM_HINT_T0);
        if constexpr (GB > 1) _mm_prefetch(reinterpret_cast<const char*>(second + (ahead + line) * kPackedGroup), _MM_HINT_T0);
      }
    }
    _tile_loadd(4, x + 2 * p, x_bytes);
    _tile_loadd(6, panel + p * kPackedGroup, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (GB > 1) {
      _tile_loadd(7, second + p * kPackedGroup, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RB > 1) {
      _tile_loadd(5, x + kAmxRows * xs + 2 * p, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (GB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  meanwhile();
  _tile_stored(0, sums, 128);
  if constexpr (GB > 1) _tile_stored(1, sums + kPackedGroup, 128);
  if constexpr (RB > 1) _tile_stored(2, sums + kAmxRows * 32, 128);
  if constexpr (RB > 1 && GB > 1) _tile_stored(3, sums + kAmxRows * 32 + kPackedGroup, 128);
}

inline void store_sums(const float* sums, int64_t rows, int64_t width, const float* scale, c10::BFloat16* out, int64_t os) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < width; ++j) {
      const __m512 s = _mm512_loadu_ps(sums + m * 32 + j * kPackedGroup);
      const __m512 sum = scale == nullptr ? s : _mm512_mul_ps(s, _mm512_loadu_ps(scale + j * kPackedGroup));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * os + j * kPackedGroup), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
    }
}

// rows of x (at most kAmxChunkRows) against the packed group at `panel` and, unless null, the one
// at `second`; finish(sums, rows, m) takes each block's sums (32 floats a row: the first group's
// 16, then the second's) for its rows from m. A block's sums are finished while the next block's
// tile products run (two buffers of sums, in turn).
template <typename Finish>
inline void amx_panel(const c10::BFloat16* x, int64_t xs, int64_t rows, const int32_t* panel, const int32_t* second, int64_t pairs,
                      Finish&& finish) {
  alignas(64) float sums[2][2 * kAmxRows * 32];
  int64_t pending_rows = 0, pending_m = 0, current = 0;  // the block whose sums wait in sums[1 - current]
  const auto finish_pending = [&] {
    if (pending_rows > 0) finish(sums[1 - current], pending_rows, pending_m);
    pending_rows = 0;
  };
  const auto block = [&](auto row_tiles, int64_t m, int64_t block_rows) {
    constexpr int RB = decltype(row_tiles)::value;
    if (second != nullptr) amx_block<RB, 2>(x + m * xs, xs, panel, second, pairs, sums[current], finish_pending);
    else amx_block<RB, 1>(x + m * xs, xs, panel, second, pairs, sums[current], finish_pending);
    pending_m = m, pending_rows = block_rows, current = 1 - current;
  };
  const int64_t full = rows / kAmxRows * kAmxRows;
  if (full > 0) amx::configure(kAmxRows);
  int64_t m = 0;
  for (; m + 2 * kAmxRows <= full; m += 2 * kAmxRows) block(std::integral_constant<int, 2>{}, m, 2 * kAmxRows);
  if (m < full) {
    block(std::integral_constant<int, 1>{}, m, kAmxRows);
    m += kAmxRows;
  }
  if (m < rows) {
    amx::configure(rows - m);  // (the sums before are in memory: a new configuration zeroes the tiles)
    block(std::integral_constant<int, 1>{}, m, rows - m);
  }
  finish_pending();
}

#endif
// `rows` packed rows of int8 pairs (16 channels' two weights each) widened to bf16 pairs (exact:
// |w| <= 127), the rows kInt8PairsAhead on asked for as it goes.
inline void widen_int8(const int8_t* source, int64_t rows, int32_t* widened) {
#if defined(__AVX512VBMI__)
  const Bf16ByteTables tables = bf16_byte_tables();
  for (int64_t i = 0; i < rows; i += 2) {
    __builtin_prefetch(source + std::min(i + kInt8PairsAhead, rows - 2) * 2 * kPackedGroup);
    __m512bh first, second;
    int8_rows_to_bf16(source + i * 2 * kPackedGroup, tables, first, second);
    _mm512_storeu_si512(widened + i * kPackedGroup, reinterpret_cast<__m512i>(first));
    _mm512_storeu_si512(widened + (i + 1) * kPackedGroup, reinterpret_cast<__m512i>(second));
  }
#else
  for (int64_t i = 0; i < rows; ++i)
    _mm512_storeu_si512(widened + i * kPackedGroup, reinterpret_cast<__m512i>(int8_to_bf16x32(source + i * 2 * kPackedGroup)));
#endif
}
}  // namespace

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
    aligned_vector<int32_t> widened(widens_once ? kTileGroups * pairs * kPackedGroup : 0);
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
      widen_int8(panel, width * pairs, widened.data());
      packed_panel(x_ptr, xs, M, width, static_cast<const int32_t*>(widened.data()), pairs, tile_scale, o, N);
    }
  });
}
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
bool amx_supported(int64_t in_features) { return in_features % (2 * kAmxPairs) == 0 && amx::permitted(); }

void amx_packed_kernel(const at::Tensor& x, const at::Tensor& packed, const c10::BFloat16* scale, at::Tensor& out) {
  const int64_t M = x.size(0), groups = packed.size(0), pairs = packed.size(1), N = groups * kPackedGroup;
  const bool is_int8 = packed.scalar_type() == at::kChar;
  const auto* x_ptr = x.data_ptr<c10::BFloat16>();
  auto* o_ptr = out.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  const int64_t panels = (groups + 1) / 2, chunks = (M + kAmxChunkRows - 1) / kAmxChunkRows;
  at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    aligned_vector<int32_t> widened(is_int8 ? 2 * pairs * kPackedGroup : 0);
    float panel_scale[2 * kPackedGroup];
    int64_t widened_panel = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t panel = task % panels, chunk = task / panels;  // a chunk's panels in turn: x stays in cache
      const int64_t group0 = panel * 2, width = std::min<int64_t>(2, groups - group0);
      const int64_t m0 = chunk * kAmxChunkRows, rows = std::min(kAmxChunkRows, M - m0);
      const int32_t* weights = reinterpret_cast<const int32_t*>(packed.data_ptr()) + group0 * pairs * kPackedGroup;
      const float* task_scale = nullptr;
      if (is_int8) {
        const int8_t* source = packed.data_ptr<int8_t>() + group0 * pairs * 2 * kPackedGroup;
        if (widened_panel != panel) {
          widen_int8(source, width * pairs, widened.data());
          widened_panel = panel;
        }
        for (int64_t c = 0; c < width * kPackedGroup; ++c) panel_scale[c] = static_cast<float>(scale[group0 * kPackedGroup + c]);
        weights = widened.data();
        task_scale = panel_scale;
      }
      c10::BFloat16* o = o_ptr + m0 * N + group0 * kPackedGroup;
      amx_panel(x_ptr + m0 * xs, xs, rows, weights, width == 2 ? weights + pairs * kPackedGroup : nullptr, pairs,
                [&](const float* sums, int64_t block_rows, int64_t m) { store_sums(sums, block_rows, width, task_scale, o + m * N, N); });
    }
    _tile_release();
  });
}

// out (M, I) = silu(x W_gate^T) * (x W_up^T) for a bf16 gate/up weight packed as one (2 I, K)
// projection, gate's I channels first: a task's block of sums pairs gate group g with up group
// I / 16 + g, each rounded to bf16 as packed_mm's output would be, then silu.h's SiLU and product,
// while the next block's tile products run. The bits of silu_mul(packed_mm(x, packed, None, AMX)).
void amx_silu_kernel(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  const int64_t M = x.size(0), gate_groups = packed.size(0) / 2, pairs = packed.size(1), I = gate_groups * kPackedGroup;
  const auto* x_ptr = x.data_ptr<c10::BFloat16>();
  auto* o_ptr = out.data_ptr<c10::BFloat16>();
  const auto* weights = reinterpret_cast<const int32_t*>(packed.data_ptr<c10::BFloat16>());
  const int64_t xs = x.stride(0), chunks = (M + kAmxChunkRows - 1) / kAmxChunkRows;
  at::parallel_for(0, gate_groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task % gate_groups, m0 = (task / gate_groups) * kAmxChunkRows, rows = std::min(kAmxChunkRows, M - m0);
      c10::BFloat16* o = o_ptr + m0 * I + g * kPackedGroup;
      const auto finish = [&](const float* sums, int64_t block_rows, int64_t m) {
        for (int64_t r = 0; r < block_rows; ++r) {
          const __m512 gate = bf16_bits_to_float(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(sums + r * 32))));
          const __m512 up = bf16_bits_to_float(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(sums + r * 32 + kPackedGroup))));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (m + r) * I), silu_mul_bf16x16(gate, up));
        }
      };
      amx_panel(x_ptr + m0 * xs, xs, rows, weights + g * pairs * kPackedGroup, weights + (gate_groups + g) * pairs * kPackedGroup, pairs, finish);
    }
    _tile_release();
  });
}
#endif

}  // namespace tandem::cpu
