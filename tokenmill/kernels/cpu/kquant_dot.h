// The dot product of a decoded chunk (kquant_blocks.h) with a row of int8 activations:
// AVX512-VNNI (vpdpbusd, 64 bytes at a time, with the common types decoded straight into
// registers), AVX2 (vpmaddwd, 16 at a time) or portable loops, chosen at compile time.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_KQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENMILL_KQ_AVX2 1
#endif

#include "kquant_blocks.h"

namespace tokenmill {
namespace kquant {

// ---- the dot product of a decoded chunk with one row's chunk --------------------------------
// Adds to acc (16 partial sums, reduced at the row's end) the chunk's share of the output.
#if defined(TOKENMILL_KQ_AVX512)
// The chunk's scales in vpdpbusd's lane order: lane l of register k covers weights
// 64 k + 4 l .. + 3, sub-block 4 k + l / 4.
struct ChunkRegs {
  __m512i u[4];
  __m512 a[4];
  __m512 b;
};

inline void load_chunk(const Chunk& c, ChunkRegs& r) {
  const __m512 a = _mm512_load_ps(c.a);
  for (int k = 0; k < 4; ++k) {
    r.u[k] = _mm512_load_si512(c.u + 64 * k);
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * k),
                                         _mm512_srli_epi32(_mm512_set_epi32(
                                             15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
    r.a[k] = _mm512_permutexvar_ps(idx, a);
  }
  r.b = _mm512_load_ps(c.b);
}

// One scale per 256 inputs: `d` is the chunk's.
inline __m512 chunk_dot256(const ChunkRegs& r, const int8_t* xq, float d, const float* xs,
                           __m512 acc) {
  __m512 t = _mm512_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), r.u[k],
                                          _mm512_loadu_si512(xq + 64 * k));
    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), r.a[k], t);
  }
  acc = _mm512_fmadd_ps(t, _mm512_set1_ps(d), acc);
  return _mm512_fnmadd_ps(r.b, _mm512_loadu_ps(xs), acc);
}

// One scale per 32 inputs: `d` points at the chunk's eight.
inline __m512 chunk_dot32(const ChunkRegs& r, const int8_t* xq, const float* d, const float* xs,
                          __m512 acc) {
  const __m512 d8 = _mm512_castps256_ps512(_mm256_loadu_ps(d));
  for (int k = 0; k < 4; ++k) {
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), r.u[k],
                                          _mm512_loadu_si512(xq + 64 * k));
    // Lanes 0-7 are block 2 k, lanes 8-15 block 2 k + 1.
    const __m512i idx = _mm512_add_epi32(
        _mm512_set1_epi32(2 * k),
        _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
    const __m512 dk = _mm512_permutexvar_ps(idx, d8);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(r.a[k], dk), acc);
  }
  return _mm512_fnmadd_ps(r.b, _mm512_loadu_ps(xs), acc);
}

constexpr int64_t kAccLanes = 16;

// ---- AVX-512 decoders straight into registers, for the types of Q4_K_M / Q5_K_M / Q6_K / Q8_0
// files (the others go through a Chunk in memory). Lane l of register k covers weights
// 64 k + 4 l .. + 3 of the chunk, in the natural order, as load_chunk leaves them.
inline __m512i lane_index(int base, int shift) {
  return _mm512_add_epi32(
      _mm512_set1_epi32(base),
      _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                        shift));
}

// Q4_K / Q5_K's scales (lanes 0-7) and mins (lanes 8-15) of the eight sub-blocks of 32, times
// d and dmin: ggml's unpacking of the 12 bytes.
inline __m512 k4_scales_mins(const uint8_t* p) {
  uint32_t utmp[4];
  std::memcpy(utmp, p + 4, 12);
  const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
  const uint32_t uaux = utmp[1] & kmask1;
  utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
  utmp[2] = uaux;
  utmp[0] &= kmask1;
  const __m512 sm = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(utmp))));
  return _mm512_mul_ps(sm, _mm512_insertf32x8(_mm512_set1_ps(half_at(p)),
                                              _mm256_set1_ps(half_at(p + 2)), 1));
}

