// Interface between the generic glue (amx_ext.cpp, built without ISA flags) and the AMX
// translation unit (amx_kernel.cpp, built with -mamx-* -mavx512*). Plain C++ only: no torch,
// no std templates, so nothing compiled with AVX-512 can leak into the glue through COMDAT
// folding of shared inline functions.
#pragma once
#include <cstdint>

namespace pipefill_amx {

// Keys per inner step (score tile = 32 rows x kStep fp32 = 16 KiB, L1-resident; two of them).
constexpr int kStep = 128;

struct Params {
  const uint16_t* q;   // bf16 [C, Hq, D], strides in elements below, last dim contiguous
  int64_t q_st, q_sh;
  uint16_t* out;       // bf16 [C, Hq, D]
  int64_t o_st, o_sh;
  const uint16_t* k;   // packed layer cache [num_pages, Hkv, page_size * D]
  const uint16_t* v;
  const int32_t* page_table;
  int64_t page_size, num_kv_heads, head_dim, group;  // group = Hq / Hkv
  int64_t C, L;        // queries at positions [L, L + C)
  int64_t qtile;       // query tokens per work item
  float scale;
  int step;            // keys per step: 64 or 128 (0 = kStep)
  int mode;            // benchmarks only: 1 = skip QK^T, 2 = skip softmax, 4 = skip PV,
                       // 8 = no AMX/AVX interleaving (phases one after the other),
                       // 16 = QK^T reloads Q per chunk (D = 64 keeps Q in tiles otherwise),
                       // 32 = no software prefetch of the next key step
};

struct Scratch {
  uint16_t* q;  // [rows_pad, D] bf16 staged queries (token-major rows: row = t * G + h)
  float* o;     // [rows_pad, D] fp32 accumulator
  float* m;     // [rows_pad] running max (log2 domain, already scaled)
  float* l;     // [rows_pad] running sum
  float* s;     // [2][32, kStep] fp32 scores; bf16 probabilities overwrite them in place
};

// Rows of one work item padded to the 32-row block.
inline int64_t rows_pad(int64_t qtile, int64_t group) { return (qtile * group + 31) / 32 * 32; }

// Number of work items: one per (kv head, q-tile).
inline int64_t num_items(const Params& p) {
  return p.num_kv_heads * ((p.C + p.qtile - 1) / p.qtile);
}

// Runs one work item (longest first as item grows); loads the tile config at the start and
// releases the tiles at the end. prof, when not null, accumulates rdtsc cycles:
// [0] QK^T, [1] softmax, [2] PV, [3] whole item, and forces the non-interleaved schedule.
void run_item(const Params& p, int64_t item, const Scratch& s, uint64_t* prof);

}  // namespace pipefill_amx
