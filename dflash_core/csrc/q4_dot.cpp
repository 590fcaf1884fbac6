// y = x @ w.T for a GGUF Q4_1 matrix, w[n, k] = d[n, g] * q[n, k] + m[n, g] over groups g of 32
// inputs: rows x (M, K) in bf16, the file's own 4-bit codes and its scales and minimums (fp16 in
// the file: exact in fp32); fp32 out. Built by dflash_core/q4_dot.py for CPUs with AVX512-BF16;
// the AVX2 build (avx2_as_avx512.h) leaves these bf16 entries out and keeps the int8-rows ones below.
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

#include "blocks.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef DFLASH_AVX2  // the bf16 dot products (q4_dot*): AVX512-BF16 CPUs only (int8_dot.cannot_run)
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
  zero(total);
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    zero(group);
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
  store(total, add, y, N, nb0);
}

// Up to 8 rows (two sets of accumulators each): fewer rows take more output blocks at once.
template <int MB>
void rows(const uint16_t* x, const float* xsum, int64_t K, const uint8_t* q, const float* add, float* y, int64_t N,
          int threads) {
  constexpr int NB = MB <= 1 ? 8 : (MB <= 2 ? 4 : (MB <= 4 ? 2 : 1));
  over_block_sets<NB>(N, threads, [&](int64_t nb) { tile<MB, NB>(x, xsum, K, q, add, y, N, nb); },
                      [&](int64_t nb) { tile<MB, 1>(x, xsum, K, q, add, y, N, nb); });
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
  over_row_runs(M, 8, [&](int64_t m0, int64_t mb) {
    BY_ROWS[mb](x + m0 * K, xsum + m0 * groups, K, q, add ? add + m0 * N : nullptr, y + m0 * N, N, threads);
  });
}

// q4_dot of fp32 rows x (M, K), rounded to bf16 into the scratch ``rows`` (M, K) after
// FastTarget.norm's RMS norm where ``norm`` (K) is given: weight * (x * 1 / sqrt(mean(x^2) + eps)).
extern "C" void q4_dot_floats(const float* x, int64_t M, int64_t K, const float* norm, float eps, uint16_t* rows,
                              const uint8_t* q, float* xsum, const float* add, float* y, int64_t N, int threads) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    const float scale = norm ? rms_scale(row, K, eps) : 1.0f;
    for (int64_t k = 0; k < K; ++k) rows[m * K + k] = bf16_bits(norm ? norm[k] * (row[k] * scale) : row[k]);
  }
  q4_dot(rows, M, K, q, xsum, add, y, N, threads);
}

#endif  // DFLASH_AVX2
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

// SiLU(gate) x up for 16 lanes.
inline __m512 silu_times_up(const float* gate, const float* up) {
  const __m512 g = _mm512_loadu_ps(gate);
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(silu, _mm512_loadu_ps(up));
}

}  // namespace

#ifndef DFLASH_AVX2
// q4_dot of the rows SiLU(gu[:, :I]) x gu[:, I:] (gu (M, 2 I) fp32), rounded to bf16 into the
// scratch ``rows`` (M, I): K = I.
extern "C" void q4_dot_glu(const float* gu, int64_t M, int64_t K, uint16_t* rows, const uint8_t* q, float* xsum,
                           const float* add, float* y, int64_t N, int threads) {
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = gu + m * 2 * K;
    const float* up = gate + K;
    for (int64_t k = 0; k < K; k += 16)  // K is a multiple of 32
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + m * K + k), (__m256i)_mm512_cvtneps_pbh(silu_times_up(gate + k, up + k)));
  }
  q4_dot(rows, M, K, q, xsum, add, y, N, threads);
}
#endif

// qkv (T, H + 2 KV, D) fp32 into q (T, H, D) and k (T, KV, D) with rotary applied,
// x * cos + roll(x, D / 2) * sin as FastTarget.rope computes it, and v (T, KV, D). The tables
// cos, sin are (T, table_heads, D): a row per head (table_heads = H + KV) or one for all
// (table_heads = 1). Where q_norm / k_norm (D) are given, each query / key head is first RMS-normed
// as the drafter's RMSNorm does it: weight * (x * 1 / sqrt(mean(x^2) + eps)). ``rotate_half``: the
// rolled first half negated, as the drafter's rotate_half does (FastTarget's sin table carries
// that sign instead): x * cos + rotate_half(x) * sin. Where q is null the queries are skipped.
extern "C" void rope_split(const float* qkv, int64_t T, int64_t H, int64_t KV, int64_t D, const float* cos,
                           const float* sin, int64_t table_heads, const float* q_norm, const float* k_norm, float eps,
                           int rotate_half, float* q, float* k, float* v) {
  const int64_t half = D / 2, heads = H + 2 * KV;
  std::vector<float> normed(D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = q ? 0 : H; h < H + KV; ++h) {
      const float* x = qkv + (t * heads + h) * D;
      const float* weight = h < H ? q_norm : k_norm;
      if (weight) {
        rms_norm_rows(x, 1, D, weight, eps, normed.data());
        x = normed.data();
      }
      const int64_t table = (t * table_heads + (table_heads == 1 ? 0 : h)) * D;
      const float* c = cos + table;
      const float* s = sin + table;
      float* out = h < H ? q + (t * H + h) * D : k + (t * KV + h - H) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rolled = d < half ? (rotate_half ? -x[d + half] : x[d + half]) : x[d - half];
        const float a = x[d] * c[d];
        const float b = rolled * s[d];
        out[d] = a + b;
      }
    }
    std::memcpy(v + t * KV * D, qkv + (t * heads + H + KV) * D, sizeof(float) * KV * D);
  }
}

