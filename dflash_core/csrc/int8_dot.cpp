// y = (x @ q.T) * scale (+ add): rows x (M, K) in bf16, int8 weight codes q (N, K) with one fp32
// scale per output; fp32 out. Built by dflash_core/int8_dot.py for CPUs with AVX512-BF16.
//
// The codes are widened to bf16 (exact: |q| <= 127 needs 7 bits) and multiplied by the rows with
// vdpbf16ps, which adds two products per fp32 lane: twice the fp32 FMA's products per instruction,
// so a 16-row verify block costs a quarter of the bf16-to-fp32 route inductor's AVX-512 kernel takes.
//
// Every output is summed over K in the same order, in one accumulator, whatever the number of
// rows and whichever block of rows it falls in: a row's numbers never depend on the rows beside it
// (the probe in int8_dot.py checks it too).
//
// q is packed (N / 16, K / 2, 32): element [nb][kp][2 j + t] = q[16 nb + j][2 kp + t], so one
// 256-bit load gives a k-pair for 16 outputs, as vdpbf16ps pairs them.
//
// int8_group_dot takes one scale per group of 32 inputs instead (a GGUF's Q8_0 blocks: scales
// (N / 16, K / 32, 16), the file's fp16 values): each group's sum multiplied by its scale, the
// groups summed in order, so the product is the file's weights' (up to 8 rows per pass: two sets of
// accumulators).
#include <immintrin.h>

#include "blocks.h"

#include <cstdint>
#include <cstring>

namespace {

inline __m512bh widen(const int8_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values first, then hi's: the codes' order
}

// Input pairs [from, to) of MB rows times NB blocks of 16 outputs (from block nb0) into acc.
template <int MB, int NB>
inline void accumulate(const uint16_t* x, int64_t K, const int8_t* q, int64_t nb0, int64_t from, int64_t to,
                       __m512 (&acc)[MB][NB]) {
  const int64_t pairs = K / 2;
  for (int64_t kp = from; kp < to; ++kp) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = widen(q + ((nb0 + j) * pairs + kp) * 32);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * kp, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, w[j]);
    }
  }
}

// MB rows times NB blocks of 16 outputs starting at block nb0.
template <int MB, int NB>
void tile(const uint16_t* x, int64_t K, const int8_t* q, const float* scale, const float* add, float* y,
          int64_t N, int64_t nb0) {
  __m512 acc[MB][NB];
  zero(acc);
  accumulate<MB, NB>(x, K, q, nb0, 0, K / 2, acc);
  for (int j = 0; j < NB; ++j) {
    const int64_t n = (nb0 + j) * 16;
    const __m512 s = _mm512_loadu_ps(scale + n);
    for (int m = 0; m < MB; ++m) {
      const __m512 base = add ? _mm512_loadu_ps(add + m * N + n) : _mm512_setzero_ps();
      _mm512_storeu_ps(y + m * N + n, _mm512_fmadd_ps(acc[m][j], s, base));
    }
  }
}

// Up to 16 rows: fewer rows take more output blocks at once, so that enough independent
// accumulators hide vdpbf16ps's latency (the sums' order is the same either way).
template <int MB>
void rows(const uint16_t* x, int64_t K, const int8_t* q, const float* scale, const float* add, float* y, int64_t N,
          int threads) {
  constexpr int NB = MB <= 4 ? 4 : (MB <= 8 ? 2 : 1);
  over_block_sets<NB>(N, threads, [&](int64_t nb) { tile<MB, NB>(x, K, q, scale, add, y, N, nb); },
                      [&](int64_t nb) { tile<MB, 1>(x, K, q, scale, add, y, N, nb); });
}

using RowsFn = void (*)(const uint16_t*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int);
constexpr RowsFn BY_ROWS[17] = {nullptr,   rows<1>,  rows<2>,  rows<3>,  rows<4>,  rows<5>,  rows<6>,  rows<7>, rows<8>,
                                rows<9>, rows<10>, rows<11>, rows<12>, rows<13>, rows<14>, rows<15>, rows<16>};

}  // namespace

extern "C" void int8_dot(const uint16_t* x, int64_t M, int64_t K, const int8_t* q, const float* scale,
                         const float* add, float* y, int64_t N, int threads) {
  over_row_runs(M, 16, [&](int64_t m0, int64_t mb) {
    BY_ROWS[mb](x + m0 * K, K, q, scale, add ? add + m0 * N : nullptr, y + m0 * N, N, threads);
  });
}

namespace {

template <int MB, int NB>
void group_tile(const uint16_t* x, int64_t K, const int8_t* q, const float* scales, const float* add, float* y,
                int64_t N, int64_t nb0) {
  __m512 total[MB][NB], group[MB][NB];
  zero(total);
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    zero(group);
    accumulate<MB, NB>(x, K, q, nb0, g * 16, g * 16 + 16, group);
    for (int j = 0; j < NB; ++j) {
      const __m512 s = _mm512_loadu_ps(scales + ((nb0 + j) * groups + g) * 16);
      for (int m = 0; m < MB; ++m) total[m][j] = _mm512_fmadd_ps(group[m][j], s, total[m][j]);
    }
  }
  store(total, add, y, N, nb0);
}

template <int MB>
void group_rows(const uint16_t* x, int64_t K, const int8_t* q, const float* scales, const float* add, float* y,
                int64_t N, int threads) {
  constexpr int NB = MB <= 2 ? 4 : (MB <= 4 ? 2 : 1);
  over_block_sets<NB>(N, threads, [&](int64_t nb) { group_tile<MB, NB>(x, K, q, scales, add, y, N, nb); },
                      [&](int64_t nb) { group_tile<MB, 1>(x, K, q, scales, add, y, N, nb); });
}

constexpr RowsFn BY_GROUP_ROWS[9] = {nullptr, group_rows<1>, group_rows<2>, group_rows<3>, group_rows<4>,
                                     group_rows<5>, group_rows<6>, group_rows<7>, group_rows<8>};

}  // namespace

extern "C" void int8_group_dot(const uint16_t* x, int64_t M, int64_t K, const int8_t* q, const float* scales,
                               const float* add, float* y, int64_t N, int threads) {
  over_row_runs(M, 8, [&](int64_t m0, int64_t mb) {
    BY_GROUP_ROWS[mb](x + m0 * K, K, q, scales, add ? add + m0 * N : nullptr, y + m0 * N, N, threads);
  });
}
