// AVX2 + FMA quantized decode GEMM: a block's 32 weights are widened to four ymm of float32 in
// registers and used for up to 4 rows at once, two accumulators per row, reduced at the end
// (16 ymm: 8 accumulators, 4 weights, a scale, an offset, an activation). Entered only after
// the glue's cpuid/XCR0 check for AVX2 and FMA. Layouts: see quant_gemm_kernel.h.
#include <immintrin.h>

#include "quant_gemm_kernel.h"

namespace pipefill_quant {
namespace avx2 {
namespace {

constexpr int kRows = 4;

inline __m256 widen_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 widen_i8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// w[v] = elements 8v .. 8v + 7 of the block.
template <int QT>
inline void dequant(const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  if (QT == kQ8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    w[0] = _mm256_mul_ps(widen_i8(lo), d);
    w[1] = _mm256_mul_ps(widen_i8(_mm_srli_si128(lo, 8)), d);
    w[2] = _mm256_mul_ps(widen_i8(hi), d);
    w[3] = _mm256_mul_ps(widen_i8(_mm_srli_si128(hi, 8)), d);
    return;
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  if (QT == kQ4_0) {  // (q - 8) d: the difference is exact, one rounding
    const __m256i eight = _mm256_set1_epi32(8);
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[v]), eight)), d);
    return;
  }
  const __m256 m = _mm256_set1_ps(half_at(b + 2));  // q d + m: two roundings, as ggml's
  for (int v = 0; v < 4; ++v) w[v] = _mm256_add_ps(_mm256_mul_ps(widen_u8(parts[v]), d), m);
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <int QT, int R>
inline void tile(const float* x, int64_t ldx, const uint8_t* row, int64_t blocks, float* y,
                 int64_t ldy) {
  constexpr int64_t bb = QT == kQ8_0 ? 34 : QT == kQ4_1 ? 20 : 18;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(row + (b + 8) * bb), _MM_HINT_T0);
    __m256 w[4];
    dequant<QT>(row + b * bb, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * kBlock;
      for (int v = 0; v < 4; ++v)
        acc[r][v & 1] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xr + 8 * v), acc[r][v & 1]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

template <int QT>
void run(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K,
         float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const float* xt = x + m0 * ldx;
      float* yt = y + m0 * ldy + n;
      switch (M - m0 >= kRows ? kRows : M - m0) {
#define PF_TILE(R) case R: tile<QT, R>(xt, ldx, row, blocks, yt, ldy); break;
        PF_TILE(1) PF_TILE(2) PF_TILE(3) PF_TILE(4)
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

}  // namespace avx2
}  // namespace pipefill_quant
