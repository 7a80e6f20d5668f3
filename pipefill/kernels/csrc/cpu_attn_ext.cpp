// Glue of the vector attention kernels (cpu_attn_kernel.cpp): cpuid checks per ISA, argument
// validation, cache packing (write_kv, bf16 or float32; a decode step's rows quantized into an
// int8/fp8 cache) and the work split over torch's thread pool. An ISA's kernel is entered only after its cpuid/XCR0 check passed in this process, so a
// CPU never executes an instruction it lacks.
#define PF_GLUE_TENSORS 1
#include "glue.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_attn_kernel.h"

namespace {

namespace pa = pipefill_cpu_attn;
namespace pg = pipefill_glue;
using pg::check_pages;
using pg::check_tokens;

// ISA ids: 0 = avx512bf16, 1 = avx512, 2 = avx2.
const char* isa_check(int64_t isa) {
  switch (isa) {
    case 0: return pg::need_avx512_bf16(/*dq=*/true);
    case 1: return pg::need_avx512(/*dq=*/true);
    case 2: return pg::need_avx2_fma();
    default: return "unknown ISA id";
  }
}

std::tuple<bool, std::string> cpu_supported(int64_t isa) {
  const char* why = isa_check(isa);
  return {why == nullptr, why ? why : "ok"};
}

bool isa_ok(int64_t isa) { return isa_check(isa) == nullptr; }

void check_cache(const torch::Tensor& c, const char* what) { pg::check_cache(c, what, /*float32_too=*/true); }

// Element index of (token offset in page `off`, dim d) inside one (page, head) block of ps * D.
// bf16: the AMX layout; float32: same 32-value rows, pair axis first within a row.
inline int64_t k_index(int64_t off, int64_t d, int64_t D, bool bf16) {
  const int64_t row = (off / 16) * 16 * D + (d / 32) * 512 + ((d % 32) / 2) * 32;
  return row + (bf16 ? (off % 16) * 2 + d % 2 : (d % 2) * 16 + off % 16);
}
inline int64_t v_index(int64_t off, int64_t d, int64_t D, bool bf16) {
  const int64_t o32 = off % 32;
  const int64_t row = (off / 32) * 32 * D + (d / 16) * 512 + (o32 / 2) * 32;
  return row + (bf16 ? (d % 16) * 2 + o32 % 2 : (o32 % 2) * 16 + d % 16);
}

template <typename T>
void pack(T* kd, T* vd, const T* ks, const T* vs, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh,
          const int32_t* table, int64_t H, int64_t ps, int64_t D, int64_t start, int64_t end) {
  const bool bf16 = sizeof(T) == 2;
  pg::for_each_kv_slot(table, H, ps, D, start, end, [&](int64_t pos, int64_t h, int64_t off, int64_t base, bool real) {
    const T* k = ks + (pos - start) * kst + h * ksh;
    const T* v = vs + (pos - start) * vst + h * vsh;
    for (int64_t d = 0; d < D; ++d) {
      kd[base + k_index(off, d, D, bf16)] = real ? k[d] : T(0);
      vd[base + v_index(off, d, D, bf16)] = real ? v[d] : T(0);
    }
  });
}

// Packs k/v [C, H, D] (the cache's dtype) for positions [start, start + C) and zeroes the rest
// of the last 32-token group (pg::for_each_kv_slot).
void write_kv(torch::Tensor kc, torch::Tensor vc, torch::Tensor k, torch::Tensor v, torch::Tensor pt,
              int64_t start) {
  const pg::KvWrite w = pg::check_kv_write(kc, vc, k, v, pt, start, /*float32_too=*/true);
  if (w.end == start) return;
  const int32_t* table = pt.data_ptr<int32_t>();
  const int64_t H = w.heads, ps = w.page_size, D = w.head_dim, end = w.end;
  if (kc.scalar_type() == torch::kBFloat16) {
    pack(reinterpret_cast<uint16_t*>(kc.data_ptr()), reinterpret_cast<uint16_t*>(vc.data_ptr()),
         reinterpret_cast<const uint16_t*>(k.data_ptr()), reinterpret_cast<const uint16_t*>(v.data_ptr()),
         k.stride(0), k.stride(1), v.stride(0), v.stride(1), table, H, ps, D, start, end);
  } else {
    pack(kc.data_ptr<float>(), vc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0),
         k.stride(1), v.stride(0), v.stride(1), table, H, ps, D, start, end);
  }
}

// Split KV for one q-tile over a long context (decode): parts of this many keys, fixed so that the
// split (and so every bit of the result) does not depend on the thread count. Its one copy is
// cpu_attention.py's DECODE_KV_PART, which the build passes in.
#ifndef PF_ATTN_KV_PART
#error "PF_ATTN_KV_PART (cpu_attention.DECODE_KV_PART) must be defined"
#endif
constexpr int64_t kAutoKvPart = PF_ATTN_KV_PART;
static_assert(kAutoKvPart > 0 && kAutoKvPart % pa::kStep == 0, "the split part: whole kernel steps");

