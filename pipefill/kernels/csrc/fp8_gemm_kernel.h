// FP8 block-quantized weights (DeepSeek-V3's and the -FP8 Qwen3 checkpoints' layout): W[N, K] is
// N rows of K float8 e4m3fn bytes (sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent
// 0 is subnormal, m * 2^-9; no infinities), and one float32 scale per 128 x 128 block: weight
// (n, k) = fp8(n, k) * scale[scale_row[n] * lds + k / 128]. scale_row maps each weight row to
// its row of the scale grid (row / 128 in the file's order; a stacked or reordered matrix keeps
// every row's own block). The last block of a row or of the grid may be partial (K or N not a
// multiple of 128).
//
// Every path computes each weight as exactly fp8 widened to float32, times its scale, rounded
// once (what torch's weight.to(float32) * scale gives), and multiplies it by the float32
// activations: one float32 sum per (row, column) in k order, lanes reduced at the end, so the
// paths differ by float32 summation order only. The vector paths widen through IEEE half
// (vcvtph2ps, exact for every e4m3 value: e4m3's bits shifted into a half are the value / 256);
// the scalar path reads a 256-entry table. The codes 0x7f and 0xff (e4m3fn's NaN, which
// quantizers never write: they saturate at +-448) read as +-480 on every kernel path.
// Included by the glue (quant_gemm.cpp) and the ISA translation units. Plain C++ only.
#pragma once
#include <cstdint>
#include <cstring>

namespace pipefill_quant {

constexpr int kFp8Block = 128;  // weights per scale block, along rows and along columns

namespace {

// e4m3 byte -> float32 in integer code (no FPU mode can change it); 0x7f/0xff -> +-480.
inline float fp8_to_f32(uint8_t b) {
  const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
  uint32_t e = (b >> 3) & 15u, m = b & 7u, u;
  if (e != 0) {
    u = sign | ((e + 120) << 23) | (m << 20);
  } else if (m == 0) {
    u = sign;
  } else {  // subnormal m * 2^-9: normalise
    e = 121;
    while (!(m & 8u)) {
      m <<= 1;
      --e;
    }
    u = sign | (e << 23) | ((m & 7u) << 20);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

// Each ISA's functions: fp8_gemm_cols computes columns [n0, n1) of all M rows, y[m * ldy + n] =
// the float32 sum (no bias: the glue adds it), x float32 [M, ldx]; fp8_dequant_rows writes rows
// [n0, n1) of W dequantized to out (row stride ldo): float32, or bf16 rounded to nearest even
// where `bf16` (prefill's per-call copy). W's rows are K bytes apart.
#define PF_FP8_GEMM(ns)                                                                                   \
  namespace ns {                                                                                          \
  void fp8_gemm_cols(const float* x, int64_t ldx, const uint8_t* w, const float* scale,                  \
                     const int32_t* scale_row, int64_t lds, int64_t M, int64_t K, float* y, int64_t ldy, \
                     int64_t n0, int64_t n1);                                                             \
  void fp8_dequant_rows(const uint8_t* w, const float* scale, const int32_t* scale_row, int64_t lds,     \
                        int64_t K, int64_t n0, int64_t n1, void* out, bool bf16, int64_t ldo);           \
  }
PF_FP8_GEMM(scalar)
PF_FP8_GEMM(avx2)
PF_FP8_GEMM(avx512)
#undef PF_FP8_GEMM

}  // namespace pipefill_quant
