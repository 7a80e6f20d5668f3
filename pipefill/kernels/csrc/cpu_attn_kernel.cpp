// Flash-style causal chunk attention for x86 vector units, over the packed paged KV cache
// (layout in cpu_attn_kernel.h). This one source is compiled three times, each into its own
// namespace (PF_ATTN_NS) with its own flags:
//   avx512bf16: -mavx512f/bw/vl/dq -mavx512bf16 -mfma; QK^T and PV with vdpbf16ps on bf16 Q, K,
//               V and P (fp32 accumulators), R = 8 rows per register block (4 for decode);
//   avx512:     -mavx512f/bw/vl/dq -mfma; fp32 compute, R = 8 (4 for decode);
//   avx2:       -mavx2 -mfma; fp32 compute, R = 6 (12 accumulators of 16 ymm registers; QK^T
//               and PV written with intrinsics: GCC spilled the generic code's), 4 for decode.
// The fp32 kernels read bf16 caches by a shift (even dims/tokens) and a mask (odd), or float32
// caches directly. Generic code uses GCC vector extensions (16 floats; AVX2 gets two ymm per
// vector), so the same source serves every ISA and the compiler only emits what -m allows.
//
// Work item = (kv head g, q-tile of qtile tokens[, KV part]); rows are token-major (row = t * G + h), so each
// K/V tile loaded serves all G query heads of the group. Per step of kStep keys (K/V of the step
// stay in L1) and per block of R rows: S = Q K^T (fp32), online softmax in the log2 domain with a
// lazy rescale (the running max moves only when it grows by more than 8), p = exp2 by a
// polynomial (degree 3 where P is rounded to bf16 anyway, degree 6 for fp32; AVX-512 scales by
// 2^n with vscalefps), O += P V. Horizontal max/sum use shuffles, never a 16-long scalar chain;
// the bf16 kernel keeps each row's sum as a vector until the epilogue. Causal limits come from the
// loop bounds: a block stops at the last key its last row sees; only steps crossing the diagonal
// mask columns. Split KV (one q-tile over a long context): an item covers one part of the keys
// and writes (O, max, sum) for the glue to merge.
// A quantized cache (int8, fp8_e4m3; token-major rows of codes and a scale) is read by the same
// loops: each step's K and V rows are widened once per item into L1 scratch in the packed layout
// (K transposed as bytes first), exactly the values torch's dequantize gives in q's dtype.
// Decode over one (int8 with bf16 q; on AVX-512 any) reads the rows in registers instead:
// QuantDecode below.
#include <cstdint>
#include <cstring>

#include "cpu_attn_kernel.h"

#include <immintrin.h>  // intrinsics are emitted only where used, within this object's -m flags

namespace pipefill_cpu_attn {
namespace PF_ATTN_NS {
namespace {

// Native vector width: 16 floats (AVX-512) or 8 (AVX2); a 16-token/16-dim row is NV vectors.
constexpr int W = PF_ATTN_WIDTH;
constexpr int NV = 16 / W;
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

constexpr int kRows = PF_ATTN_ROWS;  // rows per register block; decode (<= 4 rows) uses 4
constexpr int NB = kStep;
constexpr float kNegInf = -__builtin_inff();
constexpr float kLazy = 8.0f;
#if PF_ATTN_BF16DOT
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// The next step's K and V lines (in an item's last step: the first step of the thread's next
// item, `after`), prefetched a few at a time while a decode step computes
// (ARCHITECTURE.md, 'GGUF blocks kept quantized', the decode step's attention): issued all at
// once before the step, they filled the miss buffers and stalled the step's own loads behind
// them. tick() is called once per inner iteration of QK^T and PV.
struct SpreadPrefetch {
  const char* run[4] = {nullptr, nullptr, nullptr, nullptr};  // K run 0, 1; V run 0, 1
  int lines_per_run = 0, next = 0, per_tick = 0;
  inline void tick() {
    const int end = next + per_tick < 4 * lines_per_run ? next + per_tick : 4 * lines_per_run;
    for (; next < end; ++next)
      if (run[next / lines_per_run]) __builtin_prefetch(run[next / lines_per_run] + 64 * (next % lines_per_run), 0, 2);
  }
  inline void finish() {  // what the ticks left, then idle until the next step's start
    per_tick = 4 * lines_per_run;
    tick();
    per_tick = 0;
  }
};

inline vf loadf(const void* p) { vf v; std::memcpy(&v, p, sizeof(vf)); return v; }
inline void storef(void* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vu loadu(const void* p) { vu v; std::memcpy(&v, p, sizeof(vu)); return v; }
inline vf splat(float x) { return vf{} + x; }

// Horizontal max/sum by shuffles (a scalar loop is a 16-long dependency chain per row and step).
#if PF_ATTN_WIDTH == 16
inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }
inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
inline float hmax(vf v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float hsum(vf v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// Polynomial for 2^f, f in [-1/2, 1/2].
template <int DEG>
inline vf exp2_poly(vf f) {
  if (DEG == 3) return ((0.05517167f * f + 0.24261114f) * f + 0.69326099f) * f + 0.99992807f;  // rel. 7.5e-5 (as AMX)
  vf p = 1.5403530e-4f * f + 1.3333558e-3f;  // Taylor of e^(f ln 2) to degree 6: rel. ~1.2e-7
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 0.24022651f;
  p = p * f + 0.69314718f;
  return p * f + 1.0f;
}

// 2^x = poly(f) * 2^n, n = round(x), f = x - n. Masked (-inf) lanes come out exactly 0.
#if PF_ATTN_WIDTH == 16
template <int DEG>
inline vf exp2v(vf x) {
  // AVX-512: roundscale + scalef (2^n with n <= -150 underflows to exactly 0). The clamp keeps
  // -inf lanes from making f = -inf - -inf = NaN.
  const __m512 xc = _mm512_max_ps((__m512)x, _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf p = exp2_poly<DEG>((vf)_mm512_sub_ps(xc, n));
  return (vf)_mm512_scalef_ps((__m512)p, n);
}
#else
template <int DEG>
inline vf exp2v(vf x) {  // AVX2: exponent added as an integer; lanes below -126 are 0
  const vi small = x < splat(-126.f);
  const vf xc = small ? splat(-126.f) : x;
  const vf big = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (xc + big) - big;
  const vf p = exp2_poly<DEG>(xc - n);
  const vi ni = __builtin_convertvector(n, vi);
  const vf r = (vf)((vu)p + (vu)(ni << 23));
  return small ? splat(0.f) : r;
}
#endif

// Part h (of NV) of a 32-value row as (even, odd) float vectors: bf16 rows hold 16 uint32 pairs
// (low half even, high half odd), float32 rows [16 even][16 odd].
template <bool KVB>
inline void load_pair(const char* row, int h, vf& e, vf& o) {
  if (KVB) {
    const vu x = loadu(row + 4 * W * h);
    e = (vf)(x << 16);
    o = (vf)(x & 0xffff0000u);
  } else {
    e = loadf(row + 4 * W * h);
    o = loadf(row + 64 + 4 * W * h);
  }
}

#if PF_ATTN_WIDTH == 8
// AVX2: the even (odd = 0) or odd half of a 32-value row as two 8-float vectors (values 0-7 and
// 8-15 of the 16 tokens or dims). bf16 rows are loaded again for the odd half (an L1 hit) so
// that the 2R accumulators, two values and a broadcast fit in 16 ymm registers.
template <bool KVB>
inline void load_half(const char* row, int odd, __m256& a, __m256& b) {
  if (KVB) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32));
    if (odd) {
      const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
      a = _mm256_castsi256_ps(_mm256_and_si256(x0, hi));
      b = _mm256_castsi256_ps(_mm256_and_si256(x1, hi));
    } else {
      a = _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16));
      b = _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16));
    }
  } else {
    a = _mm256_loadu_ps(reinterpret_cast<const float*>(row + 64 * odd));
    b = _mm256_loadu_ps(reinterpret_cast<const float*>(row + 64 * odd + 32));
  }
}