// A decode step over a layer of one KV head is a single work item per sequence: unsplit, one
// thread reads all its keys while the others wait (Gemma 3 270M at batch 1). Such a step is cut
// in two halves of whole kernel steps once it sees more than this many keys, up to parts of
// kAutoKvPart. The rule reads the lengths and the layer's shape only, never the batch or the
// thread count, so a sequence's bits stay its own.
constexpr int64_t kOneHeadHalvesFrom = 4 * pa::kStep;

// kv_split: 0 auto (parts of kAutoKvPart keys when one q-tile sees more than two parts; halves
// first for one KV head, above), < 0 never, > 0 keys per part (a multiple of the kernel step).
// -> keys per part, 0 for no split.
int64_t choose_kv_part(int64_t kv_split, int64_t C, int64_t qtile, int64_t keys, int64_t kv_heads) {
  if (kv_split < 0 || C > qtile) return 0;
  if (kv_split > 0) {
    TORCH_CHECK(kv_split % pa::kStep == 0, "kv_split must be a multiple of ", pa::kStep, ", got ", kv_split);
    return kv_split < keys ? kv_split : 0;
  }
  if (kv_heads == 1 && keys > kOneHeadHalvesFrom) {
    const int64_t half = ((keys + 1) / 2 + pa::kStep - 1) / pa::kStep * pa::kStep;
    return half < kAutoKvPart ? half : kAutoKvPart;
  }
  return keys > 2 * kAutoKvPart ? kAutoKvPart : 0;
}

// p's split KV (its L, C, qtile and window set): parts over the keys from the window's group
// on, so a window's parts hold only keys its queries see.
void split_kv(pa::Params& p, int64_t kv_split) {
  p.kv_begin = pa::window_group(p.window, p.L);
  const int64_t keys = p.L + p.C - p.kv_begin;
  p.kv_part = choose_kv_part(kv_split, p.C, p.qtile, keys, p.num_kv_heads);
  p.nparts = p.kv_part ? (keys + p.kv_part - 1) / p.kv_part : 1;
}

// Row i (kv head g, row r) of p's output = the parts' (O, m, l) merged in part order:
// O = sum_j 2^(m_j - m) O_j / sum_j 2^(m_j - m) l_j. Plain C++ (this file has no ISA flags);
// the same arithmetic whichever thread merges a row. Rows of a kv head with fewer query heads
// than p.group (q_first) are slots the kernel left unused: skipped.
void merge_row(const pa::Params& p, int64_t i) {
  const int64_t D = p.head_dim, M = p.C * p.group, np = p.nparts;
  float acc[pa::kMaxHeadDim];
  const int64_t g = i / M, r = i % M, G = pa::group_of(p, g), t = r / G, h = r % G;
  if (r >= p.C * G) return;
  const float* part0 = p.partial + (g * np * M + r) * (D + 2);
  const int64_t stride = M * (D + 2);
  float mx = -__builtin_inff();
  for (int64_t j = 0; j < np; ++j) mx = std::max(mx, part0[j * stride + D]);
  float l = 0.f;
  std::fill(acc, acc + D, 0.f);
  for (int64_t j = 0; j < np; ++j) {
    const float* pj = part0 + j * stride;
    if (pj[D] == -__builtin_inff()) continue;  // the row sees no key of this part
    const float w = std::exp2(pj[D] - mx);
    l += w * pj[D + 1];
    for (int64_t d = 0; d < D; ++d) acc[d] += w * pj[d];
  }
  const float inv = 1.0f / l;
  const int64_t head = pa::first_q_head(p, g) + h;
  char* dst = static_cast<char*>(p.out) + ((t) * p.o_st + head * p.o_sh) * (p.q_bf16 ? 2 : 4);
  for (int64_t d = 0; d < D; ++d) {
    const float x = acc[d] * inv;
    if (p.q_bf16) {
      const uint16_t hb = pg::bf16_rne(x);
      std::memcpy(dst + 2 * d, &hb, 2);
    } else {
      std::memcpy(dst + 4 * d, &x, 4);
    }
  }
}

void merge_parts(const pa::Params& p) {
  at::parallel_for(0, p.num_kv_heads * p.C * p.group, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) merge_row(p, i);
  });
}

// The query heads of each kv head: (largest group, q_first's data or null). q_first: int32
// [Hkv + 1] ascending offsets from 0 to Hq, every group at least one head; absent: equal groups.
std::pair<int64_t, const int32_t*> head_groups(const c10::optional<torch::Tensor>& q_first, int64_t Hq,
                                               int64_t Hkv) {
  if (!q_first.has_value()) {
    TORCH_CHECK(Hq % Hkv == 0, "q heads (", Hq, ") must be a multiple of kv heads (", Hkv, ")");
    return {Hq / Hkv, nullptr};
  }
  const torch::Tensor& f = *q_first;
  TORCH_CHECK(f.dim() == 1 && f.size(0) == Hkv + 1 && f.scalar_type() == torch::kInt && f.is_contiguous(),
              "q_first: expected a contiguous int32 [", Hkv + 1, "], got ", f.sizes());
  const int32_t* first = f.data_ptr<int32_t>();
  TORCH_CHECK(first[0] == 0 && first[Hkv] == Hq, "q_first must run from 0 to the ", Hq, " q heads");
  int64_t G = 0;
  for (int64_t g = 0; g < Hkv; ++g) {
    TORCH_CHECK(first[g + 1] > first[g], "q_first: kv head ", g, " has no query head");
    G = std::max<int64_t>(G, first[g + 1] - first[g]);
  }
  return {G, first};
}

