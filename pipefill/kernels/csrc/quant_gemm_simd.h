// The vector paths' quantized decode GEMM, written once over the register width: included by
// quant_gemm_avx2.cpp and quant_gemm_avx512.cpp, each of which defines its vector type V (the
// register, its lanes, the row tile) and instantiates gemm_cols_simd<V> with its own -m flags.
// Layouts and the arithmetic: quant_gemm_kernel.h.
//
// A unit's 32 codes are decoded 16 at a time in 128-bit integer registers (SSSE3-level
// instructions, which both ISAs have): nibbles masked or shifted out, fifth and sixth bits
// spread from their bit planes, the zero point subtracted. V widens 16 int8 codes to float32
// lanes and applies the half unit's scale and offset (mul, then add: two roundings, as ggml).
// A column's blocks are read once per tile of up to V::kRows rows; every row keeps two
// accumulators (alternate registers of a unit), reduced at the end.
#pragma once
#include <immintrin.h>

#include "quant_gemm_kernel.h"
#include "quant_simd_common.h"

namespace pipefill_quant {
namespace {

inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0f)); }

inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)); }

// 0x10 in byte j where bit j of the 16 `bits` is set, else 0 (Q5_0's fifth bits).
inline __m128i fifth_bits(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), _mm_set_epi64x(0x0101010101010101, 0));
  const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ull);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(0x10));
}

// Bits [shift, shift + width) of every byte of v, moved to bit 4 up (K types' high bit planes).
template <int kMask>
inline __m128i plane(__m128i v, int shift) {
  const __m128i bits = _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(kMask));
  return _mm_slli_epi16(bits, 4);  // per byte at most 0x30: nothing crosses into the next byte
}

// Codes of weights 0..15 (lo) and 16..31 (hi) of unit u, as int8 (the bits of unit_codes).
// The 32 signed codes of a Q4_0/Q4_1/Q5_0 block from its 16 nibble bytes `raw` (and Q5_0's
// fifth bits, one per weight; ignored otherwise): weights 0-15 in lo, 16-31 in hi, less the
// type's zero point (Q4_1 has none: its offset m is added in floats).
template <int QT>
inline void nibble_codes32(__m128i raw, uint32_t fifth, __m128i& lo, __m128i& hi) {
  lo = low_nibbles(raw);
  hi = high_nibbles(raw);
  if constexpr (QT == kQ5_0) {
    lo = _mm_or_si128(lo, fifth_bits(fifth & 0xffff));
    hi = _mm_or_si128(hi, fifth_bits(fifth >> 16));
  } else {
    (void)fifth;
  }
  if constexpr (QT != kQ4_1) {
    const __m128i zero = _mm_set1_epi8(QT == kQ4_0 ? 8 : 16);
    lo = _mm_sub_epi8(lo, zero);
    hi = _mm_sub_epi8(hi, zero);
  }
}

template <int QT>
inline void unit_codes16(const uint8_t* b, int u, __m128i& lo, __m128i& hi) {
  if constexpr (QT == kQ8_0) {
    lo = load16(b + 2);
    hi = load16(b + 18);
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0) {
    uint32_t fifth = 0;
    if constexpr (QT == kQ5_0) std::memcpy(&fifth, b + 2, 4);
    nibble_codes32<QT>(load16(b + (QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : 6)), fifth, lo, hi);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const uint8_t* nib = b + (QT == kQ4_K ? 16 : 48) + 32 * (u / 2);
    const __m128i r0 = load16(nib), r1 = load16(nib + 16);
    lo = u & 1 ? high_nibbles(r0) : low_nibbles(r0);
    hi = u & 1 ? high_nibbles(r1) : low_nibbles(r1);
    if constexpr (QT == kQ5_K) {
      lo = _mm_or_si128(lo, plane<1>(load16(b + 16), u));
      hi = _mm_or_si128(hi, plane<1>(load16(b + 32), u));
    }
  } else {  // Q6_K: unit u = 4 h + g of half h
    const int h = u / 4, g = u % 4;
    const uint8_t* low = b + 64 * h + 32 * (g & 1);
    const __m128i r0 = load16(low), r1 = load16(low + 16);
    lo = g >> 1 ? high_nibbles(r0) : low_nibbles(r0);
    hi = g >> 1 ? high_nibbles(r1) : low_nibbles(r1);
    const uint8_t* high = b + 128 + 32 * h;
    const __m128i zero = _mm_set1_epi8(32);
    lo = _mm_sub_epi8(_mm_or_si128(lo, plane<3>(load16(high), 2 * g)), zero);
    hi = _mm_sub_epi8(_mm_or_si128(hi, plane<3>(load16(high + 16), 2 * g)), zero);
  }
}

