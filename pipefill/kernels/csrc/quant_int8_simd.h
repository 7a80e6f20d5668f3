// The integer path of the quantized decode GEMM, written once over the register width: included
// by quant_gemm_avx2.cpp (V: ymm, two slots, vpmaddubsw + vpmaddwd) and
// quant_gemm_avx512vnni.cpp (V: zmm, four slots, vpdpbusd). Layouts and arithmetic:
// quant_int8_kernel.h (the activations), quant_gemm_kernel.h (the blocks).
//
// Two kernels, both reading each weight block once per tile of rows (V::kRows: 8 on zmm, 4 on
// ymm) and each row's quantized activations once per column, with one pointer a tile (the
// records of quant_int8_kernel.h: a tile's rows of one group or step are consecutive):
// * the group kernel (the K types, and the 32-weight types on rows too short for the other):
//   per group of 128 weights and register's worth of slots (a "chunk": the whole group on zmm,
//   half of it on ymm), the blocks' codes are unpacked once into the lo and hi registers as
//   unsigned bytes (the zero point left in: its term comes from the activations' sums, exactly)
//   and the block scales into float lanes; then every row of the tile adds its integer dot
//   products into one int32 register (the zero point's -zero * sum(q) as its start), converts
//   it and adds it times d dx into its float sum (and, for offset types, m times dx sum(q)).
//   Per row and group: 2 dot products and 3-4 float operations on 16 lanes of which only 4
//   hold distinct scales.
// * the unit-lane kernel (the 32-weight types): a step's blocks are transposed in registers so
//   that each lane holds one block, and a row's 8 dot products over the step need one float
//   scaling for 16 blocks: per row and 128 weights, 2 dot products and under 1 float operation.
// Why this blocking: a decode call reads every weight once from memory (the bytes that set its
// time at M = 1), so the columns run one at a time, all row tiles of a column back to back (the
// second tile finds the column's blocks in L1), and the activations, quantized once a call into
// records of 2 (groups) or 1.25 (unit lanes) bytes a weight a row, are what every column
// re-reads: for 8 rows of K = 1536 that is 15-24 KB, which stays in L1 (L2 for larger M or K)
// across the columns. Blocking two or three columns a tile (sharing the records' loads)
// measured no faster: a tile is bound by its integer and float operations, not by its loads,
// which is what the unit lanes cut.
#pragma once
#include <immintrin.h>

#include <type_traits>

#include "quant_int8_kernel.h"
#include "quant_simd_common.h"

namespace pipefill_quant {
namespace {

alignas(64) constexpr uint8_t kZeroBlock[64] = {};  // stands for the blocks past a row's end

// The integer path's ymm ops, two 128-bit slots a register (AVX2; the VNNI build's half step
// adds vpdpbusd on ymm): the AVX2 path's register type and the VNNI path's half step.
struct I256Ops {
  using ireg = __m256i;
  using reg = __m256;
  static constexpr int kSlots = 2;
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
  static ireg unpacklo32(ireg a, ireg b) { return _mm256_unpacklo_epi32(a, b); }
  static ireg unpackhi32(ireg a, ireg b) { return _mm256_unpackhi_epi32(a, b); }
  static ireg shuffle8(ireg a, __m128i idx) { return _mm256_shuffle_epi8(a, _mm256_broadcastsi128_si256(idx)); }
  static ireg min_u8(ireg a, ireg b) { return _mm256_min_epu8(a, b); }
  static ireg set1_64(uint64_t v) { return _mm256_set1_epi64x((long long)v); }
  static ireg gather(const uint8_t* const* p, int off) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p[0] + off)), load16(p[1] + off), 1);
  }
  static ireg srlv(ireg a, const int* sh) { return _mm256_srlv_epi64(a, _mm256_set_epi64x(sh[1], sh[1], sh[0], sh[0])); }
  static ireg slot_dwords(const uint32_t* v) { return _mm256_set_epi32(v[1], v[1], v[1], v[1], v[0], v[0], v[0], v[0]); }
  // Lane l = v[2 (2 c + l / 4) + odd]: chunk c's slot's d (odd 0) or m (odd 1).
  static reg slot_lanes(__m256 v, int c, int odd) {
    const __m256i idx = _mm256_add_epi32(_mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0), _mm256_set1_epi32(4 * c + odd));
    return _mm256_permutevar8x32_ps(v, idx);
  }
  static reg lanes(const float* h) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(h)), _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0));
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
  static float sum(reg a, reg b) { return sum256(a, b); }
  static ireg addi(ireg a, ireg b) { return _mm256_add_epi32(a, b); }
  static ireg srli32(ireg a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
  // Lane l = v[l] (a step's per-block words, unit-lane order).
  static ireg dwords(const uint32_t* v) {
    return _mm256_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5], (int)v[6], (int)v[7]);
  }
  // The IEEE halves in the low 16 bits of every lane -> float32, exactly.
  static reg halves_low(ireg v) {
    const ireg low = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
  }
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

