// Absorbed latent attention over one part of one sequence, one build per ISA (PF_MLA_NS =
// scalar, avx2, avx512, avx512bf16; PF_MLA_WIDTH floats a register: 4 for the baseline x86-64
// build, 8, 16; PF_MLA_ROWS rows per register block). Generic code over GCC vector types: the compiler emits
// only what the object's -m flags allow. Per block of kBlock tokens: widen their latents to
// float32 (kb [count, D]), score them against every head tile (S = kb Q, one broadcast of a
// latent value times a vector of heads per FMA), the online softmax in exp2 with one rescale
// factor per head and block, then O = O * alpha + kb[:, :R]^T P, again vectorised over heads.
// The avx512bf16 build's `pairs` route does both products with vdpbf16ps on bf16 pairs
// (attend_part_pairs below). Layout and arguments: mla_attn_kernel.h.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "mla_attn_kernel.h"

namespace pipefill_mla {
namespace PF_MLA_NS {
namespace {

constexpr int W = PF_MLA_WIDTH;
constexpr int NV = kHeadTile / W;  // registers per head tile
constexpr int kRows = PF_MLA_ROWS;
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf broadcast(float x) { return vf{} + x; }
inline vf larger(vf a, vf b) { return a > b ? a : b; }

// 2^x for x <= 0; lanes below -126 give exactly 0 (so do -inf lanes). x = n + f with n the
// nearest integer (|f| <= 1/2); 2^f = e^(f ln 2) by its Taylor series to the 6th power, nested
// as 1 + y(1 + y/2 (1 + y/3 (...))) with y = f ln 2 (relative error about 1e-7); 2^n is built
// in the exponent bits.
inline vf exp2_nonpositive(vf x) {
  const vi gone = x < broadcast(-126.0f);
  const vf xc = gone ? broadcast(-126.0f) : x;
  const vf up = xc + 0.5f;
  vi n = __builtin_convertvector(up, vi);  // truncates toward zero
  n += __builtin_convertvector(n, vf) > up;  // -1 where that rounded up: now floor(x + 1/2)
  const vf y = (xc - __builtin_convertvector(n, vf)) * 0.69314718f;
  vf p = broadcast(1.0f);
  for (int k = 6; k >= 1; --k) p = 1.0f + p * (y * (1.0f / (float)k));
  const vf two_n = (vf)((n + 127) << 23);
  return gone ? broadcast(0.0f) : p * two_n;
}

inline float bf16_value(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The latents of tokens [t0, t0 + count) of the part as float32 rows kb [count, D].
void widen_block(const PartArgs& a, int64_t t0, int64_t count, float* kb) {
  const int64_t first = a.half < a.D ? a.half : a.D, rest = a.D - first;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t at = a.slots[t0 + t] * a.half;
    float* row = kb + t * a.D;
    if (a.bf16) {
      const uint16_t* k = static_cast<const uint16_t*>(a.k) + at;
      const uint16_t* v = static_cast<const uint16_t*>(a.v) + at;
      for (int64_t d = 0; d < first; ++d) row[d] = bf16_value(k[d]);
      for (int64_t d = 0; d < rest; ++d) row[first + d] = bf16_value(v[d]);
    } else {
      std::memcpy(row, static_cast<const float*>(a.k) + at, sizeof(float) * first);
      std::memcpy(row + first, static_cast<const float*>(a.v) + at, sizeof(float) * rest);
    }
  }
}

// s[m, j..j+16) = sum_d kb[m, d] qt[d, j..j+16) for ROWS token rows.
template <int ROWS>
inline void score_rows(const float* kb, int64_t D, const float* qt, int64_t Hp, int64_t j, float* s) {
  vf acc[ROWS][NV] = {};
  const float* q = qt + j;
  for (int64_t d = 0; d < D; ++d, q += Hp) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(q + v * W);
    for (int m = 0; m < ROWS; ++m) {
      const float x = kb[m * D + d];
      for (int v = 0; v < NV; ++v) acc[m][v] += x * b[v];
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < NV; ++v) store(s + m * Hp + j + v * W, acc[m][v]);
}

// out[r + m, j..j+16) = out[...] * alpha[j..j+16) + sum_t kb[t, r + m] p[t, j..j+16) for ROWS
// latent values r + m.
template <int ROWS>
inline void accumulate_rows(const float* kb, int64_t D, const float* p, int64_t count, int64_t Hp,
                            const float* alpha, int64_t r, int64_t j, float* out) {
  vf acc[ROWS][NV];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = load(out + (r + m) * Hp + j + v * W) * load(alpha + j + v * W);
  for (int64_t t = 0; t < count; ++t) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(p + t * Hp + j + v * W);
    for (int m = 0; m < ROWS; ++m) {
      const float x = kb[t * D + r + m];
      for (int v = 0; v < NV; ++v) acc[m][v] += x * b[v];
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < NV; ++v) store(out + (r + m) * Hp + j + v * W, acc[m][v]);
}

// Scores s [count, Hp] become probabilities against the new running maximum; each head's
// maximum, sum and the factor alpha its earlier output is rescaled by are updated.
void softmax_block(float* s, int64_t count, int64_t Hp, float* top, float* sum, float* alpha) {
  for (int64_t u = 0; u < Hp; u += W) {
    const vf old = load(top + u);
    vf now = old;
    for (int64_t t = 0; t < count; ++t) now = larger(now, load(s + t * Hp + u));
    const vf a = exp2_nonpositive(old - now);
    vf total = load(sum + u) * a;
    for (int64_t t = 0; t < count; ++t) {
      const vf p = exp2_nonpositive(load(s + t * Hp + u) - now);
      store(s + t * Hp + u, p);
      total += p;
    }
    store(top + u, now);
    store(sum + u, total);
    store(alpha + u, a);
  }
}

// Every head's running maximum at -inf, sum and output at 0: (top, sum, out) of the state.
inline void start_state(const PartArgs& a, float*& top, float*& sum, float*& out) {
  top = a.state;
  sum = top + a.Hp;
  out = sum + a.Hp;  // [R, Hp]
  for (int64_t h = 0; h < a.Hp; ++h) top[h] = -__builtin_inff(), sum[h] = 0.0f;
  std::memset(out, 0, sizeof(float) * a.R * a.Hp);
}

#if defined(__AVX512BF16__)
// ---- the pairs route: bf16 latents, query and probabilities, vdpbf16ps (float32 sums) -------

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// The block's latents as bf16 rows kb [count rounded up to even, Dp], zero-padded (a missing
// last token of an odd count, and the value past an odd D, are zeros).
void copy_block(const PartArgs& a, int64_t t0, int64_t count, int64_t Dp, uint16_t* kb) {
  const int64_t first = a.half < a.D ? a.half : a.D, rest = a.D - first;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t at = a.slots[t0 + t] * a.half;
    uint16_t* row = kb + t * Dp;
    std::memcpy(row, static_cast<const uint16_t*>(a.k) + at, 2 * first);
    std::memcpy(row + first, static_cast<const uint16_t*>(a.v) + at, 2 * rest);
    if (Dp > a.D) row[a.D] = 0;
  }
  if (count & 1) std::memset(kb + count * Dp, 0, 2 * Dp);
}

// c2 [pairs of tokens, R]: (C[2i, r], C[2i + 1, r]) as one 32-bit lane, the values' layout
// for vdpbf16ps over tokens (two token rows interleaved 32 values at a time).
void pair_tokens(const uint16_t* kb, int64_t Dp, int64_t count, int64_t R, uint32_t* c2) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t i = 0; 2 * i < count; ++i) {
    const uint16_t* x = kb + 2 * i * Dp;
    const uint16_t* y = x + Dp;
    uint32_t* dst = c2 + i * R;
    int64_t r = 0;
    for (; r + 32 <= R; r += 32) {
      const __m512i vx = _mm512_loadu_si512(x + r), vy = _mm512_loadu_si512(y + r);
      _mm512_storeu_si512(dst + r, _mm512_permutex2var_epi16(vx, lo, vy));
      _mm512_storeu_si512(dst + r + 16, _mm512_permutex2var_epi16(vx, hi, vy));
    }
    for (; r < R; ++r) dst[r] = (uint32_t)x[r] | ((uint32_t)y[r] << 16);
  }
}

