// AVX2 + FMA decode GEMM, float32 compute, float32 or bf16 weights (bf16 -> float32 in
// registers: a 16-bit shift for the even k of a pair, a mask for the odd k). Entered only after
// the glue's cpuid/XCR0 check for AVX2 and FMA. 16 ymm registers: a tile is at most 12
// accumulators (bf16 weights: 5 rows x 16 columns, 4 x 16, 3 x 24, 2 x 24 or 1 x 48; float32:
// 4 x 24 to 1 x 48, see tile_cols) with room for the weights and a broadcast: when a tile needs
// more than 16, GCC spills an accumulator to the stack (an FMA chain through memory: half
// speed). The row tiles and column passes after the first read a K chunk of the group from L1.
// One FMA chain per (row, column) in k order: the same bits as the AVX-512 path, whatever M and
// whichever tile a row falls in.
#include <immintrin.h>

#include <vector>

#include "decode_gemm_kernel.h"

namespace pipefill_decode {
namespace avx2 {
namespace {

constexpr int64_t kChunkBytes = 16384;  // weights per K chunk: L1-resident while every pass runs
constexpr int64_t kChunkLines = kChunkBytes / 64;
constexpr int kPrefetchPairs = 8;  // M = 1 (one pass per chunk): this far ahead into L1

// Which pass over a K chunk a tile is (passes = 0: no software prefetch).
struct Fetch {
  int pass, passes;
};

inline uint16_t to_bf16(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  if (f != f) return 0x7fc0;
  return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

inline void store8(const Out& o, int64_t m, int64_t n0, __m256 acc) {
  float v[8];
  _mm256_storeu_ps(v, acc);
  const int64_t n = o.N - n0 < 8 ? o.N - n0 : 8;
  if (o.bias)
    for (int64_t j = 0; j < n; ++j) v[j] += o.bias[n0 + j];
  if (o.y_dtype == kF32) {
    float* y = static_cast<float*>(o.y) + m * o.ldy + n0;
    for (int64_t j = 0; j < n; ++j) y[j] = v[j];
  } else {
    uint16_t* y = static_cast<uint16_t*>(o.y) + m * o.ldy + n0;
    for (int64_t j = 0; j < n; ++j) y[j] = to_bf16(v[j]);
  }
}

// Weights of k = 2p + J (J = 0 even, 1 odd) for the 8 columns from c of a group, as float32.
// bf16: one integer op on the 32-bit pairs, as on AVX-512 (a shift for the even k, an AND for
// the odd k: one uop, where the old two shifts took two); each k loads the pair from L1 again,
// so no pair register stays live.
template <int J, bool BF16>
inline __m256 load_k(const void* grp, int64_t p, int c) {
  if (BF16) {
    const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint32_t*>(grp) + p * kGroup + c));
    const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    return _mm256_castsi256_ps(J == 0 ? _mm256_slli_epi32(pair, 16)
                                      : _mm256_and_si256(pair, odd_mask));
  }
  return _mm256_loadu_ps(static_cast<const float*>(grp) + (2 * p + J) * kGroup + c);
}

// k = 2p + J for the tile. The order of the loads decides how many registers are live (GCC keeps
// it: no scheduling before register allocation on x86): NV weights then one broadcast at a time,
// or for bf16 tiles with fewer rows than weight vectors MR broadcasts then one weight at a time.
// (float32 keeps the first order everywhere: with the second in its 1 x 48 and 2 x 24 tiles,
// GCC spilled in its 3 x 24 and 4 x 24 tiles.)
template <int J, int MR, int NV, bool BF16>
inline void k_step(const float* x, int64_t ldx, const void* grp, int64_t p, int c0,
                   __m256 acc[][NV]) {
  if (NV <= MR || !BF16) {
    __m256 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load_k<J, BF16>(grp, p, c0 + 8 * v);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + 2 * p + J);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(xv, w[v], acc[r][v]);
    }
  } else {
    __m256 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_broadcast_ss(x + r * ldx + 2 * p + J);
    for (int v = 0; v < NV; ++v) {
      const __m256 w = load_k<J, BF16>(grp, p, c0 + 8 * v);
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_fmadd_ps(xv[r], w, acc[r][v]);
    }
  }
}

