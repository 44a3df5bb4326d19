// packed_mm's packed weights and its two kernels, one for bf16 rows (packed_mm_bf16.cpp) and one
// for float32 rows (packed_mm_float.cpp): a weight's channels in groups of kPackedGroup, each
// group's weights side by side per input (float32 rows) or pair of inputs (bf16 rows), a task's
// tile kTileGroups groups wide. pack_weight (packed_mm.cpp) writes them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace tandem::cpu {

constexpr int64_t kPackedGroup = 16;  // channels a packed group holds (one float32 vector of sums)
constexpr int64_t kTileGroups = 3;
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
constexpr bool kInt8SignMagnitude = true;  // int8 weights for bf16 rows packed as int8_rows_to_bf16 reads them
#else
constexpr bool kInt8SignMagnitude = false;
#endif

#if defined(__AVX512BF16__)
// out = x (M, K) bf16 @ the packed bf16 or int8 weight's W.T (scale: an int8 weight's, else null).
void packed_kernel(const at::Tensor& x, const at::Tensor& packed, const c10::BFloat16* scale, at::Tensor& out);
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TANDEM_AMX 1
// Whether the AMX kernel serves a weight of K inputs here (K a multiple of 32, the tiles granted).
bool amx_supported(int64_t in_features);
// packed_kernel's product on AMX tiles: the same bits.
void amx_packed_kernel(const at::Tensor& x, const at::Tensor& packed, const c10::BFloat16* scale, at::Tensor& out);
// out (M, I) = silu(gate) * up of the packed bf16 (2 I, K) gate/up weight's product (packed_mm_silu).
void amx_silu_kernel(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
// out = x (M, K) float32 @ the packed float32 or int8 weight's W.T (scale: an int8 weight's, else null).
void float_packed_kernel(const at::Tensor& x, const at::Tensor& packed, const float* scale, at::Tensor& out);
#endif

}  // namespace tandem::cpu