// p2 [pairs of tokens, Hp]: the probabilities of tokens 2i and 2i + 1 rounded to bf16 and
// interleaved per head (a zero for the missing token of an odd count).
void pair_probs(const float* s, int64_t count, int64_t Hp, uint32_t* p2) {
  alignas(64) static const uint16_t mix_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i mix = _mm512_load_si512(mix_idx);
  for (int64_t i = 0; 2 * i < count; ++i) {
    const bool second = 2 * i + 1 < count;
    for (int64_t h = 0; h < Hp; h += 16) {
      const __m512 x = _mm512_loadu_ps(s + 2 * i * Hp + h);
      const __m512 y = second ? _mm512_loadu_ps(s + (2 * i + 1) * Hp + h) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(y, x);  // x in the low 16, y high
      _mm512_storeu_si512(p2 + i * Hp + h, _mm512_permutexvar_epi16(mix, both));
    }
  }
}

// s[m, j..j+16) = sum over latent pairs of kb[m] . qt2 for ROWS token rows (kb rows of Dp/2 pairs).
template <int ROWS>
inline void score_rows_pairs(const uint32_t* kb, int64_t pairs, const uint32_t* qt2, int64_t Hp, int64_t j,
                             float* s) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t d = 0; d < pairs; ++d) {
    const __m512bh b = as_bh(_mm512_loadu_si512(qt2 + d * Hp + j));
    for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], as_bh(_mm512_set1_epi32((int)kb[m * pairs + d])), b);
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(s + m * Hp + j, acc[m]);
}

