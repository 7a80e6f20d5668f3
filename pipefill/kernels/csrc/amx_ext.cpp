// Generic glue for the AMX attention kernel: CPU/permission checks, argument validation,
// cache packing (write_kv) and the work split over torch's thread pool. Built WITHOUT any ISA
// flags, so importing the module and calling the checks is safe on any x86-64 CPU; the AMX
// translation unit (amx_kernel.cpp) is only entered after amx_permission() succeeded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>

#include "amx_kernel.h"

namespace {

constexpr long kArchGetXcompPerm = 0x1022;
constexpr long kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

// cpuid: AMX-TILE, AMX-BF16, AVX512F/BW/VL/DQ, AVX512-BF16, FMA, and OS-enabled ZMM state.
std::tuple<bool, std::string> cpu_supported() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return {false, "cpuid leaf 1 unavailable"};
  if (!(c & (1u << 27))) return {false, "OSXSAVE not enabled"};
  if (!(c & (1u << 12))) return {false, "no FMA"};
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0xe6) != 0xe6) return {false, "OS does not enable AVX-512 (XCR0)"};
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return {false, "cpuid leaf 7 unavailable"};
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  if (!(f && dq && bw && vl)) return {false, "no AVX-512 F/DQ/BW/VL"};
  if (!(d & (1u << 24))) return {false, "no AMX-TILE"};
  if (!(d & (1u << 22))) return {false, "no AMX-BF16"};
  unsigned a1, b1, c1, d1;
  if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !(a1 & (1u << 5))) return {false, "no AVX512-BF16"};
  return {true, "ok"};
}

std::once_flag g_perm_once;
bool g_perm_ok = false;
std::string g_perm_msg;

// Requests XTILEDATA once per process and verifies it with ARCH_GET_XCOMP_PERM.
std::tuple<bool, std::string> amx_permission() {
  std::call_once(g_perm_once, [] {
    auto [ok, why] = cpu_supported();
    if (!ok) {
      g_perm_msg = why;
      return;
    }
    const long rc = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
    unsigned long mask = 0;
    const long rc2 = syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask);
    if (rc2 != 0) {
      g_perm_msg = "ARCH_GET_XCOMP_PERM failed (errno " + std::to_string(errno) + ")";
    } else if (!(mask & (1ul << kXfeatureXtiledata))) {
      g_perm_msg = "AMX tile data permission not granted (ARCH_REQ_XCOMP_PERM rc=" + std::to_string(rc) + ")";
    } else {
      g_perm_ok = true;
      g_perm_msg = "ok";
    }
  });
  return {g_perm_ok, g_perm_msg};
}

struct ThreadScratch {
  void* buf = nullptr;
  size_t cap = 0;
  ~ThreadScratch() { std::free(buf); }
  void* get(size_t bytes) {
    if (bytes > cap) {
      std::free(buf);
      cap = (bytes + 4095) / 4096 * 4096;
      buf = std::aligned_alloc(64, cap);
      TORCH_CHECK(buf, "pipefill AMX attention: out of memory for scratch");
    }
    return buf;
  }
};

size_t align64(size_t x) { return (x + 63) / 64 * 64; }

void check_cache(const torch::Tensor& c, const char* what) {
  TORCH_CHECK(c.dim() == 4, what, ": expected [num_pages, kv_heads, page_size, head_dim], got ", c.sizes());
  TORCH_CHECK(c.scalar_type() == torch::kBFloat16, what, ": expected bfloat16");
  TORCH_CHECK(c.is_contiguous(), what, ": must be contiguous");
  TORCH_CHECK(c.size(2) % 32 == 0, what, ": page_size must be a multiple of 32, got ", c.size(2));
  TORCH_CHECK(c.size(3) == 64 || c.size(3) == 128, what, ": head_dim must be 64 or 128, got ", c.size(3));
}

void check_pages(const torch::Tensor& pt, int64_t needed, int64_t num_pages) {
  TORCH_CHECK(pt.scalar_type() == torch::kInt32 && pt.dim() == 1 && pt.is_contiguous(),
              "page_table: expected a contiguous 1-D int32 tensor");
  TORCH_CHECK(pt.size(0) >= needed, "page_table: ", pt.size(0), " pages, need ", needed);
  const int32_t* p = pt.data_ptr<int32_t>();
  for (int64_t i = 0; i < needed; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < num_pages, "page_table[", i, "] = ", p[i], " out of range [0, ", num_pages, ")");
}

