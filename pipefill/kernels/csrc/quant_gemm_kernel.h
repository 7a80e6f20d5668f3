// Interface between the quantized decode-GEMM glue (quant_gemm.cpp, built without ISA flags) and
// the per-ISA translation units quant_gemm_{scalar,avx2,avx512}.cpp (each built with its own -m
// flags and entered only after the glue's cpuid/XCR0 check for that ISA). Plain C++ only.
//
// y[M, N] = x[M, K] @ W[N, K]^T for small M, W held as GGUF blocks exactly as in the file: row n
// of W is K / block_weights blocks of block_bytes each (ggml's block layouts; f16 = IEEE half):
//   Q4_0  32 weights, 18 bytes: f16 d, 16 nibble bytes; w = (q - 8) d
//   Q4_1  32 weights, 20 bytes: f16 d, f16 m, 16 nibble bytes; w = q d + m
//   Q5_0  32 weights, 22 bytes: f16 d, 4 bytes of fifth bits (bit j: weight j), 16 nibble bytes;
//         w = (q - 16) d
//   Q8_0  32 weights, 34 bytes: f16 d, 32 int8; w = q d
//   (a nibble byte j of these holds weight j in its low nibble and j + 16 in its high nibble)
//   Q4_K  256 weights, 144 bytes: f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min) pairs,
//         128 nibble bytes; sub-block s (weights 32s..32s+31) has w = (d sc_s) q - (dmin min_s);
//         its nibbles are the low (s even) or high (s odd) halves of bytes 32 (s / 2) .. +31
//   Q5_K  256 weights, 176 bytes: as Q4_K with 32 bytes of fifth bits after the scales (bit s of
//         byte j: weight 32s + j) and the 128 nibble bytes after those
//   Q6_K  256 weights, 210 bytes: 128 low-nibble bytes, 64 bytes of 2-bit highs, 16 int8 scales
//         (one per 16 weights), f16 d last; w = (d sc) (q - 32)
// The 6-bit pairs of Q4_K/Q5_K: pair s < 4 is (b[s] & 63, b[s + 4] & 63); pair s >= 4 is
// (b[s + 4] & 15 | (b[s - 4] >> 6) << 4, b[s + 4] >> 4 | (b[s] >> 6) << 4).
//
// Every path dequantizes in 32-weight units (a block of the 32-weight types, a sub-block of the
// K types): the unit's 32 integer codes and, per half unit (16 weights), a float32 scale d and
// offset m, w = code d (+ m). Those are ggml's float32 operations in its order (d sc first,
// then times the code, then the offset: -(dmin min) added is dmin min subtracted), so every
// path gets the gguf Python package's exact bits. Each path multiplies them by the float32
// activations; every output is one float32 sum per (row, column) over the units in k order,
// lane sums reduced at the end. The ISAs reduce in different lane orders, so their results
// differ by float32 rounding only.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pipefill_quant {

// GGML type ids (as in the GGUF file).
constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ5_0 = 6;
constexpr int kQ8_0 = 8;
constexpr int kQ4_K = 12;
constexpr int kQ5_K = 13;
constexpr int kQ6_K = 14;
constexpr int kUnit = 32;       // weights per dequantization unit
constexpr int kMaxBlock = 256;  // weights per block, at most

// What the paths need to know of a block type at compile time.
template <int QT>
struct Layout {
  static constexpr int kWeights = QT >= kQ4_K ? 256 : 32;
  static constexpr int kUnits = kWeights / kUnit;
  static constexpr int kBytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : QT == kQ5_0 ? 22
                                : QT == kQ8_0 ? 34 : QT == kQ4_K ? 144 : QT == kQ5_K ? 176 : 210;
  static constexpr bool kOffset = QT == kQ4_1 || QT == kQ4_K || QT == kQ5_K;  // w = q d + m
};

// The functions below have internal linkage (an unnamed namespace): each translation unit keeps
// its own copy, compiled with its own flags, so the linker can never hand the glue (built for
// any x86-64) a copy compiled with AVX-512.
namespace {

// f(std::integral_constant<int, QT>) for a runtime type id; false for a type not read here.
template <typename F>
inline bool with_type(int qtype, const F& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); return true;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); return true;
    case kQ5_0: f(std::integral_constant<int, kQ5_0>{}); return true;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); return true;
    case kQ4_K: f(std::integral_constant<int, kQ4_K>{}); return true;
    case kQ5_K: f(std::integral_constant<int, kQ5_K>{}); return true;
    case kQ6_K: f(std::integral_constant<int, kQ6_K>{}); return true;
    default: return false;
  }
}

