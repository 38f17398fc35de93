// The two ceilings of a CPU forward, for benchmarks/cpu/roofline.py: memory read bandwidth
// (every weight byte is streamed once per forward) and the integer dot-product peak of the
// instruction the int4 kernel multiplies with (the same #if as specdec/models/kernels/int4_matmul.cpp:
// AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw + vpaddw, or one scalar multiply-add), on all threads.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>

namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
constexpr int kChains = 12;  // independent accumulators: enough to hide each instruction's latency
}  // namespace

extern "C" {
const char* specdec_probe_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "AVX-512 VNNI (vpdpbusd)";
#elif defined(__AVX2__)
  return "AVX2 (vpmaddubsw + vpaddw)";
#else
  return "portable C++ (scalar multiply-add)";
#endif
}

// Best GB/s of `repeats` parallel reads of a `bytes` buffer (make it several times the LLC), in
// 2 MB pages where Linux grants them, as specdec's packed weights are (specdec/models/huge_pages.py).
double specdec_probe_read_gbs(int64_t bytes, int repeats) {
  constexpr size_t kHugePage = size_t(2) << 20;
  bytes = int64_t((size_t(bytes) + kHugePage - 1) / kHugePage * kHugePage);
  auto* buffer = static_cast<uint8_t*>(std::aligned_alloc(kHugePage, size_t(bytes)));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(buffer, size_t(bytes), MADV_HUGEPAGE);  // before memset's first touch
#endif
  std::memset(buffer, 1, size_t(bytes));
  double best = 0.0;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    int64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t at = 0; at < bytes; at += 256) {
#if defined(__AVX2__)
      const __m256i a = _mm256_load_si256((const __m256i*)(buffer + at));
      const __m256i b = _mm256_load_si256((const __m256i*)(buffer + at + 32));
      const __m256i c = _mm256_load_si256((const __m256i*)(buffer + at + 64));
      const __m256i d = _mm256_load_si256((const __m256i*)(buffer + at + 96));
      const __m256i e = _mm256_load_si256((const __m256i*)(buffer + at + 128));
      const __m256i f = _mm256_load_si256((const __m256i*)(buffer + at + 160));
      const __m256i g = _mm256_load_si256((const __m256i*)(buffer + at + 192));
      const __m256i h = _mm256_load_si256((const __m256i*)(buffer + at + 224));
      const __m256i sum = _mm256_add_epi8(_mm256_add_epi8(_mm256_add_epi8(a, b), _mm256_add_epi8(c, d)),
                                          _mm256_add_epi8(_mm256_add_epi8(e, f), _mm256_add_epi8(g, h)));
      total += _mm256_extract_epi8(sum, 0);
#else
      total += buffer[at] + buffer[at + 64] + buffer[at + 128] + buffer[at + 192];
#endif
    }
    const double elapsed = seconds_since(start);
    if (total == -1) best = -1.0;  // keeps the sum alive
    if (bytes / elapsed > best) best = bytes / elapsed;
  }
  std::free(buffer);
  return best / 1e9;
}

// Best G multiply-adds per second of 8-bit x 8-bit products, `iterations` instructions per thread.
double specdec_probe_dot_gmacs(int64_t iterations, int repeats) {
  double best = 0.0;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    int64_t sink = 0;
    int threads = 1;
#pragma omp parallel reduction(+ : sink)
    {
#pragma omp single
      threads = omp_get_num_threads();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      constexpr int kMacs = 64;
      __m512i acc[kChains];
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
      __m512i weights = _mm512_set1_epi8(3), inputs = _mm512_set1_epi8(5);
      for (int64_t it = 0; it < iterations / kChains; ++it) {
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], weights, inputs);
        asm volatile("" : "+v"(weights), "+v"(inputs));
      }
      for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
#elif defined(__AVX2__)
      constexpr int kMacs = 32;
      __m256i acc[kChains];
      for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi16(int16_t(i));
      __m256i weights = _mm256_set1_epi8(3), inputs = _mm256_set1_epi8(5);
      for (int64_t it = 0; it < iterations / kChains; ++it) {
        for (int i = 0; i < kChains; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(weights, inputs));
        asm volatile("" : "+x"(weights), "+x"(inputs));
      }
      for (int i = 0; i < kChains; ++i) sink += _mm256_extract_epi16(acc[i], 0);
#else
      constexpr int kMacs = 1;
      volatile int32_t acc = 0;
      for (int64_t it = 0; it < iterations; ++it) acc = acc + int32_t(it & 7) * 5;
      sink += acc;
#endif
      if (sink == 42 * kMacs) sink = 0;
    }
    const double elapsed = seconds_since(start);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const double macs = double(iterations / kChains * kChains) * 64 * threads;
#elif defined(__AVX2__)
    const double macs = double(iterations / kChains * kChains) * 32 * threads;
#else
    const double macs = double(iterations) * threads;
#endif
    if (sink == 1) best = -1.0;  // keeps the sums alive
    if (macs / elapsed > best) best = macs / elapsed;
  }
  return best / 1e9;
}
}
