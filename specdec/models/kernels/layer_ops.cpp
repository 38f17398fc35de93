// A decoder layer's work around its int4 matmuls, for specdec's own forward (specdec/models/int4_layer.py):
// RMSNorm, bias, RoPE, SiLU-gated MLP, residual adds, and attention of each query over exactly its
// own keys. Why: on a 2-core CPU the 1.5B target's one-token step spent ~40% of its time in the
// ~20 small torch ops per layer around the matmuls (dispatch and threading overhead on vectors of
// a few thousand floats); here they are 3 calls per layer.
//
// Exactness: every result of a row (a token) is computed by the same instructions in the same
// order whatever else is in the call, so a token scores the same inside a verify block as alone.
// Reductions (norms, dot products, softmax sums) run in 8 interleaved lanes summed in a fixed
// order; compiled with -ffp-contract=off, no -ffast-math, so nothing is reassociated or fused.
// The matmuls themselves are specdec_int4_linear (int4_matmul.cpp) or specdec_w8a32_linear
// (w8a32_matmul.cpp), linked into the same library: `format` (4 or 8) says which packs the weights.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "float16.h"
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" void specdec_int4_linear(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K);
extern "C" void specdec_w8a32_linear(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K);

namespace {
// An allocator of 64-byte aligned memory (a cache line). Why: a vector's buffer from malloc is
// 16-byte aligned, so half of the 32-byte loads from it straddle two cache lines, which costs
// Zen 4 a second load: scoring 32 widened keys ran at 32 G fused multiply-adds a second on one
// core from such a buffer against 46-47 G from an aligned one (a scratch measurement).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
using AlignedFloats = std::vector<float, LineAligned<float>>;

// Scratch floats: a buffer kept per calling thread and per use, or, past kKeep floats (a long
// prefill), one freed after the call so that memory does not stay grown. Why: a fresh vector each
// call zeroed (and, past glibc's mmap threshold, faulted in) megabytes per verify block (measured
// ~4% of a 16-token step).
constexpr size_t kKeep = size_t(1) << 22;
template <int use>
class Scratch {
 public:
  explicit Scratch(size_t n) {
    thread_local AlignedFloats kept;
    if (n > kKeep) {
      own_.reset(new (std::align_val_t(64)) float[n]);  // (not zeroed: a long prefill's megabytes)
      data_ = own_.get();
      return;
    }
    if (kept.size() < n) kept.resize(n);
    data_ = kept.data();
  }
  float* get() const { return data_; }

 private:
  struct AlignedDelete {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<float[], AlignedDelete> own_;
  float* data_;
};

void linear(int64_t format, const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  (format == 8 ? specdec_w8a32_linear : specdec_int4_linear)(x, w, y, M, N, K);
}

float dot(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) + tail;
}

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

// dot(), its products fused: 8 interleaved lanes summed in dot()'s order, then the tail.
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

// silu(g) * u = g / (1 + exp(-g)) * u, with exp computed the same way, bit for bit, by the vector
// and the scalar code below: Cody-Waite reduction (n = round(x log2 e), r = x - n ln2 in two
// parts), cephes' degree-7 polynomial, times 2^n built in the exponent bits; every step one IEEE
// operation in one order (no FMA contraction), so an element's bits do not depend on which code
// path or which position in a block computed it. Why not std::exp: one call per element was ~6% of
// an 8-token step; this is vectorized. Accurate to a few float ulps on the clamped range.
constexpr float kExpLow = -87.3f, kExpHigh = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

float exp_scalar(float x) {
  x = x > kExpLow ? x : kExpLow;  // as vmaxps(x, low): low where x is NaN
  x = x < kExpHigh ? x : kExpHigh;
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2High;
  r = r - n * kLn2Low;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__)
// exp_scalar's steps on 8 lanes: the same bits per element.
inline __m256 exp_vector(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpLow));
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpHigh));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(kLn2High)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(kLn2Low)));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

