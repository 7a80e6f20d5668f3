// Glue of the absorbed latent decode attention (mla_attn_kernel.h): the cpuid/XCR0 check of the
// ISA asked for (the vector builds' ids of glue_vector_isa.h, and kAvx512Bf16), argument
// checks, the cut of each sequence into parts, the parts over torch's threads (each with its
// own scratch) and their merge. Takes addresses and sizes (pipefill/kernels/mla_attention.py
// checks the tensors).
#include "glue.h"

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "glue_vector_isa.h"
#include "mla_attn_kernel.h"

namespace {

namespace pg = pipefill_glue;
using namespace pipefill_mla;
using pg::Addr;

constexpr int kAvx512Bf16 = 3;

const char* isa_check(int isa) { return isa == kAvx512Bf16 ? pg::need_avx512_bf16() : pg::vector_isa_check(isa); }

bool isa_ok(int isa) {
  static const bool ok[4] = {isa_check(0) == nullptr, isa_check(1) == nullptr, isa_check(2) == nullptr,
                             isa_check(kAvx512Bf16) == nullptr};
  return isa >= 0 && isa <= kAvx512Bf16 && ok[isa];
}

std::tuple<bool, std::string> isa_supported(int isa) {
  const char* why = isa_check(isa);
  return {why == nullptr, why ? why : "ok"};
}

// Tokens a part covers: at least kMinPart, and a sequence is cut into at most kMaxParts. Both
// depend on the sequence's length only, so its bits do not depend on the thread count.
constexpr int64_t kMinPart = 256, kMaxParts = 16;

struct Part {
  int64_t seq, first, count;
};

std::vector<Part> cut_parts(const int64_t* off, int64_t B) {
  std::vector<Part> parts;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = off[b + 1] - off[b];
    int64_t len = std::max(kMinPart, (n + kMaxParts - 1) / kMaxParts);
    len = (len + kBlock - 1) / kBlock * kBlock;
    for (int64_t t = 0; t < n; t += len) parts.push_back({b, t, std::min(len, n - t)});
  }
  return parts;
}

// out[b] [R, Hp] = sum over b's parts of their output weighted by 2^(max_p - max) / total.
void merge(const std::vector<Part>& parts, const std::vector<float>& states, int64_t B, int64_t Hp, int64_t R,
           float* out) {
  const int64_t per = (R + 2) * Hp;
  std::vector<int64_t> first(B + 1, (int64_t)parts.size());
  for (int64_t i = (int64_t)parts.size() - 1; i >= 0; --i) first[parts[i].seq] = i;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> top(Hp), weight(Hp);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p0 = first[b], p1 = first[b + 1];
      std::fill(top.begin(), top.end(), -INFINITY);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t h = 0; h < Hp; ++h) top[h] = std::max(top[h], states[p * per + h]);
      std::vector<float> total(Hp, 0.0f);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t h = 0; h < Hp; ++h) total[h] += states[p * per + Hp + h] * std::exp2(states[p * per + h] - top[h]);
      float* o = out + b * R * Hp;
      std::fill(o, o + R * Hp, 0.0f);
      for (int64_t p = p0; p < p1; ++p) {
        const float* st = states.data() + p * per;
        for (int64_t h = 0; h < Hp; ++h) weight[h] = std::exp2(st[h] - top[h]) / total[h];
        for (int64_t r = 0; r < R; ++r)
          for (int64_t h = 0; h < Hp; ++h) o[r * Hp + h] += st[2 * Hp + r * Hp + h] * weight[h];
      }
    }
  });
}

// For each of B query tokens b (one per sequence), all heads at once: out[b] [R, Hp] = the
// softmax-weighted sum of the first R values of the latents of slots[offsets[b] ..
// offsets[b + 1]), the weights 2^(qt[b]^T latent) (qt: [B, D, Hp] float32 scaled into log2
// units, or with `pairs` [B, Dp / 2, Hp] bf16 pairs). Returns 0, or -2 (ISA not usable here),
// -3 (bad arguments), -1 (exception).
int pf_mla_decode(int isa, Addr qt, Addr k, Addr v, bool bf16, bool pairs, Addr slots, Addr offsets, int64_t B,
                  int64_t Hp, int64_t D, int64_t R, int64_t half, Addr out) {
  if (!isa_ok(isa)) return -2;
  if (B <= 0 || Hp <= 0 || Hp % kHeadTile || R <= 0 || R > D || D > 2 * half) return -3;
  if (pairs && (isa != kAvx512Bf16 || !bf16)) return -3;
  const int64_t q_bytes = pairs ? (D + 1) / 2 * Hp * 4 : D * Hp * 4;  // one sequence's query
  const int64_t* off = offsets.as<const int64_t>();
  for (int64_t b = 0; b < B; ++b)
    if (off[b + 1] <= off[b]) return -3;  // a query sees at least its own token
  auto fn = isa == kAvx512Bf16 ? avx512bf16::attend_part
            : isa == pg::kAvx512 ? avx512::attend_part
            : isa == pg::kAvx2   ? avx2::attend_part
                                 : scalar::attend_part;
  return pg::guarded("pipefill latent decode attention", [&] {
    const std::vector<Part> parts = cut_parts(off, B);
    const int64_t per = (R + 2) * Hp;
    std::vector<float> states((size_t)(parts.size() * per));
    pg::pull_items(
        (int64_t)parts.size(),
        [&] {
          thread_local pg::ThreadScratch scratch;
          return static_cast<float*>(scratch.get(sizeof(float) * part_scratch_floats(D, Hp)));
        },
        [&](int64_t i, float* scratch) {
          const Part& p = parts[i];
          const PartArgs a{qt.as<const char>() + p.seq * q_bytes, k.as<const void>(), v.as<const void>(), bf16,
                           pairs, slots.as<const int64_t>() + off[p.seq] + p.first, p.count, Hp, D, R, half,
                           states.data() + i * per};
          fn(a, scratch);
        });
    merge(parts, states, B, Hp, R, out.as<float>());
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("pf_mla_isa_supported", &isa_supported);
  m.def("pf_mla_decode", &pf_mla_decode, py::call_guard<py::gil_scoped_release>());
}
