// IEEE binary16 and bfloat16 <-> binary32 for the compiled kernels (int4_matmul.cpp's float16
// scales, attention.cpp's 16-bit keys and values): plain integer and float operations, the same bits
// on every instruction-set path. Included by both; specdec/models/native.py hashes it with them.
#pragma once
#include <cstdint>
#include <cstring>

namespace specdec16 {

// binary16 -> binary32, exact.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    uint32_t m = mantissa;
    while (!(m & 0x400)) {
      m <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((m & 0x3FF) << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// binary32 -> binary16, rounded to nearest even as torch rounds it (c10::Half's conversion: the
// rounding done by one float addition at the right exponent; overflow to infinity, NaN to 0x7E00).
// Needs IEEE float arithmetic without contraction (-ffp-contract=off).
inline uint16_t float_to_half(float value) {
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  float magnitude = value < 0 ? -value : value;
  float base = (magnitude * scale_to_inf) * scale_to_zero;
  uint32_t w;
  std::memcpy(&w, &value, 4);
  const uint32_t twice = w + w, sign = w & 0x80000000u;
  uint32_t bias = twice & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
  float bias_value;
  std::memcpy(&bias_value, &bias_bits, 4);
  base = bias_value + base;
  uint32_t bits;
  std::memcpy(&bits, &base, 4);
  const uint32_t exponent_bits = (bits >> 13) & 0x00007C00u, mantissa_bits = bits & 0x00000FFFu;
  return uint16_t((sign >> 16) | (twice > 0xFF000000u ? 0x7E00u : exponent_bits + mantissa_bits));
}

// binary32 -> bfloat16: the top 16 bits rounded to nearest even, NaN to 0x7FC0, as torch rounds it.
inline uint16_t float_to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (value != value) return 0x7FC0;
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// bfloat16 -> binary32, exact.
inline float bfloat16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

}  // namespace specdec16
