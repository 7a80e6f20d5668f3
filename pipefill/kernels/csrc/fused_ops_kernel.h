// Interface between the generic glue (fused_ops.cpp, built without ISA flags) and the AVX-512
// translation unit (fused_ops_avx512.cpp). Plain C++ only (no torch, no std templates), so no
// AVX-512 code can leak into the glue through COMDAT folding of shared inline functions.
// Each function processes rows [r0, r1); the glue splits rows over torch's thread pool.
// dtype codes: 0 = float32, 1 = bfloat16. Strides are in elements.
#pragma once
#include <cstdint>

namespace pipefill_fused {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;

// fused_ops_avx512.cpp is compiled twice: namespace avx512 (AVX512 F/BW/VL; bf16 rounding in
// integer code) and namespace avx512bf16 (adds -mavx512bf16: vcvtneps2bf16 rounds to bf16).
#define PF_FUSED_DECLARE_KERNELS(NS)                                                              \
  namespace NS {                                                                                  \
  /* res[r] += hid[r] (if hid), then out[r] = res[r] / sqrt(mean(res[r]^2) + eps) * w. */         \
  void add_rms_norm_rows(float* res, int64_t res_st, const void* hid, int hid_dtype, int64_t hid_st, \
                         const float* w, void* out, int out_dtype, int64_t out_st, int64_t H,     \
                         float eps, int64_t r0, int64_t r1);                                      \
  /* Rotate-half RoPE in place on x[t, n, :D] (row stride st, head stride sh, last dim          \
     contiguous); cos/sin: float32 [T, D/2] contiguous. */                                        \
  void rope_rows(void* x, int dtype, int64_t st, int64_t sh, int64_t N, int64_t D,                \
                 const float* cos, const float* sin, int64_t r0, int64_t r1);                     \
  /* out[t, :I] = silu(gu[t, :I]) * gu[t, I:2I]. */                                               \
  void silu_mul_rows(const void* gu, int dtype, int64_t gu_st, void* out, int64_t out_st,         \
                     int64_t I, int64_t r0, int64_t r1);                                          \
  /* Gemma: out[t, :I] = gelu_tanh(gu[t, :I]) * gu[t, I:2I]. */                                   \
  void gelu_tanh_mul_rows(const void* gu, int dtype, int64_t gu_st, void* out, int64_t out_st,    \
                          int64_t I, int64_t r0, int64_t r1);                                     \
  /* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, x of any dtype (out may be x). */              \
  void rms_norm_rows(const void* x, int x_dtype, int64_t x_st, const float* w, void* out,         \
                     int out_dtype, int64_t out_st, int64_t H, float eps, int64_t r0, int64_t r1); \
  /* Gemma's sandwich: hid[r] = rms_norm(hid[r]) * hid_w in place (if hid_w), then as            \
     add_rms_norm_rows: the two kernels' results, row by row. */                                  \
  void norm_add_rms_norm_rows(float* res, int64_t res_st, void* hid, int hid_dtype,               \
                              int64_t hid_st, const float* hid_w, const float* w, void* out,      \
                              int out_dtype, int64_t out_st, int64_t H, float eps, int64_t r0,    \
                              int64_t r1);                                                        \
  /* Per-head RMSNorm of x[t, n, :D] in place (heads n < Nq by wq, the next Nk by wk), then     \
     rope_rows over those Nq + Nk heads: the two kernels' results. */                             \
  void qk_norm_rope_rows(void* x, int dtype, int64_t st, int64_t sh, int64_t Nq, int64_t Nk,      \
                         int64_t D, const float* wq, const float* wk, float eps,                  \
                         const float* cos, const float* sin, int64_t r0, int64_t r1);             \
  }

PF_FUSED_DECLARE_KERNELS(avx512)
PF_FUSED_DECLARE_KERNELS(avx512bf16)
// fused_ops_avx2.cpp (-mavx2 -mfma): CPUs without AVX-512.
PF_FUSED_DECLARE_KERNELS(avx2)

}  // namespace pipefill_fused
