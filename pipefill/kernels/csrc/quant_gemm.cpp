// Glue of the quantized decode GEMM (GGUF blocks kept as in the file, and FP8 e4m3 weights with
// 128 x 128 block scales): per-ISA cpuid/XCR0 checks, bf16 activations widened to float32, the
// bias and the bf16 output rounding, the split of output columns over torch's thread pool
// (at::parallel_for, so --threads-per-stage applies), and the dequantization of whole rows that
// prefill multiplies on torch. An ISA's code runs only
// when the caller asked for that ISA and the check for it passed. The entry points take
// addresses and sizes (pipefill/kernels/quant_gemm.py checks them).
#include "glue.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fp8_gemm_kernel.h"
#include "glue_vector_isa.h"
#include "quant_gemm_kernel.h"
#include "quant_int8_kernel.h"

namespace {

namespace pg = pipefill_glue;
using namespace pipefill_quant;
using pg::Addr;
using pg::kAvx2;
using pg::kAvx512;

constexpr int kBF16 = 1;  // dtype codes: 0 float32, 1 bfloat16

// The arguments every entry point shares are sane: a known type, whole blocks, the row size.
bool shape_ok(int qtype, int64_t row_bytes, int64_t K) {
  const int bb = block_bytes(qtype), bw = block_weights(qtype);
  return bb > 0 && K > 0 && K % bw == 0 && row_bytes == K / bw * bb;
}

// Bytes of float32 sums a task holds at a time for bf16 output (below): a few hundred KB, in
// cache, instead of a float32 copy of the whole y (32 MiB for a 512-row chunk of an 8,192 x 2
// wide gate/up projection, kept by the thread as its high-water mark: ARCHITECTURE.md, 'What a
// stage's memory is made of').
constexpr int64_t kSumsBytes = 256 << 10;

// Rows of bf16 x widened to float32 at a time where only prep reads x (widened_rows).
constexpr int64_t kWidenRows = 16;

// y[M, N] (row stride ldy, float32 or bf16) = x[M, K] (row stride ldx, float32 or bf16) @ W^T
// (+ bias float32 [N] or None), where cols(xf, ldxf, yf, ldyf, n0, n1) writes the float32 sums
// of columns [n0, n1) (at yf + m * ldyf + n) from float32 x: bf16 x is widened first, bf16 y
// rounded last (after the bias) by the task that computed the columns, which are split over
// torch's pool, `grain` at least per task, in whole runs of `col_unit` columns (the 16-row
// layout's groups); a task with bf16 y computes its columns a piece of kSumsBytes of sums at a
// time in its own scratch. prep(xf, ldf) runs once before the columns (the integer path
// quantizes the activations there); with prep_reads_x, prep alone reads x and gets x's own
// address and dtype instead (xf = x_addr, ldf = ldx), so a bf16 x is never widened whole
// (widened_rows), and cols gets no x.
template <class Prep, class Cols>
int float_gemm(const char* what, Addr x_addr, int x_dtype, int64_t ldx, Addr bias_addr, Addr y_addr,
               int y_dtype, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t grain, const Prep& prep,
               const Cols& cols, int64_t col_unit = 1, bool prep_reads_x = false) {
  const float* bias = bias_addr.as<const float>();
  return pg::guarded(what, [&] {
    thread_local std::vector<float> xbuf;
    const float* xf = x_addr.as<const float>();
    int64_t ldf = ldx;
    if (x_dtype == kBF16 && !prep_reads_x) {
      xbuf.resize((size_t)(M * K));
      const uint16_t* xb = x_addr.as<const uint16_t>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xbuf[m * K + k] = pg::bf16_to_f32(xb[m * ldx + k]);
      xf = xbuf.data();
      ldf = K;
    }
    prep(xf, ldf);
    // Columns a piece of sums holds: whole runs, as many as kSumsBytes holds (all of a task's
    // for the few rows of a decode step), so each column is computed as one call computes it.
    const int64_t piece = std::max<int64_t>(1, kSumsBytes / (4 * std::max<int64_t>(M, 1)) / col_unit) * col_unit;
    const int64_t runs = (N + col_unit - 1) / col_unit;
    at::parallel_for(0, runs, std::max<int64_t>(1, grain / col_unit), [&](int64_t r0, int64_t r1) {
      const int64_t n0 = r0 * col_unit, n1 = std::min(N, r1 * col_unit);
      if (y_dtype != kBF16) {
        float* yf = y_addr.as<float>();
        cols(xf, ldf, yf, ldy, n0, n1);
        if (bias)
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = n0; n < n1; ++n) yf[m * ldy + n] += bias[n];
        return;
      }
      thread_local pg::ThreadScratch sums;
      for (int64_t c0 = n0; c0 < n1; c0 += piece) {
        const int64_t c1 = std::min(n1, c0 + piece), width = c1 - c0;
        float* s = static_cast<float*>(sums.get((size_t)(M * width) * 4));
        // cols addresses column n of row m at yf + m * ldyf + n: this piece's column c0 is s's.
        float* yf = reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(s) - (uintptr_t)(c0 * 4));
        cols(xf, ldf, yf, width, c0, c1);
        for (int64_t m = 0; m < M; ++m) {
          const float* sr = s + m * width;
          uint16_t* out = y_addr.as<uint16_t>() + m * ldy + c0;
          for (int64_t j = 0; j < width; ++j) {
            const float v = bias ? sr[j] + bias[c0 + j] : sr[j];
            out[j] = v != v ? 0x7fc0 : pg::bf16_rne(v);
          }
        }
      }
    });
  });
}