// ---------------------------------------------------------------------------------------------
// Rows as int8, as llama.cpp multiplies a GGUF's matrices (its Q8_1 / Q8_0 rows): each row's group
// of 32 inputs becomes codes r = round(x / s), s = max |x| / 127, and the group's products are sums
// of byte products, exact in int32 on AVX512-VNNI's vpdpbusd (64 an instruction, twice vdpbf16ps'
// pairs), one unsigned and one signed byte each:
//   Q4_1 weights (d, m, codes q in 0..15, the unsigned bytes):  s * (d * sum(r * q) + m * sum(r))
//   Q8_0 weights (d, signed codes c; the rows' r + 128 the unsigned bytes):
//                                                               s * d * (sum((r + 128) * c) - 128 * sum(c))
// Layouts (int8_rows.py packs them), per group of 32 inputs and 16 outputs:
//   Q4 (320 bytes): four runs of 64 bytes (run t: byte 4 j + i holds output j's input 8 t + i in its
//     low nibble, 8 t + 4 + i in its high one: one and / one shift + and give vpdpbusd's bytes),
//     then the outputs' fp16 scales and minimums (the file's);
//   Q8 (640 bytes): eight runs of 64 signed codes (run p: byte 4 j + i is output j's input 4 p + i),
//     then the outputs' fp32 scales and their int32 128 * sum(c).
// A row's sums run in one fixed order whatever the rows beside it.

namespace {

enum Format { Q4 = 0, Q8 = 1 };

template <int F>
constexpr int64_t FORMAT_BYTES = F == Q4 ? 320 : 640;

// (M, K) fp32 rows into int8 codes (plus 128 as unsigned bytes where ``shift``) and, per group, its
// scale s and s * sum(codes), group by group: the codes (K / 32, M, 32), the scales (K / 32, M, 2),
// so that a tile's rows sit at fixed offsets from one address per group.
void quantize_rows(const float* x, int64_t M, int64_t K, bool shift, int8_t* codes, float* scales) {
  const int64_t groups = K / 32;
  const __m128i flip = _mm_set1_epi8(static_cast<char>(shift ? 0x80 : 0));
  for (int64_t i = 0; i < M * groups; ++i) {
    const int64_t at = (i % groups) * M + i / groups;  // group, row
    const __m512 a = _mm512_loadu_ps(x + 32 * i), b = _mm512_loadu_ps(x + 32 * i + 16);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float s = largest / 127.0f;
    const __m512 inverse = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // to nearest, ties to even
    const __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 32 * at), _mm_xor_si128(_mm512_cvtepi32_epi8(ra), flip));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 32 * at + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(rb), flip));
    scales[2 * at] = s;
    scales[2 * at + 1] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ra, rb)));
  }
}

// The groups four ahead of ``run`` on their way (hints past the matrix's end are harmless): from 6
// to 16 rows 10-20% faster, no slower at fewer (scripts/csrc_ab.py).
template <int F>
inline void prefetch_ahead(const uint8_t* run) {
  for (int line = 0; line < FORMAT_BYTES<F>; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(run + 4 * FORMAT_BYTES<F> + line), _MM_HINT_T0);
}

#ifdef DFLASH_AVX2
// The scales (and Q4's minimums) of half h (8 outputs) of the group at ``run``.
template <int F>
inline void half_scales(const uint8_t* run, int h, __m256& scale, __m256& minimum) {
  if constexpr (F == Q4) {
    scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 256 + 16 * h)));
    minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 288 + 16 * h)));
  } else {
    scale = _mm256_loadu_ps(reinterpret_cast<const float*>(run + 512 + 32 * h));
    minimum = _mm256_setzero_ps();  // Q8 has none
  }
}

// A row's exact int32 sums of a group half added to its total: tile8's float steps, in its order
// (s: the row's scale for the group and, Q4, its scale times the sum of its codes).
template <int F>
inline __m256 add_group(__m256 total, __m256i sum, __m256 scale, __m256 minimum, const float* s) {
  total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(s[0])), total);
  if constexpr (F == Q4) total = _mm256_fmadd_ps(_mm256_set1_ps(s[1]), minimum, total);
  return total;
}

// Bytes 4p..4p+3 of a row's group as one int32 (broadcast, they meet four inputs of each output).
inline int32_t four_bytes(const int8_t* row, int p) {
  int32_t bytes;
  std::memcpy(&bytes, row + 4 * p, sizeof bytes);
  return bytes;
}

// Q4: a 32-byte line's two code registers, the low nibbles (codes 2t) and the high (2t + 1).
inline void nibbles(__m256i w, __m256i& low_codes, __m256i& high_codes) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  low_codes = _mm256_and_si256(w, low);
  high_codes = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
}

// Q8: the int32 sums of c * r for the codes c (``signs``, their magnitudes |c|) and four rows'
// bytes stored as r + 128 (``four``): |c| * (r signed by c), whose pairs vpmaddubsw sums exactly.
inline __m256i q8_dot(__m256i magnitudes, __m256i signs, int32_t four) {
  const __m256i signed_rows = _mm256_sign_epi8(_mm256_set1_epi32(four ^ static_cast<int32_t>(0x80808080u)), signs);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, signed_rows), _mm256_set1_epi16(1));
}