void check_tokens(const torch::Tensor& x, const char* what, int64_t heads, int64_t d) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == d, what, ": expected [C, ", heads, ", ", d,
              "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, what, ": expected bfloat16");
  TORCH_CHECK(x.stride(2) == 1, what, ": last dim must be contiguous");
}

// Packs tokens [start, start + C) into the AMX layouts (see amx_kernel.cpp) and zeroes the
// rest of the last 32-token group, so the kernel never multiplies zero probabilities by
// uninitialised (possibly NaN) values.
void write_kv(torch::Tensor kc, torch::Tensor vc, torch::Tensor k, torch::Tensor v, torch::Tensor pt,
              int64_t start) {
  check_cache(kc, "k_cache");
  check_cache(vc, "v_cache");
  TORCH_CHECK(kc.sizes() == vc.sizes(), "k_cache and v_cache shapes differ");
  const int64_t P = kc.size(0), H = kc.size(1), ps = kc.size(2), D = kc.size(3);
  check_tokens(k, "k_new", H, D);
  check_tokens(v, "v_new", H, D);
  TORCH_CHECK(k.size(0) == v.size(0), "k_new and v_new lengths differ");
  TORCH_CHECK(start >= 0, "start must be >= 0");
  const int64_t C = k.size(0), end = start + C;
  if (C == 0) return;
  check_pages(pt, (end + ps - 1) / ps, P);
  const int32_t* table = pt.data_ptr<int32_t>();
  uint16_t* kd = reinterpret_cast<uint16_t*>(kc.data_ptr());
  uint16_t* vd = reinterpret_cast<uint16_t*>(vc.data_ptr());
  const uint16_t* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const int64_t kst = k.stride(0), ksh = k.stride(1), vst = v.stride(0), vsh = v.stride(1);
  const int64_t tail = (end + 31) / 32 * 32;  // zero tokens [end, tail): same page as end - 1
  at::parallel_for(start, tail, 64, [&](int64_t b, int64_t e) {
    for (int64_t pos = b; pos < e; ++pos) {
      const bool real = pos < end;
      const int64_t off = pos % ps;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((int64_t)table[(real ? pos : end - 1) / ps] * H + h) * ps * D;
        // K: [off/16][D/32][16 pairs][16 tokens][2] -> dim pair j of this token is one uint32.
        uint32_t* kdst = reinterpret_cast<uint32_t*>(kd + base + (off / 16) * 16 * D) + (off % 16);
        const uint32_t* ksrc = reinterpret_cast<const uint32_t*>(ks + (pos - start) * kst + h * ksh);
        for (int64_t j = 0; j < D / 2; ++j) kdst[j * 16] = real ? ksrc[j] : 0u;  // j*16 = (j/16)*256+(j%16)*16
        // V: [off/32][D/16][16 token pairs][16 dims][2].
        const int64_t o32 = off % 32;
        uint16_t* vdst = vd + base + (off / 32) * 32 * D + (o32 / 2) * 32 + (o32 % 2);
        const uint16_t* vsrc = vs + (pos - start) * vst + h * vsh;
        for (int64_t d = 0; d < D; ++d) vdst[(d / 16) * 512 + (d % 16) * 2] = real ? vsrc[d] : (uint16_t)0;
      }
    }
  });
}

