// Interface of the quantized decode GEMM's integer path (glue: quant_gemm.cpp; kernels:
// quant_int8_simd.h inside quant_gemm_avx2.cpp and quant_gemm_avx512vnni.cpp). Plain C++ (and
// SSE2, every x86-64's) only: the glue includes it.
//
// y[M, N] = x[M, K] @ W[N, K]^T with W as GGUF blocks (quant_gemm_kernel.h) and x quantized once
// per call: each row's natural blocks of 32 become int8 codes q = round(x / dx), dx = amax / 127
// (float32, rounded to nearest even), so x ~ dx q. A block of 32 weights w = d code (+ m)
// (- zero point) then gives
//     sum w x ~ d dx sum(code q) - d dx zero sum(q) + m dx sum(q),
// integer dot products (VNNI vpdpbusd: u8 x s8 -> s32; AVX2 vpmaddubsw + vpmaddwd) with the
// block's float scales applied once per block.
//
// Register layout ("a group" = 128 weights = 4 slots of 32): a kernel register holds, per
// 128-bit slot, 16 codes of one 32-weight unit; the group is two registers, "lo" and "hi", whose
// slots hold the same units, so the 32-bit lanes at one position of lo and hi belong to one unit
// (and, for Q6_K, to one 16-weight scale). The activations are laid out once per call to match
// (kind: 0 = slot s is unit s, lo its codes 0..15 and hi 16..31; 1 = Q4_K/Q5_K's nibble order,
// slots 0..3 are units 0, 2, 1, 3 of the group; 2 = Q6_K: lo holds codes 0..7 and 16..23 of a
// slot's unit, hi 8..15 and 24..31, so that a lane never straddles two of its 16-weight scales).
// Per 32-bit lane l of a group (16 lanes: slot l / 4), two arrays give what the lane's sum
// needs: dl = dx of its unit, and either nx = -zero * (the sum of its 8 codes q: 4 in lo, 4 in
// hi; the zero point's term, exact in int32: the integer sum's start) for the types with a zero
// point, or sl = dx * that sum (the offset term of Q4_1 and the K types' mins); no type has both.
// A row's K is padded to a whole number of groups with zero codes and zero scales.
//
// Records: one row's share of one group is one 256-byte record (lo codes, hi codes, dl, then nx
// or sl: 64 bytes each), stored group-major and row-minor: record (g, r) at rec + (g M + r) 256.
// A tile of rows then finds a group's activations at one address plus constant offsets (one
// pointer, no per-row address arithmetic), in consecutive lines; all M rows' records (2 bytes a
// weight a row: 24 KB for 8 rows of K = 1536) stay in L1/L2 while a task's columns stream by.
#pragma once
#include <emmintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_gemm_kernel.h"

