// The 16-row kernel of the integer path on AVX-512 VNNI (included by
// quant_gemm_avx512vnni.cpp; its AVX2 port: quant_int8_rows16_avx2.h): every block type held in
// the 16-row layout that pipefill/kernels/gguf_blocks.py (to_rows16) writes once at load: per
// group of 16 weight rows and per block column, each field of the 16 rows side by side (the
// half scales d, then Q4_1's m, Q5_0's fifth bits, ...), dword j of each row's codes in 32-bit
// lane `row` of a 64-byte register.
//
// Why this layout: a decode call reads each weight once, so at M = 1 its time is the bytes of
// the weights as long as the unpacking keeps up. With one output column per 32-bit lane, a
// block of 16 rows (320 bytes of Q4_1) is 4 loads, 4 and + 4 shift-and for the nibbles, two
// half-to-float conversions for d and m, then per activation row 8 vpdpbusd whose activation
// operand is one broadcast dword of the row's natural codes (no transposing, no lane sums at
// the end: the 16 lanes are the 16 outputs), and one float scaling for 16 blocks. The row-major
// kernels (quant_int8_simd.h) spend that much per single block of one row.
//
// Activations: the records of quant_int8_rows16_records.h (Q8_0's codes flipped to unsigned
// here, their zero point 128).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_int8_kernel.h"
#include "quant_int8_rows16_records.h"
#include "quant_simd_common.h"

namespace pipefill_quant {
namespace {

// One 32-weight unit (a block of the 32-weight types, a sub-block of the K types) of a group of
// 16 rows, unpacked: c[j] holds the codes paired with activation dword j (the unit's weights
// 4 j .. 4 j + 3) of every row, as unsigned bytes; dv the rows' scales of the unit (Q6_K: of
// its first 16 weights, dv2 of the last 16), mv their offsets (Q4_1's m; the K types' dmin mn,
// subtracted).
template <int QT>
struct Rows16Unit {
  __m512i c[8];
  __m512 dv, dv2, mv;

  static __m512 halves16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }

  // 0x10 in byte k of lane l where bit first + k of the lane's dword of `bits` is set.
  static __m512i fifth_bits16(__m512i bits, int first) {
    const __m512i spread = _mm512_shuffle_epi8(
        _mm512_srl_epi32(bits, _mm_cvtsi32_si128(first)),
        _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c)));
    const __mmask64 set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201));
    return _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10));
  }

  // Byte `byte` of every lane of v, shifted right by `shift` and masked: an int32 a lane.
  static __m512i field(__m512i v, int byte, int shift, int mask) {
    return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * byte + shift)), _mm512_set1_epi32(mask));
  }

  // Q4_K/Q5_K: sub-block u's 6-bit scale and min of every row, from the 12 scale bytes (three
  // registers of dwords), as ggml's get_scale_min_k4.
  static void k4_scale_min(const uint8_t* p, int u, __m512i& sc, __m512i& mn) {
    const __m512i q0 = load(p), q1 = load(p + 64), q2 = load(p + 128);
    if (u < 4) {
      sc = field(q0, u, 0, 63);
      mn = field(q1, u, 0, 63);
    } else {
      sc = _mm512_or_si512(field(q2, u - 4, 0, 15), _mm512_slli_epi32(field(q0, u - 4, 6, 3), 4));
      mn = _mm512_or_si512(field(q2, u - 4, 4, 15), _mm512_slli_epi32(field(q1, u - 4, 6, 3), 4));
    }
  }

  // Unit u of the group's block column at p.
  __attribute__((always_inline)) void unpack(const uint8_t* p, int u) {
    const __m512i f = _mm512_set1_epi8(0x0f);
    if constexpr (QT == kQ8_0) {
      dv = halves16(p);
      for (int j = 0; j < 8; ++j) c[j] = _mm512_xor_si512(load(p + 32 + 64 * j), _mm512_set1_epi8((char)0x80));
    } else if constexpr (Layout<QT>::kWeights == 32) {
      constexpr int kCodes = QT == kQ4_0 ? 32 : QT == kQ4_1 ? 64 : 96;
      dv = halves16(p);
      if constexpr (QT == kQ4_1) mv = halves16(p + 32);
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = load(p + kCodes + 64 * j);
        c[j] = _mm512_and_si512(raw, f);
        c[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), f);
      }
      if constexpr (QT == kQ5_0) {
        const __m512i bits = load(p + 32);
        for (int j = 0; j < 4; ++j) {
          c[j] = _mm512_or_si512(c[j], fifth_bits16(bits, 4 * j));
          c[4 + j] = _mm512_or_si512(c[4 + j], fifth_bits16(bits, 16 + 4 * j));
        }
      }
    } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
      // d 0, dmin 32, scales 64 (3 x 64), [Q5_K: fifth-bit planes 256 (8 x 64)], codes: 4
      // chunks of 8 dwords, unit u the low (u even) or high nibbles of chunk u / 2.
      constexpr int kCodes = QT == kQ4_K ? 256 : 768;
      __m512i sc, mn;
      k4_scale_min(p + 64, u, sc, mn);
      dv = _mm512_mul_ps(halves16(p), _mm512_cvtepi32_ps(sc));
      mv = _mm512_mul_ps(halves16(p + 32), _mm512_cvtepi32_ps(mn));
      const __m128i shift = _mm_cvtsi32_si128(4 * (u & 1));
      for (int j = 0; j < 8; ++j) {
        c[j] = _mm512_and_si512(_mm512_srl_epi16(load(p + kCodes + 64 * (8 * (u / 2) + j)), shift), f);
        if constexpr (QT == kQ5_K) {  // bit u of each byte of the planes: the code's fifth bit
          const __m512i plane = _mm512_srl_epi16(load(p + 256 + 64 * j), _mm_cvtsi32_si128(u));
          c[j] = _mm512_or_si512(c[j], _mm512_slli_epi16(_mm512_and_si512(plane, _mm512_set1_epi8(1)), 4));
        }
      }
    } else {  // Q6_K: ql 0 (32 x 64), qh 2048 (16 x 64), scales 3072 (4 x 64), d 3328
      const int h = u / 4, t = u % 4;
      const __m128i lshift = _mm_cvtsi32_si128(4 * (t / 2));
      for (int j = 0; j < 8; ++j) {
        const __m512i lo = _mm512_and_si512(_mm512_srl_epi16(load(p + 64 * (16 * h + 8 * (t % 2) + j)), lshift), f);
        __m512i hi = load(p + 2048 + 64 * (8 * h + j));  // bits 2 t, 2 t + 1 of each byte to 4, 5
        hi = t == 0 ? _mm512_slli_epi16(hi, 4) : t == 1 ? _mm512_slli_epi16(hi, 2) : t == 3 ? _mm512_srli_epi16(hi, 2) : hi;
        c[j] = _mm512_or_si512(lo, _mm512_and_si512(hi, _mm512_set1_epi8(0x30)));
      }
      const __m512 d = halves16(p + 3328);
      const __m512i sc = load(p + 3072 + 64 * (u / 2));  // scales 2 u, 2 u + 1 at bytes 2 (u % 2) +0, +1
      const int at = 2 * (u % 2);
      dv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 24 - 8 * at), 24)));
      dv2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 16 - 8 * at), 24)));
    }
  }
};