inline void k4_scale_regs(const uint8_t* p, ChunkRegs& r) {
  const __m512 sm = k4_scales_mins(p);
  for (int k = 0; k < 4; ++k) r.a[k] = _mm512_permutexvar_ps(lane_index(2 * k, 3), sm);
  r.b = _mm512_permutexvar_ps(lane_index(8, 1), sm);  // sub-block of 16 i: min i / 2
}

// qs[64 h .. 64 h + 63] holds weights 128 h + 0..31 and 64..95 in its low nibbles, 32..63 and
// 96..127 in its high ones: 128-bit lane shuffles put them in order.
inline void q4_k_regs(const uint8_t* p, ChunkRegs& r) {
  k4_scale_regs(p, r);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_loadu_si512(p + 16 + 64 * h);
    const __m512i lo = _mm512_and_si512(q, m4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    r.u[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
    r.u[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
  }
}

// Q5_K: the same, plus the fifth bits: for register k (weights 64 k ..), bit 2 k of qh[l] for
// its first 32 weights and bit 2 k + 1 for the next 32.
inline void q5_k_regs(const uint8_t* p, ChunkRegs& r) {
  k4_scale_regs(p, r);
  const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p + 16)));
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_loadu_si512(p + 48 + 64 * h);
    const __m512i lo = _mm512_and_si512(q, m4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    for (int e = 0; e < 2; ++e) {
      const int k = 2 * h + e;
      const __m512i shift = _mm512_setr_epi64(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                              2 * k + 1, 2 * k + 1);
      const __m512i bit = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), one);
      const __m512i low4 = _mm512_shuffle_i64x2(lo, hi, e == 0 ? 0x44 : 0xEE);
      r.u[k] = _mm512_or_si512(low4, _mm512_slli_epi16(bit, 4));
    }
  }
}

// Q6_K: per half n, ql[64 n ..]'s low nibbles are weights 128 n + 0..63 in order and its high
// ones 64..127; qh[32 n + l] gives weights l, l + 32, l + 64, l + 96 their bits 4-5.
inline void q6_k_regs(const uint8_t* p, ChunkRegs& r) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3);
  for (int n = 0; n < 2; ++n) {
    const __m512i q = _mm512_loadu_si512(p + 64 * n);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p + 128 + 32 * n)));
    const __m512i h0 = _mm512_and_si512(
        _mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), m2);
    const __m512i h1 = _mm512_and_si512(
        _mm512_srlv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6)), m2);
    r.u[2 * n] = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_slli_epi16(h0, 4));
    r.u[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                                     _mm512_slli_epi16(h1, 4));
  }
  const __m512 a = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(p + 192)))),
      _mm512_set1_ps(half_at(p + 208)));
  for (int k = 0; k < 4; ++k) r.a[k] = _mm512_permutexvar_ps(lane_index(4 * k, 2), a);
  r.b = _mm512_mul_ps(a, _mm512_set1_ps(32.f));
}

// The fp16 scales of `blocks` (<= 8) blocks `bytes` apart as fp32 lanes (zeros after).
inline __m512 block_scales8(const uint8_t* p, int64_t bytes, int64_t blocks) {
  uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = 0; k < blocks; ++k) std::memcpy(&h[k], p + k * bytes, 2);
  return _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(h))));
}

inline void block32_scale_regs(__m512 d8, float offset, ChunkRegs& r) {
  for (int k = 0; k < 4; ++k) r.a[k] = _mm512_permutexvar_ps(lane_index(2 * k, 3), d8);
  r.b = _mm512_mul_ps(_mm512_permutexvar_ps(lane_index(0, 1), d8), _mm512_set1_ps(offset));
}

// Q8_0, `blocks` (<= 8: fewer at a row's end) blocks: u = q + 128 (b = 128 d); zeros after.
inline __m256i q8_0_block(const uint8_t* b) {
  return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                          _mm256_set1_epi8(static_cast<char>(0x80)));
}

