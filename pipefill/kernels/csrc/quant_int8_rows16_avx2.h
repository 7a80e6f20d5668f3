// The 16-row kernel of the integer path on AVX2 (included by quant_gemm_avx2.cpp): the VNNI
// kernel (quant_int8_rows16.h, which describes the layout and why) ported to ymm without
// vpdpbusd. A group's 16 rows are two halves of 8, one output column per 32-bit lane: half h's
// share of a 64-byte field unit is its bytes 32 h .. 32 h + 31, of a 32-byte run of 16 half
// scales its bytes 16 h .. 16 h + 15, so a half is read like a group of 8 rows.
//
// The dot products: vpmaddubsw (unsigned codes x signed activations -> int16 pairs, saturating)
// then vpmaddwd by ones (-> int32 lanes). The int16 pairs of several activation dwords are added
// before widening while they cannot reach 32767: 4-bit codes 8 dwords (8 x 2 x 15 x 127 =
// 30,480), 5-bit 4 (31,496), Q6_K's 6-bit 2 (32,004). Q8_0 keeps its codes signed (its codes +
// 128 would saturate one pair): |code| x the activation with the code's sign, widened per dword.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_int8_kernel.h"
#include "quant_int8_rows16_records.h"
#include "quant_simd_common.h"

namespace pipefill_quant {
namespace {

// One 32-weight unit of half h of a group of 16 rows, unpacked: c[j] holds the codes paired with
// activation dword j of the half's 8 rows (Q8_0: their magnitudes, `sign` the codes); dv the
// rows' scales of the unit (Q6_K: of its first 16 weights, dv2 of the last 16), mv their
// offsets (Q4_1's m; the K types' dmin mn, subtracted).
template <int QT>
struct Rows16HalfUnit {
  __m256i c[8], sign[QT == kQ8_0 ? 8 : 1];
  __m256 dv, dv2, mv;

