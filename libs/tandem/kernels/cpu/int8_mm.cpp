// int8_mm, an int8 layer's product for a decode step's few rows (AVX512-BF16).
//
// x (M, K) bf16 @ (w8 (N, K) int8 * scale (N,)).T for the few rows of a decode step, reading the
// int8 weight once: 32 weights widened to bf16 (exact: |w| <= 127) and multiplied with 32 of
// each row's values by AVX512-BF16 dot products into float32 lanes, two channels at a time for up
// to eight rows. out[m][n] = bf16(sum * scale[n]), the sum in an order fixed by K alone: a row's
// bits do not depend on the other rows, their number, or the threads.

#include "ops.h"
#include "vector.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

namespace tandem::cpu {
namespace {

#if defined(__AVX512BF16__)
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

}  // namespace

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

}  // namespace tandem::cpu