// In every 128-bit slot, the 4 x 4 dwords of r[0..3] transposed: r[i] dword g = old r[g] dword i.
template <class V>
inline void transpose4(typename V::ireg* r) {
  const auto t0 = V::unpacklo32(r[0], r[1]), t1 = V::unpackhi32(r[0], r[1]);
  const auto t2 = V::unpacklo32(r[2], r[3]), t3 = V::unpackhi32(r[2], r[3]);
  r[0] = V::unpacklo64(t0, t2);
  r[1] = V::unpackhi64(t0, t2);
  r[2] = V::unpacklo64(t1, t3);
  r[3] = V::unpackhi64(t1, t3);
}

// 0x10 in every byte of v that has a bit of `sel` set, else 0 (a fifth bit moved to bit 4).
template <class V>
inline typename V::ireg bit4_where(typename V::ireg v, typename V::ireg sel) {
  return V::slli16(V::min_u8(V::and_(v, sel), V::set1(1)), 4);
}

// 0x10 in byte j of each slot where bit j of the slot's bytes first, first + 1 (of `spread`,
// V::slot_dwords) is set: the group kernel's Q5_0 fifth bits.
template <class V>
inline typename V::ireg fifth_bits(typename V::ireg spread, int first) {
  const __m128i idx = _mm_set_epi64x(0x0101010101010101ll * (first + 1), 0x0101010101010101ll * first);
  return bit4_where<V>(V::shuffle8(spread, idx), V::set1_64(0x8040201008040201ull));
}

// 0x10 in byte k of a lane where bit first + k of the lane's dword in `bits` is set: the unit
// lanes' Q5_0 fifth bits.
template <class V>
inline typename V::ireg lane_bits(typename V::ireg bits, int first) {
  const __m128i idx = _mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c);
  return bit4_where<V>(V::shuffle8(V::srli32(bits, first), idx), V::set1_64(0x0804020108040201ull));
}

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
        lo = V::or_(lo, fifth_bits<V>(spread, 0));
        hi = V::or_(hi, fifth_bits<V>(spread, 2));
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

// One step of a weight row of a 32-weight type on unit lanes (quant_int8_kernel.h): the W =
// 4 V::kSlots blocks from unit u0, block u0 + g (W / 4) + s in lane 4 s + g. The blocks are read
// four slots at a time as they lie (register g: the blocks g (W / 4) + s, 16 bytes a slot), then
// each slot's 4 x 4 dwords are transposed (8 in-slot unpacks), so that code register i holds
// dword i of every block: cI[i] the codes paired with X_i, cI[4 + i] those paired with X_{4+i}.
// dv, mv: the blocks' d and m (Q4_1) per lane, widened exactly by F16C.
template <class V, int QT>
struct UnitStep {
  using ireg = typename V::ireg;
  using reg = typename V::reg;
  static constexpr int kS = V::kSlots, kW = 4 * kS;
  ireg c[8];
  reg dv, mv;

