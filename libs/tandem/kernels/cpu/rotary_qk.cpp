// The split and rotation of q and k (rotary_qk) from a fused qkv projection's output, with
// models/rotary.apply_rotary's bits.

#include "ops.h"
#include "vector.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace tandem::cpu {
namespace {

// q and k of a fused qkv projection's output (tokens, (heads + 2 kv_heads) * head_dim), rotated
// as models/rotary.apply_rotary does ("rotate_half": dimension i pairs with i + head_dim/2, in
// float32, rounded to the dtype; bit for bit apply_rotary's), each returned contiguous: (tokens,
// heads, head_dim) and (tokens, kv_heads, head_dim). cos and sin: (tokens, 1, head_dim/2) float32.
// Products rounded before the sum (no fused multiply-add), as torch's elementwise ops compute them.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_pairs(const float* first, const float* second, const float* c, const float* s, T* dst,
                                                                int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    dst[i] = static_cast<T>(first[i] * c[i] - second[i] * s[i]);
    dst[half + i] = static_cast<T>(second[i] * c[i] + first[i] * s[i]);
  }
}

template <typename T>
void rotary_kernel(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q, at::Tensor& k) {
  const int64_t tokens = qkv.size(0), num_heads = q.size(1), num_kv_heads = k.size(1), head_dim = q.size(2), half = head_dim / 2;
  const T* src = qkv.data_ptr<T>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  T* q_ptr = q.data_ptr<T>();
  T* k_ptr = k.data_ptr<T>();
  const int64_t src_stride = qkv.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> first(half), second(half);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + t * cos_stride;
      const float* s = sin_ptr + t * sin_stride;
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
        const T* in = src + t * src_stride + head * head_dim;
        T* dst = head < num_heads ? q_ptr + (t * num_heads + head) * head_dim : k_ptr + (t * num_kv_heads + head - num_heads) * head_dim;
        to_float(in, first.data(), half);
        to_float(in + half, second.data(), half);
        rotate_pairs(first.data(), second.data(), c, s, dst, half);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                             int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be a CPU (tokens, width) tensor with unit last stride");
  const int64_t head_dim = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  TORCH_CHECK(head_dim % 2 == 0 && head_dim * (num_heads + 2 * num_kv_heads) == qkv.size(1), "qkv's width must be (heads + 2 kv_heads) * even head_dim");
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == at::kFloat && table->dim() == 3 && table->size(0) == qkv.size(0) && table->size(1) == 1 &&
                    table->size(2) == head_dim / 2 && table->stride(2) == 1,
                "cos and sin must be CPU float32 (tokens, 1, head_dim/2) with unit last stride");
  at::Tensor q = at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({qkv.size(0), num_kv_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_qk", [&] { rotary_kernel<scalar_t>(qkv, cos, sin, q, k); });
  return {q, k};
}

}  // namespace tandem::cpu
