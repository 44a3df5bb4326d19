// fp8_mm, an fp8 layer's product for a few rows (AVX512F).
//
// x (M, K) bf16 or float32 @ (w (N, K) float8_e4m3fn * scale (N,) float32).T, reading the fp8
// weight once per group of up to eight rows. The rows are widened to float32 first (exact); 32
// weights at a time are widened as they are loaded: each byte s.eeee.mmm becomes the half-float
// s.0eeee.mmm0000000, whose value is the fp8 value times 2^-8 for normal and subnormal values
// alike (both formats put the exponent's bias where the shift puts it), then widened to float32,
// exactly. The 2^8 goes into the row's scale. Float32 products are summed in 16 lanes, two
// channels at a time for up to eight rows; out[m][n] = (sum * scale[n] * 256)
// rounded once to x's dtype, the sum in an order fixed by K alone: a row's bits do not depend on
// the other rows, their number, or the threads.

#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tandem::cpu {
namespace {

#if defined(__AVX512F__)
// e4m3fn bytes -> half-float bits: sign-extended to 16 bits and shifted left by 7, the byte's
// sign lands on bit 15 and its exponent and mantissa on bits 13..7; bit 14, a copy of the sign,
// is cleared. The halves are the fp8 values times 2^-8 (NaN bytes, which a saturating cast never
// writes, come out as 480 * 2^-8).
constexpr int16_t kHalfMask = static_cast<int16_t>(0xBFFF);

// 32 weights as two vectors of 16 float32 (times 2^-8).
inline void fp8x32_to_ps(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i half = _mm512_and_si512(_mm512_slli_epi16(wide, 7), _mm512_set1_epi16(kHalfMask));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}

// 16 weights (a row's last, where in_features is an odd multiple of 16).
inline __m512 fp8x16_to_ps(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(kHalfMask)));
}

// acc[r][c] += x row r . weight row c over all K, for C channels (1 or 2) and R rows: 32 weights a
// step, then 16 if K leaves them; the same order of additions for every C and R.
template <int64_t R, int64_t C>
inline void fp8_dot(const float* x, int64_t K, const uint8_t* const* w, __m512 (&acc)[R][2]) {
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (k % 64 == 0) {  // the next channels, a cache line each per two steps
      for (int64_t c = 0; c < C; ++c) __builtin_prefetch(w[c] + C * K + k);
    }
    __m512 lo[C], hi[C];
    for (int64_t c = 0; c < C; ++c) fp8x32_to_ps(w[c] + k, lo[c], hi[c]);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 a0 = _mm512_loadu_ps(x + r * K + k), a1 = _mm512_loadu_ps(x + r * K + k + 16);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a1, hi[c], _mm512_fmadd_ps(a0, lo[c], acc[r][c]));
    }
  }
  if (k < K) {
    __m512 b[C];
    for (int64_t c = 0; c < C; ++c) b[c] = fp8x16_to_ps(w[c] + k);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 a = _mm512_loadu_ps(x + r * K + k);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
}

template <typename T, int64_t R>
inline void fp8_rows(const float* x, int64_t K, const uint8_t* w, const float* scale, T* out, int64_t os, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    __m512 acc[R][2];
    for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint8_t* rows[2] = {w + n * K, w + (n + 1) * K};
    fp8_dot<R, 2>(x, K, rows, acc);
    const float s0 = scale[n] * 256.0f, s1 = scale[n + 1] * 256.0f;
    for (int64_t r = 0; r < R; ++r) {
      out[r * os + n] = static_cast<T>(_mm512_reduce_add_ps(acc[r][0]) * s0);
      out[r * os + n + 1] = static_cast<T>(_mm512_reduce_add_ps(acc[r][1]) * s1);
    }
  }
  for (; n < n1; ++n) {  // an odd last channel: the same chain as either channel of a pair
    __m512 acc[R][2];
    for (int64_t r = 0; r < R; ++r) acc[r][0] = _mm512_setzero_ps();
    const uint8_t* rows[1] = {w + n * K};
    fp8_dot<R, 1>(x, K, rows, acc);
    for (int64_t r = 0; r < R; ++r) out[r * os + n] = static_cast<T>(_mm512_reduce_add_ps(acc[r][0]) * (scale[n] * 256.0f));
  }
}

template <typename T>
void fp8_mm_impl(const float* x, const uint8_t* w, const float* scale, T* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    // Channels in blocks whose fp8 rows stay in the cache while each group of up to 8 rows passes.
    for (int64_t n0 = begin; n0 < end; n0 += 16) {
      const int64_t n1 = std::min(end, n0 + 16);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const float* xr = x + m0 * K;
        T* orow = out + m0 * N;
        switch (std::min<int64_t>(8, M - m0)) {
          case 1: fp8_rows<T, 1>(xr, K, w, scale, orow, N, n0, n1); break;
          case 2: fp8_rows<T, 2>(xr, K, w, scale, orow, N, n0, n1); break;
          case 3: fp8_rows<T, 3>(xr, K, w, scale, orow, N, n0, n1); break;
          case 4: fp8_rows<T, 4>(xr, K, w, scale, orow, N, n0, n1); break;
          case 5: fp8_rows<T, 5>(xr, K, w, scale, orow, N, n0, n1); break;
          case 6: fp8_rows<T, 6>(xr, K, w, scale, orow, N, n0, n1); break;
          case 7: fp8_rows<T, 7>(xr, K, w, scale, orow, N, n0, n1); break;
          default: fp8_rows<T, 8>(xr, K, w, scale, orow, N, n0, n1); break;
        }
      }
    }
  });
}
#endif

}  // namespace

bool fp8_mm_supported(int64_t rows, int64_t in_features, at::ScalarType dtype) {
#if defined(__AVX512F__)
  return rows >= 1 && in_features % 16 == 0 && (dtype == at::kBFloat16 || dtype == at::kFloat);
#else
  return false;
#endif
}

at::Tensor fp8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), "x, weight and scale must be on the CPU");
  TORCH_CHECK(x.dim() == 2, "x must be (rows, in_features)");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat8_e4m3fn && weight.size(1) == x.size(1),
              "weight must be a contiguous float8_e4m3fn (out_features, in_features)");
  TORCH_CHECK(scale.dim() == 1 && scale.is_contiguous() && scale.size(0) == weight.size(0) && scale.scalar_type() == at::kFloat,
              "scale must be a contiguous (out_features,) float32 tensor");
  TORCH_CHECK(fp8_mm_supported(x.size(0), x.size(1), x.scalar_type()), "fp8_mm does not serve ", x.size(0), " rows of ", x.size(1), " ",
              x.scalar_type(), " here");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  const at::Tensor rows = x.to(at::kFloat).contiguous();  // bf16 widened exactly, once, not once per channel
  const float* x_ptr = rows.data_ptr<float>();
  const auto* w_ptr = static_cast<const uint8_t*>(weight.data_ptr());
  const float* s_ptr = scale.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    fp8_mm_impl(x_ptr, w_ptr, s_ptr, out.data_ptr<c10::BFloat16>(), M, N, K);
  } else {
    fp8_mm_impl(x_ptr, w_ptr, s_ptr, out.data_ptr<float>(), M, N, K);
  }
#endif
  return out;
}

}  // namespace tandem::cpu
