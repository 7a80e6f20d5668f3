// AVX2 + FMA quantized decode GEMM: 16 weights to two ymm of float32, up to 4 rows per tile
// (16 ymm: 8 accumulators, 4 weights, the scales, an activation). Its integer path
// (quant_int8_simd.h): half a group's codes in two ymm, vpmaddubsw + vpmaddwd, 4 rows a tile. Entered only after the glue's
// cpuid/XCR0 check for AVX2 and FMA (and F16C for the FP8 path). The kernels: quant_gemm_simd.h
// (GGUF blocks), fp8_gemm_simd.h (FP8 with block scales); layouts: quant_gemm_kernel.h,
// fp8_gemm_kernel.h.
#include "quant_gemm_simd.h"
#include "fp8_gemm_simd.h"
#include "quant_int8_simd.h"

#ifndef AR
#define AR 4
#define AC 1
#endif
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
  static float sum(reg a, reg b) {
    const __m256 v = _mm256_add_ps(a, b);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
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

// The integer path's ymm: two 128-bit slots a register.
struct I256 {
  using ireg = __m256i;
  using reg = __m256;
  static constexpr int kSlots = 2, kRows = AR, kCols = AC;
  // vpmaddubsw saturates its int16 pair sums: Q8_0's codes (up to 255 with + 128) would
  // overflow them, so Q8_0 multiplies |code| by the activation with the code's sign instead.
  static constexpr bool kSignedQ8 = true;
  static ireg zeroi() { return _mm256_setzero_si256(); }
  static reg zero() { return _mm256_setzero_ps(); }
  static ireg set1(char v) { return _mm256_set1_epi8(v); }
  static ireg loadi(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static ireg and_(ireg a, ireg b) { return _mm256_and_si256(a, b); }
  static ireg or_(ireg a, ireg b) { return _mm256_or_si256(a, b); }
  static ireg xor_(ireg a, ireg b) { return _mm256_xor_si256(a, b); }
  static ireg srli16(ireg a, int n) { return _mm256_srli_epi16(a, n); }
  static ireg slli16(ireg a, int n) { return _mm256_slli_epi16(a, n); }
  static ireg unpacklo64(ireg a, ireg b) { return _mm256_unpacklo_epi64(a, b); }
  static ireg unpackhi64(ireg a, ireg b) { return _mm256_unpackhi_epi64(a, b); }
  static ireg gather(const uint8_t* const* p, int off) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(bytes16(p[0] + off)), bytes16(p[1] + off), 1);
  }
  static ireg srlv(ireg a, const int* sh) { return _mm256_srlv_epi64(a, _mm256_set_epi64x(sh[1], sh[1], sh[0], sh[0])); }
  static ireg slot_dwords(const uint32_t* v) { return _mm256_set_epi32(v[1], v[1], v[1], v[1], v[0], v[0], v[0], v[0]); }
  static ireg fifth_bits(ireg spread, int first) {
    const __m128i i128 = _mm_set_epi64x(0x0101010101010101ll * (first + 1), 0x0101010101010101ll * first);
    const ireg bytes = _mm256_shuffle_epi8(spread, _mm256_broadcastsi128_si256(i128));
    const ireg sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_slli_epi16(_mm256_min_epu8(_mm256_and_si256(bytes, sel), _mm256_set1_epi8(1)), 4);
  }
  static reg lanes(const float* h) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(h)), _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0));
  }
  // Lane l = v[2 (2 c + l / 4) + odd]: chunk c's slot's d (odd 0) or m (odd 1).
  static reg slot_lanes(__m256 v, int c, int odd) {
    const __m256i idx = _mm256_add_epi32(_mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0), _mm256_set1_epi32(4 * c + odd));
    return _mm256_permutevar8x32_ps(v, idx);
  }
  // Codes up to 63: a pair of products is at most 2 * 63 * 127 and the lo + hi sum of two pairs
  // 32,004, inside int16.
  static ireg dot(ireg start, ireg lo, ireg hi, ireg xlo, ireg xhi) {
    const ireg pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_add_epi32(start, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // Signed codes: |code| (at most 128) x activation with the code's sign; each pair at most
  // 2 * 128 * 127, so lo and hi are widened apart.
  static ireg dot_signed(ireg lo, ireg hi, ireg xlo, ireg xhi) {
    const ireg one = _mm256_set1_epi16(1);
    const ireg a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(xlo, lo)), one);
    const ireg b = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(xhi, hi)), one);
    return _mm256_add_epi32(a, b);
  }
  static reg cvt(ireg a) { return _mm256_cvtepi32_ps(a); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(reg a, reg b) { return V256::sum(a, b); }
  static float quantize32(const float* x, int8_t* q) {
    const reg sign = _mm256_set1_ps(-0.0f);
    reg v[4], amax = zero();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float d = _mm_cvtss_f32(m) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const reg s = _mm256_set1_ps(id);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], s));
    // packs interleave the 128-bit halves: dwords come out as 0, 4, 1, 5, 2, 6, 3, 7.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
  }
};

}  // namespace

PF_QUANT_GEMM_COLS(V256)
PF_QUANT_INT8_COLS(I256)
PF_FP8_GEMM_COLS(V256)

}  // namespace avx2
}  // namespace pipefill_quant