// The two halves' totals of MB rows stored as tile8's 16-output blocks.
template <int MB>
inline void store_halves(const __m256 (&total)[2][MB], const float* add, float* y, int64_t N, int64_t nb) {
  __m512 out[MB][1];
  for (int m = 0; m < MB; ++m) out[m][0] = {total[0][m], total[1][m]};
  store(out, add, y, N, nb);
}

// An AVX2 tile's frame: the two halves' totals of MB rows, zeroed, ``group(run, rows, row_scales,
// total)`` on each group of the block nb in order (its packed codes, the rows' codes and scales
// there, as quantize_rows lays them out), then stored.
template <int F, int MB, typename Group>
inline void over_groups(const int8_t* x, const float* xs, int64_t M, int64_t K, const uint8_t* q, const float* add,
                        float* y, int64_t N, int64_t nb, Group group) {
  __m256 total[2][MB];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MB; ++m) total[h][m] = _mm256_setzero_ps();
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* run = q + (nb * groups + g) * FORMAT_BYTES<F>;
    prefetch_ahead<F>(run);
    group(run, x + g * M * 32, xs + g * M * 2, total);
  }
  store_halves(total, add, y, N, nb);
}

// tile8's AVX2 form, one half of the block's 16 outputs at a time (its codes in eight registers of
// the sixteen). Its int32 sums are tile8's (exact integers) and the float steps after them the
// same, so a row's numbers are what the AVX-512 build computes.
//   Q4: vpmaddubsw multiplies the codes (unsigned, below 16) with the rows' bytes into 16-bit pair
//       sums; a row's eight of a group are added in 16 bits (each lane at most 8 x 2 x 15 x 127 =
//       30,480: exact) and widened once by vpmaddwd: half the multiplies of vpdpbusd emulated per step.
//   Q8: the rows' bytes back to signed (r = stored ^ 0x80) and each product c * r as |c| * (r signed
//       by c), vpmaddubsw's pairs then at most 2 x 128 x 127 = 32,512 (exact): sum(r * c) directly,
//       which is tile8's sum((r + 128) * c) - 128 * sum(c).
template <int F, int MB>
void tile8_avx2(const int8_t* x, const float* xs, int64_t M, int64_t K, const uint8_t* q, const float* add, float* y,
                int64_t N, int64_t nb) {
  const __m256i ones = _mm256_set1_epi16(1);
  over_groups<F, MB>(x, xs, M, K, q, add, y, N, nb, [&](const uint8_t* run, const int8_t* rows, const float* row_scales,
                                                         __m256 (&total)[2][MB]) {
    for (int h = 0; h < 2; ++h) {
      const auto at = [&](int offset) { return reinterpret_cast<const __m256i*>(run + offset + 32 * h); };
      __m256i codes[8];  // Q4: the codes; Q8: their magnitudes
      __m256 scale, minimum;
      half_scales<F>(run, h, scale, minimum);
      if constexpr (F == Q4) {
        for (int t = 0; t < 4; ++t) nibbles(_mm256_loadu_si256(at(64 * t)), codes[2 * t], codes[2 * t + 1]);
      } else {
        for (int p = 0; p < 8; ++p) codes[p] = _mm256_abs_epi8(_mm256_loadu_si256(at(64 * p)));
      }
      for (int m = 0; m < MB; ++m) {
        const int8_t* row = rows + 32 * m;
        __m256i sum = _mm256_setzero_si256();  // Q4: 16-bit pair sums until widened
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          const int32_t four = four_bytes(row, p);
          if constexpr (F == Q4)
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(codes[p], _mm256_set1_epi32(four)));
          else
            sum = _mm256_add_epi32(sum, q8_dot(codes[p], _mm256_loadu_si256(at(64 * p)), four));
        }
        if constexpr (F == Q4) sum = _mm256_madd_epi16(sum, ones);
        total[h][m] = add_group<F>(total[h][m], sum, scale, minimum, row_scales + 2 * m);
      }
    }
  });
}

// Up to this many rows tile8_avx2_few is the faster form (beyond, Q4_1's ran slower and Q8_0's no
// faster: docs/BENCHMARKS-AVX2.md, from scripts/csrc_ab.py --kernels products,q8_products).
template <int F>
constexpr int FEW_ROWS = F == Q4 ? 6 : 4;

