// Glue of the small-M decode GEMM: per-ISA cpuid/XCR0 checks, activation conversion (bf16 ->
// float32 for the float32-compute paths, zero-padding an odd K for vdpbf16ps) and the split of
// column blocks over torch's thread pool (at::parallel_for, so --threads-per-stage applies).
// Built WITHOUT ISA flags; an ISA's code runs only when the caller asked for that ISA and the
// check for it passed. Plain extern "C" entry points called through ctypes (the GIL is released).
#include <ATen/Parallel.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include "decode_gemm_kernel.h"

namespace {

using namespace pipefill_decode;

enum Isa { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3 };
constexpr int kIsas = 4;

uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

// Linux lends AMX tile data only to a process that asked for it (arch_prctl); process-wide,
// so torch's pool threads may then use tiles too. nullptr when granted.
const char* amx_permission() {
  constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtiledata = 18;
  unsigned long mask = 0;
  if (syscall(SYS_arch_prctl, kGetPerm, &mask) == 0 && (mask & (1ul << kXtiledata))) return nullptr;
  if (syscall(SYS_arch_prctl, kReqPerm, kXtiledata) != 0) return "AMX tile permission refused (ARCH_REQ_XCOMP_PERM)";
  if (syscall(SYS_arch_prctl, kGetPerm, &mask) != 0 || !(mask & (1ul << kXtiledata)))
    return "AMX tile permission not granted (ARCH_GET_XCOMP_PERM)";
  return nullptr;
}

const char* isa_check(int isa) {
  unsigned a, b, c, d;
  if (isa < 0 || isa >= kIsas) return "unknown ISA";
  if (!__get_cpuid(1, &a, &b, &c, &d)) return "cpuid leaf 1 unavailable";
  if (!(c & (1u << 27))) return "OSXSAVE not enabled";
  const bool fma = c & (1u << 12);
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return "OS does not enable AVX state (XCR0)";
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "cpuid leaf 7 unavailable";
  if (isa == kAvx2) {
    if (!(b & (1u << 5))) return "no AVX2";
    if (!fma) return "no FMA";
    return nullptr;
  }
  if ((xcr0 & 0xe6) != 0xe6) return "OS does not enable AVX-512 state (XCR0)";
  if (!(b & (1u << 16))) return "no AVX512F";
  if (!(b & (1u << 30))) return "no AVX512BW";
  if (!(b & (1u << 31))) return "no AVX512VL";
  const bool amx_tile = d & (1u << 24), amx_bf16 = d & (1u << 22);
  if (isa == kAvx512Bf16 || isa == kAmx) {
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return "no AVX512_BF16";
  }
  if (isa == kAmx) {
    if (!amx_tile) return "no AMX-TILE";
    if (!amx_bf16) return "no AMX-BF16";
    if ((xcr0 & 0x60000) != 0x60000) return "OS does not enable AMX tile state (XCR0)";
    return amx_permission();
  }
  return nullptr;
}

bool isa_ok(int isa) {
  static const bool ok[kIsas] = {isa_check(0) == nullptr, isa_check(1) == nullptr,
                                 isa_check(2) == nullptr, isa_check(3) == nullptr};
  return isa >= 0 && isa < kIsas && ok[isa];
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t b = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
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

}  // namespace

extern "C" {

// 1 when this ISA's kernel can run here; otherwise 0 and the reason in buf.
int pf_dg_isa_supported(int isa, char* buf, int n) {
  const char* why = isa_check(isa);
  if (why && buf && n > 0) std::snprintf(buf, (size_t)n, "%s", why);
  return why == nullptr;
}

// y[M, N] (row stride ldy, float32 or bf16) = x[M, K] (row stride ldx, float32 or bf16) @ W^T
// (+ bias float32 [N] or null), W packed (see decode_gemm_kernel.h) as w_dtype.
// W's Kp is K rounded up to even, or to a multiple of kAmxK for the AMX path.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_dg_gemm(int isa, const void* x, int x_dtype, int64_t ldx, const void* wp, int w_dtype,
               const float* bias, void* y, int y_dtype, int64_t ldy, int64_t M, int64_t N, int64_t K) {
  if (!isa_ok(isa)) return -2;
  if (M <= 0 || N <= 0) return 0;
  const bool bf16_only = isa == kAvx512Bf16 || isa == kAmx;
  if (K <= 0 || (bf16_only && (w_dtype != kBF16 || x_dtype != kBF16))) return -3;
  const Out out{y, y_dtype, ldy, N, bias};
  const int64_t kp = isa == kAmx ? (K + kAmxK - 1) / kAmxK * kAmxK : K + (K & 1);
  const int64_t ng = (N + kGroup - 1) / kGroup;
  try {
    if (isa == kAmx) {  // A tiles read whole 16-row x 32-k blocks: a zero-padded copy of x
      thread_local std::vector<uint16_t> padded;
      const uint16_t* xp = zero_padded(static_cast<const uint16_t*>(x), ldx, M, K,
                                       (M + 15) / 16 * 16, kp, padded);
      at::parallel_for(0, ng, grain(kp, 2), [&](int64_t g0, int64_t g1) {
        amx::gemm_blocks(xp, wp, M, kp, out, g0, g1);
      });
      return 0;
    }
    if (isa == kAvx512Bf16) {
      const uint16_t* xb = static_cast<const uint16_t*>(x);
      std::vector<uint16_t> padded;
      if (K & 1) {  // vdpbf16ps reads k in pairs: give the last k a zero partner
        xb = zero_padded(xb, ldx, M, K, M, kp, padded);
        ldx = kp;
      }
      at::parallel_for(0, ng, grain(kp, 2), [&](int64_t g0, int64_t g1) {
        avx512bf16::gemm_blocks(xb, ldx, wp, M, kp, out, g0, g1);
      });
      return 0;
    }
    const float* xf = static_cast<const float*>(x);
    std::vector<float> conv;
    if (x_dtype == kBF16) {
      conv.resize((size_t)(M * K));
      const uint16_t* xb = static_cast<const uint16_t*>(x);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) conv[m * K + k] = bf16_to_f32(xb[m * ldx + k]);
      xf = conv.data();
      ldx = K;
    }
    auto fn = isa == kAvx2 ? avx2::gemm_blocks : avx512::gemm_blocks;
    at::parallel_for(0, ng, grain(kp, w_dtype == kBF16 ? 2 : 4), [&](int64_t g0, int64_t g1) {
      fn(xf, ldx, wp, w_dtype, M, K, out, g0, g1);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipefill decode gemm: %s\n", e.what());
    return -1;
  } catch (...) {
    return -1;
  }
  return 0;
}

}  // extern "C"