// Per-thread kernel scratch for items of `qtile` queries of a group of G heads, head dim D.
struct ScratchLayout {
  size_t q_bytes, o_bytes, m_bytes, l_bytes, s_bytes, p_bytes, kv_bytes, scale_bytes, total;
  // quantized: room for one step's widened K and V (float32 at most) and their row scales
  ScratchLayout(int64_t qtile, int64_t G, int64_t D, bool quantized) {
    const int64_t rows = pa::rows_pad(qtile, G);
    q_bytes = o_bytes = pg::align64(rows * D * 4);
    m_bytes = pg::align64(rows * 4);
    l_bytes = pg::align64(rows * pa::kLanes * 4);
    s_bytes = pg::align64(pa::kMaxRows * pa::kStep * 4);
    p_bytes = pg::align64(pa::kMaxRows * pa::kStep * 2);
    kv_bytes = quantized ? pg::align64(pa::kStep * D * 4) : 0;
    scale_bytes = quantized ? pg::align64(2 * pa::kStep * 4) : 0;
    total = q_bytes + o_bytes + m_bytes + l_bytes + s_bytes + p_bytes + 2 * kv_bytes + scale_bytes;
  }
  pa::Scratch thread_scratch() const {  // the calling thread's buffer, grown when needed
    thread_local pg::ThreadScratch scratch;
    char* base = static_cast<char*>(scratch.get(total));
    pa::Scratch s;
    s.q = base;
    s.o = reinterpret_cast<float*>(base + q_bytes);
    s.m = reinterpret_cast<float*>(base + q_bytes + o_bytes);
    s.l = reinterpret_cast<float*>(base + q_bytes + o_bytes + m_bytes);
    s.s = reinterpret_cast<float*>(base + q_bytes + o_bytes + m_bytes + l_bytes);
    s.p = reinterpret_cast<uint16_t*>(base + q_bytes + o_bytes + m_bytes + l_bytes + s_bytes);
    char* kv = base + q_bytes + o_bytes + m_bytes + l_bytes + s_bytes + p_bytes;
    s.kq = kv_bytes ? kv : nullptr;
    s.vq = kv_bytes ? kv + kv_bytes : nullptr;
    s.ks = kv_bytes ? reinterpret_cast<float*>(kv + 2 * kv_bytes) : nullptr;
    s.vs = kv_bytes ? s.ks + pa::kStep : nullptr;
    return s;
  }
};

using RunItem = void (*)(const pa::Params&, int64_t, const pa::Scratch&, const char* const*);
constexpr RunItem kKernels[3] = {pa::avx512bf16::run_item, pa::avx512::run_item, pa::avx2::run_item};
constexpr const char* kNames[3] = {"avx512bf16", "avx512", "avx2"};

// The checks both entry points share: the kernel runs here, the caches agree, q [rows, Hq, D]
// fits them. -> the caches' (pages, kv heads, page size, head dim) and whether q / KV are bf16.
struct Shapes {
  int64_t P, Hkv, ps, D;
  bool q_bf16, kv_bf16;  // kv_bf16: what the inner loops read (for a quantized cache: q's dtype)
  int kv_quant;          // pa::KvQuant
};

// A quantized cache's kind, or kPacked for any other dtype.
int quant_kind(const torch::Tensor& c) {
  if (c.scalar_type() == torch::kChar) return pa::kInt8;
  if (c.scalar_type() == at::ScalarType::Float8_e4m3fn) return pa::kFp8;
  return pa::kPacked;
}

// A quantized layer cache [num_pages * page_size, kv heads, head_dim + 4] (kernels/kv_quant.py).
Shapes check_quant_cache(const torch::Tensor& c, int64_t page_size, const char* what) {
  TORCH_CHECK(c.dim() == 3 && c.is_contiguous(), what, ": expected a contiguous [slots, kv_heads, head_dim + 4]"
              " quantized cache, got ", c.sizes());
  TORCH_CHECK(page_size > 0 && page_size % 32 == 0 && c.size(0) % page_size == 0, what,
              ": page_size must be a positive multiple of 32 dividing the slots, got ", page_size);
  const int64_t D = c.size(2) - 4;
  TORCH_CHECK(D == 64 || D == 128 || D == 256, what, ": head_dim must be 64, 128 or 256, got ", D);
  return Shapes{c.size(0) / page_size, c.size(1), page_size, D, false, false, quant_kind(c)};
}

