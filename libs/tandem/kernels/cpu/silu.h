// An MLP's SiLU and product on sixteen lanes as torch computes F.silu(gate) * up for bf16 rows with
// its AVX-512 kernels: gate / (1 + e^-gate) in float32 with SLEEF's e^x (the one torch's
// vectorized silu calls), rounded to bf16, then the product with up in float32 rounded to bf16.
// silu_mul.cpp's op and packed_mm's fused gate/up product (packed_mm_silu) share it, so the two
// give the same bits.
#pragma once

#include "vector.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>

namespace tandem::cpu {

// silu(gate) in float32, before any rounding to the rows' dtype.
inline __m512 silu16(__m512 gate) {
  return _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_expf16_u10(_mm512_xor_ps(gate, _mm512_set1_ps(-0.f)))));
}

// silu(gate) * up for bf16 rows (gate and up their values widened to float32): sixteen bf16 results.
inline __m256i silu_mul_bf16x16(__m512 gate, __m512 up) {
  return float_to_bf16(_mm512_mul_ps(bf16_bits_to_float(float_to_bf16(silu16(gate))), up));
}

}  // namespace tandem::cpu
#endif
