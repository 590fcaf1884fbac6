// The AVX-512 intrinsics q4_dot.cpp's int8-rows kernels use (row quantization, SiLU, attention,
// stores), on AVX2 + FMA + F16C: each 512-bit vector is two 256-bit halves, each instruction its
// lane-for-lane equivalent, so that the same C++ builds for AVX2-only CPUs (``-DDFLASH_AVX2``;
// int8_dot.py chooses the build). The int8 products themselves have their own AVX2 tile
// (q4_dot.cpp's tile8_avx2); the bf16 dot-product kernels are left out of the AVX2 build.
//
// Lane-for-lane means the same numbers: every lane's arithmetic is the same operations in the same
// order as the AVX-512 instruction's, so the kernels' fixed summation orders (a row's numbers
// independent of the rows beside it) hold here too. What AVX2 lacks: vscalefps (two exact powers
// of two, so the product rounds once), vpmovdb (saturating packs: the same bytes for the codes'
// range), horizontal reductions (the order GCC's AVX-512 forms use), masks (lane masks from bits).
// Included by blocks.h after <immintrin.h>: the names below then mean these functions.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace avx2 {

struct f32x16 {
  __m256 lo, hi;
};
struct i512 {
  __m256i lo, hi;
};
struct f64x8 {
  __m256d lo, hi;
};