// fn(xf, ldf, m0, m1) on rows [m0, m1) of x (row stride ldx, float32 or bf16) as float32 (xf:
// row m0, row stride ldf): float32 x as it is, bf16 x widened kWidenRows rows at a time.
template <class Fn>
void widened_rows(Addr x_addr, int x_dtype, int64_t ldx, int64_t M, int64_t K, const Fn& fn) {
  if (x_dtype != kBF16) {
    fn(x_addr.as<const float>(), ldx, 0, M);
    return;
  }
  thread_local std::vector<float> rows;
  rows.resize((size_t)(kWidenRows * K));
  const uint16_t* xb = x_addr.as<const uint16_t>();
  for (int64_t m0 = 0; m0 < M; m0 += kWidenRows) {
    const int64_t m1 = std::min(M, m0 + kWidenRows);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; ++k) rows[(m - m0) * K + k] = pg::bf16_to_f32(xb[m * ldx + k]);
    fn(rows.data(), K, m0, m1);
  }
}

// pf_qg_dequant of W held in the 16-row layout: a group of 16 rows at a time, dequantized from
// the layout where the ISA has the code for the type (dequant_group16: the vector paths, the
// 32-weight types), else put back in the file's layout in a small scratch (one read of the
// layout, transposed in registers) and dequantized from there by the file's rows' code: every
// output bit is the file's rows'.
template <class Dequant, class Group>
void dequant_rows16(const Dequant& fn, const Group& group16, const uint8_t* w, int qtype, int64_t row_bytes, int64_t N, int64_t K,
                    char* out, bool bf16, int64_t ldo) {
  const int bb = block_bytes(qtype), bw = block_weights(qtype);
  // Block columns a copy: whole rows up to 4 KB (16 of them, 64 KB, stay in L1/L2 between the
  // copy and its dequantization; rows written to the end in one go as from the file's layout).
  const int64_t blocks = K / bw, step = std::clamp<int64_t>(4096 / bb, 1, blocks);
  const size_t elem = bf16 ? 2 : 4;
  const int64_t groups = (N + 15) / 16;
  at::parallel_for(0, groups, std::max<int64_t>(1, 65536 / (16 * row_bytes)), [&](int64_t g0, int64_t g1) {
    thread_local pg::ThreadScratch scratch;
    uint8_t* rows = static_cast<uint8_t*>(scratch.get((size_t)(16 * step * bb)));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t valid = std::min<int64_t>(16, N - 16 * g);
      if (group16(w + 16 * g * row_bytes, qtype, K, (int)valid, out + 16 * g * ldo * elem, bf16, ldo)) continue;
      for (int64_t b0 = 0; b0 < blocks; b0 += step) {
        const int64_t b1 = std::min(blocks, b0 + step);
        rows16_group_to_file(w + 16 * g * row_bytes, qtype, b0, b1, rows);
        fn(rows, qtype, (b1 - b0) * bb, (b1 - b0) * bw, 0, valid, out + (16 * g * ldo + b0 * bw) * elem, bf16, ldo);
      }
    }
  });
}

