// The paged KV cache as the attention ops and write_kv take it: (blocks, block_size, kv_heads,
// head_dim) with unit last stride, on the CPU, in q's dtype or bf16 under float32 q.
#pragma once

#include <ATen/core/Tensor.h>

namespace tandem::cpu {

// A cache holds q's dtype, or bf16 under float32 q (half the bytes to read; float32 arithmetic).
inline bool is_bf16_cache_of_float(const at::Tensor& cache, const at::Tensor& q) {
  return cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kFloat;
}

inline void check_cache(const at::Tensor& cache, const at::Tensor& q, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, name, " must be (blocks, block_size, kv_heads, head_dim) with unit last stride");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type() || is_bf16_cache_of_float(cache, q), name, " dtype must equal q's (or be bf16 under float32)");
}

}  // namespace tandem::cpu
