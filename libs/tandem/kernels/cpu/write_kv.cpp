// The KV write of a step's new tokens (write_kv): each token's k and v rows into its slot of the
// paged cache: copied, rounded to bf16 (a bf16 cache under float32), or saturated to +-448 and
// rounded to FP8 e4m3 (an FP8 cache).

#include "kv_cache.h"
#include "ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <cstring>

namespace tandem::cpu {
namespace {

// e4m3's largest finite value: a plain conversion makes anything past it NaN.
constexpr float kFp8Max = 448.f;

// x saturated to +-448 and rounded to e4m3 (to nearest even), as attention_reference.write_kv's
// clamp and torch's .to(); a NaN stays NaN (neither comparison holds).
inline c10::Float8_e4m3fn to_fp8(float x) { return c10::Float8_e4m3fn(x > kFp8Max ? kFp8Max : (x < -kFp8Max ? -kFp8Max : x)); }

}  // namespace

// k_cache[slot / block_size, slot % block_size] = k[token] for each new token's slot, and v alike.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache(k_cache, k, "k_cache");
  check_cache(v_cache, v, "v_cache");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k and v must be (tokens, kv_heads, head_dim) of the cache's heads");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && slot_mapping.device().is_cpu(), "k, v and slot_mapping must be on the CPU");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == k.size(0),
              "slot_mapping: int64, one per token");
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t token = 0; token < k.size(0); ++token)
    TORCH_CHECK(slots[token] >= 0 && slots[token] < num_slots, "slot ", slots[token], " outside the cache's ", num_slots);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must have unit last stride");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "k and v, and the caches, must share a dtype");
  const int64_t num_kv_heads = k.size(1), row_bytes = k.size(2) * k.element_size();
  if (is_fp8_cache(k_cache, k)) {
    auto round_rows = [&](const at::Tensor& src, at::Tensor& cache, auto source_type) {
      using S = decltype(source_type);
      const S* from = src.data_ptr<S>();
      c10::Float8_e4m3fn* to = cache.data_ptr<c10::Float8_e4m3fn>();
      for (int64_t token = 0; token < src.size(0); ++token) {
        const int64_t block = slots[token] / block_size, offset = slots[token] % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const S* row = from + token * src.stride(0) + h * src.stride(1);
          c10::Float8_e4m3fn* dst = to + block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2);
          for (int64_t d = 0; d < src.size(2); ++d) dst[d] = to_fp8(static_cast<float>(row[d]));
        }
      }
    };
    if (k.scalar_type() == at::kFloat) {
      round_rows(k, k_cache, float{});
      round_rows(v, v_cache, float{});
    } else {
      round_rows(k, k_cache, c10::BFloat16{});
      round_rows(v, v_cache, c10::BFloat16{});
    }
    return;
  }
  if (is_bf16_cache_of_float(k_cache, k)) {  // each value rounded to bf16 (to nearest even, as torch's .to())
    auto round_rows = [&](const at::Tensor& src, at::Tensor& cache) {
      const float* from = src.data_ptr<float>();
      c10::BFloat16* to = cache.data_ptr<c10::BFloat16>();
      for (int64_t token = 0; token < src.size(0); ++token) {
        const int64_t block = slots[token] / block_size, offset = slots[token] % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const float* row = from + token * src.stride(0) + h * src.stride(1);
          c10::BFloat16* dst = to + block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2);
          for (int64_t d = 0; d < src.size(2); ++d) dst[d] = c10::BFloat16(row[d]);
        }
      }
    };
    round_rows(k, k_cache);
    round_rows(v, v_cache);
    return;
  }
  auto copy_rows = [&](const at::Tensor& src, at::Tensor& cache) {
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(cache.data_ptr());
    const int64_t item = src.element_size();
    for (int64_t token = 0; token < src.size(0); ++token) {
      const int64_t block = slots[token] / block_size, offset = slots[token] % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        std::memcpy(to + (block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2)) * item,
                    from + (token * src.stride(0) + h * src.stride(1)) * item, row_bytes);
    }
  };
  copy_rows(k, k_cache);
  copy_rows(v, v_cache);
}

}  // namespace tandem::cpu
