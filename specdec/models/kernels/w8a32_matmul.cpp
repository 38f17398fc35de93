// float32 activations x 8-bit weight groups -> float32, for specdec's W8A32Linear (specdec/models/w8a32.py;
// the library: specdec/models/native.py).
//
// A weight is scale * q + min per group of 32 inputs (q int8; scale and min float32, per output and
// group). That holds a 4- or 8-bit GGUF's weights (Q4_0, Q4_1, Q8_0) exactly, so the model then
// computes what float32 computes, up to the order of the float sums:
//   y[m, n] = sum over groups g (in order) of fma(min[n, g], xsum[m, g], dot[m, n, g] * scale[n, g])
//   dot[m, n, g] = fma chain over the group's inputs k in order: dot = fma(x[m, k], q[n, k], dot)
//   xsum[m, g] = x[m, k] summed over the group's inputs in order
// Each operation is one IEEE float32 fma, multiply or add in exactly this order (compiled with
// -ffp-contract=off; the fmas are written out), on every path: AVX-512, AVX2 + FMA, or portable
// C++ with std::fmaf. Each row is computed alone by the same instructions whatever else is in the
// call, so a token scores the same inside a verify block as alone.
//
// Weights (specdec.models.w8a32.pack_weight): column blocks of 16 outputs; per (block, group) a record of
// 640 bytes: 32 inputs x 16 columns of int8 (byte 16k + c: column c's q for input k), then 16 float32
// scales, then 16 float32 mins.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "specdec_kernels.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
constexpr int kCols = 16, kGroup = 32, kRecord = 640, kScales = 512, kMins = 576;

#if defined(__AVX512F__)
constexpr int kRows = 12;
// `rows` rows x one column block of 16: a zmm register holds the block's 16 columns, so each row
// needs one fma chain and one running total (the AVX2 path's two of each, half as wide; each lane
// runs the same operations in the same order, so the bits are the same). 32 registers hold 12
// rows' chains and totals beside the weights and a broadcast: a 12-token block reads the weights once.
template <int rows>
void block_rows(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t N, int64_t K, int64_t block) {
  const int64_t groups = K / kGroup;
  __m512 total[rows];
  for (int r = 0; r < rows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = w + (block * groups + g) * kRecord;
    for (int line = 0; line < kRecord; line += 64) _mm_prefetch((const char*)record + 4 * kRecord + line, _MM_HINT_T0);
    __m512 dot[rows];
    for (int r = 0; r < rows; ++r) dot[r] = _mm512_setzero_ps();
    for (int k = 0; k < kGroup; ++k) {
      const __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(record + kCols * k))));
      for (int r = 0; r < rows; ++r) dot[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + g * kGroup + k]), weights, dot[r]);
    }
    const __m512 scale = _mm512_loadu_ps((const float*)(record + kScales));
    const __m512 mins = _mm512_loadu_ps((const float*)(record + kMins));
    for (int r = 0; r < rows; ++r)
      total[r] = _mm512_add_ps(total[r], _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[r * groups + g]), _mm512_mul_ps(dot[r], scale)));
  }
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * N + block * kCols, total[r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 6;
// `rows` rows x one column block of 16 (columns are independent: each output's arithmetic is the
// same whichever others share the loop). A row alone takes one block at a time too: its records
// are then read as one sequential stream per thread. Four blocks at once (8 fma chains to hide the
// fma latency) measured a third slower for a one-token forward once the weights stream from memory
// (docs/design.md, "The default pair's one-token forward").
// The 16 ymm registers hold 2 fma chains a row, the weights and a broadcast: 6 rows a pass. Up to
// 3 rows the running totals stay in registers too; past that they wait in y between groups (the
// same additions in the same order), so a 4- to 6-token block reads the weights once, not twice.
template <int rows>
void block_rows(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t N, int64_t K, int64_t block) {
  constexpr bool totals_in_registers = rows <= 3;
  const int64_t groups = K / kGroup;
  float* out = y + block * kCols;
  __m256 total[rows][2];
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      total[r][h] = _mm256_setzero_ps();
      if constexpr (!totals_in_registers) _mm256_storeu_ps(out + r * N + 8 * h, total[r][h]);
    }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = w + (block * groups + g) * kRecord;
    for (int line = 0; line < kRecord; line += 64) _mm_prefetch((const char*)record + 4 * kRecord + line, _MM_HINT_T0);
    __m256 dot[rows][2];
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_setzero_ps();
    for (int k = 0; k < kGroup; ++k) {
      __m256 weights[2];
      for (int h = 0; h < 2; ++h)
        weights[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(record + kCols * k + 8 * h))));
      for (int r = 0; r < rows; ++r) {
        const __m256 xs = _mm256_broadcast_ss(x + r * K + g * kGroup + k);
        for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_fmadd_ps(xs, weights[h], dot[r][h]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_loadu_ps((const float*)(record + kScales) + 8 * h);
      const __m256 mins = _mm256_loadu_ps((const float*)(record + kMins) + 8 * h);
      for (int r = 0; r < rows; ++r) {
        float* kept = out + r * N + 8 * h;
        const __m256 before = totals_in_registers ? total[r][h] : _mm256_loadu_ps(kept);
        total[r][h] = _mm256_add_ps(
            before, _mm256_fmadd_ps(mins, _mm256_set1_ps(xsum[r * groups + g]), _mm256_mul_ps(dot[r][h], scale)));
        if constexpr (!totals_in_registers) _mm256_storeu_ps(kept, total[r][h]);
      }
    }
  }
  if constexpr (totals_in_registers)
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * N + 8 * h, total[r][h]);
}
#else
constexpr int kRows = 1;
template <int rows>
void block_rows(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t N, int64_t K, int64_t block) {
  const int64_t groups = K / kGroup;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < kCols; ++c) {
      float total = 0.0f;
      const uint8_t* record = w + block * groups * kRecord;
      for (int64_t g = 0; g < groups; ++g, record += kRecord) {
        float dot = 0.0f;
        for (int k = 0; k < kGroup; ++k) dot = std::fmaf(x[r * K + g * kGroup + k], float(int8_t(record[kCols * k + c])), dot);
        float scale, minimum;
        std::memcpy(&scale, record + kScales + 4 * c, 4);
        std::memcpy(&minimum, record + kMins + 4 * c, 4);
        total = total + std::fmaf(minimum, xsum[r * groups + g], dot * scale);
      }
      y[r * N + block * kCols + c] = total;
    }
}
#endif

