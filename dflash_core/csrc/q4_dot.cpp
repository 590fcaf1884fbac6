// y = x @ w.T for a GGUF Q4_1 matrix, w[n, k] = d[n, g] * q[n, k] + m[n, g] over groups g of 32
// inputs: rows x (M, K) in bf16, the file's own 4-bit codes and its scales and minimums (fp16 in
// the file, fp32 here: exact); fp32 out. Built by dflash_core/q4_dot.py for CPUs with AVX512-BF16.
//
// Per group, sum(x * w) = d * sum(x * q) + m * sum(x): the codes become bf16 through one vpermw
// from a 16-entry table (exact), sum(x * q) runs on vdpbf16ps, and each row's sum(x) over the
// group is added once per output. Every output is summed in one fixed order whatever the number of
// rows: a row's numbers never depend on the rows beside it (q4_dot.py's probe checks it too).
//
// Codes packed (N / 16, K / 4, 32) bytes: byte j of (block nb, quad t) holds, for output
// 16 nb + j / 2 and s = j % 2, input 4 t + s in its low nibble and input 4 t + 2 + s in its high
// one: one 256-bit load gives two input pairs for 16 outputs, as vdpbf16ps pairs them. Scales and
// minimums (N / 16, K / 32, 16).
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {

float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// MB rows times NB blocks of 16 outputs starting at block nb0.
template <int MB, int NB>
void tile(const uint16_t* x, const float* xsum, int64_t K, const uint8_t* q, const float* d, const float* mins,
          float* y, int64_t N, int64_t nb0, __m512i table) {
  __m512 total[MB][NB], group[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) total[m][j] = _mm512_setzero_ps();
  const int64_t quads = K / 4, groups = K / 32;
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) group[m][j] = _mm512_setzero_ps();
    for (int64_t t = g * 8; t < g * 8 + 8; ++t) {
      __m512bh low[NB], high[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i codes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + ((nb0 + j) * quads + t) * 32)));
        low[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(codes, nibble), table);
        high[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
      }
      for (int m = 0; m < MB; ++m) {
        int32_t first, second;
        std::memcpy(&first, x + m * K + 4 * t, sizeof first);
        std::memcpy(&second, x + m * K + 4 * t + 2, sizeof second);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(first), b = (__m512bh)_mm512_set1_epi32(second);
        for (int j = 0; j < NB; ++j) {
          group[m][j] = _mm512_dpbf16_ps(group[m][j], a, low[j]);
          group[m][j] = _mm512_dpbf16_ps(group[m][j], b, high[j]);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 scale = _mm512_loadu_ps(d + ((nb0 + j) * groups + g) * 16);
      const __m512 minimum = _mm512_loadu_ps(mins + ((nb0 + j) * groups + g) * 16);
      for (int m = 0; m < MB; ++m) {
        total[m][j] = _mm512_fmadd_ps(group[m][j], scale, total[m][j]);
        total[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), minimum, total[m][j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(y + m * N + (nb0 + j) * 16, total[m][j]);
}

// Up to 8 rows (two sets of accumulators each): fewer rows take more output blocks at once.
template <int MB>
void rows(const uint16_t* x, const float* xsum, int64_t K, const uint8_t* q, const float* d, const float* mins,
          float* y, int64_t N, int threads, __m512i table) {
  constexpr int NB = MB <= 1 ? 8 : (MB <= 2 ? 4 : (MB <= 4 ? 2 : 1));
  const int64_t blocks = N / 16;
  const int64_t sets = blocks / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t s = 0; s < sets; ++s) tile<MB, NB>(x, xsum, K, q, d, mins, y, N, s * NB, table);
  for (int64_t nb = sets * NB; nb < blocks; ++nb) tile<MB, 1>(x, xsum, K, q, d, mins, y, N, nb, table);
}

using RowsFn = void (*)(const uint16_t*, const float*, int64_t, const uint8_t*, const float*, const float*, float*,
                        int64_t, int, __m512i);
constexpr RowsFn BY_ROWS[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

}  // namespace

// xsum: scratch of M * K / 32 floats (each row's sum over each group, in order).
extern "C" void q4_dot(const uint16_t* x, int64_t M, int64_t K, const uint8_t* q, const float* d, const float* mins,
                       float* xsum, float* y, int64_t N, int threads) {
  const int64_t groups = K / 32;
  for (int64_t i = 0; i < M * groups; ++i) {
    float sum = 0.0f;
    for (int k = 0; k < 32; ++k) sum += bf16_value(x[i * 32 + k]);
    xsum[i] = sum;
  }
  alignas(64) uint16_t values[32];
  for (int v = 0; v < 32; ++v) {
    const float f = static_cast<float>(v & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    values[v] = static_cast<uint16_t>(bits >> 16);  // exact: 0..15 need 4 bits
  }
  const __m512i table = _mm512_load_si512(values);
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mb = M - m0 < 8 ? M - m0 : 8;
    BY_ROWS[mb](x + m0 * K, xsum + m0 * groups, K, q, d, mins, y + m0 * N, N, threads, table);
  }
}
