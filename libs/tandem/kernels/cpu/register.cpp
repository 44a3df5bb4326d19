// The kernels' registration as torch.ops.tandem.*: each op's schema (TORCH_LIBRARY) and its CPU
// implementation (TORCH_LIBRARY_IMPL), the functions ops.h declares. Built and loaded by
// cpu_extension.py.

#include "ops.h"

#include <torch/library.h>

using namespace tandem::cpu;

TORCH_LIBRARY(tandem, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, Tensor block_tables, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int seq_len, float scale, int window=0, float softcap=0.0, int kernel=-1) -> Tensor");
  m.def("prefill_amx_supported(int head_dim, ScalarType dtype, ScalarType cache_dtype) -> bool", &prefill_amx_supported);
  m.def("prefill_supported(int head_dim, ScalarType dtype) -> bool", &prefill_supported);  // no tensor: not dispatched by device
  m.def("int8_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("int8_mm_supported(int rows, int in_features, ScalarType dtype) -> bool", &int8_mm_supported);
  m.def("fp8_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("fp8_mm_supported(int rows, int in_features, ScalarType dtype) -> bool", &fp8_mm_supported);
  m.def("packed_mm(Tensor x, Tensor packed, Tensor? scale=None, int kernel=0) -> Tensor");
  m.def("packed_mm_silu(Tensor x, Tensor packed) -> Tensor");
  m.def("packed_mm_amx_supported(int in_features, ScalarType x_dtype) -> bool", &packed_mm_amx_supported);
  m.def("pack_weight(Tensor weight, ScalarType x_dtype) -> Tensor");
  m.def("packed_mm_supported(int out_features, int in_features, ScalarType dtype, ScalarType x_dtype) -> bool", &packed_mm_supported);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor added, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] scales, int[] kernels, Tensor cos, Tensor sin, Tensor kv_cache, Tensor slot_mapping, "
      "Tensor seq_lens, Tensor block_tables, int num_heads, int num_kv_heads, float scale, float eps) -> Tensor");
  m.def("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("int8_mm", &int8_mm);
  m.impl("fp8_mm", &fp8_mm);
  m.impl("packed_mm", &packed_mm);
  m.impl("packed_mm_silu", &packed_mm_silu);
  m.impl("pack_weight", &pack_weight);
  m.impl("write_kv", &write_kv);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("decode_layers", &decode_layers);
  m.impl("rotary_qk", &rotary_qk);
}
