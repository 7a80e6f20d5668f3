// Glue of the quantized decode GEMM (GGUF blocks kept as in the file): per-ISA cpuid/XCR0
// checks, bf16 activations widened to float32, the bias and the bf16 output rounding, the split
// of output columns over torch's thread pool (at::parallel_for, so --threads-per-stage applies),
// and the dequantization of whole rows that prefill multiplies on torch. An ISA's code runs only
// when the caller asked for that ISA and the check for it passed. The entry points take
// addresses and sizes (pipefill/kernels/quant_gemm.py checks them).
#include "glue.h"

#include <vector>

#include "glue_vector_isa.h"
#include "quant_gemm_kernel.h"

namespace {

namespace pg = pipefill_glue;
using namespace pipefill_quant;
using pg::Addr;
using pg::kAvx2;
using pg::kAvx512;

constexpr int kBF16 = 1;  // dtype codes: 0 float32, 1 bfloat16

// The arguments every entry point shares are sane: a known type, whole blocks, the row size.
bool shape_ok(int qtype, int64_t row_bytes, int64_t K) {
  const int bb = block_bytes(qtype), bw = block_weights(qtype);
  return bb > 0 && K > 0 && K % bw == 0 && row_bytes == K / bw * bb;
}

// y[M, N] (row stride ldy, float32 or bf16) = x[M, K] (row stride ldx, float32 or bf16) @ W^T
// (+ bias float32 [N] or None), W GGUF blocks of `qtype`, row n at w + n * row_bytes.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_qg_gemm(int isa, Addr x_addr, int x_dtype, int64_t ldx, Addr w_addr, int qtype,
               int64_t row_bytes, Addr bias_addr, Addr y_addr, int y_dtype, int64_t ldy,
               int64_t M, int64_t N, int64_t K) {
  if (!pg::vector_isa_ok(isa)) return -2;
  if (M <= 0 || N <= 0) return 0;
  if (!shape_ok(qtype, row_bytes, K)) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  const float* bias = bias_addr.as<const float>();
  return pg::guarded("pipefill quantized gemm", [&] {
    thread_local std::vector<float> xbuf, ybuf;
    const float* xf = x_addr.as<const float>();
    int64_t ldf = ldx;
    if (x_dtype == kBF16) {
      xbuf.resize((size_t)(M * K));
      const uint16_t* xb = x_addr.as<const uint16_t>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xbuf[m * K + k] = pg::bf16_to_f32(xb[m * ldx + k]);
      xf = xbuf.data();
      ldf = K;
    }
    float* yf = y_addr.as<float>();
    int64_t ldf_y = ldy;
    if (y_dtype == kBF16) {
      ybuf.resize((size_t)(M * N));
      yf = ybuf.data();
      ldf_y = N;
    }
    auto fn = isa == kAvx512 ? avx512::gemm_cols : isa == kAvx2 ? avx2::gemm_cols : scalar::gemm_cols;
    // Columns per task: at least ~32 KB of blocks, so small matrices stay on one thread.
    const int64_t grain = std::max<int64_t>(1, 32768 / row_bytes);
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      fn(xf, ldf, w, qtype, row_bytes, M, K, yf, ldf_y, n0, n1);
    });
    for (int64_t m = 0; m < M; ++m) {
      float* yr = yf + m * ldf_y;
      if (bias)
        for (int64_t n = 0; n < N; ++n) yr[n] += bias[n];
      if (y_dtype == kBF16) {
        uint16_t* out = y_addr.as<uint16_t>() + m * ldy;
        for (int64_t n = 0; n < N; ++n) out[n] = yr[n] != yr[n] ? 0x7fc0 : pg::bf16_rne(yr[n]);
      }
    }
  });
}

// out[N, K] (row stride ldo, float32 or bf16 rounded to nearest even) = W dequantized by the
// ISA's code, each weight as dequant_block computes it (the decode paths' float32 values).
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_qg_dequant(int isa, Addr w_addr, int qtype, int64_t row_bytes, int64_t N, int64_t K, Addr out_addr,
                  int out_dtype, int64_t ldo) {
  if (!pg::vector_isa_ok(isa)) return -2;
  if (N <= 0) return 0;
  if (!shape_ok(qtype, row_bytes, K)) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  auto fn = isa == kAvx512 ? avx512::dequant_rows : isa == kAvx2 ? avx2::dequant_rows : scalar::dequant_rows;
  return pg::guarded("pipefill dequantize", [&] {
    at::parallel_for(0, N, std::max<int64_t>(1, 65536 / row_bytes), [&](int64_t n0, int64_t n1) {
      fn(w, qtype, row_bytes, K, n0, n1, out_addr.as<void>(), out_dtype == kBF16, ldo);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("pf_qg_isa_supported", &pg::vector_isa_supported);
  m.def("pf_qg_gemm", &pf_qg_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_dequant", &pf_qg_dequant, py::call_guard<py::gil_scoped_release>());
}
