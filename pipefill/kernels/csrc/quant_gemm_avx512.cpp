// AVX-512 quantized decode GEMM: 16 weights to one zmm of float32, up to 8 rows per tile (16
// accumulators + 2 weights + the scales < 32 zmm). Entered only after the glue's cpuid/XCR0
// check for AVX-512 F/BW/VL. The kernels: quant_gemm_simd.h (GGUF blocks), fp8_gemm_simd.h
// (FP8 with block scales); layouts: quant_gemm_kernel.h, fp8_gemm_kernel.h.
#include "quant_gemm_simd.h"
#include "fp8_gemm_simd.h"

namespace pipefill_quant {
namespace avx512 {
namespace {

struct V512 {
  using reg = __m512;
  static constexpr int kLanes = 16, kRows = 8;
  // 16 int8 codes -> code * d (+ m), the scale's and the offset's rounding apart.
  template <bool kOffset>
  static void widen(__m128i q, float d, float m, reg* w) {
    const reg v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d));
    w[0] = kOffset ? _mm512_add_ps(v, _mm512_set1_ps(m)) : v;
  }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  // 16 IEEE halves -> float32, exactly (the FP8 path's widening).
  static void from_half(__m256i h, reg* w) { w[0] = _mm512_cvtph_ps(h); }
  static float sum(reg a, reg b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  // Nearest even: + 0x7fff + the lowest kept bit, then the high halves (finite v).
  static void store_bf16(uint16_t* p, reg v) {
    const __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i up = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, up), 16)));
  }
};

}  // namespace

PF_QUANT_GEMM_COLS(V512)
PF_FP8_GEMM_COLS(V512)

}  // namespace avx512
}  // namespace pipefill_quant