namespace pipefill_quant {

constexpr int kGroup = 128;       // weights per group
constexpr int kLanesPerGroup = 16;  // 32-bit lanes of a group's sums

inline int64_t padded_k(int64_t K) { return (K + kGroup - 1) / kGroup * kGroup; }

constexpr int kRecBytes = 256;  // one record: codes lo, codes hi, dl, nx or sl
constexpr int kRecLo = 0, kRecHi = 64, kRecDl = 128, kRecExtra = 192;

// A call's quantized activations in the kernels' layout (records, above) for M rows of
// `groups` groups of 128.
struct Int8Rows {
  uint8_t* rec;
  int64_t M;
  int64_t groups;
  // The unit-lane layout (the 32-weight types, below): `full` steps of `wide` units, then one
  // of `last` units (0: none).
  int wide = 0;
  int64_t full = 0;
  int last = 0;
  uint8_t* at(int64_t g, int64_t r) const { return rec + (g * M + r) * kRecBytes; }
};

// The 32-weight types (Q4_0, Q4_1, Q5_0, Q8_0) take the unit-lane layout instead: a step of W
// units (W = 16 on zmm, 8 on ymm) puts unit u0 + g (W / 4) + s in 32-bit lane 4 s + g of its
// registers (s: the 128-bit slot, g = 0..3), one unit a lane, so a row's eight integer dot
// products over the step (32 codes a lane) land in one int32 register that needs one float
// scaling for W units (the group records need one per 4 units). A row's record for a step: eight
// code registers X_0..X_7 (X_i lane L: codes 4 i..4 i + 3 of L's unit for i < 4, 16 + 4 (i - 4)..
// for i >= 4), then dl, then nx or sl per lane (now over the unit's 32 codes): 40 W bytes,
// step-major and row-minor as the groups'. Units past K have zero codes and scales.
constexpr int kUnitRec = 40;  // record bytes per lane of a step

inline int64_t unit_step_units(const Int8Rows& a) { return a.full * a.wide + a.last; }

// Bytes of the scratch int8_scratch lays out for M rows of K (padded to kp): natural codes,
// scales, records, each 64-byte aligned.
inline size_t align64_bytes(size_t n) { return (n + 63) / 64 * 64; }
inline size_t int8_scratch_bytes(int64_t M, int64_t kp) {
  const size_t groups = (size_t)(M * kp / kGroup) * kRecBytes, lanes = (size_t)(M * (kp / kUnit + 16)) * kUnitRec;
  return align64_bytes((size_t)(M * kp)) + align64_bytes((size_t)(M * kp / kUnit) * 4) + (groups > lanes ? groups : lanes);
}

// The natural codes [M, kp], scales [M, kp / 32] and records of int8_scratch_bytes(M, kp) at
// base (64-byte aligned).
inline Int8Rows int8_scratch(void* base, int64_t M, int64_t kp, int8_t*& nat, float*& dx) {
  char* p = static_cast<char*>(base);
  nat = reinterpret_cast<int8_t*>(p);
  p += align64_bytes((size_t)(M * kp));
  dx = reinterpret_cast<float*>(p);
  p += align64_bytes((size_t)(M * kp / kUnit) * 4);
  return {reinterpret_cast<uint8_t*>(p), M, kp / kGroup};
}

// The activation layout a block type's kernel reads (see above).
inline int int8_kind(int qtype) { return qtype == kQ4_K || qtype == kQ5_K ? 1 : qtype == kQ6_K ? 2 : 0; }

// The zero point the kernels' unsigned codes hold (Q8_0: its codes + 128 on VNNI), or 0.
inline int int8_zero(int qtype) {
  return qtype == kQ4_0 ? 8 : qtype == kQ5_0 ? 16 : qtype == kQ6_K ? 32 : qtype == kQ8_0 ? 128 : 0;
}

namespace {

// Unit of the group in slot s of layout `kind`.
inline int slot_unit(int kind, int s) { return kind == 1 ? (s == 1 ? 2 : s == 2 ? 1 : s) : s; }

// Natural codes nat[kp] and scales dx[kp / 32] of one row -> the records of `qtype`'s kernel,
// row `r` of `rows`.
inline void lay_out_row(const int8_t* nat, const float* dx, int qtype, const Int8Rows& rows, int64_t r) {
  const int kind = int8_kind(qtype), zero = int8_zero(qtype);
  for (int64_t g = 0; g < rows.groups; ++g) {
    uint8_t* rec = rows.at(g, r);
    float* dl = reinterpret_cast<float*>(rec + kRecDl);
    int32_t* nx = reinterpret_cast<int32_t*>(rec + kRecExtra);
    float* sl = reinterpret_cast<float*>(rec + kRecExtra);
    for (int s = 0; s < 4; ++s) {
      const int64_t unit = 4 * g + slot_unit(kind, s);
      const int8_t* src = nat + 32 * unit;
      int8_t* lo = reinterpret_cast<int8_t*>(rec + kRecLo) + 16 * s;
      int8_t* hi = reinterpret_cast<int8_t*>(rec + kRecHi) + 16 * s;
      if (kind == 2) {
        std::memcpy(lo, src, 8);
        std::memcpy(lo + 8, src + 16, 8);
        std::memcpy(hi, src + 8, 8);
        std::memcpy(hi + 8, src + 24, 8);
      } else {
        std::memcpy(lo, src, 16);
        std::memcpy(hi, src + 16, 16);
      }
      for (int i = 0; i < 4; ++i) {
        int32_t sum = 0;
        for (int j = 0; j < 4; ++j) sum += lo[4 * i + j] + hi[4 * i + j];
        const int l = 4 * s + i;
        dl[l] = dx[unit];
        if (zero)
          nx[l] = -zero * sum;
        else
          sl[l] = dx[unit] * (float)sum;
      }
    }
  }
}

// The unit-lane layout of a row (the 32-weight types): steps of a.wide units, the last of
// a.last, from the natural codes nat (units of 32) and scales dx of K weights.
inline void lay_out_row_units(const int8_t* nat, const float* dx, int64_t K, int qtype, const Int8Rows& a, int64_t r) {
  const int zero = int8_zero(qtype);
  const int64_t units = K / kUnit;
  uint8_t* step = a.rec;
  for (int64_t j = 0, u0 = 0; j < a.full + (a.last ? 1 : 0); ++j) {
    const int W = j < a.full ? a.wide : a.last;
    uint8_t* rec = step + r * kUnitRec * W;
    float* dl = reinterpret_cast<float*>(rec + 32 * W);
    int32_t* nx = reinterpret_cast<int32_t*>(rec + 36 * W);
    float* sl = reinterpret_cast<float*>(rec + 36 * W);
    for (int lane = 0; lane < W; ++lane) {
      const int64_t u = u0 + (lane % 4) * (W / 4) + lane / 4;
      int32_t sum = 0;
      for (int i = 0; i < 8; ++i) {
        int8_t* x = reinterpret_cast<int8_t*>(rec + 4 * W * i + 4 * lane);
        const int c0 = i < 4 ? 4 * i : 16 + 4 * (i - 4);
        for (int k = 0; k < 4; ++k) {
          x[k] = u < units ? nat[32 * u + c0 + k] : 0;
          sum += x[k];
        }
      }
      const float d = u < units ? dx[u] : 0.0f;
      dl[lane] = d;
      if (zero)
        nx[lane] = -zero * sum;
      else
        sl[lane] = d * (float)sum;
    }
    u0 += W;
    step += a.M * kUnitRec * W;
  }
}

}  // namespace

// Each integer path's functions (namespaces avx2 and avx512vnni):
// int8_quantize: rows [0, M) of x (float32, row stride ldx) -> natural codes nat (row stride
// ldn) and scales dx (row stride ldd); where `rows` is given (ldn >= its kp), also zero padding
// up to kp and the layout of `qtype`'s kernel in *rows.
// int8_gemm_cols: columns [n0, n1) of y (row stride ldy, float32 sums, no bias) from the
// quantized rows and W's rows n at w + n * row_bytes.
#define PF_QUANT_INT8(ns)                                                                              \
  namespace ns {                                                                                       \
  void int8_quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int qtype, int8_t* nat,        \
                     int64_t ldn, float* dx, int64_t ldd, Int8Rows* rows);                             \
  void int8_gemm_cols(const Int8Rows& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes,    \
                      int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1);                       \
  }
