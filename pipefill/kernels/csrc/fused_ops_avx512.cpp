// AVX-512 (F/BW/VL) kernels for pipefill's fused elementwise ops. The only translation unit
// compiled with -mavx512*; entered only after the glue's cpuid/XCR0 check succeeded. Compiled
// twice (see fused_ops_kernel.h): PF_FUSED_NS=avx512, and PF_FUSED_NS=avx512bf16 with
// PF_HW_BF16=1 and -mavx512bf16 (bf16 rounding by vcvtneps2bf16).
// Built with -ffp-contract=off: every product and sum is rounded as in torch's eager fp32 code
// (only exp() uses explicit FMAs), so fp32 rope is bit-identical to the torch formula.
// bf16 outputs are rounded once, to nearest even (NaN -> 0x7FC0), as c10::BFloat16 does.
#include "fused_ops_kernel.h"

#include <immintrin.h>

#include <cmath>

#ifndef PF_FUSED_NS
#define PF_FUSED_NS avx512
#endif
#ifndef PF_HW_BF16
#define PF_HW_BF16 0
#endif

namespace pipefill_fused {
namespace PF_FUSED_NS {
namespace {

// ---- loads / stores of 16 lanes (full, or the first n < 16 with a mask) ---------------------

inline __m512 bf16_bits_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m256i f32_to_bf16_bits(__m512 v) {
#if PF_HW_BF16
  // Round to nearest even; the instruction treats fp32 denormal inputs as zero.
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

template <typename T> struct Io;

template <> struct Io<float> {
  static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
};

template <> struct Io<uint16_t> {
  static inline __m512 load(const uint16_t* p) {
    return bf16_bits_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline __m512 load(const uint16_t* p, __mmask16 m) { return bf16_bits_to_f32(_mm256_maskz_loadu_epi16(m, p)); }
  static inline void store(uint16_t* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16_bits(v));
  }
  static inline void store(uint16_t* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, f32_to_bf16_bits(v)); }
};

// ---- SiLU * mul ------------------------------------------------------------------------------
// exp(-g) = 2^n * p(r) with n = round(-g * log2(e)), r = -g - n*ln2 = -(g + n*ln2) in
// [-ln2/2, ln2/2] (ln2 split in two for an exact reduction), p a degree-6 near-minimax
// polynomial (relative error 2e-9 before rounding; ~1 ulp in fp32). Its coefficients have
// alternating signs so that it is evaluated at s = -r directly.

inline __m512 exp_neg_ps(__m512 g) {
  g = _mm512_min_ps(_mm512_max_ps(g, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(110.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 x = _mm512_fmadd_ps(n, _mm512_set1_ps(0.693359375f), g);  // s = g + n*ln2 = -r
  x = _mm512_fmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.3836834114044905e-3f);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(-8.374815806746483e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.166822507977486e-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(-1.6666419804096222e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.9999991059303284e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(-1.0f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p * 2^n, saturating to inf / 0
}

// silu(g) * u = g / (1 + exp(-g)) * u, as torch: (g / (1 + exp(-g))) then * u.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_neg_ps(g));
  return _mm512_mul_ps(_mm512_div_ps(g, d), u);
}

// gelu_tanh(g) * u. tanh's GELU is g * (1 + tanh(y)) / 2 with y = sqrt(2/pi) (g + 0.044715 g^3),
// and (1 + tanh(y)) / 2 = 1 / (1 + exp(-2y)): so g / (1 + exp(-z)) * u with z = 2y, the SiLU
// form (no cancellation in 1 + tanh(y) for negative g, where torch's formula loses bits).
inline __m512 gelu_tanh_mul(__m512 g, __m512 u) {
  const __m512 inner = _mm512_add_ps(_mm512_set1_ps(1.5957691216057308f),
                                     _mm512_mul_ps(_mm512_set1_ps(0.0713548162726009f), _mm512_mul_ps(g, g)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_neg_ps(_mm512_mul_ps(g, inner)));
  return _mm512_mul_ps(_mm512_div_ps(g, d), u);
}

struct Silu {
  static inline __m512 apply(__m512 g, __m512 u) { return silu_mul(g, u); }
};
struct GeluTanh {
  static inline __m512 apply(__m512 g, __m512 u) { return gelu_tanh_mul(g, u); }
};

// ---- add + RMSNorm ---------------------------------------------------------------------------

// out = x / sqrt(mean(x^2) + eps) * w for one row of x (any dtype; out may be x itself).
template <typename TX, typename TO>
inline void rms_norm_row(const TX* x, const float* w, TO* out, int64_t H, float eps) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= H; j += 32) {
    const __m512 x0 = Io<TX>::load(x + j), x1 = Io<TX>::load(x + j + 16);
    a0 = _mm512_add_ps(a0, _mm512_mul_ps(x0, x0));
    a1 = _mm512_add_ps(a1, _mm512_mul_ps(x1, x1));
  }
  for (; j < H; j += 16) {
    const __m512 x0 = Io<TX>::load(x + j);
    a0 = _mm512_add_ps(a0, _mm512_mul_ps(x0, x0));
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  const __m512 vinv = _mm512_set1_ps(1.0f / std::sqrt(ss / (float)H + eps));
  for (j = 0; j < H; j += 16)
    Io<TO>::store(out + j, _mm512_mul_ps(_mm512_mul_ps(Io<TX>::load(x + j), vinv), _mm512_loadu_ps(w + j)));
}

// rr += hh (if hh), then oo = rms_norm(rr) * w: one row.
template <typename TH, typename TO>
inline void add_rms_norm_row(float* rr, const TH* hh, const float* w, TO* oo, int64_t H, float eps) {
  if (!hh) return rms_norm_row(static_cast<const float*>(rr), w, oo, H, eps);
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= H; j += 32) {
    const __m512 x0 = _mm512_add_ps(_mm512_loadu_ps(rr + j), Io<TH>::load(hh + j));
    const __m512 x1 = _mm512_add_ps(_mm512_loadu_ps(rr + j + 16), Io<TH>::load(hh + j + 16));
    _mm512_storeu_ps(rr + j, x0);
    _mm512_storeu_ps(rr + j + 16, x1);
    a0 = _mm512_add_ps(a0, _mm512_mul_ps(x0, x0));
    a1 = _mm512_add_ps(a1, _mm512_mul_ps(x1, x1));
  }
  for (; j < H; j += 16) {
    const __m512 x0 = _mm512_add_ps(_mm512_loadu_ps(rr + j), Io<TH>::load(hh + j));
    _mm512_storeu_ps(rr + j, x0);
    a0 = _mm512_add_ps(a0, _mm512_mul_ps(x0, x0));
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  const __m512 vinv = _mm512_set1_ps(1.0f / std::sqrt(ss / (float)H + eps));
  for (j = 0; j < H; j += 16)
    Io<TO>::store(oo + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(rr + j), vinv), _mm512_loadu_ps(w + j)));
}

// hid_w: Gemma's post-norm, applied to the row of hid in place before the add (nullptr: none).
template <typename TH, typename TO>
void add_rms_norm_impl(float* res, int64_t res_st, TH* hid, int64_t hid_st, const float* hid_w, const float* w,
                       TO* out, int64_t out_st, int64_t H, float eps, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    TH* hh = hid ? hid + t * hid_st : nullptr;
    if (hid_w && hh) rms_norm_row(static_cast<const TH*>(hh), hid_w, hh, H, eps);
    add_rms_norm_row(res + t * res_st, static_cast<const TH*>(hh), w, out + t * out_st, H, eps);
  }
}

template <typename TX, typename TO>
void rms_norm_impl(const TX* x, int64_t x_st, const float* w, TO* out, int64_t out_st, int64_t H, float eps,
                   int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) rms_norm_row(x + t * x_st, w, out + t * out_st, H, eps);
}

// ---- RoPE ------------------------------------------------------------------------------------

template <typename T>
inline void rope_vec(T* p1, T* p2, const float* c, const float* s, int64_t i) {
  const __m512 x1 = Io<T>::load(p1 + i), x2 = Io<T>::load(p2 + i);
  const __m512 vc = _mm512_loadu_ps(c + i), vs = _mm512_loadu_ps(s + i);
  Io<T>::store(p1 + i, _mm512_sub_ps(_mm512_mul_ps(x1, vc), _mm512_mul_ps(x2, vs)));
  Io<T>::store(p2 + i, _mm512_add_ps(_mm512_mul_ps(x2, vc), _mm512_mul_ps(x1, vs)));
}

template <typename T>
inline void rope_vec_masked(T* p1, T* p2, const float* c, const float* s, int64_t i, __mmask16 m) {
  const __m512 x1 = Io<T>::load(p1 + i, m), x2 = Io<T>::load(p2 + i, m);
  const __m512 vc = _mm512_maskz_loadu_ps(m, c + i), vs = _mm512_maskz_loadu_ps(m, s + i);
  Io<T>::store(p1 + i, _mm512_sub_ps(_mm512_mul_ps(x1, vc), _mm512_mul_ps(x2, vs)), m);
  Io<T>::store(p2 + i, _mm512_add_ps(_mm512_mul_ps(x2, vc), _mm512_mul_ps(x1, vs)), m);
}

// HALF > 0: compile-time half width (multiple of 16); HALF == 0: runtime half (multiple of 8).
template <typename T, int HALF>
void rope_impl(T* x, int64_t st, int64_t sh, int64_t N, int64_t D, const float* cos, const float* sin,
               int64_t r0, int64_t r1) {
  const int64_t half = HALF ? HALF : D / 2;
  const int64_t full = half / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (half - full)) - 1u);
  for (int64_t t = r0; t < r1; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    T* row = x + t * st;
    for (int64_t n = 0; n < N; ++n) {
      T* p1 = row + n * sh;
      T* p2 = p1 + half;
      if (HALF) {
#pragma GCC unroll 8
        for (int64_t i = 0; i < HALF; i += 16) rope_vec(p1, p2, c, s, i);
      } else {
        for (int64_t i = 0; i < full; i += 16) rope_vec(p1, p2, c, s, i);
        if (tail) rope_vec_masked(p1, p2, c, s, full, tail);
      }
    }
  }
}

template <typename T>
void rope_dispatch(T* x, int64_t st, int64_t sh, int64_t N, int64_t D, const float* cos, const float* sin,
                   int64_t r0, int64_t r1) {
  switch (D) {
    case 64: return rope_impl<T, 32>(x, st, sh, N, D, cos, sin, r0, r1);
    case 128: return rope_impl<T, 64>(x, st, sh, N, D, cos, sin, r0, r1);
    default: return rope_impl<T, 0>(x, st, sh, N, D, cos, sin, r0, r1);
  }
}

// Per-head RMSNorm (heads [0, Nq) by wq, [Nq, Nq + Nk) by wk) in place, rounded to T, then
// rope over the row's heads: the two kernels' results, while the row is in L1.
template <typename T>
void qk_norm_rope_impl(T* x, int64_t st, int64_t sh, int64_t Nq, int64_t Nk, int64_t D, const float* wq,
                       const float* wk, float eps, const float* cos, const float* sin, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    T* row = x + t * st;
    for (int64_t n = 0; n < Nq + Nk; ++n) {
      T* head = row + n * sh;
      rms_norm_row(static_cast<const T*>(head), n < Nq ? wq : wk, head, D, eps);
    }
    rope_dispatch(x, st, sh, Nq + Nk, D, cos, sin, t, t + 1);
  }
}

