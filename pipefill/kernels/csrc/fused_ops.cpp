// Generic glue for pipefill's fused elementwise CPU ops (add+RMSNorm, RoPE, SiLU*mul): the
// cpuid/XCR0 check, the choice of kernel build (avx512 or avx512bf16) and the split of rows over
// torch's thread pool (at::parallel_for, built with -fopenmp so it runs on torch's own OpenMP
// pool). Built WITHOUT ISA flags; the AVX-512 code in fused_ops_avx512.cpp is only entered after
// pf_fused_cpu_supported() succeeded (the entry points return -2 before that). Plain extern "C"
// entry points called through ctypes (which releases the GIL): only <ATen/Parallel.h> is
// included, so the build takes ~2 s.
// Argument validation lives in pipefill/kernels/fused_ops.py.
#include <ATen/Parallel.h>

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>

#include "fused_ops_kernel.h"

namespace {

uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

// AVX2 + FMA with the OS saving YMM state: enough for the avx2 build.
const char* avx2_check() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return "cpuid leaf 1 unavailable";
  if (!(c & (1u << 27))) return "OSXSAVE not enabled";
  if (!(c & (1u << 28)) || !(c & (1u << 12))) return "no AVX/FMA";
  if ((xgetbv0() & 0x6) != 0x6) return "OS does not enable AVX state (XCR0)";
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "cpuid leaf 7 unavailable";
  if (!(b & (1u << 5))) return "no AVX2";
  return nullptr;
}

const char* cpu_check() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return "cpuid leaf 1 unavailable";
  if (!(c & (1u << 27))) return "OSXSAVE not enabled";
  if ((xgetbv0() & 0xe6) != 0xe6) return "OS does not enable AVX-512 state (XCR0)";
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "cpuid leaf 7 unavailable";
  if (!(b & (1u << 16))) return "no AVX512F";
  if (!(b & (1u << 30))) return "no AVX512BW";
  if (!(b & (1u << 31))) return "no AVX512VL";
  return nullptr;
}

bool has_avx512_bf16() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}

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
  try {
    at::parallel_for(0, T, grain_for(elems_per_row), f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipefill fused ops: %s\n", e.what());
    return -1;
  } catch (...) {
    return -1;
  }
  return 0;
}

}  // namespace

extern "C" {

// 1 when a kernel build can run (and selects the best: avx512bf16, avx512, avx2); otherwise 0
// and the reasons in buf.
int pf_fused_cpu_supported(char* buf, int n) {
  const char* why = cpu_check();
  if (!why) {
    g_k.store(has_avx512_bf16() ? &kAvx512Bf16 : &kAvx512, std::memory_order_release);
    return 1;
  }
  const char* why2 = avx2_check();
  if (!why2) {
    g_k.store(&kAvx2, std::memory_order_release);
    return 1;
  }
  if (buf && n > 0) std::snprintf(buf, (size_t)n, "%s; %s", why, why2);
  return 0;
}

// Selects a kernel build by name ("avx512", "avx512bf16", "avx2"); 0 if unknown or unsupported here.
// Not thread-safe against concurrent calls of the ops (tests and benchmarks only).
int pf_fused_select(const char* name) {
  if (!g_k || !name) return 0;
  if (std::strcmp(name, kAvx2.name) == 0 && !avx2_check()) {
    g_k.store(&kAvx2, std::memory_order_release);
    return 1;
  }
  if (std::strcmp(name, kAvx512.name) == 0 && !cpu_check()) {
    g_k.store(&kAvx512, std::memory_order_release);
    return 1;
  }
  if (std::strcmp(name, kAvx512Bf16.name) == 0 && !cpu_check() && has_avx512_bf16()) {
    g_k.store(&kAvx512Bf16, std::memory_order_release);
    return 1;
  }
  return 0;
}

const char* pf_fused_kernel_name() {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return k ? k->name : "";
}

int pf_add_rms_norm(float* res, int64_t res_st, const void* hid, int hid_dtype, int64_t hid_st, const float* w,
                    void* out, int out_dtype, int64_t out_st, int64_t T, int64_t H, double eps) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 2 * H, [&](int64_t r0, int64_t r1) {
    k->add_rms_norm_rows(res, res_st, hid, hid_dtype, hid_st, w, out, out_dtype, out_st, H, (float)eps, r0, r1);
  });
}

int pf_rope(void* x, int dtype, int64_t st, int64_t sh, int64_t T, int64_t N, int64_t D, const float* cos,
            const float* sin) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, N * D, [&](int64_t r0, int64_t r1) {
    k->rope_rows(x, dtype, st, sh, N, D, cos, sin, r0, r1);
  });
}

int pf_silu_mul(const void* gu, int dtype, int64_t gu_st, void* out, int64_t out_st, int64_t T, int64_t I) {
  const Kernels* k = g_k.load(std::memory_order_acquire);
  return run_rows(k, T, 4 * I, [&](int64_t r0, int64_t r1) {
    k->silu_mul_rows(gu, dtype, gu_st, out, out_st, I, r0, r1);
  });
}

}  // extern "C"