// Q5_0: nibbles of qs[16] (weights j, j + 16) and their fifth bits in qh.
inline __m256i q5_0_block(const uint8_t* b) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m4)),
                                              _mm_and_si128(_mm_srli_epi16(q, 4), m4), 1);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  return _mm256_or_si256(nib, _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10)));
}

// Q4_0: the nibbles of qs[16] (weights j, j + 16).
inline __m256i q4_0_block(const uint8_t* b) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m4)),
                                 _mm_and_si128(_mm_srli_epi16(q, 4), m4), 1);
}

template <int64_t kBytes, __m256i (*kBlock)(const uint8_t*)>
inline void blocks32_regs(const uint8_t* p, int64_t blocks, float offset, ChunkRegs& r) {
  for (int k = 0; k < 4; ++k) {
    const uint8_t* b0 = p + (2 * k) * kBytes;
    const __m256i lo = 2 * k < blocks ? kBlock(b0) : _mm256_setzero_si256();
    const __m256i hi = 2 * k + 1 < blocks ? kBlock(b0 + kBytes) : _mm256_setzero_si256();
    r.u[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  block32_scale_regs(block_scales8(p, kBytes, blocks), offset, r);
}

// The chunk `ci` of a row in registers: straight from the blocks for the types above (whole
// chunks), through a Chunk in memory otherwise.
template <int64_t kType>
inline void chunk_regs(const uint8_t* row, int64_t ci, int64_t K, ChunkRegs& r) {
  if constexpr (kType == kQ4_K) {
    q4_k_regs(row + ci * 144, r);
  } else if constexpr (kType == kQ5_K) {
    q5_k_regs(row + ci * 176, r);
  } else if constexpr (kType == kQ6_K) {
    q6_k_regs(row + ci * 210, r);
  } else if constexpr (kType == kQ8_0) {
    blocks32_regs<34, q8_0_block>(row + ci * 8 * 34, std::min<int64_t>(8, K / 32 - 8 * ci),
                                  128.f, r);
  } else if constexpr (kType == kQ4_0) {
    blocks32_regs<18, q4_0_block>(row + ci * 8 * 18, std::min<int64_t>(8, K / 32 - 8 * ci),
                                  8.f, r);
  } else if constexpr (kType == kQ5_0) {
    blocks32_regs<22, q5_0_block>(row + ci * 8 * 22, std::min<int64_t>(8, K / 32 - 8 * ci),
                                  16.f, r);
  } else {
    Chunk c;
    decode_chunk(kType, row, ci, K, c);
    load_chunk(c, r);
  }
}
#else
constexpr int64_t kAccLanes = 8;
#endif

// The integer dot of sub-block i (16 bytes of u by 16 int8 activations), where no SIMD path
// applies: 8 partial sums a sub-block, widened to int32.
inline void chunk_dot_generic(const Chunk& c, const int8_t* xq, const float* d, bool per32,
                              const float* xs, float* acc) {
#if defined(TOKENMILL_KQ_AVX2)
  __m256 v = _mm256_loadu_ps(acc);
  for (int i = 0; i < kSubs; ++i) {
    const __m256i u16 = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(c.u + 16 * i)));
    const __m256i x16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16 * i)));
    const __m256i p = _mm256_madd_epi16(u16, x16);
    const float s = c.a[i] * (per32 ? d[i / 2] : d[0]);
    v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), v);
  }
  for (int h = 0; h < 2; ++h) {
    v = _mm256_fnmadd_ps(_mm256_load_ps(c.b + 8 * h), _mm256_loadu_ps(xs + 8 * h), v);
  }
  _mm256_storeu_ps(acc, v);
#else
  for (int i = 0; i < kSubs; ++i) {
    int32_t s = 0;
    for (int j = 0; j < 16; ++j) {
      s += static_cast<int32_t>(c.u[16 * i + j]) * static_cast<int32_t>(xq[16 * i + j]);
    }
    const float scale = c.a[i] * (per32 ? d[i / 2] : d[0]);
    acc[i % kAccLanes] += scale * static_cast<float>(s) - c.b[i] * xs[i];
  }
#endif
}
}  // namespace kquant
}  // namespace tokenmill
