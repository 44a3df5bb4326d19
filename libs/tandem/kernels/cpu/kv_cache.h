// The paged KV cache as the attention ops and write_kv take it: (blocks, block_size, kv_heads,
// head_dim) with unit last stride, on the CPU, in q's dtype, or bf16 under float32 q, or FP8 e4m3
// under float32 or bf16 q.
#pragma once

#include <ATen/core/Tensor.h>

namespace tandem::cpu {

// A cache holds q's dtype, or bf16 under float32 q (half the bytes to read; float32 arithmetic).
inline bool is_bf16_cache_of_float(const at::Tensor& cache, const at::Tensor& q) {
  return cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kFloat;
}

// An FP8 e4m3 cache under float32 or bf16 q (a quarter or half the bytes; rows widened exactly).
inline bool is_fp8_cache(const at::Tensor& cache, const at::Tensor& q) {
  return cache.scalar_type() == at::kFloat8_e4m3fn && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16);
}

inline void check_cache(const at::Tensor& cache, const at::Tensor& q, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, name, " must be (blocks, block_size, kv_heads, head_dim) with unit last stride");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type() || is_bf16_cache_of_float(cache, q) || is_fp8_cache(cache, q), name,
              " dtype must equal q's (or be bf16 under float32, or float8_e4m3fn under float32 or bf16)");
}

}  // namespace tandem::cpu