// acc[r] += x[r * ldx] * (even half of row) + x[r * ldx + 1] * (odd half), for R rows: one
// K row (dims 2j, 2j + 1 of 16 tokens; x = q) or V row (tokens 2t, 2t + 1 of 16 dims; x = p).
template <bool KVB, int R>
inline void fma_row(__m256 (*acc)[2], const char* row, const float* x, int64_t ldx) {
  for (int odd = 0; odd < 2; ++odd) {
    __m256 a, b;
    load_half<KVB>(row, odd, a, b);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + odd);
      acc[r][0] = _mm256_fmadd_ps(xb, a, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, b, acc[r][1]);
    }
  }
}

template <int R>
inline void store_rows(float* dst, int64_t ld, __m256 (*acc)[2]) {
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(dst + r * ld, acc[r][0]);
    _mm256_storeu_ps(dst + r * ld + 8, acc[r][1]);
  }
}

// store_rows with column j multiplied by col[j] (a quantized cache's key scales; null: none).
template <int R>
inline void store_rows_scaled(float* dst, int64_t ld, __m256 (*acc)[2], const float* col) {
  if (!col) return store_rows<R>(dst, ld, acc);
  const __m256 c0 = _mm256_loadu_ps(col), c1 = _mm256_loadu_ps(col + 8);
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(dst + r * ld, _mm256_mul_ps(acc[r][0], c0));
    _mm256_storeu_ps(dst + r * ld + 8, _mm256_mul_ps(acc[r][1], c1));
  }
}
#endif

inline vh to_bf16(vf x) {  // round to nearest even, like torch's .to(bfloat16) (no NaN here)
  vu u = (vu)x;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return __builtin_convertvector(u, vh);
}


// ---- Quantized caches (int8, fp8_e4m3): one step's rows widened into the packed layout ----
// Only the codes are widened (exactly: int8 codes and e4m3 values / 256 have at most 8
// significant bits, so bf16 holds them and the bf16 word is the float's top half); the row
// scales (kernels/kv_quant.py) go to Scratch::ks/vs and are applied once per score (K) and per
// probability (V), not once per value.
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// 16 codes -> 16 floats, exactly: int8 as integers; e4m3 as the IEEE halves of value / 256
// (the 7 magnitude bits moved to the half's exponent and mantissa, e4m3's subnormals are
// halves' subnormals), widened by vcvtph2ps. The fp8 caller's scale is 256 x the row's (exact).
inline v16f widen16(__m128i codes, int kind) {
  if (kind == kInt8) {  // vpmovsxbd + vcvtdq2ps (GCC scalarizes a convertvector from int8)
#if PF_ATTN_WIDTH == 16
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
#else
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(codes, codes)));
    v16f r;
    std::memcpy(&r, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
    return r;
#endif
  }
  // Sign-extended to words, shifted by 7: bits 7-13 the magnitude, bit 15 the sign (bit 14,
  // a copy of the sign, is masked off).
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7),
                                     _mm256_set1_epi16((short)0xbf80));
#if PF_ATTN_WIDTH == 16
  return (v16f)_mm512_cvtph_ps(h);
#else
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  v16f r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#endif
}

// Two 16-float vectors of widened codes as 16 bf16 pairs (e in each dword's low half, o in its
// high half): the floats' top halves, exact for these values (see above).
inline void store_bf16_pairs(char* dst, v16f e, v16f o) {
  const v16u w = ((v16u)e >> 16) | ((v16u)o & 0xffff0000u);
  std::memcpy(dst, &w, 64);
}

// A widened (even, odd) pair of 16-value rows into the packed scratch (bf16 or float32).
template <bool KVB>
inline void store_pair(char* dst, v16f e, v16f o) {
  if (KVB) {
    store_bf16_pairs(dst, e, o);
  } else {
    std::memcpy(dst, &e, 64);
    std::memcpy(dst + 64, &o, 64);
  }
}

// In-register transpose of 16 rows of 16 bytes (four rounds of unpacks, SSE2): afterwards x[k]
// holds byte column kRev4[k] (4-bit reversal of k) of rows 0..15 in order.
constexpr int kRev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline void transpose16x16(__m128i* x) {
  __m128i y[16];
  for (int i = 0; i < 8; ++i) {
    y[i] = _mm_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
    y[i + 8] = _mm_unpackhi_epi8(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm_unpacklo_epi16(y[2 * i], y[2 * i + 1]);
    x[i + 8] = _mm_unpackhi_epi16(y[2 * i], y[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    y[i] = _mm_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    y[i + 8] = _mm_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm_unpacklo_epi64(y[2 * i], y[2 * i + 1]);
    x[i + 8] = _mm_unpackhi_epi64(y[2 * i], y[2 * i + 1]);
  }
}

// The scale of a row (256 x it for fp8, see widen16).
inline float row_scale(const char* row, int64_t D, int kind) {
  float s;
  std::memcpy(&s, row + D, 4);
  return kind == kFp8 ? s * 256.0f : s;
}

// K of 16 tokens (rows[t], t < n; the rest zero) as one packed 16-token group: for each dim
// pair, 16 tokens' (even, odd) values; codes go through the transpose as bytes.
template <int D, bool KVB>
void widen_k_group(const char* const* rows, int n, int kind, char* dst) {
  for (int blk = 0; blk < D / 16; ++blk) {
    __m128i x[16];
    for (int t = 0; t < 16; ++t)
      x[t] = t < n ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[t] + 16 * blk)) : _mm_setzero_si128();
    transpose16x16(x);
    for (int k = 0; k < 8; ++k) {  // x[k]: dim 16 blk + kRev4[k] (even), x[k + 8]: the next dim
      const int d = 16 * blk + kRev4[k];
      const int64_t off = (d / 32) * 512 + ((d % 32) / 2) * 32;
      store_pair<KVB>(dst + off * (KVB ? 2 : 4), widen16(x[k], kind), widen16(x[k + 8], kind));
    }
  }
}

// V of 32 tokens (rows[t], t < n; the rest zero) as one packed 32-token group: for each
// 16-dim chunk and token pair, the pair's 16 dims. Rows are already dims-contiguous.
template <int D, bool KVB>
void widen_v_group(const char* const* rows, int n, int kind, char* dst) {
  for (int tp = 0; tp < 16; ++tp) {
    const int t = 2 * tp;
    for (int dc = 0; dc < D / 16; ++dc) {
      const v16f e = t < n ? widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[t] + 16 * dc)), kind)
                           : v16f{};
      const v16f o = t + 1 < n
                         ? widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[t + 1] + 16 * dc)), kind)
                         : v16f{};
      const int64_t off = (int64_t)dc * 512 + tp * 32;
      store_pair<KVB>(dst + off * (KVB ? 2 : 4), e, o);
    }
  }
}

template <int D, bool KVB, int RB>
struct Kernel {
  static constexpr int R = RB;
  static constexpr int64_t kEsz = KVB ? 2 : 4;
  const Params& p;
  const Scratch& s;
  int64_t G, g, q0, part, t0, base_pos, kend, kv_lo, kv_hi;
  int M, nblk;
  float c;
  int64_t kend_b[2048 / R + 1];
  int64_t kstart_b[2048 / R + 1];  // a sliding window's first key of each block's first row
  mutable SpreadPrefetch spf;      // a decode step's prefetches of the next step (run())
  const char* const* after;        // the next item's first step (first_step_runs), or null

