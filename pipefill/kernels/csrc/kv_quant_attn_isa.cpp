// Decode attention over an int8 KV cache, one build per ISA (PF_QA_NS = scalar, avx2, avx512;
// the -m flags decide which vector code below compiles). Per KV head: the scores of its query
// heads against every token (one pass over the K rows, each row's codes read once for the whole
// group), their maximum, then one pass over the V rows accumulating exp(score - max) * scale_v
// * codes. Sums in float32. See kv_quant_attn_kernel.h for the layout.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kv_quant_attn_kernel.h"

namespace pipefill_qattn {
namespace PF_QA_NS {
namespace {

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);  // the float32 after the codes (4-byte aligned: D % 4 == 0)
  return s;
}

// sum_d q[d] * codes[d]
inline float dot(const float* q, const int8_t* codes, int64_t D) {
  int64_t d = 0;
  float total = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d));
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), acc);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d));
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), acc);
  }
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  total = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
#endif
  for (; d < D; ++d) total += q[d] * (float)codes[d];
  return total;
}

// acc[d] += w * codes[d]
inline void axpy(float w, const int8_t* codes, float* acc, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; d + 16 <= D; d += 16) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d));
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(wv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)),
                                              _mm512_loadu_ps(acc + d)));
  }
#elif defined(__AVX2__)
  const __m256 wv = _mm256_set1_ps(w);
  for (; d + 8 <= D; d += 8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d));
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)),
                                              _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < D; ++d) acc[d] += w * (float)codes[d];
}

void one_kv_head(const DecodeArgs& a, int64_t h, float* scratch) {
  const int64_t group = a.Hq / a.H, stride = a.H * a.row_bytes;
  float* scores = scratch;                 // [group, n]
  float* acc = scratch + group * a.n;      // [D] of one query head at a time
  const int8_t* k_head = a.k + h * a.row_bytes;
  const int8_t* v_head = a.v + h * a.row_bytes;
  for (int64_t t = 0; t < a.n; ++t) {
    const int8_t* row = k_head + a.slots[t] * stride;
    const float s = row_scale(row, a.D) * a.scale;
    for (int64_t j = 0; j < group; ++j) scores[j * a.n + t] = dot(a.q + (h * group + j) * a.D, row, a.D) * s;
  }
  for (int64_t j = 0; j < group; ++j) {
    float* sj = scores + j * a.n;
    float top = -INFINITY;
    for (int64_t t = 0; t < a.n; ++t) top = sj[t] > top ? sj[t] : top;
    float total = 0.0f;
    std::memset(acc, 0, sizeof(float) * a.D);
    for (int64_t t = 0; t < a.n; ++t) {
      const float p = std::exp(sj[t] - top);
      total += p;
      const int8_t* row = v_head + a.slots[t] * stride;
      axpy(p * row_scale(row, a.D), row, acc, a.D);
    }
    float* o = a.out + (h * group + j) * a.D;
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < a.D; ++d) o[d] = acc[d] * inv;
  }
}

}  // namespace

void decode_heads(const DecodeArgs& a, int64_t h0, int64_t h1, float* scratch) {
  for (int64_t h = h0; h < h1; ++h) one_kv_head(a, h, scratch);
}

}  // namespace PF_QA_NS
}  // namespace pipefill_qattn
