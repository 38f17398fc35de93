// Attention of each query over exactly its own keys, for specdec's compiled layers
// (specdec/models/fused_layer.py, drafting/fused_head.py) and the stack in one call (stack.cpp):
// specdec_attend (per-query slot lists: a verify block, a tree's nodes, a server's batch) and
// specdec_attend_chain (a chain over its row: a prompt), each writing the tokens' new keys and values
// into the cache (float32, or bfloat16 / float16 rounded as torch rounds them) first.
//
// Exactness: a query's scores, softmax and sums are computed by the same instructions in the same
// order whatever else is in the call or however the work is split across threads, so a token scores
// the same inside a verify block as alone. Reductions (dot products, softmax sums) run in 8
// interleaved lanes summed in a fixed order; compiled with -ffp-contract=off, no -ffast-math, so
// nothing is reassociated or fused but the fused multiply-adds written out.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "float16.h"
#include "layer_common.h"
#include "specdec_kernels.h"
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
using specdec::AlignedFloats;
using specdec::Scratch;
using specdec::ScratchFor;

// A stored key or value element: float32, or 16 bits (bfloat16 or float16) widened to float32
// exactly, in registers or one at a time (the same floats either way).
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};
inline float element(const float* at, int64_t i) { return at[i]; }
inline float element(const BFloat16* at, int64_t i) { return specdec16::bfloat16_to_float(at[i].bits); }
inline float element(const Float16* at, int64_t i) { return specdec16::half_to_float(at[i].bits); }
#if defined(__AVX2__) && defined(__F16C__)
inline __m256 load8(const float* at) { return _mm256_loadu_ps(at); }
inline __m256 load8(const BFloat16* at) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const Float16* at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))); }
#define SPECDEC_LOAD8 1
#endif

// How the cache stores keys and values (specdec_attend's kv_format): 0 float32, 1 bfloat16, 2 float16.
constexpr int64_t kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2;

// use(at as a pointer to the stored element type).
template <typename Use>
void with_elements(int64_t format, const char* at, Use&& use) {
  if (format == kFloat32) use(reinterpret_cast<const float*>(at));
  else if (format == kBFloat16) use(reinterpret_cast<const BFloat16*>(at));
  else use(reinterpret_cast<const Float16*>(at));
}

// The attention's products are fused multiply-adds, one rounding each (std::fma where there is no
// vector path: the same bits, slowly, on a CPU without FMA): half the arithmetic instructions of a
// multiply then an add, in scoring and in gathering alike.
#if defined(__AVX2__) && defined(__FMA__)
#define SPECDEC_FMA8 1
#endif

// A dot product as layer_ops.cpp's dot(), its products fused: 8 interleaved lanes summed in a fixed
// order, then the tail.
float fused_dot(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
  float tail = 0.0f;
  for (; i < n; ++i) tail = std::fma(a[i], b[i], tail);
  return (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) + tail;
}

// out[c] = fused_dot(query, keys + c * d, d) * scale for c < count, the same bits each: 8 keys at
// once (8 independent lane chains), their 8 lanes summed in fused_dot()'s order by two horizontal
// adds and a half swap (hadd gives (l0 + l1), (l2 + l3) ...; the halves then add as it does). keys:
// count consecutive float32 keys of d elements (a chunk widened from the cache).
void score_keys(const float* query, const float* keys, int64_t count, int64_t d, float scale, float* out) {
  int64_t c = 0;
#if defined(SPECDEC_FMA8)
  if (d % 8 == 0) {
    for (; c + 8 <= count; c += 8) {
      const float* key = keys + c * d;
      __m256 lanes[8];
      for (int kk = 0; kk < 8; ++kk) lanes[kk] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(query + i);
        for (int kk = 0; kk < 8; ++kk) lanes[kk] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key + kk * d + i), lanes[kk]);
      }
      const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(lanes[0], lanes[1]), _mm256_hadd_ps(lanes[2], lanes[3]));
      const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(lanes[4], lanes[5]), _mm256_hadd_ps(lanes[6], lanes[7]));
      __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31));
      dots = _mm256_add_ps(dots, _mm256_setzero_ps());  // fused_dot()'s "+ tail" (0 here): -0 becomes +0 alike
      _mm256_storeu_ps(out + c, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
    }
  }