template <int MR, int NV, bool BF16>
inline void pair_step(const float* x, int64_t ldx, const void* grp, int64_t p, int c0,
                      __m256 acc[][NV]) {
  k_step<0, MR, NV, BF16>(x, ldx, grp, p, c0, acc);
  k_step<1, MR, NV, BF16>(x, ldx, grp, p, c0, acc);
}

// Rows [m0, m0 + MR) x columns [n0 + c0, n0 + c0 + 8 NV) of one group, k-pairs [p0, p1).
// Between K chunks the sums wait in part[r * kGroup + column] (stored and reloaded exactly, so
// the per-column chain is the same as without chunks); the last chunk adds the bias and stores.
template <int MR, int NV, bool BF16>
inline void tile(const float* x, int64_t ldx, const void* grp, int64_t K, const Out& o, int64_t m0,
                 int64_t n0, int c0, int64_t p0, int64_t p1, float* part, Fetch fetch) {
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      acc[r][v] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + r * kGroup + c0 + 8 * v);
  const int64_t pairs = K / 2;
  const int64_t pair_bytes = (BF16 ? 4 : 8) * kGroup;
  // Every pass over a chunk asks for its share of the next chunk's lines (the same group's next
  // K chunk, or the next group's first: this thread's next work) into L2, spread over its
  // pairs, so memory streams the whole time the chunk's passes compute from L1 and L2.
  const char* next = static_cast<const char*>(grp) + p1 * pair_bytes;
  const int64_t lo = fetch.passes ? kChunkLines * fetch.pass / fetch.passes : 0;
  const int64_t hi = fetch.passes ? kChunkLines * (fetch.pass + 1) / fetch.passes : 0;
  const int64_t n = p1 - p0;
  for (int64_t p = p0; p < p1; ++p) {
    if (fetch.passes) {
      const int64_t i = p - p0;
      for (int64_t l = lo + (hi - lo) * i / n; l < lo + (hi - lo) * (i + 1) / n; ++l)
        _mm_prefetch(next + 64 * l, _MM_HINT_T1);
    } else {  // one pass: a few pairs ahead into L1
      const char* ahead = static_cast<const char*>(grp) + (p + kPrefetchPairs) * pair_bytes;
      for (int64_t off = 0; off < pair_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    }
    pair_step<MR, NV, BF16>(x, ldx, grp, p, c0, acc);
  }
  // Constant trip counts (a test inside, not in the loop condition): the accumulators then
  // stay registers instead of an array GCC spills on every k.
  if (p1 < pairs) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(part + r * kGroup + c0 + 8 * v, acc[r][v]);
    return;
  }
  if (K & 1) k_step<0, MR, NV, BF16>(x, ldx, grp, pairs, c0, acc);  // no partner for the last k
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      if (n0 + c0 + 8 * v < o.N) store8(o, m0 + r, n0 + c0 + 8 * v, acc[r][v]);
}

// Columns per tile of MR rows: MR x NV accumulators (NV = columns / 8) + the weights or
// broadcasts held + 1 (+ the odd-k mask for bf16) <= 16 registers, and >= 8 independent chains
// where the rows allow (2 FMA pipes x 4 cycles of latency on Zen 3/4). float32 weights: up to
// 4 x 24 (16 registers; as before this change, ~100 GFLOP/s at M = 16 already). bf16: the mask
// makes 4 x 24 17 registers and 6 x 16 16, and GCC spilled an accumulator in both (0.75x and 0.7x
// of 4 x 16 and 5 x 16). GCC's allocation is fragile here: a 5 x 16 tile next to 4 x 24 in the
// float32 function made it spill in every float32 tile; check the inner loops for %rsp after a
// change.
template <bool BF16>
constexpr int tile_cols(int mr) {
  return mr == 1 ? 48 : BF16 && mr >= 4 ? 16 : 24;
}

