// Interface between the quantized decode-GEMM glue (quant_gemm.cpp, built without ISA flags) and
// the per-ISA translation units quant_gemm_{scalar,avx2,avx512}.cpp (each built with its own -m
// flags and entered only after the glue's cpuid/XCR0 check for that ISA). Plain C++ only.
//
// y[M, N] = x[M, K] @ W[N, K]^T for small M, W held as GGUF blocks exactly as in the file: row n
// of W is K / 32 blocks of row_bytes / (K / 32) bytes each (ggml's block layouts):
//   Q4_0  18 bytes: float16 d, 16 bytes of nibbles q; w = (q - 8) d
//   Q4_1  20 bytes: float16 d, float16 m, 16 bytes of nibbles q; w = q d + m
//   Q8_0  34 bytes: float16 d, 32 int8 q; w = q d
// A nibble byte j holds element j (low nibble) and element j + 16 (high nibble).
// Each ISA dequantizes a block in registers to float32 exactly as ggml's reference (and the gguf
// Python package) does: q * d then + m (Q4_1), (q - 8) * d (Q4_0), q * d (Q8_0); the same bits
// on every path. It multiplies them by the float32 activations; every output is one float32 sum
// per (row, column) over the blocks in k order, lane sums reduced at the end. The ISAs reduce
// in different lane orders, so their results differ by float32 rounding only.
#pragma once
#include <cstdint>
#include <cstring>

namespace pipefill_quant {

// GGML type ids (as in the GGUF file).
constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ8_0 = 8;
constexpr int kBlock = 32;  // weights per block of every type here

inline int block_bytes(int qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: return 0;
  }
}

// IEEE half -> float, exactly (normals, subnormals, inf, NaN), in integer code so that no ISA
// flag (F16C) and no denormal mode of the FPU changes it.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// One block's 32 weights as float32 (the glue's dequantization for prefill, and the scalar
// path's). Built with -ffp-contract=off: no fma fuses the product and the offset.
inline void dequant_block(int qtype, const uint8_t* b, float* out) {
  const float d = half_at(b);
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < kBlock; ++j) out[j] = (float)q[j] * d;
    return;
  }
  if (qtype == kQ4_0) {
    const uint8_t* q = b + 2;
    for (int j = 0; j < 16; ++j) {
      out[j] = (float)((q[j] & 0xf) - 8) * d;
      out[j + 16] = (float)((q[j] >> 4) - 8) * d;
    }
    return;
  }
  const float m = half_at(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 16; ++j) {
    out[j] = (float)(q[j] & 0xf) * d + m;
    out[j + 16] = (float)(q[j] >> 4) * d + m;
  }
}

// Each function computes columns [n0, n1) of all M rows: y[m * ldy + n] = the float32 sum (no
// bias: the glue adds it). x: float32 [M, ldx]; w: row n at w + n * row_bytes; K a multiple of 32.
#define PF_QUANT_GEMM(ns)                                                                        \
  namespace ns {                                                                                 \
  void gemm_cols(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes,  \
                 int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1);          \
  }
PF_QUANT_GEMM(scalar)
PF_QUANT_GEMM(avx2)
PF_QUANT_GEMM(avx512)
#undef PF_QUANT_GEMM

}  // namespace pipefill_quant