// Rows r0.. of one parallel span's column blocks block..block + spans - 1 (4, fewer at the matrix's end).
template <int rows>
void rows_of_block(const float* x, const float* xsum, const uint8_t* w, float* y, int left, int64_t N, int64_t K,
                   int64_t block, int64_t spans) {
  if constexpr (rows > 1) {
    if (left < rows) return rows_of_block<rows - 1>(x, xsum, w, y, left, N, K, block, spans);
  }
  for (int64_t b = block; b < block + spans; ++b) block_rows<rows>(x, xsum, w, y, N, K, b);
}
}  // namespace

extern "C" {
// The instruction set this build uses (for the one-line notice).
const char* specdec_w8a32_isa() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2 + FMA";
#else
  return "portable C++";
#endif
}

// x [M, K] float32, w: N / 16 blocks of K / 32 records, y [M, N] float32. N a multiple of 16, K of 32.
void specdec_w8a32_linear(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = N / kCols, groups = K / kGroup;
  std::vector<float> xsum(M * groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int k = 0; k < kGroup; ++k) sum = sum + x[m * K + g * kGroup + k];
      xsum[m * groups + g] = sum;
    }
  const int64_t spans = (blocks + 3) / 4;
#pragma omp parallel for schedule(static)
  for (int64_t span = 0; span < spans; ++span)
    for (int64_t r0 = 0; r0 < M; r0 += kRows)
      rows_of_block<kRows>(x + r0 * K, xsum.data() + r0 * groups, w, y + r0 * N, int(M - r0), N, K, 4 * span,
                           std::min<int64_t>(4, blocks - 4 * span));
}
}