PF_QUANT_INT8(avx2)
PF_QUANT_INT8(avx512vnni)
#undef PF_QUANT_INT8

// Each integer path's 16-row kernel (quant_int8_rows16.h on VNNI, quant_int8_rows16_avx2.h;
// the blocks held in the 16-row layout): rows16_records lays out the records it reads (48 bytes
// a unit and row) from the natural codes q and scales dx of `units` units a row;
// rows16_gemm_cols writes columns [n0, n1) of y (n0 a multiple of 16, n1 one too or N).
inline int rows16_extra_words(int qtype) { return qtype == kQ6_K ? 2 : 1; }
#define PF_QUANT_ROWS16(ns)                                                                            \
  namespace ns {                                                                                       \
  void rows16_records(int qtype, const int8_t* q, int64_t ldq, const float* dx, int64_t ldd, int64_t M, \
                      int64_t units, uint8_t* rec);                                                     \
  void rows16_gemm_cols(const uint8_t* rec, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes,  \
                        int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1);                     \
  }
PF_QUANT_ROWS16(avx2)
PF_QUANT_ROWS16(avx512vnni)
#undef PF_QUANT_ROWS16

// The 16-row layout's fields (as kernels/gguf_blocks.py's _ROWS16_FIELDS): per type, (first
// byte, end, unit bytes) of each field of a block, in the order the layout stores them.
struct Rows16Field {
  int lo, hi, unit;
};
inline int rows16_fields(int qtype, const Rows16Field*& f) {
  static const Rows16Field q4_0[] = {{0, 2, 2}, {2, 18, 4}}, q4_1[] = {{0, 2, 2}, {2, 4, 2}, {4, 20, 4}},
                           q5_0[] = {{0, 2, 2}, {2, 6, 4}, {6, 22, 4}}, q8_0[] = {{0, 2, 2}, {2, 34, 4}},
                           q4_k[] = {{0, 2, 2}, {2, 4, 2}, {4, 16, 4}, {16, 144, 4}},
                           q5_k[] = {{0, 2, 2}, {2, 4, 2}, {4, 16, 4}, {16, 48, 4}, {48, 176, 4}},
                           q6_k[] = {{0, 128, 4}, {128, 192, 4}, {192, 208, 4}, {208, 210, 2}};
  switch (qtype) {
    case kQ4_0: return f = q4_0, 2;
    case kQ4_1: return f = q4_1, 3;
    case kQ5_0: return f = q5_0, 3;
    case kQ8_0: return f = q8_0, 2;
    case kQ4_K: return f = q4_k, 4;
    case kQ5_K: return f = q5_k, 5;
    case kQ6_K: return f = q6_k, 4;
    default: return f = nullptr, 0;
  }
}

