// What every kernel glue file shares (cpu_attn_ext.cpp, amx_ext.cpp, fused_ops.cpp,
// decode_gemm.cpp). A glue file is built WITHOUT ISA flags as a pybind11 module by
// torch.utils.cpp_extension (pipefill/kernels/build.py): it checks the CPU, validates arguments,
// splits work over torch's thread pool and calls the ISA translation units only after their
// check passed. A glue file that takes torch tensors defines PF_GLUE_TENSORS before including
// this header (it then gets <torch/extension.h>, ~35 s to compile); the others get only pybind11
// and <ATen/Parallel.h> (~10 s) and take addresses (tensor.data_ptr()) and sizes.
#pragma once

#ifdef PF_GLUE_TENSORS
#include <torch/extension.h>
#else
#include <pybind11/pybind11.h>
#endif
#include <ATen/Parallel.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>

namespace pipefill_glue {

// ------------------------------------------------------------------------------- CPU checks

inline uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

// What cpuid and XCR0 say, read once per process.
struct CpuFeatures {
  const char* error = nullptr;  // no vector state at all: cpuid leaves missing, no OSXSAVE
  bool avx = false, fma = false, avx2 = false;
  bool avx512f = false, avx512dq = false, avx512bw = false, avx512vl = false, avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false;
  bool ymm_state = false, zmm_state = false, tile_state = false;  // XCR0: the OS saves them
};

inline CpuFeatures read_cpu_features() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f.error = "cpuid leaf 1 unavailable", f;
  if (!(c & (1u << 27))) return f.error = "OSXSAVE not enabled", f;
  f.avx = c & (1u << 28);
  f.fma = c & (1u << 12);
  const uint64_t xcr0 = xgetbv0();
  f.ymm_state = (xcr0 & 0x6) == 0x6;
  f.zmm_state = (xcr0 & 0xe6) == 0xe6;
  f.tile_state = (xcr0 & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f.error = "cpuid leaf 7 unavailable", f;
  f.avx2 = b & (1u << 5);
  f.avx512f = b & (1u << 16);
  f.avx512dq = b & (1u << 17);
  f.avx512bw = b & (1u << 30);
  f.avx512vl = b & (1u << 31);
  f.amx_bf16 = d & (1u << 22);
  f.amx_tile = d & (1u << 24);
  f.avx512_bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
  return f;
}

inline const CpuFeatures& cpu() {
  static const CpuFeatures features = read_cpu_features();
  return features;
}

// Each need_* returns nullptr when this CPU (and its OS) runs code built with those flags, else
// the first thing missing. Each level includes the one before it.
inline const char* need_avx2_fma() {
  const CpuFeatures& f = cpu();
  if (f.error) return f.error;
  if (!f.ymm_state) return "OS does not enable AVX state (XCR0)";
  if (!f.avx || !f.fma) return "no AVX/FMA";
  if (!f.avx2) return "no AVX2";
  return nullptr;
}

// AVX-512 F/BW/VL (and DQ when `dq`).
inline const char* need_avx512(bool dq = false) {
  if (const char* why = need_avx2_fma()) return why;
  const CpuFeatures& f = cpu();
  if (!f.zmm_state) return "OS does not enable AVX-512 state (XCR0)";
  if (!f.avx512f) return "no AVX512F";
  if (!f.avx512bw) return "no AVX512BW";
  if (!f.avx512vl) return "no AVX512VL";
  if (dq && !f.avx512dq) return "no AVX512DQ";
  return nullptr;
}

inline const char* need_avx512_bf16(bool dq = false) {
  if (const char* why = need_avx512(dq)) return why;
  return cpu().avx512_bf16 ? nullptr : "no AVX512_BF16";
}

// Linux lends AMX tile data only to a process that asked for it (arch_prctl), process-wide, so
// torch's pool threads may then use tiles too. Asked once per process.
inline const char* amx_permission() {
  static const char* const why = [] () -> const char* {
    constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtiledata = 18;
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &mask) == 0 && (mask & (1ul << kXtiledata))) return nullptr;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtiledata) != 0)
      return "AMX tile permission refused (ARCH_REQ_XCOMP_PERM)";
    if (syscall(SYS_arch_prctl, kGetPerm, &mask) != 0 || !(mask & (1ul << kXtiledata)))
      return "AMX tile permission not granted (ARCH_GET_XCOMP_PERM)";
    return nullptr;
  }();
  return why;
}