#endif
  for (; c < count; ++c) out[c] = fused_dot(query, keys + c * d, d) * scale;
}

// Keys and values stored in 16 bits, computed with in float32: a stored element is rounded to
// nearest even as torch rounds it (so a key the compiled attention stores is the key torch stores),
// and widened back exactly.
template <typename Element>
void widen(const Element* from, float* to, int64_t n) {
  int64_t i = 0;
#if defined(SPECDEC_LOAD8)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, load8(from + i));
#endif
  for (; i < n; ++i) to[i] = element(from, i);
}

// n floats into a cache slot in kv_format.
void store_elements(const float* from, char* to, int64_t n, int64_t format) {
  if (format == kFloat32) {
    std::memcpy(to, from, n * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t bits = format == kBFloat16 ? specdec16::float_to_bfloat16(from[i]) : specdec16::float_to_half(from[i]);
    std::memcpy(to + 2 * i, &bits, 2);
  }
}

// Scores soft-capped before the softmax where cap > 0 (gemma2's attn_logit_softcapping), as the
// reference: tanh(x / cap) * cap, one element at a time (std::tanh: the same bits on every path).
void soft_cap(float* x, int64_t n, float cap) {
  if (cap > 0.0f)
    for (int64_t j = 0; j < n; ++j) x[j] = std::tanh(x[j] / cap) * cap;
}

// The largest of x[0..n): 8 lanes at a time (a running maximum, one compare per key, was a
// latency-bound chain over a long context). The maximum of a set is the same whatever the order,
// and exp(x - top) is the same for a top of -0 or +0: for scores that are numbers, the weights of
// the plain loop, bit for bit.
float largest(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 tops = _mm256_loadu_ps(x);
    for (j = 8; j + 8 <= n; j += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(x + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    for (const float lane : lanes) top = std::max(top, lane);
  }
#endif
  for (; j < n; ++j) top = std::max(top, x[j]);
  return top;
}

// x[j] = exp(x[j] - top), each element's bits those of exp_scalar(x[j] - top) on either path; returns
// their sum in 8 interleaved lanes summed in a fixed order (as fused_dot(): a single running sum over a
// long context was a latency-bound chain of one add per key).
float exp_minus_and_sum(float* x, float top, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
#if defined(__AVX2__)
  __m256 sums = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_vector(_mm256_sub_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(top)));
    _mm256_storeu_ps(x + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  _mm256_storeu_ps(lanes, sums);
#else
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) {
      x[j + l] = exp_scalar(x[j + l] - top);
      lanes[l] += x[j + l];
    }
#endif
  float tail = 0.0f;
  for (; j < n; ++j) {
    x[j] = exp_scalar(x[j] - top);
    tail += x[j];
  }
  return (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) + tail;
}

constexpr int64_t kChunk = 32;   // slots widened at once: they stay in the first-level caches
constexpr int64_t kSpan = 256;   // slots one scoring job covers
#if defined(__AVX512F__)
constexpr int64_t kSliceVectors = 4;  // 32 registers: 6 heads' sums of a 32-element slice (a 16-bit cache line)
#else
constexpr int64_t kSliceVectors = 2;  // 16 registers: 6 heads' sums of a 16-element slice
#endif
constexpr int64_t kSlice = 8 * kSliceVectors;  // elements of a value one gathering job covers (where d allows)
constexpr int64_t kHeadsAtOnce = 6;
constexpr int64_t kPairsPerThread = 4;  // (row, kv head) pairs a thread that attends them whole should get
constexpr int64_t kMembersAtOnce = 16;  // a row's queries one scoring job covers (a long prompt piece's are many)

constexpr int64_t kAhead = 16;  // slots ahead whose cache lines are prefetched (a paged row's blocks
                                 // are scattered: the hardware's stream prefetch stops at each jump)

inline void prefetch(const void* at) {
#if defined(__x86_64__)
  _mm_prefetch(static_cast<const char*>(at), _MM_HINT_T0);
#endif
}

// out[h][t] = (sum over j < count in order of weights[h][j] * value(list[j])[t0 + t]) / totals[h]
// for t < width and h < heads; value(s) the d elements at values + (base + s * d). The vector
// path's sums are the plain loop's, element by element, whatever the slice's width. Heads, a
// template argument, so that every head's sums stay in registers.
template <int64_t Heads, typename Element>
void gather_slice(const float* const* weights, const float* totals, const Element* values, int64_t base,
                  const int64_t* list, int64_t count, int64_t d, int64_t t0, int64_t width, float* const* out) {
#if defined(SPECDEC_LOAD8) && defined(SPECDEC_FMA8)
  if (width == kSlice) {
    __m256 sums[Heads][kSliceVectors];
    for (int64_t h = 0; h < Heads; ++h)
      for (int64_t u = 0; u < kSliceVectors; ++u) sums[h][u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      if (j + kAhead < count) prefetch(values + base + list[j + kAhead] * d + t0);
      const Element* value = values + base + list[j] * d + t0;
      __m256 parts[kSliceVectors];
      for (int64_t u = 0; u < kSliceVectors; ++u) parts[u] = load8(value + 8 * u);
      for (int64_t h = 0; h < Heads; ++h) {
        const __m256 weight = _mm256_set1_ps(weights[h][j]);
        for (int64_t u = 0; u < kSliceVectors; ++u) sums[h][u] = _mm256_fmadd_ps(weight, parts[u], sums[h][u]);
      }
    }
    for (int64_t h = 0; h < Heads; ++h) {
      const __m256 total = _mm256_set1_ps(totals[h]);
      for (int64_t u = 0; u < kSliceVectors; ++u) _mm256_storeu_ps(out[h] + 8 * u, _mm256_div_ps(sums[h][u], total));
    }
    return;
  }
#endif
  for (int64_t h = 0; h < Heads; ++h)
    for (int64_t t = 0; t < width; ++t) {
      float sum = 0.0f;
      for (int64_t j = 0; j < count; ++j) sum = std::fma(weights[h][j], element(values + base + list[j] * d, t0 + t), sum);
      out[h][t] = sum / totals[h];
    }
}

// gather_slice for n heads (1 <= n <= kHeadsAtOnce).
template <typename Element>
void gather_heads(int64_t n, const float* const* weights, const float* totals, const Element* values, int64_t base,
                  const int64_t* list, int64_t count, int64_t d, int64_t t0, int64_t width, float* const* out) {
  switch (n) {
    case 1: return gather_slice<1>(weights, totals, values, base, list, count, d, t0, width, out);
    case 2: return gather_slice<2>(weights, totals, values, base, list, count, d, t0, width, out);
    case 3: return gather_slice<3>(weights, totals, values, base, list, count, d, t0, width, out);
    case 4: return gather_slice<4>(weights, totals, values, base, list, count, d, t0, width, out);
    case 5: return gather_slice<5>(weights, totals, values, base, list, count, d, t0, width, out);
    default: return gather_slice<kHeadsAtOnce>(weights, totals, values, base, list, count, d, t0, width, out);
  }
}

// Keys list[from..from + m) of one (row, kv head) of the cache (base: its first element), widened
// to float32 into `to` [m, d]; the cache lines of slots up to kAhead further (before `end`) fetched.
void widen_keys(const void* keys, int64_t base, const int64_t* list, int64_t from, int64_t m, int64_t end, int64_t d,
                int64_t kv_format, float* to) {
  const int64_t element = kv_format == kFloat32 ? 4 : 2;  // bytes a stored element takes
  for (int64_t c = 0; c < m; ++c) {
    if (from + c + kAhead < end) {
      const char* ahead = static_cast<const char*>(keys) + (base + list[from + c + kAhead] * d) * element;
      for (int64_t line = 0; line < d * element; line += 64) prefetch(ahead + line);
    }
    with_elements(kv_format, static_cast<const char*>(keys) + (base + list[from + c] * d) * element,
                  [&](auto stored) { widen(stored, to + c * d, d); });
  }
}

// One query's output for heads [h0, h1), elements [t0, t0 + slice) of each: its softmax weights
// (head h's `count` floats at weights + h * count, unnormalized; totals[h] their sum) over the
// values at list[0..count) of the (row, kv head) at base. out: the query's [heads, d] output row.
void gather_query(const float* weights, int64_t count, const float* totals, int64_t h0, int64_t h1,
                  const void* values, int64_t base, const int64_t* list, int64_t d, int64_t t0, int64_t slice,
                  int64_t kv_format, float* out) {
  for (int64_t first = h0; first < h1; first += kHeadsAtOnce) {
    const int64_t n = std::min(kHeadsAtOnce, h1 - first);
    const float* head_weights[kHeadsAtOnce];
    float* head_out[kHeadsAtOnce];
    for (int64_t h = 0; h < n; ++h) {
      head_weights[h] = weights + (first + h) * count;
      head_out[h] = out + (first + h) * d + t0;
    }
    with_elements(kv_format, static_cast<const char*>(values), [&](auto stored) {
      gather_heads(n, head_weights, totals + first, stored, base, list, count, d, t0, slice, head_out);
    });
  }
}

// One token's key and value (kv heads of d floats at k and v) into a cache slot: element `at` (its
// row's offset plus slot * d) of each kv head's keys and values, in kv_format.
void store_token(const float* k, const float* v, void* keys, void* values, int64_t at, int64_t head_stride,
                 int64_t kv_heads, int64_t d, int64_t kv_format) {
  const int64_t element = kv_format == kFloat32 ? 4 : 2;
  for (int64_t g = 0; g < kv_heads; ++g) {
    store_elements(k + g * d, static_cast<char*>(keys) + (at + g * head_stride) * element, d, kv_format);
    store_elements(v + g * d, static_cast<char*>(values) + (at + g * head_stride) * element, d, kv_format);
  }
}
}  // namespace

