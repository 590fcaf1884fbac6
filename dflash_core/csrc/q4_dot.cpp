// y = x @ w.T for a GGUF Q4_1 matrix, w[n, k] = d[n, g] * q[n, k] + m[n, g] over groups g of 32
// inputs: rows x (M, K) in bf16, the file's own 4-bit codes and its scales and minimums (fp16 in
// the file: exact in fp32); fp32 out. Built by dflash_core/q4_dot.py for CPUs with AVX512-BF16.
//
// A code q becomes the bf16 number 1 + q / 16 by putting it into the mantissa of 1.0 (one shift,
// one vpternlog: exact), so per group
//   sum(x * w) = d * sum(x * q) + m * sum(x) = 16 d * sum(x * (1 + q / 16)) + (m - 16 d) * sum(x),
// the sum of products on vdpbf16ps and each row's sum(x) over the group added once per output.
// Every output is summed in one fixed order whatever the number of rows: a row's numbers never
// depend on the rows beside it (q4_dot.py's probe checks it too).
//
// At one or two rows the kernel is bound by reading the weights, so they are read as the file
// stores them, 20 bytes per 32 weights, in one stream per 16 outputs: packed (N / 16, K / 32, 320)
// bytes, each group's run of 320 the codes (four runs of 32 16-bit words: word 2 j + s of run t
// holds, for output 16 nb + j, input 8 t + 2 v + s of the group in its nibble v, v = 0..3; one
// 512-bit load gives four input pairs for 16 outputs, as vdpbf16ps pairs them), then the 16
// outputs' fp16 scales, then their fp16 minimums.
//
// q4_dot_glu takes a layer's gate/up product (M, 2 I) in fp32 and multiplies SiLU(gate) x up
// (rounded to bf16: the MLP's down product's rows) in its first pass; rope_split lays a layer's
// QKV product out as attention takes it, rotary applied (FastTarget.rope's operations in its order).
//
// q4_dot_floats takes fp32 rows instead and rounds them to bf16 first (to nearest even, as
// PyTorch does), after an RMS norm where given one (a decoder layer's norm before its QKV or
// gate/up matrices: one pass over the rows instead of PyTorch's half a dozen ops); both entries add
// an optional fp32 residual (M, N) to the result.
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t GROUP_BYTES = 320;  // a group of 32 inputs for 16 outputs: codes 256, d 32, m 32

float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// Nibble V of every 16-bit word of w as the bf16 number 1 + q / 16: q moved to mantissa bits 3..6,
// then (w & 0x78) | 0x3F80 in one vpternlog (0xEA: (a & b) | c).
template <int V>
inline __m512bh decode(__m512i w) {
  const __m512i moved = V == 0 ? _mm512_slli_epi16(w, 3) : _mm512_srli_epi16(w, 4 * V - 3);
  return (__m512bh)_mm512_ternarylogic_epi32(moved, _mm512_set1_epi16(0x78), _mm512_set1_epi16(0x3F80), 0xEA);
}

// MB rows times NB blocks of 16 outputs starting at block nb0.
template <int MB, int NB>
void tile(const uint16_t* x, const float* xsum, int64_t K, const uint8_t* q, const float* add, float* y, int64_t N,
          int64_t nb0) {
  __m512 total[MB][NB], group[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) total[m][j] = _mm512_setzero_ps();
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) group[m][j] = _mm512_setzero_ps();
    for (int j = 0; j < NB; ++j) {
      const uint8_t* run = q + ((nb0 + j) * groups + g) * GROUP_BYTES;
      for (int t = 0; t < 4; ++t) {
        const __m512i w = _mm512_loadu_si512(run + 64 * t);
        const __m512bh codes[4] = {decode<0>(w), decode<1>(w), decode<2>(w), decode<3>(w)};
        for (int m = 0; m < MB; ++m)
          for (int v = 0; v < 4; ++v) {
            int32_t pair;
            std::memcpy(&pair, x + m * K + 32 * g + 8 * t + 2 * v, sizeof pair);
            group[m][j] = _mm512_dpbf16_ps(group[m][j], (__m512bh)_mm512_set1_epi32(pair), codes[v]);
          }
      }
    }
    for (int j = 0; j < NB; ++j) {
      // the file's fp16 scale d and minimum m: the kernel multiplies 1 + q / 16, so 16 d and m - 16 d
      const uint8_t* run = q + ((nb0 + j) * groups + g) * GROUP_BYTES;
      const __m512 scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 256))),
                                         _mm512_set1_ps(16.0f));
      const __m512 minimum =
          _mm512_sub_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 288))), scale);
      for (int m = 0; m < MB; ++m) {
        total[m][j] = _mm512_fmadd_ps(group[m][j], scale, total[m][j]);
        total[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), minimum, total[m][j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) {
      const int64_t at = m * N + (nb0 + j) * 16;
      _mm512_storeu_ps(y + at, add ? _mm512_add_ps(total[m][j], _mm512_loadu_ps(add + at)) : total[m][j]);
    }
}

