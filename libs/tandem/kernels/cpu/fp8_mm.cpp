// fp8_mm, an fp8 layer's product for a few rows (AVX512F).
//
// x (M, K) bf16 or float32 @ (w (N, K) float8_e4m3fn * scale (N,) float32).T, reading the fp8
// weight once per group of up to eight rows. The rows are widened to float32 first (exact); 16
// weights at a time are widened as they are loaded: each byte s.eeee.mmm becomes the half-float
// s.0eeee.mmm0000000, whose value is the fp8 value times 2^-8 for normal and subnormal values
// alike (both formats put the exponent's bias where the shift puts it), then F16C widens the 16
// halves to float32, exactly. The 2^8 goes into the row's scale. Float32 products are summed in
// 16 lanes, two channels at a time for up to eight rows; out[m][n] = (sum * scale[n] * 256)
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
// 16 e4m3fn bytes -> their values times 2^-8 as float32 (NaN bytes, which a saturating cast never
// writes, come out as 480 * 2^-8).
inline __m512 fp8x16_to_ps(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
}

template <typename T, int64_t R>
inline void fp8_rows(const float* x, int64_t K, const uint8_t* w, const float* scale, T* out, int64_t os, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    __m512 acc[R][2];
    for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint8_t* w0 = w + n * K;
    const uint8_t* w1 = w0 + K;
    for (int64_t k = 0; k < K; k += 16) {
      if (k % 64 == 0) {  // the next pair of channels, a cache line each per four steps
        __builtin_prefetch(w0 + 2 * K + k);
        __builtin_prefetch(w1 + 2 * K + k);
      }
      const __m512 b0 = fp8x16_to_ps(w0 + k), b1 = fp8x16_to_ps(w1 + k);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 a = _mm512_loadu_ps(x + r * K + k);
        acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      }
    }
    const float s0 = scale[n] * 256.0f, s1 = scale[n + 1] * 256.0f;
    for (int64_t r = 0; r < R; ++r) {
      out[r * os + n] = static_cast<T>(_mm512_reduce_add_ps(acc[r][0]) * s0);
      out[r * os + n + 1] = static_cast<T>(_mm512_reduce_add_ps(acc[r][1]) * s1);
    }
  }
  for (; n < n1; ++n) {  // an odd last channel: the same chain as either channel of a pair
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 b = fp8x16_to_ps(w + n * K + k);
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), b, acc[r]);
    }
    for (int64_t r = 0; r < R; ++r) out[r * os + n] = static_cast<T>(_mm512_reduce_add_ps(acc[r]) * (scale[n] * 256.0f));
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
