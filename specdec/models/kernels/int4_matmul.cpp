// int8 activations x 4-bit weights -> float32, for specdec's Int4Linear (specdec/models/int4.py; the
// library: specdec/models/native.py).
//
// Weights w ~ d[n, s] * sc[n, g] * q - dmin[n, s] * mn[n, g]: 4-bit codes q (0..15) in groups g of 32
// inputs, each group's scale and min as 8-bit integers sc, mn under a float16 scale d, dmin per
// super-block s of 8 groups (256 inputs; the last may be shorter): 4.625 bits a weight.
//
// y[m, n] = xscale[m] * sum over super-blocks s (in order) of
//           (float(isum[m, n, s]) * d[n, s] - float(msum[m, n, s]) * dmin[n, s])
// isum = sum over the super-block's groups of sc[n, g] * dot[m, n, g], msum = sum of mn[n, g] * xsum[m, g]:
// dot is the exact integer dot product of the row's int8 activations with the group's codes, xsum
// the sum of the row's activations in the group; both sums are exact in int32 (|isum| <= 8 x 255 x
// 15 x 127 x 32 < 2^27). Every float operation is one IEEE float32 multiply, subtract or add in
// exactly this order (compiled with -ffp-contract=off): specdec.models.int4.reference_matmul
// computes the same bits with torch. Each row is computed alone by the same instructions whatever
// else is in the call, so a token scores the same inside a verify block as alone.
//
// Weights (specdec.models.int4.pack_weight): column blocks of 16 outputs; per (block, super-block),
// for each group 288 bytes: 4 steps of 64 bytes (step s: byte 4c + j holds column c's code for input
// 8s + j in its low nibble and for input 8s + 4 + j in its high nibble), then the 16 columns'
// sub-scales sc and sub-mins mn (a byte each); after the super-block's groups, its 16 float16 d and
// 16 float16 dmin. Integer products: u8 code x s8 activation, at most 15 x 127 x 2 per pair: no
// saturation even on AVX2's int16 pair sums (vpmaddubsw).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "float16.h"
#include "specdec_kernels.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
constexpr int kCols = 16, kGroup = 32, kSuper = 8;
// A group's bytes (256 of 4-bit codes, 16 sub-scales, 16 sub-mins) and a super-block's tail (16
// float16 scales, 16 float16 min scales).
constexpr int kGroupBytes = 288, kTailBytes = 64;
// Software prefetch distance in bytes (8 groups ahead). Why: a block's records span several 4 KiB
// pages and the hardware prefetchers stop at page boundaries; once a verify block of 8 rows makes
// the kernel compute-bound, each such miss stalled it (VNNI, 1.5B int4, 8 rows: 62 -> 44 ms of
// matmuls a step, benchmarks/cpu/roofline.py).
constexpr int kAhead = 8 * kGroupBytes;