// tile8_avx2 for a few rows, where the codes serve too few rows to be worth holding: each
// code register is decoded (Q4) or loaded (Q8) as the products reach it, for both halves of the
// block, each row's four bytes read once for both. The same exact int32 sums (16-bit adds
// of vpmaddubsw's pair sums cannot overflow, so their order is free) and the same float steps in
// the same order, so a row's numbers are tile8_avx2's. Holding the eight codes of a half costs
// half of AVX2's sixteen registers, and each row's broadcasts are made once per half there.
template <int F, int MB>
void tile8_avx2_few(const int8_t* x, const float* xs, int64_t M, int64_t K, const uint8_t* q, const float* add,
                    float* y, int64_t N, int64_t nb) {
  static_assert(MB <= FEW_ROWS<F>, "few rows only");
  const __m256i ones = _mm256_set1_epi16(1);
  over_groups<F, MB>(x, xs, M, K, q, add, y, N, nb, [&](const uint8_t* run, const int8_t* rows, const float* row_scales,
                                                         __m256 (&total)[2][MB]) {
    const auto at = [&](int offset, int h) { return reinterpret_cast<const __m256i*>(run + offset + 32 * h); };
    const auto four = [&](int m, int p) { return four_bytes(rows + 32 * m, p); };
    __m256i sum[2][MB];  // Q4: 16-bit pair sums until widened; Q8: int32
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MB; ++m) sum[h][m] = _mm256_setzero_si256();
    if constexpr (F == Q4) {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {  // codes 2t (low nibbles) and 2t + 1 (high) of each half
        __m256i even[MB], odd[MB];
        for (int m = 0; m < MB; ++m) {
          even[m] = _mm256_set1_epi32(four(m, 2 * t));
          odd[m] = _mm256_set1_epi32(four(m, 2 * t + 1));
        }
        for (int h = 0; h < 2; ++h) {
          __m256i c0, c1;
          nibbles(_mm256_loadu_si256(at(64 * t, h)), c0, c1);
          for (int m = 0; m < MB; ++m)
            sum[h][m] = _mm256_add_epi16(sum[h][m], _mm256_add_epi16(_mm256_maddubs_epi16(c0, even[m]),
                                                                       _mm256_maddubs_epi16(c1, odd[m])));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        for (int h = 0; h < 2; ++h) {
          const __m256i signs = _mm256_loadu_si256(at(64 * p, h)), codes = _mm256_abs_epi8(signs);
          for (int m = 0; m < MB; ++m) sum[h][m] = _mm256_add_epi32(sum[h][m], q8_dot(codes, signs, four(m, p)));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, minimum;
      half_scales<F>(run, h, scale, minimum);
      for (int m = 0; m < MB; ++m) {
        const __m256i whole = F == Q4 ? _mm256_madd_epi16(sum[h][m], ones) : sum[h][m];
        total[h][m] = add_group<F>(total[h][m], whole, scale, minimum, row_scales + 2 * m);
      }
    }
  });
}
#endif

// MB rows (of M, laid out by quantize_rows; x and xs at the first) times the block of 16 outputs nb.
// One block at a time: its eight code registers and MB accumulators stay in registers (more blocks
// at once spilled codes to the stack at two and four rows, and ran slower: scripts/csrc_ab.py).
template <int F, int MB>
void tile8(const int8_t* x, const float* xs, int64_t M, int64_t K, const uint8_t* q, const float* add, float* y,
           int64_t N, int64_t nb) {
#ifdef DFLASH_AVX2
  if constexpr (MB <= FEW_ROWS<F>)
    tile8_avx2_few<F, MB>(x, xs, M, K, q, add, y, N, nb);
  else
    tile8_avx2<F, MB>(x, xs, M, K, q, add, y, N, nb);
#else
  __m512 total[MB][1];
  zero(total);
  const int64_t groups = K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* run = q + (nb * groups + g) * FORMAT_BYTES<F>;
    prefetch_ahead<F>(run);
    __m512i codes[8];
    __m512 scale, minimum;
    __m512i offset;
    if constexpr (F == Q4) {
      for (int t = 0; t < 4; ++t) {
        const __m512i w = _mm512_loadu_si512(run + 64 * t);
        codes[2 * t] = _mm512_and_si512(w, low);
        codes[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      }
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 256)));
      minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 288)));
    } else {
      for (int p = 0; p < 8; ++p) codes[p] = _mm512_loadu_si512(run + 64 * p);
      scale = _mm512_loadu_ps(reinterpret_cast<const float*>(run + 512));
      offset = _mm512_loadu_si512(run + 576);
    }
    const int8_t* rows = x + g * M * 32;
    const float* row_scales = xs + g * M * 2;
#pragma GCC unroll 16  // every row's accumulator stays in a register
    for (int m = 0; m < MB; ++m) {
      const int8_t* row = rows + 32 * m;
      __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        int32_t four;
        std::memcpy(&four, row + 4 * p, sizeof four);
        const __m512i rows4 = _mm512_set1_epi32(four);
        sum = F == Q4 ? _mm512_dpbusd_epi32(sum, codes[p], rows4) : _mm512_dpbusd_epi32(sum, rows4, codes[p]);
      }
      const float* s = row_scales + 2 * m;
      if constexpr (F == Q4) {
        total[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(s[0])), total[m][0]);
        total[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(s[1]), minimum, total[m][0]);
      } else {
        total[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, offset)),
                                      _mm512_mul_ps(scale, _mm512_set1_ps(s[0])), total[m][0]);
      }
    }
  }
  store(total, add, y, N, nb);
#endif
}

// Up to 16 rows in one pass over the weights, the output blocks split across the threads.
template <int F, int MB>
void rows8(const int8_t* x, const float* xs, int64_t M, int64_t K, const uint8_t* q, const float* add, float* y,
           int64_t N, int threads) {
  const auto block = [&](int64_t nb) { tile8<F, MB>(x, xs, M, K, q, add, y, N, nb); };
  over_block_sets<1>(N, threads, block, block);  // one block a set: none left over
}

using Rows8Fn = void (*)(const int8_t*, const float*, int64_t, int64_t, const uint8_t*, const float*, float*, int64_t,
                         int);

template <int F>
constexpr Rows8Fn BY_ROWS8[17] = {nullptr,       rows8<F, 1>,  rows8<F, 2>,  rows8<F, 3>,  rows8<F, 4>,  rows8<F, 5>,
                                  rows8<F, 6>,   rows8<F, 7>,  rows8<F, 8>,  rows8<F, 9>,  rows8<F, 10>, rows8<F, 11>,
                                  rows8<F, 12>,  rows8<F, 13>, rows8<F, 14>, rows8<F, 15>, rows8<F, 16>};

