// The AMX tiles as the kernels use them (packed_mm's AMX kernel, paged_prefill's): Linux's
// permission, one tile configuration, and a blocked tile product over strided operands.
//
// A bf16 tile product (TDPBF16PS) adds to each float32 sum C[m][n] the products of row m of A (16
// pairs of bf16) with column n of B (16 rows of pairs, as an AVX512-BF16 dot product takes them),
// pair after pair: a sum's bits depend on its own row of A, its column of B and the products
// before it, never on the tile's other rows. Rows of zeros (padding) or pairs of zero weights add
// nothing to a sum (x + 0 = x): a kernel can pad and align its tiles without changing any bits.
#pragma once

#include <cstdlib>
#include <new>
#include <vector>

namespace tandem::cpu {

// A buffer whose rows a tile loads or stores starts on a cache line: a tile row that straddles two
// lines takes two loads, and the prefill's tile products ran at a third of their rate so.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using aligned_vector = std::vector<T, LineAligned<T>>;

}  // namespace tandem::cpu

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tandem::cpu::amx {

constexpr int64_t kRows = 16;   // rows a tile holds
constexpr int64_t kPairs = 16;  // pairs of bf16 a tile product takes (64 bytes of a row of A)
constexpr int64_t kCols = 16;   // float32 sums a row of C holds

// Whether Linux lets this process use the tiles: asked once (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); without it the first tile instruction faults.
inline bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-5 of `rows` rows (sums and rows of A), 6-7 of 16 (B: 16 rows of pairs), 64 bytes wide.
inline void configure(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t < 6 ? rows : kPairs);
  }
  _tile_loadconfig(&config);
}

// C (RB x 16 rows by CB x 16 columns, float32, `c_stride` bytes a row) = the sum over `steps` of
// A_s (RB x 16 rows of 16 pairs) times B_s (16 rows of pairs by CB x 16 columns), from zero, step
// after step. A_s's row tile r at a + s * a_step + r * 16 * a_stride; B_s's column tile j at
// b + s * b_step + j * b_col, each row `b_stride` bytes on. Tiles 0-3: the sums, 4-5: A, 6-7: B
// (configure(16) first).
template <int RB, int CB>
inline void product(const char* a, int64_t a_stride, int64_t a_step, const char* b, int64_t b_col, int64_t b_stride, int64_t b_step,
                    int64_t steps, float* c, int64_t c_stride) {
  static_assert(RB >= 1 && RB <= 2 && CB >= 1 && CB <= 2, "a 2 x 2 block of sums at most");
  _tile_zero(0);
  if constexpr (CB > 1) _tile_zero(1);
  if constexpr (RB > 1) _tile_zero(2);
  if constexpr (RB > 1 && CB > 1) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const char* as = a + s * a_step;
    const char* bs = b + s * b_step;
    _tile_loadd(4, as, a_stride);
    _tile_loadd(6, bs, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CB > 1) {
      _tile_loadd(7, bs + b_col, b_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RB > 1) {
      _tile_loadd(5, as + kRows * a_stride, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  char* out = reinterpret_cast<char*>(c);
  _tile_stored(0, out, c_stride);
  if constexpr (CB > 1) _tile_stored(1, out + kCols * sizeof(float), c_stride);
  if constexpr (RB > 1) _tile_stored(2, out + kRows * c_stride, c_stride);
  if constexpr (RB > 1 && CB > 1) _tile_stored(3, out + kRows * c_stride + kCols * sizeof(float), c_stride);
}

// product over `row_tiles` x `col_tiles` tiles of sums, in 2 x 2 blocks (the edges in smaller
// ones): row tile r at a + r * 16 * a_stride, column tile j at b + j * b_col, C's at c + r * 16
// rows and j * 16 columns.
inline void product_tiles(const char* a, int64_t a_stride, int64_t a_step, int64_t row_tiles, const char* b, int64_t b_col, int64_t b_stride,
                          int64_t b_step, int64_t col_tiles, int64_t steps, float* c, int64_t c_stride) {
  for (int64_t r = 0; r < row_tiles; r += 2) {
    const char* ar = a + r * kRows * a_stride;
    float* cr = reinterpret_cast<float*>(reinterpret_cast<char*>(c) + r * kRows * c_stride);
    for (int64_t j = 0; j < col_tiles; j += 2) {
      const char* bj = b + j * b_col;
      float* cj = cr + j * kCols;
      const bool two_rows = r + 1 < row_tiles, two_cols = j + 1 < col_tiles;
      if (two_rows && two_cols) product<2, 2>(ar, a_stride, a_step, bj, b_col, b_stride, b_step, steps, cj, c_stride);
      else if (two_rows) product<2, 1>(ar, a_stride, a_step, bj, b_col, b_stride, b_step, steps, cj, c_stride);
      else if (two_cols) product<1, 2>(ar, a_stride, a_step, bj, b_col, b_stride, b_step, steps, cj, c_stride);
      else product<1, 1>(ar, a_stride, a_step, bj, b_col, b_stride, b_step, steps, cj, c_stride);
    }
  }
}

}  // namespace tandem::cpu::amx
#endif
