// Glue of the int8 KV decode attention (kv_quant_attn_kernel.h): the cpuid/XCR0 check of the
// ISA asked for, argument checks, and the split of KV heads over torch's thread pool (each
// task with its own scratch). Takes addresses and sizes (pipefill/kernels/kv_quant_attention.py
// checks the tensors).
#include "glue.h"

#include <vector>

#include "glue_vector_isa.h"
#include "kv_quant_attn_kernel.h"

namespace {

namespace pg = pipefill_glue;
using namespace pipefill_qattn;
using pg::Addr;

// out[Hq, D] = softmax(q K^T * scale) V for one query token over the n cached tokens `slots`.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_qa_decode(int isa, Addr q, Addr k, Addr v, Addr slots, int64_t n, int64_t Hq, int64_t H,
                 int64_t D, int64_t row_bytes, double scale, Addr out) {
  if (!pg::vector_isa_ok(isa)) return -2;
  if (n <= 0 || H <= 0 || Hq % H != 0 || D <= 0 || D % 4 != 0 || row_bytes != D + 4) return -3;
  const DecodeArgs a{q.as<const float>(), k.as<const int8_t>(), v.as<const int8_t>(),
                     slots.as<const int64_t>(), n, Hq, H, D, row_bytes, (float)scale,
                     out.as<float>()};
  auto fn = isa == pg::kAvx512 ? avx512::decode_heads : isa == pg::kAvx2 ? avx2::decode_heads
                                                                         : scalar::decode_heads;
  return pg::guarded("pipefill int8 KV decode attention", [&] {
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      thread_local std::vector<float> scratch;
      scratch.resize((size_t)scratch_floats(a));
      fn(a, h0, h1, scratch.data());
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("pf_qa_isa_supported", &pg::vector_isa_supported);
  m.def("pf_qa_decode", &pf_qa_decode, py::call_guard<py::gil_scoped_release>());
}