  __attribute__((always_inline)) void unpack(const uint8_t* row, int64_t units, int64_t u0) {
    using L = Layout<QT>;
    const uint8_t* blk[4][kS];
    uint32_t word[kW], fifth[kW];
    const bool inside = u0 + kW <= units;  // no block past the row's end
    for (int g = 0; g < 4; ++g)
      for (int s = 0; s < kS; ++s) {
        const int64_t u = u0 + g * kS + s;
        blk[g][s] = inside || u < units ? row + u * L::kBytes : kZeroBlock;
        std::memcpy(&word[4 * s + g], blk[g][s], 4);
        if constexpr (QT == kQ5_0) std::memcpy(&fifth[4 * s + g], blk[g][s] + 2, 4);
      }
    const ireg words = V::dwords(word);
    dv = V::halves_low(words);
    if constexpr (QT == kQ4_1) mv = V::halves_low(V::srli32(words, 16));
    if constexpr (QT == kQ8_0) {
      for (int g = 0; g < 4; ++g) {
        c[g] = V::gather(blk[g], 2);
        c[4 + g] = V::gather(blk[g], 18);
      }
      transpose4<V>(c);
      transpose4<V>(c + 4);
      if constexpr (!V::kSignedQ8)
        for (int i = 0; i < 8; ++i) c[i] = V::xor_(c[i], V::set1((char)0x80));
    } else {
      ireg raw[4];
      for (int g = 0; g < 4; ++g) raw[g] = V::gather(blk[g], QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : 6);
      transpose4<V>(raw);
      const ireg f = V::set1(0x0f);
      for (int i = 0; i < 4; ++i) {
        c[i] = V::and_(raw[i], f);
        c[4 + i] = V::and_(V::srli16(raw[i], 4), f);
      }
      if constexpr (QT == kQ5_0) {
        const ireg bits = V::dwords(fifth);
        for (int i = 0; i < 4; ++i) {
          c[i] = V::or_(c[i], lane_bits<V>(bits, 4 * i));
          c[4 + i] = V::or_(c[4 + i], lane_bits<V>(bits, 16 + 4 * i));
        }
      }
    }
  }
};

// acc[r] += rows m0..m0 + R - 1 of one step (the records at rec, kUnitRec V's W bytes a row)
// times the unpacked step w: eight integer dot products a row (the zero point's -zero sum(q)
// as their start), then one float scaling for the step's W units (and Q4_1's m dx sum(q)).
template <class V, int QT, int R>
__attribute__((always_inline)) inline void unit_rows(const UnitStep<V, QT>& w, const uint8_t* rec,
                                                     typename V::reg* acc) {
  using T = Int8Type<QT>;
  using ireg = typename V::ireg;
  constexpr int W = UnitStep<V, QT>::kW;
  constexpr bool kSigned = QT == kQ8_0 && V::kSignedQ8;
  // Register i of every row before register i + 1 of any: the rows' chains of dot products
  // (eight deep) interleave, so their latency hides behind the other rows' work; a tile of
  // fewer than 4 rows splits each row's chain in kC (summed at the end) for the same reason.
  constexpr int kC = R >= 4 ? 1 : R >= 2 ? 2 : 4;
  ireg isum[R][kC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c)
      isum[r][c] = c == 0 && T::kZero && !kSigned ? V::loadi(rec + r * kUnitRec * W + 36 * W) : V::zeroi();
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = rec + r * kUnitRec * W;
      const ireg xlo = V::loadi(p + 4 * W * i), xhi = V::loadi(p + 4 * W * (4 + i));
      ireg& sum = isum[r][i % kC];
      if constexpr (kSigned)
        sum = V::addi(sum, V::dot_signed(w.c[i], w.c[4 + i], xlo, xhi));
      else
        sum = V::dot(sum, w.c[i], w.c[4 + i], xlo, xhi);
    }
  for (int r = 0; r < R; ++r)
    for (int c = 1; c < kC; ++c) isum[r][0] = V::addi(isum[r][0], isum[r][c]);
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = rec + r * kUnitRec * W;
    acc[r] = V::fmadd(V::cvt(isum[r][0]), V::mul(w.dv, V::load(reinterpret_cast<const float*>(p + 32 * W))), acc[r]);
    if constexpr (T::kOffset)
      acc[r] = V::fmadd(w.mv, V::load(reinterpret_cast<const float*>(p + 36 * W)), acc[r]);
  }
}

