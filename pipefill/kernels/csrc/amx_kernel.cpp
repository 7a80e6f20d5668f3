// Fused causal chunk attention on AMX-BF16 + AVX-512 (compiled with -mamx-tile -mamx-bf16
// -mavx512f/bw/vl/dq/bf16 -mfma; nothing here runs before the glue has checked the CPU and
// obtained the AMX permission).
//
// Work item = (kv head g, q-tile of `qtile` tokens). Its rows are token-major: row = t * G + h
// for the G query heads of the group, so every K/V tile loaded serves all G heads and one
// causal limit per token serves the heads of that token. Rows are processed in 32-row blocks
// (the last one may have 16). A unit of work is (block, step of NB = 128 keys):
//   QK^T  S[32, NB] fp32 = Q_block K^T with AMX (Q kept in tiles for D = 64), stored to L1;
//   softmax, per row, AVX-512, log2 domain: row max (4 accumulators), lazy rescale of m/l/O when
//         the max grows by more than 8, p = exp2(s * scale * log2e - m) with a degree-3
//         polynomial + roundscale + scalef, two sum accumulators, bf16 P written in place
//         over the row's scores; only steps crossing the diagonal use a mask (iota <= limit);
//   PV    O_block[32, D] fp32 (in memory, per item) += P V with AMX.
// Units run as a software pipeline: the softmax of unit u is interleaved with the PV of unit
// u - 1 and the QK^T of unit u + 1, and prefetches (to L2) the next key step's K/V.
// Causality comes from the loop bounds: a block stops at the last key its last row sees.
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

