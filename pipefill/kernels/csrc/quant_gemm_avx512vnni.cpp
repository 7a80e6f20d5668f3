// AVX-512 VNNI integer path of the quantized decode GEMM: a group's 128 codes in two zmm (four
// 128-bit slots each), vpdpbusd (unsigned codes x signed activations -> int32, no saturation),
// up to 8 rows per tile (8 float sums, 8 int32 sums, a step's 8 code registers and 2 of scales
// < 32 zmm); the unit-lane kernel's half step (8 blocks) on ymm.
// Entered only after the glue's cpuid/XCR0 check for AVX-512 F/BW/VL and AVX512_VNNI. The
// kernel: quant_int8_simd.h; the activations' layout: quant_int8_kernel.h.
#include "quant_int8_rows16.h"
#include "quant_int8_simd.h"

namespace pipefill_quant {
namespace avx512vnni {
namespace {

// The half step (ymm: 8 units) of the unit-lane kernel: the AVX2 ops with vpdpbusd on ymm.
struct V256Vnni : I256Ops {
  using Half = V256Vnni;
  static constexpr bool kSignedQ8 = false;  // Q8_0's codes + 128, their zero point 128
  static ireg dot(ireg start, ireg lo, ireg hi, ireg xlo, ireg xhi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, lo, xlo), hi, xhi);
  }
  static ireg dot_signed(ireg, ireg, ireg, ireg) { return zeroi(); }  // not used (kSignedQ8 false)
};

struct V512Vnni {
  using ireg = __m512i;
  using reg = __m512;
  using Half = V256Vnni;
  static constexpr int kSlots = 4, kRows = 8;
  static constexpr bool kSignedQ8 = false;  // Q8_0's codes + 128, their zero point 128
  static ireg zeroi() { return _mm512_setzero_si512(); }
  static reg zero() { return _mm512_setzero_ps(); }
  static ireg set1(char v) { return _mm512_set1_epi8(v); }
  static ireg loadi(const void* p) { return _mm512_loadu_si512(p); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static ireg and_(ireg a, ireg b) { return _mm512_and_si512(a, b); }
  static ireg or_(ireg a, ireg b) { return _mm512_or_si512(a, b); }
  static ireg xor_(ireg a, ireg b) { return _mm512_xor_si512(a, b); }
  static ireg srli16(ireg a, int n) { return _mm512_srli_epi16(a, n); }
  static ireg slli16(ireg a, int n) { return _mm512_slli_epi16(a, n); }
  static ireg unpacklo64(ireg a, ireg b) { return _mm512_unpacklo_epi64(a, b); }
  static ireg unpackhi64(ireg a, ireg b) { return _mm512_unpackhi_epi64(a, b); }
  static ireg unpacklo32(ireg a, ireg b) { return _mm512_unpacklo_epi32(a, b); }
  static ireg unpackhi32(ireg a, ireg b) { return _mm512_unpackhi_epi32(a, b); }
  static ireg shuffle8(ireg a, __m128i idx) { return _mm512_shuffle_epi8(a, _mm512_broadcast_i32x4(idx)); }
  static ireg min_u8(ireg a, ireg b) { return _mm512_min_epu8(a, b); }
  static ireg set1_64(uint64_t v) { return _mm512_set1_epi64((long long)v); }
  // Slot t: the 16 bytes at p[t] + off.
  static ireg gather(const uint8_t* const* p, int off) {
    const __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p[0] + off)), load16(p[1] + off), 1);
    const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p[2] + off)), load16(p[3] + off), 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
  // Slot t shifted right by sh[t] bits (per 64-bit element: the caller masks within bytes).
  static ireg srlv(ireg a, const int* sh) {
    return _mm512_srlv_epi64(a, _mm512_set_epi64(sh[3], sh[3], sh[2], sh[2], sh[1], sh[1], sh[0], sh[0]));
  }
  // Every dword of slot t = v[t].
  static ireg slot_dwords(const uint32_t* v) {
    return _mm512_set_epi32(v[3], v[3], v[3], v[3], v[2], v[2], v[2], v[2], v[1], v[1], v[1], v[1], v[0], v[0],
                            v[0], v[0]);
  }
  // Lane l = h[l / 2] (the scale of the 16 weights lane l's codes belong to).
  static reg lanes(const float* h) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                 _mm512_castps256_ps512(_mm256_loadu_ps(h)));
  }
  // Lane l = v[2 (l / 4) + odd]: slot l / 4's d (odd 0) or m (odd 1) of the group's 8 (chunk c = 0).
  static reg slot_lanes(__m256 v, int, int odd) {
    const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0),
                                         _mm512_set1_epi32(odd));
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
  }
  static ireg addi(ireg a, ireg b) { return _mm512_add_epi32(a, b); }
  static ireg srli32(ireg a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
  static ireg dwords(const uint32_t* v) {
    return _mm512_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5], (int)v[6], (int)v[7],
                             (int)v[8], (int)v[9], (int)v[10], (int)v[11], (int)v[12], (int)v[13], (int)v[14],
                             (int)v[15]);
  }
  static reg halves_low(ireg v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
  static ireg dot(ireg start, ireg lo, ireg hi, ireg xlo, ireg xhi) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, xlo), hi, xhi);
  }
  static ireg dot_signed(ireg, ireg, ireg, ireg) { return zeroi(); }  // not used (kSignedQ8 false)
  static reg cvt(ireg a) { return _mm512_cvtepi32_ps(a); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(reg a, reg b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
  // a with the half step's sums h added to its low 8 lanes.
  static reg add_half(reg a, __m256 h) { return _mm512_add_ps(a, _mm512_zextps256_ps512(h)); }
  // 32 floats -> int8 codes round(x / d) (nearest even), d = amax / 127 returned.
  static float quantize32(const float* x, int8_t* q) {
    const reg a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const reg s = _mm512_set1_ps(id);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, s))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, s))));
    return d;
  }
};

}  // namespace

PF_QUANT_INT8_COLS(V512Vnni)

void rows16_records(int qtype, const int8_t* q, int64_t ldq, const float* dx, int64_t ldd, int64_t M, int64_t units,
                    uint8_t* rec) {
  fill_rows16_records(qtype, false, q, ldq, dx, ldd, M, units, rec);
}

void rows16_gemm_cols(const uint8_t* rec, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes, int64_t K,
                      float* y, int64_t ldy, int64_t n0, int64_t n1) {
  rows16_cols({rec, M}, M, w, qtype, row_bytes, K, y, ldy, n0, n1);
}

}  // namespace avx512vnni
}  // namespace pipefill_quant
