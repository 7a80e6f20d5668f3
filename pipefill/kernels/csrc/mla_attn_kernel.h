// Absorbed multi-head latent attention for decode rows (pipefill/kernels/mla_attention.py):
// one query token per sequence, every head of it at once, against the sequence's cached
// latents. A token's latent is D = kv_lora_rank + rope values laid over two cache rows of
// `half` values each (the first half in the K tensor's row, the rest in the V tensor's; an odd
// D leaves V's last value unused). The key of every head is the whole latent (D wide: the
// query was folded into the latent space by W_uk beforehand), the value its first R =
// kv_lora_rank values. So one pass over the latents serves every head: each block of tokens is
// widened to float32 once and multiplied by all heads' queries, as two small GEMMs vectorised
// over the heads (scores S[t, h] = K[t, :] . Q[:, h], then O[r, h] += C[t, r] P[t, h]).
//
// The query comes transposed, [D, Hp] (heads padded with zeros to a multiple of 16, the head
// tile every build vectorises over) and multiplied by softmax scale * log2(e), so the online
// softmax runs in exp2. The avx512bf16 build over a bf16 cache for a bf16 model (`pairs`)
// multiplies with vdpbf16ps, two latent values a lane: its query comes as bf16 pairs
// [Dp / 2, Hp, 2] (Dp = D rounded up to even), the probabilities are rounded to bf16 (as torch
// rounds them for a bf16 model) and paired over tokens; every other case widens the latents to
// float32 and keeps float32 math. A long sequence is cut into parts (their lengths depend only on the
// sequence's length: the bits do not depend on the thread count); each part leaves its running
// maximum, sum and unnormalised output, which the glue (mla_attn.cpp) merges.
//
// One source (mla_attn_isa.cpp) is compiled once per ISA into the namespaces below.
#pragma once
#include <cstdint>

namespace pipefill_mla {

constexpr int64_t kHeadTile = 16;  // heads per register tile; Hp is a multiple of it
constexpr int64_t kBlock = 32;     // tokens widened and scored together

// One part of one sequence: tokens slots[0 .. n).
struct PartArgs {
  const void* qt;        // [D, Hp] float32, the scaled query transposed (or bf16 pairs: pairs)
  const void* k;         // the layer's K rows: the row of slot s at element s * half
  const void* v;         // likewise V
  bool bf16;             // the cache holds bfloat16 (else float32)
  bool pairs;            // vdpbf16ps on bf16 pairs (the avx512bf16 build only; implies bf16)
  const int64_t* slots;  // [n] cache slots, in token order
  int64_t n, Hp, D, R, half;
  float* state;          // [(R + 2) * Hp]: running max (log2) [Hp], sum [Hp], output [R, Hp]
};

// Floats of scratch attend_part needs.
inline int64_t part_scratch_floats(int64_t D, int64_t Hp) { return kBlock * (D + 1) + (2 * kBlock + 1) * Hp; }

#define PF_MLA_DECLARE(ns) \
  namespace ns {           \
  void attend_part(const PartArgs& a, float* scratch); \
  }
PF_MLA_DECLARE(scalar)
PF_MLA_DECLARE(avx2)
PF_MLA_DECLARE(avx512)
PF_MLA_DECLARE(avx512bf16)
#undef PF_MLA_DECLARE

}  // namespace pipefill_mla