  static __m256 halves8(const uint8_t* p, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
  }
  static __m256i load(const uint8_t* p, int h) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)); }

  // 0x10 in byte k of lane l where bit first + k of the lane's dword of `bits` is set.
  static __m256i fifth_bits8(__m256i bits, int first) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_srl_epi32(bits, _mm_cvtsi32_si128(first)),
        _mm256_broadcastsi128_si256(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c)));
    const __m256i sel = _mm256_set1_epi32(0x08040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(0x10));
  }

  // Byte `byte` of every lane of v, shifted right by `shift` and masked: an int32 a lane.
  static __m256i field(__m256i v, int byte, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * byte + shift)), _mm256_set1_epi32(mask));
  }

  // Q4_K/Q5_K: sub-block u's 6-bit scale and min of every row, as ggml's get_scale_min_k4.
  static void k4_scale_min(const uint8_t* p, int h, int u, __m256i& sc, __m256i& mn) {
    const __m256i q0 = load(p, h), q1 = load(p + 64, h), q2 = load(p + 128, h);
    if (u < 4) {
      sc = field(q0, u, 0, 63);
      mn = field(q1, u, 0, 63);
    } else {
      sc = _mm256_or_si256(field(q2, u - 4, 0, 15), _mm256_slli_epi32(field(q0, u - 4, 6, 3), 4));
      mn = _mm256_or_si256(field(q2, u - 4, 4, 15), _mm256_slli_epi32(field(q1, u - 4, 6, 3), 4));
    }
  }

  // Unit u of half h of the group's block column at p (offsets as quant_int8_rows16.h's).
  __attribute__((always_inline)) void unpack(const uint8_t* p, int h, int u) {
    const __m256i f = _mm256_set1_epi8(0x0f);
    if constexpr (QT == kQ8_0) {
      dv = halves8(p, h);
      for (int j = 0; j < 8; ++j) {
        sign[j] = load(p + 32 + 64 * j, h);
        c[j] = _mm256_abs_epi8(sign[j]);
      }
    } else if constexpr (Layout<QT>::kWeights == 32) {
      constexpr int kCodes = QT == kQ4_0 ? 32 : QT == kQ4_1 ? 64 : 96;
      dv = halves8(p, h);
      if constexpr (QT == kQ4_1) mv = halves8(p + 32, h);
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = load(p + kCodes + 64 * j, h);
        c[j] = _mm256_and_si256(raw, f);
        c[4 + j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), f);
      }
      if constexpr (QT == kQ5_0) {
        const __m256i bits = load(p + 32, h);
        for (int j = 0; j < 4; ++j) {
          c[j] = _mm256_or_si256(c[j], fifth_bits8(bits, 4 * j));
          c[4 + j] = _mm256_or_si256(c[4 + j], fifth_bits8(bits, 16 + 4 * j));
        }
      }
    } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
      constexpr int kCodes = QT == kQ4_K ? 256 : 768;
      __m256i sc, mn;
      k4_scale_min(p + 64, h, u, sc, mn);
      dv = _mm256_mul_ps(halves8(p, h), _mm256_cvtepi32_ps(sc));
      mv = _mm256_mul_ps(halves8(p + 32, h), _mm256_cvtepi32_ps(mn));
      const __m128i shift = _mm_cvtsi32_si128(4 * (u & 1));
      for (int j = 0; j < 8; ++j) {
        c[j] = _mm256_and_si256(_mm256_srl_epi16(load(p + kCodes + 64 * (8 * (u / 2) + j), h), shift), f);
        if constexpr (QT == kQ5_K) {  // bit u of each byte of the planes: the code's fifth bit
          const __m256i plane = _mm256_srl_epi16(load(p + 256 + 64 * j, h), _mm_cvtsi32_si128(u));
          c[j] = _mm256_or_si256(c[j], _mm256_slli_epi16(_mm256_and_si256(plane, _mm256_set1_epi8(1)), 4));
        }
      }
    } else {  // Q6_K: ql 0 (32 x 64), qh 2048 (16 x 64), scales 3072 (4 x 64), d 3328
      const int hb = u / 4, t = u % 4;
      const __m128i lshift = _mm_cvtsi32_si128(4 * (t / 2));
      for (int j = 0; j < 8; ++j) {
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(load(p + 64 * (16 * hb + 8 * (t % 2) + j), h), lshift), f);
        __m256i hi = load(p + 2048 + 64 * (8 * hb + j), h);  // bits 2 t, 2 t + 1 of each byte to 4, 5
        hi = t == 0 ? _mm256_slli_epi16(hi, 4) : t == 1 ? _mm256_slli_epi16(hi, 2) : t == 3 ? _mm256_srli_epi16(hi, 2) : hi;
        c[j] = _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
      }
      const __m256 d = halves8(p + 3328, h);
      const __m256i sc = load(p + 3072 + 64 * (u / 2), h);  // scales 2 u, 2 u + 1 at bytes 2 (u % 2) +0, +1
      const int at = 2 * (u % 2);
      dv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(sc, 24 - 8 * at), 24)));
      dv2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(sc, 16 - 8 * at), 24)));
    }
  }

  // How many activation dwords' int16 pairs add up before widening (see the top).
  static constexpr int kPairsPerWiden = QT == kQ8_0 ? 1 : QT == kQ6_K ? 2 : QT == kQ5_0 || QT == kQ5_K ? 4 : 8;

  // start + the integer dot products of dwords [j0, j1) with the row's broadcast dwords xb.
  __attribute__((always_inline)) __m256i dot(__m256i start, const __m256i* xb, int j0, int j1) const {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = start;
    for (int j = j0; j < j1; j += kPairsPerWiden) {
      __m256i pairs = _mm256_setzero_si256();
      for (int i = j; i < j + kPairsPerWiden && i < j1; ++i) {
        const __m256i x = QT == kQ8_0 ? _mm256_sign_epi8(xb[i], sign[QT == kQ8_0 ? i : 0]) : xb[i];
        pairs = i == j ? _mm256_maddubs_epi16(c[i], x) : _mm256_add_epi16(pairs, _mm256_maddubs_epi16(c[i], x));
      }
      s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));
    }
    return s;
  }
};