// The bytes of one column block's records over K inputs: every group's, and a tail per super-block.
inline int64_t block_bytes(int64_t groups) { return groups * kGroupBytes + (groups + kSuper - 1) / kSuper * kTailBytes; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 rows a tile, so that a verify block of up to 16 tokens unpacks each weight once. Past 8 rows
// the integer dots run 4 rows at a time, two chains a row (low and high nibbles), so that 8
// independent vpdpbusd chains hide the instruction's latency without 16 rows' chains in registers.
constexpr int kRows = 16;
constexpr int kQuad = 4;
// acc + the 16 u8 x s8 dot products of 4 bytes: w's in each 32-bit lane with the 4 bytes at x in
// every lane. Written out so that the broadcast rides in the instruction's memory operand (GCC
// otherwise emits a separate vpbroadcastd for each, which measured ~10% of a 16-row block).
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)x));
  return acc;
}
template <int rows>
void block_rows(const int8_t* x, const int16_t* xsum, const float* xscale, const uint8_t* w, float* y,
                int64_t N, int64_t K, int64_t block) {
  const int64_t groups = K / kGroup;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 accf[rows];
  for (int r = 0; r < rows; ++r) accf[r] = _mm512_setzero_ps();
  const uint8_t* record = w + block * block_bytes(groups);
  const int8_t* xg = x;
  for (int64_t first = 0; first < groups; first += kSuper) {
    const int count = int(std::min<int64_t>(kSuper, groups - first));
    const uint8_t* super_block = record;
    __m512i isum[rows];  // the super-block's sum of sub-scale x dot, exact in int32
    for (int r = 0; r < rows; ++r) isum[r] = _mm512_setzero_si512();
    for (int g = 0; g < count; ++g, record += kGroupBytes, xg += rows * kGroup) {
      for (int line = 0; line < kGroupBytes; line += 64) _mm_prefetch((const char*)record + kAhead + line, _MM_HINT_T0);
      __m512i low[4], high[4];
      for (int s = 0; s < 4; ++s) {
        const __m512i packed = _mm512_loadu_si512(record + 64 * s);
        low[s] = _mm512_and_si512(packed, nibble);
        high[s] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      }
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(record + 256)));
      if constexpr (rows <= 8) {  // one chain a row, all rows in flight: what measured fastest up to 8
        __m512i acci[rows];
        for (int r = 0; r < rows; ++r) acci[r] = _mm512_setzero_si512();
        for (int s = 0; s < 4; ++s)
          for (int r = 0; r < rows; ++r) {
            const int8_t* xs = xg + r * kGroup + 8 * s;
            acci[r] = dpbusd_broadcast(acci[r], low[s], xs);
            acci[r] = dpbusd_broadcast(acci[r], high[s], xs + 4);
          }
        for (int r = 0; r < rows; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(acci[r], scale));
      } else {
#pragma GCC unroll 4
        for (int r0 = 0; r0 < rows; r0 += kQuad) {
          const int n = rows - r0 < kQuad ? rows - r0 : kQuad;
          __m512i lo[kQuad], hi[kQuad];
          for (int j = 0; j < n; ++j) lo[j] = hi[j] = _mm512_setzero_si512();
          for (int s = 0; s < 4; ++s)
            for (int j = 0; j < n; ++j) {
              const int8_t* xs = xg + (r0 + j) * kGroup + 8 * s;
              lo[j] = dpbusd_broadcast(lo[j], low[s], xs);
              hi[j] = dpbusd_broadcast(hi[j], high[s], xs + 4);
            }
          for (int j = 0; j < n; ++j)
            isum[r0 + j] = _mm512_add_epi32(isum[r0 + j], _mm512_mullo_epi32(_mm512_add_epi32(lo[j], hi[j]), scale));
        }
      }
    }
    // The mins' side once a super-block: sum of sub-min x the row's group sums (exact in int32),
    // two groups a vpdpwssd (the sub-mins of a pair of groups as int16 pairs in each column's lane,
    // read again from the records just streamed, in L1; the row's two group sums side by side).
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)record));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(record + 32)));
    record += kTailBytes;
    const int pairs = (count + 1) / 2;
    __m512i min_pairs[kSuper / 2];
    for (int j = 0; j < pairs; ++j) {
      const uint8_t* even = super_block + 2 * j * kGroupBytes + 272;
      const __m512i odd = 2 * j + 1 < count ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(even + kGroupBytes)))
                                            : _mm512_setzero_si512();
      min_pairs[j] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)even)), _mm512_slli_epi32(odd, 16));
    }
    const int16_t* pair_sums = xsum + first * rows;  // (first / 2) pairs of rows x 2 sums
    for (int r = 0; r < rows; ++r) {
      __m512i msum = _mm512_setzero_si512();
      for (int j = 0; j < pairs; ++j) {
        int32_t two;
        std::memcpy(&two, pair_sums + (j * rows + r) * 2, 4);
        msum = _mm512_dpwssd_epi32(msum, min_pairs[j], _mm512_set1_epi32(two));
      }
      const __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), d);
      const __m512 t2 = _mm512_mul_ps(_mm512_cvtepi32_ps(msum), dmin);
      accf[r] = _mm512_add_ps(accf[r], _mm512_sub_ps(t1, t2));
    }
  }
  for (int r = 0; r < rows; ++r)
    _mm512_storeu_ps(y + r * N + block * kCols, _mm512_mul_ps(accf[r], _mm512_set1_ps(xscale[r])));
}
#elif defined(__AVX2__) && defined(__F16C__)
// 4 rows x 16 columns: 16 accumulators in 16 ymm registers, so some spill; still faster than 3
// rows, which split a 4-token block in two passes (Zen 4 capped to AVX2, 1.5B int4: T(4) 53.7 vs
// 59.3 ms, T(8) 104 vs 117; docs/benchmarks/archive/cpu/flat-blocks-epyc-vnni).
constexpr int kRows = 4;
template <int rows>
void block_rows(const int8_t* x, const int16_t* xsum, const float* xscale, const uint8_t* w, float* y,
                int64_t N, int64_t K, int64_t block) {
  const int64_t groups = K / kGroup;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 accf[rows][2];  // a ymm register holds 8 of the block's 16 columns: two halves
  for (int r = 0; r < rows; ++r) accf[r][0] = accf[r][1] = _mm256_setzero_ps();
  const uint8_t* record = w + block * block_bytes(groups);
  for (int64_t first = 0; first < groups; first += kSuper) {
    const int count = int(std::min<int64_t>(kSuper, groups - first));
    const uint8_t* super_block = record;
    __m256i isum[rows][2];
    for (int r = 0; r < rows; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < count; ++g, record += kGroupBytes) {
      for (int line = 0; line < kGroupBytes; line += 64) _mm_prefetch((const char*)record + kAhead + line, _MM_HINT_T0);
      // Each int16 lane sums 8 pair sums of the group: at most 16 x 15 x 127 = 30480 < 2^15, so
      // the lanes are exact in int16; one vpmaddwd with the sub-scale in both halves of a column's
      // 32-bit lane multiplies and widens them (at most 2 x 30480 x 255 < 2^31).
      __m256i acc16[rows][2];
      for (int r = 0; r < rows; ++r) acc16[r][0] = acc16[r][1] = _mm256_setzero_si256();
      for (int s = 0; s < 4; ++s) {
        __m256i low[2], high[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i packed = _mm256_loadu_si256((const __m256i*)(record + 64 * s + 32 * h));
          low[h] = _mm256_and_si256(packed, nibble);
          high[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        }
        for (int r = 0; r < rows; ++r) {
          const int8_t* xs = x + ((first + g) * rows + r) * kGroup + 8 * s;
          int32_t x0, x1;
          std::memcpy(&x0, xs, 4);
          std::memcpy(&x1, xs + 4, 4);
          const __m256i x0s = _mm256_set1_epi32(x0), x1s = _mm256_set1_epi32(x1);
          for (int h = 0; h < 2; ++h)
            acc16[r][h] = _mm256_add_epi16(
                acc16[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(low[h], x0s), _mm256_maddubs_epi16(high[h], x1s)));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i scale = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(record + 256 + 8 * h)));
        const __m256i scale_pairs = _mm256_or_si256(scale, _mm256_slli_epi32(scale, 16));
        for (int r = 0; r < rows; ++r) isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(acc16[r][h], scale_pairs));
      }
    }
    const int pairs = (count + 1) / 2;
    const int16_t* pair_sums = xsum + first * rows;  // (first / 2) pairs of rows x 2 sums
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(record + 16 * h)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(record + 32 + 16 * h)));
      __m256i min_pairs[kSuper / 2];  // a pair of groups' sub-mins as int16 pairs in each column's lane
      for (int j = 0; j < pairs; ++j) {
        const uint8_t* even = super_block + 2 * j * kGroupBytes + 272 + 8 * h;
        const __m256i odd = 2 * j + 1 < count ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(even + kGroupBytes)))
                                              : _mm256_setzero_si256();
        min_pairs[j] = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)even)),
                                       _mm256_slli_epi32(odd, 16));
      }
      for (int r = 0; r < rows; ++r) {
        __m256i msum = _mm256_setzero_si256();
        for (int j = 0; j < pairs; ++j) {
          int32_t two;
          std::memcpy(&two, pair_sums + (j * rows + r) * 2, 4);
          msum = _mm256_add_epi32(msum, _mm256_madd_epi16(min_pairs[j], _mm256_set1_epi32(two)));
        }
        const __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][h]), d);
        const __m256 t2 = _mm256_mul_ps(_mm256_cvtepi32_ps(msum), dmin);
        accf[r][h] = _mm256_add_ps(accf[r][h], _mm256_sub_ps(t1, t2));
      }
    }
    record += kTailBytes;
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(y + r * N + block * kCols + 8 * h, _mm256_mul_ps(accf[r][h], _mm256_set1_ps(xscale[r])));
}
#else
constexpr int kRows = 1;
using specdec16::half_to_float;
template <int rows>
void block_rows(const int8_t* x, const int16_t* xsum, const float* xscale, const uint8_t* w, float* y,
                int64_t N, int64_t K, int64_t block) {
  const int64_t groups = K / kGroup;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < kCols; ++c) {
      float accf = 0.0f;
      const uint8_t* record = w + block * block_bytes(groups);
      for (int64_t first = 0; first < groups; first += kSuper) {
        const int count = int(std::min<int64_t>(kSuper, groups - first));
        int32_t isum = 0, msum = 0;
        for (int g = 0; g < count; ++g, record += kGroupBytes) {
          int32_t dot = 0;
          for (int s = 0; s < 4; ++s)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = record[64 * s + 4 * c + j];
              const int8_t* xs = x + ((first + g) * rows + r) * kGroup + 8 * s;
              dot += int32_t(byte & 0x0F) * xs[j] + int32_t(byte >> 4) * xs[4 + j];
            }
          isum += int32_t(record[256 + c]) * dot;
          msum += int32_t(record[272 + c]) * xsum[(((first + g) / 2) * rows + r) * 2 + (first + g) % 2];
        }
        uint16_t d_bits, dmin_bits;
        std::memcpy(&d_bits, record + 2 * c, 2);
        std::memcpy(&dmin_bits, record + 32 + 2 * c, 2);
        const float t1 = float(isum) * half_to_float(d_bits);
        const float t2 = float(msum) * half_to_float(dmin_bits);
        accf = accf + (t1 - t2);
        record += kTailBytes;
      }
      y[r * N + block * kCols + c] = accf * xscale[r];
    }
  }
}
#endif