  Kernel(const Params& p_, const Scratch& s_, int64_t item, const char* const* after_)
      : p(p_), s(s_), after(after_) {
    const int64_t Hkv = p.num_kv_heads;
    part = item_part(p, item);
    g = item_tile_head(p, item) % Hkv;
    G = group_of(p, g);
    q0 = first_q_head(p, g);
    int64_t nt;
    item_tile(p, item, t0, nt);
    M = (int)(nt * G);
    nblk = (M + R - 1) / R;
    base_pos = p.L + t0;
    c = p.scale * 1.4426950408889634f;
    stage_q(g);
    std::memset(s.o, 0, sizeof(float) * (size_t)nblk * R * D);
    std::memset(s.l, 0, sizeof(float) * (size_t)nblk * R * W);
    for (int r = 0; r < nblk * R; ++r) s.m[r] = kNegInf;
    for (int b = 0; b < nblk; ++b) {
      const int last = R * b + R - 1 < M - 1 ? R * b + R - 1 : M - 1;
      kend_b[b] = base_pos + last / G + 1;
      kstart_b[b] = first_key(p, base_pos + R * b / G);
    }
    kend = kend_b[nblk - 1];
    item_keys(p, item, kv_lo, kv_hi);  // split KV: this part's keys; else from the window on
  }

  const char* q_row_src(int r, int64_t g) const {
    const int64_t t = r / G, h = r % G;
    const int64_t esz = p.q_bf16 ? 2 : 4;
    return static_cast<const char*>(p.q) + ((t0 + t) * p.q_st + (q0 + h) * p.q_sh) * esz;
  }

  // Q rows (padding rows zero): bf16 as given for the bf16 kernel, else float32.
  void stage_q(int64_t g) {
    const int rows = nblk * R;
#if PF_ATTN_BF16DOT
    uint16_t* dst = static_cast<uint16_t*>(s.q);
    for (int r = 0; r < rows; ++r) {
      if (r < M) std::memcpy(dst + (int64_t)r * D, q_row_src(r, g), D * 2);
      else std::memset(dst + (int64_t)r * D, 0, D * 2);
    }
#else
    float* dst = static_cast<float*>(s.q);
    for (int r = 0; r < rows; ++r) {
      float* row = dst + (int64_t)r * D;
      if (r >= M) {
        std::memset(row, 0, D * 4);
      } else if (p.q_bf16) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(q_row_src(r, g));
        for (int d = 0; d < D; ++d) {
          const uint32_t u = (uint32_t)src[d] << 16;
          std::memcpy(row + d, &u, 4);
        }
      } else {
        std::memcpy(row, q_row_src(r, g), D * 4);
      }
    }
#endif
  }

  const char* tok_ptr(const void* base, int64_t tok) const {
    return static_cast<const char*>(base) + packed_token_offset(p, g, tok) * kEsz;
  }

  // Quantized cache: the row of (token, this item's kv head) in the token-major layer.
  const char* quant_row(const void* base, int64_t tok) const {
    const int64_t ps = p.page_size, slot = (int64_t)p.page_table[tok / ps] * ps + tok % ps;
    return static_cast<const char*>(base) + (slot * p.num_kv_heads + g) * (D + 4);
  }

  // Quantized cache: the step's K and V widened into the scratch (packed 16- and 32-token
  // groups, as kg/vg point into a packed cache), the next step's rows prefetched to L2.
  void widen_step(int64_t kv0, int nstep, const char** kg, const char** vg) const {
    const char* kr[NB];
    const char* vr[NB];
    const int64_t stride = p.num_kv_heads * (D + 4);
    const char* k0 = quant_row(p.k, kv0);  // the rest by steps within the page (no division)
    const char* v0 = quant_row(p.v, kv0);
    for (int t = 0; t < nstep; ++t) {
      const bool same_page = (kv0 % p.page_size) + t < p.page_size;
      kr[t] = same_page ? k0 + t * stride : quant_row(p.k, kv0 + t);
      vr[t] = same_page ? v0 + t * stride : quant_row(p.v, kv0 + t);
      s.ks[t] = row_scale(kr[t], D, p.kv_quant);
      s.vs[t] = row_scale(vr[t], D, p.kv_quant);
    }
    for (int t = nstep; t < NB; ++t) s.ks[t] = s.vs[t] = 0.0f;  // padding keys: score 0, p 0
    const int64_t next = kv0 + NB;
    const char* k1 = next < kv_hi ? quant_row(p.k, next) : nullptr;
    const char* v1 = next < kv_hi ? quant_row(p.v, next) : nullptr;
    for (int64_t t = next; t < next + NB && t < kv_hi; ++t) {
      const bool same_page = (next % p.page_size) + (t - next) < p.page_size;
      const char* k = same_page ? k1 + (t - next) * stride : quant_row(p.k, t);
      const char* v = same_page ? v1 + (t - next) * stride : quant_row(p.v, t);
      __builtin_prefetch(k, 0, 2);
      __builtin_prefetch(k + D + 3, 0, 2);
      __builtin_prefetch(v, 0, 2);
      __builtin_prefetch(v + D + 3, 0, 2);
    }
    char* kd = static_cast<char*>(s.kq);
    char* vd = static_cast<char*>(s.vq);
    for (int j = 0; 16 * j < nstep; ++j) {
      kg[j] = kd + 16 * D * kEsz * j;
      widen_k_group<D, KVB>(kr + 16 * j, nstep - 16 * j, p.kv_quant, kd + 16 * D * kEsz * j);
    }
    for (int j = 0; 32 * j < nstep; ++j) {
      vg[j] = vd + 32 * D * kEsz * j;
      widen_v_group<D, KVB>(vr + 32 * j, nstep - 32 * j, p.kv_quant, vd + 32 * D * kEsz * j);
    }
  }

  // Independent accumulator chains per pass: a block of R rows alone gives R chains (vdpbf16ps
  // and FMA latency 4-6), too few to keep the vector unit busy at decode's R = 4, so QK^T takes
  // NG 16-token groups and PV NDC 16-dim chunks per pass. Each accumulator still sums in the
  // same order, so the bits do not depend on NG or NDC. AVX2 (16 ymm) keeps one per pass.
  static constexpr int kChains = W == 16 ? 16 : R * NV;
  static constexpr int NG = kChains / (R * NV) < 4 ? kChains / (R * NV) : 4;
  static constexpr int NDC = NG < D / 16 ? NG : D / 16;

  // S[R, 16 * N] (row stride NB) = Q_block K^T for N 16-token groups kg[0..N), each column
  // times its key's scale ks[column] (a quantized cache; null: none, x 1 is exact).
  template <int N>
  void qk_groups(int b, const char* const* kg, float* S, const float* ks) const {
#if PF_ATTN_BF16DOT
    vf acc[N][R];
    for (int n = 0; n < N; ++n)
      for (int r = 0; r < R; ++r) acc[n][r] = vf{};
    const uint32_t* q = static_cast<const uint32_t*>(s.q) + (int64_t)R * b * (D / 2);
    for (int j = 0; j < D / 2; ++j) {
      const int64_t off = ((j / 16) * 512 + (j % 16) * 32) * kEsz;
      spf.tick();
      __m512bh kr[N];
      for (int n = 0; n < N; ++n) kr[n] = (__m512bh)_mm512_loadu_si512(kg[n] + off);
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r * (D / 2) + j]);
        for (int n = 0; n < N; ++n) acc[n][r] = (vf)_mm512_dpbf16_ps((__m512)acc[n][r], qb, kr[n]);
      }
    }
    for (int n = 0; n < N; ++n) {
      const vf sc = ks ? loadf(ks + 16 * n) : splat(1.0f);
      for (int r = 0; r < R; ++r) storef(S + r * NB + 16 * n, acc[n][r] * sc);
    }
#elif PF_ATTN_WIDTH == 8
    static_assert(N == 1, "AVX2 keeps one 16-token group per pass");
    // R rows x 16 tokens = 2R ymm accumulators; per dim two K vectors and one broadcast per
    // row, in dim order 0, 1, 2, ... (the generic code's order, so the same bits).
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* q = static_cast<const float*>(s.q) + (int64_t)R * b * D;
    for (int j = 0; j < D / 2; ++j)
      fma_row<KVB, R>(acc, kg[0] + ((j / 16) * 512 + (j % 16) * 32) * kEsz, q + 2 * j, D);
    store_rows_scaled<R>(S, NB, acc, ks);