Shapes check_inputs(int64_t isa, const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                    const char* rows, int64_t page_size) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "unknown ISA id ", isa);
  TORCH_CHECK(isa_ok(isa), "pipefill CPU attention: this CPU cannot run the ", kNames[isa], " kernel: ",
              isa_check(isa));
  TORCH_CHECK(kc.sizes() == vc.sizes() && kc.scalar_type() == vc.scalar_type(), "k_cache and v_cache differ");
  Shapes sh{};
  if (quant_kind(kc) != pa::kPacked) {
    sh = check_quant_cache(kc, page_size, "k_cache");
    check_quant_cache(vc, page_size, "v_cache");
    sh.kv_bf16 = q.scalar_type() == torch::kBFloat16;  // widened to q's dtype
  } else {
    check_cache(kc, "k_cache");
    check_cache(vc, "v_cache");
    sh = Shapes{kc.size(0), kc.size(1), kc.size(2), kc.size(3), false, kc.scalar_type() == torch::kBFloat16,
                pa::kPacked};
  }
  sh.q_bf16 = q.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(q.dim() == 3 && q.size(2) == sh.D, "q: expected [", rows, ", Hq, ", sh.D, "], got ", q.sizes());
  TORCH_CHECK(sh.q_bf16 || q.scalar_type() == torch::kFloat, "q: expected bfloat16 or float32");
  if (isa == 0)
    TORCH_CHECK(sh.q_bf16 && sh.kv_bf16, "the avx512bf16 kernel needs bfloat16 q and a bfloat16 or quantized KV cache");
  check_tokens(q, "q", q.size(1), sh.D, q.scalar_type());
  return sh;
}

// out[C, Hq, D] = causal attention of q (positions [L, L + C)) over cached tokens [0, L + C).
torch::Tensor chunk_attention(int64_t isa, torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor pt,
                              int64_t L, double scale, c10::optional<torch::Tensor> out_opt, int64_t qtile,
                              int64_t kv_split, int64_t page_size, c10::optional<torch::Tensor> q_first,
                              int64_t window) {
  const auto [P, Hkv, ps, D, q_bf16, kv_bf16, kv_quant] = check_inputs(isa, q, kc, vc, "C", page_size);
  const int64_t C = q.size(0), Hq = q.size(1);
  TORCH_CHECK(L >= 0, "prefix_len must be >= 0");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  const auto [G, heads] = head_groups(q_first, Hq, Hkv);
  torch::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    check_tokens(out, "out", Hq, D, q.scalar_type());
    TORCH_CHECK(out.size(0) == C, "out: expected ", C, " rows");
  } else {
    out = torch::empty({C, Hq, D}, q.options());
  }
  if (C == 0) return out;
  pa::Params p{};
  p.window = window;
  p.kv_begin = pa::window_group(window, L);  // no key before it is read: its page on must be real
  check_pages(pt, (L + C + ps - 1) / ps, P, p.kv_begin / ps);
  // About 128 rows per item: each K/V step fetched serves all of them.
  if (qtile <= 0) qtile = std::max<int64_t>(1, 128 / G);
  qtile = std::min(qtile, C);
  TORCH_CHECK(qtile * G <= 2048, "qtile * group must be <= 2048");

  p.q = q.data_ptr();
  p.q_st = q.stride(0);
  p.q_sh = q.stride(1);
  p.out = out.data_ptr();
  p.o_st = out.stride(0);
  p.o_sh = out.stride(1);
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.page_table = pt.data_ptr<int32_t>();
  p.page_size = ps;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.group = G;
  p.q_first = heads;
  p.C = C;
  p.L = L;
  p.qtile = qtile;
  p.scale = (float)scale;
  p.q_bf16 = q_bf16;
  p.kv_bf16 = kv_bf16;
  p.kv_quant = kv_quant;
  split_kv(p, kv_split);
  torch::Tensor partial;
  if (p.nparts > 1) {
    partial = torch::empty({Hkv * p.nparts * C * G * (D + 2)}, torch::kFloat);
    p.partial = partial.data_ptr<float>();
  }

  const int64_t n = pa::num_items(p);
  const ScratchLayout layout(qtile, G, D, kv_quant != pa::kPacked);
  const RunItem run = kKernels[isa];
  pg::pull_items(n, [&] { return layout.thread_scratch(); }, [&](int64_t i, const pa::Scratch& s) { run(p, i, s, nullptr); });
  if (p.nparts > 1) merge_parts(p);
  return out;
}

// One new token's K or V row (dtype S) converted to the cache's dtype T.
inline uint16_t to_cache(float x, uint16_t*) { return x != x ? (uint16_t)0x7fc0 : pg::bf16_rne(x); }
inline float to_cache(uint16_t x, float*) { return pg::bf16_to_f32(x); }
template <typename T>
inline T to_cache(T x, T*) { return x; }

// write_kv of one token at position L (dtype S -> the cache's T), with the same result: the
// token's K/V, and zeroes for the rest of its 32-token group. Those zeroes are written only by
// the group's first token (a contiguous 32-token span in both layouts): every later token of
// the group finds its slot and the ones after it still zero, as every writer of the token
// before it (pack, this, whole-page copies of such pages) left them. Zeroing the rest at every
// step cost ~10 us per sequence and layer.
template <typename T, typename S>
void put_token(T* kd, T* vd, const S* k, const S* v, const int32_t* table, int64_t H, int64_t h, int64_t ps,
               int64_t D, int64_t L) {
  const bool bf16 = sizeof(T) == 2;
  const int64_t off = L % ps;
  const int64_t base = ((int64_t)table[L / ps] * H + h) * ps * D;
  if (L % 32 == 0) {  // K: two 16-token blocks of 16 * D values; V: one 32-token block
    std::memset(kd + base + (off / 16) * 16 * D, 0, 32 * D * sizeof(T));
    std::memset(vd + base + (off / 32) * 32 * D, 0, 32 * D * sizeof(T));
  }
  for (int64_t d = 0; d < D; ++d) {
    kd[base + k_index(off, d, D, bf16)] = to_cache(k[d], (T*)nullptr);
    vd[base + v_index(off, d, D, bf16)] = to_cache(v[d], (T*)nullptr);
  }
}