// Up to 8 rows (two sets of accumulators each): fewer rows take more output blocks at once.
template <int MB>
void rows(const uint16_t* x, const float* xsum, int64_t K, const uint8_t* q, const float* add, float* y, int64_t N,
          int threads) {
  constexpr int NB = MB <= 1 ? 8 : (MB <= 2 ? 4 : (MB <= 4 ? 2 : 1));
  const int64_t blocks = N / 16;
  const int64_t sets = blocks / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t s = 0; s < sets; ++s) tile<MB, NB>(x, xsum, K, q, add, y, N, s * NB);
  for (int64_t nb = sets * NB; nb < blocks; ++nb) tile<MB, 1>(x, xsum, K, q, add, y, N, nb);
}

using RowsFn = void (*)(const uint16_t*, const float*, int64_t, const uint8_t*, const float*, float*, int64_t, int);
constexpr RowsFn BY_ROWS[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

uint16_t bf16_bits(float value) {  // to nearest, ties to even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

}  // namespace

// xsum: scratch of M * K / 32 floats (each row's sum over each group, in order); add: null or
// (M, N) fp32 added to the result.
extern "C" void q4_dot(const uint16_t* x, int64_t M, int64_t K, const uint8_t* q, float* xsum, const float* add,
                       float* y, int64_t N, int threads) {
  const int64_t groups = K / 32;
  for (int64_t i = 0; i < M * groups; ++i) {
    float sum = 0.0f;
    for (int k = 0; k < 32; ++k) sum += bf16_value(x[i * 32 + k]);
    xsum[i] = sum;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mb = M - m0 < 8 ? M - m0 : 8;
    BY_ROWS[mb](x + m0 * K, xsum + m0 * groups, K, q, add ? add + m0 * N : nullptr, y + m0 * N, N, threads);
  }
}

// q4_dot of fp32 rows x (M, K), rounded to bf16 into the scratch ``rows`` (M, K) after
// FastTarget.norm's RMS norm where ``norm`` (K) is given: weight * (x * 1 / sqrt(mean(x^2) + eps)).
extern "C" void q4_dot_floats(const float* x, int64_t M, int64_t K, const float* norm, float eps, uint16_t* rows,
                              const uint8_t* q, float* xsum, const float* add, float* y, int64_t N, int threads) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float scale = 1.0f;
    if (norm) {
      float squares = 0.0f;
      for (int64_t k = 0; k < K; ++k) squares += row[k] * row[k];
      scale = 1.0f / std::sqrt(squares / static_cast<float>(K) + eps);
    }
    for (int64_t k = 0; k < K; ++k) rows[m * K + k] = bf16_bits(norm ? norm[k] * (row[k] * scale) : row[k]);
  }
  q4_dot(rows, M, K, q, xsum, add, y, N, threads);
}

namespace {

// e^x for fp32 lanes: 2^n e^r with n = round(x / ln 2) and e^r (|r| <= ln 2 / 2) a degree-6
// Taylor polynomial, within a few fp32 ulps (SiLU's result is then rounded to bf16).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace

// q4_dot of the rows SiLU(gu[:, :I]) x gu[:, I:] (gu (M, 2 I) fp32), rounded to bf16 into the
// scratch ``rows`` (M, I): K = I.
extern "C" void q4_dot_glu(const float* gu, int64_t M, int64_t K, uint16_t* rows, const uint8_t* q, float* xsum,
                           const float* add, float* y, int64_t N, int threads) {
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = gu + m * 2 * K;
    const float* up = gate + K;
    for (int64_t k = 0; k < K; k += 16) {  // K is a multiple of 32
      const __m512 g = _mm512_loadu_ps(gate + k);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      const __m512 value = _mm512_mul_ps(silu, _mm512_loadu_ps(up + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + m * K + k), (__m256i)_mm512_cvtneps_pbh(value));
    }
  }
  q4_dot(rows, M, K, q, xsum, add, y, N, threads);
}

// qkv (T, H + 2 KV, D) fp32 into q (T, H, D) and k (T, KV, D) with rotary applied,
// x * cos + roll(x, D / 2) * sin as FastTarget.rope computes it (cos, sin (T, H + KV, D)), and v (T, KV, D).
extern "C" void rope_split(const float* qkv, int64_t T, int64_t H, int64_t KV, int64_t D, const float* cos,
                           const float* sin, float* q, float* k, float* v) {
  const int64_t half = D / 2, heads = H + 2 * KV;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H + KV; ++h) {
      const float* x = qkv + (t * heads + h) * D;
      const float* c = cos + (t * (H + KV) + h) * D;
      const float* s = sin + (t * (H + KV) + h) * D;
      float* out = h < H ? q + (t * H + h) * D : k + (t * KV + h - H) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rolled = x[d < half ? d + half : d - half];
        const float a = x[d] * c[d];
        const float b = rolled * s[d];
        out[d] = a + b;
      }
    }
    std::memcpy(v + t * KV * D, qkv + (t * heads + H + KV) * D, sizeof(float) * KV * D);
  }
}