// Rows m0 .. m0 + R - 1 of the 16 columns of one group (its block columns at grp) over K, into
// y (the group's first column; `valid` of its 16 columns exist). Per unit, each half is
// unpacked once for the R rows, whose activation dwords are broadcast once for both halves.
template <int QT, int R, int H0, int H1>
inline void rows16_tile_avx2(const Rows16Acts& a, int64_t m0, const uint8_t* grp, int64_t K, float* y, int64_t ldy,
                             int valid) {
  using L = Layout<QT>;
  constexpr int64_t kGroupBlock = kRows16 * L::kBytes;
  constexpr bool kZero = rows16_zero(QT, true) != 0, kHalves = QT == kQ6_K;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / L::kWeights; ++b) {
    const uint8_t* blk = grp + b * kGroupBlock;
    for (int u = 0; u < L::kUnits; ++u) {
      const int64_t unit = b * L::kUnits + u;
      const uint8_t* rec = a.rec + (unit * a.M + m0) * kRows16Rec;
      if constexpr (R >= 4 || QT == kQ6_K) {  // as the VNNI kernel's (quant_int8_rows16.h)
        constexpr int kSpan = kGroupBlock / L::kUnits, kAhead = R >= 4 ? 12 : 4;
        for (int i = 0; i < kSpan; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + (u + kAhead) * kSpan + i), _MM_HINT_T0);
      }
      for (int h = H0; h < H1; ++h) {
        Rows16HalfUnit<QT> w;
        w.unpack(blk, h, u);
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = rec + r * kRows16Rec;
          const uint8_t* e = x + kRows16Extra;
          __m256i xb[8];
          for (int j = 0; j < 8; ++j) {
            int32_t v;
            std::memcpy(&v, x + 4 * j, 4);
            xb[j] = _mm256_set1_epi32(v);
          }
          int32_t e0, e1;
          std::memcpy(&e0, e, 4);
          std::memcpy(&e1, e + 4, 4);
          float dx;
          std::memcpy(&dx, x + kRows16Dx, 4);
          const __m256 dxv = _mm256_set1_ps(dx);
          const __m256i z0 = kZero ? _mm256_set1_epi32(e0) : _mm256_setzero_si256();
          if constexpr (kHalves) {
            const __m256i s0 = w.dot(z0, xb, 0, 4), s1 = w.dot(_mm256_set1_epi32(e1), xb, 4, 8);
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(w.dv, dxv), acc[r][h]);
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(w.dv2, dxv), acc[r][h]);
          } else {
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w.dot(z0, xb, 0, 8)), _mm256_mul_ps(w.dv, dxv), acc[r][h]);
          }
          if constexpr (L::kOffset) {
            float sl;
            std::memcpy(&sl, e, 4);
            acc[r][h] = QT == kQ4_1 ? _mm256_fmadd_ps(w.mv, _mm256_set1_ps(sl), acc[r][h])
                                    : _mm256_fnmadd_ps(w.mv, _mm256_set1_ps(sl), acc[r][h]);
          }
        }
      }
    }
  }
  for (int h = H0; h < H1; ++h) {
    const int n = valid - 8 * h < 0 ? 0 : valid - 8 * h > 8 ? 8 : valid - 8 * h;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * ldy + 8 * h, keep, acc[r][h]);
  }
}

// Columns [n0, n1) (n0 a multiple of 16; n1 one too, or N) of y from the 16-row layout at w:
// each group's units unpacked once per tile of 4 rows.
inline void rows16_cols_avx2(const Rows16Acts& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes, int64_t K,
                             float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) {
    constexpr int QT = decltype(t)::value;
    for (int64_t n = n0; n < n1; n += kRows16) {
      const uint8_t* grp = w + n * row_bytes;
      const int valid = n1 - n < kRows16 ? (int)(n1 - n) : kRows16;
      for (int64_t m0 = 0; m0 < M; m0 += 4)
        with_rows<4>(M - m0 < 4 ? M - m0 : 4, [&](auto r) {
          constexpr int R = decltype(r)::value;
          float* yt = y + m0 * ldy + n;
          if constexpr (R >= 4) {
            rows16_tile_avx2<QT, R, 0, 1>(a, m0, grp, K, yt, ldy, valid);
            rows16_tile_avx2<QT, R, 1, 2>(a, m0, grp, K, yt, ldy, valid);
          } else {
            rows16_tile_avx2<QT, R, 0, 2>(a, m0, grp, K, yt, ldy, valid);
          }
        });
    }
  });
}

}  // namespace
}  // namespace pipefill_quant