// The new tokens of a decode step (k, v [B, H, D], float32 or bf16) and the caches they go to.
struct NewTokens {
  void *kd, *vd;
  const char *k, *v;
  int64_t k_st, k_sh, v_st, v_sh, esz, H, ps, D;
  bool src_f32, kv_bf16;
  int kv_quant;

  // page_size: the quantized cache's (its shape does not hold it), else unused.
  NewTokens(const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& k_, const torch::Tensor& v_,
            int64_t page_size)
      : kd(kc.data_ptr()), vd(vc.data_ptr()), k(static_cast<const char*>(k_.data_ptr())),
        v(static_cast<const char*>(v_.data_ptr())), k_st(k_.stride(0)), k_sh(k_.stride(1)), v_st(v_.stride(0)),
        v_sh(v_.stride(1)), esz(k_.element_size()), H(kc.size(1)), ps(kc.dim() == 4 ? kc.size(2) : page_size),
        D(kc.dim() == 4 ? kc.size(3) : kc.size(2) - 4), src_f32(k_.scalar_type() == torch::kFloat),
        kv_bf16(kc.scalar_type() == torch::kBFloat16), kv_quant(quant_kind(kc)) {}

  // Sequence b's kv head h at position L (its page table `table`).
  void put(int64_t b, int64_t h, const int32_t* table, int64_t L) const {
    const char* ks = k + (b * k_st + h * k_sh) * esz;
    const char* vs = v + (b * v_st + h * v_sh) * esz;
    if (kv_quant != pa::kPacked) {
      const int64_t row = (((int64_t)table[L / ps] * ps + L % ps) * H + h) * (D + 4);
      quantize_row(ks, static_cast<char*>(kd) + row);
      quantize_row(vs, static_cast<char*>(vd) + row);
    } else if (kv_bf16) put_as(static_cast<uint16_t*>(kd), static_cast<uint16_t*>(vd), ks, vs, table, h, L);
    else put_as(static_cast<float*>(kd), static_cast<float*>(vd), ks, vs, table, h, L);
  }

  // One row as kv_quant.quantize writes it: s = max |x| / qmax (at least FLT_MIN), codes
  // x / s clamped to +-qmax, rounded half to even (int8) or to the nearest e4m3 value.
  void quantize_row(const char* src, char* dst) const {
    float x[pa::kMaxHeadDim];
    for (int64_t d = 0; d < D; ++d) {
      if (src_f32) {
        std::memcpy(&x[d], src + 4 * d, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, src + 2 * d, 2);
        x[d] = pg::bf16_to_f32(h);
      }
    }
    const float qmax = kv_quant == pa::kInt8 ? 127.0f : 448.0f;
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float scale = std::max(amax / qmax, std::numeric_limits<float>::min());
    for (int64_t d = 0; d < D; ++d) {
      const float c = std::min(std::max(x[d] / scale, -qmax), qmax);
      if (kv_quant == pa::kInt8) dst[d] = (char)(int8_t)std::nearbyint(c);
      else dst[d] = (char)c10::Float8_e4m3fn(c).x;
    }
    std::memcpy(dst + D, &scale, 4);
  }

  template <typename T>
  void put_as(T* kt, T* vt, const char* ks, const char* vs, const int32_t* table, int64_t h, int64_t L) const {
    if (src_f32)
      put_token(kt, vt, reinterpret_cast<const float*>(ks), reinterpret_cast<const float*>(vs), table, H, h, ps, D, L);
    else
      put_token(kt, vt, reinterpret_cast<const uint16_t*>(ks), reinterpret_cast<const uint16_t*>(vs), table, H, h,
                ps, D, L);
  }
};

// Checks of decode_attention's per-step arguments: every table row covers its sequence's
// tokens [0, L + 1) with pages in range (from its window's first page on), and no two
// sequences write into the same page.
void check_decode_tables(const torch::Tensor& tables, const torch::Tensor& lens, int64_t B, int64_t ps, int64_t P,
                         int64_t window) {
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && tables.dim() == 2 && tables.is_contiguous() &&
                  tables.size(0) == B,
              "page_tables: expected a contiguous int32 tensor [", B, ", pages], got ", tables.scalar_type(), " ",
              tables.sizes());
  TORCH_CHECK(lens.scalar_type() == torch::kLong && lens.dim() == 1 && lens.is_contiguous() && lens.size(0) == B,
              "prefix_lens: expected a contiguous int64 tensor [", B, "], got ", lens.scalar_type(), " ",
              lens.sizes());
  const int64_t W = tables.size(1);
  const int32_t* t = tables.data_ptr<int32_t>();
  const int64_t* L = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(L[b] >= 0, "prefix_lens[", b, "] = ", L[b], " must be >= 0");
    const int64_t needed = L[b] / ps + 1;
    TORCH_CHECK(needed <= W, "page_tables row ", b, ": ", W, " pages, need ", needed, " for prefix_len ", L[b]);
    for (int64_t i = pa::window_group(window, L[b]) / ps; i < needed; ++i)
      TORCH_CHECK(t[b * W + i] >= 0 && t[b * W + i] < P, "page_tables[", b, ", ", i, "] = ", t[b * W + i],
                  " out of range [0, ", P, ")");
    for (int64_t c = 0; c < b; ++c)
      TORCH_CHECK(t[b * W + L[b] / ps] != t[c * W + L[c] / ps], "sequences ", c, " and ", b,
                  " would write their new token into the same page ", t[b * W + L[b] / ps]);
  }
}