void silu_times(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = exp_vector(_mm256_sub_ps(zero, g));  // exp(-g); -g as the scalar code's unary minus (exact)
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
  }
#endif
  for (; j < n; ++j) out[j] = (gate[j] / (1.0f + exp_scalar(0.0f - gate[j]))) * up[j];
}

// gelu_tanh(g) * u = (0.5 g (1 + tanh(c (g + 0.044715 g^3)))) * u, tanh(t) = 1 - 2 / (exp(2 t) + 1)
// with exp as above (gemma's gelu_pytorch_tanh): the vector and scalar code run the same IEEE
// operations in the same order, so each element has the same bits on either path.
constexpr float kGeluC = 0.7978845608028654f, kGeluCube = 0.044715f;

inline float gelu_tanh_scalar(float g) {
  const float t = kGeluC * (g + kGeluCube * ((g * g) * g));
  const float tanh_t = 1.0f - 2.0f / (exp_scalar(2.0f * t) + 1.0f);
  return (0.5f * g) * (1.0f + tanh_t);
}

void gelu_tanh_times(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
  const __m256 c = _mm256_set1_ps(kGeluC), cube = _mm256_set1_ps(kGeluCube);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 t = _mm256_mul_ps(c, _mm256_add_ps(g, _mm256_mul_ps(cube, g3)));
    const __m256 e = exp_vector(_mm256_mul_ps(two, t));
    const __m256 tanh_t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, tanh_t));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + j)));
  }
#endif
  for (; j < n; ++j) out[j] = gelu_tanh_scalar(gate[j]) * up[j];
}

// The MLP gate's activations (the activation argument of specdec_layer_mlp).
constexpr int64_t kSilu = 0, kGeluTanh = 1;

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
// their sum in 8 interleaved lanes summed in a fixed order (as dot(): a single running sum over a
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

// out = weight * (x / sqrt(mean(x^2) + eps)), as RMSNorm in float32.
void rms_norm(const float* x, const float* weight, float eps, float* out, int64_t n) {
  const float inverse = 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inverse);
}

// y [M, N] = norm(x) @ W^T + bias (bias over the first `width` outputs; N is the padded width).
// A null norm_weight: no norm (olmo2's layers have none on their inputs).
void norm_linear(int64_t format, const float* x, const float* norm_weight, float eps, const uint8_t* w, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K, int64_t width) {
  if (norm_weight) {
    const Scratch<0> normed_buffer(M * K);
    float* normed = normed_buffer.get();
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; ++m) rms_norm(x + m * K, norm_weight, eps, normed + m * K, K);
    linear(format, normed, w, y, M, N, K);
  } else {
    linear(format, x, w, y, M, N, K);
  }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < width; ++j) y[m * N + j] += bias[j];
}

// In place on each row's first `heads` heads of d: x * cos + rotate_half(x) * sin over each head's
// first `rotary` dims (all d, or phi3's partial rotary), as the torch forward. cos, sin [M, rotary].
void rope(float* y, const float* cos, const float* sin, int64_t M, int64_t stride, int64_t heads, int64_t d,
          int64_t rotary) {
  const int64_t half = rotary / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      float* x = y + m * stride + h * d;
      const float* c = cos + m * rotary;
      const float* s = sin + m * rotary;
      for (int64_t j = 0; j < half; ++j) {
        const float a = x[j], b = x[j + half];
        x[j] = a * c[j] + (-b) * s[j];
        x[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
}

// In place on each row's `width` floats from `first`: RMSNorm of every group of `size` floats with
// `weight` [size] (q/k norms: size head_dim for qwen3's and gemma3's per-head norms, all the q (k)
// heads for olmo2's).
void norm_groups(float* y, const float* weight, float eps, int64_t M, int64_t stride, int64_t first, int64_t width,
                 int64_t size) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t start = first; start < first + width; start += size) {
      float* x = y + m * stride + start;
      rms_norm(x, weight, eps, x, size);
    }
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
// out[m] += (norm(p[m] + bias) or p[m] + bias) for M rows of `hidden` (p's rows `padded` apart): a
// projection's residual add, through a norm on its output where the layer has one (gemma, olmo2).
void add_projected(float* out, const float* projected, const float* bias, const float* out_norm, float eps,
                   int64_t M, int64_t hidden, int64_t padded) {
  if (!out_norm) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < hidden; ++j) {
        const float p = projected[m * padded + j];
        out[m * hidden + j] += bias ? p + bias[j] : p;
      }
    return;
  }
  const Scratch<7> row_buffer(hidden);
  float* row = row_buffer.get();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < hidden; ++j) {
      const float p = projected[m * padded + j];
      row[j] = bias ? p + bias[j] : p;
    }
    rms_norm(row, out_norm, eps, row, hidden);
    for (int64_t j = 0; j < hidden; ++j) out[m * hidden + j] += row[j];
  }
}