// The GEMM on GGUF blocks: W of `qtype`, row n at w + n * row_bytes.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_qg_gemm(int isa, Addr x_addr, int x_dtype, int64_t ldx, Addr w_addr, int qtype,
               int64_t row_bytes, Addr bias_addr, Addr y_addr, int y_dtype, int64_t ldy,
               int64_t M, int64_t N, int64_t K) {
  if (!pg::vector_isa_ok(isa)) return -2;
  if (M <= 0 || N <= 0) return 0;
  if (!shape_ok(qtype, row_bytes, K)) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  auto fn = isa == kAvx512 ? avx512::gemm_cols : isa == kAvx2 ? avx2::gemm_cols : scalar::gemm_cols;
  // Columns per task: at least ~32 KB of blocks, so small matrices stay on one thread.
  return float_gemm("pipefill quantized gemm", x_addr, x_dtype, ldx, bias_addr, y_addr, y_dtype, ldy, M, N, K,
                    std::max<int64_t>(1, 32768 / row_bytes), [](const float*, int64_t) {},
                    [&](const float* xf, int64_t ldf, float* yf, int64_t ldf_y, int64_t n0, int64_t n1) {
                      fn(xf, ldf, w, qtype, row_bytes, M, K, yf, ldf_y, n0, n1);
                    });
}

// out[N, K] (row stride ldo, float32 or bf16 rounded to nearest even) = W dequantized by the
// ISA's code, each weight as dequant_block computes it (the decode paths' float32 values).
// rows16: W is held in the 16-row layout (quant_int8_kernel.h), padded to whole groups.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_qg_dequant(int isa, Addr w_addr, int qtype, int64_t row_bytes, int64_t N, int64_t K, Addr out_addr,
                  int out_dtype, int64_t ldo, bool rows16) {
  if (!pg::vector_isa_ok(isa)) return -2;
  if (N <= 0) return 0;
  if (!shape_ok(qtype, row_bytes, K)) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  auto fn = isa == kAvx512 ? avx512::dequant_rows : isa == kAvx2 ? avx2::dequant_rows : scalar::dequant_rows;
  return pg::guarded("pipefill dequantize", [&] {
    auto group16 = isa == kAvx512 ? avx512::dequant_group16 : isa == kAvx2 ? avx2::dequant_group16
                                                                          : scalar::dequant_group16;
    if (rows16) return dequant_rows16(fn, group16, w, qtype, row_bytes, N, K, out_addr.as<char>(), out_dtype == kBF16, ldo);
    at::parallel_for(0, N, std::max<int64_t>(1, 65536 / row_bytes), [&](int64_t n0, int64_t n1) {
      fn(w, qtype, row_bytes, K, n0, n1, out_addr.as<void>(), out_dtype == kBF16, ldo);
    });
  });
}

// ---- The integer path: activations quantized to int8 (quant_int8_kernel.h) ----

constexpr int kInt8Avx2 = 0, kInt8Vnni = 1;  // the integer paths' ids

// nullptr when this CPU runs integer path `path`, else the first thing missing. Both use F16C
// (the blocks' half scales) and AVX2 is the floor of the VNNI build too.
const char* int8_check(int path) {
  unsigned a, b, c, d;
  if (path == kInt8Avx2 || path == kInt8Vnni) {
    if (const char* why = path == kInt8Vnni ? pg::need_avx512() : pg::need_avx2_fma()) return why;
    if (!(__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)))) return "no F16C";
    if (path == kInt8Vnni && !(__get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << 11))))
      return "no AVX512_VNNI";
    return nullptr;
  }
  return "unknown integer path";
}

