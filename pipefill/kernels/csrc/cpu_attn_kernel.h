// Interface between the generic glue (cpu_attn_ext.cpp, built without ISA flags) and the vector
// attention kernels (cpu_attn_kernel.cpp, compiled once per ISA into its own namespace with its
// own -m flags: avx512bf16, avx512, avx2). Plain C++ only, so no vector code can leak into the
// glue through COMDAT folding of shared inline functions.
//
// A quantized cache (int8 or fp8_e4m3, pipefill/kernels/kv_quant.py) is instead the token-major
// KVCache layer [num_pages * page_size, Hkv, D + 4]: per (token, kv head) D one-byte codes and
// the row's float32 scale. Each step's codes are widened (exactly, to bf16 for bf16 q, else
// float32) into per-thread scratch in the packed layout below, which the same inner loops then
// read; the row scales are folded in where it costs one multiply per key, not per value: each
// score is multiplied by its key's scale and each probability by its value's scale. Decode of
// one query token (int8 with bf16 q; on AVX-512 any) reads the rows in registers instead
// (QuantDecode in cpu_attn_kernel.cpp), using Scratch::o, s and p only.
//
// Cache layout: the AMX kernel's packed paged layout (see amx_kernel.cpp), per (page, kv head):
//   K: [page_size/16][D/32][16 dim pairs][16 tokens][2]
//   V: [page_size/32][D/16][16 token pairs][16 dims][2]
// bf16 caches are byte-identical to the AMX ones. float32 caches keep the same order of 32-value
// rows but store each row's pair axis first ([2][16] instead of [16][2]), so a row loads as two
// vectors (even, odd) with no shuffles, exactly like the bf16 row after a shift and a mask.
#pragma once
#include <cstdint>

