// Interface between the decode-GEMM glue (decode_gemm.cpp, built without ISA flags) and the
// per-ISA translation units decode_gemm_{avx2,avx512,avx512bf16,amx}.cpp (each built with its own
// -m flags and entered only after the glue's cpuid/XCR0 check for that ISA). Plain C++ only.
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M, W packed at load time:
//   groups of kGroup = 48 output columns (3 zmm / 6 ymm of float32 sums); K padded to
//   Kp = K rounded up to even (AMX: to a multiple of kAmxK) with zeros, N to a whole group;
//   float32 weights: wp[g][Kp][48]            (48 columns of one k contiguous: 3 cache lines)
//   bf16 weights:    wp[g][Kp/2][48][2]       (per column the pair k = 2p, 2p + 1 in one
//                                               32-bit word: low half = even k)
// so a tile of rows x columns reads its weights as one sequential stream, once for up to 8
// rows (AVX-512) or from L2 for the next row tile.
// Each row's sum per column is ONE chain in k order (k = 0, 1, ..., K - 1 as float32 FMAs;
// pair p = 0, 1, ... as vdpbf16ps), bias added last; the order does not depend on M, on the
// tile a row falls in or on the ISA, so a row gives the same bits alone or inside a batch.
// Each function computes the column groups [g0, g1) of all M rows: y[m * ldy + n] =
// sum + bias[n] (bias may be null; float32) for n < N, stored as float32 or as bf16 (rounded to
// nearest even by integer code, the same on every ISA; NaN -> 0x7FC0).
#pragma once
#include <cstdint>

namespace pipefill_decode {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;
constexpr int kGroup = 48;
constexpr int kAmxK = 32;  // k values per AMX step (one 16-pair B tile)

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
                 const Out& out, int64_t g0, int64_t g1);
}
namespace avx512 {
void gemm_blocks(const float* x, int64_t ldx, const void* wp, int w_dtype, int64_t M, int64_t K,
                 const Out& out, int64_t g0, int64_t g1);
}
namespace avx512bf16 {
// x: bf16 bits [M, ldx] with K even (the glue pads an odd K with a zero column); bf16 weights
// only (vdpbf16ps).
void gemm_blocks(const uint16_t* x, int64_t ldx, const void* wp, int64_t M, int64_t K,
                 const Out& out, int64_t g0, int64_t g1);
}

namespace amx {
// x: bf16 bits, zero-padded to whole 16-row tiles [ceil(M / 16) * 16, Kp] (row stride Kp, a
// multiple of kAmxK); bf16 weights packed with that Kp. Needs tile permission (the glue's).
void gemm_blocks(const uint16_t* x, const void* wp, int64_t M, int64_t Kp, const Out& out,
                 int64_t g0, int64_t g1);
}

}  // namespace pipefill_decode
