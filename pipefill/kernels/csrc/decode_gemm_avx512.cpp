// AVX-512F decode GEMM, float32 compute, float32 or bf16 weights (bf16 -> float32 in registers:
// a 16-bit shift for the even k of a pair, a mask for the odd k). The only code here runs after
// the glue's cpuid/XCR0 check for AVX-512 F/BW/VL. Layouts and the fixed per-row order: see
// decode_gemm_kernel.h. Explicit FMAs only (no -ffast-math), so the order is what is written.
#include <immintrin.h>

#include "decode_gemm_kernel.h"

namespace pipefill_decode {
namespace avx512 {
namespace {

constexpr int kRows = 12;  // rows per tile: 24 accumulators + weights + a broadcast < 32 zmm

inline void store_row(const Out& o, int64_t m, int64_t n0, __m512 v) {
  const int64_t left = o.N - n0;
  const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + n0));
  if (o.y_dtype == kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(o.y) + m * o.ldy + n0, mask, v);
    return;
  }
  // Round to nearest even, NaN -> quiet NaN, as c10::BFloat16 does.
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.y) + m * o.ldy + n0, mask, _mm512_cvtepi32_epi16(r));
}

// Weights of k = 2p (even) and 2p + 1 (odd) for the 16 columns of a block.
template <bool BF16>
inline void load_pair(const void* blk, int64_t p, __m512& we, __m512& wo) {
  if (BF16) {
    const __m512i v = _mm512_loadu_si512(static_cast<const uint32_t*>(blk) + p * 16);
    we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    wo = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
  } else {
    const float* w = static_cast<const float*>(blk) + p * 32;
    we = _mm512_loadu_ps(w);
    wo = _mm512_loadu_ps(w + 16);
  }
}

template <int MR, bool BF16>
inline void tile(const float* x, int64_t ldx, const void* blk, int64_t K, const Out& o, int64_t m0,
                 int64_t n0) {
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  const char* pf = static_cast<const char*>(blk);
  const int64_t pair_bytes = BF16 ? 64 : 128;
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(pf + (p + 16) * pair_bytes, _MM_HINT_T0);
    __m512 we, wo;
    load_pair<BF16>(blk, p, we, wo);
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * ldx + 2 * p;
      a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), we, a0[r]);
      a1[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), wo, a1[r]);
    }
  }
  if (K & 1) {  // the last k has no partner (its padded partner weight is zero)
    __m512 we, wo;
    load_pair<BF16>(blk, pairs, we, wo);
    for (int r = 0; r < MR; ++r) a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + K - 1]), we, a0[r]);
  }
  for (int r = 0; r < MR; ++r) store_row(o, m0 + r, n0, _mm512_add_ps(a0[r], a1[r]));
}

template <bool BF16>
void run(const float* x, int64_t ldx, const void* wp, int64_t M, int64_t K, const Out& o, int64_t b0,
         int64_t b1) {
  const int64_t kp = K + (K & 1);
  const int64_t elem = BF16 ? 2 : 4;
  for (int64_t b = b0; b < b1; ++b) {
    const void* blk = static_cast<const char*>(wp) + b * kp * 16 * elem;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const float* xt = x + m0 * ldx;
      switch (M - m0 >= kRows ? kRows : M - m0) {
#define PF_TILE(R) case R: tile<R, BF16>(xt, ldx, blk, K, o, m0, b * 16); break;
        PF_TILE(1) PF_TILE(2) PF_TILE(3) PF_TILE(4) PF_TILE(5) PF_TILE(6)
        PF_TILE(7) PF_TILE(8) PF_TILE(9) PF_TILE(10) PF_TILE(11) PF_TILE(12)
#undef PF_TILE
      }
    }
  }
}

}  // namespace

void gemm_blocks(const float* x, int64_t ldx, const void* wp, int w_dtype, int64_t M, int64_t K,
                 const Out& out, int64_t b0, int64_t b1) {
  if (w_dtype == kBF16) run<true>(x, ldx, wp, M, K, out, b0, b1);
  else run<false>(x, ldx, wp, M, K, out, b0, b1);
}

}  // namespace avx512
}  // namespace pipefill_decode
