// AVX-512F decode GEMM, float32 compute, float32 or bf16 weights (bf16 -> float32 in registers:
// a 16-bit shift for the even k of a pair, a mask for the odd k). The only code here runs after
// the glue's cpuid/XCR0 check for AVX-512 F/BW/VL. Layouts and the fixed per-row order: see
// decode_gemm_kernel.h. Explicit FMAs only (no -ffast-math), so the order is what is written.
// A tile is up to 8 rows x one 48-column group: 24 accumulators in zmm registers, each weight
// vector loaded (and widened) once for all 8 rows, each x broadcast shared by 3 FMAs.
#include <immintrin.h>

#include "decode_gemm_kernel.h"
#include "decode_gemm_store512.h"

namespace pipefill_decode {
namespace avx512 {
namespace {

constexpr int kRows = 8;  // 24 accumulators + 3 weights + a broadcast < 32 zmm
constexpr int kPrefetchPairs = 8;

// The 48 weights of k = 2p + j (j = 0 even, 1 odd) of a group, as float32.
template <bool BF16>
inline void load_k(const void* grp, int64_t p, int j, __m512 w[3]) {
  if (BF16) {
    const uint32_t* src = static_cast<const uint32_t*>(grp) + p * kGroup;
    for (int v = 0; v < 3; ++v) {
      const __m512i pair = _mm512_loadu_si512(src + 16 * v);
      w[v] = _mm512_castsi512_ps(j == 0 ? _mm512_slli_epi32(pair, 16)
                                        : _mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
  } else {
    const float* src = static_cast<const float*>(grp) + (2 * p + j) * kGroup;
    for (int v = 0; v < 3; ++v) w[v] = _mm512_loadu_ps(src + 16 * v);
  }
}

template <int MR, bool BF16>
inline void step(const float* x, int64_t ldx, const void* grp, int64_t p, int j, __m512 acc[][3]) {
  __m512 w[3];
  load_k<BF16>(grp, p, j, w);
  for (int r = 0; r < MR; ++r) {
    const __m512 xv = _mm512_set1_ps(x[r * ldx + 2 * p + j]);
    for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_fmadd_ps(xv, w[v], acc[r][v]);
  }
}

template <int MR, bool BF16>
inline void tile(const float* x, int64_t ldx, const void* grp, int64_t K, const Out& o, int64_t m0,
                 int64_t n0) {
  __m512 acc[MR][3];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  const int64_t pair_bytes = (BF16 ? 4 : 8) * kGroup;
  for (int64_t p = 0; p < pairs; ++p) {
    const char* ahead = static_cast<const char*>(grp) + (p + kPrefetchPairs) * pair_bytes;
    for (int64_t off = 0; off < pair_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    step<MR, BF16>(x, ldx, grp, p, 0, acc);
    step<MR, BF16>(x, ldx, grp, p, 1, acc);
  }
  if (K & 1) step<MR, BF16>(x, ldx, grp, pairs, 0, acc);  // the last k has no partner
  for (int r = 0; r < MR; ++r)  // constant trip counts keep acc in registers (see avx2)
    for (int v = 0; v < 3; ++v)
      if (n0 + 16 * v < o.N) store_row(o, m0 + r, n0 + 16 * v, acc[r][v]);
}

template <bool BF16>
void run(const float* x, int64_t ldx, const void* wp, int64_t M, int64_t K, const Out& o, int64_t g0,
         int64_t g1) {
  const int64_t kp = K + (K & 1);
  const int64_t elem = BF16 ? 2 : 4;
  for (int64_t g = g0; g < g1; ++g) {
    const void* grp = static_cast<const char*>(wp) + g * kp * kGroup * elem;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {  // row tiles after the first read grp from L2
      const float* xt = x + m0 * ldx;
      switch (M - m0 >= kRows ? kRows : M - m0) {
#define PF_TILE(R) case R: tile<R, BF16>(xt, ldx, grp, K, o, m0, g * kGroup); break;
        PF_TILE(1) PF_TILE(2) PF_TILE(3) PF_TILE(4) PF_TILE(5) PF_TILE(6) PF_TILE(7) PF_TILE(8)
#undef PF_TILE
      }
    }
  }
}

}  // namespace

void gemm_blocks(const float* x, int64_t ldx, const void* wp, int w_dtype, int64_t M, int64_t K,
                 const Out& out, int64_t g0, int64_t g1) {
  if (w_dtype == kBF16) run<true>(x, ldx, wp, M, K, out, g0, g1);
  else run<false>(x, ldx, wp, M, K, out, g0, g1);
}

}  // namespace avx512
}  // namespace pipefill_decode