// specdec_layer_mlp for M rows at once.
void layer_mlp_rows(int64_t format, const float* x, const float* attended, const uint8_t* o_w, const float* o_bias,
                    const float* o_norm, const float* norm_weight, float eps, const uint8_t* gate_up_w,
                    const float* gate_up_bias, const uint8_t* down_w, const float* down_bias, const float* down_norm,
                    int64_t activation, float* out, int64_t M, int64_t hidden, int64_t attn_width, int64_t inter,
                    int64_t hidden_padded, int64_t gate_up_padded) {
  const Scratch<1> projected_buffer(M * hidden_padded);
  const Scratch<2> gate_up_buffer(M * gate_up_padded);
  const Scratch<3> act_buffer(M * inter);
  float* projected = projected_buffer.get();
  float* gate_up = gate_up_buffer.get();
  float* act = act_buffer.get();
  linear(format, attended, o_w, projected, M, hidden_padded, attn_width);
  std::memcpy(out, x, sizeof(float) * M * hidden);
  add_projected(out, projected, o_bias, o_norm, eps, M, hidden, hidden_padded);
  norm_linear(format, out, norm_weight, eps, gate_up_w, gate_up_bias, gate_up, M, gate_up_padded, hidden, 2 * inter);
  constexpr int64_t kPiece = 1024;  // elements per job: whole vectors, a few jobs per row
  const int64_t pieces = (inter + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static) if (M * inter >= 4096)
  for (int64_t job = 0; job < M * pieces; ++job) {
    const int64_t m = job / pieces, start = job % pieces * kPiece, count = std::min(kPiece, inter - start);
    const float* row = gate_up + m * gate_up_padded;
    (activation == kGeluTanh ? gelu_tanh_times : silu_times)(row + start, row + inter + start,
                                                              act + m * inter + start, count);
  }
  linear(format, act, down_w, projected, M, hidden_padded, inter);
  add_projected(out, projected, down_bias, down_norm, eps, M, hidden, hidden_padded);
}

// Rows of a long prompt a layer's MLP call takes at a time (specdec_layer_mlp).
constexpr int64_t kPanelRows = 128;
}  // namespace

