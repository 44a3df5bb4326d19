// A decode step's decoder layers in one C++ call (decode_layers), op by op through the others.

#include "ops.h"

#include <ATen/ops/add.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace tandem::cpu {

// A decode step's decoder layers in one call: what models/llama.LlamaModel runs for a step whose
// every sequence has one new token, on a CPU with these kernels and every projection packed, op
// for op in the same order (the same kernels, silu_mul and add_rms_norm among them), so every
// output has the Python path's bits; without Python between ops (a visible share of a SmolLM2
// batch-1 step's layer). weights: per layer its input norm's weight, packed qkv, packed o, post-
// attention norm's weight, packed gate_up and packed down; scales: per layer the four
// projections' int8 scales (or none); kernels: per layer the four projections' packed_mm kernels.
// Returns the hidden state before the final norm.
at::Tensor decode_layers(const at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
                         at::IntArrayRef kernels, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  constexpr int64_t kWeights = 6, kScales = 4;
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeights;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeights && static_cast<int64_t>(scales.size()) == layers * kScales &&
                  static_cast<int64_t>(kernels.size()) == layers * kScales,
              "decode_layers takes 6 weights, 4 scales and 4 kernels a layer");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be (tokens, hidden_size)");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == layers && kv_cache.size(2) == 2,
              "kv_cache must be (blocks, layers, 2, block_size, kv_heads, head_dim) with one layer per 6 weights");
  const int64_t tokens = hidden.size(0), head_dim = kv_cache.size(5);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::Tensor k_caches = kv_cache.select(2, 0), v_caches = kv_cache.select(2, 1);
  at::Tensor h = hidden, normed = layers > 0 ? rms_norm(hidden, weights[0], eps) : hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeights;
    const auto scale_of = [&](int64_t i) { return scales.get(l * kScales + i); };
    const int64_t* kernel = kernels.data() + l * kScales;
    const at::Tensor qkv = packed_mm(normed, w[1], scale_of(0), kernel[0]);
    auto [q, k] = rotary_qk(qkv, cos, sin, num_heads, num_kv_heads);
    const at::Tensor v = qkv.slice(1, q_size + kv_size).view({-1, num_kv_heads, head_dim});
    at::Tensor k_cache = k_caches.select(1, l), v_cache = v_caches.select(1, l);
    write_kv(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attended = paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, 0, 0.0);
    std::tie(h, normed) = add_rms_norm(h, packed_mm(attended.reshape({tokens, q_size}), w[2], scale_of(1), kernel[1]), w[3], eps);
    // (on AMX tiles with a bf16 weight, the SiLU and product in the same pass: the same bits)
    const bool fused = kernel[2] == kPackedAmx && !scale_of(2).has_value() && w[4].scalar_type() == at::kBFloat16;
    const at::Tensor act = fused ? packed_mm_silu(normed, w[4]) : silu_mul(packed_mm(normed, w[4], scale_of(2), kernel[2]));
    const at::Tensor down = packed_mm(act, w[5], scale_of(3), kernel[3]);
    if (l + 1 < layers)
      std::tie(h, normed) = add_rms_norm(h, down, weights[(l + 1) * kWeights], eps);  // the next layer's input norm
    else
      h = at::add(h, down);
  }
  return h;
}

}  // namespace tandem::cpu
