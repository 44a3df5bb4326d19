// Greedy sampling's argmax (argmax_rows).
//
// Each row's index of its largest value: the first of equal ones, or the first NaN where there is
// one, as torch.argmax answers; int64 (rows,). Float32 or bf16 rows, sixteen lanes at a time, each
// lane keeping the first index of its largest value, then the lowest index among the lanes that
// hold the row's largest (several times faster than torch's own reduction over a batch's logits
// across SmolLM2's whole vocabulary).

#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tandem::cpu {
namespace {

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

template <typename T>
int64_t row_argmax(const T* row, int64_t len) {
  constexpr int64_t kChains = 4;  // independent maxima in flight, each a lane's chain of compares
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best[kChains];
  __m512i best_index[kChains], index[kChains];
  for (int64_t c = 0; c < kChains; ++c) {
    // -inf at the lane's first index: a lane whose values are all -inf answers its first (and one
    // past the row's end is never below a real index holding the same)
    best[c] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    best_index[c] = index[c] = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(16 * c)));
  }
  const __m512i step = _mm512_set1_epi32(16 * kChains);
  __mmask16 nan_seen = 0;
  int64_t i = 0;
  for (; i + 16 * kChains <= len; i += 16 * kChains) {
    for (int64_t c = 0; c < kChains; ++c) {
      const __m512 v = load16(row + i + 16 * c, 0xFFFF);
      nan_seen |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, best[c], _CMP_GT_OQ);  // strictly: the first of equals stays
      best[c] = _mm512_mask_mov_ps(best[c], larger, v);
      best_index[c] = _mm512_mask_mov_epi32(best_index[c], larger, index[c]);
      index[c] = _mm512_add_epi32(index[c], step);
    }
  }
  for (int64_t c = 0; i < len; i += 16, c = (c + 1) % kChains) {  // the tail, a vector at a time in chain order
    const __mmask16 present = len - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - i)) - 1);
    const __m512 v = load16(row + i, present);
    nan_seen |= _mm512_mask_cmp_ps_mask(present, v, v, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_mask_cmp_ps_mask(present, v, best[c], _CMP_GT_OQ);
    best[c] = _mm512_mask_mov_ps(best[c], larger, v);
    best_index[c] = _mm512_mask_mov_epi32(best_index[c], larger, index[c]);
    index[c] = _mm512_add_epi32(index[c], step);
  }
  if (nan_seen != 0) {
    for (int64_t j = 0; j < len; ++j)
      if (std::isnan(static_cast<float>(row[j]))) return j;
  }
  __m512 top = best[0];
  for (int64_t c = 1; c < kChains; ++c) top = _mm512_max_ps(top, best[c]);
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512i first = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  for (int64_t c = 0; c < kChains; ++c)
    first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(best[c], peak, _CMP_EQ_OQ), first, best_index[c]);
  return _mm512_reduce_min_epi32(first);
}
#endif

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.size(1) > 0, "logits must be a CPU (rows, vocab) tensor with a vocab");
#if defined(__AVX512F__)
  const at::ScalarType dtype = logits.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && logits.stride(1) == 1 && logits.size(1) < (int64_t{1} << 31)) {
    const int64_t rows = logits.size(0), len = logits.size(1), stride = logits.stride(0);
    at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
    int64_t* o = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        o[r] = dtype == at::kFloat ? row_argmax(logits.data_ptr<float>() + r * stride, len)
                                   : row_argmax(logits.data_ptr<c10::BFloat16>() + r * stride, len);
    });
    return out;
  }
#endif
  return at::argmax(logits, 1);
}

}  // namespace tandem::cpu
