// Scalar quantized decode GEMM (any x86-64, and the reference order of the vector paths): each
// block is dequantized into floats once per column, then used for every row. Layouts: see
// quant_gemm_kernel.h.
#include "quant_gemm_kernel.h"

namespace pipefill_quant {
namespace scalar {
namespace {

template <int QT>
void run(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K,
         float* y, int64_t ldy, int64_t n0, int64_t n1) {
  using L = Layout<QT>;
  const int64_t blocks = K / L::kWeights;
  constexpr int kRows = 64;  // rows summed per pass (M is at most a few dozen)
  float acc[kRows];
  float wf[L::kWeights];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = M - m0 < kRows ? M - m0 : kRows;
      for (int64_t r = 0; r < rows; ++r) acc[r] = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        dequant_block<QT>(row + b * L::kBytes, wf);
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = x + (m0 + r) * ldx + b * L::kWeights;
          for (int u = 0; u < L::kUnits; ++u) {  // one partial sum per 32 weights
            float s = 0.0f;
            for (int j = 0; j < kUnit; ++j) s += wf[u * kUnit + j] * xr[u * kUnit + j];
            acc[r] += s;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = acc[r];
    }
  }
}

template <int QT>
void dequant(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16,
             int64_t ldo) {
  using L = Layout<QT>;
  float v[L::kWeights];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < K / L::kWeights; ++b) {
      dequant_block<QT>(w + n * row_bytes + b * L::kBytes, v);
      const int64_t at = n * ldo + b * L::kWeights;
      if (!bf16) {
        std::memcpy(static_cast<float*>(out) + at, v, sizeof v);
      } else {
        for (int j = 0; j < L::kWeights; ++j) static_cast<uint16_t*>(out)[at + j] = bf16_round(v[j]);
      }
    }
}

}  // namespace

void dequant_rows(const uint8_t* w, int qtype, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1,
                  void* out, bool bf16, int64_t ldo) {
  with_type(qtype, [&](auto t) { dequant<decltype(t)::value>(w, row_bytes, K, n0, n1, out, bf16, ldo); });
}

void gemm_cols(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes,
               int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) {
    run<decltype(t)::value>(x, ldx, w, row_bytes, M, K, y, ldy, n0, n1);
  });
}

}  // namespace scalar
}  // namespace pipefill_quant