// One row of the score tile, softmax'd in place: nv (even) vectors of 16 fp32 scores in srow
// become 16 * nv bf16 probabilities at the start of the same row. kFull: nv == NB / 16, no
// mask. kMask: columns > lim are masked out. Rescales the row's O (in memory) when the lazy
// threshold is crossed.
template <bool kFull, bool kMask, int D, int NB>
inline void softmax_row(float* srow, int nv, int lim, float c, float* m_io, float* l_io, float* orow) {
  if (kFull) nv = NB / 16;
  uint16_t* prow = reinterpret_cast<uint16_t*>(srow);  // writes trail the reads (in place)
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

// One (32-row block, key step) unit of work.
template <int NB>
struct Unit {
  int64_t kv0;
  int b, nch;  // block, 32-key chunks in this step
  bool half;   // the block has only 16 rows (the item's last rows)
  const uint16_t* kp[NB / 32];
  const uint16_t* vp[NB / 32];
};

// S[:, 32j : 32j + 32] = Q_block[32, D] K_chunk^T (row stride NB floats); half: 16 rows.
// D == 64 keeps Q in tiles 0-3 (loaded when j == 0; callers issue a unit's chunks in order with
// no other tile work in between): per 16 keys 2 K loads, 4 TDP, 2 stores.
template <int D, int NB>
inline void qk_chunk(const uint16_t* qb, const uint16_t* k0, float* S, int j, bool q_resident, bool half) {
  if (half) {
    _tile_zero(4);
    _tile_zero(5);
#pragma GCC unroll 4
    for (int kc = 0; kc < D / 32; ++kc) {
      _tile_loadd(0, qb + kc * 32, D * 2);
      _tile_loadd(2, k0 + kc * 512, 64);
      _tile_loadd(3, k0 + 16 * D + kc * 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
    }
    _tile_stored(4, S + 32 * j, NB * 4);
    _tile_stored(5, S + 32 * j + 16, NB * 4);
    return;
  }
  if (D == 64 && q_resident) {
    if (j == 0) {
      _tile_loadd(0, qb, D * 2);
      _tile_loadd(1, qb + 32, D * 2);
      _tile_loadd(2, qb + 16 * D, D * 2);
      _tile_loadd(3, qb + 16 * D + 32, D * 2);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const uint16_t* kh = k0 + h * 16 * D;
      _tile_loadd(4, kh, 64);
      _tile_loadd(5, kh + 512, 64);
      _tile_zero(6);
      _tile_zero(7);
      _tile_dpbf16ps(6, 0, 4);
      _tile_dpbf16ps(7, 2, 4);
      _tile_dpbf16ps(6, 1, 5);
      _tile_dpbf16ps(7, 3, 5);
      _tile_stored(6, S + 32 * j + 16 * h, NB * 4);
      _tile_stored(7, S + 16 * NB + 32 * j + 16 * h, NB * 4);
    }
    return;
  }
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
  _tile_stored(4, S + 32 * j, NB * 4);
  _tile_stored(5, S + 32 * j + 16, NB * 4);
  _tile_stored(6, S + 16 * NB + 32 * j, NB * 4);
  _tile_stored(7, S + 16 * NB + 32 * j + 16, NB * 4);
}

// O_block[32, 32dp : 32dp + 32] += P[32, 32 * nch] V[32 * nch, 32dp : 32dp + 32]; P is bf16 in
// place in the score buffer (row stride NB * 4 bytes).
template <int D, int NB>
inline void pv_pass(const float* S, const Unit<NB>& u, float* O, int dp) {
  const uint16_t* P = reinterpret_cast<const uint16_t*>(S);
  float* o = O + dp * 32;
  if (u.half) {
    _tile_loadd(4, o, D * 4);
    _tile_loadd(5, o + 16, D * 4);
    for (int j = 0; j < u.nch; ++j) {
      _tile_loadd(0, P + 32 * j, NB * 4);
      _tile_loadd(2, u.vp[j] + (2 * dp) * 512, 64);
      _tile_loadd(3, u.vp[j] + (2 * dp + 1) * 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
    }
    _tile_stored(4, o, D * 4);
    _tile_stored(5, o + 16, D * 4);
    return;
  }
  _tile_loadd(4, o, D * 4);
  _tile_loadd(5, o + 16, D * 4);
  _tile_loadd(6, o + 16 * D, D * 4);
  _tile_loadd(7, o + 16 * D + 16, D * 4);
  for (int j = 0; j < u.nch; ++j) {
    _tile_loadd(0, P + 32 * j, NB * 4);
    _tile_loadd(1, P + 32 * NB + 32 * j, NB * 4);  // row 16 = 16 * NB floats = 32 * NB bf16
    _tile_loadd(2, u.vp[j] + (2 * dp) * 512, 64);
    _tile_loadd(3, u.vp[j] + (2 * dp + 1) * 512, 64);
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

constexpr int kMaxBlocks = 64;

template <int D, int NB>
struct Item {
  const Params& p;
  const Scratch& s;
  int64_t G, t0, base_pos, kend, head_off, page_stride;
  int M, Mpad, nblk;
  float c;
  bool qres;  // Q-resident QK^T (D == 64)
  int64_t kend_b[kMaxBlocks], first_b[kMaxBlocks];

  Item(const Params& p_, const Scratch& s_, int64_t item) : p(p_), s(s_) {
    G = p.group;
    const int64_t Hkv = p.num_kv_heads, ps = p.page_size;
    const int64_t ntiles = (p.C + p.qtile - 1) / p.qtile;
    const int64_t ti = ntiles - 1 - item / Hkv;  // longest (last) q-tiles first
    const int64_t g = item % Hkv;
    t0 = ti * p.qtile;
    const int64_t nt = p.C - t0 < p.qtile ? p.C - t0 : p.qtile;
    M = (int)(nt * G);
    Mpad = (M + 15) / 16 * 16;  // the last block may have 16 rows
    nblk = (Mpad + 31) / 32;
    base_pos = p.L + t0;
    head_off = g * ps * D;
    page_stride = Hkv * ps * D;
    c = p.scale * 1.4426950408889634f;
    qres = !(p.mode & 16);
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
    // Causal bounds per 32-row block: keys [0, kend_b); a row sees keys up to base_pos + t for
    // its token t. Padding rows behave like the last real row.
    for (int b = 0; b < nblk; ++b) {
      const int last_row = 32 * b + 31 < M - 1 ? 32 * b + 31 : M - 1;
      first_b[b] = base_pos + (32 * b) / G;
      kend_b[b] = base_pos + last_row / G + 1;
    }
    kend = kend_b[nblk - 1];
  }

  void fill(Unit<NB>& u, int64_t kv0, int b) const {
    u.kv0 = kv0;
    u.b = b;
    const int64_t nb = kend_b[b] - kv0 < NB ? kend_b[b] - kv0 : NB;
    u.nch = (int)((nb + 31) / 32);
    u.half = Mpad - 32 * b == 16;
    const int64_t ps = p.page_size;
    for (int j = 0; j < u.nch; ++j) {
      const int64_t tok = kv0 + 32 * j;
      const int64_t off = (int64_t)p.page_table[tok / ps] * page_stride + head_off + (tok % ps) * D;
      u.kp[j] = p.k + off;
      u.vp[j] = p.v + off;
    }
  }

  // Units in order: steps of NB keys, and within a step the blocks that still see keys.
  bool next(int64_t& kv0, int& b) const {
    if (++b < nblk) return true;
    kv0 += NB;
    if (kv0 >= kend) return false;
    b = 0;
    while (kend_b[b] <= kv0) ++b;
    return true;
  }

  const uint16_t* qb(int b) const { return s.q + (int64_t)32 * b * D; }
  float* ob(int b) const { return s.o + (int64_t)32 * b * D; }

  void qk_all(const Unit<NB>& u, float* S) const {
    if (p.mode & 1) return;
    for (int j = 0; j < u.nch; ++j) qk_chunk<D, NB>(qb(u.b), u.kp[j], S, j, qres, u.half);
  }
  void pv_all(const Unit<NB>& u, const float* S) const {
    if (p.mode & 4) return;
    for (int dp = 0; dp < D / 32; ++dp) pv_pass<D, NB>(S, u, ob(u.b), dp);
  }

  // Softmax of the unit's 32 rows in S; after row i, calls piece(k) for the pieces due so far
  // (npieces spread evenly over the rows) so that AMX work overlaps the AVX-512 work.
  // Software prefetch (to L2) of the next key step's K and V, shared among the step's units:
  // the hardware prefetchers stop at every 4 KiB page, and K/V pages are scattered anyway.
  struct Prefetch {
    const char* run[2 * NB / 32];  // contiguous 32-token K or V runs, 64 * D bytes each
    int lo = 0, hi = 0;            // this unit's share of the lines
  };
  static constexpr int kRunLines = 32 * D * 2 / 64;

  void plan_prefetch(const Unit<NB>& u, Prefetch& pf) const {
    pf.lo = pf.hi = 0;
    const int64_t kv1 = u.kv0 + NB;
    if ((p.mode & 32) || kv1 >= kend) return;
    const int64_t nb1 = kend - kv1 < NB ? kend - kv1 : NB;
    const int nch1 = (int)((nb1 + 31) / 32);
    int b0 = 0;
    while (kend_b[b0] <= u.kv0) ++b0;
    const int nact = nblk - b0, idx = u.b - b0;
    const int64_t ps = p.page_size;
    for (int j = 0; j < nch1; ++j) {
      const int64_t tok = kv1 + 32 * j;
      const int64_t off = (int64_t)p.page_table[tok / ps] * page_stride + head_off + (tok % ps) * D;
      pf.run[2 * j] = reinterpret_cast<const char*>(p.k + off);
      pf.run[2 * j + 1] = reinterpret_cast<const char*>(p.v + off);
    }
    const int total = 2 * nch1 * kRunLines;
    pf.lo = total * idx / nact;
    pf.hi = total * (idx + 1) / nact;
  }

  template <typename F>
  void softmax(const Unit<NB>& u, float* S, int npieces, F&& piece) const {
    const int ncol = 32 * u.nch;
    const bool need_mask = first_b[u.b] - u.kv0 < ncol - 1;
    Prefetch pf;
    plan_prefetch(u, pf);
    int issued = 0;
    const int rows = u.half ? 16 : 32;
    for (int i = 0; i < rows; ++i) {
      for (int x = pf.lo + (pf.hi - pf.lo) * i / rows, e = pf.lo + (pf.hi - pf.lo) * (i + 1) / rows; x < e; ++x)
        _mm_prefetch(pf.run[x / kRunLines] + 64 * (x % kRunLines), _MM_HINT_T1);
      if (!(p.mode & 2)) {
        const int r = 32 * u.b + i;
        const int rr = r < M ? r : M - 1;
        const int64_t lim = base_pos + rr / G - u.kv0;  // last visible column of this row
        float* srow = S + i * NB;
        float* orow = s.o + (int64_t)r * D;
        if (!need_mask || lim >= ncol - 1) {
          if (u.nch == NB / 32)
            softmax_row<true, false, D, NB>(srow, 0, 0, c, s.m + r, s.l + r, orow);
          else
            softmax_row<false, false, D, NB>(srow, 2 * u.nch, 0, c, s.m + r, s.l + r, orow);
        } else if (lim < 0) {
          uint16_t* prow = reinterpret_cast<uint16_t*>(srow);
          for (int x = 0; x < ncol; x += 32) _mm512_store_si512(prow + x, _mm512_setzero_si512());
        } else {
          softmax_row<false, true, D, NB>(srow, 2 * u.nch, (int)lim, c, s.m + r, s.l + r, orow);
        }
      }
      const int due = ((i + 1) * npieces + rows - 1) / rows;
      while (issued < due) piece(issued++);
    }
  }

  // Software pipeline over units: softmax(u) is interleaved with PV(u - 1) (when u - 1 is another
  // block; for the same block its PV must land before u's lazy rescale) and QK^T(u + 1), one
  // PV pass (32 output dims) or one QK^T chunk (32 keys) every few softmax rows.
  // Two score buffers: PV(u - 1) reads buffer (u + 1) % 2 before QK^T(u + 1) overwrites it
  // (program order; all PV pieces are issued before the QK pieces).
  void run_pipelined() {
    Unit<NB> U[3];
    int64_t kv0 = 0;
    int b = 0;
    fill(U[0], kv0, b);
    qk_all(U[0], s.s);
    bool have_prev = false;
    int k = 0;
    for (;; ++k) {
      const Unit<NB>& u = U[k % 3];
      Unit<NB>& nx = U[(k + 1) % 3];
      const Unit<NB>& pr = U[(k + 2) % 3];
      const bool have_next = next(kv0, b);
      if (have_next) fill(nx, kv0, b);
      float* Sc = s.s + (k & 1) * 32 * NB;
      float* So = s.s + ((k + 1) & 1) * 32 * NB;
      const bool defer = have_prev && pr.b != u.b;
      if (have_prev && !defer) pv_all(pr, So);
      const int npv = (defer && !(p.mode & 4)) ? D / 32 : 0;
      const int nqk = (have_next && !(p.mode & 1)) ? nx.nch : 0;
      softmax(u, Sc, npv + nqk, [&](int x) {
        if (x < npv)
          pv_pass<D, NB>(So, pr, ob(pr.b), x);
        else
          qk_chunk<D, NB>(qb(nx.b), nx.kp[x - npv], So, x - npv, qres, nx.half);
      });
      have_prev = true;
      if (!have_next) break;
    }
    pv_all(U[k % 3], s.s + (k & 1) * 32 * NB);
  }

  // Phases one after the other (profiling: rdtsc around each phase).
  void run_sequential(uint64_t* prof) {
    Unit<NB> u;
    int64_t kv0 = 0;
    int b = 0;
    do {
      fill(u, kv0, b);
      uint64_t t1 = prof ? __rdtsc() : 0, t2;
      qk_all(u, s.s);
      if (prof) { t2 = __rdtsc(); prof[0] += t2 - t1; t1 = t2; }
      softmax(u, s.s, 0, [](int) {});
      if (prof) { t2 = __rdtsc(); prof[1] += t2 - t1; t1 = t2; }
      pv_all(u, s.s);
      if (prof) prof[2] += __rdtsc() - t1;
    } while (next(kv0, b));
  }

  void epilogue() const {
    const int64_t g = head_off / (p.page_size * D);
    for (int r = 0; r < M; ++r) {
      const int64_t t = r / G, h = r % G;
      uint16_t* dst = p.out + (t0 + t) * p.o_st + (g * G + h) * p.o_sh;
      const __m512 inv = _mm512_set1_ps(1.0f / s.l[r]);
      const float* orow = s.o + (int64_t)r * D;
      for (int d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i*)(dst + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(orow + d), inv)));
    }
  }
};

template <int D, int NB>
void run_item_d(const Params& p, int64_t item, const Scratch& s, uint64_t* prof) {
  const uint64_t t_item = prof ? __rdtsc() : 0;
  Item<D, NB> it(p, s, item);
  load_tile_config();
  if (prof || (p.mode & 8))
    it.run_sequential(prof);
  else
    it.run_pipelined();
  _tile_release();
  it.epilogue();
  if (prof) prof[3] += __rdtsc() - t_item;
}

}  // namespace

void run_item(const Params& p, int64_t item, const Scratch& s, uint64_t* prof) {
  if (p.head_dim == 64) {
    if (p.step == 64)
      run_item_d<64, 64>(p, item, s, prof);
    else
      run_item_d<64, 128>(p, item, s, prof);
  } else {
    if (p.step == 64)
      run_item_d<128, 64>(p, item, s, prof);
    else
      run_item_d<128, 128>(p, item, s, prof);
  }
}

}  // namespace pipefill_amx