extern "C" {
// qkv [M, N] = norm(x) @ Wqkv^T + bias, the q and k norms, then RoPE on the q and k heads (d each).
// x [M, K]; norm_weight null: no input norm; bias over the first `width` outputs or null;
// q_norm [q_norm_size] and k_norm [k_norm_size], or null: RMSNorm over each group of that many
// floats of the q heads (heads * d) and the k heads (kv_heads * d); cos, sin [M, rotary], or null: no
// RoPE; rotary: the dims of each head RoPE turns (d, or fewer for a partial rotary).
void specdec_layer_qkv(int64_t format, const float* x, const float* norm_weight, float eps, const uint8_t* w, const float* bias,
                       const float* q_norm, const float* k_norm, int64_t q_norm_size, int64_t k_norm_size,
                       const float* cos, const float* sin, float* qkv, int64_t M, int64_t N, int64_t K, int64_t width,
                       int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary) {
  norm_linear(format, x, norm_weight, eps, w, bias, qkv, M, N, K, width);
  if (q_norm) norm_groups(qkv, q_norm, eps, M, N, 0, heads * d, q_norm_size);
  if (k_norm) norm_groups(qkv, k_norm, eps, M, N, heads * d, kv_heads * d, k_norm_size);
  if (cos && sin) rope(qkv, cos, sin, M, N, heads + kv_heads, d, rotary);
}

// qkv [M, N] = concat(norm(a), norm(b)) @ Wqkv^T, RoPE applied to the first rope_heads heads of d
// each: a draft head's attention input (drafting/fused_head.py), its token's embedding a and the
// features b it reads, each [M, hidden] normed with its own weight (the same eps).
void specdec_head_qkv(int64_t format, const float* a, const float* a_weight, const float* b, const float* b_weight,
                      float eps, const uint8_t* w, const float* cos, const float* sin, float* qkv, int64_t M, int64_t N,
                      int64_t hidden, int64_t rope_heads, int64_t d) {
  const Scratch<4> normed_buffer(M * 2 * hidden);
  float* normed = normed_buffer.get();
  for (int64_t m = 0; m < M; ++m) {
    rms_norm(a + m * hidden, a_weight, eps, normed + m * 2 * hidden, hidden);
    rms_norm(b + m * hidden, b_weight, eps, normed + m * 2 * hidden + hidden, hidden);
  }
  linear(format, normed, w, qkv, M, N, 2 * hidden);
  rope(qkv, cos, sin, M, N, rope_heads, d, d);
}

// y [M, N] = norm(x) @ W^T (+ bias): the final norm and the output head.
void specdec_norm_linear(int64_t format, const float* x, const float* norm_weight, float eps, const uint8_t* w, const float* bias,
                         float* y, int64_t M, int64_t N, int64_t K, int64_t width) {
  norm_linear(format, x, norm_weight, eps, w, bias, y, M, N, K, width);
}

// The rest of a layer after attention, for M rows of `hidden` floats:
//   h = x + [o_norm](attended @ Wo^T (+ bo));  g, u = halves of [norm](h) @ Wgu^T (+ bgu);
//   out = h + [down_norm]((act(g) * u) @ Wdown^T (+ bdown))
// the bracketed norms where their weights are not null, act SiLU (activation kSilu) or GELU-tanh
// (kGeluTanh). attended [M, attn_width]; out [M, hidden] (may not alias x). hidden_padded and gate_up_padded:
// the kernels' padded output widths (multiples of 16). A long prompt's rows go through it
// kPanelRows at a time (each row's arithmetic is its own: the same bits), so that its scratch stays
// a panel's: the gate/up output of all M rows (a 4,096-token prefill of the 1.5B: 293 MB) was
// faulted in afresh each call and went through memory between the matmul and the SiLU.
void specdec_layer_mlp(int64_t format, const float* x, const float* attended, const uint8_t* o_w, const float* o_bias,
                       const float* o_norm, const float* norm_weight, float eps, const uint8_t* gate_up_w,
                       const float* gate_up_bias, const uint8_t* down_w, const float* down_bias, const float* down_norm,
                       int64_t activation, float* out, int64_t M, int64_t hidden, int64_t attn_width, int64_t inter,
                       int64_t hidden_padded, int64_t gate_up_padded) {
  for (int64_t m0 = 0; m0 < M; m0 += kPanelRows)
    layer_mlp_rows(format, x + m0 * hidden, attended + m0 * attn_width, o_w, o_bias, o_norm, norm_weight, eps,
                   gate_up_w, gate_up_bias, down_w, down_bias, down_norm, activation, out + m0 * hidden,
                   std::min(kPanelRows, M - m0), hidden, attn_width, inter, hidden_padded, gate_up_padded);
}

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
// however it is split (a dot as dot(), the sums slot after slot, each head's alone), so its bits do
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
  const Scratch<5> weights_buffer(starts[queries]);
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
    const Scratch<6> weights(starts[end - begin]);
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