void int8_rows_product(int format, const float* rows, int64_t M, int64_t K, const uint8_t* q, const float* add,
                       float* y, int64_t N, int threads) {
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scales;
  codes.resize(M * K);
  scales.resize(2 * M * (K / 32));
  quantize_rows(rows, M, K, format == Q8, codes.data(), scales.data());
  over_row_runs(M, 16, [&](int64_t m0, int64_t mb) {
    const Rows8Fn fn = format == Q4 ? BY_ROWS8<Q4>[mb] : BY_ROWS8<Q8>[mb];
    fn(codes.data() + 32 * m0, scales.data() + 2 * m0, M, K, q, add ? add + m0 * N : nullptr, y + m0 * N, N, threads);
  });
}

// The rows the product takes when they are computed first (normed, or SiLU x up): per thread.
float* row_scratch(int64_t size) {
  thread_local std::vector<float> rows;
  rows.resize(size);
  return rows.data();
}

}  // namespace

// The product of fp32 rows x (M, K) quantized per group of 32 to int8 with the matrix q of
// ``format`` (0: Q4, 1: Q8; layouts above), after FastTarget.norm's RMS norm where ``norm`` (K)
// is given; plus an optional fp32 residual ``add`` (M, N); fp32 out.
extern "C" void int8_rows_floats(int format, const float* x, int64_t M, int64_t K, const float* norm, float eps,
                                 const uint8_t* q, const float* add, float* y, int64_t N, int threads) {
  if (norm) {
    float* normed = row_scratch(M * K);
    rms_norm_rows(x, M, K, norm, eps, normed);
    x = normed;
  }
  int8_rows_product(format, x, M, K, q, add, y, N, threads);
}

// int8_rows_floats of the rows SiLU(gu[:, :I]) x gu[:, I:] (gu (M, 2 I) fp32): K = I.
extern "C" void int8_rows_glu(int format, const float* gu, int64_t M, int64_t K, const uint8_t* q, const float* add,
                              float* y, int64_t N, int threads) {
  float* rows = row_scratch(M * K);
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = gu + m * 2 * K;
    const float* up = gate + K;
    for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(rows + m * K + k, silu_times_up(gate + k, up + k));
  }
  int8_rows_product(format, rows, M, K, q, add, y, N, threads);
}

// ---------------------------------------------------------------------------------------------
// A target layer's attention for its rows (dot_attention.py): the rows' keys and values k, v
// (T, KV, D) written into the layer's cache keys, values (KV, C, D) at their positions rows[t],
// then for each query head h of row t (q (T, H, D), already scaled) softmax(q . keys[g, 0..p]) .
// values[g, 0..p] over the row's own positions 0..p = rows[t], g = h / (H / KV), into out
// (T, H * D). Each (row, head) is summed alone, in one order set by its position only, so a row's
// numbers never depend on the rows beside it in a call (D a multiple of 16, at most 256).

namespace {

// The sums of 16 vectors' lanes, lane j the sum of a[j]'s: pairs of lanes added within 128-bit
// chunks, then the chunks (one fixed tree, whatever the caller).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

#ifdef DFLASH_AVX2
// The sums of four keys' 8-lane products (a half of sum_lanes16's inputs) in sum_lanes16's tree:
// lane pairs within 128-bit chunks, then the two chunks: key j's (l0 + l2) + (l1 + l3), plus the same
// of lanes 4-7.
inline __m128 four_sums(const __m256* a) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
  const __m256d x = _mm256_castps_pd(ab), y = _mm256_castps_pd(cd);
  const __m256 s = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// One query's dot products with 16 keys (the first ``live`` of them; 0 for the rest), the same
// numbers as the AVX-512 form below (each key's 16 lanes summed by sum_lanes16's tree), four keys at
// a time: the two-half emulation of sum_lanes16 holds 32 registers of products where AVX2 has 16.
template <int LANES>
inline __m512 key_scores(const float* query, const float* key, int64_t live) {
  constexpr int64_t D = 16 * LANES;
  __m256 q[2 * LANES];
  for (int c = 0; c < 2 * LANES; ++c) q[c] = _mm256_loadu_ps(query + 8 * c);
  __m128 four[4];
  for (int64_t g = 0; g < 4; ++g) {
    __m256 low[4], high[4];  // lanes 0-7 and 8-15 of each key's products
    for (int64_t j = 0; j < 4; ++j) {
      if (4 * g + j >= live) {
        low[j] = high[j] = _mm256_setzero_ps();
        continue;
      }
      const float* at = key + (4 * g + j) * D;
      low[j] = _mm256_mul_ps(q[0], _mm256_loadu_ps(at));
      high[j] = _mm256_mul_ps(q[1], _mm256_loadu_ps(at + 8));
      for (int c = 1; c < LANES; ++c) {
        low[j] = _mm256_fmadd_ps(q[2 * c], _mm256_loadu_ps(at + 16 * c), low[j]);
        high[j] = _mm256_fmadd_ps(q[2 * c + 1], _mm256_loadu_ps(at + 16 * c + 8), high[j]);
      }
    }
    four[g] = _mm_add_ps(four_sums(low), four_sums(high));
  }
  return {_mm256_set_m128(four[1], four[0]), _mm256_set_m128(four[3], four[2])};
}
#endif

// Queries beyond this many per call of attend_queries are split into more tasks.
constexpr int64_t MOST_QUERIES = 48;
// Positions whose values are added for every query before the next ones are read (in L1: 32 x D floats).
constexpr int64_t VALUE_RUN = 32;

// Q query heads sharing one KV head's keys and values, query i over its n[i] positions 0..n[i]-1,
// into out[i]. Each query's numbers are what it gets alone (its sums run in the same order: 16
// keys' dot products summed across lanes together, then the exponentials, then the values in
// position order): the queries only share reads of the keys and values, which is what bounds
// attention at a few rows (each query head reading its KV head's cache from L2 alone read it
// H / KV times per row). scores: Q x stride floats (stride >= max n + 16); acc: Q x D floats.
template <int LANES>
void attend_queries(const float* const* query, const int64_t* n, int64_t Q, const float* key, const float* value,
                    float* scores, int64_t stride, float* acc, float* const* out) {
  constexpr int64_t D = 16 * LANES;
  int64_t most = 0;
  for (int64_t i = 0; i < Q; ++i) most = n[i] > most ? n[i] : most;
  __m512 largest[MOST_QUERIES];
  for (int64_t i = 0; i < Q; ++i) largest[i] = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < most; j0 += 16)
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t live = n[i] - j0 < 16 ? n[i] - j0 : 16;
      if (live <= 0) continue;
#ifdef DFLASH_AVX2
      const __m512 sums = key_scores<LANES>(query[i], key + j0 * D, live);
#else
      __m512 q[LANES];
      for (int c = 0; c < LANES; ++c) q[c] = _mm512_loadu_ps(query[i] + 16 * c);
      __m512 dots[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= live) {
          dots[j] = _mm512_setzero_ps();
          continue;
        }
        const float* at = key + (j0 + j) * D;
        __m512 dot = _mm512_mul_ps(q[0], _mm512_loadu_ps(at));
        for (int c = 1; c < LANES; ++c) dot = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(at + 16 * c), dot);
        dots[j] = dot;
      }
      const __m512 sums = sum_lanes16(dots);
