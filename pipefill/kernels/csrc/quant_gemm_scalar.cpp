// Scalar quantized decode GEMM (any x86-64, and the reference order of the vector paths): each
// block is dequantized into 32 floats once per column, then used for every row. Layouts: see
// quant_gemm_kernel.h.
#include "quant_gemm_kernel.h"

namespace pipefill_quant {
namespace scalar {

void gemm_cols(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes,
               int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kBlock, bb = block_bytes(qtype);
  constexpr int kRows = 64;  // rows summed per pass (M is at most a few dozen)
  float acc[kRows];
  float wf[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = M - m0 < kRows ? M - m0 : kRows;
      for (int64_t r = 0; r < rows; ++r) acc[r] = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        dequant_block(qtype, row + b * bb, wf);
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = x + (m0 + r) * ldx + b * kBlock;
          float s = 0.0f;
          for (int j = 0; j < kBlock; ++j) s += wf[j] * xr[j];
          acc[r] += s;
        }
      }
      for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = acc[r];
    }
  }
}

}  // namespace scalar
}  // namespace pipefill_quant