bool int8_ok(int path) {
  static const bool ok[2] = {int8_check(kInt8Avx2) == nullptr, int8_check(kInt8Vnni) == nullptr};
  return (path == kInt8Avx2 || path == kInt8Vnni) && ok[path];
}

std::tuple<bool, std::string> pf_qg_int8_supported(int path) {
  const char* why = int8_check(path);
  return {why == nullptr, why ? why : "ok"};
}

// One call's quantized activations in the caller's scratch (quant_int8_kernel.h's layout).
struct Int8Buffers {
  pg::ThreadScratch scratch;
  int8_t* nat = nullptr;
  float* dx = nullptr;
  Int8Rows rows(int64_t M, int64_t kp) { return int8_scratch(scratch.get(int8_scratch_bytes(M, kp)), M, kp, nat, dx); }
};

// The GEMM on GGUF blocks with int8 activations (arguments as pf_qg_gemm's; path: kInt8*).
// Returns 0, or -2 (path not usable here), -3 (bad arguments), -1 (exception).
int pf_qg_int8_gemm(int path, Addr x_addr, int x_dtype, int64_t ldx, Addr w_addr, int qtype, int64_t row_bytes,
                    Addr bias_addr, Addr y_addr, int y_dtype, int64_t ldy, int64_t M, int64_t N, int64_t K) {
  if (!int8_ok(path)) return -2;
  if (M <= 0 || N <= 0) return 0;
  if (!shape_ok(qtype, row_bytes, K)) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  auto quantize = path == kInt8Vnni ? avx512vnni::int8_quantize : avx2::int8_quantize;
  auto fn = path == kInt8Vnni ? avx512vnni::int8_gemm_cols : avx2::int8_gemm_cols;
  const int64_t kp = padded_k(K);
  thread_local Int8Buffers buf;
  Int8Rows rows{};
  return float_gemm("pipefill quantized int8 gemm", x_addr, x_dtype, ldx, bias_addr, y_addr, y_dtype, ldy, M,
                    N, K, std::max<int64_t>(1, 32768 / row_bytes),
                    [&](const float* xf, int64_t ldf) {
                      rows = buf.rows(M, kp);
                      quantize(xf, ldf, M, K, qtype, buf.nat, kp, buf.dx, kp / kUnit, &rows);
                    },
                    [&](const float*, int64_t, float* yf, int64_t ldf_y, int64_t n0, int64_t n1) {
                      fn(rows, M, w, qtype, row_bytes, K, yf, ldf_y, n0, n1);
                    });
}