// A KV head whose query group straddles two TP ranks, split by keys between them at decode
// (ARCHITECTURE.md, 'Tensor parallelism inside a stage'): this rank computes only parts [lo, hi)
// of head `head` for every sequence and leaves their (O, m, l) in `out` [B, P, G, D + 2], part
// order, unmerged; the ranks gather them and merge_gathered merges them. head < 0: none.
struct SharedHead {
  int64_t head = -1;
  const int64_t* range = nullptr;  // [B, 2]: lo, hi
  float* out = nullptr;
  int64_t slots = 0;  // P
  bool skips(int64_t b, int64_t g, int64_t part) const {
    return g == head && (part < range[2 * b] || part >= range[2 * b + 1]);
  }
};

SharedHead check_shared(int64_t head, const c10::optional<torch::Tensor>& parts,
                        const c10::optional<torch::Tensor>& out, const std::vector<pa::Params>& seqs,
                        int64_t Hkv, int64_t G, int64_t D, bool equal_groups) {
  SharedHead sh;
  if (head < 0) return sh;
  const int64_t B = seqs.size();
  TORCH_CHECK(head < Hkv, "shared_head ", head, " is not one of the ", Hkv, " kv heads");
  // merge_gathered writes every one of the G rows: the shared head's group must be whole.
  TORCH_CHECK(equal_groups, "shared_head needs equal query groups (no q_first)");
  TORCH_CHECK(parts.has_value() && out.has_value(), "shared_head needs shared_parts and shared_out");
  const torch::Tensor& r = *parts;
  const torch::Tensor& o = *out;
  TORCH_CHECK(r.scalar_type() == torch::kLong && r.is_contiguous() && r.dim() == 2 && r.size(0) == B &&
                  r.size(1) == 2, "shared_parts: expected a contiguous int64 [", B, ", 2], got ", r.sizes());
  TORCH_CHECK(o.scalar_type() == torch::kFloat && o.is_contiguous() && o.dim() == 4 && o.size(0) == B &&
                  o.size(2) == G && o.size(3) == D + 2,
              "shared_out: expected a contiguous float32 [", B, ", parts, ", G, ", ", D + 2, "], got ", o.sizes());
  sh.head = head, sh.range = r.data_ptr<int64_t>(), sh.out = o.data_ptr<float>(), sh.slots = o.size(1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = sh.range[2 * b], hi = sh.range[2 * b + 1];
    TORCH_CHECK(seqs[b].nparts > 1, "shared_head: sequence ", b, " has ", seqs[b].L + 1,
                " keys, too few to be split into parts");
    TORCH_CHECK(0 <= lo && lo <= hi && hi <= seqs[b].nparts && hi - lo <= sh.slots, "shared_parts[", b,
                "] = [", lo, ", ", hi, ") is not a range of at most ", sh.slots, " of its ", seqs[b].nparts,
                " parts");
  }
  return sh;
}

// The shared head's parts this rank computed, from each sequence's partials into sh.out.
void copy_shared(const SharedHead& sh, const std::vector<pa::Params>& seqs) {
  for (size_t b = 0; b < seqs.size(); ++b) {
    const pa::Params& p = seqs[b];
    const int64_t rows = p.C * p.group * (p.head_dim + 2), lo = sh.range[2 * b], hi = sh.range[2 * b + 1];
    const float* src = p.partial + (sh.head * p.nparts + lo) * rows;
    std::copy(src, src + (hi - lo) * rows, sh.out + b * sh.slots * rows);
  }
}

