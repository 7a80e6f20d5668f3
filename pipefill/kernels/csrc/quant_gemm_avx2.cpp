// AVX2 + FMA quantized decode GEMM: 16 weights to two ymm of float32, up to 4 rows per tile
// (16 ymm: 8 accumulators, 4 weights, the scales, an activation). Its integer path
// (quant_int8_simd.h): half a group's codes in two ymm (or a step of 8 blocks in 8), vpmaddubsw +
// vpmaddwd, 4 rows a tile. Entered only after the glue's
// cpuid/XCR0 check for AVX2 and FMA (and F16C for the FP8 path). The kernels: quant_gemm_simd.h
// (GGUF blocks), fp8_gemm_simd.h (FP8 with block scales); layouts: quant_gemm_kernel.h,
// fp8_gemm_kernel.h.
#include "quant_gemm_simd.h"
#include "fp8_gemm_simd.h"
#include "quant_int8_rows16_avx2.h"
#include "quant_int8_simd.h"

namespace pipefill_quant {
namespace avx2 {
namespace {

struct V256 {
  using reg = __m256;
  static constexpr int kLanes = 8, kRows = 4;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  // 16 IEEE halves -> float32 in two registers, exactly (F16C: the FP8 path's widening).
  static void from_half(__m256i h, reg* w) {
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    w[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(reg a, reg b) { return sum256(a, b); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  // Nearest even, as the AVX-512 path; packus keeps the 16 low bits (at most 0xffff each).
  static void store_bf16(uint16_t* p, reg v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                                     _mm256_extracti128_si256(r, 1)));
  }
  // 16 int8 codes -> code * d (+ m) in two registers, the scale's and the offset's rounding apart.
  template <bool kOffset>
  static void widen(__m128i q, float d, float m, reg* w) {
    const reg scale = _mm256_set1_ps(d), offset = _mm256_set1_ps(m);
    const __m128i parts[2] = {q, _mm_srli_si128(q, 8)};
    for (int i = 0; i < 2; ++i) {
      const reg v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])), scale);
      w[i] = kOffset ? _mm256_add_ps(v, offset) : v;
    }
  }
};

// The integer path's ymm (quant_int8_simd.h's I256Ops): Q8_0 on signed codes (vpmaddubsw
// would saturate on its codes + 128), no half-width step.
struct I256 : I256Ops {
  using Half = I256;
  static constexpr int kRows = 4;
  static constexpr bool kSignedQ8 = true;
};

}  // namespace

PF_QUANT_GEMM_COLS(V256)
PF_QUANT_INT8_COLS(I256)
PF_FP8_GEMM_COLS(V256)

void rows16_records(int qtype, const int8_t* q, int64_t ldq, const float* dx, int64_t ldd, int64_t M, int64_t units,
                    uint8_t* rec) {
  fill_rows16_records(qtype, true, q, ldq, dx, ldd, M, units, rec);
}

void rows16_gemm_cols(const uint8_t* rec, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes, int64_t K,
                      float* y, int64_t ldy, int64_t n0, int64_t n1) {
  rows16_cols_avx2({rec, M}, M, w, qtype, row_bytes, K, y, ldy, n0, n1);
}

}  // namespace avx2
}  // namespace pipefill_quant
