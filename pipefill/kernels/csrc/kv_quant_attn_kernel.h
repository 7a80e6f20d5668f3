// Decode attention over an int8 KV cache (pipefill/kernels/kv_quant_attention.py): one query
// token per sequence against its cached tokens, read as they are stored: per (token, KV head)
// a row of head_dim int8 codes followed by its float32 scale (pipefill/kernels/kv_quant.py).
// The scale multiplies a whole row, so it is applied once per dot product (keys) and folded into
// the softmax weight (values): the codes are widened to float32 in registers and never written
// back dequantized.
//
// One source (kv_quant_attn_isa.cpp) is compiled three times, with only its own -m flags, into
// the namespaces below; the glue (kv_quant_attn.cpp) calls one after its cpuid check.
#pragma once
#include <cstdint>

namespace pipefill_qattn {

// The work of one call, shared by every ISA.
struct DecodeArgs {
  const float* q;        // [Hq, D] the query token (float32)
  const int8_t* k;       // the layer's K rows: row (slot, h) at k + (slot * H + h) * row_bytes
  const int8_t* v;       // likewise V
  const int64_t* slots;  // [n] the cache slot of each token the query sees, in order
  int64_t n, Hq, H, D, row_bytes;
  float scale;           // softmax scale (1 / sqrt(D) or the family's)
  float* out;            // [Hq, D] float32
};

#define PF_QATTN_DECLARE(ns) \
  namespace ns {             \
  void decode_heads(const DecodeArgs& a, int64_t h0, int64_t h1, float* scratch); \
  }
PF_QATTN_DECLARE(scalar)
PF_QATTN_DECLARE(avx2)
PF_QATTN_DECLARE(avx512)
#undef PF_QATTN_DECLARE

// Floats of scratch decode_heads needs per KV head it runs: the group's scores and sums.
inline int64_t scratch_floats(const DecodeArgs& a) {
  const int64_t group = a.Hq / a.H;
  return group * (a.n + a.D);
}

}  // namespace pipefill_qattn
