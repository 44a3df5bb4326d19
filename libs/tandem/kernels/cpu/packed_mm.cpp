// packed_mm: a bf16 or float32 layer's product for any number of rows, its weight (bf16, float32
// or int8) packed once by pack_weight into packed_mm.h's layout, the product itself
// packed_mm_bf16.cpp's or packed_mm_float.cpp's; packed_mm_supported says where it serves.

#include "ops.h"
#include "packed_mm.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>

#include <cstdint>
#include <optional>

namespace tandem::cpu {

// Whether packed_mm serves a weight of this shape and type for rows of x_dtype here: bf16 rows
// (AVX512-BF16) with bf16 weights, K even, or int8 ones, K a multiple of 4; float32 rows (AVX2
// and FMA) with float32 or int8 weights; N a multiple of 16 either way.
bool packed_mm_supported(int64_t out_features, int64_t in_features, at::ScalarType dtype, at::ScalarType x_dtype) {
  if (out_features <= 0 || out_features % kPackedGroup != 0 || in_features <= 0) return false;
#if defined(__AVX512BF16__)
  if (x_dtype == at::kBFloat16 && dtype == at::kBFloat16 && in_features % 2 == 0) return true;
  if (x_dtype == at::kBFloat16 && dtype == at::kChar && in_features % 4 == 0) return true;  // pairs of pairs (int8_rows_to_bf16)
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (x_dtype == at::kFloat && (dtype == at::kFloat || dtype == at::kChar)) return true;
#endif
  return false;
}

// (N, K) weight -> packed_mm's layout for rows of x_dtype, of the weight's type: for bf16 rows
// (N / 16, K / 2, 32), pairs of inputs side by side; for float32 rows (N / 16, K, 16).
at::Tensor pack_weight(const at::Tensor& weight, at::ScalarType x_dtype) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "weight must be a CPU (out_features, in_features) tensor");
  TORCH_CHECK(packed_mm_supported(weight.size(0), weight.size(1), weight.scalar_type(), x_dtype), "pack_weight does not serve a ",
              weight.size(0), "x", weight.size(1), " ", weight.scalar_type(), " weight for ", x_dtype, " rows here");
  const int64_t N = weight.size(0), K = weight.size(1);
  if (x_dtype == at::kFloat) return weight.reshape({N / kPackedGroup, kPackedGroup, K}).permute({0, 2, 1}).contiguous();
  const at::Tensor pairs = weight.reshape({N / kPackedGroup, kPackedGroup, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  if (weight.scalar_type() == at::kChar)
    TORCH_CHECK(weight.min().item<int8_t>() > -128, "an int8 weight for bf16 rows must lie in -127..127 (exact in bf16's 8 bits)");
  if (weight.scalar_type() != at::kChar || !kInt8SignMagnitude) return pairs.reshape({N / kPackedGroup, K / 2, 2 * kPackedGroup});
  // int8_rows_to_bf16's packing: sign and magnitude, two packed rows in alternate 8-byte chunks
  const at::Tensor chunked = pairs.reshape({N / kPackedGroup, K / 4, 2, 4, 8}).permute({0, 1, 3, 2, 4}).contiguous();
  const at::Tensor magnitude = chunked.abs();
  return at::where(chunked < 0, magnitude.bitwise_or(-128), magnitude).reshape({N / kPackedGroup, K / 2, 2 * kPackedGroup});
}

bool packed_mm_amx_supported(int64_t in_features, at::ScalarType x_dtype) {
#if defined(TANDEM_AMX)
  return x_dtype == at::kBFloat16 && amx_supported(in_features);
#else
  return false;
#endif
}

at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& scale, int64_t kernel) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and the packed weight must be on the CPU");
  const auto x_dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x_dtype == at::kBFloat16 || x_dtype == at::kFloat),
              "x must be bf16 or float32 (rows, in_features) with unit last stride");
  const bool is_int8 = packed.scalar_type() == at::kChar;
  const bool floats = x_dtype == at::kFloat;
  const int64_t per_row = floats ? 1 : 2;  // inputs a packed row holds per channel
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && (is_int8 || packed.scalar_type() == x_dtype) &&
                  packed.size(2) == per_row * kPackedGroup && packed.size(1) * per_row == x.size(1),
              "the weight must be pack_weight's for ", x_dtype, " rows: (out_features / 16, in_features",
              floats ? ", 16)" : " / 2, 32)");
  const int64_t N = packed.size(0) * kPackedGroup;
  TORCH_CHECK(packed_mm_supported(N, x.size(1), packed.scalar_type(), x_dtype), "packed_mm does not serve ", x_dtype, " rows with a ",
              packed.scalar_type(), " weight here");
  TORCH_CHECK(is_int8 == scale.has_value(), "an int8 weight takes a scale per channel, a ", x_dtype, " one none");
  if (is_int8)
    TORCH_CHECK(scale->device().is_cpu() && scale->dim() == 1 && scale->is_contiguous() && scale->size(0) == N && scale->scalar_type() == x_dtype,
                "scale must be a contiguous ", x_dtype, " CPU (out_features,) tensor");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
#if defined(__AVX2__) && defined(__FMA__)
  if (floats) {
    float_packed_kernel(x, packed, is_int8 ? scale->data_ptr<float>() : nullptr, out);
    return out;
  }
#endif
  TORCH_CHECK(kernel == kPackedAvx512 || (kernel == kPackedAmx && packed_mm_amx_supported(x.size(1), x_dtype)),
              "packed_mm has no kernel ", kernel, " for these rows here");
#if defined(TANDEM_AMX)
  if (kernel == kPackedAmx) {
    amx_packed_kernel(x, packed, is_int8 ? scale->data_ptr<c10::BFloat16>() : nullptr, out);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  packed_kernel(x, packed, is_int8 ? scale->data_ptr<c10::BFloat16>() : nullptr, out);
#endif
  return out;
}

at::Tensor packed_mm_silu(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and the packed weight must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be bf16 (rows, in_features) with unit last stride");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 2 * kPackedGroup &&
                  packed.size(1) * 2 == x.size(1) && packed.size(0) % 2 == 0,
              "the weight must be pack_weight's of a bf16 gate/up projection: (2 intermediate / 16, in_features / 2, 32), intermediate a multiple of 16");
  TORCH_CHECK(packed_mm_amx_supported(x.size(1), x.scalar_type()), "packed_mm_silu takes AMX tiles, which do not serve these rows here");
  at::Tensor out = at::empty({x.size(0), packed.size(0) / 2 * kPackedGroup}, x.options());
#if defined(TANDEM_AMX)
  if (x.size(0) > 0) amx_silu_kernel(x, packed, out);
#endif
  return out;
}

}  // namespace tandem::cpu