// The next row tile's height for `left` rows still to do. bf16: tiles of 5, and the last 6 or 7
// rows as 3 + 3 or 4 + 3 rather than leaving a tile of 1 or 2 rows (few chains, one more pass).
template <bool BF16>
inline int tile_rows(int64_t left) {
  if (!BF16) return (int)(left < 4 ? left : 4);
  return (int)(left <= 5 ? left : left == 6 ? 3 : left == 7 ? 4 : 5);
}

template <int MR, bool BF16>
inline void rows(const float* x, int64_t ldx, const void* grp, int64_t K, const Out& o, int64_t m0,
                 int64_t n0, int64_t p0, int64_t p1, float* part, Fetch& fetch) {
  constexpr int NV = tile_cols<BF16>(MR) / 8;
  for (int c0 = 0; c0 < kGroup && n0 + c0 < o.N; c0 += 8 * NV, ++fetch.pass)
    tile<MR, NV, BF16>(x, ldx, grp, K, o, m0, n0, c0, p0, p1, part, fetch);
}

// Tile passes over each K chunk for M rows (row tiles x column passes), or 0 where there is one
// (M = 1: the pass prefetches a few pairs ahead into L1 instead).
template <bool BF16>
int chunk_passes(int64_t M) {
  int passes = 0;
  for (int64_t m0 = 0; m0 < M;) {
    const int mr = tile_rows<BF16>(M - m0);
    passes += kGroup / tile_cols<BF16>(mr);
    m0 += mr;
  }
  return passes > 1 ? passes : 0;
}

// Per group, K in chunks of ~16 KB of weights: every row tile and column pass runs over a chunk
// while it is in L1 (a whole group, 110 KB of float32 at K = 576, is not).
template <bool BF16>
void run(const float* x, int64_t ldx, const void* wp, int64_t M, int64_t K, const Out& o, int64_t g0,
         int64_t g1) {
  const int64_t kp = K + (K & 1);
  const int64_t elem = BF16 ? 2 : 4;
  const int64_t pairs = K / 2;
  const int64_t chunk = kChunkBytes / ((BF16 ? 4 : 8) * kGroup);
  const int passes = chunk_passes<BF16>(M);
  std::vector<float> part((size_t)(M * kGroup));
  for (int64_t g = g0; g < g1; ++g) {
    const void* grp = static_cast<const char*>(wp) + g * kp * kGroup * elem;
    int64_t p0 = 0;
    do {
      const int64_t p1 = pairs - p0 > chunk ? p0 + chunk : pairs;
      Fetch fetch{0, passes};
      for (int64_t m0 = 0; m0 < M;) {
        const int mr = tile_rows<BF16>(M - m0);
        const float* xt = x + m0 * ldx;
        float* pt = part.data() + m0 * kGroup;
        const int64_t n0 = g * kGroup;
        switch (mr) {
#define PF_ROWS(R) case R: rows<R, BF16>(xt, ldx, grp, K, o, m0, n0, p0, p1, pt, fetch); break;
          PF_ROWS(1) PF_ROWS(2) PF_ROWS(3) PF_ROWS(4)
          case 5: if (BF16) rows<5, BF16>(xt, ldx, grp, K, o, m0, n0, p0, p1, pt, fetch); break;
#undef PF_ROWS
        }
        m0 += mr;
      }
      p0 = p1;
    } while (p0 < pairs);
  }
}

}  // namespace

void gemm_blocks(const float* x, int64_t ldx, const void* wp, int w_dtype, int64_t M, int64_t K,
                 const Out& out, int64_t g0, int64_t g1) {
  if (w_dtype == kBF16) run<true>(x, ldx, wp, M, K, out, g0, g1);
  else run<false>(x, ldx, wp, M, K, out, g0, g1);
}

}  // namespace avx2
}  // namespace pipefill_decode
