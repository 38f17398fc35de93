// A decoder layer's work around its matmuls, for specdec's own forward (specdec/models/fused_layer.py):
// RMSNorm, bias, RoPE, SiLU- or GELU-gated MLP and residual adds; attention is attention.cpp's. Why: on
// a 2-core CPU the 1.5B target's one-token step spent ~40% of its time in the ~20 small torch ops per
// layer around the matmuls (dispatch and threading overhead on vectors of a few thousand floats);
// here they are 3 calls per layer.
//
// Exactness: every result of a row (a token) is computed by the same instructions in the same
// order whatever else is in the call, so a token scores the same inside a verify block as alone.
// Reductions (norms, dot products) run in 8 interleaved lanes summed in a fixed order; compiled
// with -ffp-contract=off, no -ffast-math, so nothing is reassociated or fused.
// The matmuls themselves are specdec_int4_linear (int4_matmul.cpp) or specdec_w8a32_linear
// (w8a32_matmul.cpp), linked into the same library: `format` (4 or 8) says which packs the weights.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "layer_common.h"
#include "specdec_kernels.h"
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
using specdec::Scratch;
using specdec::ScratchFor;

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

// silu(g) * u = g / (1 + exp(-g)) * u, with layer_common.h's exp: the vector and scalar code run the
// same IEEE operations in the same order, so each element has the same bits on either path.
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
// with exp as silu's (gemma's gelu_pytorch_tanh): the vector and scalar code run the same IEEE
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
    const Scratch<float, ScratchFor::kNormedRows> normed_buffer(M * K);
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
  const Scratch<float, ScratchFor::kNormedOutput> row_buffer(hidden);
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
  const Scratch<float, ScratchFor::kProjected> projected_buffer(M * hidden_padded);
  const Scratch<float, ScratchFor::kGateUp> gate_up_buffer(M * gate_up_padded);
  const Scratch<float, ScratchFor::kGated> act_buffer(M * inter);
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
  const Scratch<float, ScratchFor::kHeadInput> normed_buffer(M * 2 * hidden);
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
}
