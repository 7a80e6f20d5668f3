// The three builds of glue files whose kernels come as scalar, AVX2 and AVX-512 translation
// units (quant_gemm.cpp, shm_comm.cpp): the ids the Python side passes, and what cpuid/XCR0 say
// of each. Included after glue.h.
#pragma once
#include <string>
#include <tuple>

#include "glue.h"

namespace pipefill_glue {

enum VectorIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// nullptr when this CPU (and its OS) runs the build `isa`, else the first thing missing.
inline const char* vector_isa_check(int isa) {
  switch (isa) {
    case kScalar: return nullptr;
    case kAvx2: return need_avx2_fma();
    case kAvx512: return need_avx512();
    default: return "unknown ISA";
  }
}

// vector_isa_check == nullptr, read once per process (for every call's entry check).
inline bool vector_isa_ok(int isa) {
  static const bool ok[3] = {vector_isa_check(kScalar) == nullptr, vector_isa_check(kAvx2) == nullptr,
                             vector_isa_check(kAvx512) == nullptr};
  return isa >= kScalar && isa <= kAvx512 && ok[isa];
}

// (True, "ok") or (False, why): what the Python side's isa_status reads.
inline std::tuple<bool, std::string> vector_isa_supported(int isa) {
  const char* why = vector_isa_check(isa);
  return {why == nullptr, why ? why : "ok"};
}

}  // namespace pipefill_glue