#else
    vf acc[N][R][NV];
    for (int n = 0; n < N; ++n)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < NV; ++h) acc[n][r][h] = vf{};
    const float* q = static_cast<const float*>(s.q) + (int64_t)R * b * D;
    for (int j = 0; j < D / 2; ++j) {
      const int64_t off = ((j / 16) * 512 + (j % 16) * 32) * kEsz;
      for (int n = 0; n < N; ++n)
        for (int h = 0; h < NV; ++h) {
          vf e, o;
          load_pair<KVB>(kg[n] + off, h, e, o);
          for (int r = 0; r < R; ++r) {
            acc[n][r][h] += q[r * D + 2 * j] * e;
            acc[n][r][h] += q[r * D + 2 * j + 1] * o;
          }
        }
    }
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < NV; ++h) {
        const vf sc = ks ? loadf(ks + 16 * n + h * W) : splat(1.0f);
        for (int r = 0; r < R; ++r) storef(S + r * NB + 16 * n + h * W, acc[n][r][h] * sc);
      }
#endif
  }

  // S = Q_block K^T for the step's first `groups` 16-token groups, NG at a time.
  // The last groups (a decode step of 33-63 keys has 3) go in one pass too: one group alone is
  // R chains, latency-bound at decode's R = 4.
  void qk_block(int b, const char* const* kg, int groups) const {
    const float* ks = p.kv_quant ? s.ks : nullptr;
    int j = 0;
    for (; j + NG <= groups; j += NG) qk_groups<NG>(b, kg + j, s.s + 16 * j, ks ? ks + 16 * j : ks);
    const float* kt = ks ? ks + 16 * j : ks;
    switch (groups - j) {  // < NG (the N below only keep N <= NG instantiated)
      case 3: qk_groups<(NG > 3 ? 3 : 1)>(b, kg + j, s.s + 16 * j, kt); break;
      case 2: qk_groups<(NG > 2 ? 2 : 1)>(b, kg + j, s.s + 16 * j, kt); break;
      case 1: qk_groups<1>(b, kg + j, s.s + 16 * j, kt); break;
      default: break;
    }
  }

  // One row of ncol scores: columns < lo (before a window) and > lim masked; softmax'd in
  // place (and as bf16 into prow).
  // The row's sum stays a vector (s.l[r * W ..]) until the epilogue: no reduction per step.
  // vs (a quantized cache's value scales; null: none): the probabilities P V reads are p x vs,
  // the sum is of p.
  void softmax_row(float* srow, uint16_t* prow, int ncol, int lo, int lim, int r, const float* vs) const {
    for (int x = 0; x < lo; ++x) srow[x] = kNegInf;
    if (lim < ncol - 1)
      for (int x = lim + 1; x < ncol; ++x) srow[x] = kNegInf;
    vf mx0 = splat(kNegInf), mx1 = mx0;
    int x = 0;
    for (; x + 2 * W <= ncol; x += 2 * W) {
      mx0 = vmax(mx0, loadf(srow + x));
      mx1 = vmax(mx1, loadf(srow + x + W));
    }
    if (x < ncol) mx0 = vmax(mx0, loadf(srow + x));
    const float bmax = hmax(vmax(mx0, mx1)) * c;
    float m = s.m[r];
    float* lrow = s.l + (int64_t)r * W;
    if (bmax > m + kLazy) {
      if (m != kNegInf) {
        const float alpha = __builtin_exp2f(m - bmax);
        storef(lrow, loadf(lrow) * alpha);
        float* orow = s.o + (int64_t)r * D;
        for (int d = 0; d < D; d += W) storef(orow + d, loadf(orow + d) * alpha);
      }
      m = bmax;
      s.m[r] = m;
    }
    vf sum = loadf(lrow);
#if PF_ATTN_BF16DOT
    x = 0;
    for (; x + 32 <= ncol; x += 32) {  // two vectors -> 32 bf16 in one rounding instruction
      const vf p0 = exp2v<3>(loadf(srow + x) * c - m);
      const vf p1 = exp2v<3>(loadf(srow + x + 16) * c - m);
      sum += p0 + p1;
      const vf w0 = vs ? p0 * loadf(vs + x) : p0, w1 = vs ? p1 * loadf(vs + x + 16) : p1;
      _mm512_storeu_si512(prow + x, (__m512i)_mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0));
    }
    if (x < ncol) {
      const vf p0 = exp2v<3>(loadf(srow + x) * c - m);
      sum += p0;
      const vf w0 = vs ? p0 * loadf(vs + x) : p0;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + x), (__m256i)_mm512_cvtneps_pbh((__m512)w0));
    }
#else
    // float32: the step's sum is added to lane 0 in lane order, the summation order of the
    // first version of these kernels (a vector sum moved an end-to-end logprob by 1.5e-4 against
    // split SDPA, past test_bf16_kv_cache_matches_hf_within_rounding's 1e-4).
    vf step = vf{};
    for (x = 0; x < ncol; x += W) {
      const vf pv = exp2v<6>(loadf(srow + x) * c - m);
      storef(srow + x, vs ? pv * loadf(vs + x) : pv);
      step += pv;
    }
    float t = 0.f;
    for (int i = 0; i < W; ++i) t += step[i];
    sum[0] += t;
    (void)prow;
#endif
    storef(lrow, sum);
  }

  // O_block[R, D] += P[R, 2 * npairs] V[2 * npairs, D]; vg: the step's 32-token V groups.
  void pv_block(int b, const float* S, const uint16_t* P, const char* const* vg, int npairs) const {
    for (int dc = 0; dc < D / 16; dc += NDC) pv_chunks<NDC>(b, S, P, vg, npairs, dc);
  }

  // O_block[R, 16 dims of chunks dc0 .. dc0 + N) += P V: N chunks' chains side by side.
  template <int N>
  void pv_chunks(int b, const float* S, const uint16_t* P, const char* const* vg, int npairs, int dc0) const {
    float* O = s.o + (int64_t)R * b * D + dc0 * 16;
#if PF_ATTN_BF16DOT
    vf acc[N][R];
    for (int n = 0; n < N; ++n)
      for (int r = 0; r < R; ++r) acc[n][r] = loadf(O + r * D + n * 16);
    for (int tp = 0; tp < npairs; ++tp) {
      const char* row = vg[tp / 16] + ((int64_t)dc0 * 512 + (tp % 16) * 32) * kEsz;
      spf.tick();
      __m512bh vr[N];
      for (int n = 0; n < N; ++n) vr[n] = (__m512bh)_mm512_loadu_si512(row + n * 512 * kEsz);
      for (int r = 0; r < R; ++r) {
        uint32_t pp;
        std::memcpy(&pp, P + r * NB + 2 * tp, 4);
        const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp);
        for (int n = 0; n < N; ++n) acc[n][r] = (vf)_mm512_dpbf16_ps((__m512)acc[n][r], pb, vr[n]);
      }
    }
    for (int n = 0; n < N; ++n)
      for (int r = 0; r < R; ++r) storef(O + r * D + n * 16, acc[n][r]);
    (void)S;
#elif PF_ATTN_WIDTH == 8
    static_assert(N == 1, "AVX2 keeps one 16-dim chunk per pass");
    // As qk_groups: R rows x 16 dims, per token two V vectors and one broadcast of p per row,
    // tokens in order (the generic code's order).
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_loadu_ps(O + r * D);
      acc[r][1] = _mm256_loadu_ps(O + r * D + 8);
    }
    for (int tp = 0; tp < npairs; ++tp)
      fma_row<KVB, R>(acc, vg[tp / 16] + ((int64_t)dc0 * 512 + (tp % 16) * 32) * kEsz, S + 2 * tp, NB);
    store_rows<R>(O, D, acc);
    (void)P;
