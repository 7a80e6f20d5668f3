// What the integer path's two kernels on the 16-row layout share (quant_int8_rows16.h on
// AVX-512 VNNI, quant_int8_rows16_avx2.h on AVX2): the call's quantized activations as both
// read them. Plain C++ only.
//
// Activations: per unit of 32 and row, a record (Rows16Acts) of the natural int8 codes and
// scale dx of int8_quantize and `extra`: -zero * sum(q) (int32; the types with a zero point:
// Q4_0's 8, Q5_0's 16, Q8_0's 128 where its codes are flipped to unsigned (VNNI), Q6_K's 32,
// one per 16 weights, its scales' span) or dx * sum(q) (float32; the offsets: Q4_1's m, the K
// types' mins).
#pragma once
#include <cstdint>
#include <cstring>

#include "quant_int8_kernel.h"

namespace pipefill_quant {
namespace {

constexpr int kRows16 = 16;

// The call's quantized activations as the kernels read them: one 48-byte record per unit
// and row, unit-major and row-minor (record (u, m) at rec + (u M + m) 48): the row's 32 natural
// codes, dx, then `extra` (see above: one word, Q6_K two). A tile finds its rows' records at
// constant offsets from one pointer (the broadcasts then need no per-row address arithmetic).
constexpr int kRows16Rec = 48, kRows16Dx = 32, kRows16Extra = 36;
struct Rows16Acts {
  const uint8_t* rec;
  int64_t M;
};

// The zero point each type's unsigned codes hold in a kernel, or 0. Q8_0: its codes + 128
// where the kernel flips them to unsigned (VNNI's vpdpbusd), 0 where it keeps them signed
// (AVX2: vpmaddubsw's int16 pairs would saturate on codes up to 255).
constexpr int rows16_zero(int qtype, bool signed_q8) {
  return qtype == kQ4_0 ? 8 : qtype == kQ5_0 ? 16 : qtype == kQ8_0 ? (signed_q8 ? 0 : 128) : qtype == kQ6_K ? 32 : 0;
}

// Whether a type's `extra` is the zero point's int32 term (else the offsets' float32 one).
constexpr bool rows16_int_extra(int qtype) { return qtype == kQ4_0 || qtype == kQ5_0 || qtype == kQ8_0 || qtype == kQ6_K; }

// The records (Rows16Acts) of M rows of `units` units from the natural codes q and scales dx:
// extra = -zero * sum(q) (int32) where the type has a zero point, else dx * sum(q) (float32).
inline void fill_rows16_records(int qtype, bool signed_q8, const int8_t* q, int64_t ldq, const float* dx, int64_t ldd,
                                int64_t M, int64_t units, uint8_t* rec) {
  const int zero = rows16_zero(qtype, signed_q8), per = rows16_extra_words(qtype), span = kUnit / per;
  const bool int_extra = rows16_int_extra(qtype);
  for (int64_t u = 0; u < units; ++u)
    for (int64_t m = 0; m < M; ++m) {
      uint8_t* out = rec + (u * M + m) * kRows16Rec;
      const int8_t* x = q + m * ldq + kUnit * u;
      std::memcpy(out, x, kUnit);
      std::memcpy(out + kRows16Dx, &dx[m * ldd + u], 4);
      for (int i = 0; i < per; ++i) {
        int32_t sum = 0;
        for (int k = 0; k < span; ++k) sum += x[span * i + k];
        const int32_t zi = -zero * sum;
        const float sl = dx[m * ldd + u] * (float)sum;
        std::memcpy(out + kRows16Extra + 4 * i, int_extra ? static_cast<const void*>(&zi) : static_cast<const void*>(&sl),
                    4);
      }
    }
}

}  // namespace
}  // namespace pipefill_quant
