// Interface between the shared-memory all-reduce's glue (shm_comm.cpp, built without ISA flags)
// and its reduction loops (shm_comm_reduce.cpp, compiled once per ISA into its own namespace).
// Plain C++ only, so no vector code can leak into the glue through shared inline functions.
#pragma once
#include <cstdint>

namespace pipefill_shm {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;

// shm_comm_reduce.cpp is compiled three times: avx512 (F/BW/VL), avx2 (+FMA) and scalar (the
// baseline x86-64 flags, whatever the compiler vectorises with SSE2).
#define PF_SHM_DECLARE_KERNELS(NS)                                                               \
  namespace NS {                                                                                 \
  /* dst[i] = src[0][i] + src[1][i] + ... + src[nsrc-1][i], left to right, for i in [0, n).     \
     float32, or bfloat16 summed in float32 and rounded once (nearest even). dst may be one of   \
     the sources (each block is read whole before it is written). */                             \
  void sum_into(const void* const* src, int nsrc, void* dst, int dtype, int64_t n);              \
  }

PF_SHM_DECLARE_KERNELS(avx512)
PF_SHM_DECLARE_KERNELS(avx2)
PF_SHM_DECLARE_KERNELS(scalar)

}  // namespace pipefill_shm
