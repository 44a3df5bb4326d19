// The ops of the C++ CPU kernels, registered as torch.ops.tandem.* by register.cpp and defined in
// the file named above each. Every op's arithmetic for a row is in a fixed order whatever the
// batch, so a row gets the same bits alone or in any company.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace tandem::cpu {

// decode_attention.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seq_lens,
                        const at::Tensor& block_tables, double scale, int64_t window, double softcap);

// prefill_attention.cpp
bool prefill_supported(int64_t head_dim, at::ScalarType dtype);
// kernel: kPrefillVector (the vector units), kPrefillAmx (bf16 queries over a bf16 cache on AMX
// tiles, where prefill_amx_supported) or kPrefillDefault (AMX where it serves). Either kernel
// gives a row the same bits however its prompt is chunked; the two kernels' bits differ.
constexpr int64_t kPrefillDefault = -1, kPrefillVector = 0, kPrefillAmx = 1;
bool prefill_amx_supported(int64_t head_dim, at::ScalarType dtype, at::ScalarType cache_dtype);
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table, int64_t seq_len,
                         double scale, int64_t window, double softcap, int64_t kernel);
// prefill_attention_amx.cpp: paged_prefill's AMX kernel, for HD 64, 96, 128 and 256, bf16 q into
// out (q's shape), over bf16 caches; scale > 0
template <int64_t HD>
void prefill_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* table, int64_t seq_len, double scale,
                 int64_t window, float softcap, at::Tensor& out);

// write_kv.cpp
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping);

// rms_norm.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& added, const at::Tensor& weight, double eps);

// rotary_qk.cpp
std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                             int64_t num_kv_heads);

// silu_mul.cpp
at::Tensor silu_mul(const at::Tensor& gate_up);

// int8_mm.cpp
bool int8_mm_supported(int64_t rows, int64_t in_features, at::ScalarType dtype);
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale);

// fp8_mm.cpp
bool fp8_mm_supported(int64_t rows, int64_t in_features, at::ScalarType dtype);
at::Tensor fp8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale);

// packed_mm.cpp
bool packed_mm_supported(int64_t out_features, int64_t in_features, at::ScalarType dtype, at::ScalarType x_dtype);
at::Tensor pack_weight(const at::Tensor& weight, at::ScalarType x_dtype);
// kernel: kPackedAvx512 (bf16 rows: AVX512-BF16 dot products; float32 rows: AVX2) or kPackedAmx
// (bf16 rows on AMX tiles, where packed_mm_amx_supported): the same bits for every row either way.
constexpr int64_t kPackedAvx512 = 0, kPackedAmx = 1;
bool packed_mm_amx_supported(int64_t in_features, at::ScalarType x_dtype);
at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& scale, int64_t kernel = kPackedAvx512);
// silu(gate) * up of x times a bf16 gate/up weight (packed_mm's layout, gate's channels first) on
// AMX tiles, in one pass: silu_mul(packed_mm(x, packed, None, kPackedAmx))'s bits.
at::Tensor packed_mm_silu(const at::Tensor& x, const at::Tensor& packed);

// argmax_rows.cpp
at::Tensor argmax_rows(const at::Tensor& logits);

// decode_layers.cpp
at::Tensor decode_layers(const at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
                         at::IntArrayRef kernels, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, int64_t num_heads, int64_t num_kv_heads, double scale, double eps);

}  // namespace tandem::cpu
