// AVX-512 quantized decode GEMM: a block's 32 weights are widened to two zmm of float32 in
// registers (nibbles or int8 -> int32 -> float32, then the block's scale and offset, the
// bits of ggml's dequantization) and used for up to 8 rows at once, two accumulators per row (elements 0..15 and
// 16..31 of every block), reduced at the end. Entered only after the glue's cpuid/XCR0 check
// for AVX-512 F/BW/VL. Layouts: see quant_gemm_kernel.h.
#include <immintrin.h>

#include "quant_gemm_kernel.h"

namespace pipefill_quant {
namespace avx512 {
namespace {

constexpr int kRows = 8;  // 16 accumulators + 2 weights + the scales < 32 zmm

template <int QT>
inline void dequant(const uint8_t* b, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  if (QT == kQ8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d);
    return;
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  if (QT == kQ4_0) {  // (q - 8) d: the difference is exact, one rounding
    const __m512i eight = _mm512_set1_epi32(8);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(lo), eight)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(hi), eight)), d);
    return;
  }
  const __m512 m = _mm512_set1_ps(half_at(b + 2));  // q d + m: two roundings, as ggml's
  w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d), m);
  w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d), m);
}

template <int QT, int R>
inline void tile(const float* x, int64_t ldx, const uint8_t* row, int64_t blocks, float* y,
                 int64_t ldy) {
  constexpr int64_t bb = QT == kQ8_0 ? 34 : QT == kQ4_1 ? 20 : 18;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(row + (b + 8) * bb), _MM_HINT_T0);
    __m512 w0, w1;
    dequant<QT>(row + b * bb, w0, w1);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * kBlock;
      acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

template <int QT>
void run(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K,
         float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {  // row tiles after the first read row from L1
      const float* xt = x + m0 * ldx;
      float* yt = y + m0 * ldy + n;
      switch (M - m0 >= kRows ? kRows : M - m0) {
#define PF_TILE(R) case R: tile<QT, R>(xt, ldx, row, blocks, yt, ldy); break;
        PF_TILE(1) PF_TILE(2) PF_TILE(3) PF_TILE(4) PF_TILE(5) PF_TILE(6) PF_TILE(7) PF_TILE(8)
#undef PF_TILE
      }
    }
  }
}

}  // namespace

void gemm_cols(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes,
               int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (qtype == kQ4_0) run<kQ4_0>(x, ldx, w, row_bytes, M, K, y, ldy, n0, n1);
  else if (qtype == kQ4_1) run<kQ4_1>(x, ldx, w, row_bytes, M, K, y, ldy, n0, n1);
  else run<kQ8_0>(x, ldx, w, row_bytes, M, K, y, ldy, n0, n1);
}

}  // namespace avx512
}  // namespace pipefill_quant
