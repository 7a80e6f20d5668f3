// The integer path of the quantized decode GEMM, written once over the register width: included
// by quant_gemm_avx2.cpp (V: ymm, two slots, vpmaddubsw + vpmaddwd) and
// quant_gemm_avx512vnni.cpp (V: zmm, four slots, vpdpbusd). Layouts and arithmetic:
// quant_int8_kernel.h (the activations), quant_gemm_kernel.h (the blocks).
//
// Per group of 128 weights and register's worth of slots (a "chunk": the whole group on zmm,
// half of it on ymm), the blocks' codes are unpacked once into the lo and hi registers as
// unsigned bytes (the zero point left in: its term comes from the activations' sums, exactly)
// and the block scales into float lanes; then every row of the tile adds its integer dot
// products into one int32 register (the zero point's -zero * sum(q) as its start), converts it
// and adds it times d dx into its float sum (and, for offset types, m times dx sum(q) into a
// second one). So a tile of rows reads and unpacks each block once.
#pragma once
#include <immintrin.h>

#include "quant_int8_kernel.h"

namespace pipefill_quant {
namespace {

alignas(64) constexpr uint8_t kZeroBlock[64] = {};  // stands for the blocks past a row's end

inline __m128i bytes16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// What the integer kernels need to know of a block type.
template <int QT>
struct Int8Type {
  static constexpr int kKind = QT == kQ4_K || QT == kQ5_K ? 1 : QT == kQ6_K ? 2 : 0;
  static constexpr bool kZero = QT == kQ4_0 || QT == kQ5_0 || QT == kQ6_K || QT == kQ8_0;  // int8_zero
  static constexpr bool kOffset = Layout<QT>::kOffset;
};

// The codes and scales of one chunk (V::kSlots slots of a group) of one weight row.
template <class V, int QT>
struct Unpacker {
  using L = Layout<QT>;
  using ireg = typename V::ireg;
  using reg = typename V::reg;
  static constexpr int kS = V::kSlots;
  const uint8_t* row;
  int64_t units;  // 32-weight units in the row
  const uint8_t* blk[4];  // the 32-weight types: the group's blocks; K types: blk[0] its super-block
  int half = 0;  // K types: which half (group) of the super-block
  // The 32-weight types: d, m of slot s at 2 s, 2 s + 1 (m: the codes' bytes if none), widened
  // exactly by F16C (both builds have it).
  __m256 dm;
  float d[16], m[16];  // K types: the super-block's scale and offset per 16 weights

  __attribute__((always_inline)) void start(int64_t g) {
    if constexpr (L::kWeights == 32) {
      uint32_t halves[4];
      for (int s = 0; s < 4; ++s) {
        const int64_t u = 4 * g + s;
        blk[s] = u < units ? row + u * L::kBytes : kZeroBlock;
        std::memcpy(&halves[s], blk[s], 4);
      }
      // Widened in registers (a scalar store each would stall the vector load that reads them).
      dm = _mm256_cvtph_ps(_mm_setr_epi32((int)halves[0], (int)halves[1], (int)halves[2], (int)halves[3]));
    } else {
      half = (int)(g & 1);
      blk[0] = row + (g >> 1) * L::kBytes;
      if (half == 0) block_scales<QT>(blk[0], d, m);
    }
  }

