// AVX-512-BF16 decode GEMM: bf16 activations x bf16 weights, float32 sums (vdpbf16ps: per
// column acc += x[2p] * w[2p] + x[2p + 1] * w[2p + 1]). Entered only after the glue's cpuid
// check for AVX-512 F/BW/VL + AVX512_BF16. Two partial sums per row (even and odd pairs) keep
// two dependency chains in flight at M = 1; the order is fixed, whatever M.
#include <immintrin.h>

#include <cstring>

#include "decode_gemm_kernel.h"

namespace pipefill_decode {
namespace avx512bf16 {
namespace {

constexpr int kRows = 12;

inline void store_row(const Out& o, int64_t m, int64_t n0, __m512 v) {
  const int64_t left = o.N - n0;
  const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + n0));
  if (o.y_dtype == kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(o.y) + m * o.ldy + n0, mask, v);
    return;
  }
  // Integer rounding (not vcvtneps2bf16, which flushes denormals): same bits as the other ISAs.
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.y) + m * o.ldy + n0, mask, _mm512_cvtepi32_epi16(r));
}

inline __m512bh pair_of(const uint16_t* x) {
  uint32_t bits;
  std::memcpy(&bits, x, 4);
  return (__m512bh)_mm512_set1_epi32((int)bits);
}

template <int MR>
inline void tile(const uint16_t* x, int64_t ldx, const uint32_t* blk, int64_t K, const Out& o,
                 int64_t m0, int64_t n0) {
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t p = 0;
  for (; p + 1 < pairs; p += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + (p + 16) * 16), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(blk + p * 16);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(blk + (p + 1) * 16);
    for (int r = 0; r < MR; ++r) {
      const uint16_t* xr = x + r * ldx + 2 * p;
      a0[r] = _mm512_dpbf16_ps(a0[r], pair_of(xr), w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], pair_of(xr + 2), w1);
    }
  }
  if (p < pairs) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(blk + p * 16);
    for (int r = 0; r < MR; ++r) a0[r] = _mm512_dpbf16_ps(a0[r], pair_of(x + r * ldx + 2 * p), w0);
  }
  for (int r = 0; r < MR; ++r) store_row(o, m0 + r, n0, _mm512_add_ps(a0[r], a1[r]));
}

}  // namespace

void gemm_blocks(const uint16_t* x, int64_t ldx, const void* wp, int64_t M, int64_t K,
                 const Out& o, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint32_t* blk = static_cast<const uint32_t*>(wp) + b * (K / 2) * 16;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const uint16_t* xt = x + m0 * ldx;
      switch (M - m0 >= kRows ? kRows : M - m0) {
#define PF_TILE(R) case R: tile<R>(xt, ldx, blk, K, o, m0, b * 16); break;
        PF_TILE(1) PF_TILE(2) PF_TILE(3) PF_TILE(4) PF_TILE(5) PF_TILE(6)
        PF_TILE(7) PF_TILE(8) PF_TILE(9) PF_TILE(10) PF_TILE(11) PF_TILE(12)
#undef PF_TILE
      }
    }
  }
}

}  // namespace avx512bf16
}  // namespace pipefill_decode