#endif
      const __mmask16 mask = live == 16 ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
      _mm512_storeu_ps(scores + i * stride + j0, sums);
      largest[i] = _mm512_mask_max_ps(largest[i], mask, largest[i], sums);
    }
  float inverse[MOST_QUERIES];
  for (int64_t i = 0; i < Q; ++i) {
    float* s = scores + i * stride;
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(largest[i]));
    __m512 total = _mm512_setzero_ps();
    // Whole runs of 16 unmasked (AVX2's masked loads and stores are slow); the last run's lanes
    // past n[i] hold what the scores' loop stored there, are not added, and are never read again.
    int64_t j = 0;
    for (; j + 16 <= n[i]; j += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), top));
      _mm512_storeu_ps(s + j, e);
      total = _mm512_add_ps(total, e);
    }
    if (j < n[i]) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), top));
      _mm512_storeu_ps(s + j, e);
      total = _mm512_mask_add_ps(total, static_cast<__mmask16>((1u << (n[i] - j)) - 1), total, e);
    }
    inverse[i] = 1.0f / _mm512_reduce_add_ps(total);
    for (int c = 0; c < LANES; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, _mm512_setzero_ps());
  }
  for (int64_t j0 = 0; j0 < most; j0 += VALUE_RUN)
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t end = n[i] < j0 + VALUE_RUN ? n[i] : j0 + VALUE_RUN;
      if (end <= j0) continue;
      const float* s = scores + i * stride;
      __m512 sum[LANES];
      for (int c = 0; c < LANES; ++c) sum[c] = _mm512_loadu_ps(acc + i * D + 16 * c);
      for (int64_t j = j0; j < end; ++j) {
        const __m512 weight = _mm512_set1_ps(s[j]);
        for (int c = 0; c < LANES; ++c) sum[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + j * D + 16 * c), sum[c]);
      }
      for (int c = 0; c < LANES; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, sum[c]);
    }
  for (int64_t i = 0; i < Q; ++i)
    for (int c = 0; c < LANES; ++c)
      _mm512_storeu_ps(out[i] + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * c), _mm512_set1_ps(inverse[i])));
}

using QueriesFn = void (*)(const float* const*, const int64_t*, int64_t, const float*, const float*, float*, int64_t,
                           float*, float* const*);
constexpr QueriesFn BY_LANES[17] = {nullptr,
                                    attend_queries<1>,  attend_queries<2>,  attend_queries<3>,  attend_queries<4>,
                                    attend_queries<5>,  attend_queries<6>,  attend_queries<7>,  attend_queries<8>,
                                    attend_queries<9>,  attend_queries<10>, attend_queries<11>, attend_queries<12>,
                                    attend_queries<13>, attend_queries<14>, attend_queries<15>, attend_queries<16>};

