// Glue of pipefill's fused elementwise CPU ops (add+RMSNorm, RoPE, SiLU*mul): the choice of
// kernel build (avx512bf16, avx512 or avx2) from cpuid and the split of rows over torch's thread
// pool. The entry points take addresses and sizes (argument validation lives in
// pipefill/kernels/fused_ops.py; the decode path calls them directly with addresses it took
// once) and return 0, -2 before pf_fused_cpu_supported() succeeded, or -1 on an exception.
#include "glue.h"

#include <string>
#include <tuple>

#include "fused_ops_kernel.h"

namespace {

namespace pg = pipefill_glue;
using pg::Addr;

struct Kernels {
  decltype(&pipefill_fused::avx512::add_rms_norm_rows) add_rms_norm_rows;
  decltype(&pipefill_fused::avx512::rope_rows) rope_rows;
  decltype(&pipefill_fused::avx512::silu_mul_rows) silu_mul_rows;
  const char* name;
};

constexpr Kernels kAvx512{pipefill_fused::avx512::add_rms_norm_rows, pipefill_fused::avx512::rope_rows,
                          pipefill_fused::avx512::silu_mul_rows, "avx512"};
constexpr Kernels kAvx512Bf16{pipefill_fused::avx512bf16::add_rms_norm_rows, pipefill_fused::avx512bf16::rope_rows,
                              pipefill_fused::avx512bf16::silu_mul_rows, "avx512bf16"};
constexpr Kernels kAvx2{pipefill_fused::avx2::add_rms_norm_rows, pipefill_fused::avx2::rope_rows,
                        pipefill_fused::avx2::silu_mul_rows, "avx2"};

// Set by pf_fused_cpu_supported() once the CPU check passed.
std::atomic<const Kernels*> g_k{nullptr};

// Rows per task: at least ~16K elements of work, so that tiny T stays on the calling thread.
int64_t grain_for(int64_t elems_per_row) {
  return std::max<int64_t>(1, (16384 + elems_per_row - 1) / std::max<int64_t>(1, elems_per_row));
}

template <typename F>
int run_rows(const Kernels* k, int64_t T, int64_t elems_per_row, const F& f) {
  if (!k) return -2;
  if (T <= 0) return 0;
  return pg::guarded("pipefill fused ops", [&] { at::parallel_for(0, T, grain_for(elems_per_row), f); });
}

// (True, "ok") when a kernel build can run (and selects the best: avx512bf16, avx512, avx2);
// otherwise (False, the reasons).
std::tuple<bool, std::string> pf_fused_cpu_supported() {
  const char* why = pg::need_avx512();
  if (!why) {
    g_k.store(pg::cpu().avx512_bf16 ? &kAvx512Bf16 : &kAvx512, std::memory_order_release);
    return {true, "ok"};
  }
  const char* why2 = pg::need_avx2_fma();
  if (!why2) {
    g_k.store(&kAvx2, std::memory_order_release);
    return {true, "ok"};
  }
  return {false, std::string(why) + "; " + why2};
}

// Selects a kernel build by name ("avx512", "avx512bf16", "avx2"); false if unknown or unsupported
// here. Not thread-safe against concurrent calls of the ops (tests and benchmarks only).
bool pf_fused_select(const std::string& name) {
  if (!g_k) return false;
  const Kernels* pick = nullptr;
  if (name == kAvx2.name && !pg::need_avx2_fma()) pick = &kAvx2;
  if (name == kAvx512.name && !pg::need_avx512()) pick = &kAvx512;
  if (name == kAvx512Bf16.name && !pg::need_avx512_bf16()) pick = &kAvx512Bf16;
  if (pick) g_k.store(pick, std::memory_order_release);
  return pick != nullptr;
}

std::string pf_fused_kernel_name() {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return k ? k->name : "";
}

// res, out: float32 / out_dtype rows; hid: rows of hid_dtype, or None (no residual add).
int pf_add_rms_norm(Addr res, int64_t res_st, Addr hid, int hid_dtype, int64_t hid_st, Addr w, Addr out,
                    int out_dtype, int64_t out_st, int64_t T, int64_t H, double eps) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 2 * H, [&](int64_t r0, int64_t r1) {
    k->add_rms_norm_rows(res.as<float>(), res_st, hid.as<const void>(), hid_dtype, hid_st, w.as<const float>(),
                         out.as<void>(), out_dtype, out_st, H, (float)eps, r0, r1);
  });
}

int pf_rope(Addr x, int dtype, int64_t st, int64_t sh, int64_t T, int64_t N, int64_t D, Addr cos, Addr sin) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, N * D, [&](int64_t r0, int64_t r1) {
    k->rope_rows(x.as<void>(), dtype, st, sh, N, D, cos.as<const float>(), sin.as<const float>(), r0, r1);
  });
}

int pf_silu_mul(Addr gu, int dtype, int64_t gu_st, Addr out, int64_t out_st, int64_t T, int64_t I) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 4 * I, [&](int64_t r0, int64_t r1) {
    k->silu_mul_rows(gu.as<const void>(), dtype, gu_st, out.as<void>(), out_st, I, r0, r1);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pf_fused_cpu_supported", &pf_fused_cpu_supported);
  m.def("pf_fused_select", &pf_fused_select);
  m.def("pf_fused_kernel_name", &pf_fused_kernel_name);
  m.def("pf_add_rms_norm", &pf_add_rms_norm, nogil);
  m.def("pf_rope", &pf_rope, nogil);
  m.def("pf_silu_mul", &pf_silu_mul, nogil);
}