// floats
inline f32x16 set1_ps(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline f32x16 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline f32x16 loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu_ps(float* p, f32x16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#define AVX2_BINARY(name, op) \
  inline f32x16 name(f32x16 a, f32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
AVX2_BINARY(add_ps, _mm256_add_ps)
AVX2_BINARY(sub_ps, _mm256_sub_ps)
AVX2_BINARY(mul_ps, _mm256_mul_ps)
AVX2_BINARY(div_ps, _mm256_div_ps)
AVX2_BINARY(max_ps, _mm256_max_ps)
AVX2_BINARY(min_ps, _mm256_min_ps)
#undef AVX2_BINARY
inline f32x16 fmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline f32x16 fnmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline f32x16 abs_ps(f32x16 a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
template <int IMM>
inline f32x16 roundscale_ps(f32x16 a) {
  static_assert(IMM == _MM_FROUND_TO_NEAREST_INT, "only rounding to the nearest integer is emulated");
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a * 2^n for integral n in [-128, 128]: two exact powers of two, so the product rounds once, as vscalefps does.
inline __m256 scalef_half(__m256 a, __m256 n) {
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i first = _mm256_srai_epi32(whole, 1);
  const __m256i second = _mm256_sub_epi32(whole, first);
  const auto power = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(a, power(first)), power(second));
}
inline f32x16 scalef_ps(f32x16 a, f32x16 n) { return {scalef_half(a.lo, n.lo), scalef_half(a.hi, n.hi)}; }
inline float reduce_max_ps(f32x16 a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
inline float reduce_add_ps(f32x16 a) {  // halves, then 128-bit halves, then pairs: one fixed tree
  __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
inline i512 cvtps_epi32(f32x16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }

// masks: lane i of a half set where bit i (of that half's 8) is
inline __m256i lanes(unsigned bits) {
  const __m256i each = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), each), each);
}
inline f32x16 maskz_loadu_ps(unsigned mask, const float* p) {
  return {_mm256_maskload_ps(p, lanes(mask & 0xFF)), _mm256_maskload_ps(p + 8, lanes((mask >> 8) & 0xFF))};
}
inline void mask_storeu_ps(float* p, unsigned mask, f32x16 v) {
  _mm256_maskstore_ps(p, lanes(mask & 0xFF), v.lo);
  _mm256_maskstore_ps(p + 8, lanes((mask >> 8) & 0xFF), v.hi);
}
inline f32x16 blend(f32x16 src, unsigned mask, f32x16 v) {
  return {_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(lanes(mask & 0xFF))),
          _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(lanes((mask >> 8) & 0xFF)))};
}
inline f32x16 mask_max_ps(f32x16 src, unsigned mask, f32x16 a, f32x16 b) { return blend(src, mask, max_ps(a, b)); }
inline f32x16 mask_add_ps(f32x16 src, unsigned mask, f32x16 a, f32x16 b) { return blend(src, mask, add_ps(a, b)); }

// permutations (within 128-bit chunks, as the AVX-512 forms)
inline f32x16 unpacklo_ps(f32x16 a, f32x16 b) { return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)}; }
inline f32x16 unpackhi_ps(f32x16 a, f32x16 b) { return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)}; }
inline f64x8 castps_pd(f32x16 a) { return {_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
inline f32x16 castpd_ps(f64x8 a) { return {_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
inline f64x8 unpacklo_pd(f64x8 a, f64x8 b) { return {_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)}; }
inline f64x8 unpackhi_pd(f64x8 a, f64x8 b) { return {_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)}; }
inline __m128 chunk(f32x16 a, int i) {  // 128-bit chunk i of 4
  const __m256 half = i < 2 ? a.lo : a.hi;
  return i % 2 ? _mm256_extractf128_ps(half, 1) : _mm256_castps256_ps128(half);
}
template <int IMM>
inline f32x16 shuffle_f32x4(f32x16 a, f32x16 b) {
  return {_mm256_set_m128(chunk(a, (IMM >> 2) & 3), chunk(a, IMM & 3)),
          _mm256_set_m128(chunk(b, (IMM >> 6) & 3), chunk(b, (IMM >> 4) & 3))};
}

// integers
inline i512 add_epi32(i512 a, i512 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline int reduce_add_epi32(i512 a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
}
// Saturating where vpmovdb truncates: the same bytes for values in -128..127 (the kernels' codes).
inline __m128i cvtepi32_epi8(i512 a) {
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

}  // namespace avx2

#define __m512 avx2::f32x16
#define __m512i avx2::i512
#define __m512d avx2::f64x8
#define _mm512_set1_ps avx2::set1_ps
#define _mm512_setzero_ps avx2::setzero_ps
#define _mm512_loadu_ps avx2::loadu_ps
#define _mm512_storeu_ps avx2::storeu_ps
#define _mm512_add_ps avx2::add_ps
#define _mm512_sub_ps avx2::sub_ps
#define _mm512_mul_ps avx2::mul_ps
#define _mm512_div_ps avx2::div_ps
#define _mm512_max_ps avx2::max_ps
#define _mm512_min_ps avx2::min_ps
#define _mm512_fmadd_ps avx2::fmadd_ps
#define _mm512_fnmadd_ps avx2::fnmadd_ps
#define _mm512_abs_ps avx2::abs_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, imm) avx2::roundscale_ps<(imm)>(a)
#define _mm512_scalef_ps avx2::scalef_ps
#define _mm512_reduce_max_ps avx2::reduce_max_ps
#define _mm512_reduce_add_ps avx2::reduce_add_ps
#define _mm512_cvtps_epi32 avx2::cvtps_epi32
#define _mm512_maskz_loadu_ps avx2::maskz_loadu_ps
#define _mm512_mask_storeu_ps avx2::mask_storeu_ps
#define _mm512_mask_max_ps avx2::mask_max_ps
#define _mm512_mask_add_ps avx2::mask_add_ps
#define _mm512_unpacklo_ps avx2::unpacklo_ps
#define _mm512_unpackhi_ps avx2::unpackhi_ps
#define _mm512_castps_pd avx2::castps_pd
#define _mm512_castpd_ps avx2::castpd_ps
#define _mm512_unpacklo_pd avx2::unpacklo_pd
#define _mm512_unpackhi_pd avx2::unpackhi_pd
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm) avx2::shuffle_f32x4<(imm)>(a, b)
#define _mm512_add_epi32 avx2::add_epi32
#define _mm512_reduce_add_epi32 avx2::reduce_add_epi32
#define _mm512_cvtepi32_epi8 avx2::cvtepi32_epi8
