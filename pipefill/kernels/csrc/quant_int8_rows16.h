// The 16-row kernel of the integer path (AVX-512 VNNI, included by quant_gemm_avx512vnni.cpp):
// the 32-weight types (Q4_0, Q4_1, Q5_0, Q8_0) held in the 16-row layout that
// pipefill/kernels/gguf_blocks.py (to_rows16) writes once at load: per group of 16 weight rows
// and per block column, the 16 rows' half scales d (then Q4_1's m, Q5_0's fifth bits) and their
// codes, dword j of each row in 32-bit lane `row` of a 64-byte register.
//
// Why this layout: a decode call reads each weight once, so at M = 1 its time is the bytes of
// the weights as long as the unpacking keeps up. With one output column per 32-bit lane, a
// block of 16 rows (320 bytes of Q4_1) is 4 loads, 4 and + 4 shift-and for the nibbles, two
// half-to-float conversions for d and m, then per activation row 8 vpdpbusd whose activation
// operand is one broadcast dword of the row's natural codes (no transposing, no lane sums at
// the end: the 16 lanes are the 16 outputs), and one float scaling for 16 blocks. The row-major
// kernels (quant_int8_simd.h) spend that much per single block of one row.
//
// Activations: the natural int8 codes q [M, kp] and scales dx [M, kp / 32] of int8_quantize,
// and per row and unit `extra`: -zero * sum(q) (int32; the types with a zero point: Q4_0's 8,
// Q5_0's 16, Q8_0's 128 once its codes are flipped to unsigned) or dx * sum(q) (float32 bits;
// Q4_1's offset m).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_gemm_kernel.h"
#include "quant_simd_common.h"

namespace pipefill_quant {
namespace {

constexpr int kRows16 = 16;

// One block column of a group of 16 rows, unpacked: c[j] holds the codes paired with
// activation dword j (weights 4 j .. 4 j + 3) of every row, as unsigned bytes; dv, mv the rows'
// d and m.
template <int QT>
struct Rows16Block {
  __m512i c[8];
  __m512 dv, mv;

  static __m512 halves16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  // 0x10 in byte k of lane l where bit first + k of the lane's dword of `bits` is set.
  static __m512i fifth_bits16(__m512i bits, int first) {
    const __m512i spread = _mm512_shuffle_epi8(
        _mm512_srl_epi32(bits, _mm_cvtsi32_si128(first)),
        _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c)));
    const __mmask64 set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201));
    return _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10));
  }

  __attribute__((always_inline)) void unpack(const uint8_t* p) {
    dv = halves16(p);
    if constexpr (QT == kQ8_0) {
      for (int j = 0; j < 8; ++j)
        c[j] = _mm512_xor_si512(_mm512_loadu_si512(p + 32 + 64 * j), _mm512_set1_epi8((char)0x80));
    } else {
      constexpr int kCodes = QT == kQ4_0 ? 32 : QT == kQ4_1 ? 64 : 96;
      if constexpr (QT == kQ4_1) mv = halves16(p + 32);
      const __m512i f = _mm512_set1_epi8(0x0f);
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(p + kCodes + 64 * j);
        c[j] = _mm512_and_si512(raw, f);
        c[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), f);
      }
      if constexpr (QT == kQ5_0) {
        const __m512i bits = _mm512_loadu_si512(p + 32);
        for (int j = 0; j < 4; ++j) {
          c[j] = _mm512_or_si512(c[j], fifth_bits16(bits, 4 * j));
          c[4 + j] = _mm512_or_si512(c[4 + j], fifth_bits16(bits, 16 + 4 * j));
        }
      }
    }
  }
};

// The call's quantized activations as this kernel reads them (see above).
struct Rows16Acts {
  const int8_t* q;  // [M, ldq]
  int64_t ldq;
  const float* dx;  // [M, ldd]
  const uint32_t* extra;  // [M, ldd]
  int64_t ldd;
};

