// The row store shared by the AVX-512 decode-GEMM paths (decode_gemm_{avx512,avx512bf16,amx}.cpp,
// each built with AVX-512 F/BW/VL flags; never included by the glue or the AVX2 path): 16 sums
// of row m from column n0 on, plus bias, as float32 or as bf16 rounded to nearest even by
// integer code (NaN -> 0x7FC0, as c10::BFloat16 does; not vcvtneps2bf16, which flushes
// denormals), so every ISA stores the same bits for the same sums.
#pragma once
#include <immintrin.h>

#include "decode_gemm_kernel.h"

namespace pipefill_decode {
namespace {

inline void store_row(const Out& o, int64_t m, int64_t n0, __m512 v) {
  const int64_t left = o.N - n0;
  const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + n0));
  if (o.y_dtype == kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(o.y) + m * o.ldy + n0, mask, v);
    return;
  }
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.y) + m * o.ldy + n0, mask, _mm512_cvtepi32_epi16(r));
}

}  // namespace
}  // namespace pipefill_decode