template <int rows>
void rows_of_block(const int8_t* x, const int16_t* xsum, const float* xscale, const uint8_t* w, float* y,
                   int left, int64_t N, int64_t K, int64_t block) {
  if constexpr (rows > 1) {
    if (left < rows) return rows_of_block<rows - 1>(x, xsum, xscale, w, y, left, N, K, block);
  }
  block_rows<rows>(x, xsum, xscale, w, y, N, K, block);
}

// The M rows in tiles of at most kRows, as even as can be (12 rows: 6 + 6, not 8 + 4: a short tile
// shares each unpacked weight among fewer rows). Row m's tile: its first row and its row count.
void tile_of(int64_t m, int64_t M, int64_t& start, int64_t& rows) {
  const int64_t tiles = (M + kRows - 1) / kRows, base = M / tiles, big = (M % tiles) * (base + 1);
  rows = m < big ? base + 1 : base;
  start = m < big ? m / rows * rows : big + (m - big) / rows * rows;
}

// max |x| over a row. Where a value is NaN, std::max(largest, NaN) keeps largest, as vmaxps(NaN, largest) does.
inline float largest_magnitude(const float* row, int64_t K) {
  float largest = 0.0f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) lanes = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row + k)), lanes);
  largest = _mm512_reduce_max_ps(lanes);