// R rows (from m0) of one column of a 32-weight type: the full steps on V, the last on V or
// V::Half (where a.last is half a step: half the register width, half the cost for the units
// past the last whole step). Each step is unpacked once for the R rows; a row's records are
// read once per column, in order (all M rows: 1.25 bytes a weight, in L1/L2 across columns).
template <class V, int QT, int R>
inline void unit_tile(const Int8Rows& a, int64_t m0, const uint8_t* row, int64_t K, float* y, int64_t ldy) {
  using H = typename V::Half;
  constexpr int W = UnitStep<V, QT>::kW;
  typename V::reg acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::zero();
  const int64_t units = K / kUnit;
  const uint8_t* step = a.rec;
  int64_t u0 = 0;
  const int64_t whole = a.full + (a.last == W ? 1 : 0);
  for (int64_t j = 0; j < whole; ++j, u0 += W, step += a.M * kUnitRec * W) {
    _mm_prefetch(reinterpret_cast<const char*>(row + (u0 + 2 * W) * Layout<QT>::kBytes), _MM_HINT_T0);
    UnitStep<V, QT> w;
    w.unpack(row, units, u0);
    unit_rows<V, QT, R>(w, step + m0 * kUnitRec * W, acc);
  }
  if constexpr (!std::is_same_v<H, V>) {
    if (a.last && a.last != W) {  // half a step: its sums join the low half of acc
      typename H::reg hacc[R];
      for (int r = 0; r < R; ++r) hacc[r] = H::zero();
      UnitStep<H, QT> w;
      w.unpack(row, units, u0);
      unit_rows<H, QT, R>(w, step + m0 * kUnitRec * (W / 2), hacc);
      for (int r = 0; r < R; ++r) acc[r] = V::add_half(acc[r], hacc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = V::sum(acc[r], V::zero());
}

// A tile of R rows of one column (weight row `row`) of a K type over all of K. Per group and
// chunk, the blocks are unpacked once (codes, scales in registers) and every row loads its
// activations once (codes lo and hi, dl, nx or sl: one record, quant_int8_kernel.h): R integer
// dot products then R float scalings per unpacking. One float32 sum a row: the block scale's
// term and the offset's added into it in k order, lanes reduced at the end.
template <class V, int QT, int R>
inline void int8_tile(const Int8Rows& a, int64_t m0, const uint8_t* row, int64_t K, float* y, int64_t ldy) {
  using T = Int8Type<QT>;
  using reg = typename V::reg;
  using ireg = typename V::ireg;
  constexpr int kChunks = 4 / V::kSlots;
  constexpr bool kSigned = QT == kQ8_0 && V::kSignedQ8;
  reg acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::zero();
  Unpacker<V, QT> up;
  up.row = row;
  up.units = K / kUnit;
  const int64_t group_bytes = Layout<QT>::kBytes * kGroup / Layout<QT>::kWeights;
  const uint8_t* rec = a.at(0, m0);
  const int64_t rec_step = a.M * kRecBytes;  // one group's records of all M rows
  for (int64_t g = 0; g < a.groups; ++g, rec += rec_step) {
    _mm_prefetch(reinterpret_cast<const char*>(row + (g + 8) * group_bytes), _MM_HINT_T0);
    up.start(g);
    for (int ch = 0; ch < kChunks; ++ch) {
      ireg lo, hi;
      reg dv, mv;
      up.chunk(ch, lo, hi, dv, mv);
      const int xo = 16 * V::kSlots * ch, lo4 = 4 * 4 * V::kSlots * ch;  // bytes into the codes, the lanes
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = rec + r * kRecBytes;
        const ireg xlo = V::loadi(p + kRecLo + xo), xhi = V::loadi(p + kRecHi + xo);
        ireg isum;
        if constexpr (kSigned)
          isum = V::dot_signed(lo, hi, xlo, xhi);
        else
          isum = V::dot(T::kZero ? V::loadi(p + kRecExtra + lo4) : V::zeroi(), lo, hi, xlo, xhi);
        const reg dl = V::load(reinterpret_cast<const float*>(p + kRecDl + lo4));
        acc[r] = V::fmadd(V::cvt(isum), V::mul(dv, dl), acc[r]);
        if constexpr (T::kOffset)
          acc[r] = V::fmadd(mv, V::load(reinterpret_cast<const float*>(p + kRecExtra + lo4)), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = V::sum(acc[r], V::zero());
}

// Columns [n0, n1), one at a time, each in tiles of V::kRows rows: the tiles after a column's
// first find its blocks in L1, and the records of all M rows, read in order once per tile, stay
// in L1/L2 across the columns (quant_int8_kernel.h). Blocking over columns as well (2 or 3 a
// tile, the records' loads shared) measured no faster: the integer and float operations per row
// bound the tile, not the loads.
template <class V>
void int8_gemm_cols_simd(const Int8Rows& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes, int64_t K,
                         float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) {
    constexpr int QT = decltype(t)::value;
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += V::kRows) {
        const int64_t rows = M - m0 < V::kRows ? M - m0 : V::kRows;
        with_rows<V::kRows>(rows, [&](auto r) {
          constexpr int R = decltype(r)::value;
          if constexpr (Layout<QT>::kWeights == 32) {
            if (a.wide) return unit_tile<V, QT, R>(a, m0, w + n * row_bytes, K, y + m0 * ldy + n, ldy);
          }
          int8_tile<V, QT, R>(a, m0, w + n * row_bytes, K, y + m0 * ldy + n, ldy);
        });
      }
  });
}

template <class V>
void int8_quantize_simd(const float* x, int64_t ldx, int64_t M, int64_t K, int qtype, int8_t* nat, int64_t ldn,
                        float* dx, int64_t ldd, Int8Rows* rows) {
  // The unit-lane layout (the 32-weight types) and its steps, where a row has at least two
  // whole steps and the units the steps pad in come to at most a quarter more: a step past the
  // last whole one costs as much as a whole one (half on zmm), which on shorter rows (K = 576:
  // 18 units in steps of 16 + 8) outweighs what the unit lanes save; those keep the groups.
  constexpr int W = 4 * V::kSlots;
  constexpr bool kHalf = !std::is_same_v<typename V::Half, V>;
  if (rows) rows->wide = 0;
  const int64_t units = K / kUnit;
  const int rest = (int)(units % W);
  const int last = rest == 0 ? 0 : kHalf && rest <= W / 2 ? W / 2 : W;
  if (rows && block_weights(qtype) == 32 && units >= 2 * W && 4 * (units / W * W + last) <= 5 * units) {
    rows->wide = W;
    rows->full = units / W;
    rows->last = last;
  }
  for (int64_t r = 0; r < M; ++r) {
    int8_t* q = nat + r * ldn;
    float* d = dx + r * ldd;
    for (int64_t b = 0; b < K / kUnit; ++b) d[b] = V::quantize32(x + r * ldx + b * kUnit, q + b * kUnit);
    if (rows) {
      const int64_t kp = rows->groups * kGroup;
      std::memset(q + K, 0, (size_t)(kp - K));
      for (int64_t b = K / kUnit; b < kp / kUnit; ++b) d[b] = 0.0f;
      if (rows->wide)
        lay_out_row_units(q, d, K, qtype, *rows, r);
      else
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
                     int64_t ldn, float* dx, int64_t ldd, Int8Rows* rows) {                            \
    int8_quantize_simd<V>(x, ldx, M, K, qtype, nat, ldn, dx, ldd, rows);                               \
  }                                                                                                    \
  void int8_gemm_cols(const Int8Rows& a, int64_t M, const uint8_t* w, int qtype, int64_t row_bytes,    \
                      int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {                      \
    int8_gemm_cols_simd<V>(a, M, w, qtype, row_bytes, K, y, ldy, n0, n1);                              \
  }
