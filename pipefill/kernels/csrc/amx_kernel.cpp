// Fused causal chunk attention on AMX-BF16 + AVX-512 (compiled with -mamx-tile -mamx-bf16
// -mavx512f/bw/vl/dq/bf16 -mfma; nothing here runs before the glue has checked the CPU and
// obtained the AMX permission).
//
// Work item = (kv head g, q-tile of `qtile` tokens). Its rows are token-major: row = t * G + h
// for the G query heads of the group, so every K/V tile loaded serves all G heads and one
// causal limit per token serves the heads of that token. Rows are processed in 32-row blocks.
// Per step of kStep keys and per block: S = Q K^T (AMX, 2x2 tiles) into a 32 x kStep fp32 tile,
// online softmax in the log2 domain (AVX-512, degree-3 exp2, lazy rescale with threshold 8),
// P (bf16) V accumulated by AMX into the block's fp32 O rows.
//
// Cache layout (written by write_kv in the glue), per (page, kv head), page_size * D bf16:
//   K: [page_size/16 groups][D/32 chunks][16 dim pairs][16 tokens][2]   (QK^T B tiles)
//   V: [page_size/32 groups][D/16 chunks][16 token pairs][16 dims][2]   (PV B tiles)
// so tokens [o, o + 32) of a page (o % 32 == 0) start at element o * D in both.
#include <immintrin.h>
#include <x86intrin.h>

#include <cstdint>

#include "amx_kernel.h"

namespace pipefill_amx {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void load_tile_config() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

constexpr float kNegInf = -__builtin_inff();
constexpr float kLazyThreshold = 8.0f;  // log2 units: p <= 256 between rescales
// 2^f on [-1/2, 1/2], degree-3 near-minimax for relative error (max 7.5e-5).
constexpr float kC0 = 0.99992807f, kC1 = 0.69326099f, kC2 = 0.24261114f, kC3 = 0.05517167f;

// p = 2^x as poly(f) * 2^n with n = round(x); masked lanes (kMask) come out as 0.
template <bool kMask>
inline __m512 exp2_ps(__m512 x, __mmask16 k) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kC3), f, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC0));
  if (kMask) return _mm512_maskz_scalef_ps(k, p, n);
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 col_mask(int i, __m512i vlim) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_cmple_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16 * i)), vlim);
}

