// The shared-memory all-reduce's sum: plain loops the compiler vectorises for the ISA it is
// compiled for (PF_SHM_NS names the namespace; see shm_comm_kernel.h). Every element is summed
// in source order (rank 0 first) with no reassociation, so every build gives the same bits.
#include <cstring>

#include "shm_comm_kernel.h"

namespace pipefill_shm {
namespace PF_SHM_NS {

namespace {

constexpr int64_t kBlock = 512;  // elements summed per pass over the sources (2 KiB of float32)

// Its own bf16 conversions, not glue.h's: an inline function shared with the glue and compiled
// here with ISA flags could be the copy the linker keeps, and run on a CPU without that ISA.
inline float widen(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Nearest even; NaN becomes 0x7fc0, as in torch's float32 -> bfloat16 conversion.
inline uint16_t narrow(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return x != x ? (uint16_t)0x7fc0 : rounded;
}

void sum_f32(const float* const* src, int nsrc, float* dst, int64_t n) {
  float acc[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = n - b < kBlock ? n - b : kBlock;
    const float* s0 = src[0] + b;
    for (int64_t i = 0; i < m; ++i) acc[i] = s0[i];
    for (int k = 1; k < nsrc; ++k) {
      const float* s = src[k] + b;
      for (int64_t i = 0; i < m; ++i) acc[i] += s[i];
    }
    float* d = dst + b;
    for (int64_t i = 0; i < m; ++i) d[i] = acc[i];
  }
}

void sum_bf16(const uint16_t* const* src, int nsrc, uint16_t* dst, int64_t n) {
  float acc[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = n - b < kBlock ? n - b : kBlock;
    const uint16_t* s0 = src[0] + b;
    for (int64_t i = 0; i < m; ++i) acc[i] = widen(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const uint16_t* s = src[k] + b;
      for (int64_t i = 0; i < m; ++i) acc[i] += widen(s[i]);
    }
    uint16_t* d = dst + b;
    for (int64_t i = 0; i < m; ++i) d[i] = narrow(acc[i]);
  }
}

}  // namespace

void sum_into(const void* const* src, int nsrc, void* dst, int dtype, int64_t n) {
  if (dtype == kBF16)
    sum_bf16(reinterpret_cast<const uint16_t* const*>(src), nsrc, static_cast<uint16_t*>(dst), n);
  else
    sum_f32(reinterpret_cast<const float* const*>(src), nsrc, static_cast<float*>(dst), n);
}

}  // namespace PF_SHM_NS
}  // namespace pipefill_shm