// AMX-TILE + AMX-BF16 with their OS state, on top of AVX512-BF16 (the kernels' stores and
// softmax). The tile permission is the caller's next step (amx_permission).
inline const char* need_amx_cpu(bool dq = false) {
  if (const char* why = need_avx512_bf16(dq)) return why;
  const CpuFeatures& f = cpu();
  if (!f.amx_tile) return "no AMX-TILE";
  if (!f.amx_bf16) return "no AMX-BF16";
  if (!f.tile_state) return "OS does not enable AMX tile state (XCR0)";
  return nullptr;
}

// ------------------------------------------------------------------------------- numbers

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as the kernels' own conversion (NaN is the caller's business).
inline uint16_t bf16_rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline size_t align64(size_t x) { return (x + 63) / 64 * 64; }

// ------------------------------------------------------------------------------- work split

// One thread's kernel scratch, 64-byte aligned, grown when a call needs more; use it as a
// thread_local so torch's pool threads keep theirs across calls.
struct ThreadScratch {
  void* buf = nullptr;
  size_t cap = 0;
  ~ThreadScratch() { std::free(buf); }
  void* get(size_t bytes) {
    if (bytes > cap) {
      std::free(buf);
      cap = (bytes + 4095) / 4096 * 4096;
      buf = std::aligned_alloc(64, cap);
      if (!buf) {
        cap = 0;
        throw std::runtime_error("pipefill kernels: out of memory for scratch");
      }
    }
    return buf;
  }
};

// Items [0, n) over torch's pool: one task per thread, each pulling items from a shared counter
// (callers number them longest first, so the last ones are short). `setup()` runs once per task
// and its result is handed to every `run(item, state)` of that task. An item is computed the
// same way whichever thread runs it: results do not depend on the thread count.
template <typename Setup, typename Run>
void pull_items(int64_t n, const Setup& setup, const Run& run) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    const auto state = setup();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) run(i, state);
  });
}

// pull_items with a one-item lookahead: a task claims its next item before running the current
// one, and run(item, next, state) gets it (-1: none left), so that the kernel can prefetch the
// next item's first data while it computes. The counter still hands items out in order; a task
// holds at most one claimed item more than pull_items would. With no more items than tasks
// there is nothing to look ahead to, and a claim ahead would be harmful: the first task to
// start would take two items before the others woke (one KV head's two halves on two threads
// ran on one).
template <typename Setup, typename Run>
void pull_items_ahead(int64_t n, const Setup& setup, const Run& run) {
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), n);
  if (n <= tasks) {
    pull_items(n, setup, [&](int64_t i, const auto& state) { run(i, -1, state); });
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    const auto state = setup();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;) {
      const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
      run(i, j < n ? j : -1, state);
      i = j;
    }
  });
}

// The slots a K/V write fills in a packed paged cache: tokens at positions [start, end) and
// zeros for the rest of the last one's 32-token group (same page), so that zero probabilities
// never meet uninitialised (NaN) values. slot(pos, h, off, base, real) for every such position
// and kv head h: off = pos's offset in its page, base = the element offset of the (page, head)
// block of ps * D values, real = pos < end (a token, not a zero).
template <typename Slot>
void for_each_kv_slot(const int32_t* table, int64_t H, int64_t ps, int64_t D, int64_t start, int64_t end,
                      const Slot& slot) {
  const int64_t tail = (end + 31) / 32 * 32;
  at::parallel_for(start, tail, 64, [&](int64_t b, int64_t e) {
    for (int64_t pos = b; pos < e; ++pos) {
      const bool real = pos < end;
      const int64_t off = pos % ps;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((int64_t)table[(real ? pos : end - 1) / ps] * H + h) * ps * D;
        slot(pos, h, off, base, real);
      }
    }
  });
}

// f() for entry points that report by return code: 0, or -1 after printing what was thrown.
template <typename F>
int guarded(const char* what, const F& f) {
  try {
    f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", what, e.what());
    return -1;
  } catch (...) {
    return -1;
  }
  return 0;
}

// An address handed in from Python: tensor.data_ptr(), or None for "no tensor".
struct Addr {
  uintptr_t value = 0;
  template <typename T>
  T* as() const { return reinterpret_cast<T*>(value); }
};

// ------------------------------------------------------------------------------- tensor checks

#ifdef PF_GLUE_TENSORS
inline const char* dtype_name(torch::ScalarType t) {
  if (t == torch::kBFloat16) return "bfloat16";
  if (t == torch::kFloat) return "float32";
  return c10::toString(t);
}

