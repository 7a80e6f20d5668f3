// Glue of the int8 KV decode attention (kv_quant_attn_kernel.h): the cpuid/XCR0 check of the
// ISA asked for, argument checks, and the split of (sequence, KV head) pairs over torch's
// thread pool (each task with its own scratch). Takes addresses and sizes
// (pipefill/kernels/kv_quant_attention.py checks the tensors).
#include "glue.h"

#include <vector>

#include "glue_vector_isa.h"
#include "kv_quant_attn_kernel.h"

namespace {

namespace pg = pipefill_glue;
using namespace pipefill_qattn;
using pg::Addr;

// For each of B query tokens b (one per sequence): out[b] [Hq, D] = softmax(q[b] K^T * scale) V
// over the cached tokens slots[offsets[b] .. offsets[b + 1]). The (sequence, KV head) pairs are
// split over torch's threads, each task with its own scratch.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_qa_decode(int isa, Addr q, Addr k, Addr v, Addr slots, Addr offsets, int64_t B, int64_t Hq,
                 int64_t H, int64_t D, int64_t row_bytes, double scale, Addr out) {
  if (!pg::vector_isa_ok(isa)) return -2;
  if (B <= 0 || H <= 0 || Hq % H != 0 || D <= 0 || D % 4 != 0 || row_bytes != D + 4) return -3;
  const int64_t* off = offsets.as<const int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (off[b + 1] <= off[b]) return -3;  // a query sees at least its own token
    longest = std::max(longest, off[b + 1] - off[b]);
  }
  auto fn = isa == pg::kAvx512 ? avx512::decode_heads : isa == pg::kAvx2 ? avx2::decode_heads
                                                                         : scalar::decode_heads;
  return pg::guarded("pipefill int8 KV decode attention", [&] {
    at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
      thread_local std::vector<float> scratch;
      scratch.resize((size_t)((Hq / H) * (longest + D)));  // scratch_floats of the longest
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / H, h = t % H;
        const DecodeArgs a{q.as<const float>() + b * Hq * D, k.as<const int8_t>(), v.as<const int8_t>(),
                           slots.as<const int64_t>() + off[b], off[b + 1] - off[b], Hq, H, D, row_bytes,
                           (float)scale, out.as<float>() + b * Hq * D};
        fn(a, h, h + 1, scratch.data());
      }
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("pf_qa_isa_supported", &pg::vector_isa_supported);
  m.def("pf_qa_decode", &pf_qa_decode, py::call_guard<py::gil_scoped_release>());
}
