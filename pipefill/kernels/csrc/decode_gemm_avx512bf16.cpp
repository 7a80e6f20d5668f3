// AVX-512-BF16 decode GEMM: bf16 activations x bf16 weights, float32 sums (vdpbf16ps: per
// column acc += x[2p] * w[2p] + x[2p + 1] * w[2p + 1]). Entered only after the glue's cpuid
// check for AVX-512 F/BW/VL + AVX512_BF16. A tile is up to 8 rows x one 48-column group: 24
// accumulators in zmm registers, the 3 weight vectors of a k-pair loaded once for all 8 rows,
// each x pair broadcast once (vpbroadcastd from memory) for the 3 dot products of its row
// (the {1to16} memory-operand form measured 2x slower on Zen 4). At M = 1 the 3 column
// chains (latency 6) still outrun memory. One chain per (row, column) in pair order: the same
// bits whatever M.
// Prefetch (Zen 4, 576 x 3072 from memory, 2 threads, medians of 60 interleaved samples): at
// M = 1 the hardware prefetchers alone stream best (108 us; software prefetch 8 pairs ahead to
// L1: 121 us); at M = 8 the 24 vdpbf16ps per pair take long enough that memory idles unless
// lines are requested far ahead: 128 pairs (24 KB) ahead to L2 gives 125 us, 8 pairs to L1
// 152 us, none 171 us.
#include <immintrin.h>

#include <cstring>

#include "decode_gemm_kernel.h"
#include "decode_gemm_store512.h"

namespace pipefill_decode {
namespace avx512bf16 {
namespace {

constexpr int kRows = 8;             // 24 accumulators + 3 weights < 32 zmm
constexpr int kPrefetchPairs = 128;  // 24 KB ahead of the loads, into L2

// acc += x pair . w per column; the compiler shares one broadcast of the pair per row.
inline __m512 dot_pair(__m512 acc, __m512bh w, const uint16_t* x) {
  int bits;
  std::memcpy(&bits, x, 4);
  return _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_set1_epi32(bits));
}

template <int MR>
inline void tile(const uint16_t* x, int64_t ldx, const uint32_t* grp, int64_t K, const Out& o,
                 int64_t m0, int64_t n0) {
  __m512 acc[MR][3];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* w = grp + p * kGroup;
    if (MR > 1) {  // past a group's end: the next group, which this thread takes next
      const char* ahead = reinterpret_cast<const char*>(w + kPrefetchPairs * kGroup);
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      _mm_prefetch(ahead + 128, _MM_HINT_T1);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 16);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int r = 0; r < MR; ++r) {
      const uint16_t* xr = x + r * ldx + 2 * p;
      acc[r][0] = dot_pair(acc[r][0], w0, xr);
      acc[r][1] = dot_pair(acc[r][1], w1, xr);
      acc[r][2] = dot_pair(acc[r][2], w2, xr);
    }
  }
  for (int r = 0; r < MR; ++r)  // constant trip counts keep acc in registers
    for (int v = 0; v < 3; ++v)
      if (n0 + 16 * v < o.N) store_row(o, m0 + r, n0 + 16 * v, acc[r][v]);
}

}  // namespace

void gemm_blocks(const uint16_t* x, int64_t ldx, const void* wp, int64_t M, int64_t K,
                 const Out& o, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint32_t* grp = static_cast<const uint32_t*>(wp) + g * (K / 2) * kGroup;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {  // row tiles after the first read grp from L2
      const uint16_t* xt = x + m0 * ldx;
      switch (M - m0 >= kRows ? kRows : M - m0) {
#define PF_TILE(R) case R: tile<R>(xt, ldx, grp, K, o, m0, g * kGroup); break;
        PF_TILE(1) PF_TILE(2) PF_TILE(3) PF_TILE(4) PF_TILE(5) PF_TILE(6) PF_TILE(7) PF_TILE(8)
#undef PF_TILE
      }
    }
  }
}

}  // namespace avx512bf16
}  // namespace pipefill_decode
