// The vector paths' FP8 decode GEMM (e4m3 weights, one float32 scale per 128 x 128 block),
// written once over the register width like quant_gemm_simd.h: included by quant_gemm_avx2.cpp
// and quant_gemm_avx512.cpp after it, each of whose vector type V adds set1, mul and from_half
// (16 IEEE halves to float32 registers, vcvtph2ps). Layout and arithmetic: fp8_gemm_kernel.h.
//
// 16 codes become 16 halves in integer lanes: the 7 magnitude bits shifted to the half's
// exponent and mantissa (the value / 256, subnormals included: a half has e4m3's subnormals as
// its own) and the sign to bit 15; widened exactly, then times 256 x the block's scale: one
// rounding of the same exact product as torch's value x scale (256 x scale is exact; it stays
// finite for every scale below 2^120, and a quantizer's scales are at most FLT_MAX / 448).
// Weights go 32 at a time; a row's last block may end inside 32, and those weights (and the
// activations beside them) go through zero-padded copies, so every weight passes the same
// arithmetic.
#pragma once
#include <immintrin.h>

#include <algorithm>

#include "fp8_gemm_kernel.h"
#include "quant_simd_common.h"

namespace pipefill_quant {
namespace {

// 16 e4m3 codes -> 16 IEEE halves of value / 256 (AVX2 integer ops; both builds have them).
inline __m256i fp8_halves(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3f80));
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16((short)0x8000));
  return _mm256_or_si256(magnitude, sign);
}

constexpr int kFp8Unit = 32;  // weights per step

// The register a block's weights are scaled by: 256 x its scale (see above).
template <class V>
inline typename V::reg fp8_scale(float scale) {
  return V::set1(scale * 256.0f);
}

// Weights [k, k + 32) of a row as 32 / V::kLanes registers of float32 (code x scale).
template <class V>
inline void fp8_unit(const uint8_t* p, typename V::reg scale256, typename V::reg* w) {
  constexpr int kHalf = 16 / V::kLanes;
  V::from_half(fp8_halves(p), w);
  V::from_half(fp8_halves(p + 16), w + kHalf);
  for (int v = 0; v < 2 * kHalf; ++v) w[v] = V::mul(w[v], scale256);
}

// acc[r] += the unit's weights times x rows r (row stride ldx), alternating two accumulators.
template <class V, int R>
inline void fp8_fma(const typename V::reg* w, const float* x, int64_t ldx, typename V::reg (*acc)[2]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kFp8Unit / V::kLanes; ++v)
      acc[r][v & 1] = V::fmadd(w[v], V::load(x + r * ldx + v * V::kLanes), acc[r][v & 1]);
}

// Columns of R rows against one weight row; its scales at srow (one per 128 weights).
template <class V, int R>
inline void fp8_tile(const float* x, int64_t ldx, const uint8_t* row, const float* srow, int64_t K, float* y,
                     int64_t ldy) {
  typename V::reg acc[R][2], w[kFp8Unit / V::kLanes];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::zero();
  for (int64_t k0 = 0; k0 < K; k0 += kFp8Block) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kFp8Block);
    const typename V::reg scale = fp8_scale<V>(srow[k0 / kFp8Block]);
    _mm_prefetch(reinterpret_cast<const char*>(row + k0 + 8 * kFp8Block), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + k0 + 8 * kFp8Block + 64), _MM_HINT_T0);
    int64_t k = k0;
    for (; k + kFp8Unit <= k1; k += kFp8Unit) {
      fp8_unit<V>(row + k, scale, w);
      fp8_fma<V, R>(w, x + k, ldx, acc);
    }
    if (k < k1) {  // the row's partial end: zero-padded codes and activations
      alignas(64) uint8_t codes[kFp8Unit] = {};
      alignas(64) float xs[R][kFp8Unit] = {};
      std::memcpy(codes, row + k, k1 - k);
      for (int r = 0; r < R; ++r) std::memcpy(xs[r], x + r * ldx + k, (k1 - k) * sizeof(float));
      fp8_unit<V>(codes, scale, w);
      fp8_fma<V, R>(w, xs[0], kFp8Unit, acc);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = V::sum(acc[r][0], acc[r][1]);
}