// Block columns [b0, b1) of one group of 16 rows held in the 16-row layout (the group's first
// byte at grp), back in the file's layout: row r's blocks b0 .. b1 - 1 at out + r (b1 - b0)
// block_bytes. Fields of 4-byte units go 4 units of 4 rows at a time, a 4 x 4 transpose of
// dwords in SSE2 registers (the glue's baseline); the 2-byte fields (d, m) and a field's last
// 1-3 units one move each.
inline void rows16_group_to_file(const uint8_t* grp, int qtype, int64_t b0, int64_t b1, uint8_t* out) {
  const Rows16Field* f;
  const int fields = rows16_fields(qtype, f), bb = block_bytes(qtype);
  const int64_t ldo = (b1 - b0) * bb;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* src = grp + b * 16 * bb;
    uint8_t* dst = out + (b - b0) * bb;
    for (int i = 0; i < fields; ++i) {
      const int lo = f[i].lo, hi = f[i].hi;
      int k = lo;
      if (f[i].unit == 4)
        for (; k + 16 <= hi; k += 16) {  // units (k - lo) / 4 .. + 3: 64 bytes (16 rows) each
          const uint8_t* u = src + (k - lo) * 16;
          for (int q = 0; q < 4; ++q) {  // rows 4 q .. 4 q + 3
            const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16 * q));
            const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 64 + 16 * q));
            const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 128 + 16 * q));
            const __m128i a3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192 + 16 * q));
            const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3);
            const __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
            uint8_t* row = dst + 4 * q * ldo + k;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row), _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row + ldo), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 2 * ldo), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 3 * ldo), _mm_unpackhi_epi64(t2, t3));
          }
        }
      if (f[i].unit == 4)  // constant sizes: one move each (a size known only at run time is a call)
        for (; k < hi; k += 4)
          for (int r = 0; r < 16; ++r) std::memcpy(dst + r * ldo + k, src + (k - lo) * 16 + r * 4, 4);
      else
        for (; k < hi; k += 2)
          for (int r = 0; r < 16; ++r) std::memcpy(dst + r * ldo + k, src + (k - lo) * 16 + r * 2, 2);
      src += 16 * (hi - lo);
    }
  }
}

}  // namespace pipefill_quant