// A packed layer cache [num_pages, kv_heads, page_size, head_dim]: bfloat16 (or float32 when
// `float32_too`), contiguous, whole 32-token groups per page, head_dim 64, 128 or 256 (the AMX
// kernel's attention takes 64 and 128 only and says so itself; packing takes any of them).
inline void check_cache(const torch::Tensor& c, const char* what, bool float32_too) {
  TORCH_CHECK(c.dim() == 4, what, ": expected [num_pages, kv_heads, page_size, head_dim], got ", c.sizes());
  const bool dtype_ok = c.scalar_type() == torch::kBFloat16 || (float32_too && c.scalar_type() == torch::kFloat);
  TORCH_CHECK(dtype_ok, what, ": expected bfloat16", float32_too ? " or float32" : "", ", got ",
              dtype_name(c.scalar_type()));
  TORCH_CHECK(c.is_contiguous(), what, ": must be contiguous");
  TORCH_CHECK(c.size(2) % 32 == 0, what, ": page_size must be a multiple of 32, got ", c.size(2));
  TORCH_CHECK(c.size(3) == 64 || c.size(3) == 128 || c.size(3) == 256, what, ": head_dim must be 64, 128 or 256, got ",
              c.size(3));
}

// A sequence's page table: int32, at least `needed` pages, entries [first, needed) in
// [0, num_pages) (a sliding window's table holds freed pages before `first`, never read).
inline void check_pages(const torch::Tensor& pt, int64_t needed, int64_t num_pages, int64_t first = 0) {
  TORCH_CHECK(pt.scalar_type() == torch::kInt32 && pt.dim() == 1 && pt.is_contiguous(),
              "page_table: expected a contiguous 1-D int32 tensor");
  TORCH_CHECK(pt.size(0) >= needed, "page_table: ", pt.size(0), " pages, need ", needed);
  const int32_t* p = pt.data_ptr<int32_t>();
  for (int64_t i = first; i < needed; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < num_pages, "page_table[", i, "] = ", p[i], " out of range [0, ", num_pages, ")");
}

// Tokens [C, heads, d] of dtype `dt` with the last dim contiguous.
inline void check_tokens(const torch::Tensor& x, const char* what, int64_t heads, int64_t d, torch::ScalarType dt) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == d, what, ": expected [C, ", heads, ", ", d,
              "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == dt, what, ": expected ", dtype_name(dt), ", got ", dtype_name(x.scalar_type()));
  TORCH_CHECK(x.stride(2) == 1, what, ": last dim must be contiguous");
}

// The dims of a write of new K/V tokens into a layer's packed caches.
struct KvWrite {
  int64_t num_pages, heads, page_size, head_dim, end;  // end: the position after the last token
};

// A write's checks: the caches alike (check_cache), k/v [C, heads, head_dim] in their dtype,
// start >= 0 and, when C > 0, a page table covering positions [0, start + C) whose pages from
// start's on are in range (the ones written).
inline KvWrite check_kv_write(const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& pt, int64_t start, bool float32_too) {
  check_cache(kc, "k_cache", float32_too);
  check_cache(vc, "v_cache", float32_too);
  TORCH_CHECK(kc.sizes() == vc.sizes() && kc.scalar_type() == vc.scalar_type(), "k_cache and v_cache differ");
  const KvWrite w{kc.size(0), kc.size(1), kc.size(2), kc.size(3), start + k.size(0)};
  check_tokens(k, "k_new", w.heads, w.head_dim, kc.scalar_type());
  check_tokens(v, "v_new", w.heads, w.head_dim, kc.scalar_type());
  TORCH_CHECK(k.size(0) == v.size(0), "k_new and v_new lengths differ");
  TORCH_CHECK(start >= 0, "start must be >= 0");
  if (w.end > start) check_pages(pt, (w.end + w.page_size - 1) / w.page_size, w.num_pages, start / w.page_size);
  return w;
}
#endif  // PF_GLUE_TENSORS

}  // namespace pipefill_glue

namespace pybind11::detail {
// None -> 0, an int -> that address.
template <>
struct type_caster<pipefill_glue::Addr> {
  PYBIND11_TYPE_CASTER(pipefill_glue::Addr, const_name("int | None"));
  bool load(handle src, bool convert) {
    if (src.is_none()) {
      value.value = 0;
      return true;
    }
    make_caster<uintptr_t> address;
    if (!address.load(src, convert)) return false;
    value.value = cast_op<uintptr_t>(address);
    return true;
  }
  static handle cast(const pipefill_glue::Addr& a, return_value_policy, handle) {
    return PyLong_FromSize_t(a.value);
  }
};
}  // namespace pybind11::detail