#else
    vf acc[N][R][NV];
    for (int n = 0; n < N; ++n)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < NV; ++h) acc[n][r][h] = loadf(O + r * D + n * 16 + h * W);
    for (int tp = 0; tp < npairs; ++tp) {
      const char* row = vg[tp / 16] + ((int64_t)dc0 * 512 + (tp % 16) * 32) * kEsz;
      for (int n = 0; n < N; ++n)
        for (int h = 0; h < NV; ++h) {
          vf e, o;
          load_pair<KVB>(row + n * 512 * kEsz, h, e, o);
          for (int r = 0; r < R; ++r) {
            acc[n][r][h] += S[r * NB + 2 * tp] * e;
            acc[n][r][h] += S[r * NB + 2 * tp + 1] * o;
          }
        }
    }
    for (int n = 0; n < N; ++n)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < NV; ++h) storef(O + r * D + n * 16 + h * W, acc[n][r][h]);
    (void)P;
#endif
  }

  void run() {
    const char* kg[NB / 16];
    const char* vg[NB / 32];
    for (int64_t kv0 = kv_lo; kv0 < kv_hi; kv0 += NB) {
      const int64_t nstep = kv_hi - kv0 < NB ? kv_hi - kv0 : NB;
      const char* next[4] = {nullptr, nullptr, nullptr, nullptr};  // K run 0, 1; V run 0, 1
      if (p.kv_quant) {
        widen_step(kv0, (int)nstep, kg, vg);
      } else {
        for (int j = 0; j < (nstep + 15) / 16; ++j) kg[j] = tok_ptr(p.k, kv0 + 16 * j);
        for (int j = 0; j < (nstep + 31) / 32; ++j) vg[j] = tok_ptr(p.v, kv0 + 32 * j);
      }
      // The next step's K and V (32-token runs on other pages, where the hardware prefetchers
      // stop) are prefetched to L2, a share per block, while this step computes; during the
      // last step, the first step of the item this thread runs next (`after`).
      for (int j = 0; !p.kv_quant && kv0 + NB + 32 * j < kv_hi && j < 2; ++j) {
        next[j] = tok_ptr(p.k, kv0 + NB + 32 * j);
        next[2 + j] = tok_ptr(p.v, kv0 + NB + 32 * j);
      }
      if (after && kv0 + NB >= kv_hi)
        for (int j = 0; j < 4; ++j) next[j] = after[j];
      constexpr int kRunLines = 32 * D * kEsz / 64;
      // A decode step (one block, bf16 dot products) spreads them over its QK^T and PV
      // iterations (D / 2 each, a pass); else a share before each block.
      const bool spread = kBf16Dot && nblk == 1 && !p.kv_quant;
      if (spread) {
        for (int j = 0; j < 4; ++j) spf.run[j] = next[j];
        spf.lines_per_run = kRunLines;
        spf.next = 0;
        spf.per_tick = (4 * kRunLines + D - 1) / D;
      }
      for (int b = 0; b < nblk; ++b) {
        for (int i = 4 * kRunLines * b / nblk; !spread && i < 4 * kRunLines * (b + 1) / nblk; ++i)
          if (next[i / kRunLines]) __builtin_prefetch(next[i / kRunLines] + 64 * (i % kRunLines), 0, 2);
        const int64_t hi = kend_b[b] < kv_hi ? kend_b[b] : kv_hi;
        // The block sees none of the step: all keys after its last row, or before its first
        // row's window (rows later in a block start their windows later still).
        if (hi <= kv0 || kstart_b[b] >= (hi < kv0 + NB ? hi : kv0 + NB)) continue;
        const int64_t nb = hi - kv0 < NB ? hi - kv0 : NB;
        const int ncol = (int)((nb + 15) / 16 * 16);
        qk_block(b, kg, ncol / 16);
        for (int i = 0; i < R; ++i) {
          const int r = R * b + i;
          const int rr = r < M ? r : M - 1;  // padding rows behave like the last real row
          const int64_t pos = base_pos + rr / G;
          const int64_t lim = pos - kv0;                // last visible column of this row
          const int64_t lo = first_key(p, pos) - kv0;  // first visible column (a window)
          float* srow = s.s + i * NB;
          uint16_t* prow = s.p + i * NB;
          if (lim < 0 || lo >= ncol) {  // the row sees none of this step: zero probabilities
            std::memset(srow, 0, ncol * 4);
            std::memset(prow, 0, ncol * 2);
          } else {
            softmax_row(srow, prow, ncol, (int)(lo > 0 ? lo : 0), (int)(lim < ncol - 1 ? lim : ncol - 1), r,
                        p.kv_quant ? s.vs : nullptr);
          }
        }
        pv_block(b, s.s, s.p, vg, ncol / 2);
      }
      if (spread) spf.finish();
    }
  }

  // Split KV: the unnormalised O rows, running max and sum of this part, for the glue to merge.
  void epilogue_part() const {
    float* dst = p.partial + (g * p.nparts + part) * p.C * p.group * (D + 2);
    for (int r = 0; r < M; ++r, dst += D + 2) {
      std::memcpy(dst, s.o + (int64_t)r * D, D * 4);
      dst[D] = s.m[r];
      dst[D + 1] = hsum(loadf(s.l + (int64_t)r * W));
    }
  }

  void epilogue() const {
    if (p.nparts > 1) return epilogue_part();
    const int64_t esz = p.q_bf16 ? 2 : 4;
    for (int r = 0; r < M; ++r) {
      const int64_t t = r / G, h = r % G;
      char* dst = static_cast<char*>(p.out) + ((t0 + t) * p.o_st + (q0 + h) * p.o_sh) * esz;
      const float inv = 1.0f / hsum(loadf(s.l + (int64_t)r * W));
      const float* orow = s.o + (int64_t)r * D;
      for (int d = 0; d < D; d += W) {
        const vf x = loadf(orow + d) * inv;
        if (p.q_bf16) {
          const vh hb = to_bf16(x);
          std::memcpy(dst + d * 2, &hb, sizeof(vh));
        } else {
          storef(dst + d * 4, x);
        }
      }
    }
  }
};

// ---- Decode over an int8 cache with bf16 q: integer dot products, no scratch widening ----
// (ARCHITECTURE.md, 'The KV room', quantized pages.) One query token of G <= 4 heads reads each
// K and V row once, in registers, for all its heads. Scores: q in int16 per head (|q| max ->
// 32767, an error of max|q| / 65534 per value, far below q's own bf16 rounding), K codes
// transposed as dwords (8 keys x 4 dims a lane group) and widened to int16, vpmaddwd into int32
// (exact). Values: per step the weights p x scale_v of a head in int16 against the step's
// largest (an error of 1 / 65534 of it per weight, where the bf16 kernel rounds p to 8 bits),
// two keys' codes interleaved per dim, vpmaddwd into int32 (exact), the sums taken into the
// float32 output once per step. Float32 q keeps the widening path (its tolerance is float32's).
alignas(64) const int8_t kZeroRow[kMaxHeadDim + 4] = {};

#if PF_ATTN_WIDTH == 16
typedef __m512i ivec;
// acc + a . b in pairs; the empty asm keeps each accumulator a chain in one register (GCC
// otherwise re-associates the integer sums into trees of products and spills them).
inline ivec madd_acc(ivec acc, ivec a, ivec b) {
  ivec r = _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
  asm("" : "+v"(r));
  return r;
}

// 8 rows of 16 dwords -> x[2e]: dword e of rows 0..7 (low 256 bits), dword 4 + e (high);
// x[2e + 1]: dwords 8 + e and 12 + e.
inline void transpose8x16(__m512i* x) {
  __m512i t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  __m512i r[8];  // r[4i + e], 128-bit chunk k: dword 4k + e of rows 4i .. 4i + 3
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int e = 0; e < 4; ++e) {
    x[2 * e] = _mm512_permutex2var_epi64(r[e], lo, r[4 + e]);
    x[2 * e + 1] = _mm512_permutex2var_epi64(r[e], hi, r[4 + e]);
  }
}
#else
typedef __m256i ivec;
inline ivec madd_acc(ivec acc, ivec a, ivec b) {  // as the AVX-512 one
  ivec r = _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
  asm("" : "+v"(r));
  return r;
}