extern "C" {
// Attention of each listed query over exactly its own key slots, in their order: softmax(q . k *
// scale, soft-capped where softcap > 0) @ v, after writing each query's new key and value into its last slot. Grouped-query: head
// h reads kv head h / (heads / kv_heads).
//   q: token t's head h at q + t * q_stride + h * d; its new key and value of kv head g likewise at
//   k and v + t * q_stride + g * d;  out [tokens, heads * d] (stride heads * d)
//   keys, values: one layer's cache, slot s of row r, kv head g at element r * row_stride + g *
//   head_stride + s * d, each element in kv_format (float32, bfloat16 or float16; 16 bits widened)
//   per query i: token tokens[i], cache row rows[i], counts[i] slots at slots + i * slots_stride
//
// The queries of one cache row (a verify block, a tree's nodes) attend together: the slots their
// lists share from the start (the row's committed context) are read once for all of them, then
// each query's own slots. Why: one query at a time read the whole context's cache once per query,
// k times for a k-token block (at 11k tokens of context, ~0.6 GB a query on the 1.5B target).
// Three steps for each (row, kv head): 1. scores, a chunk of keys widened once and every query
// head of the kv head and every query of the row scored against it; 2. each (query, head)'s
// softmax: its maximum, exp and sum; 3. values, each query's sums over its slots in order, kept in
// registers for up to 6 heads while a slice of kSlice elements of each value streams past.
// How they are split across threads, so that every thread is busy and every key and value is read
// from memory about once:
//   - a batch of rows (at least kPairsPerThread (row, kv head) pairs a thread), or rows no longer
//     than a span: one job per pair, or per part of its query heads when pairs are fewer than two
//     a thread, doing its three steps in turn (a server's step: measured in the server, a pass's
//     wait cost more than the work, and waking the threads for each of three passes more still);
//   - else (a few long rows) three passes in one parallel region: scores by (row, kv head, span of
//     kSpan slots, block of kMembersAtOnce queries), softmax by (query, head), values by (row, kv
//     head, slice). Splitting a kv head's query heads between threads would read its cache once
//     per split, and 3 kv heads on 2 threads would leave one thread with twice the work.
// A query's dot products, softmax and sums run in the same order whatever else is in the call or
// however it is split (a dot as fused_dot(), the sums slot after slot, each head's alone), so its bits do
// not depend on the others in the call.
void specdec_attend(const float* q, const float* k, const float* v, int64_t q_stride, void* keys, void* values,
                    int64_t row_stride, int64_t head_stride, const int64_t* tokens, const int64_t* rows,
                    const int64_t* slots, const int64_t* counts, int64_t slots_stride, int64_t queries, int64_t heads,
                    int64_t kv_heads, int64_t d, float scale, float* out, int64_t kv_format, float softcap) {
  const int64_t group = heads / kv_heads;
  // Each query's own key and value first (its last slot), so that block-mates see each other.
  for (int64_t i = 0; i < queries; ++i)
    store_token(k + tokens[i] * q_stride, v + tokens[i] * q_stride, keys, values,
                rows[i] * row_stride + slots[i * slots_stride + counts[i] - 1] * d, head_stride, kv_heads, d,
                kv_format);
  // The queries by cache row, in their order, and the slots each row's queries all start with.
  std::vector<std::vector<int64_t>> members;
  std::vector<int64_t> shared, longest;
  for (int64_t i = 0; i < queries; ++i) {
    int64_t found = 0;
    while (found < int64_t(members.size()) && rows[members[found][0]] != rows[i]) ++found;
    if (found == int64_t(members.size())) {
      members.push_back({i});
      shared.push_back(counts[i]);
      longest.push_back(counts[i]);
      continue;
    }
    members[found].push_back(i);
    longest[found] = std::max(longest[found], counts[i]);
    const int64_t* mine = slots + i * slots_stride;
    const int64_t* theirs = slots + members[found][0] * slots_stride;
    int64_t common = std::min(shared[found], counts[i]);
    for (int64_t j = 0; j < common; ++j)
      if (mine[j] != theirs[j]) {
        common = j;
        break;
      }
    shared[found] = common;
  }
  // Query i's weights for head h: counts[i] floats at weights + starts[i] + h * counts[i].
  std::vector<int64_t> starts(queries + 1, 0);
  for (int64_t i = 0; i < queries; ++i) starts[i + 1] = starts[i] + heads * counts[i];
  const Scratch<float, ScratchFor::kQueryWeights> weights_buffer(starts[queries]);
  float* weights = weights_buffer.get();
  std::vector<float> totals(queries * heads);
  const auto cache_base = [&](int64_t r, int64_t g) { return rows[members[r][0]] * row_stride + g * head_stride; };

  const int64_t slice = d % kSlice == 0 ? kSlice : d;

  // 1. Scores of members [first, last) of row r for query heads [h0, h1) of kv head g over slots
  // [j0, j0 + kSpan): a chunk of keys widened once for all of them (the shared slots), then each
  // member's own slots.
  const auto score_span = [&](int64_t r, int64_t g, int64_t h0, int64_t h1, int64_t j0, size_t first, size_t last) {
    const std::vector<int64_t>& mine = members[r];
    const int64_t base = cache_base(r, g), common = shared[r], j1 = j0 + kSpan;
    thread_local AlignedFloats widened;  // its keys' loads within cache lines (LineAligned)
    widened.resize(kChunk * d);
    // [from, to) of list, a chunk at a time, widened, then scored for each member in [begin, end).
    const auto score = [&](const int64_t* list, int64_t from, int64_t to, size_t begin, size_t end) {
      for (int64_t c0 = from; c0 < to; c0 += kChunk) {
        const int64_t m = std::min(kChunk, to - c0);
        widen_keys(keys, base, list, c0, m, to, d, kv_format, widened.data());
        for (size_t a = begin; a < end; ++a) {
          const int64_t i = mine[a];
          for (int64_t h = h0; h < h1; ++h)
            score_keys(q + tokens[i] * q_stride + h * d, widened.data(), m, d, scale,
                       weights + starts[i] + h * counts[i] + c0);
        }
      }
    };
    score(slots + mine[0] * slots_stride, j0, std::min(j1, common), first, last);
    for (size_t a = first; a < last; ++a)
      score(slots + mine[a] * slots_stride, std::max(j0, common), std::min(j1, counts[mine[a]]), a, a + 1);
  };
  // 2. Query i's softmax weights for head h, unnormalized, and their total.
  const auto softmax = [&](int64_t i, int64_t h) {
    const int64_t count = counts[i];
    float* row = weights + starts[i] + h * count;
    soft_cap(row, count, softcap);
    totals[i * heads + h] = exp_minus_and_sum(row, largest(row, count), count);
  };
  // 3. Values of row r's members for query heads [h0, h1) of kv head g, elements [t0, t0 + slice)
  // of each head's output.
  const auto gather = [&](int64_t r, int64_t g, int64_t h0, int64_t h1, int64_t t0) {
    for (const int64_t i : members[r])
      gather_query(weights + starts[i], counts[i], totals.data() + i * heads, h0, h1, values, cache_base(r, g),
                   slots + i * slots_stride, d, t0, slice, kv_format, out + tokens[i] * heads * d);
  };

  // Whole jobs, each a (row, kv head) pair's or a part of its query heads' three steps, one after
  // the other: where pairs are enough to keep every thread busy (a server's batch), or where every
  // row is short enough that parts reading its keys and values again cost less than a pass's wait.
  if (members.empty()) return;  // (no queries)
  const int64_t pairs = int64_t(members.size()) * kv_heads, threads = omp_get_max_threads();
  const bool enough_pairs = pairs >= kPairsPerThread * threads;
  const bool short_rows = *std::max_element(longest.begin(), longest.end()) <= kSpan;
  if (enough_pairs || short_rows) {
    const int64_t parts = enough_pairs ? 1 : std::min(group, (2 * threads + pairs - 1) / pairs);
    const int64_t share = (group + parts - 1) / parts;
#pragma omp parallel for schedule(dynamic, 1) if (pairs * parts > 1)
    for (int64_t job = 0; job < pairs * parts; ++job) {
      const int64_t r = job / parts / kv_heads, g = job / parts % kv_heads;
      const int64_t h0 = g * group + job % parts * share, h1 = std::min(h0 + share, (g + 1) * group);
      if (h0 >= h1) continue;
      for (int64_t j0 = 0; j0 < longest[r]; j0 += kSpan) score_span(r, g, h0, h1, j0, 0, members[r].size());
      for (const int64_t i : members[r])
        for (int64_t h = h0; h < h1; ++h) softmax(i, h);
      for (int64_t t0 = 0; t0 < d; t0 += slice) gather(r, g, h0, h1, t0);
    }
    return;
  }
  // Else three passes, each split finer, in one parallel region (a thread woken once, then waiting
  // at each pass's end): scores by (row, kv head, span, block of queries), softmax by (query, head),
  // values by (row, kv head, slice).
  std::vector<std::array<int64_t, 5>> scoring;
  std::vector<std::array<int64_t, 3>> gathering;
  for (int64_t r = 0; r < int64_t(members.size()); ++r)
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t j0 = 0; j0 < longest[r]; j0 += kSpan)
        for (int64_t first = 0; first < int64_t(members[r].size()); first += kMembersAtOnce)
          scoring.push_back({r, g, j0, first, std::min(first + kMembersAtOnce, int64_t(members[r].size()))});
      for (int64_t t0 = 0; t0 < d; t0 += slice) gathering.push_back({r, g, t0});
    }
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (size_t job = 0; job < scoring.size(); ++job)
      score_span(scoring[job][0], scoring[job][1], scoring[job][1] * group, (scoring[job][1] + 1) * group,
                 scoring[job][2], size_t(scoring[job][3]), size_t(scoring[job][4]));