template <typename Act, typename T>
void act_mul_impl(const T* gu, int64_t gu_st, T* out, int64_t out_st, int64_t I, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    const T* g = gu + t * gu_st;
    const T* u = g + I;
    T* o = out + t * out_st;
    int64_t j = 0;
    for (; j + 32 <= I; j += 32) {
      const __m512 y0 = Act::apply(Io<T>::load(g + j), Io<T>::load(u + j));
      const __m512 y1 = Act::apply(Io<T>::load(g + j + 16), Io<T>::load(u + j + 16));
      Io<T>::store(o + j, y0);
      Io<T>::store(o + j + 16, y1);
    }
    for (; j < I; j += 16) Io<T>::store(o + j, Act::apply(Io<T>::load(g + j), Io<T>::load(u + j)));
  }
}

// bf16: 32 values per step, split into even/odd lanes (one shift / one and per 32 loaded
// values instead of a widening move and a shift per 16), recombined before the store.
template <typename Act>
void act_mul_impl(const uint16_t* gu, int64_t gu_st, uint16_t* out, int64_t out_st, int64_t I, int64_t r0,
                  int64_t r1) {
  const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
#if PF_HW_BF16
  // cvtne2ps_pbh(odd, even) holds even results in words 0..15 and odd ones in 16..31.
  alignas(64) static constexpr uint16_t kIdx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
#endif
  for (int64_t t = r0; t < r1; ++t) {
    const uint16_t* g = gu + t * gu_st;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * out_st;
    int64_t j = 0;
    for (; j + 32 <= I; j += 32) {
      const __m512i G = _mm512_loadu_si512(g + j), U = _mm512_loadu_si512(u + j);
      const __m512 ye = Act::apply(_mm512_castsi512_ps(_mm512_slli_epi32(G, 16)),
                                   _mm512_castsi512_ps(_mm512_slli_epi32(U, 16)));
      const __m512 yo = Act::apply(_mm512_castsi512_ps(_mm512_and_si512(G, hi_mask)),
                                   _mm512_castsi512_ps(_mm512_and_si512(U, hi_mask)));
#if PF_HW_BF16
      const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(yo, ye));
      _mm512_storeu_si512(o + j, _mm512_permutexvar_epi16(idx, packed));
#else
      // Round to nearest even in the upper half of each 32-bit lane (NaN -> 0x7FC0).
      const __m512i nan = _mm512_set1_epi32(0x7fc00000), bias = _mm512_set1_epi32(0x7fff);
      const __m512i one = _mm512_set1_epi32(1);
      const __m512i be = _mm512_castps_si512(ye), bo = _mm512_castps_si512(yo);
      __m512i re = _mm512_add_epi32(be, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(be, 16), one)));
      __m512i ro = _mm512_add_epi32(bo, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(bo, 16), one)));
      re = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(ye, ye, _CMP_UNORD_Q), re, nan);
      ro = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(yo, yo, _CMP_UNORD_Q), ro, nan);
      // (ro & 0xffff0000) | (re >> 16)
      _mm512_storeu_si512(o + j, _mm512_ternarylogic_epi32(hi_mask, ro, _mm512_srli_epi32(re, 16), 0xEA));