inline int block_bytes(int qtype) {
  int bytes = 0;
  with_type(qtype, [&](auto t) { bytes = Layout<decltype(t)::value>::kBytes; });
  return bytes;
}

inline int block_weights(int qtype) {
  int weights = 0;
  with_type(qtype, [&](auto t) { weights = Layout<decltype(t)::value>::kWeights; });
  return weights;
}

// IEEE half -> float, exactly (normals, subnormals, inf, NaN), in integer code so that no ISA
// flag (F16C) and no denormal mode of the FPU changes it.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Q4_K/Q5_K: the 6-bit (scale, min) pair of sub-block s from the 12 packed bytes q.
inline void scale_min_k4(int s, const uint8_t* q, int& sc, int& mn) {
  if (s < 4) {
    sc = q[s] & 63;
    mn = q[s + 4] & 63;
  } else {
    sc = (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
    mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

// A block's scale d[h] and offset m[h] of each half unit h (16 weights; 2 per unit): weight j of
// unit u is code * d[2u + j / 16] (+ m[2u + j / 16] where Layout::kOffset). Built with
// -ffp-contract=off: each product is rounded as ggml's.
template <int QT>
inline void block_scales(const uint8_t* b, float* d, float* m) {
  constexpr int kHalves = 2 * Layout<QT>::kUnits;
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const float dd = half_at(b), dmin = half_at(b + 2);
    for (int s = 0; s < Layout<QT>::kUnits; ++s) {
      int sc, mn;
      scale_min_k4(s, b + 4, sc, mn);
      d[2 * s] = d[2 * s + 1] = dd * (float)sc;
      m[2 * s] = m[2 * s + 1] = -(dmin * (float)mn);
    }
  } else if constexpr (QT == kQ6_K) {
    const float dd = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < kHalves; ++h) {
      d[h] = dd * (float)sc[h];
      m[h] = 0.0f;  // no offset (unused)
    }
  } else {
    d[0] = d[1] = half_at(b);
    m[0] = m[1] = QT == kQ4_1 ? half_at(b + 2) : 0.0f;
  }
}

// The 32 codes of unit u of a block, one byte at a time (the scalar path and the glue's
// dequantization; the vector paths decode the same bits 16 at a time, quant_gemm_simd.h).
template <int QT>
inline void unit_codes(const uint8_t* b, int u, int8_t* q) {
  if constexpr (QT == kQ8_0) {
    std::memcpy(q, b + 2, kUnit);
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0) {
    const uint8_t* nib = b + (QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : 6);
    uint32_t fifth = 0;
    if (QT == kQ5_0) std::memcpy(&fifth, b + 2, 4);
    const int zero = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : 0;
    for (int j = 0; j < 16; ++j) {
      q[j] = (int8_t)(((nib[j] & 15) | ((fifth >> j) & 1) << 4) - zero);
      q[j + 16] = (int8_t)(((nib[j] >> 4) | ((fifth >> (j + 16)) & 1) << 4) - zero);
    }
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const uint8_t* nib = b + (QT == kQ4_K ? 16 : 48) + 32 * (u / 2);
    const int shift = 4 * (u & 1);
    for (int j = 0; j < kUnit; ++j) {
      const int fifth = QT == kQ5_K ? ((b[16 + j] >> u) & 1) << 4 : 0;
      q[j] = (int8_t)(((nib[j] >> shift) & 15) | fifth);
    }
  } else {  // Q6_K: unit u = 4 h + g of half h (128 weights)
    const int h = u / 4, g = u % 4;
    const uint8_t* low = b + 64 * h + 32 * (g & 1);
    const uint8_t* high = b + 128 + 32 * h;
    for (int j = 0; j < kUnit; ++j)
      q[j] = (int8_t)((((low[j] >> (4 * (g >> 1))) & 15) | (((high[j] >> (2 * g)) & 3) << 4)) - 32);
  }
}

// float32 -> bf16, rounded to nearest even (finite x: weights are).
inline uint16_t bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One block's weights as float32 (the scalar path's).
template <int QT>
inline void dequant_block(const uint8_t* b, float* out) {
  float d[2 * Layout<QT>::kUnits], m[2 * Layout<QT>::kUnits];
  block_scales<QT>(b, d, m);
  int8_t q[kUnit];
  for (int u = 0; u < Layout<QT>::kUnits; ++u) {
    unit_codes<QT>(b, u, q);
    for (int j = 0; j < kUnit; ++j) {
      const int h = 2 * u + j / 16;
      const float w = (float)q[j] * d[h];
      out[u * kUnit + j] = Layout<QT>::kOffset ? w + m[h] : w;
    }
  }
}

