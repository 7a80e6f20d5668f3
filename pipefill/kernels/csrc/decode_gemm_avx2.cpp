// AVX2 + FMA decode GEMM, float32 compute, float32 or bf16 weights (bf16 -> float32 in
// registers: a 16-bit shift for the even k of a pair, a mask for the odd k). Entered only after
// the glue's cpuid/XCR0 check for AVX2 and FMA. A block of 16 columns is two 8-lane halves;
// per row and half two partial sums (even and odd k), added at the end: the same order as the
// AVX-512 path, whatever M.
#include <immintrin.h>

#include "decode_gemm_kernel.h"

namespace pipefill_decode {
namespace avx2 {
namespace {

constexpr int kRows = 3;  // 12 accumulators + 2-4 weights + a broadcast <= 16 ymm

inline uint16_t to_bf16(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  if (f != f) return 0x7fc0;
  return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

inline void store_row(const Out& o, int64_t m, int64_t n0, __m256 lo, __m256 hi) {
  float v[16];
  _mm256_storeu_ps(v, lo);
  _mm256_storeu_ps(v + 8, hi);
  const int64_t n = o.N - n0 < 16 ? o.N - n0 : 16;
  if (o.bias)
    for (int64_t j = 0; j < n; ++j) v[j] += o.bias[n0 + j];
  if (o.y_dtype == kF32) {
    float* y = static_cast<float*>(o.y) + m * o.ldy + n0;
    for (int64_t j = 0; j < n; ++j) y[j] = v[j];
  } else {
    uint16_t* y = static_cast<uint16_t*>(o.y) + m * o.ldy + n0;
    for (int64_t j = 0; j < n; ++j) y[j] = to_bf16(v[j]);
  }
}

// Weights of k = 2p and 2p + 1 for columns [8h, 8h + 8) of a block.
template <bool BF16>
inline void load_pair(const void* blk, int64_t p, int h, __m256& we, __m256& wo) {
  if (BF16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint32_t*>(blk) + p * 16 + 8 * h));
    we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    wo = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
  } else {
    const float* w = static_cast<const float*>(blk) + p * 32 + 8 * h;
    we = _mm256_loadu_ps(w);
    wo = _mm256_loadu_ps(w + 16);
  }
}

template <int MR, bool BF16>
inline void tile(const float* x, int64_t ldx, const void* blk, int64_t K, const Out& o, int64_t m0,
                 int64_t n0) {
  __m256 a0[MR][2], a1[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) a0[r][h] = a1[r][h] = _mm256_setzero_ps();
  const int64_t pairs = K / 2;
  const char* pf = static_cast<const char*>(blk);
  const int64_t pair_bytes = BF16 ? 64 : 128;
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(pf + (p + 16) * pair_bytes, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256 we, wo;
      load_pair<BF16>(blk, p, h, we, wo);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + 2 * p;
        a0[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xr[0]), we, a0[r][h]);
        a1[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xr[1]), wo, a1[r][h]);
      }
    }
  }
  if (K & 1) {
    for (int h = 0; h < 2; ++h) {
      __m256 we, wo;
      load_pair<BF16>(blk, pairs, h, we, wo);
      for (int r = 0; r < MR; ++r)
        a0[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + K - 1]), we, a0[r][h]);
    }
  }
  for (int r = 0; r < MR; ++r)
    store_row(o, m0 + r, n0, _mm256_add_ps(a0[r][0], a1[r][0]), _mm256_add_ps(a0[r][1], a1[r][1]));
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
        case 1: tile<1, BF16>(xt, ldx, blk, K, o, m0, b * 16); break;
        case 2: tile<2, BF16>(xt, ldx, blk, K, o, m0, b * 16); break;
        case 3: tile<3, BF16>(xt, ldx, blk, K, o, m0, b * 16); break;
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

}  // namespace avx2
}  // namespace pipefill_decode
