// RMSNorm (rms_norm), and a residual add with the RMSNorm of its sum (add_rms_norm), with the bits
// of models/layers.RMSNorm and torch's add.

#include "ops.h"
#include "vector.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

namespace tandem::cpu {
namespace {

#if defined(__AVX512BF16__)
// 16 bf16 values widened to float32.
inline __m512 bf16x16_to_float(__m256bh v) { return bf16_bits_to_float(reinterpret_cast<__m256i>(v)); }
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

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU (tokens, hidden) tensor");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a CPU (hidden,) tensor in x's dtype");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] { rms_norm_kernel<scalar_t>(x, weight, eps, out); });
  return out;
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

}  // namespace tandem::cpu