// 8 rows of 8 dwords -> x[e]: dword e of rows 0..7.
inline void transpose8x8(__m256i* x) {
  __m256i t[8], r[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // r[4i + e], 128-bit lane k: dword 4k + e of rows 4i .. 4i + 3
    r[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    x[e] = _mm256_permute2x128_si256(r[e], r[4 + e], 0x20);
    x[4 + e] = _mm256_permute2x128_si256(r[e], r[4 + e], 0x31);
  }
}
#endif

// KIND kInt8 (bf16 q) as above. kFp8 and kInt8Float (AVX-512 only; fp8, or int8 under float32
// q, whose tolerance is float32's): the same transposes, the codes widened exactly in
// registers (fp8 as IEEE halves of value / 256, as widen16) and float32 FMAs against q as
// given; the weights p x scale_v stay float32.
constexpr int kInt8Float = 3;

template <int D, int R, int KIND>
struct QuantDecode {
  static constexpr bool kI8 = KIND == kInt8;
  const Params& p;
  const Scratch& s;
  int64_t g, part, kv_lo, kv_hi;
  alignas(64) int16_t q16[kI8 ? R : 1][D];  // int8: q in int16, per head
  alignas(64) float qf[kI8 ? 1 : R][D];     // float path: q in float32
  float qs[R];  // q's scale (int8; float path: 1) times softmax scale x log2(e)
  float m[R], l[R], wscale[R];

  QuantDecode(const Params& p_, const Scratch& s_, int64_t item) : p(p_), s(s_) {
    part = item_part(p, item);
    g = item_tile_head(p, item) % p.num_kv_heads;  // one q-tile: C = 1
    // Split parts count from the window's group; the first part starts at the first key seen
    // (this path masks nothing, so it reads no key before it).
    const int64_t first = first_key(p, p.L), kend = p.L + 1;
    kv_lo = p.nparts > 1 ? p.kv_begin + part * p.kv_part : first;
    kv_hi = p.nparts > 1 && kv_lo + p.kv_part < kend ? kv_lo + p.kv_part : kend;
    if (kv_lo < first) kv_lo = first;
    const float c = p.scale * 1.4426950408889634f;
    for (int r = 0; r < R; ++r) {
      const char* src = static_cast<const char*>(p.q) + (g * R + r) * p.q_sh * (p.q_bf16 ? 2 : 4);
      float x[D], amax = 0.0f;
      for (int d = 0; d < D; ++d) {
        if (p.q_bf16) {
          uint16_t h;
          std::memcpy(&h, src + 2 * d, 2);
          const uint32_t u = (uint32_t)h << 16;
          std::memcpy(&x[d], &u, 4);
        } else {
          std::memcpy(&x[d], src + 4 * d, 4);
        }
        amax = x[d] > amax ? x[d] : -x[d] > amax ? -x[d] : amax;
      }
      m[r] = kNegInf;
      l[r] = 0.0f;
      if (!kI8) {
        std::memcpy(qf[kI8 ? 0 : r], x, sizeof x);
        qs[r] = c;
        continue;
      }
      const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
      for (int d = 0; d < D; ++d) {
        const float y = __builtin_rintf(x[d] * inv);
        q16[kI8 ? r : 0][d] = (int16_t)(y > 32767.0f ? 32767.0f : y < -32767.0f ? -32767.0f : y);
      }
      qs[r] = amax > 0.0f ? c / inv : 0.0f;
    }
    std::memset(s.o, 0, sizeof(float) * R * D);
  }

  int64_t qpat(int r, int j) const {  // q's dims 4j .. 4j + 3 as one int64
    int64_t x;
    std::memcpy(&x, &q16[kI8 ? r : 0][4 * j], 8);
    return x;
  }

#if PF_ATTN_WIDTH == 16
  // 32 fp8 codes -> 32 IEEE halves of value / 256 (as widen16).
  static __m512i fp8_halves(__m256i codes) {
    return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7), _mm512_set1_epi16((short)0xbf80));
  }

  // 32 codes -> their values (fp8: / 256) as floats: codes 0-15 in a, 16-31 in b.
  static void widen32(__m256i codes, __m512& a, __m512& b) {
    if (KIND == kFp8) {
      const __m512i h = fp8_halves(codes);
      a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    } else {
      a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
      b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
    }
  }

  // float path: S[r * NB + 0..16) = the scores of 16 keys; acc[i] lanes 4t + u: key 4i + t's
  // dims = u mod 4.
  void score16_float(const char* const* rows, const float* ks, float* S) const {
    __m512 acc[4][R];
    for (int i = 0; i < 4; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int half = 0; half < 2; ++half) {
      for (int blk = 0; blk < D / 64; ++blk) {
        __m512i x[8];
        for (int i = 0; i < 8; ++i) x[i] = _mm512_loadu_si512(rows[8 * half + i] + 64 * blk);
        transpose8x16(x);
        for (int e = 0; e < 8; ++e) {
          for (int hi = 0; hi < 2; ++hi) {  // 8 keys' dims 4j .. 4j + 3
            const int j = 16 * blk + (e % 2 ? 8 : 0) + e / 2 + 4 * hi;
            __m512 f0, f1;  // keys 0-3, 4-7
            widen32(hi ? _mm512_extracti64x4_epi64(x[e], 1) : _mm512_castsi512_si256(x[e]), f0, f1);
            for (int r = 0; r < R; ++r) {
              const __m512 q = _mm512_broadcast_f32x4(_mm_loadu_ps(&qf[kI8 ? 0 : r][4 * j]));
              acc[2 * half][r] = _mm512_fmadd_ps(f0, q, acc[2 * half][r]);
              acc[2 * half + 1][r] = _mm512_fmadd_ps(f1, q, acc[2 * half + 1][r]);
            }
          }
        }
      }
    }
    // per 128-bit lane k: the four sums of keys k, 4 + k, 8 + k, 12 + k, then in key order
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 kscale = _mm512_loadu_ps(ks);
    for (int r = 0; r < R; ++r) {
      const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(acc[0][r], acc[1][r]), _mm512_unpackhi_ps(acc[0][r], acc[1][r]));
      const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(acc[2][r], acc[3][r]), _mm512_unpackhi_ps(acc[2][r], acc[3][r]));
      const __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
      _mm512_storeu_ps(S + r * NB, _mm512_mul_ps(_mm512_mul_ps(_mm512_permutexvar_ps(order, sum), kscale),
                                                 _mm512_set1_ps(qs[r])));
    }
  }

  // float path: O[r] += sum_t w[r][t] * V values[t] (w float32 in s.s), the codes widened per key.
  void pv_float(const char* const* vr, int ncol) const {
    for (int blk = 0; blk < D / 64; ++blk) {
      __m512 acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_loadu_ps(s.o + r * D + 64 * blk + 16 * i);
      for (int t = 0; t < ncol; ++t) {
        const __m512i codes = _mm512_loadu_si512(vr[t] + 64 * blk);
        __m512 f[4];
        widen32(_mm512_castsi512_si256(codes), f[0], f[1]);
        widen32(_mm512_extracti64x4_epi64(codes, 1), f[2], f[3]);
        for (int r = 0; r < R; ++r) {
          const __m512 w = _mm512_set1_ps(s.s[r * NB + t]);
          for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(w, f[i], acc[r][i]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(s.o + r * D + 64 * blk + 16 * i, acc[r][i]);
    }
  }

  // S[r * NB + 0..16) = the scores of 16 keys (rows[t]) for every head, in the log2 domain.
  void score16(const char* const* rows, const float* ks, float* S) const {
    if (!kI8) return score16_float(rows, ks, S);
    __m512i acc[2][R];
    for (int half = 0; half < 2; ++half) {  // keys 8 half .. 8 half + 7
      for (int r = 0; r < R; ++r) acc[half][r] = _mm512_setzero_si512();
      for (int blk = 0; blk < D / 64; ++blk) {
        __m512i x[8];
        for (int i = 0; i < 8; ++i) x[i] = _mm512_loadu_si512(rows[8 * half + i] + 64 * blk);
        transpose8x16(x);
        for (int e = 0; e < 8; ++e) {  // x[e]: 8 keys' dims 4j .. 4j + 3 (low half), 4j + 16 .. (high)
          const int j = 16 * blk + (e % 2 ? 8 : 0) + e / 2;
          const __m512i lo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(x[e]));
          const __m512i hi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(x[e], 1));
          for (int r = 0; r < R; ++r) {
            acc[half][r] = madd_acc(acc[half][r], lo, _mm512_set1_epi64(qpat(r, j)));
            acc[half][r] = madd_acc(acc[half][r], hi, _mm512_set1_epi64(qpat(r, j + 4)));
          }
        }
      }
    }
    // lanes 2t and 2t + 1 of acc[half] hold key 8 half + t's two partial sums
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 kscale = _mm512_loadu_ps(ks);
    for (int r = 0; r < R; ++r) {
      const __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(acc[0][r], even, acc[1][r]),
                                           _mm512_permutex2var_epi32(acc[0][r], odd, acc[1][r]));
      _mm512_storeu_ps(S + r * NB, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), kscale), _mm512_set1_ps(qs[r])));
    }
  }

  // 16 floats -> 16 int16 (round to nearest even; |x| <= 32767)
  static void store_w16(int16_t* dst, vf x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32((__m512)x)));
  }

  // O[r] += wscale[r] * sum_t w16[r][t] * V codes[t] over keys [0, ncol), two keys per vpmaddwd.
  void pv(const char* const* vr, int ncol, const int16_t* w16) const {
    if (!kI8) return pv_float(vr, ncol);
    for (int blk = 0; blk < D / 64; ++blk) {
      __m512i acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_si512();
      for (int t = 0; t < ncol; t += 2) {
        const __m512i a = _mm512_loadu_si512(vr[t] + 64 * blk), b = _mm512_loadu_si512(vr[t + 1] + 64 * blk);
        const __m512i lo = _mm512_unpacklo_epi8(a, b), hi = _mm512_unpackhi_epi8(a, b);
        // x[i], dword lanes: dims 0-7 | 16-23 (x0), 32-39 | 48-55 (x1), 8-15 | 24-31 (x2), 40-47 | 56-63 (x3)
        const __m512i x[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
                              _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                              _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
                              _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
        for (int r = 0; r < R; ++r) {
          int32_t wp;
          std::memcpy(&wp, w16 + r * NB + t, 4);
          const __m512i w = _mm512_set1_epi32(wp);
          for (int i = 0; i < 4; ++i) acc[r][i] = madd_acc(acc[r][i], x[i], w);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 ws = _mm512_set1_ps(wscale[r]);
        __m512 f[4];
        for (int i = 0; i < 4; ++i) f[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][i]), ws);
        const __m512 nat[4] = {_mm512_shuffle_f32x4(f[0], f[2], 0x44), _mm512_shuffle_f32x4(f[0], f[2], 0xee),
                               _mm512_shuffle_f32x4(f[1], f[3], 0x44), _mm512_shuffle_f32x4(f[1], f[3], 0xee)};
        float* orow = s.o + r * D + 64 * blk;
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(orow + 16 * i, _mm512_add_ps(_mm512_loadu_ps(orow + 16 * i), nat[i]));
      }
    }
  }
