// AMX decode GEMM: bf16 activations x bf16 weights, float32 sums in tile registers (TDPBF16PS).
// Entered only after the glue's cpuid/XCR0 check for AMX-TILE + AMX-BF16 (+ AVX-512 for the
// stores) and its ARCH_REQ_XCOMP_PERM request. The vector kernels become compute-bound from
// ~8 rows (one vdpbf16ps per row, column vector and k-pair); one TDPBF16PS multiplies 16 rows by
// a 16-pair x 16-column weight tile in ~16 cycles, so every M up to 16 streams the weights at
// the same speed as M = 1.
//
// Layout: the packed bf16 groups of decode_gemm_kernel.h, with K padded to a multiple of 32
// (kAmxK) so every k-step is one whole tile: the pairs [p, p + 16) of a 16-column slice of a
// group are 16 rows of 64 bytes, 192 bytes apart (the group's row of pairs), which is exactly a
// B tile. The glue hands in x zero-padded to whole 16-row tiles and Kp columns. Tiles: C0..C2
// the 48 sums of a group, A3 the rows, B4..B6 the weights; A and C have min(M, 16) rows (fewer
// rows multiply faster: M = 1 costs what the vector path costs).
// Sums per (row, column) run over the k-steps in order, each step one TDPBF16PS whose result for
// a row depends on that row alone: the same bits whatever M (not the same bits as the vector
// path's one-pair-at-a-time chain).
#include <immintrin.h>

#include <cstring>

#include "decode_gemm_kernel.h"
#include "decode_gemm_store512.h"

namespace pipefill_decode {
namespace amx {
namespace {

constexpr int kRows = 16;
constexpr int kPairsPerStep = kAmxK / 2;  // B tile rows
constexpr int kStepBytes = kPairsPerStep * kGroup * 4;  // weights of one k-step of a group: 3 KB

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A and C tiles of `rows` rows (fewer rows multiply faster), B tiles 16 rows; 64 bytes each.
void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t >= 4 ? kRows : rows;
  }
  _tile_loadconfig(&cfg);
}

// The 48 columns of group grp for rows [m0, m0 + rows) of x (16 padded rows, row stride Kp).
void tile(const uint16_t* x, int64_t Kp, const uint32_t* grp, const Out& o, int64_t m0,
          int64_t rows, int64_t n0) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  const int64_t steps = Kp / kAmxK;
  const uint16_t* xt = x + m0 * Kp;
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* w = grp + s * kPairsPerStep * kGroup;
    // The next step's 3 KB while this one multiplies (the tile loads stall on misses).
    const char* ahead = reinterpret_cast<const char*>(w) + kStepBytes;
    if (s + 1 < steps)
      for (int l = 0; l < kStepBytes / 64; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    _tile_loadd(3, xt + s * kAmxK, Kp * 2);
    _tile_loadd(4, w, kGroup * 4);
    _tile_loadd(5, w + 16, kGroup * 4);
    _tile_loadd(6, w + 32, kGroup * 4);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  alignas(64) float sums[kRows][kGroup];
  _tile_stored(0, &sums[0][0], kGroup * 4);
  _tile_stored(1, &sums[0][16], kGroup * 4);
  _tile_stored(2, &sums[0][32], kGroup * 4);
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < 3; ++v)
      if (n0 + 16 * v < o.N) store_row(o, m0 + r, n0 + 16 * v, _mm512_load_ps(&sums[r][16 * v]));
}

}  // namespace

void gemm_blocks(const uint16_t* x, const void* wp, int64_t M, int64_t Kp, const Out& o,
                 int64_t g0, int64_t g1) {
  configure(M < kRows ? (int)M : kRows);  // tile state is per thread: every task its own
  for (int64_t g = g0; g < g1; ++g) {
    const uint32_t* grp = static_cast<const uint32_t*>(wp) + g * (Kp / 2) * kGroup;
    for (int64_t m0 = 0; m0 < M; m0 += kRows)  // later row tiles read grp from L2
      tile(x, Kp, grp, o, m0, M - m0 < kRows ? M - m0 : kRows, g * kGroup);
  }
  _tile_release();
}

}  // namespace amx
}  // namespace pipefill_decode
