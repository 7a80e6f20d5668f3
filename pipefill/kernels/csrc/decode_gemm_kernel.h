// Interface between the decode-GEMM glue (decode_gemm.cpp, built without ISA flags) and the
// per-ISA translation units decode_gemm_{avx2,avx512,avx512bf16}.cpp (each built with its own
// -m flags and entered only after the glue's cpuid/XCR0 check for that ISA). Plain C++ only.
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M, W packed at load time:
//   blocks of 16 output columns; K padded to Kp = K rounded up to even (zeros);
//   float32 weights: wp[nb][Kp][16]            (16 columns of one k contiguous)
//   bf16 weights:    wp[nb][Kp/2][16][2]        (per column the pair k = 2p, 2p + 1 in one
//                                                 32-bit word: low half = even k)
// Each row's sum runs in a fixed order (two partial sums, even and odd k or k-pair, added at
// the end) that does not depend on M or on which row tile the row falls in, so a row gives
// the same bits alone or inside a batch.
// Each function computes the column blocks [b0, b1) of all M rows: y[m * ldy + n] =
// sum + bias[n] (bias may be null; float32) for n < N, stored as float32 or as bf16 (rounded to
// nearest even by integer code, the same on every ISA; NaN -> 0x7FC0).
#pragma once
#include <cstdint>

namespace pipefill_decode {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;
constexpr int kBlock = 16;

struct Out {
  void* y;
  int y_dtype;
  int64_t ldy;
  int64_t N;
  const float* bias;
};

namespace avx2 {
// x: float32 [M, ldx]; w_dtype: kF32 or kBF16 (layouts above); K is the real (unpadded) K.
void gemm_blocks(const float* x, int64_t ldx, const void* wp, int w_dtype, int64_t M, int64_t K,
                 const Out& out, int64_t b0, int64_t b1);
}
namespace avx512 {
void gemm_blocks(const float* x, int64_t ldx, const void* wp, int w_dtype, int64_t M, int64_t K,
                 const Out& out, int64_t b0, int64_t b1);
}
namespace avx512bf16 {
// x: bf16 bits [M, ldx] with K even (the glue pads an odd K with a zero column); bf16 weights
// only (vdpbf16ps).
void gemm_blocks(const uint16_t* x, int64_t ldx, const void* wp, int64_t M, int64_t K,
                 const Out& out, int64_t b0, int64_t b1);
}

}  // namespace pipefill_decode