// out[r + m, j..j+16) = out * alpha + sum over token pairs of c2[., r + m] . p2[., j..j+16).
template <int ROWS>
inline void accumulate_rows_pairs(const uint32_t* c2, const uint32_t* p2, int64_t token_pairs, int64_t R,
                                  int64_t Hp, const float* alpha, int64_t r, int64_t j, float* out) {
  const __m512 scale = _mm512_loadu_ps(alpha + j);
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_mul_ps(_mm512_loadu_ps(out + (r + m) * Hp + j), scale);
  for (int64_t i = 0; i < token_pairs; ++i) {
    const __m512bh b = as_bh(_mm512_loadu_si512(p2 + i * Hp + j));
    for (int m = 0; m < ROWS; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], as_bh(_mm512_set1_epi32((int)c2[i * R + r + m])), b);
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(out + (r + m) * Hp + j, acc[m]);
}

void attend_part_pairs(const PartArgs& a, float* scratch) {
  const int64_t Dp = (a.D + 1) / 2 * 2, pairs = Dp / 2;
  uint16_t* kb = reinterpret_cast<uint16_t*>(scratch);              // [kBlock, Dp] bf16
  uint32_t* c2 = reinterpret_cast<uint32_t*>(scratch) + kBlock * pairs;  // [kBlock / 2, R]
  float* s = scratch + kBlock * pairs + kBlock / 2 * a.R;            // [kBlock, Hp]
  uint32_t* p2 = reinterpret_cast<uint32_t*>(s + kBlock * a.Hp);    // [kBlock / 2, Hp]
  float* alpha = s + kBlock * a.Hp + kBlock / 2 * a.Hp;              // [Hp]
  const uint32_t* qt2 = static_cast<const uint32_t*>(a.qt);
  float *top, *sum, *out;
  start_state(a, top, sum, out);
  for (int64_t t0 = 0; t0 < a.n; t0 += kBlock) {
    const int64_t count = a.n - t0 < kBlock ? a.n - t0 : kBlock, token_pairs = (count + 1) / 2;
    copy_block(a, t0, count, Dp, kb);
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(kb);
    for (int64_t j = 0; j < a.Hp; j += kHeadTile) {
      int64_t t = 0;
      for (; t + kRows <= count; t += kRows) score_rows_pairs<kRows>(rows + t * pairs, pairs, qt2, a.Hp, j, s + t * a.Hp);
      for (; t < count; ++t) score_rows_pairs<1>(rows + t * pairs, pairs, qt2, a.Hp, j, s + t * a.Hp);
    }
    softmax_block(s, count, a.Hp, top, sum, alpha);
    pair_tokens(kb, Dp, count, a.R, c2);
    pair_probs(s, count, a.Hp, p2);
    for (int64_t j = 0; j < a.Hp; j += kHeadTile) {
      int64_t r = 0;
      for (; r + kRows <= a.R; r += kRows) accumulate_rows_pairs<kRows>(c2, p2, token_pairs, a.R, a.Hp, alpha, r, j, out);
      for (; r < a.R; ++r) accumulate_rows_pairs<1>(c2, p2, token_pairs, a.R, a.Hp, alpha, r, j, out);
    }
  }
}
#endif  // __AVX512BF16__

}  // namespace

void attend_part(const PartArgs& a, float* scratch) {
#if defined(__AVX512BF16__)
  if (a.pairs) return attend_part_pairs(a, scratch);
#endif
  float* kb = scratch;                 // [kBlock, D]
  float* s = kb + kBlock * a.D;        // [kBlock, Hp]
  float* alpha = s + kBlock * a.Hp;    // [Hp]
  const float* qt = static_cast<const float*>(a.qt);
  float *top, *sum, *out;
  start_state(a, top, sum, out);
  for (int64_t t0 = 0; t0 < a.n; t0 += kBlock) {
    const int64_t count = a.n - t0 < kBlock ? a.n - t0 : kBlock;
    widen_block(a, t0, count, kb);
    for (int64_t j = 0; j < a.Hp; j += kHeadTile) {
      int64_t t = 0;
      for (; t + kRows <= count; t += kRows) score_rows<kRows>(kb + t * a.D, a.D, qt, a.Hp, j, s + t * a.Hp);
      for (; t < count; ++t) score_rows<1>(kb + t * a.D, a.D, qt, a.Hp, j, s + t * a.Hp);
    }
    softmax_block(s, count, a.Hp, top, sum, alpha);
    for (int64_t j = 0; j < a.Hp; j += kHeadTile) {
      int64_t r = 0;
      for (; r + kRows <= a.R; r += kRows) accumulate_rows<kRows>(kb, a.D, s, count, a.Hp, alpha, r, j, out);
      for (; r < a.R; ++r) accumulate_rows<1>(kb, a.D, s, count, a.Hp, alpha, r, j, out);
    }
  }
}

}  // namespace PF_MLA_NS
}  // namespace pipefill_mla