#endif
  for (; k < K; ++k) largest = std::max(largest, std::fabs(row[k]));
  return largest;
}

// A group's 32 int8 codes round-half-even(x / scale) (one IEEE division each, the current rounding
// mode: nearest-even, as std::nearbyint), written to into; returns their sum.
inline int32_t quantize_group(const float* values, float scale, int8_t* into) {
#if defined(__AVX512F__)
  const __m512 divisor = _mm512_set1_ps(scale);
  const __m512i low = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(values), divisor));
  const __m512i high = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(values + 16), divisor));
  _mm_storeu_si128((__m128i*)into, _mm512_cvtepi32_epi8(low));
  _mm_storeu_si128((__m128i*)(into + 16), _mm512_cvtepi32_epi8(high));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(low, high));
#else
  int32_t sum = 0;
  for (int k = 0; k < kGroup; ++k) {
    const int32_t value = int32_t(std::nearbyint(values[k] / scale));
    into[k] = int8_t(value);
    sum += value;
  }
  return sum;
#endif
}

// Per-row int8 activations, as torch computes them in specdec.models.int4.quantize_rows:
// scale = max|x| / 127 (at least 1e-12 / 127), q = round-half-even(x / scale), and each group's sum.
// Written tiled as block_rows reads them: the rows in tiles (tile_of), and within a tile group by
// group, the tile's rows' 32 values side by side; the sums (int16: at most 32 x 127) a pair of
// groups at a time, each row's two side by side (one vpdpwssd multiplies them by two groups'
// sub-mins). Why: the kernel then reads one sequential stream of activations, not one per row
// (measured: 5-7% of a verify block's matmuls on VNNI at 8-16 rows).
void quantize_rows(const float* x, int8_t* q, int16_t* sums, float* scales, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup, pairs = (groups + 1) / 2;
  // Rows on both cores when there are several (a verify block): alone, this loop kept one core
  // waiting (measured: ~4% of a 16-token step). Each row's arithmetic is the same either way.
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    int64_t tile, rows;
    tile_of(m, M, tile, rows);
    const int64_t r = m - tile;
    const float scale = std::max(largest_magnitude(row, K), 1e-12f) / 127.0f;
    scales[m] = scale;
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t sum = quantize_group(row + g * kGroup, scale, q + tile * K + (g * rows + r) * kGroup);
      sums[tile * 2 * pairs + ((g / 2) * rows + r) * 2 + g % 2] = int16_t(sum);  // |sum| <= 32 x 127
    }
    if (groups % 2) sums[tile * 2 * pairs + ((groups / 2) * rows + r) * 2 + 1] = 0;  // an odd count's pad
  }
}