// Unit u of a block as 2 * 16 / V::kLanes registers of float32 weights (d, m: block_scales').
template <class V, int QT>
inline void unit_weights(const uint8_t* blk, int u, const float* d, const float* m, typename V::reg* w) {
  __m128i lo, hi;
  unit_codes16<QT>(blk, u, lo, hi);
  V::template widen<Layout<QT>::kOffset>(lo, d[2 * u], m[2 * u], w);
  V::template widen<Layout<QT>::kOffset>(hi, d[2 * u + 1], m[2 * u + 1], w + 16 / V::kLanes);
}

template <class V, int QT, int R>
inline void tile(const float* x, int64_t ldx, const uint8_t* row, int64_t blocks, float* y, int64_t ldy) {
  using L = Layout<QT>;
  constexpr int kHalf = 16 / V::kLanes;  // registers per 16 weights
  typename V::reg acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * L::kBytes;
    for (int off = 0; off < L::kBytes; off += 64)  // the block 8 units of 32 ahead
      _mm_prefetch(reinterpret_cast<const char*>(blk + off + 8 * L::kBytes / L::kUnits), _MM_HINT_T0);
    float d[2 * L::kUnits], m[2 * L::kUnits];
    block_scales<QT>(blk, d, m);
#pragma GCC unroll 8
    for (int u = 0; u < L::kUnits; ++u) {
      typename V::reg w[2 * kHalf];
      unit_weights<V, QT>(blk, u, d, m, w);
      const int64_t k0 = b * L::kWeights + u * kUnit;
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + k0;
        for (int v = 0; v < 2 * kHalf; ++v)
          acc[r][v & 1] = V::fmadd(w[v], V::load(xr + v * V::kLanes), acc[r][v & 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = V::sum(acc[r][0], acc[r][1]);
}

template <class V, int QT>
void run(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K, float* y,
         int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t blocks = K / Layout<QT>::kWeights;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += V::kRows)  // row tiles after the first read the row from L1
      with_rows<V::kRows>(M - m0 < V::kRows ? M - m0 : V::kRows, [&](auto r) {
        tile<V, QT, decltype(r)::value>(x + m0 * ldx, ldx, row, blocks, y + m0 * ldy + n, ldy);
      });
  }
}

// dequant_rows (quant_gemm_kernel.h) of one type: a unit's registers stored as they are, or
// rounded to bf16.
template <class V, int QT>
void dequant(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16,
             int64_t ldo) {
  using L = Layout<QT>;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < K / L::kWeights; ++b) {
      const uint8_t* blk = w + n * row_bytes + b * L::kBytes;
      float d[2 * L::kUnits], m[2 * L::kUnits];
      block_scales<QT>(blk, d, m);
#pragma GCC unroll 8
      for (int u = 0; u < L::kUnits; ++u) {
        typename V::reg r[32 / V::kLanes];
        unit_weights<V, QT>(blk, u, d, m, r);
        const int64_t at = n * ldo + b * L::kWeights + u * kUnit;
        for (int v = 0; v < 32 / V::kLanes; ++v) {
          if (bf16)
            V::store_bf16(static_cast<uint16_t*>(out) + at + v * V::kLanes, r[v]);
          else
            V::store(static_cast<float*>(out) + at + v * V::kLanes, r[v]);
        }
      }
    }
}

// The 16 IEEE halves at p -> float32, each the bits f16_to_f32 gives (integer code: NaN payloads
// kept, no FPU mode involved), 8 at a time in AVX2 integer lanes; a subnormal half (a rare
// scale) by f16_to_f32 itself.
inline void halves16(const uint8_t* p, float* out) {
  for (int i = 0; i < 2; ++i) {
    const __m256i h = _mm256_cvtepu16_epi32(load16(p + 16 * i));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
    const __m256i exp = _mm256_and_si256(_mm256_srli_epi32(h, 10), _mm256_set1_epi32(0x1f));
    const __m256i mant = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x3ff)), 13);
    const __m256i top = _mm256_cmpeq_epi32(exp, _mm256_set1_epi32(0x1f)), low = _mm256_cmpeq_epi32(exp, _mm256_setzero_si256());
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(exp, _mm256_set1_epi32(112)), 23);
    e = _mm256_andnot_si256(low, _mm256_blendv_epi8(e, _mm256_set1_epi32(0x7f800000), top));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i), _mm256_or_si256(sign, _mm256_or_si256(e, mant)));
    const __m256i sub = _mm256_andnot_si256(_mm256_cmpeq_epi32(mant, _mm256_setzero_si256()), low);
    if (!_mm256_testz_si256(sub, sub))
      for (int l = 0; l < 8; ++l) out[8 * i + l] = half_at(p + 16 * i + 2 * l);
  }
}