// The integer path on blocks held in the 16-row layout (quant_int8_rows16.h,
// quant_int8_rows16_avx2.h; arguments as pf_qg_int8_gemm's, row_bytes the file's; W padded to
// whole groups of 16 rows).
// Returns 0, or -2 (path not usable here), -3 (bad arguments), -1 (exception).
int pf_qg_int8_rows16_gemm(int path, Addr x_addr, int x_dtype, int64_t ldx, Addr w_addr, int qtype,
                           int64_t row_bytes, Addr bias_addr, Addr y_addr, int y_dtype, int64_t ldy, int64_t M,
                           int64_t N, int64_t K) {
  if (!int8_ok(path)) return -2;
  if (M <= 0 || N <= 0) return 0;
  if (!shape_ok(qtype, row_bytes, K)) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  const int64_t units = K / kUnit;
  thread_local pg::ThreadScratch scratch;
  int8_t* q = nullptr;
  float* dx = nullptr;
  uint8_t* rec = nullptr;
  const bool vnni = path == kInt8Vnni;
  auto quantize = vnni ? avx512vnni::int8_quantize : avx2::int8_quantize;
  auto records = vnni ? avx512vnni::rows16_records : avx2::rows16_records;
  auto cols = vnni ? avx512vnni::rows16_gemm_cols : avx2::rows16_gemm_cols;
  return float_gemm("pipefill quantized int8 gemm (16 rows)", x_addr, x_dtype, ldx, bias_addr, y_addr, y_dtype,
                    ldy, M, N, K, std::max<int64_t>(1, 32768 / row_bytes),
                    [&](const float*, int64_t) {
                      const size_t codes = align64_bytes((size_t)(M * K)), scales = align64_bytes((size_t)(M * units) * 4);
                      char* base = static_cast<char*>(scratch.get(codes + scales + (size_t)(M * units) * 48));
                      q = reinterpret_cast<int8_t*>(base);
                      dx = reinterpret_cast<float*>(base + codes);
                      rec = reinterpret_cast<uint8_t*>(base + codes + scales);
                      // Each row's codes and scales are its own: quantized a few rows at a time.
                      widened_rows(x_addr, x_dtype, ldx, M, K, [&](const float* xf, int64_t ldf, int64_t m0, int64_t m1) {
                        quantize(xf, ldf, m1 - m0, K, qtype, q + m0 * K, K, dx + m0 * units, units, nullptr);
                      });
                      records(qtype, q, K, dx, units, M, units, rec);
                    },
                    [&](const float*, int64_t, float* yf, int64_t ldf_y, int64_t n0, int64_t n1) {
                      cols(rec, M, w, qtype, row_bytes, K, yf, ldf_y, n0, n1);
                    },
                    16, true);
}

// The integer path's quantization of float32 x [M, K] (row stride ldx; K a multiple of 32)
// into int8 codes q [M, K] and float32 scales dx [M, K / 32] (contiguous), for the tests.
int pf_qg_int8_quantize(int path, Addr x_addr, int64_t ldx, int64_t M, int64_t K, Addr q_addr, Addr dx_addr) {
  if (!int8_ok(path)) return -2;
  if (M <= 0) return 0;
  if (K <= 0 || K % kUnit) return -3;
  auto quantize = path == kInt8Vnni ? avx512vnni::int8_quantize : avx2::int8_quantize;
  return pg::guarded("pipefill int8 quantize", [&] {
    quantize(x_addr.as<const float>(), ldx, M, K, kQ8_0, q_addr.as<int8_t>(), K, dx_addr.as<float>(), K / kUnit,
             nullptr);
  });
}

// ---- FP8 e4m3 with 128 x 128 block scales (fp8_gemm_kernel.h) ----

// The AVX2 build widens FP8 through halves (F16C), which every AVX2 CPU has; checked all the same.
const char* fp8_isa_check(int isa) {
  if (const char* why = pg::vector_isa_check(isa)) return why;
  unsigned a, b, c, d;
  if (isa == kAvx2 && !(__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)))) return "no F16C";
  return nullptr;
}

bool fp8_isa_ok(int isa) {
  static const bool ok[3] = {fp8_isa_check(0) == nullptr, fp8_isa_check(kAvx2) == nullptr,
                             fp8_isa_check(kAvx512) == nullptr};
  return isa >= 0 && isa <= kAvx512 && ok[isa];
}

std::tuple<bool, std::string> pf_qg_fp8_isa_supported(int isa) {
  const char* why = fp8_isa_check(isa);
  return {why == nullptr, why ? why : "ok"};
}

