// Scalar quantized decode GEMM (any x86-64, and the reference order of the vector paths): each
// block is dequantized into floats once per column, then used for every row. Layouts: see
// quant_gemm_kernel.h (GGUF blocks) and fp8_gemm_kernel.h (FP8 with 128 x 128 block scales).
#include "fp8_gemm_kernel.h"
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

bool dequant_group16(const uint8_t*, int, int64_t, int, void*, bool, int64_t) {
  return false;  // the glue copies the rows back and runs dequant_rows
}

void gemm_cols(const float* x, int64_t ldx, const uint8_t* w, int qtype, int64_t row_bytes,
               int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_type(qtype, [&](auto t) {
    run<decltype(t)::value>(x, ldx, w, row_bytes, M, K, y, ldy, n0, n1);
  });
}

// ---- FP8 e4m3 with block scales: a 256-entry table of the codes' float32 values ----

namespace {

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_to_f32((uint8_t)b);
  }
};

// Weights [k0, k1) of a row (one scale block) as float32: code value x scale, rounded once.
inline void fp8_block(const uint8_t* row, float scale, int64_t k0, int64_t k1, float* out) {
  static const Fp8Table table;
  for (int64_t k = k0; k < k1; ++k) out[k - k0] = table.value[row[k]] * scale;
}

}  // namespace

void fp8_gemm_cols(const float* x, int64_t ldx, const uint8_t* w, const float* scale,
                   const int32_t* scale_row, int64_t lds, int64_t M, int64_t K, float* y, int64_t ldy,
                   int64_t n0, int64_t n1) {
  constexpr int kRows = 64;  // rows summed per pass
  float acc[kRows], wf[kFp8Block];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * K;
    const float* srow = scale + scale_row[n] * lds;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = M - m0 < kRows ? M - m0 : kRows;
      for (int64_t r = 0; r < rows; ++r) acc[r] = 0.0f;
      for (int64_t k0 = 0; k0 < K; k0 += kFp8Block) {
        const int64_t k1 = K - k0 < kFp8Block ? K : k0 + kFp8Block;
        fp8_block(row, srow[k0 / kFp8Block], k0, k1, wf);
        for (int64_t r = 0; r < rows; ++r) {  // one partial sum per block
          const float* xr = x + (m0 + r) * ldx + k0;
          float s = 0.0f;
          for (int64_t j = 0; j < k1 - k0; ++j) s += wf[j] * xr[j];
          acc[r] += s;
        }
      }
      for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = acc[r];
    }
  }
}

void fp8_dequant_rows(const uint8_t* w, const float* scale, const int32_t* scale_row, int64_t lds, int64_t K,
                      int64_t n0, int64_t n1, void* out, bool bf16, int64_t ldo) {
  float v[kFp8Block];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k0 = 0; k0 < K; k0 += kFp8Block) {
      const int64_t k1 = K - k0 < kFp8Block ? K : k0 + kFp8Block;
      fp8_block(w + n * K, scale[scale_row[n] * lds + k0 / kFp8Block], k0, k1, v);
      if (!bf16) {
        std::memcpy(static_cast<float*>(out) + n * ldo + k0, v, (k1 - k0) * sizeof(float));
      } else {
        for (int64_t j = 0; j < k1 - k0; ++j) static_cast<uint16_t*>(out)[n * ldo + k0 + j] = bf16_round(v[j]);
      }
    }
}

uint64_t stream_lines(const uint8_t* p, int64_t l0, int64_t l1, int64_t ahead) {
  return xor_lines(p, l0, l1, ahead);
}

}  // namespace scalar
}  // namespace pipefill_quant