#else
  // AVX2: as above in 8-key groups and 32-byte blocks of dims.
  void score16(const char* const* rows, const float* ks, float* S) const {
    for (int half = 0; half < 2; ++half) {  // keys 8 half .. 8 half + 7
      __m256i acc[R][2];                    // keys 0-3, 4-7 of the half: lanes 2t, 2t + 1
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int blk = 0; blk < D / 32; ++blk) {
        __m256i x[8];
        for (int i = 0; i < 8; ++i) x[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[8 * half + i] + 32 * blk));
        transpose8x8(x);
        for (int e = 0; e < 8; ++e) {  // x[e]: 8 keys' dims 4j .. 4j + 3
          const int j = 8 * blk + e;
          const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x[e]));
          const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x[e], 1));
          for (int r = 0; r < R; ++r) {
            const __m256i q = _mm256_set1_epi64x(qpat(r, j));
            acc[r][0] = madd_acc(acc[r][0], lo, q);
            acc[r][1] = madd_acc(acc[r][1], hi, q);
          }
        }
      }
      const __m256 kscale = _mm256_loadu_ps(ks + 8 * half);
      for (int r = 0; r < R; ++r) {  // hadd: keys 0 1 4 5 | 2 3 6 7, put in order
        const __m256i sum = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xd8);
        _mm256_storeu_ps(S + r * NB + 8 * half,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), kscale), _mm256_set1_ps(qs[r])));
      }
    }
  }

  static void store_w16(int16_t* dst, vf x) {
    const __m256i w = _mm256_cvtps_epi32((__m256)x);  // packs: lanes 0-3 of w, 0-3 of 0, 4-7 of w, ...
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(w, w), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
  }

  // 16 dims at a time: two keys' codes interleaved (xmm), widened to 8 + 8 dword lanes.
  void pv(const char* const* vr, int ncol, const int16_t* w16) const {
    for (int dc = 0; dc < D / 16; ++dc) {
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int t = 0; t < ncol; t += 2) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr[t] + 16 * dc));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vr[t + 1] + 16 * dc));
        const __m256i x0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));  // dims 0-7
        const __m256i x1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));  // dims 8-15
        for (int r = 0; r < R; ++r) {
          int32_t wp;
          std::memcpy(&wp, w16 + r * NB + t, 4);
          const __m256i w = _mm256_set1_epi32(wp);
          acc[r][0] = madd_acc(acc[r][0], x0, w);
          acc[r][1] = madd_acc(acc[r][1], x1, w);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 ws = _mm256_set1_ps(wscale[r]);
        float* orow = s.o + r * D + 16 * dc;
        for (int i = 0; i < 2; ++i)
          _mm256_storeu_ps(orow + 8 * i, _mm256_add_ps(_mm256_loadu_ps(orow + 8 * i),
                                                       _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][i]), ws)));
      }
    }
  }