template <class V>
void fp8_gemm_cols_simd(const float* x, int64_t ldx, const uint8_t* w, const float* scale, const int32_t* scale_row,
                        int64_t lds, int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += V::kRows)  // row tiles after the first read the row from L1
      with_rows<V::kRows>(M - m0 < V::kRows ? M - m0 : V::kRows, [&](auto r) {
        fp8_tile<V, decltype(r)::value>(x + m0 * ldx, ldx, w + n * K, scale + scale_row[n] * lds, K,
                                        y + m0 * ldy + n, ldy);
      });
}

// One unit's registers stored to out + at (float32 or bf16), its first `count` weights only.
template <class V>
inline void fp8_store(const typename V::reg* w, void* out, int64_t at, bool bf16, int64_t count) {
  alignas(64) float f[kFp8Unit];
  alignas(64) uint16_t h[kFp8Unit];
  const bool whole = count == kFp8Unit;
  for (int v = 0; v < kFp8Unit / V::kLanes; ++v) {
    if (bf16)
      V::store_bf16((whole ? static_cast<uint16_t*>(out) + at : h) + v * V::kLanes, w[v]);
    else
      V::store((whole ? static_cast<float*>(out) + at : f) + v * V::kLanes, w[v]);
  }
  if (!whole && bf16) std::memcpy(static_cast<uint16_t*>(out) + at, h, count * sizeof(uint16_t));
  if (!whole && !bf16) std::memcpy(static_cast<float*>(out) + at, f, count * sizeof(float));
}

template <class V>
void fp8_dequant_rows_simd(const uint8_t* w, const float* scale, const int32_t* scale_row, int64_t lds, int64_t K,
                           int64_t n0, int64_t n1, void* out, bool bf16, int64_t ldo) {
  typename V::reg r[kFp8Unit / V::kLanes];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * K;
    for (int64_t k = 0; k < K; k += kFp8Unit) {
      const typename V::reg s = fp8_scale<V>(scale[scale_row[n] * lds + k / kFp8Block]);
      const int64_t count = std::min<int64_t>(kFp8Unit, K - k);
      alignas(64) uint8_t codes[kFp8Unit] = {};
      if (count < kFp8Unit) std::memcpy(codes, row + k, count);
      fp8_unit<V>(count < kFp8Unit ? codes : row + k, s, r);
      fp8_store<V>(r, out, n * ldo + k, bf16, count);
    }
  }
}

}  // namespace
}  // namespace pipefill_quant

// The ISA's fp8_gemm_cols and fp8_dequant_rows (fp8_gemm_kernel.h) on its vector type V, written
// inside its namespace by its translation unit.
#define PF_FP8_GEMM_COLS(V)                                                                                    \
  void fp8_gemm_cols(const float* x, int64_t ldx, const uint8_t* w, const float* scale,                       \
                     const int32_t* scale_row, int64_t lds, int64_t M, int64_t K, float* y, int64_t ldy,      \
                     int64_t n0, int64_t n1) {                                                                 \
    fp8_gemm_cols_simd<V>(x, ldx, w, scale, scale_row, lds, M, K, y, ldy, n0, n1);                            \
  }                                                                                                            \
  void fp8_dequant_rows(const uint8_t* w, const float* scale, const int32_t* scale_row, int64_t lds, int64_t K, \
                        int64_t n0, int64_t n1, void* out, bool bf16, int64_t ldo) {                           \
    fp8_dequant_rows_simd<V>(w, scale, scale_row, lds, K, n0, n1, out, bf16, ldo);                            \
  }