// The shared head's rows of out [B, Hq, D] (query heads [first, first + G)) from every rank's
// parts: gathered [R, B, P, G, D + 2], counts [R, B] the parts rank r computed, in rank order
// (rank r's parts follow rank r - 1's). merge_row's arithmetic in part order: the bits one
// rank computing every part gets.
void merge_gathered(torch::Tensor gathered, torch::Tensor counts, torch::Tensor out, int64_t first) {
  TORCH_CHECK(gathered.scalar_type() == torch::kFloat && gathered.is_contiguous() && gathered.dim() == 5,
              "gathered: expected a contiguous float32 [ranks, B, parts, G, D + 2], got ", gathered.sizes());
  const int64_t R = gathered.size(0), B = gathered.size(1), P = gathered.size(2), G = gathered.size(3),
                D = gathered.size(4) - 2;
  TORCH_CHECK(counts.scalar_type() == torch::kLong && counts.is_contiguous() && counts.dim() == 2 &&
                  counts.size(0) == R && counts.size(1) == B, "counts: expected a contiguous int64 [", R, ", ",
              B, "], got ", counts.sizes());
  TORCH_CHECK(D <= 128, "head_dim ", D, " is larger than 128");
  check_tokens(out, "out", out.size(1), D, out.scalar_type());
  TORCH_CHECK(out.size(0) == B && first >= 0 && first + G <= out.size(1), "out: expected [", B,
              ", at least ", first + G, " heads, ", D, "], got ", out.sizes());
  const int64_t* n = counts.data_ptr<int64_t>();
  const int64_t part_floats = G * (D + 2);
  std::vector<float> parts;
  for (int64_t b = 0; b < B; ++b) {
    parts.clear();
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(n[r * B + b] >= 0 && n[r * B + b] <= P, "counts[", r, ", ", b, "] out of range");
      const float* src = gathered.data_ptr<float>() + (r * B + b) * P * part_floats;
      parts.insert(parts.end(), src, src + n[r * B + b] * part_floats);
    }
    pa::Params p{};
    p.partial = parts.data();
    p.nparts = parts.size() / part_floats;
    TORCH_CHECK(p.nparts > 0, "sequence ", b, ": no part to merge");
    p.C = 1, p.group = G, p.head_dim = D, p.num_kv_heads = 1, p.q_first = nullptr;
    p.q_bf16 = out.scalar_type() == torch::kBFloat16;
    p.o_st = out.stride(0), p.o_sh = out.stride(1);
    p.out = static_cast<char*>(out.data_ptr()) + (b * p.o_st + first * p.o_sh) * out.element_size();
    for (int64_t i = 0; i < G; ++i) merge_row(p, i);
  }
}