// The GEMM on FP8 weights: W uint8 [N, K] (rows K bytes apart), scale float32 grid (row stride
// lds), scale_row int32 [N]: each weight row's grid row.
// Returns 0, or -2 (ISA not usable here), -3 (bad arguments), -1 (exception).
int pf_qg_fp8_gemm(int isa, Addr x_addr, int x_dtype, int64_t ldx, Addr w_addr, Addr scale_addr,
                   Addr scale_row_addr, int64_t lds, Addr bias_addr, Addr y_addr, int y_dtype, int64_t ldy,
                   int64_t M, int64_t N, int64_t K) {
  if (!fp8_isa_ok(isa)) return -2;
  if (M <= 0 || N <= 0) return 0;
  if (K <= 0 || lds < (K + kFp8Block - 1) / kFp8Block) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  const float* scale = scale_addr.as<const float>();
  const int32_t* scale_row = scale_row_addr.as<const int32_t>();
  auto fn = isa == kAvx512 ? avx512::fp8_gemm_cols : isa == kAvx2 ? avx2::fp8_gemm_cols : scalar::fp8_gemm_cols;
  return float_gemm("pipefill fp8 gemm", x_addr, x_dtype, ldx, bias_addr, y_addr, y_dtype, ldy, M, N, K,
                    std::max<int64_t>(1, 32768 / K), [](const float*, int64_t) {},
                    [&](const float* xf, int64_t ldf, float* yf, int64_t ldf_y, int64_t n0, int64_t n1) {
                      fn(xf, ldf, w, scale, scale_row, lds, M, K, yf, ldf_y, n0, n1);
                    });
}

// out[N, K] (row stride ldo, float32 or bf16 rounded to nearest even) = W dequantized, each
// weight code x scale rounded once to float32 (then to bf16).
int pf_qg_fp8_dequant(int isa, Addr w_addr, Addr scale_addr, Addr scale_row_addr, int64_t lds, int64_t N,
                      int64_t K, Addr out_addr, int out_dtype, int64_t ldo) {
  if (!fp8_isa_ok(isa)) return -2;
  if (N <= 0) return 0;
  if (K <= 0 || lds < (K + kFp8Block - 1) / kFp8Block) return -3;
  const uint8_t* w = w_addr.as<const uint8_t>();
  const float* scale = scale_addr.as<const float>();
  const int32_t* scale_row = scale_row_addr.as<const int32_t>();
  auto fn = isa == kAvx512 ? avx512::fp8_dequant_rows : isa == kAvx2 ? avx2::fp8_dequant_rows
                                                                     : scalar::fp8_dequant_rows;
  return pg::guarded("pipefill fp8 dequantize", [&] {
    at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t n0, int64_t n1) {
      fn(w, scale, scale_row, lds, K, n0, n1, out_addr.as<void>(), out_dtype == kBF16, ldo);
    });
  });
}

// ---- The memory read bandwidth a decode GEMM at M = 1 can reach ----

// Reads [addr, addr + nbytes) (64-byte aligned, whole 64-byte lines) once on the ISA's widest
// loads (xor_lines, quant_gemm_kernel.h), split into equal contiguous shares over torch's pool
// as the GEMMs split their columns. Returns the xor of its 64-bit words, or 0 where the ISA is
// not usable here (the caller checks first).
uint64_t pf_qg_stream_read(int isa, Addr addr, int64_t nbytes, int64_t ahead) {
  if (!pg::vector_isa_ok(isa)) return 0;
  auto fn = isa == kAvx512 ? avx512::stream_lines : isa == kAvx2 ? avx2::stream_lines : scalar::stream_lines;
  std::atomic<uint64_t> folded{0};
  at::parallel_for(0, nbytes / 64, 4096, [&](int64_t l0, int64_t l1) {
    folded.fetch_xor(fn(addr.as<const uint8_t>(), l0, l1, ahead));
  });
  return folded.load();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("pf_qg_isa_supported", &pg::vector_isa_supported);
  m.def("pf_qg_gemm", &pf_qg_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_dequant", &pf_qg_dequant, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_int8_supported", &pf_qg_int8_supported);
  m.def("pf_qg_int8_gemm", &pf_qg_int8_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_int8_rows16_gemm", &pf_qg_int8_rows16_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_int8_quantize", &pf_qg_int8_quantize, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_fp8_isa_supported", &pf_qg_fp8_isa_supported);
  m.def("pf_qg_fp8_gemm", &pf_qg_fp8_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_fp8_dequant", &pf_qg_fp8_dequant, py::call_guard<py::gil_scoped_release>());
  m.def("pf_qg_stream_read", &pf_qg_stream_read, py::call_guard<py::gil_scoped_release>());
}