// Each row t's query heads (q (T, H, D)) over its n[t] positions 0..n[t]-1 of the cache keys,
// values (KV, C, D) into out (T, H * D).
void attend_rows(const float* q, const int64_t* n, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t C,
                 const float* keys, const float* values, float* out, int threads) {
  // Each KV head's queries (row-major over rows, then its query heads) in ``parts`` runs: enough
  // runs for every thread to have two, none longer than MOST_QUERIES.
  const int64_t group = H / KV, per_head = T * group;
  int64_t parts = (2 * threads + KV - 1) / KV;
  const int64_t at_least = (per_head + MOST_QUERIES - 1) / MOST_QUERIES;
  parts = parts < at_least ? at_least : parts;
  parts = parts > per_head ? per_head : parts;
  const QueriesFn attend = BY_LANES[D / 16];
  int64_t most = 0;
  for (int64_t t = 0; t < T; ++t) most = n[t] > most ? n[t] : most;
  const int64_t stride = most + 16;
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<float> scores, acc;
    scores.resize(MOST_QUERIES * stride);
    acc.resize(MOST_QUERIES * D);
    const float* query[MOST_QUERIES];
    float* into[MOST_QUERIES];
    int64_t lengths[MOST_QUERIES];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < KV * parts; ++task) {
      const int64_t g = task / parts, part = task % parts;
      const int64_t first = part * per_head / parts, last = (part + 1) * per_head / parts;
      for (int64_t i = first; i < last; ++i) {
        const int64_t t = i / group, h = g * group + i % group;
        query[i - first] = q + (t * H + h) * D;
        into[i - first] = out + (t * H + h) * D;
        lengths[i - first] = n[t];
      }
      attend(query, lengths, last - first, keys + g * C * D, values + g * C * D, scores.data(), stride, acc.data(),
             into);
    }
  }
}

// Row t's keys and values k, v (T, KV, D) into the cache keys, values (KV, C, D) at position rows[t].
void write_rows(const float* k, const float* v, float* keys, float* values, const int64_t* rows, int64_t T,
                int64_t KV, int64_t D, int64_t C) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < KV; ++g) {
      std::memcpy(keys + (g * C + rows[t]) * D, k + (t * KV + g) * D, sizeof(float) * D);
      std::memcpy(values + (g * C + rows[t]) * D, v + (t * KV + g) * D, sizeof(float) * D);
    }
}

}  // namespace

extern "C" void write_and_attend(const float* q, const float* k, const float* v, float* keys, float* values,
                                 const int64_t* rows, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t C,
                                 float* out, int threads) {
  write_rows(k, v, keys, values, rows, T, KV, D, C);
  std::vector<int64_t> n(T);
  for (int64_t t = 0; t < T; ++t) n[t] = rows[t] + 1;
  attend_rows(q, n.data(), T, H, KV, D, C, keys, values, out, threads);
}

// ---------------------------------------------------------------------------------------------
// Every decoder layer of a w4a8 target in one call (q4_layers.FusedPass): for each layer, the
// calls q4_layers makes from Python, in its order and with its buffers' precision, so the numbers
// are bit for bit those of the layer-by-layer path:
//   qkv = int8_rows_floats(x, ln1) ; q, k, v = rope_split(qkv) ; att = write_and_attend(q, k, v)
//   h = int8_rows_floats(att) + x ; gu = int8_rows_floats(h, ln2) ; x = int8_rows_glu(gu) + h
// ``layers`` holds, per layer, 6 addresses: the packed QKV, O, gate/up and down matrices and the
// two norms' weights. Keys and values of layer l sit at keys + l * layer_stride (floats). x (T, E)
// is updated in place; where ``features`` is given, x after layer l is copied to features +
// slot[l] * T * E for the layers with slot[l] >= 0.
// A chain pass (turns null) attends all T rows in one call. A draft tree's pass (tree_attention)
// attends each of ``n_turns`` runs of rows [turns[2 i], turns[2 i + 1]) in its own call, in order
// (a path's new nodes), copies the last real row's attention to the padding rows after ``real``,
// and, where tree_k / tree_v are given, keeps every layer's k and v (L, T, KV, D).
extern "C" void w4a8_pass(const int64_t* layers, int64_t L, float* x, int64_t T, int64_t E, int64_t H, int64_t KV,
                          int64_t D, int64_t I, const float* cos, const float* sin, const int64_t* rows, float* keys,
                          float* values, int64_t layer_stride, int64_t C, float eps, const int64_t* slot,
                          float* features, const int64_t* turns, int64_t n_turns, int64_t real, float* tree_k,
                          float* tree_v, int threads) {
  const int64_t width = (H + 2 * KV) * D;
  std::vector<float> qkv(T * width), q(T * H * D), k(T * KV * D), v(T * KV * D), att(T * H * D), h(T * E),
      gate_up(T * 2 * I);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* w = layers + 6 * l;
    const auto matrix = [&](int i) { return reinterpret_cast<const uint8_t*>(w[i]); };
    const float* ln1 = reinterpret_cast<const float*>(w[4]);
    const float* ln2 = reinterpret_cast<const float*>(w[5]);
    float* layer_keys = keys + l * layer_stride;
    float* layer_values = values + l * layer_stride;
    int8_rows_floats(Q4, x, T, E, ln1, eps, matrix(0), nullptr, qkv.data(), width, threads);
    rope_split(qkv.data(), T, H, KV, D, cos, sin, H + KV, nullptr, nullptr, 0.0f, 0, q.data(), k.data(), v.data());
    if (!turns) {
      write_and_attend(q.data(), k.data(), v.data(), layer_keys, layer_values, rows, T, H, KV, D, C, att.data(), threads);
    } else {
      for (int64_t i = 0; i < n_turns; ++i) {
        const int64_t a = turns[2 * i], b = turns[2 * i + 1];
        write_and_attend(q.data() + a * H * D, k.data() + a * KV * D, v.data() + a * KV * D, layer_keys, layer_values,
                         rows + a, b - a, H, KV, D, C, att.data() + a * H * D, threads);
      }
      for (int64_t t = real; t < T; ++t)
        std::memcpy(att.data() + t * H * D, att.data() + (real - 1) * H * D, sizeof(float) * H * D);
      if (tree_k) {
        std::memcpy(tree_k + l * T * KV * D, k.data(), sizeof(float) * T * KV * D);
        std::memcpy(tree_v + l * T * KV * D, v.data(), sizeof(float) * T * KV * D);
      }
    }
    int8_rows_floats(Q4, att.data(), T, H * D, nullptr, 0.0f, matrix(1), x, h.data(), E, threads);
    int8_rows_floats(Q4, h.data(), T, E, ln2, eps, matrix(2), nullptr, gate_up.data(), 2 * I, threads);
    int8_rows_glu(Q4, gate_up.data(), T, I, matrix(3), h.data(), x, E, threads);
    if (features && slot[l] >= 0) std::memcpy(features + slot[l] * T * E, x, sizeof(float) * T * E);
  }
}

