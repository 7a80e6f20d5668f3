// Glue of the AMX attention kernel: CPU/permission checks, argument validation, cache packing
// (write_kv) and the work split over torch's thread pool. Importing the module and calling the
// checks is safe on any x86-64 CPU; the AMX translation unit (amx_kernel.cpp) is only entered
// after the tile permission was granted.
#define PF_GLUE_TENSORS 1
#include "glue.h"

#include <string>
#include <tuple>

#include "amx_kernel.h"

namespace {

namespace pg = pipefill_glue;
using pg::align64;
using pg::check_pages;

// cpuid: AMX-TILE, AMX-BF16, AVX512F/BW/VL/DQ, AVX512-BF16, FMA, and OS-enabled register state.
std::tuple<bool, std::string> cpu_supported() {
  const char* why = pg::need_amx_cpu(/*dq=*/true);
  return {why == nullptr, why ? why : "ok"};
}

// Requests XTILEDATA once per process (after the CPU check) and verifies it.
std::tuple<bool, std::string> amx_permission() {
  const char* why = pg::need_amx_cpu(/*dq=*/true);
  if (!why) why = pg::amx_permission();
  return {why == nullptr, why ? why : "ok"};
}

void check_cache(const torch::Tensor& c, const char* what) { pg::check_cache(c, what, /*float32_too=*/false); }

void check_tokens(const torch::Tensor& x, const char* what, int64_t heads, int64_t d) {
  pg::check_tokens(x, what, heads, d, torch::kBFloat16);
}

// Packs tokens [start, start + C) into the AMX layouts (see amx_kernel.cpp) and zeroes the
// rest of the last 32-token group (pg::for_each_kv_slot).
void write_kv(torch::Tensor kc, torch::Tensor vc, torch::Tensor k, torch::Tensor v, torch::Tensor pt,
              int64_t start) {
  const pg::KvWrite w = pg::check_kv_write(kc, vc, k, v, pt, start, /*float32_too=*/false);
  if (w.end == start) return;
  const int64_t D = w.head_dim;
  uint16_t* kd = reinterpret_cast<uint16_t*>(kc.data_ptr());
  uint16_t* vd = reinterpret_cast<uint16_t*>(vc.data_ptr());
  const uint16_t* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const int64_t kst = k.stride(0), ksh = k.stride(1), vst = v.stride(0), vsh = v.stride(1);
  pg::for_each_kv_slot(pt.data_ptr<int32_t>(), w.heads, w.page_size, D, start, w.end,
                       [&](int64_t pos, int64_t h, int64_t off, int64_t base, bool real) {
    // K: [off/16][D/32][16 pairs][16 tokens][2] -> dim pair j of this token is one uint32.
    uint32_t* kdst = reinterpret_cast<uint32_t*>(kd + base + (off / 16) * 16 * D) + (off % 16);
    const uint32_t* ksrc = reinterpret_cast<const uint32_t*>(ks + (pos - start) * kst + h * ksh);
    for (int64_t j = 0; j < D / 2; ++j) kdst[j * 16] = real ? ksrc[j] : 0u;  // j*16 = (j/16)*256+(j%16)*16
    // V: [off/32][D/16][16 token pairs][16 dims][2].
    const int64_t o32 = off % 32;
    uint16_t* vdst = vd + base + (off / 32) * 32 * D + (o32 / 2) * 32 + (o32 % 2);
    const uint16_t* vsrc = vs + (pos - start) * vst + h * vsh;
    for (int64_t d = 0; d < D; ++d) vdst[(d / 16) * 512 + (d % 16) * 2] = real ? vsrc[d] : (uint16_t)0;
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
  TORCH_CHECK(D == 64 || D == 128, "the AMX kernel takes head_dim 64 or 128, got ", D);
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
  struct Task {
    pipefill_amx::Scratch s;
    uint64_t* prof;  // this thread's row of prof, or null
  };
  auto setup = [&] {
    thread_local pg::ThreadScratch scratch;
    char* base = static_cast<char*>(scratch.get(total));
    Task t;
    t.s.q = reinterpret_cast<uint16_t*>(base);
    t.s.o = reinterpret_cast<float*>(base + q_bytes);
    t.s.m = reinterpret_cast<float*>(base + q_bytes + o_bytes);
    t.s.l = reinterpret_cast<float*>(base + q_bytes + o_bytes + ml_bytes);
    t.s.s = reinterpret_cast<float*>(base + q_bytes + o_bytes + 2 * ml_bytes);
    t.prof = prof ? reinterpret_cast<uint64_t*>(prof + 4 * at::get_thread_num()) : nullptr;
    return t;
  };
  pg::pull_items(n, setup, [&](int64_t i, const Task& t) { pipefill_amx::run_item(p, i, t.s, t.prof); });
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
