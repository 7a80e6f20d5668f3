// Glue of pipefill's fused elementwise CPU ops (add+RMSNorm, RoPE, SiLU*mul, and Gemma's
// RMSNorm sandwich, per-head q/k norm + RoPE and GeGLU): the choice of
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
  decltype(&pipefill_fused::avx512::gelu_tanh_mul_rows) gelu_tanh_mul_rows;
  decltype(&pipefill_fused::avx512::rms_norm_rows) rms_norm_rows;
  decltype(&pipefill_fused::avx512::norm_add_rms_norm_rows) norm_add_rms_norm_rows;
  decltype(&pipefill_fused::avx512::qk_norm_rope_rows) qk_norm_rope_rows;
  const char* name;
};

#define PF_KERNELS(NS)                                                                                   \
  Kernels {                                                                                              \
    pipefill_fused::NS::add_rms_norm_rows, pipefill_fused::NS::rope_rows, pipefill_fused::NS::silu_mul_rows, \
        pipefill_fused::NS::gelu_tanh_mul_rows, pipefill_fused::NS::rms_norm_rows,                       \
        pipefill_fused::NS::norm_add_rms_norm_rows, pipefill_fused::NS::qk_norm_rope_rows, #NS           \
  }
constexpr Kernels kAvx512 = PF_KERNELS(avx512);
constexpr Kernels kAvx512Bf16 = PF_KERNELS(avx512bf16);
constexpr Kernels kAvx2 = PF_KERNELS(avx2);

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

int pf_gelu_tanh_mul(Addr gu, int dtype, int64_t gu_st, Addr out, int64_t out_st, int64_t T, int64_t I) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 4 * I, [&](int64_t r0, int64_t r1) {
    k->gelu_tanh_mul_rows(gu.as<const void>(), dtype, gu_st, out.as<void>(), out_st, I, r0, r1);
  });
}

// x rows of x_dtype normed into out rows of out_dtype (out may be x).
int pf_rms_norm(Addr x, int x_dtype, int64_t x_st, Addr w, Addr out, int out_dtype, int64_t out_st, int64_t T,
                int64_t H, double eps) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 2 * H, [&](int64_t r0, int64_t r1) {
    k->rms_norm_rows(x.as<const void>(), x_dtype, x_st, w.as<const float>(), out.as<void>(), out_dtype, out_st, H,
                     (float)eps, r0, r1);
  });
}

// pf_add_rms_norm with hid normed in place by hid_w first (Gemma's post-norm before the add).
int pf_norm_add_rms_norm(Addr res, int64_t res_st, Addr hid, int hid_dtype, int64_t hid_st, Addr hid_w, Addr w,
                         Addr out, int out_dtype, int64_t out_st, int64_t T, int64_t H, double eps) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 3 * H, [&](int64_t r0, int64_t r1) {
    k->norm_add_rms_norm_rows(res.as<float>(), res_st, hid.as<void>(), hid_dtype, hid_st, hid_w.as<const float>(),
                              w.as<const float>(), out.as<void>(), out_dtype, out_st, H, (float)eps, r0, r1);
  });
}

// Per-head RMSNorm of nq heads by wq and nk heads by wk, then RoPE, in place.
int pf_qk_norm_rope(Addr x, int dtype, int64_t st, int64_t sh, int64_t T, int64_t nq, int64_t nk, int64_t D, Addr wq,
                    Addr wk, double eps, Addr cos, Addr sin) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 2 * (nq + nk) * D, [&](int64_t r0, int64_t r1) {
    k->qk_norm_rope_rows(x.as<void>(), dtype, st, sh, nq, nk, D, wq.as<const float>(), wk.as<const float>(),
                         (float)eps, cos.as<const float>(), sin.as<const float>(), r0, r1);
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
  m.def("pf_gelu_tanh_mul", &pf_gelu_tanh_mul, nogil);
  m.def("pf_rms_norm", &pf_rms_norm, nogil);
  m.def("pf_norm_add_rms_norm", &pf_norm_add_rms_norm, nogil);
  m.def("pf_qk_norm_rope", &pf_qk_norm_rope, nogil);
}
