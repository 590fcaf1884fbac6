// What the CPU kernels (int8_dot.cpp, q4_dot.cpp) share: how a product's rows and output blocks
// are split. Every output block's sums run in one fixed order whatever the split, so a row's
// numbers never depend on the rows beside it or on the thread count.
#pragma once

#include <immintrin.h>
#include <omp.h>
#ifdef DFLASH_AVX2  // the AVX2 build: the AVX-512 names below mean their two-half equivalents
#include "avx2_as_avx512.h"
#endif

#include <cmath>
#include <cstdint>

// ``tile(nb0)`` on each set of ``NB`` output blocks of 16 (of N / 16) across the threads, then
// ``single(nb)`` on each block left over.
template <int NB, typename Tile, typename Single>
inline void over_block_sets(int64_t N, int threads, Tile tile, Single single) {
  const int64_t blocks = N / 16;
  const int64_t sets = blocks / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t s = 0; s < sets; ++s) tile(s * NB);
  for (int64_t nb = sets * NB; nb < blocks; ++nb) single(nb);
}

// ``pass(m0, rows)`` on the M rows in runs of at most ``most`` (one pass over the weights each).
template <typename Pass>
inline void over_row_runs(int64_t M, int64_t most, Pass pass) {
  for (int64_t m0 = 0; m0 < M; m0 += most) pass(m0, M - m0 < most ? M - m0 : most);
}

// 1 / sqrt(mean(x^2) + eps) over n values: FastTarget.norm's and the drafter's RMS norm scale.
inline float rms_scale(const float* x, int64_t n, float eps) {
  float squares = 0.0f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  return 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
}

// Each of M rows of x (M, K) RMS-normed into out (which may be x): weight * (x * rms_scale(x)), as
// FastTarget.norm and the drafter's RMSNorm compute it.
inline void rms_norm_rows(const float* x, int64_t M, int64_t K, const float* weight, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float scale = rms_scale(x + m * K, K, eps);
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = weight[k] * (x[m * K + k] * scale);
  }
}

// Every accumulator of an MB x NB tile set to zero.
template <int MB, int NB>
inline void zero(__m512 (&acc)[MB][NB]) {
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
}

// A tile's sums into y (M, N), rows m, blocks nb0 + j, plus ``add`` (M, N) where given.
template <int MB, int NB>
inline void store(const __m512 (&total)[MB][NB], const float* add, float* y, int64_t N, int64_t nb0) {
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) {
      const int64_t at = m * N + (nb0 + j) * 16;
      _mm512_storeu_ps(y + at, add ? _mm512_add_ps(total[m][j], _mm512_loadu_ps(add + at)) : total[m][j]);
    }
}
