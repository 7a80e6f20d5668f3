// What the quantized decode GEMM's vector code shares across its float kernels
// (quant_gemm_simd.h, fp8_gemm_simd.h) and its integer kernels (quant_int8_simd.h): one copy of
// each small piece (the tiles' row dispatch, a 16-byte load, the ymm lane sum), compiled into
// every ISA's translation unit with that unit's -m flags.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace pipefill_quant {
namespace {

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// The sum of the 16 float lanes of a + b, in the order both ymm paths have always used.
inline float sum256(__m256 a, __m256 b) {
  const __m256 v = _mm256_add_ps(a, b);
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// f(std::integral_constant<int, rows>) for rows in 1..R: a tile's row count as a template
// argument (its accumulators live in registers).
template <int R, class F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

}  // namespace
}  // namespace pipefill_quant