#endif
    }
    for (; j < I; j += 16) Io<uint16_t>::store(o + j, Act::apply(Io<uint16_t>::load(g + j), Io<uint16_t>::load(u + j)));
  }
}

}  // namespace

#define PF_BY_DTYPE(code, T, ...) \
  if ((code) == kBF16) {          \
    using T = uint16_t;           \
    __VA_ARGS__;                  \
  } else {                        \
    using T = float;              \
    __VA_ARGS__;                  \
  }

void add_rms_norm_rows(float* res, int64_t res_st, const void* hid, int hid_dtype, int64_t hid_st,
                       const float* w, void* out, int out_dtype, int64_t out_st, int64_t H, float eps,
                       int64_t r0, int64_t r1) {
  norm_add_rms_norm_rows(res, res_st, const_cast<void*>(hid), hid_dtype, hid_st, nullptr, w, out, out_dtype,
                         out_st, H, eps, r0, r1);
}

void norm_add_rms_norm_rows(float* res, int64_t res_st, void* hid, int hid_dtype, int64_t hid_st,
                            const float* hid_w, const float* w, void* out, int out_dtype, int64_t out_st,
                            int64_t H, float eps, int64_t r0, int64_t r1) {
  PF_BY_DTYPE(hid_dtype, TH, PF_BY_DTYPE(out_dtype, TO,
      add_rms_norm_impl(res, res_st, static_cast<TH*>(hid), hid_st, hid_w, w, static_cast<TO*>(out), out_st,
                        H, eps, r0, r1)))
}