// Rows m0 .. m0 + R - 1 of the 16 columns of one group (its block columns at grp) over K,
// into y (the group's first column; `valid` of its 16 columns exist).
template <int QT, int R>
inline void rows16_tile(const Rows16Acts& a, int64_t m0, const uint8_t* grp, int64_t K, float* y, int64_t ldy,
                        int valid) {
  using L = Layout<QT>;
  constexpr int64_t kGroupBlock = kRows16 * L::kBytes;
  constexpr bool kZero = rows16_zero(QT, false) != 0, kHalves = QT == kQ6_K;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / L::kWeights; ++b) {
    const uint8_t* blk = grp + b * kGroupBlock;
    for (int u = 0; u < L::kUnits; ++u) {
      const int64_t unit = b * L::kUnits + u;
      const uint8_t* rec = a.rec + (unit * a.M + m0) * kRows16Rec;
      // A tile of 4 rows or more is bound by its dot products, and the bytes 12 units ahead
      // asked for early keep coming (measured: 15-30% faster at M = 8); a tile of fewer rows
      // streams faster on the hardware prefetcher alone (the prefetches measured 15-30% slower
      // at M = 1), except Q6_K's, whose units read four places of a 3 KB block column (M = 1
      // measured half as fast without them).
      if constexpr (R >= 4 || QT == kQ6_K) {
        constexpr int kSpan = kGroupBlock / L::kUnits, kAhead = R >= 4 ? 12 : 4;  // a unit's share of the bytes
        for (int i = 0; i < kSpan; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + (u + kAhead) * kSpan + i), _MM_HINT_T0);
      }
      Rows16Unit<QT> w;
      w.unpack(blk, u);
      for (int r = 0; r < R; ++r) {
        const uint8_t* x = rec + r * kRows16Rec;
        const uint8_t* e = x + kRows16Extra;
        // Two chains of four dot products (weights 0..15, 16..31; their latency overlaps),
        // each starting from its zero point's term.
        int32_t e0, e1;
        std::memcpy(&e0, e, 4);
        std::memcpy(&e1, e + 4, 4);
        __m512i s0 = kZero ? _mm512_set1_epi32(e0) : _mm512_setzero_si512();
        __m512i s1 = kHalves ? _mm512_set1_epi32(e1) : _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          int32_t x0, x1;
          std::memcpy(&x0, x + 4 * j, 4);
          std::memcpy(&x1, x + 16 + 4 * j, 4);
          s0 = _mm512_dpbusd_epi32(s0, w.c[j], _mm512_set1_epi32(x0));
          s1 = _mm512_dpbusd_epi32(s1, w.c[4 + j], _mm512_set1_epi32(x1));
        }
        float dx;
        std::memcpy(&dx, x + kRows16Dx, 4);
        const __m512 dxv = _mm512_set1_ps(dx);
        if constexpr (kHalves) {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(w.dv, dxv), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(w.dv2, dxv), acc[r]);
        } else {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(w.dv, dxv), acc[r]);
        }
        if constexpr (L::kOffset) {
          float sl;
          std::memcpy(&sl, e, 4);
          acc[r] = QT == kQ4_1 ? _mm512_fmadd_ps(w.mv, _mm512_set1_ps(sl), acc[r])
                               : _mm512_fnmadd_ps(w.mv, _mm512_set1_ps(sl), acc[r]);
        }
      }
    }
  }
  const __mmask16 keep = valid >= kRows16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

// Columns [n0, n1) (n0 a multiple of 16; n1 one too, or N) of y from the 16-row layout at w
// (group g at w + g 16 row_bytes): each group's units unpacked once per tile of 8 rows.
inline void rows16_cols(const Rows16Acts& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes, int64_t K,
                        float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) {
    constexpr int QT = decltype(t)::value;
    for (int64_t n = n0; n < n1; n += kRows16) {
      const uint8_t* grp = w + n * row_bytes;
      const int valid = n1 - n < kRows16 ? (int)(n1 - n) : kRows16;
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        with_rows<8>(M - m0 < 8 ? M - m0 : 8, [&](auto r) {
          rows16_tile<QT, decltype(r)::value>(a, m0, grp, K, y + m0 * ldy + n, ldy, valid);
        });
    }
  });
}

}  // namespace
}  // namespace pipefill_quant