#endif

  // Row r's scores of the step (n real keys of ncol) -> online softmax; the weights p x vs in
  // int16 (w16, against their largest, wscale[r]); O rescaled to the new max.
  void softmax(int r, int n, int ncol, const float* vs, int16_t* w16) {
    float* srow = s.s + r * NB;
    for (int x = n; x < ncol; ++x) srow[x] = kNegInf;
    vf mx = splat(kNegInf);
    for (int x = 0; x < ncol; x += W) mx = vmax(mx, loadf(srow + x));
    const float top = hmax(mx), mnew = top > m[r] ? top : m[r];
    const float alpha = __builtin_exp2f(m[r] - mnew);
    float* orow = s.o + r * D;
    if (alpha != 1.0f)
      for (int d = 0; d < D; d += W) storef(orow + d, loadf(orow + d) * alpha);
    m[r] = mnew;
    vf sum = vf{}, wmax = vf{};
    for (int x = 0; x < ncol; x += W) {
      const vf pv = exp2v<6>(loadf(srow + x) - mnew);
      sum += pv;
      const vf w = pv * loadf(vs + x);
      storef(srow + x, w);
      wmax = vmax(wmax, w);
    }
    l[r] = l[r] * alpha + hsum(sum);
    if (!kI8) return;  // float path: the float32 weights stay in s.s
    const float wm = hmax(wmax), k = wm > 0.0f ? 32767.0f / wm : 0.0f;
    wscale[r] = wm / 32767.0f;
    for (int x = 0; x < ncol; x += 16) {
      vf a = loadf(srow + x) * k, b = W == 8 ? loadf(srow + x + 8) * k : vf{};
      a = vmax(vmin(a, splat(32767.0f)), splat(0.0f));
      b = vmax(vmin(b, splat(32767.0f)), splat(0.0f));
      store_w16(w16 + r * NB + x, a);
      if (W == 8) store_w16(w16 + r * NB + x + 8, b);
    }
  }

  // Byte offsets of the rows of keys [tok0, tok0 + n) in the layer caches (one division per
  // call: a division per key cost more than the key's arithmetic).
  void row_offsets(int64_t tok0, int n, int64_t* off) const {
    const int64_t ps = p.page_size;
    int64_t page = tok0 / ps, in_page = tok0 % ps;
    for (int t = 0; t < n; ++t) {
      off[t] = (((int64_t)p.page_table[page] * ps + in_page) * p.num_kv_heads + g) * (D + 4);
      if (++in_page == ps) {
        in_page = 0;
        ++page;
      }
    }
  }

  void run() {
    const char* kr[NB];
    const char* vr[NB];
    int64_t offs[2][NB];  // this step's row offsets, the next step's
    alignas(64) float ks[NB], vs[NB];
    int16_t* w16 = reinterpret_cast<int16_t*>(s.p);  // [R, NB]
    const char* zero = reinterpret_cast<const char*>(kZeroRow);
    const char* kbase = static_cast<const char*>(p.k);
    const char* vbase = static_cast<const char*>(p.v);
    row_offsets(kv_lo, (int)(kv_hi - kv_lo < NB ? kv_hi - kv_lo : NB), offs[0]);
    for (int64_t kv0 = kv_lo, step = 0; kv0 < kv_hi; kv0 += NB, ++step) {
      const int n = (int)(kv_hi - kv0 < NB ? kv_hi - kv0 : NB), ncol = (n + 15) / 16 * 16;
      const int64_t* off = offs[step % 2];
      for (int t = 0; t < n; ++t) {
        kr[t] = kbase + off[t];
        vr[t] = vbase + off[t];
        ks[t] = row_scale(kr[t], D, KIND);  // fp8: 256 x (the codes widen to value / 256)
        vs[t] = row_scale(vr[t], D, KIND);
      }
      for (int t = n; t < ncol; ++t) {  // padding keys: zero codes, score -inf (softmax), weight 0
        kr[t] = vr[t] = zero;
        ks[t] = vs[t] = 0.0f;
      }
      if (kv0 + NB < kv_hi) {  // the next step's rows, to L2 while this one computes
        const int nn = (int)(kv_hi - kv0 - NB < NB ? kv_hi - kv0 - NB : NB);
        int64_t* next = offs[(step + 1) % 2];
        row_offsets(kv0 + NB, nn, next);
        for (int t = 0; t < nn; ++t) {
          __builtin_prefetch(kbase + next[t], 0, 2);
          __builtin_prefetch(kbase + next[t] + D + 3, 0, 2);
          __builtin_prefetch(vbase + next[t], 0, 2);
          __builtin_prefetch(vbase + next[t] + D + 3, 0, 2);
        }
      }
      for (int x = 0; x < ncol; x += 16) score16(kr + x, ks + x, s.s + x);
      for (int r = 0; r < R; ++r) softmax(r, n, ncol, vs, w16);
      pv(vr, ncol, w16);
    }
    epilogue();
  }

  void epilogue() const {
    if (p.nparts > 1) {
      float* dst = p.partial + (g * p.nparts + part) * R * (D + 2);
      for (int r = 0; r < R; ++r, dst += D + 2) {
        std::memcpy(dst, s.o + r * D, D * 4);
        dst[D] = m[r];
        dst[D + 1] = l[r];
      }
      return;
    }
    for (int r = 0; r < R; ++r) {
      char* dst = static_cast<char*>(p.out) + (g * R + r) * p.o_sh * (p.q_bf16 ? 2 : 4);
      const float inv = 1.0f / l[r];
      for (int d = 0; d < D; d += W) {
        const vf x = loadf(s.o + r * D + d) * inv;
        if (p.q_bf16) {
          const vh hb = to_bf16(x);
          std::memcpy(dst + d * 2, &hb, sizeof(vh));
        } else {
          storef(dst + d * 4, x);
        }
      }
    }
  }
};

template <int D, int R, int KIND>
void run_quant_decode(const Params& p, int64_t item, const Scratch& s) {
  QuantDecode<D, R, KIND> k(p, s, item);
  k.run();
}

// The register decode paths take one query token of at most 4 heads per KV head: int8 with bf16
// q on every ISA, int8 with float32 q and fp8 on AVX-512. Their group size is a template
// constant, so unequal query groups (q_first) take the widening path, which reads the map.
inline bool quant_decode(const Params& p) {
  if (p.kv_quant == kPacked || p.C != 1 || p.group > 4 || p.q_first) return false;
  return (p.kv_quant == kInt8 && p.q_bf16) || W == 16;
}

template <int D, int KIND>
void run_quant_decode_g(const Params& p, int64_t item, const Scratch& s) {
  switch (p.group) {
    case 1: return run_quant_decode<D, 1, KIND>(p, item, s);
    case 2: return run_quant_decode<D, 2, KIND>(p, item, s);
    case 3: return run_quant_decode<D, 3, KIND>(p, item, s);
    default: return run_quant_decode<D, 4, KIND>(p, item, s);
  }
}

template <int D>
void run_quant_decode_k(const Params& p, int64_t item, const Scratch& s) {
  if (p.kv_quant == kInt8 && p.q_bf16) return run_quant_decode_g<D, kInt8>(p, item, s);
#if PF_ATTN_WIDTH == 16
  if (p.kv_quant == kInt8) return run_quant_decode_g<D, kInt8Float>(p, item, s);
  run_quant_decode_g<D, kFp8>(p, item, s);
#endif
}


template <int D, bool KVB, int RB>
void run_r(const Params& p, int64_t item, const Scratch& s, const char* const* after) {
  Kernel<D, KVB, RB> k(p, s, item, after);
  k.run();
  k.epilogue();
}

// Decode (a q-tile of at most 4 rows, e.g. one token of a group of 3) takes blocks of 4 rows,
// and exactly 3 rows (SmolLM2's 9 query heads over 3 KV heads) a block of 3: a padding row
// would cost a quarter of the QK^T, softmax and PV work. Rows are computed alike in any block
// size (each row's sums in the same order), so the bits do not change.
template <int D, bool KVB>
void run_d(const Params& p, int64_t item, const Scratch& s, const char* const* after) {
  if (quant_decode(p)) return run_quant_decode_k<D>(p, item, s);
  const int64_t rows = (p.C < p.qtile ? p.C : p.qtile) * p.group;
  if (kRows > 4 && rows == 3) run_r<D, KVB, 3>(p, item, s, after);
  else if (kRows > 4 && rows <= 4) run_r<D, KVB, 4>(p, item, s, after);
  else run_r<D, KVB, kRows>(p, item, s, after);
}

}  // namespace

// One head dim's kernels: bf16 or float32 values (the bf16 kernel reads bf16 only).
template <int D>
void run_dim(const Params& p, int64_t item, const Scratch& s, const char* const* after) {
#if PF_ATTN_BF16DOT
  run_d<D, true>(p, item, s, after);
#else
  if (p.kv_bf16) run_d<D, true>(p, item, s, after);
  else run_d<D, false>(p, item, s, after);
#endif
}

void run_item(const Params& p, int64_t item, const Scratch& s, const char* const* after) {
  switch (p.head_dim) {
    case 64: return run_dim<64>(p, item, s, after);
    case 128: return run_dim<128>(p, item, s, after);
    default: return run_dim<256>(p, item, s, after);  // Gemma 3 (the glue admits 64, 128, 256 only)
  }
}

}  // namespace PF_ATTN_NS
}  // namespace pipefill_cpu_attn