// out[C, Hq, D] = causal attention of q (positions [L, L + C)) over cached tokens [0, L + C).
// prof (optional, int64 [num_threads, 4]) accumulates rdtsc cycles: QK^T, softmax, PV, item.
torch::Tensor chunk_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor pt,
                              int64_t L, double scale, c10::optional<torch::Tensor> out_opt, int64_t qtile,
                              int64_t mode, c10::optional<torch::Tensor> prof_opt, int64_t step) {
  auto [ok, why] = amx_permission();
  TORCH_CHECK(ok, "pipefill AMX attention unavailable: ", why);
  check_cache(kc, "k_cache");
  check_cache(vc, "v_cache");
  TORCH_CHECK(kc.sizes() == vc.sizes(), "k_cache and v_cache shapes differ");
  const int64_t P = kc.size(0), Hkv = kc.size(1), ps = kc.size(2), D = kc.size(3);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D, "q: expected [C, Hq, ", D, "], got ", q.sizes());
  const int64_t C = q.size(0), Hq = q.size(1);
  TORCH_CHECK(Hq % Hkv == 0, "q heads (", Hq, ") must be a multiple of kv heads (", Hkv, ")");
  check_tokens(q, "q", Hq, D);
  TORCH_CHECK(L >= 0, "prefix_len must be >= 0");
  const int64_t G = Hq / Hkv;
  torch::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    check_tokens(out, "out", Hq, D);
    TORCH_CHECK(out.size(0) == C, "out: expected ", C, " rows");
  } else {
    out = torch::empty({C, Hq, D}, q.options());
  }
  if (C == 0) return out;
  check_pages(pt, (L + C + ps - 1) / ps, P);
  // About 192 rows (6 blocks of 32) per item: each K/V step fetched is reused by all of them.
  if (qtile <= 0) qtile = std::max<int64_t>(1, 192 / G);
  qtile = std::min(qtile, C);
  TORCH_CHECK(qtile * G <= 2048, "qtile * group must be <= 2048");

  pipefill_amx::Params p{};
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  p.q_st = q.stride(0);
  p.q_sh = q.stride(1);
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.o_st = out.stride(0);
  p.o_sh = out.stride(1);
  p.k = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  p.v = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  p.page_table = pt.data_ptr<int32_t>();
  p.page_size = ps;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.group = G;
  p.C = C;
  p.L = L;
  p.qtile = qtile;
  p.scale = (float)scale;
  p.mode = (int)mode;
  TORCH_CHECK(step == 0 || step == 64 || step == 128, "step must be 64 or 128");
  p.step = (int)(step ? step : pipefill_amx::kStep);

  const int64_t n = pipefill_amx::num_items(p);
  const int nthreads = at::get_num_threads();
  int64_t* prof = nullptr;
  if (prof_opt.has_value()) {
    TORCH_CHECK(prof_opt->scalar_type() == torch::kInt64 && prof_opt->is_contiguous() &&
                    prof_opt->numel() >= 4 * nthreads, "prof: expected int64 [num_threads, 4]");
    prof = prof_opt->data_ptr<int64_t>();
  }
  const int64_t rows = pipefill_amx::rows_pad(qtile, G);
  const size_t q_bytes = align64(rows * D * 2), o_bytes = align64(rows * D * 4), ml_bytes = align64(rows * 4);
  const size_t s_bytes = 2 * 32 * pipefill_amx::kStep * 4;
  const size_t total = q_bytes + o_bytes + 2 * ml_bytes + s_bytes;
  std::atomic<int64_t> next{0};
  // One task per thread; each pulls items (longest first) from the shared counter.
  at::parallel_for(0, std::min<int64_t>(nthreads, n), 1, [&](int64_t, int64_t) {
    thread_local ThreadScratch scratch;
    char* base = static_cast<char*>(scratch.get(total));
    pipefill_amx::Scratch s;
    s.q = reinterpret_cast<uint16_t*>(base);
    s.o = reinterpret_cast<float*>(base + q_bytes);
    s.m = reinterpret_cast<float*>(base + q_bytes + o_bytes);
    s.l = reinterpret_cast<float*>(base + q_bytes + o_bytes + ml_bytes);
    s.s = reinterpret_cast<float*>(base + q_bytes + o_bytes + 2 * ml_bytes);
    uint64_t* my_prof = prof ? reinterpret_cast<uint64_t*>(prof + 4 * at::get_thread_num()) : nullptr;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;)
      pipefill_amx::run_item(p, i, s, my_prof);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &cpu_supported, "cpuid check for AMX-BF16/AVX-512-BF16 and OS state");
  m.def("amx_permission", &amx_permission, "request + verify AMX tile permission (once per process)");
  m.def("write_kv", &write_kv, "pack new K/V tokens into the AMX cache layout",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k_new"), py::arg("v_new"), py::arg("page_table"),
        py::arg("start"), py::call_guard<py::gil_scoped_release>());
  m.def("chunk_attention", &chunk_attention, "fused causal chunk attention (AMX)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"), py::arg("prefix_len"), py::arg("scale"),
        py::arg("out") = py::none(), py::arg("qtile") = 0, py::arg("mode") = 0, py::arg("prof") = py::none(), py::arg("step") = 0,
        py::call_guard<py::gil_scoped_release>());
}
