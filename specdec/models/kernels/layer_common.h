// What layer_ops.cpp and attention.cpp both compute: exp, with the same bits on the vector and the
// scalar path (the MLP's SiLU and GELU-tanh, attention's softmax). In an anonymous namespace: each
// source that includes it gets its own copy, compiled as when both were one file (layer_ops.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
// exp, computed the same way, bit for bit, by the vector and the scalar code below: Cody-Waite
// reduction (n = round(x log2 e), r = x - n ln2 in two parts), cephes' degree-7 polynomial, times 2^n
// built in the exponent bits; every step one IEEE operation in one order (no FMA contraction), so an
// element's bits do not depend on which code path or which position in a block computed it. Why not
// std::exp: one call per element was ~6% of an 8-token step; this is vectorized. Accurate to a few
// float ulps on the clamped range.
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
}  // namespace