// Lines [l0, l1) of 64 bytes at p read once, on loads as wide as the build's GEMMs use (one
// line a load on AVX-512, two on AVX2, eight words on the scalar build): the read bandwidth a
// decode GEMM at M = 1 can reach. `ahead` > 0 asks for the line that many lines ahead first.
// Returns the xor of the lines' 64-bit words, which keeps the reads from being dropped.
inline uint64_t xor_lines(const uint8_t* p, int64_t l0, int64_t l1, int64_t ahead) {
#if defined(__AVX512F__)
  __m512i a = _mm512_setzero_si512(), b = a;
  int64_t l = l0;
  for (; l + 1 < l1; l += 2) {
    if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * (l + ahead)), _MM_HINT_T0);
    a = _mm512_xor_si512(a, _mm512_load_si512(p + 64 * l));
    b = _mm512_xor_si512(b, _mm512_load_si512(p + 64 * (l + 1)));
  }
  if (l < l1) a = _mm512_xor_si512(a, _mm512_load_si512(p + 64 * l));
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, _mm512_xor_si512(a, b));
#elif defined(__AVX2__)
  __m256i a = _mm256_setzero_si256(), b = a;
  for (int64_t l = l0; l < l1; ++l) {
    if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * (l + ahead)), _MM_HINT_T0);
    a = _mm256_xor_si256(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 64 * l)));
    b = _mm256_xor_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 64 * l + 32)));
  }
  alignas(32) uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), _mm256_xor_si256(a, b));
#else
  uint64_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t l = l0; l < l1; ++l)
    for (int j = 0; j < 8; ++j) {
      uint64_t v;
      std::memcpy(&v, p + 64 * l + 8 * j, 8);
      w[j] ^= v;
    }
  (void)ahead;
#endif
  uint64_t folded = 0;
  for (uint64_t v : w) folded ^= v;
  return folded;
}

}  // namespace

// Each ISA's functions, on W's row n at w + n * row_bytes (K a multiple of the type's
// block_weights): gemm_cols computes columns [n0, n1) of all M rows, y[m * ldy + n] = the
// float32 sum (no bias: the glue adds it), x float32 [M, ldx].
// dequant_rows writes rows [n0, n1) of W dequantized (each weight's float32 value as
// dequant_block computes it) to out (row stride ldo): float32, or bf16 rounded to nearest even
// where `bf16` (prefill's per-call copy). dequant_group16 does that for the first `valid` rows
// of one group of 16 held in the 16-row layout (grp: its first byte; out: its first row), the
// same bits, straight from the layout; false where the ISA or the type has no such code (the
// glue then copies the rows back first).
#define PF_QUANT_GEMM(ns)                                                                        \
  namespace ns {                                                                                 \
  void gemm_cols(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes,  \
                 int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1);          \
  void dequant_rows(const uint8_t* w, int qtype, int64_t row_bytes, int64_t K, int64_t n0,      \
                    int64_t n1, void* out, bool bf16, int64_t ldo);                            \
  uint64_t stream_lines(const uint8_t* p, int64_t l0, int64_t l1, int64_t ahead);              \
  bool dequant_group16(const uint8_t* grp, int qtype, int64_t K, int valid, void* out,         \
                       bool bf16, int64_t ldo);                                                \
  }
PF_QUANT_GEMM(scalar)
PF_QUANT_GEMM(avx2)
PF_QUANT_GEMM(avx512)
#undef PF_QUANT_GEMM

}  // namespace pipefill_quant
