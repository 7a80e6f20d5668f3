// Glue of the small-M decode GEMM: per-ISA cpuid/XCR0 checks, activation conversion (bf16 ->
// float32 for the float32-compute paths, zero-padding an odd K for vdpbf16ps) and the split of
// column blocks over torch's thread pool (at::parallel_for, so --threads-per-stage applies). An
// ISA's code runs only when the caller asked for that ISA and the check for it passed. The entry
// points take addresses and sizes (pipefill/kernels/decode_gemm.py checks them, once per bound
// call on the decode path).
#include "glue.h"

#include <string>
#include <tuple>
#include <vector>

#include "decode_gemm_kernel.h"

namespace {

namespace pg = pipefill_glue;
using namespace pipefill_decode;
using pg::Addr;

enum Isa { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3 };
constexpr int kIsas = 4;

const char* isa_check(int isa) {
  switch (isa) {
    case kAvx2: return pg::need_avx2_fma();
    case kAvx512: return pg::need_avx512();
    case kAvx512Bf16: return pg::need_avx512_bf16();
    case kAmx: {
      const char* why = pg::need_amx_cpu();
      return why ? why : pg::amx_permission();
    }
    default: return "unknown ISA";
  }
}

bool isa_ok(int isa) {
  static const bool ok[kIsas] = {isa_check(0) == nullptr, isa_check(1) == nullptr,
                                 isa_check(2) == nullptr, isa_check(3) == nullptr};
  return isa >= 0 && isa < kIsas && ok[isa];
}

// x's M rows of K bf16 values copied into buf as `rows` rows of kp values (row stride kp),
// the rest zeros -> buf's data.
const uint16_t* zero_padded(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t rows,
                            int64_t kp, std::vector<uint16_t>& buf) {
  buf.assign((size_t)(rows * kp), 0);
  for (int64_t m = 0; m < M; ++m) std::memcpy(&buf[m * kp], x + m * ldx, K * 2);
  return buf.data();
}

// Column groups per task: at least ~64 KB of weights each, so small matrices stay on one
// thread (a group of a 576-wide matrix is already 55 KB in bf16).
int64_t grain(int64_t kp, int64_t w_elem) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kp * kGroup * w_elem));
}

// (True, "ok") when this ISA's kernel can run here; otherwise (False, the reason).
std::tuple<bool, std::string> pf_dg_isa_supported(int isa) {
  const char* why = isa_check(isa);
  return {why == nullptr, why ? why : "ok"};
}

// y[M, N] (row stride ldy, float32 or bf16) = x[M, K] (row stride ldx, float32 or bf16) @ W^T
// (+ bias float32 [N] or None), W packed (see decode_gemm_kernel.h) as w_dtype.
// W's Kp is K rounded up to even, or to a multiple of kAmxK for the AMX path.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_dg_gemm(int isa, Addr x_addr, int x_dtype, int64_t ldx, Addr wp_addr, int w_dtype, Addr bias, Addr y,
               int y_dtype, int64_t ldy, int64_t M, int64_t N, int64_t K) {
  if (!isa_ok(isa)) return -2;
  if (M <= 0 || N <= 0) return 0;
  const bool bf16_only = isa == kAvx512Bf16 || isa == kAmx;
  if (K <= 0 || (bf16_only && (w_dtype != kBF16 || x_dtype != kBF16))) return -3;
  const void* x = x_addr.as<const void>();
  const void* wp = wp_addr.as<const void>();
  const Out out{y.as<void>(), y_dtype, ldy, N, bias.as<const float>()};
  const int64_t kp = isa == kAmx ? (K + kAmxK - 1) / kAmxK * kAmxK : K + (K & 1);
  const int64_t ng = (N + kGroup - 1) / kGroup;
  return pg::guarded("pipefill decode gemm", [&] {
    if (isa == kAmx) {  // A tiles read whole 16-row x 32-k blocks: a zero-padded copy of x
      thread_local std::vector<uint16_t> padded;
      const uint16_t* xp = zero_padded(static_cast<const uint16_t*>(x), ldx, M, K,
                                       (M + 15) / 16 * 16, kp, padded);
      at::parallel_for(0, ng, grain(kp, 2), [&](int64_t g0, int64_t g1) {
        amx::gemm_blocks(xp, wp, M, kp, out, g0, g1);
      });
      return;
    }
    if (isa == kAvx512Bf16) {
      const uint16_t* xb = static_cast<const uint16_t*>(x);
      int64_t ldb = ldx;
      std::vector<uint16_t> padded;
      if (K & 1) {  // vdpbf16ps reads k in pairs: give the last k a zero partner
        xb = zero_padded(xb, ldx, M, K, M, kp, padded);
        ldb = kp;
      }
      at::parallel_for(0, ng, grain(kp, 2), [&](int64_t g0, int64_t g1) {
        avx512bf16::gemm_blocks(xb, ldb, wp, M, kp, out, g0, g1);
      });
      return;
    }
    const float* xf = static_cast<const float*>(x);
    int64_t ldf = ldx;
    std::vector<float> conv;
    if (x_dtype == kBF16) {
      conv.resize((size_t)(M * K));
      const uint16_t* xb = static_cast<const uint16_t*>(x);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) conv[m * K + k] = pg::bf16_to_f32(xb[m * ldx + k]);
      xf = conv.data();
      ldf = K;
    }
    auto fn = isa == kAvx2 ? avx2::gemm_blocks : avx512::gemm_blocks;
    at::parallel_for(0, ng, grain(kp, w_dtype == kBF16 ? 2 : 4), [&](int64_t g0, int64_t g1) {
      fn(xf, ldf, wp, w_dtype, M, K, out, g0, g1);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("pf_dg_isa_supported", &pf_dg_isa_supported);
  m.def("pf_dg_gemm", &pf_dg_gemm, py::call_guard<py::gil_scoped_release>());
}
