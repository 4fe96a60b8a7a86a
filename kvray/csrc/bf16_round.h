// Rounding 16 floats to bfloat16 as torch (c10::BFloat16) rounds, shared by the kernels that
// must give torch's bits (include where the compiler targets AVX-512).
#pragma once

#include <immintrin.h>

namespace kvray_bf16 {

// The bits of v rounded to bfloat16 precision (the bfloat16 is the high half of each lane):
// round to nearest even, denormals kept, as c10::BFloat16 does. VCVTNEPS2BF16 would be one
// instruction, but it flushes denormals to zero. NaN needs no special case here: every NaN
// these kernels round comes from a bfloat16 input or is the default NaN of an invalid
// operation, so its low 16 bits are zero, the bias cannot carry out of them, and it stays NaN.
inline __m512i rne_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
}

// v as 16 bfloat16s, rounded as rne_bits rounds.
inline __m256i to_bf16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rne_bits(v), 16));
}

}  // namespace kvray_bf16