// Rows m0 .. m0 + R - 1 of the 16 columns of one group (its blocks at grp) over `units` blocks,
// into y (the group's first column; `valid` of its 16 columns exist).
template <int QT, int R>
inline void rows16_tile(const Rows16Acts& a, int64_t m0, const uint8_t* grp, int64_t units, float* y,
                        int64_t ldy, int valid) {
  constexpr int64_t kGroupBlock = kRows16 * Layout<QT>::kBytes;
  constexpr bool kZero = QT != kQ4_1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* q = a.q + m0 * a.ldq;
  const float* dx = a.dx + m0 * a.ldd;
  const uint32_t* extra = a.extra + m0 * a.ldd;
  for (int64_t b = 0; b < units; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(grp + (b + 4) * kGroupBlock), _MM_HINT_T0);
    Rows16Block<QT> w;
    w.unpack(grp + b * kGroupBlock);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = q + r * a.ldq + kUnit * b;
      const uint32_t e = extra[r * a.ldd + b];
      // Two chains of four dot products (their latency overlaps), the zero point's start in one.
      __m512i s0 = kZero ? _mm512_set1_epi32((int)e) : _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        int32_t x0, x1;
        std::memcpy(&x0, x + 4 * j, 4);
        std::memcpy(&x1, x + 4 * j + 4, 4);
        s0 = _mm512_dpbusd_epi32(s0, w.c[j], _mm512_set1_epi32(x0));
        s1 = _mm512_dpbusd_epi32(s1, w.c[j + 1], _mm512_set1_epi32(x1));
      }
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(w.dv, _mm512_set1_ps(dx[r * a.ldd + b])), acc[r]);
      if constexpr (!kZero) {
        float sl;
        std::memcpy(&sl, &e, 4);
        acc[r] = _mm512_fmadd_ps(w.mv, _mm512_set1_ps(sl), acc[r]);
      }
    }
  }
  const __mmask16 keep = valid >= kRows16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

// Columns [n0, n1) (n0 a multiple of 16; n1 one too, or N) of y from the 16-row layout at w
// (group g at w + g 16 row_bytes): each group's blocks unpacked once per tile of 8 rows.
inline void rows16_cols(const Rows16Acts& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes, int64_t K,
                        float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) {
    constexpr int QT = decltype(t)::value;
    if constexpr (Layout<QT>::kWeights == 32) {
      for (int64_t n = n0; n < n1; n += kRows16) {
        const uint8_t* grp = w + n * row_bytes;
        const int valid = n1 - n < kRows16 ? (int)(n1 - n) : kRows16;
        for (int64_t m0 = 0; m0 < M; m0 += 8)
          with_rows<8>(M - m0 < 8 ? M - m0 : 8, [&](auto r) {
            rows16_tile<QT, decltype(r)::value>(a, m0, grp, K / kUnit, y + m0 * ldy + n, ldy, valid);
          });
      }
    }
  });
}

// extra[M, ldd] (see above) from the natural codes q and scales dx of `units` units a row.
inline void fill_rows16_extra(int qtype, const int8_t* q, int64_t ldq, const float* dx, int64_t ldd, int64_t M,
                         int64_t units, uint32_t* extra) {
  const int zero = qtype == kQ4_0 ? 8 : qtype == kQ5_0 ? 16 : qtype == kQ8_0 ? 128 : 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t u = 0; u < units; ++u) {
      const int8_t* x = q + m * ldq + kUnit * u;
      int32_t sum = 0;
      for (int k = 0; k < kUnit; ++k) sum += x[k];
      uint32_t e;
      if (zero) {
        const int32_t v = -zero * sum;
        std::memcpy(&e, &v, 4);
      } else {
        const float v = dx[m * ldd + u] * (float)sum;
        std::memcpy(&e, &v, 4);
      }
      extra[m * ldd + u] = e;
    }
}

}  // namespace
}  // namespace pipefill_quant