// ---------------------------------------------------------------------------------------------
// A drafter's decode pass in one call (q8_drafter.FusedDrafterPass), every matrix Q8_0 with int8
// rows, as Q8DrafterLayer computes it from Python:
//   c = hidden_norm(fc(features))                      the C new context rows (C, E)
//   per layer:  q, k, v   = rope_split(Q8(x normed by ln1))      the block's Q rows, per-head norms
//               _, kc, vc = rope_split(Q8(c))                    the context's (not normed), rotate_half
//               kc, vc written at slots seen..seen+C-1 of the layer's cache, k, v after them;
//               every block row's query heads (scaled by 1 / sqrt(D)) over all seen + C + Q positions (the block sees
//               itself whole); x = x + Q8(att); x = x + Q8(SiLU(gate) * up) of Q8(x normed by ln2)
//   x = norm(x)
// ``layers``: per layer 8 addresses: the packed QKV, O, gate/up and down matrices, then ln1, ln2,
// q_norm and k_norm; ``eps``: per layer ln1's, ln2's and the per-head norms', then hidden_norm's
// and norm's. x (Q, E) is the block's input, replaced by the pass's output. cos / sin: (Q, D) for
// the block, (C, D) for the context. keys / values: layer l's (KV, capacity, D) at l * layer_stride.
extern "C" void q8_drafter_pass(const int64_t* layers, int64_t L, const float* eps, float* x, int64_t Q,
                                const float* features, int64_t C, int64_t F, const uint8_t* fc, const float* hidden_norm,
                                const float* final_norm, int64_t E, int64_t H, int64_t KV, int64_t D, int64_t I,
                                const float* cos, const float* sin, const float* context_cos, const float* context_sin,
                                float* keys, float* values, int64_t layer_stride, int64_t capacity, int64_t seen,
                                int threads) {
  const int64_t width = (H + 2 * KV) * D;
  std::vector<float> context(C * E), qkv(Q * width), qkv_context(C * width), q(Q * H * D), k(Q * KV * D),
      v(Q * KV * D), kc(C * KV * D), vc(C * KV * D), att(Q * H * D), h(Q * E), gate_up(Q * 2 * I);
  int8_rows_floats(Q8, features, C, F, nullptr, 0.0f, fc, nullptr, context.data(), E, threads);
  rms_norm_rows(context.data(), C, E, hidden_norm, eps[3 * L], context.data());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));  // scaled_dot_product_attention's
  std::vector<int64_t> slots(C + Q), lengths(Q, seen + C + Q);
  for (int64_t i = 0; i < C + Q; ++i) slots[i] = seen + i;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* w = layers + 8 * l;
    const auto matrix = [&](int i) { return reinterpret_cast<const uint8_t*>(w[i]); };
    const auto vector = [&](int i) { return reinterpret_cast<const float*>(w[i]); };
    const float* layer_eps = eps + 3 * l;
    float* layer_keys = keys + l * layer_stride;
    float* layer_values = values + l * layer_stride;
    int8_rows_floats(Q8, x, Q, E, vector(4), layer_eps[0], matrix(0), nullptr, qkv.data(), width, threads);
    int8_rows_floats(Q8, context.data(), C, E, nullptr, 0.0f, matrix(0), nullptr, qkv_context.data(), width, threads);
    rope_split(qkv.data(), Q, H, KV, D, cos, sin, 1, vector(6), vector(7), layer_eps[2], 1, q.data(), k.data(), v.data());
    rope_split(qkv_context.data(), C, H, KV, D, context_cos, context_sin, 1, vector(6), vector(7), layer_eps[2], 1,
               nullptr, kc.data(), vc.data());  // the context's keys and values only
    for (float& value : q) value *= scale;  // attend_rows takes its queries scaled
    write_rows(kc.data(), vc.data(), layer_keys, layer_values, slots.data(), C, KV, D, capacity);
    write_rows(k.data(), v.data(), layer_keys, layer_values, slots.data() + C, Q, KV, D, capacity);
    attend_rows(q.data(), lengths.data(), Q, H, KV, D, capacity, layer_keys, layer_values, att.data(), threads);
    int8_rows_floats(Q8, att.data(), Q, H * D, nullptr, 0.0f, matrix(1), x, h.data(), E, threads);
    int8_rows_floats(Q8, h.data(), Q, E, vector(5), layer_eps[1], matrix(2), nullptr, gate_up.data(), 2 * I, threads);
    int8_rows_glu(Q8, gate_up.data(), Q, I, matrix(3), h.data(), x, E, threads);
  }
  rms_norm_rows(x, Q, E, final_norm, eps[3 * L + 1], x);
}