// One decode step of a layer for B sequences (one new token each, at position prefix_lens[b]):
// writes each token's K/V into its page slot, then out[b] = attention of q[b] over the
// sequence's tokens [0, L_b + 1). Each sequence is the Params that chunk_attention builds for it
// (same q-tile, same split-KV parts), and all sequences' (kv head, part) items share one pool,
// so the bits equal B chunk_attention calls at any thread count.
void decode_attention(int64_t isa, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kc,
                      torch::Tensor vc, torch::Tensor tables, torch::Tensor lens, double scale, torch::Tensor out,
                      int64_t page_size, c10::optional<torch::Tensor> q_first, int64_t window,
                      int64_t shared_head, c10::optional<torch::Tensor> shared_parts,
                      c10::optional<torch::Tensor> shared_out) {
  const auto [P, Hkv, ps, D, q_bf16, kv_bf16, kv_quant] = check_inputs(isa, q, kc, vc, "B", page_size);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  // A shared head's parts are cut over the whole prefix; no windowed model splits heads by TP.
  TORCH_CHECK(window == 0 || shared_head < 0, "shared_head is not taken with a window");
  const int64_t B = q.size(0), Hq = q.size(1);
  check_tokens(k, "k_new", Hkv, D, q.scalar_type());
  check_tokens(v, "v_new", Hkv, D, q.scalar_type());
  check_tokens(out, "out", Hq, D, q.scalar_type());
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && out.size(0) == B, "q, k_new, v_new and out need ", B,
              " rows each, got ", k.size(0), ", ", v.size(0), ", ", out.size(0));
  check_decode_tables(tables, lens, B, ps, P, window);
  if (B == 0) return;
  const auto [G, heads] = head_groups(q_first, Hq, Hkv);
  const int64_t W = tables.size(1);
  const int64_t* L = lens.data_ptr<int64_t>();

  std::vector<pa::Params> seqs(B);
  std::vector<int64_t> order(B), first(B + 1, 0), part_at(B, 0);
  int64_t partial_floats = 0;
  for (int64_t b = 0; b < B; ++b) {
    pa::Params& p = seqs[b];
    p.q = static_cast<const char*>(q.data_ptr()) + b * q.stride(0) * q.element_size();
    p.q_st = q.stride(0);
    p.q_sh = q.stride(1);
    p.out = static_cast<char*>(out.data_ptr()) + b * out.stride(0) * out.element_size();
    p.o_st = out.stride(0);
    p.o_sh = out.stride(1);
    p.k = kc.data_ptr();
    p.v = vc.data_ptr();
    p.page_table = tables.data_ptr<int32_t>() + b * W;
    p.page_size = ps;
    p.num_kv_heads = Hkv;
    p.head_dim = D;
    p.group = G;
    p.q_first = heads;
    p.C = 1;
    p.L = L[b];
    p.qtile = 1;  // chunk_attention's min(max(1, 128 / G), C) for C = 1
    p.scale = (float)scale;
    p.q_bf16 = q_bf16;
    p.kv_bf16 = kv_bf16;
    p.kv_quant = kv_quant;
    p.window = window;
    split_kv(p, 0);
    part_at[b] = partial_floats;
    if (p.nparts > 1) partial_floats += Hkv * p.nparts * G * (D + 2);
    order[b] = b;
  }
  const SharedHead shared = check_shared(shared_head, shared_parts, shared_out, seqs, Hkv, G, D, heads == nullptr);
  thread_local std::vector<float> partial;  // reused across layers and steps
  partial.resize(partial_floats);
  for (int64_t b = 0; b < B; ++b)
    if (seqs[b].nparts > 1) seqs[b].partial = partial.data() + part_at[b];

  const NewTokens tokens(kc, vc, k, v, ps);
  // Items of the sequences with the most keys per item first, so the last items are short.
  auto keys_per_item = [&](int64_t b) {
    return (L[b] + 1 - seqs[b].kv_begin + seqs[b].nparts - 1) / seqs[b].nparts;
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys_per_item(a) > keys_per_item(b); });
  for (int64_t j = 0; j < B; ++j) first[j + 1] = first[j] + pa::num_items(seqs[order[j]]);
  const int64_t n = first[B];
  const ScratchLayout layout(1, G, D, kv_quant != pa::kPacked);
  const RunItem run = kKernels[isa];
  // Pool index i -> (sequence, its item).
  auto locate = [&](int64_t i) {
    const int64_t j = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    return std::pair<int64_t, int64_t>(order[j], i - first[j]);
  };
  pg::pull_items_ahead(n, [&] { return layout.thread_scratch(); }, [&](int64_t i, int64_t i_next,
                                                                      const pa::Scratch& s) {
    const auto [b, item] = locate(i);
    const pa::Params& p = seqs[b];
    // The first step of this thread's next item is prefetched during this item's last step
    // (each item's first step missed all caches: nothing knew which thread would take it).
    const char* after[4];
    if (i_next >= 0) {
      const auto [nb, nitem] = locate(i_next);
      pa::first_step_runs(seqs[nb], nitem, after);
    }
    // The item of the part holding the new token (the last) writes its head's K/V first:
    // no other item reads that page, and the writer is the reader (the lines stay in this
    // core's cache instead of crossing from the thread that used to write every token).
    // A shared head's part left to the other rank still writes the token: each rank's pool
    // keeps its own copy of that head.
    const int64_t part = pa::item_part(p, item), head = pa::item_tile_head(p, item) % Hkv;
    if (part == p.nparts - 1) tokens.put(b, head, p.page_table, L[b]);
    if (!shared.skips(b, head, part)) run(p, item, s, i_next >= 0 ? after : nullptr);
  });
  // Merge the split sequences' parts: Hkv * G rows each, one pool for all of them.
  std::vector<int64_t> split;
  for (int64_t b = 0; b < B; ++b)
    if (seqs[b].nparts > 1) split.push_back(b);
  const int64_t rows = Hkv * G;
  at::parallel_for(0, (int64_t)split.size() * rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      if ((i % rows) / G != shared.head) merge_row(seqs[split[i / rows]], i % rows);
  });
  if (shared.head >= 0) copy_shared(shared, seqs);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &cpu_supported, "cpuid/XCR0 check for one ISA (0 avx512bf16, 1 avx512, 2 avx2)");
  m.def("write_kv", &write_kv, "pack new K/V tokens into the packed cache layout (bf16 or float32)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k_new"), py::arg("v_new"), py::arg("page_table"),
        py::arg("start"), py::call_guard<py::gil_scoped_release>());
  m.def("chunk_attention", &chunk_attention, "fused causal chunk attention (vector kernels)", py::arg("isa"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"), py::arg("prefix_len"),
        py::arg("scale"), py::arg("out") = py::none(), py::arg("qtile") = 0, py::arg("kv_split") = 0,
        py::arg("page_size") = 0, py::arg("q_first") = py::none(), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention,
        "one decode step of a layer for all sequences: KV write + attention (vector kernels)", py::arg("isa"),
        py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("page_tables"), py::arg("prefix_lens"), py::arg("scale"), py::arg("out"),
        py::arg("page_size") = 0, py::arg("q_first") = py::none(), py::arg("window") = 0,
        py::arg("shared_head") = -1,
        py::arg("shared_parts") = py::none(), py::arg("shared_out") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("merge_gathered", &merge_gathered, "a shared kv head's parts from every rank, merged into out",
        py::arg("gathered"), py::arg("counts"), py::arg("out"), py::arg("first"),
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_parts", [](torch::Tensor lens, int64_t kv_heads) {
    TORCH_CHECK(lens.scalar_type() == torch::kLong && lens.dim() == 1 && lens.is_contiguous(),
                "prefix_lens: expected a contiguous int64 [B]");
    TORCH_CHECK(kv_heads > 0, "kv_heads must be positive, got ", kv_heads);
    torch::Tensor out = torch::empty_like(lens);
    for (int64_t b = 0; b < lens.size(0); ++b) {
      const int64_t keys = lens.data_ptr<int64_t>()[b] + 1, part = choose_kv_part(0, 1, 1, keys, kv_heads);
      out.data_ptr<int64_t>()[b] = part ? (keys + part - 1) / part : 1;
    }
    return out;
  }, "the split-KV parts of each sequence's decode step (its prefix length + 1 keys) over a layer of kv_heads KV heads",
        py::arg("prefix_lens"), py::arg("kv_heads"));
  m.def("auto_kv_part", [] { return kAutoKvPart; }, "the keys of a decode step's split part");
}