// dequant_group16 (quant_gemm_kernel.h) of a 32-weight type: each block column's 16 rows come
// out of the 16-row layout 4 at a time, their code units turned back into rows by 4 x 4 dword
// transposes in 128-bit registers, and go straight into dequant's widening and stores: the
// same bits as dequant from the file's rows, without a copy of the rows in between.
template <class V, int QT>
void dequant16(const uint8_t* grp, int64_t K, int valid, void* out, bool bf16, int64_t ldo) {
  using L = Layout<QT>;
  constexpr int kCodes = QT == kQ4_1 ? 64 : QT == kQ5_0 ? 96 : 32;  // after d (and m, the fifth bits)
  const auto rows4 = [](const uint8_t* p, __m128i* r) {  // r[i]: row i's 16 bytes of 4 units at p
    const __m128i a0 = load16(p), a1 = load16(p + 64), a2 = load16(p + 128), a3 = load16(p + 192);
    const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3);
    const __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
    r[0] = _mm_unpacklo_epi64(t0, t1);
    r[1] = _mm_unpackhi_epi64(t0, t1);
    r[2] = _mm_unpacklo_epi64(t2, t3);
    r[3] = _mm_unpackhi_epi64(t2, t3);
  };
  for (int64_t b = 0; b < K / kUnit; ++b) {
    const uint8_t* blk = grp + b * 16 * L::kBytes;
    float d[16], m[16];
    halves16(blk, d);
    if constexpr (QT == kQ4_1) halves16(blk + 32, m);
    for (int q = 0; 4 * q < valid; ++q) {
      __m128i raw[4], raw2[4];
      rows4(blk + kCodes + 16 * q, raw);
      if constexpr (QT == kQ8_0) rows4(blk + kCodes + 256 + 16 * q, raw2);
      for (int r = 0; r < 4 && 4 * q + r < valid; ++r) {
        const int row = 4 * q + r;
        __m128i lo, hi;
        if constexpr (QT == kQ8_0) {
          lo = raw[r];
          hi = raw2[r];
        } else {
          uint32_t fifth = 0;
          if constexpr (QT == kQ5_0) std::memcpy(&fifth, blk + 32 + 4 * row, 4);
          nibble_codes32<QT>(raw[r], fifth, lo, hi);
        }
        const float mr = QT == kQ4_1 ? m[row] : 0.0f;
        typename V::reg w[32 / V::kLanes];
        V::template widen<L::kOffset>(lo, d[row], mr, w);
        V::template widen<L::kOffset>(hi, d[row], mr, w + 16 / V::kLanes);
        const int64_t at = row * ldo + b * kUnit;
        for (int v = 0; v < 32 / V::kLanes; ++v) {
          if (bf16)
            V::store_bf16(static_cast<uint16_t*>(out) + at + v * V::kLanes, w[v]);
          else
            V::store(static_cast<float*>(out) + at + v * V::kLanes, w[v]);
        }
      }
    }
  }
}

template <class V>
bool dequant_group16_simd(const uint8_t* grp, int qtype, int64_t K, int valid, void* out, bool bf16, int64_t ldo) {
  switch (qtype) {
    case kQ4_0: return dequant16<V, kQ4_0>(grp, K, valid, out, bf16, ldo), true;
    case kQ4_1: return dequant16<V, kQ4_1>(grp, K, valid, out, bf16, ldo), true;
    case kQ5_0: return dequant16<V, kQ5_0>(grp, K, valid, out, bf16, ldo), true;
    case kQ8_0: return dequant16<V, kQ8_0>(grp, K, valid, out, bf16, ldo), true;
    default: return false;  // the K types: the glue's copy of the rows
  }
}

template <class V>
void gemm_cols_simd(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes, int64_t M,
                    int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) { run<V, decltype(t)::value>(x, ldx, w, row_bytes, M, K, y, ldy, n0, n1); });
}

}  // namespace
}  // namespace pipefill_quant

// The ISA's gemm_cols and dequant_rows (declared in quant_gemm_kernel.h) on its vector type V, written inside its
// namespace by its translation unit.
#define PF_QUANT_GEMM_COLS(V)                                                                            \
  void gemm_cols(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes, int64_t M, \
                 int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {                             \
    gemm_cols_simd<V>(x, ldx, w, qtype, row_bytes, M, K, y, ldy, n0, n1);                                \
  }                                                                                                      \
  void dequant_rows(const uint8_t* w, int qtype, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1,  \
                    void* out, bool bf16, int64_t ldo) {                                                 \
    with_type(qtype, [&](auto t) { dequant<V, decltype(t)::value>(w, row_bytes, K, n0, n1, out, bf16, ldo); }); \
  }                                                                                                      \
  uint64_t stream_lines(const uint8_t* p, int64_t l0, int64_t l1, int64_t ahead) {                      \
    return xor_lines(p, l0, l1, ahead);                                                                  \
  }                                                                                                      \
  bool dequant_group16(const uint8_t* grp, int qtype, int64_t K, int valid, void* out, bool bf16,       \
                       int64_t ldo) {                                                                    \
    return dequant_group16_simd<V>(grp, qtype, K, valid, out, bf16, ldo);                               \
  }