void rms_norm_rows(const void* x, int x_dtype, int64_t x_st, const float* w, void* out, int out_dtype,
                   int64_t out_st, int64_t H, float eps, int64_t r0, int64_t r1) {
  PF_BY_DTYPE(x_dtype, TX, PF_BY_DTYPE(out_dtype, TO,
      rms_norm_impl(static_cast<const TX*>(x), x_st, w, static_cast<TO*>(out), out_st, H, eps, r0, r1)))
}

void rope_rows(void* x, int dtype, int64_t st, int64_t sh, int64_t N, int64_t D, const float* cos,
               const float* sin, int64_t r0, int64_t r1) {
  PF_BY_DTYPE(dtype, T, rope_dispatch(static_cast<T*>(x), st, sh, N, D, cos, sin, r0, r1))
}

void qk_norm_rope_rows(void* x, int dtype, int64_t st, int64_t sh, int64_t Nq, int64_t Nk, int64_t D,
                       const float* wq, const float* wk, float eps, const float* cos, const float* sin,
                       int64_t r0, int64_t r1) {
  PF_BY_DTYPE(dtype, T, qk_norm_rope_impl(static_cast<T*>(x), st, sh, Nq, Nk, D, wq, wk, eps, cos, sin, r0, r1))
}

void silu_mul_rows(const void* gu, int dtype, int64_t gu_st, void* out, int64_t out_st, int64_t I,
                   int64_t r0, int64_t r1) {
  PF_BY_DTYPE(dtype, T, act_mul_impl<Silu>(static_cast<const T*>(gu), gu_st, static_cast<T*>(out), out_st, I, r0, r1))
}

void gelu_tanh_mul_rows(const void* gu, int dtype, int64_t gu_st, void* out, int64_t out_st, int64_t I,
                        int64_t r0, int64_t r1) {
  PF_BY_DTYPE(dtype, T,
              act_mul_impl<GeluTanh>(static_cast<const T*>(gu), gu_st, static_cast<T*>(out), out_st, I, r0, r1))
}

}  // namespace PF_FUSED_NS
}  // namespace pipefill_fused