// One row of the score tile: nv (even) vectors of 16 scores. kFull: nv == kStep / 16, no mask.
// kMask: columns > lim are masked out.
template <bool kFull, bool kMask, int D>
inline void softmax_row(const float* __restrict srow, uint16_t* __restrict prow, int nv, int lim,
                        float c, float* m_io, float* l_io, float* __restrict orow) {
  if (kFull) nv = kStep / 16;
  const __m512i vlim = _mm512_set1_epi32(lim);
  __m512 a0 = _mm512_set1_ps(kNegInf), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 4 <= nv; i += 4) {
    const __m512 s0 = _mm512_load_ps(srow + 16 * i), s1 = _mm512_load_ps(srow + 16 * i + 16);
    const __m512 s2 = _mm512_load_ps(srow + 16 * i + 32), s3 = _mm512_load_ps(srow + 16 * i + 48);
    if (kMask) {
      a0 = _mm512_mask_max_ps(a0, col_mask(i, vlim), a0, s0);
      a1 = _mm512_mask_max_ps(a1, col_mask(i + 1, vlim), a1, s1);
      a2 = _mm512_mask_max_ps(a2, col_mask(i + 2, vlim), a2, s2);
      a3 = _mm512_mask_max_ps(a3, col_mask(i + 3, vlim), a3, s3);
    } else {
      a0 = _mm512_max_ps(a0, s0);
      a1 = _mm512_max_ps(a1, s1);
      a2 = _mm512_max_ps(a2, s2);
      a3 = _mm512_max_ps(a3, s3);
    }
  }
  for (; i < nv; i += 2) {
    const __m512 s0 = _mm512_load_ps(srow + 16 * i), s1 = _mm512_load_ps(srow + 16 * i + 16);
    if (kMask) {
      a0 = _mm512_mask_max_ps(a0, col_mask(i, vlim), a0, s0);
      a1 = _mm512_mask_max_ps(a1, col_mask(i + 1, vlim), a1, s1);
    } else {
      a0 = _mm512_max_ps(a0, s0);
      a1 = _mm512_max_ps(a1, s1);
    }
  }
  const float b = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3))) * c;
  float m = *m_io;
  if (b > m + kLazyThreshold) {
    if (m != kNegInf) {
      const float alpha = __builtin_exp2f(m - b);
      *l_io *= alpha;
      const __m512 va = _mm512_set1_ps(alpha);
      for (int d = 0; d < D; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(_mm512_load_ps(orow + d), va));
    }
    m = b;
    *m_io = m;
  }
  const __m512 negm = _mm512_set1_ps(-m), vc = _mm512_set1_ps(c);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (i = 0; i < nv; i += 2) {
    const __m512 x0 = _mm512_fmadd_ps(_mm512_load_ps(srow + 16 * i), vc, negm);
    const __m512 x1 = _mm512_fmadd_ps(_mm512_load_ps(srow + 16 * i + 16), vc, negm);
    __m512 p0, p1;
    if (kMask) {
      p0 = exp2_ps<true>(x0, col_mask(i, vlim));
      p1 = exp2_ps<true>(x1, col_mask(i + 1, vlim));
    } else {
      p0 = exp2_ps<false>(x0, 0);
      p1 = exp2_ps<false>(x1, 0);
    }
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    _mm512_store_si512(prow + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  *l_io += _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// S[32, 32 * nch] = Q_block[32, D] K^T for nch chunks of 32 keys.
template <int D>
inline void qk_block(const uint16_t* __restrict qb, const uint16_t* const* kp, int nch, float* __restrict S) {
  for (int j = 0; j < nch; ++j) {
    const uint16_t* k0 = kp[j];
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
#pragma GCC unroll 4
    for (int kc = 0; kc < D / 32; ++kc) {
      _tile_loadd(0, qb + kc * 32, D * 2);
      _tile_loadd(1, qb + 16 * D + kc * 32, D * 2);
      _tile_loadd(2, k0 + kc * 512, 64);
      _tile_loadd(3, k0 + 16 * D + kc * 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, S + 32 * j, kStep * 4);
    _tile_stored(5, S + 32 * j + 16, kStep * 4);
    _tile_stored(6, S + 16 * kStep + 32 * j, kStep * 4);
    _tile_stored(7, S + 16 * kStep + 32 * j + 16, kStep * 4);
  }
}

// O_block[32, D] += P[32, 32 * nch] V[32 * nch, D].
template <int D>
inline void pv_block(const uint16_t* __restrict P, const uint16_t* const* vp, int nch, float* __restrict O) {
  for (int dp = 0; dp < D / 32; ++dp) {
    float* o = O + dp * 32;
    _tile_loadd(4, o, D * 4);
    _tile_loadd(5, o + 16, D * 4);
    _tile_loadd(6, o + 16 * D, D * 4);
    _tile_loadd(7, o + 16 * D + 16, D * 4);
    for (int j = 0; j < nch; ++j) {
      _tile_loadd(0, P + 32 * j, kStep * 2);
      _tile_loadd(1, P + 16 * kStep + 32 * j, kStep * 2);
      _tile_loadd(2, vp[j] + (2 * dp) * 512, 64);
      _tile_loadd(3, vp[j] + (2 * dp + 1) * 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, o, D * 4);
    _tile_stored(5, o + 16, D * 4);
    _tile_stored(6, o + 16 * D, D * 4);
    _tile_stored(7, o + 16 * D + 16, D * 4);
  }
}

constexpr int kMaxBlocks = 64;

template <int D>
void run_item_d(const Params& p, int64_t item, const Scratch& s, uint64_t* prof) {
  const uint64_t t_item = prof ? __rdtsc() : 0;
  const int64_t G = p.group, Hkv = p.num_kv_heads, ps = p.page_size;
  const int64_t ntiles = (p.C + p.qtile - 1) / p.qtile;
  const int64_t ti = ntiles - 1 - item / Hkv;  // longest (last) q-tiles first
  const int64_t g = item % Hkv;
  const int64_t t0 = ti * p.qtile;
  const int64_t nt = p.C - t0 < p.qtile ? p.C - t0 : p.qtile;
  const int M = (int)(nt * G);
  const int Mpad = (M + 31) / 32 * 32;
  const int nblk = Mpad / 32;
  const int64_t base_pos = p.L + t0;  // position of the tile's first query

  // Stage Q rows (token-major within the group), zero the padding rows.
  for (int r = 0; r < M; ++r) {
    const int64_t t = r / G, h = r % G;
    const uint16_t* src = p.q + (t0 + t) * p.q_st + (g * G + h) * p.q_sh;
    uint16_t* dst = s.q + (int64_t)r * D;
    for (int d = 0; d < D; d += 32) _mm512_store_si512(dst + d, _mm512_loadu_si512(src + d));
  }
  for (int r = M; r < Mpad; ++r)
    for (int d = 0; d < D; d += 32) _mm512_store_si512(s.q + (int64_t)r * D + d, _mm512_setzero_si512());
  for (int64_t i = 0; i < (int64_t)Mpad * D; i += 16) _mm512_store_ps(s.o + i, _mm512_setzero_ps());
  for (int r = 0; r < Mpad; ++r) {
    s.m[r] = kNegInf;
    s.l[r] = 0.f;
  }

  // Causal bounds per 32-row block: keys [0, kend_b); rows of the block see keys up to
  // base_pos + t for their token t. Padding rows behave like the last real row.
  int64_t kend_b[kMaxBlocks], first_b[kMaxBlocks];
  for (int b = 0; b < nblk; ++b) {
    const int last_row = 32 * b + 31 < M - 1 ? 32 * b + 31 : M - 1;
    first_b[b] = base_pos + (32 * b) / G;
    kend_b[b] = base_pos + last_row / G + 1;
  }
  const int64_t kend = kend_b[nblk - 1];
  const float c = p.scale * 1.4426950408889634f;
  const int64_t head_off = g * ps * D, page_stride = Hkv * ps * D;

  load_tile_config();
  const uint16_t* kp[kStep / 32];
  const uint16_t* vp[kStep / 32];
  for (int64_t kv0 = 0; kv0 < kend; kv0 += kStep) {
    const int64_t nmax = kend - kv0 < kStep ? kend - kv0 : kStep;
    const int nch_max = (int)((nmax + 31) / 32);
    for (int j = 0; j < nch_max; ++j) {
      const int64_t tok = kv0 + 32 * j;
      const int64_t off = (int64_t)p.page_table[tok / ps] * page_stride + head_off + (tok % ps) * D;
      kp[j] = p.k + off;
      vp[j] = p.v + off;
    }
    for (int b = 0; b < nblk; ++b) {
      if (kend_b[b] <= kv0) continue;
      const int64_t nb = kend_b[b] - kv0 < kStep ? kend_b[b] - kv0 : kStep;
      const int nch = (int)((nb + 31) / 32);
      const uint16_t* qb = s.q + (int64_t)32 * b * D;
      float* ob = s.o + (int64_t)32 * b * D;
      uint64_t t1 = prof ? __rdtsc() : 0, t2;
      if (!(p.mode & 1)) qk_block<D>(qb, kp, nch, s.s);
      if (prof) { t2 = __rdtsc(); prof[0] += t2 - t1; t1 = t2; }
      if (!(p.mode & 2)) {
        const int ncol = 32 * nch;
        const bool need_mask = first_b[b] - kv0 < ncol - 1;
        for (int i = 0; i < 32; ++i) {
          const int r = 32 * b + i;
          const int rr = r < M ? r : M - 1;
          const int64_t lim = base_pos + rr / G - kv0;  // last visible column of this row
          const float* srow = s.s + i * kStep;
          uint16_t* prow = s.p + i * kStep;
          float* orow = s.o + (int64_t)r * D;
          if (!need_mask || lim >= ncol - 1) {
            if (nch == kStep / 32)
              softmax_row<true, false, D>(srow, prow, 0, 0, c, s.m + r, s.l + r, orow);
            else
              softmax_row<false, false, D>(srow, prow, 2 * nch, 0, c, s.m + r, s.l + r, orow);
          } else if (lim < 0) {
            for (int x = 0; x < ncol; x += 32) _mm512_store_si512(prow + x, _mm512_setzero_si512());
          } else {
            softmax_row<false, true, D>(srow, prow, 2 * nch, (int)lim, c, s.m + r, s.l + r, orow);
          }
        }
      }
      if (prof) { t2 = __rdtsc(); prof[1] += t2 - t1; t1 = t2; }
      if (!(p.mode & 4)) pv_block<D>(s.p, vp, nch, ob);
      if (prof) prof[2] += __rdtsc() - t1;
    }
  }
  _tile_release();

  // Epilogue: O / l -> bf16 into out[t0 + t, g * G + h, :].
  for (int r = 0; r < M; ++r) {
    const int64_t t = r / G, h = r % G;
    uint16_t* dst = p.out + (t0 + t) * p.o_st + (g * G + h) * p.o_sh;
    const __m512 inv = _mm512_set1_ps(1.0f / s.l[r]);
    const float* orow = s.o + (int64_t)r * D;
    for (int d = 0; d < D; d += 16)
      _mm256_storeu_si256((__m256i*)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(orow + d), inv)));
  }
  if (prof) prof[3] += __rdtsc() - t_item;
}

}  // namespace

void run_item(const Params& p, int64_t item, const Scratch& s, uint64_t* prof) {
  if (p.head_dim == 64)
    run_item_d<64>(p, item, s, prof);
  else
    run_item_d<128>(p, item, s, prof);
}

}  // namespace pipefill_amx