// Rows a panel at most: a long prompt's rows go through every column block a panel at a time. Why:
// one pass over all M rows for each block of 16 columns read the whole activation matrix again for
// each block, from memory once it outgrew the caches (a 4096-token prefill: 36 MB of the down
// projection's input, 96 times a layer); a panel's activations stay in the caches while its blocks
// go by, and the weights are read once a panel. Measured on the MLP call alone (1.5B int4, AVX-512
// VNNI): 0.144 ms a row at 256 rows, 0.156 at 1,257 and 0.168 at 4,096 in one pass.
constexpr int64_t kPanelRows = 256;

// x, xsum: M rows tiled (quantize_rows), xscale [M], w: N / 16 column blocks (block_bytes each), y [M, N]
// float32. N a multiple of 16, K of 32.
void matmul(const int8_t* x, const int16_t* xsum, const float* xscale, const uint8_t* w, float* y,
            int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = N / kCols, pairs = (K / kGroup + 1) / 2;
  const int64_t panel_tiles = std::max<int64_t>(1, kPanelRows / kRows);
  for (int64_t first = 0, end = 0; first < M; first = end) {
    for (int64_t tile = 0; tile < panel_tiles && end < M; ++tile) {  // the panel: up to panel_tiles tiles
      int64_t start, rows;
      tile_of(end, M, start, rows);
      end += rows;
    }
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < blocks; ++block)
      for (int64_t r0 = first, rows = 0; r0 < end; r0 += rows) {
        int64_t start;
        tile_of(r0, M, start, rows);
        rows_of_block<kRows>(x + r0 * K, xsum + r0 * 2 * pairs, xscale + r0, w, y + r0 * N, int(rows), N, K, block);
      }
  }
}
}  // namespace

extern "C" {
// The instruction set this build uses (for the one-line notice).
const char* specdec_int4_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "AVX-512 VNNI";
#elif defined(__AVX2__) && defined(__F16C__)
  return "AVX2";
#else
  return "portable C++";
#endif
}

// y [M, N] = x [M, K] float32 rows, quantized here (quantize_rows), times the packed weights w
// (N / 16 column blocks of block_bytes(K / 32) bytes; N a multiple of 16, K of 32).
void specdec_int4_linear(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  // Scratch kept per calling thread up to a verify block's size; a long prefill's is freed.
  using specdec::Scratch, specdec::ScratchFor;
  const bool keep = M * K <= (int64_t(1) << 22);
  const Scratch<int8_t, ScratchFor::kInt4Activations> q(M * K, keep);
  const Scratch<int16_t, ScratchFor::kInt4GroupSums> sums(M * 2 * ((K / kGroup + 1) / 2), keep);
  const Scratch<float, ScratchFor::kInt4RowScales> scales(M, keep);
  quantize_rows(x, q.get(), sums.get(), scales.get(), M, K);
  matmul(q.get(), sums.get(), scales.get(), w, y, M, N, K);
}
}
