// An MLP's SiLU and product (silu_mul): silu(gate) * up with torch's bits, in one call.

#include "ops.h"
#include "silu.h"
#include "vector.h"

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>


namespace tandem::cpu {
namespace {

#if defined(__AVX512F__)
// out = silu(gate) * up, 16 columns a time, as torch computes F.silu(gate) * up with its AVX-512
// kernels (silu.h): the SiLU in float32 rounded to T, then the product in float32 rounded to T.
template <typename T>
void silu_mul_kernel(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1), in_stride = gate_up.stride(0);
  const T* in_ptr = gate_up.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  // torch's grain: below 32,768 elements one thread (a decode step's few rows)
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in_ptr + r * in_stride;
      const T* up = gate + width;
      T* dst = out_ptr + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), silu_mul_bf16x16(load16(gate + i), load16(up + i)));
        else
          _mm512_storeu_ps(dst + i, _mm512_mul_ps(silu16(load16(gate + i)), load16(up + i)));
      }
    }
  });
}
#endif

}  // namespace

// silu(gate) * up for gate_up (tokens, 2 intermediate) = [gate | up] per row (an MLP's fused
// projection), torch's F.silu(gate) * up bit for bit in one call without its two launches and the
// SiLU's intermediate tensor. The kernel serves float32 and bf16 rows whose halves are a multiple
// of 64 wide (where torch's vectorized loops take every element, none its scalar tail) with
// AVX-512; anything else takes the torch ops themselves.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be a CPU (tokens, 2 * intermediate) tensor");
  const int64_t width = gate_up.size(1) / 2;
#if defined(__AVX512F__)
  const at::ScalarType dtype = gate_up.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && width > 0 && width % 64 == 0 && gate_up.stride(1) == 1) {
    at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
    if (dtype == at::kFloat)
      silu_mul_kernel<float>(gate_up, out);
    else
      silu_mul_kernel<c10::BFloat16>(gate_up, out);
    return out;
  }
#endif
  return at::mul(at::silu(gate_up.slice(1, 0, width)), gate_up.slice(1, width));
}

}  // namespace tandem::cpu