namespace pipefill_cpu_attn {

constexpr int kStep = 64;  // keys per step: one step's K+V (bf16, D = 64) is 16 KiB, L1-resident

struct Params {
  const void* q;  // [C, Hq, D] float32 or bf16 (q_bf16), last dim contiguous
  int64_t q_st, q_sh;
  void* out;      // [C, Hq, D], same dtype as q
  int64_t o_st, o_sh;
  const void* k;  // packed layer cache [num_pages, Hkv, page_size * D]
  const void* v;
  const int32_t* page_table;
  int64_t page_size, num_kv_heads, head_dim, group;  // group = Hq / Hkv; the largest with q_first
  // Unequal groups (a TP rank holding part of a KV head's query heads, ARCHITECTURE.md 'Tensor
  // parallelism inside a stage'): kv head g serves query heads [q_first[g], q_first[g + 1]);
  // null: equal groups, kv head g serves [g * group, (g + 1) * group).
  const int32_t* q_first;
  int64_t C, L;   // queries at positions [L, L + C)
  int64_t qtile;  // query tokens per work item
  // Split KV (flash-decoding, one q-tile only): keys [i * kv_part, (i + 1) * kv_part) are part i
  // of nparts (1 = no split); part results go to partial [Hkv, nparts, C * group, D + 2] (a
  // smaller group's rows first, the rest unused)
  // (unnormalised O, max in the log2 domain, sum), merged by the glue in part order.
  int64_t kv_part, nparts;
  float* partial;
  // Sliding window (ARCHITECTURE.md, 'Window pages'): the query at position pos sees keys
  // (pos - window, pos]; 0: the whole prefix. Split parts count from kv_begin (window_group of
  // the first query), so a long context's parts cover only the keys some query sees.
  int64_t window, kv_begin;
  float scale;
  bool q_bf16, kv_bf16;  // kv_bf16: the packed values the inner loops read (scratch if quantized)
  int kv_quant;          // 0: packed bf16/float32 cache; 1: int8 rows; 2: fp8_e4m3 rows
};

enum KvQuant { kPacked = 0, kInt8 = 1, kFp8 = 2 };

struct Scratch {
  void* q;    // [rows_pad, D] staged queries: float32, or bf16 for the avx512bf16 kernel
  float* o;   // [rows_pad, D] accumulator
  float* m;   // [rows_pad] running max (log2 domain, scaled)
  float* l;   // [rows_pad, kLanes] running sums, one vector per row (reduced in the epilogue)
  float* s;   // [kMaxRows, kStep] scores, probabilities in place
  uint16_t* p;  // [kMaxRows, kStep] bf16 probabilities (avx512bf16)
  void* kq;     // quantized cache only: one step's widened K, then V, packed ([kStep, D] each,
  void* vq;     // bf16 or float32 as kv_bf16 says), the codes' values without their row scales:
  float* ks;    // [kStep] the step's K row scales, applied to the scores,
  float* vs;    // [kStep] and V row scales, applied to the probabilities
};

constexpr int kMaxHeadDim = 256;  // head dims 64, 128 and 256
constexpr int kMaxRows = 8;  // rows per register block (avx512: 8, avx2: 6; decode: 4)
constexpr int kLanes = 16;   // floats per row of Scratch::l (the widest vector)

// Scratch rows: a multiple of every block height (4, 6, 8), so whole blocks always fit.
inline int64_t rows_pad(int64_t qtile, int64_t group) { return (qtile * group + 23) / 24 * 24; }

inline int64_t group_of(const Params& p, int64_t g) { return p.q_first ? p.q_first[g + 1] - p.q_first[g] : p.group; }
inline int64_t first_q_head(const Params& p, int64_t g) { return p.q_first ? p.q_first[g] : g * p.group; }

// The first key the query at position pos sees under a window (0: none).
inline int64_t first_key(int64_t window, int64_t pos) { return window && pos >= window ? pos - window + 1 : 0; }
inline int64_t first_key(const Params& p, int64_t pos) { return first_key(p.window, pos); }
// first_key rounded down to its 32-token group, where the packed loops start: the group lies
// in the first key's page, which a window table still holds (freed pages are never read).
inline int64_t window_group(int64_t window, int64_t pos) { return first_key(window, pos) / 32 * 32; }

inline int64_t num_items(const Params& p) { return p.num_kv_heads * ((p.C + p.qtile - 1) / p.qtile) * p.nparts; }

// An item's KV part, and its (q-tile, kv head) index (kv head = index % num_kv_heads). Split KV
// items go part-major, every kv head of part 0 first: a quantized cache's rows of the heads
// interleave (token-major), so the lines one head's item reads stay in L2 for the next head's.
inline int64_t item_part(const Params& p, int64_t item) { return p.nparts > 1 ? item / p.num_kv_heads : 0; }
inline int64_t item_tile_head(const Params& p, int64_t item) { return p.nparts > 1 ? item % p.num_kv_heads : item; }

// An item's q-tile: its first token t0 and token count nt (the longest, last, q-tiles first).
inline void item_tile(const Params& p, int64_t item, int64_t& t0, int64_t& nt) {
  const int64_t ntiles = (p.C + p.qtile - 1) / p.qtile;
  t0 = (ntiles - 1 - item_tile_head(p, item) / p.num_kv_heads) * p.qtile;
  nt = p.C - t0 < p.qtile ? p.C - t0 : p.qtile;
}

// The keys [lo, hi) an item reads: its split part, else from its tile's window on.
inline void item_keys(const Params& p, int64_t item, int64_t& lo, int64_t& hi) {
  int64_t t0, nt;
  item_tile(p, item, t0, nt);
  const int64_t kend = p.L + t0 + nt;  // one past the tile's last query position
  lo = p.nparts > 1 ? p.kv_begin + item_part(p, item) * p.kv_part : window_group(p.window, p.L + t0);
  hi = p.nparts > 1 && lo + p.kv_part < kend ? lo + p.kv_part : kend;
}

// Element offset of token `tok`'s row of kv head g in a packed paged cache (the layout above).
inline int64_t packed_token_offset(const Params& p, int64_t g, int64_t tok) {
  const int64_t ps = p.page_size;
  return (((int64_t)p.page_table[tok / ps] * p.num_kv_heads + g) * ps + tok % ps) * p.head_dim;
}

// The K and V runs of 32 tokens of an item's first step in a packed cache (K run 0, 1; V run 0,
// 1; null past the item's keys, all null for a quantized cache), which a decode thread
// prefetches during the item before it (ARCHITECTURE.md, the decode step's attention).
inline void first_step_runs(const Params& p, int64_t item, const char* run[4]) {
  for (int j = 0; j < 4; ++j) run[j] = nullptr;
  if (p.kv_quant != kPacked) return;
  int64_t lo, hi;
  item_keys(p, item, lo, hi);
  const int64_t esz = p.kv_bf16 ? 2 : 4, g = item_tile_head(p, item) % p.num_kv_heads;
  for (int j = 0; j < 2 && lo + 32 * j < hi; ++j) {
    const int64_t off = packed_token_offset(p, g, lo + 32 * j) * esz;
    run[j] = static_cast<const char*>(p.k) + off;
    run[2 + j] = static_cast<const char*>(p.v) + off;
  }
}

// run_item(p, item, s, after): after (null: none) is first_step_runs of the item this thread
// runs next, prefetched to L2 during this item's last step.
#define PF_ATTN_DECLARE(NS) \
  namespace NS {            \
  void run_item(const Params& p, int64_t item, const Scratch& s, const char* const* after); \
  }

PF_ATTN_DECLARE(avx512bf16)
PF_ATTN_DECLARE(avx512)
PF_ATTN_DECLARE(avx2)

}  // namespace pipefill_cpu_attn