#pragma omp for schedule(static)
    for (int64_t ih = 0; ih < queries * heads; ++ih) softmax(ih / heads, ih % heads);
#pragma omp for schedule(static)
    for (size_t job = 0; job < gathering.size(); ++job) {
      const int64_t g = gathering[job][1];
      gather(gathering[job][0], g, g * group, (g + 1) * group, gathering[job][2]);
    }
  }
}

// Attention of a chain: `count` queries, tokens first..first + count - 1 (laid out as for
// specdec_attend), over one cache row, query i over the row's slots list[0..committed + i] in
// order, after writing the chain's keys and values into slots list[committed..committed + count).
// Each query gets the bits specdec_attend gives it with that slot list (each key scored alone by
// score_keys, the same softmax over its slots, the same sums in slot order), without a list per
// query: a prompt piece of n tokens would need n^2 / 2 slots in lists, and torch's attention with a
// causal mask scores every block's whole rectangle, then masks it.
//   row_base: elements from keys (and values) to the row's first (row * row_stride; 0 in a pool)
// Jobs: (block of kMembersAtOnce queries, kv head), the longest blocks first; each widens a chunk
// of keys once for its queries' scores (every query head of its kv head), then their softmax, then
// their sums, one query at a time.
void specdec_attend_chain(const float* q, const float* k, const float* v, int64_t q_stride, void* keys, void* values,
                          int64_t row_base, int64_t head_stride, const int64_t* list, int64_t committed, int64_t first,
                          int64_t count, int64_t heads, int64_t kv_heads, int64_t d, float scale, float* out,
                          int64_t kv_format, float softcap) {
  for (int64_t i = 0; i < count; ++i)
    store_token(k + (first + i) * q_stride, v + (first + i) * q_stride, keys, values,
                row_base + list[committed + i] * d, head_stride, kv_heads, d, kv_format);
  const int64_t group = heads / kv_heads, blocks = (count + kMembersAtOnce - 1) / kMembersAtOnce;
  const int64_t slice = d % kSlice == 0 ? kSlice : d;
#pragma omp parallel for schedule(dynamic, 1) if (blocks * kv_heads > 1)
  for (int64_t job = 0; job < blocks * kv_heads; ++job) {
    const int64_t block = blocks - 1 - job / kv_heads, g = job % kv_heads;
    const int64_t begin = block * kMembersAtOnce, end = std::min(count, begin + kMembersAtOnce);
    const int64_t longest = committed + end, base = row_base + g * head_stride;
    // Member i's weights for its kv head's query head h: committed + i + 1 floats at
    // weights + starts[i - begin] + h * (committed + i + 1).
    std::array<int64_t, kMembersAtOnce + 1> starts{};
    for (int64_t i = begin; i < end; ++i) starts[i - begin + 1] = starts[i - begin] + group * (committed + i + 1);
    thread_local AlignedFloats widened;  // its keys' loads within cache lines (LineAligned)
    thread_local std::vector<float> totals;
    widened.resize(kChunk * d);
    totals.resize(kMembersAtOnce * group);
    const Scratch<float, ScratchFor::kChainWeights> weights(starts[end - begin]);
    // 1. Scores: each chunk of keys widened once, scored for every member that sees part of it.
    for (int64_t c0 = 0; c0 < longest; c0 += kChunk) {
      const int64_t m = std::min(kChunk, longest - c0);
      widen_keys(keys, base, list, c0, m, longest, d, kv_format, widened.data());
      for (int64_t i = std::max(begin, c0 - committed); i < end; ++i) {  // (slot c0 is member c0 - committed's last)
        const int64_t own = committed + i + 1;
        for (int64_t h = 0; h < group; ++h)
          score_keys(q + (first + i) * q_stride + (g * group + h) * d, widened.data(), std::min(m, own - c0), d, scale,
                     weights.get() + starts[i - begin] + h * own + c0);
      }
    }
    // 2. Each member's softmax weights per head, unnormalized, and their totals; 3. its sums.
    for (int64_t i = begin; i < end; ++i) {
      const int64_t own = committed + i + 1;
      float* mine = weights.get() + starts[i - begin];
      for (int64_t h = 0; h < group; ++h) {
        float* row = mine + h * own;
        soft_cap(row, own, softcap);
        totals[(i - begin) * group + h] = exp_minus_and_sum(row, largest(row, own), own);
      }
      for (int64_t t0 = 0; t0 < d; t0 += slice)
        gather_query(mine, own, totals.data() + (i - begin) * group, 0, group, values, base, list, d, t0, slice,
                     kv_format, out + (first + i) * heads * d + g * group * d);
    }
  }
}
}
