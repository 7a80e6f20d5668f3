// AVX2 + FMA kernels for pipefill's fused elementwise ops (CPUs without AVX-512: Zen 2/3,
// Haswell..Comet Lake, cloud VMs hiding AVX-512). Same contract and numerics as
// fused_ops_avx512.cpp, 8 lanes at a time: built with -ffp-contract=off, so every product and
// sum rounds as in torch's eager fp32 code (only exp() uses explicit FMAs); bf16 outputs are
// rounded once, to nearest even (NaN -> 0x7FC0). Widths are multiples of 16, so no tails.
// Entered only after the glue's cpuid/XCR0 check for AVX2 + FMA succeeded.
#include "fused_ops_kernel.h"

#include <immintrin.h>

#include <cmath>

namespace pipefill_fused {
namespace avx2 {
namespace {

inline __m256 bf16_bits_to_f32(__m128i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline __m128i f32_to_bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // 16-bit pack works per 128-bit half: [r0..3 r0..3 | r4..7 r4..7]; qwords 0 and 2 in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}

template <typename T> struct Io;

template <> struct Io<float> {
  static inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

template <> struct Io<uint16_t> {
  static inline __m256 load(const uint16_t* p) {
    return bf16_bits_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store(uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32_to_bf16_bits(v));
  }
};

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// exp(-g) as in the AVX-512 build (same reduction and polynomial); 2^n is applied as two
// exact power-of-two factors (n in [-159, 145] after the clamp), which saturates to inf / 0
// like vscalefps.
inline __m256 exp_neg_ps(__m256 g) {
  g = _mm256_min_ps(_mm256_max_ps(g, _mm256_set1_ps(-100.0f)), _mm256_set1_ps(110.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(g, _mm256_set1_ps(-1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 x = _mm256_fmadd_ps(n, _mm256_set1_ps(0.693359375f), g);
  x = _mm256_fmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.3836834114044905e-3f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(-8.374815806746483e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.166822507977486e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(-1.6666419804096222e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.9999991059303284e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(-1.0f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp_neg_ps(g));
  return _mm256_mul_ps(_mm256_div_ps(g, d), u);
}

// gelu_tanh(g) * u as g / (1 + exp(-z)) * u, z = 2 sqrt(2/pi) (g + 0.044715 g^3): the AVX-512
// build's formula.
inline __m256 gelu_tanh_mul(__m256 g, __m256 u) {
  const __m256 inner = _mm256_add_ps(_mm256_set1_ps(1.5957691216057308f),
                                     _mm256_mul_ps(_mm256_set1_ps(0.0713548162726009f), _mm256_mul_ps(g, g)));
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp_neg_ps(_mm256_mul_ps(g, inner)));
  return _mm256_mul_ps(_mm256_div_ps(g, d), u);
}

struct Silu {
  static inline __m256 apply(__m256 g, __m256 u) { return silu_mul(g, u); }
};
struct GeluTanh {
  static inline __m256 apply(__m256 g, __m256 u) { return gelu_tanh_mul(g, u); }
};

// The sum of squares of x + h (h may be null; then rr is x + h, stored back), then
// oo = (x + h) / sqrt(mean + eps) * w. TX: the row read (float32 residual or any dtype).
template <typename TX, typename TH, typename TO>
inline void norm_row(const TX* x, const TH* hh, float* rr, const float* w, TO* oo, int64_t H, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t j = 0; j < H; j += 16) {
    __m256 x0 = Io<TX>::load(x + j), x1 = Io<TX>::load(x + j + 8);
    if (hh) {
      x0 = _mm256_add_ps(x0, Io<TH>::load(hh + j));
      x1 = _mm256_add_ps(x1, Io<TH>::load(hh + j + 8));
      _mm256_storeu_ps(rr + j, x0);
      _mm256_storeu_ps(rr + j + 8, x1);
    }
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(x0, x0));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(x1, x1));
  }
  const float ss = hsum(_mm256_add_ps(a0, a1));
  const __m256 vinv = _mm256_set1_ps(1.0f / std::sqrt(ss / (float)H + eps));
  for (int64_t j = 0; j < H; j += 8)
    Io<TO>::store(oo + j, _mm256_mul_ps(_mm256_mul_ps(Io<TX>::load(x + j), vinv), _mm256_loadu_ps(w + j)));
}

template <typename TX, typename TO>
inline void rms_norm_row(const TX* x, const float* w, TO* out, int64_t H, float eps) {
  norm_row<TX, float, TO>(x, nullptr, nullptr, w, out, H, eps);
}

// hid_w: Gemma's post-norm, applied to the row of hid in place before the add (nullptr: none).
template <typename TH, typename TO>
void add_rms_norm_impl(float* res, int64_t res_st, TH* hid, int64_t hid_st, const float* hid_w, const float* w,
                       TO* out, int64_t out_st, int64_t H, float eps, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    float* rr = res + t * res_st;
    TH* hh = hid ? hid + t * hid_st : nullptr;
    if (hid_w && hh) rms_norm_row(static_cast<const TH*>(hh), hid_w, hh, H, eps);
    norm_row(static_cast<const float*>(rr), static_cast<const TH*>(hh), rr, w, out + t * out_st, H, eps);
  }
}

template <typename TX, typename TO>
void rms_norm_impl(const TX* x, int64_t x_st, const float* w, TO* out, int64_t out_st, int64_t H, float eps,
                   int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) rms_norm_row(x + t * x_st, w, out + t * out_st, H, eps);
}

template <typename T>
void rope_impl(T* x, int64_t st, int64_t sh, int64_t N, int64_t D, const float* cos, const float* sin,
               int64_t r0, int64_t r1) {
  const int64_t half = D / 2;  // a multiple of 8
  for (int64_t t = r0; t < r1; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    T* row = x + t * st;
    for (int64_t n = 0; n < N; ++n) {
      T* p1 = row + n * sh;
      T* p2 = p1 + half;
      for (int64_t i = 0; i < half; i += 8) {
        const __m256 x1 = Io<T>::load(p1 + i), x2 = Io<T>::load(p2 + i);
        const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
        Io<T>::store(p1 + i, _mm256_sub_ps(_mm256_mul_ps(x1, vc), _mm256_mul_ps(x2, vs)));
        Io<T>::store(p2 + i, _mm256_add_ps(_mm256_mul_ps(x2, vc), _mm256_mul_ps(x1, vs)));
      }
    }
  }
}

// Per-head RMSNorm in place (heads [0, Nq) by wq, then Nk by wk), rounded to T, then rope over
// the row's heads, while the row is in L1.
template <typename T>
void qk_norm_rope_impl(T* x, int64_t st, int64_t sh, int64_t Nq, int64_t Nk, int64_t D, const float* wq,
                       const float* wk, float eps, const float* cos, const float* sin, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    T* row = x + t * st;
    for (int64_t n = 0; n < Nq + Nk; ++n) {
      T* head = row + n * sh;
      rms_norm_row(static_cast<const T*>(head), n < Nq ? wq : wk, head, D, eps);
    }
    rope_impl(x, st, sh, Nq + Nk, D, cos, sin, t, t + 1);
  }
}

template <typename Act, typename T>
void act_mul_impl(const T* gu, int64_t gu_st, T* out, int64_t out_st, int64_t I, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    const T* g = gu + t * gu_st;
    const T* u = g + I;
    T* o = out + t * out_st;
    for (int64_t j = 0; j < I; j += 8) Io<T>::store(o + j, Act::apply(Io<T>::load(g + j), Io<T>::load(u + j)));
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
  PF_BY_DTYPE(dtype, T, rope_impl(static_cast<T*>(x), st, sh, N, D, cos, sin, r0, r1))
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

}  // namespace avx2
}  // namespace pipefill_fused