  // lo, hi: the chunk's codes (unsigned); dv, mv: per lane the scale d and the offset m.
  __attribute__((always_inline)) void chunk(int c, ireg& lo, ireg& hi, reg& dv, reg& mv) const {
    float dh[2 * kS], mh[2 * kS];
    const uint8_t* p[kS];
    int shift[kS] = {};
    for (int t = 0; t < kS; ++t) {
      const int s = c * kS + t;
      if constexpr (L::kWeights == 32) {
        p[t] = blk[s];
        continue;
      }
      const int u = 4 * half + slot_unit(Int8Type<QT>::kKind, s);  // the slot's unit in the super-block
      dh[2 * t] = d[2 * u];
      dh[2 * t + 1] = d[2 * u + 1];
      mh[2 * t] = mh[2 * t + 1] = m[2 * u];
      if constexpr (QT == kQ6_K) {
        p[t] = blk[0] + 64 * half + 32 * (s & 1);
        shift[t] = 4 * (s >> 1);
      } else {
        p[t] = blk[0] + (QT == kQ4_K ? 16 : 48) + 32 * (u / 2);
        shift[t] = 4 * (u & 1);
      }
    }
    if constexpr (L::kWeights == 32) {
      dv = V::slot_lanes(dm, c, 0);
      if constexpr (Int8Type<QT>::kOffset) mv = V::slot_lanes(dm, c, 1);
    } else {
      dv = V::lanes(dh);
      if constexpr (Int8Type<QT>::kOffset) mv = V::lanes(mh);
    }
    const ireg f = V::set1(0x0f);
    if constexpr (QT == kQ8_0) {
      lo = V::gather(p, 2);
      hi = V::gather(p, 18);
      if constexpr (!V::kSignedQ8) {
        lo = V::xor_(lo, V::set1((char)0x80));
        hi = V::xor_(hi, V::set1((char)0x80));
      }
    } else if constexpr (L::kWeights == 32) {
      const ireg raw = V::gather(p, QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : 6);
      lo = V::and_(raw, f);
      hi = V::and_(V::srli16(raw, 4), f);
      if constexpr (QT == kQ5_0) {
        uint32_t bits[kS];
        for (int t = 0; t < kS; ++t) std::memcpy(&bits[t], p[t] + 2, 4);
        const ireg spread = V::slot_dwords(bits);
        lo = V::or_(lo, V::fifth_bits(spread, 0));
        hi = V::or_(hi, V::fifth_bits(spread, 2));
      }
    } else {
      lo = V::and_(V::srlv(V::gather(p, 0), shift), f);
      hi = V::and_(V::srlv(V::gather(p, 16), shift), f);
      if constexpr (QT != kQ4_K) {  // the high bit planes, moved to bit 4 up
        const uint8_t* planes[kS];
        int pshift[kS];
        for (int t = 0; t < kS; ++t) {
          const int s = c * kS + t;
          planes[t] = QT == kQ5_K ? blk[0] + 16 : blk[0] + 128 + 32 * half;
          pshift[t] = QT == kQ5_K ? 4 * half + slot_unit(1, s) : 2 * s;
        }
        const ireg mask = V::set1(QT == kQ5_K ? 1 : 3);
        lo = V::or_(lo, V::slli16(V::and_(V::srlv(V::gather(planes, 0), pshift), mask), 4));
        hi = V::or_(hi, V::slli16(V::and_(V::srlv(V::gather(planes, 16), pshift), mask), 4));
      }
      if constexpr (QT == kQ6_K) {  // codes 0..7 and 16..23 in lo, 8..15 and 24..31 in hi
        const ireg a = lo;
        lo = V::unpacklo64(a, hi);
        hi = V::unpackhi64(a, hi);
      }
    }
  }
};

// A tile of R rows x C columns (weight rows row, row + row_bytes, ...) over all of K. Per group
// and chunk, the C columns' blocks are unpacked once (codes, scales in registers) and every row
// loads its activations once (codes lo and hi, dl, nx or sl: one record, quant_int8_kernel.h)
// for all C columns: R C integer dot products then R C float scalings out of R loads of a record
// and C unpackings. One float32 sum a (row, column): the block scale's term and the offset's
// added into it in k order, lanes reduced at the end.
template <class V, int QT, int R, int C>
inline void int8_tile(const Int8Rows& a, int64_t m0, const uint8_t* row, int64_t row_bytes, int64_t K, float* y,
                      int64_t ldy) {
  using T = Int8Type<QT>;
  using reg = typename V::reg;
  using ireg = typename V::ireg;
  constexpr int kChunks = 4 / V::kSlots;
  constexpr bool kSigned = QT == kQ8_0 && V::kSignedQ8;
  reg acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  Unpacker<V, QT> up[C];
  for (int c = 0; c < C; ++c) {
    up[c].row = row + c * row_bytes;
    up[c].units = K / kUnit;
  }
  const int64_t group_bytes = Layout<QT>::kBytes * kGroup / Layout<QT>::kWeights;
  const uint8_t* rec = a.at(0, m0);
  const int64_t rec_step = a.M * kRecBytes;  // one group's records of all M rows
  for (int64_t g = 0; g < a.groups; ++g, rec += rec_step) {
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(up[c].row + (g + 8) * group_bytes), _MM_HINT_T0);
      up[c].start(g);
    }
    for (int ch = 0; ch < kChunks; ++ch) {
      ireg lo[C], hi[C];
      reg dv[C], mv[C];
      for (int c = 0; c < C; ++c) up[c].chunk(ch, lo[c], hi[c], dv[c], mv[c]);
      const int xo = 16 * V::kSlots * ch, lo4 = 4 * 4 * V::kSlots * ch;  // bytes into the codes, the lanes
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = rec + r * kRecBytes;
        const ireg xlo = V::loadi(p + kRecLo + xo), xhi = V::loadi(p + kRecHi + xo);
        const reg dl = V::load(reinterpret_cast<const float*>(p + kRecDl + lo4));
        for (int c = 0; c < C; ++c) {
          ireg isum;
          if constexpr (kSigned) {
            isum = V::dot_signed(lo[c], hi[c], xlo, xhi);
          } else {
            const ireg start = T::kZero ? V::loadi(p + kRecExtra + lo4) : V::zeroi();
            isum = V::dot(start, lo[c], hi[c], xlo, xhi);
          }
          acc[r][c] = V::fmadd(V::cvt(isum), V::mul(dv[c], dl), acc[r][c]);
          if constexpr (T::kOffset)
            acc[r][c] = V::fmadd(mv[c], V::load(reinterpret_cast<const float*>(p + kRecExtra + lo4)), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = V::sum(acc[r][c], V::zero());
}

// The tile for `rows` (1..R) rows.
template <class V, int QT, int R, int C>
inline void int8_rows_tile(const Int8Rows& a, int64_t m0, const uint8_t* row, int64_t row_bytes, int64_t K,
                           float* y, int64_t ldy, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return int8_rows_tile<V, QT, R - 1, C>(a, m0, row, row_bytes, K, y, ldy, rows);
  }
  int8_tile<V, QT, R, C>(a, m0, row, row_bytes, K, y, ldy);
}

// Columns [n0, n1) in tiles of V::kCols columns x V::kRows rows: the row tiles of a column
// tile follow each other, so the ones after the first find its blocks in L1; the records of
// all M rows are read once per column tile and stay cached (quant_int8_kernel.h).
template <class V>
void int8_gemm_cols_simd(const Int8Rows& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes, int64_t K,
                         float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) {
    constexpr int QT = decltype(t)::value;
    for (int64_t n = n0; n < n1; n += V::kCols) {
      const bool whole = n1 - n >= V::kCols;
      for (int64_t m0 = 0; m0 < M; m0 += V::kRows) {
        const int64_t rows = M - m0 < V::kRows ? M - m0 : V::kRows;
        const uint8_t* row = w + n * row_bytes;
        float* yt = y + m0 * ldy + n;
        if (whole) {
          int8_rows_tile<V, QT, V::kRows, V::kCols>(a, m0, row, row_bytes, K, yt, ldy, rows);
        } else {
          for (int64_t c = 0; c < n1 - n; ++c)
            int8_rows_tile<V, QT, V::kRows, 1>(a, m0, row + c * row_bytes, row_bytes, K, yt + c, ldy, rows);
        }
      }
    }
  });
}

template <class V>
void int8_quantize_simd(const float* x, int64_t ldx, int64_t M, int64_t K, int qtype, int8_t* nat, int64_t ldn,
                        float* dx, int64_t ldd, const Int8Rows* rows) {
  for (int64_t r = 0; r < M; ++r) {
    int8_t* q = nat + r * ldn;
    float* d = dx + r * ldd;
    for (int64_t b = 0; b < K / kUnit; ++b) d[b] = V::quantize32(x + r * ldx + b * kUnit, q + b * kUnit);
    if (rows) {
      const int64_t kp = rows->groups * kGroup;
      std::memset(q + K, 0, (size_t)(kp - K));
      for (int64_t b = K / kUnit; b < kp / kUnit; ++b) d[b] = 0.0f;
      lay_out_row(q, d, qtype, *rows, r);
    }
  }
}

}  // namespace
}  // namespace pipefill_quant

// The path's int8_quantize and int8_gemm_cols (quant_int8_kernel.h) on its vector type V,
// written inside its namespace by its translation unit.
#define PF_QUANT_INT8_COLS(V)                                                                          \
  void int8_quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int qtype, int8_t* nat,        \
                     int64_t ldn, float* dx, int64_t ldd, const Int8Rows* rows) {                      \
    int8_quantize_simd<V>(x, ldx, M, K, qtype, nat, ldn, dx, ldd, rows);                               \
  }                                                                                                    \
  void int8_gemm_cols(const Int8Rows& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes,    \
                      int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {                      \
    int8_gemm_cols_simd<V>(a, M, w, qtype, row_bytes, K, y, ldy, n0, n1);                              \
  }
