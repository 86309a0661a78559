// Weight-only matmuls on GGUF's own blocks, kept as the file stores them: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0 (blocks of 32), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256 with their
// packed sub-scales and mins) and IQ4_XS. The block layouts are ggml's (ggml-common.h); the
// arithmetic is llama.cpp's way (ggml-cpu quants.c, ggml_vec_dot_q4_K_q8_K and its siblings):
// each row of activations is quantized to int8 once per call, and the products run as integer
// dot products, 64 bytes at a time with AVX512-VNNI (vpdpbusd), 16 with AVX2 (vpmaddwd).
//
// Every type is first decoded, 256 weights at a time ("a chunk": one super-block, or eight
// blocks of 32), into one common form: w = a[i] * u - b[i] for sub-block i of 16 weights, u an
// unsigned byte (0..15 for Q4_K, 0..63 for Q6_K, q + 128 for Q8_0's signed bytes, ...), a and
// b fp32 (b carries the mins, or the offset of the signed types: 128 a for Q8_0, 32 a for Q6_K).
// The decoded chunk stays in L1 and is multiplied by every row of the call, so the per-type
// code is only the decoding; the dot product is one routine for all types:
//   y += sum_i a[i] * dx * dot(u_i, xq_i) - sum_i b[i] * xs_i
// with xq the int8 activations, dx their scale and xs_i = dx * sum(xq_i) over the sub-block.
// Activation scales: one per 32 inputs for every type (llama.cpp's q8_0; llama.cpp takes one
// per 256, q8_K, for the super-block types): finer steps where a block of 256 inputs holds an
// outlier, for one more multiply per 64 weights and row. A row's result does not depend on the
// other rows of the call or on the threads: each output is one chain over the chunks in order.
#pragma once

#include <ATen/record_function.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_KQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENMILL_KQ_AVX2 1
#endif

#include "decode_kernels.h"
#include "thread_pool.h"

namespace tokenmill {
namespace kquant {

// ggml's type ids (GGMLQuantizationType in the gguf package).
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_XS = 23,
};

constexpr int64_t kChunk = 256;  // weights decoded at a time
constexpr int64_t kSubs = kChunk / 16;  // sub-blocks of 16 in a chunk

struct TypeInfo {
  int64_t block_elems;  // weights per block
  int64_t block_bytes;
  bool act_per_32;  // activation scale per 32 inputs (else per 256)
};

inline bool known_type(int64_t t) {
  switch (t) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ2_K: case kQ3_K:
    case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_XS: return true;
    default: return false;
  }
}

inline TypeInfo type_info(int64_t t) {
  switch (t) {
    case kQ4_0: return {32, 18, true};
    case kQ4_1: return {32, 20, true};
    case kQ5_0: return {32, 22, true};
    case kQ5_1: return {32, 24, true};
    case kQ8_0: return {32, 34, true};
    case kQ2_K: return {256, 84, true};
    case kQ3_K: return {256, 110, true};
    case kQ4_K: return {256, 144, true};
    case kQ5_K: return {256, 176, true};
    case kQ6_K: return {256, 210, true};
    case kIQ4_XS: return {256, 136, true};
    default: TORCH_CHECK(false, "kquant: no kernel for ggml type ", t);
  }
}

// One chunk decoded: w[16 i + j] = a[i] * u[16 i + j] - b[i].
struct alignas(64) Chunk {
  uint8_t u[kChunk];
  float a[kSubs];
  float b[kSubs];
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- blocks of 32 -----------------------------------------------------------------------
// Block `blk` of the chunk (weights 32 blk ..) with one scale a and one b for both halves.
inline void set_pair(Chunk& c, int64_t blk, float a, float b) {
  c.a[2 * blk] = c.a[2 * blk + 1] = a;
  c.b[2 * blk] = c.b[2 * blk + 1] = b;
}

// Q4_0 {fp16 d; 16 bytes}: weight j in the low nibble of byte j, j + 16 in its high one;
// w = d (q - 8). Q4_1 {d; m; 16 bytes}: w = d q + m.
inline void decode_q4_01(const uint8_t* p, bool has_min, uint8_t* u, float& a, float& b) {
  a = half_at(p);
  b = has_min ? -half_at(p + 2) : 8.f * a;
  const uint8_t* qs = p + (has_min ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    u[j] = qs[j] & 0x0F;
    u[j + 16] = qs[j] >> 4;
  }
}

// Q5_0 {d; 32 high bits; 16 bytes of low nibbles}: w = d (q - 16); Q5_1 {d; m; ...}: d q + m.
inline void decode_q5_01(const uint8_t* p, bool has_min, uint8_t* u, float& a, float& b) {
  a = half_at(p);
  b = has_min ? -half_at(p + 2) : 16.f * a;
  const uint8_t* hp = p + (has_min ? 4 : 2);
  const uint32_t qh = u32_at(hp);
  const uint8_t* qs = hp + 4;
  for (int j = 0; j < 16; ++j) {
    u[j] = static_cast<uint8_t>((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
    u[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
}

// Q8_0 {d; 32 int8}: w = d q = d (q + 128) - 128 d.
inline void decode_q8_0(const uint8_t* p, uint8_t* u, float& a, float& b) {
  a = half_at(p);
  b = 128.f * a;
  for (int j = 0; j < 32; ++j) u[j] = p[2 + j] ^ 0x80;
}

// Up to eight blocks of 32 from `p`; `blocks` < 8 at a row's end (zeros after).
inline void decode_blocks32(int64_t type, const uint8_t* p, int64_t blocks, Chunk& c) {
  const int64_t bytes = type_info(type).block_bytes;
  for (int64_t k = 0; k < blocks; ++k, p += bytes) {
    uint8_t* u = c.u + 32 * k;
    float a, b;
    switch (type) {
      case kQ4_0: decode_q4_01(p, false, u, a, b); break;
      case kQ4_1: decode_q4_01(p, true, u, a, b); break;
      case kQ5_0: decode_q5_01(p, false, u, a, b); break;
      case kQ5_1: decode_q5_01(p, true, u, a, b); break;
      default: decode_q8_0(p, u, a, b); break;
    }
    set_pair(c, k, a, b);
  }
  if (blocks < 8) {
    std::memset(c.u + 32 * blocks, 0, 32 * (8 - blocks));
    for (int64_t k = blocks; k < 8; ++k) set_pair(c, k, 0.f, 0.f);
  }
}

// ---- super-blocks of 256 ----------------------------------------------------------------
// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins for its eight sub-blocks of 32.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void k4_scales(const uint8_t* p, Chunk& c) {
  const float d = half_at(p), dmin = half_at(p + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(j, p + 4, sc, m);
    set_pair(c, j, d * static_cast<float>(sc), dmin * static_cast<float>(m));
  }
}

// Q4_K {d; dmin; scales[12]; qs[128]}: weights 64 j .. 64 j + 31 in the low nibbles of
// qs[32 j ..], the next 32 in the high ones; w = d sc q - dmin m per sub-block of 32.
inline void decode_q4_k(const uint8_t* p, Chunk& c) {
  k4_scales(p, c);
  const uint8_t* qs = p + 16;
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      c.u[64 * j + l] = qs[32 * j + l] & 0x0F;
      c.u[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
  }
}

// Q5_K {d; dmin; scales[12]; qh[32]; qs[128]}: Q4_K's nibbles with a fifth bit, bit 2 j of
// qh[l] for weight 64 j + l and bit 2 j + 1 for weight 64 j + 32 + l.
inline void decode_q5_k(const uint8_t* p, Chunk& c) {
  k4_scales(p, c);
  const uint8_t* qh = p + 16;
  const uint8_t* qs = p + 48;
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      c.u[64 * j + l] =
          static_cast<uint8_t>((qs[32 * j + l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4));
      c.u[64 * j + 32 + l] =
          static_cast<uint8_t>((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
    }
  }
}

// Q6_K {ql[128]; qh[64]; int8 scales[16]; d}: per half n of 128 weights, weight l (< 32)
// and l + 64 in the low / high nibble of ql[64 n + l], l + 32 and l + 96 in those of
// ql[64 n + 32 + l], their two high bits in qh[32 n + l] (bits 0-1, 2-3, 4-5, 6-7 for the
// four); w = d sc[i] (q - 32) for sub-block i of 16.
inline void decode_q6_k(const uint8_t* p, Chunk& c) {
  const uint8_t* ql = p;
  const uint8_t* qh = p + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
  const float d = half_at(p + 208);
  for (int n = 0; n < 2; ++n) {
    const uint8_t* l4 = ql + 64 * n;
    const uint8_t* h2 = qh + 32 * n;
    uint8_t* y = c.u + 128 * n;
    for (int l = 0; l < 32; ++l) {
      y[l] = static_cast<uint8_t>((l4[l] & 0x0F) | ((h2[l] & 3) << 4));
      y[l + 32] = static_cast<uint8_t>((l4[l + 32] & 0x0F) | (((h2[l] >> 2) & 3) << 4));
      y[l + 64] = static_cast<uint8_t>((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4));
      y[l + 96] = static_cast<uint8_t>((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4));
    }
  }
  for (int i = 0; i < kSubs; ++i) {
    c.a[i] = d * static_cast<float>(sc[i]);
    c.b[i] = 32.f * c.a[i];
  }
}

// Q2_K {scales[16]: low nibble scale, high nibble min; qs[64]; d; dmin}: weight 128 n + 32 j
// + l is bits 2 j of qs[32 n + l]; w = d sc q - dmin m per sub-block of 16.
inline void decode_q2_k(const uint8_t* p, Chunk& c) {
  const uint8_t* qs = p + 16;
  const float d = half_at(p + 80), dmin = half_at(p + 82);
  for (int n = 0; n < 2; ++n) {
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) c.u[128 * n + 32 * j + l] = (qs[32 * n + l] >> (2 * j)) & 3;
    }
  }
  for (int i = 0; i < kSubs; ++i) {
    c.a[i] = d * static_cast<float>(p[i] & 0x0F);
    c.b[i] = dmin * static_cast<float>(p[i] >> 4);
  }
}

// Q3_K {hmask[32]; qs[64]; scales[12]: sixteen 6-bit scales; d}: weight 128 n + 32 j + l is
// bits 2 j of qs[32 n + l] plus 4 where bit 4 n + j of hmask[l] is set; w = d (sc - 32)
// (q - 4).
inline void decode_q3_k(const uint8_t* p, Chunk& c) {
  const uint8_t* hm = p;
  const uint8_t* qs = p + 32;
  const float d = half_at(p + 108);
  uint32_t aux[4];
  std::memcpy(aux, p + 96, 12);
  const uint32_t tmp = aux[2], kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  int8_t scales[16];
  std::memcpy(scales, aux, 16);
  for (int n = 0; n < 2; ++n) {
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        c.u[128 * n + 32 * j + l] = static_cast<uint8_t>(
            ((qs[32 * n + l] >> (2 * j)) & 3) | (((hm[l] >> (4 * n + j)) & 1) << 2));
      }
    }
  }
  for (int i = 0; i < kSubs; ++i) {
    c.a[i] = d * static_cast<float>(scales[i] - 32);
    c.b[i] = 4.f * c.a[i];
  }
}

// IQ4_XS {d; scales_h (2 bits a block of 32); scales_l[4] (4 bits each); qs[128]}: weight
// 32 ib + j (j < 16) is the table entry of the low nibble of qs[16 ib + j], j + 16 of its high
// nibble; w = d (ls - 32) value.
inline constexpr int8_t kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

inline void decode_iq4_xs(const uint8_t* p, Chunk& c) {
  const float d = half_at(p);
  uint16_t scales_h;
  std::memcpy(&scales_h, p + 2, 2);
  const uint8_t* scales_l = p + 4;
  const uint8_t* qs = p + 8;
  for (int ib = 0; ib < 8; ++ib) {
    const int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    set_pair(c, ib, dl, 128.f * dl);
    for (int j = 0; j < 16; ++j) {
      c.u[32 * ib + j] = static_cast<uint8_t>(kIq4nl[qs[16 * ib + j] & 0x0F] + 128);
      c.u[32 * ib + 16 + j] = static_cast<uint8_t>(kIq4nl[qs[16 * ib + j] >> 4] + 128);
    }
  }
}

// Chunk `ci` of a row of `K` weights stored from `row`.
inline void decode_chunk(int64_t type, const uint8_t* row, int64_t ci, int64_t K, Chunk& c) {
  const TypeInfo info = type_info(type);
  if (info.block_elems == 32) {
    const int64_t first = ci * 8;
    decode_blocks32(type, row + first * info.block_bytes,
                    std::min<int64_t>(8, K / 32 - first), c);
    return;
  }
  const uint8_t* p = row + ci * info.block_bytes;
  switch (type) {
    case kQ2_K: decode_q2_k(p, c); break;
    case kQ3_K: decode_q3_k(p, c); break;
    case kQ4_K: decode_q4_k(p, c); break;
    case kQ5_K: decode_q5_k(p, c); break;
    case kQ6_K: decode_q6_k(p, c); break;
    default: decode_iq4_xs(p, c); break;
  }
}

// ---- activations --------------------------------------------------------------------------
// Rows quantized to int8: q [M][Kp] (Kp: K rounded up to 256, zeros after K); d: the scale of
// each block of `block` (32 or 256) inputs [M][Kp / block]; xs = d * sum(q) per 16 inputs
// [M][Kp / 16].
struct ActRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> xs;
  int64_t Kp = 0, block = 0;
};

template <typename X>
inline void quantize_row(const X* x, int64_t K, int64_t Kp, int64_t block, int8_t* q, float* d,
                         float* xs) {
  float buf[kChunk];
  for (int64_t b0 = 0; b0 < Kp; b0 += block) {
    const int64_t n = std::max<int64_t>(0, std::min(block, K - b0));
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      buf[i] = to_f(x[b0 + i]);
      amax = std::max(amax, std::fabs(buf[i]));
    }
    for (int64_t i = n; i < block; ++i) buf[i] = 0.f;
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    d[b0 / block] = scale;
    for (int64_t i = 0; i < block; ++i) {
      q[b0 + i] = static_cast<int8_t>(std::nearbyint(buf[i] * inv));
    }
    for (int64_t s = 0; s < block; s += 16) {
      int32_t sum = 0;
      for (int64_t i = 0; i < 16; ++i) sum += q[b0 + s + i];
      xs[(b0 + s) / 16] = scale * static_cast<float>(sum);
    }
  }
}

inline void quantize_rows(const at::Tensor& x, int64_t block, ActRows& out) {
  const int64_t M = x.size(0), K = x.size(1);
  out.Kp = (K + kChunk - 1) / kChunk * kChunk;
  out.block = block;
  out.q.resize(M * out.Kp);
  out.d.resize(M * out.Kp / block);
  out.xs.resize(M * out.Kp / 16);
  const int64_t Kp = out.Kp;
  auto run = [&](auto tag) {
    using X = decltype(tag);
    const X* xp = x.data_ptr<X>();
    tmpool::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        quantize_row(xp + m * K, K, Kp, block, out.q.data() + m * Kp,
                     out.d.data() + m * Kp / block, out.xs.data() + m * Kp / 16);
      }
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(float{});
  }
}

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
// d and dmin: llama.cpp's unpacking of the 12 bytes.
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

// ---- the matmul ------------------------------------------------------------------------------
// Output n of every row of xq into acc[m][kAccLanes] (zeroed here).
#if defined(TOKENMILL_KQ_AVX512)
// R rows from row m0 at once, their sums in registers; the chunk decoded once for them.
template <int64_t kType, int R>
inline void rows_dots(const uint8_t* row, int64_t K, const ActRows& xq, int64_t m0,
                      float* acc) {
  const int64_t chunks = xq.Kp / kChunk, Kp = xq.Kp;
  const bool per32 = xq.block == 32;
  const int64_t dpc = kChunk / xq.block;  // activation scales a chunk
  __m512 v[R];
  for (int i = 0; i < R; ++i) v[i] = _mm512_setzero_ps();
  for (int64_t ci = 0; ci < chunks; ++ci) {
    ChunkRegs r;
    chunk_regs<kType>(row, ci, K, r);
    for (int i = 0; i < R; ++i) {
      const int64_t m = m0 + i;
      const int8_t* q = xq.q.data() + m * Kp + ci * kChunk;
      const float* d = xq.d.data() + (m * chunks + ci) * dpc;
      const float* xs = xq.xs.data() + (m * Kp + ci * kChunk) / 16;
      v[i] = per32 ? chunk_dot32(r, q, d, xs, v[i]) : chunk_dot256(r, q, d[0], xs, v[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(acc + (m0 + i) * kAccLanes, v[i]);
}

template <int64_t kType>
inline void output_dots_as(const uint8_t* row, int64_t K, const ActRows& xq, int64_t M,
                           float* acc) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) rows_dots<kType, 4>(row, K, xq, m, acc);
  switch (M - m) {
    case 3: rows_dots<kType, 3>(row, K, xq, m, acc); break;
    case 2: rows_dots<kType, 2>(row, K, xq, m, acc); break;
    case 1: rows_dots<kType, 1>(row, K, xq, m, acc); break;
    default: break;
  }
}

inline void output_dots(int64_t type, const uint8_t* row, int64_t K, const ActRows& xq,
                        int64_t M, float* acc) {
  switch (type) {
    case kQ4_0: return output_dots_as<kQ4_0>(row, K, xq, M, acc);
    case kQ4_1: return output_dots_as<kQ4_1>(row, K, xq, M, acc);
    case kQ5_0: return output_dots_as<kQ5_0>(row, K, xq, M, acc);
    case kQ5_1: return output_dots_as<kQ5_1>(row, K, xq, M, acc);
    case kQ8_0: return output_dots_as<kQ8_0>(row, K, xq, M, acc);
    case kQ2_K: return output_dots_as<kQ2_K>(row, K, xq, M, acc);
    case kQ3_K: return output_dots_as<kQ3_K>(row, K, xq, M, acc);
    case kQ4_K: return output_dots_as<kQ4_K>(row, K, xq, M, acc);
    case kQ5_K: return output_dots_as<kQ5_K>(row, K, xq, M, acc);
    case kQ6_K: return output_dots_as<kQ6_K>(row, K, xq, M, acc);
    default: return output_dots_as<kIQ4_XS>(row, K, xq, M, acc);
  }
}
#else
inline void output_dots(int64_t type, const uint8_t* row, int64_t K, const ActRows& xq,
                        int64_t M, float* acc) {
  const int64_t chunks = xq.Kp / kChunk, Kp = xq.Kp;
  const bool per32 = xq.block == 32;
  const int64_t dpc = kChunk / xq.block;
  std::fill(acc, acc + M * kAccLanes, 0.f);
  Chunk c;
  for (int64_t ci = 0; ci < chunks; ++ci) {
    decode_chunk(type, row, ci, K, c);
    for (int64_t m = 0; m < M; ++m) {
      chunk_dot_generic(c, xq.q.data() + m * Kp + ci * kChunk,
                        xq.d.data() + (m * chunks + ci) * dpc, per32,
                        xq.xs.data() + (m * Kp + ci * kChunk) / 16, acc + m * kAccLanes);
    }
  }
}
#endif

// A layer's weight: segments of output rows, each of one ggml type (a fused q/k/v projection
// of a Q4_K_M file: Q4_K, Q4_K, Q6_K), their blocks back to back in one uint8 tensor. `table`:
// int64 [S, 2], each segment's (type, rows).
struct Segments {
  std::vector<int64_t> type, first_row, byte_off, row_bytes;
  int64_t N = 0;

  Segments(const char* name, const at::Tensor& table, const at::Tensor& blocks, int64_t K) {
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 2 &&
                    table.size(0) > 0,
                name, ": the segment table must be int64 [segments, 2] of (type, rows)");
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), name,
                ": blocks must be contiguous uint8");
    const at::Tensor t = table.contiguous();
    const int64_t* p = t.data_ptr<int64_t>();
    int64_t off = 0;
    for (int64_t s = 0; s < table.size(0); ++s) {
      const int64_t ty = p[2 * s], rows = p[2 * s + 1];
      TORCH_CHECK(known_type(ty), name, ": no kernel for ggml type ", ty);
      const TypeInfo info = type_info(ty);
      TORCH_CHECK(K > 0 && K % info.block_elems == 0, name, ": ", K,
                  " inputs are not whole blocks of ", info.block_elems);
      TORCH_CHECK(rows >= 0, name, ": a segment of ", rows, " rows");
      type.push_back(ty);
      first_row.push_back(N);
      byte_off.push_back(off);
      row_bytes.push_back(K / info.block_elems * info.block_bytes);
      N += rows;
      off += rows * row_bytes.back();
    }
    TORCH_CHECK(blocks.numel() == off, name, ": ", blocks.numel(), " bytes of blocks for ",
                off, " bytes of segments");
  }

  int64_t of_row(int64_t n) const {
    int64_t s = 0;
    while (s + 1 < static_cast<int64_t>(type.size()) && first_row[s + 1] <= n) ++s;
    return s;
  }

  bool needs(bool per32) const {
    for (int64_t ty : type) {
      if (type_info(ty).act_per_32 == per32) return true;
    }
    return false;
  }
};

// y = x W^T for W a GGUF tensor's blocks (see Segments); x fp32 or bf16 [M, K]; y in x's
// dtype (fp32 sums rounded once).
inline at::Tensor kquant_linear(const at::Tensor& x_in, const at::Tensor& blocks,
                                const at::Tensor& table) {
  RECORD_FUNCTION("tokenmill::kquant_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "kquant_linear: x must be fp32 or bf16 [M, K] on the CPU");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const Segments seg("kquant_linear", table, blocks, K);
  const int64_t N = seg.N;
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor x = x_in.contiguous();
  ActRows x32, x256;
  if (seg.needs(true)) quantize_rows(x, 32, x32);
  if (seg.needs(false)) quantize_rows(x, kChunk, x256);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const bool out_bf16 = y.scalar_type() == at::kBFloat16;
  tmpool::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M * kAccLanes);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t s = seg.of_row(n), ty = seg.type[s];
      const uint8_t* row = w + seg.byte_off[s] + (n - seg.first_row[s]) * seg.row_bytes[s];
      output_dots(ty, row, K, type_info(ty).act_per_32 ? x32 : x256, M, acc.data());
      for (int64_t m = 0; m < M; ++m) {
        float sum = 0.f;
        for (int64_t l = 0; l < kAccLanes; ++l) sum += acc[m * kAccLanes + l];
        if (out_bf16) {
          y.data_ptr<c10::BFloat16>()[m * N + n] = from_f<c10::BFloat16>(sum);
        } else {
          y.data_ptr<float>()[m * N + n] = sum;
        }
      }
    }
  });
  return y;
}

// The weight [N, K] the blocks stand for (ggml's dequantization, same values), fp32 or bf16
// (each value rounded once): what the dense route multiplies by.
inline at::Tensor kquant_dequantize(const at::Tensor& blocks, const at::Tensor& table,
                                    int64_t K, bool bf16 = false) {
  RECORD_FUNCTION("tokenmill::kquant_dequantize", std::vector<c10::IValue>());
  const Segments seg("kquant_dequantize", table, blocks, K);
  const int64_t N = seg.N, chunks = (K + kChunk - 1) / kChunk;
  at::Tensor w = at::empty({N, K}, blocks.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* dst = w.data_ptr<T>();
    tmpool::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      Chunk c;
      alignas(64) float buf[kChunk];
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t s = seg.of_row(n);
        const uint8_t* row = src + seg.byte_off[s] + (n - seg.first_row[s]) * seg.row_bytes[s];
        for (int64_t ci = 0; ci < chunks; ++ci) {
          decode_chunk(seg.type[s], row, ci, K, c);
          for (int64_t i = 0; i < kSubs; ++i) {
            for (int64_t j = 0; j < 16; ++j) {
              buf[16 * i + j] = c.a[i] * static_cast<float>(c.u[16 * i + j]) - c.b[i];
            }
          }
          const int64_t len = std::min(kChunk, K - ci * kChunk);
          T* out = dst + n * K + ci * kChunk;
          for (int64_t j = 0; j < len; ++j) out[j] = from_f<T>(buf[j]);
        }
      }
    });
  };
  if (bf16) {
    run(c10::BFloat16{});
  } else {
    run(float{});
  }
  return w;
}

}  // namespace kquant
}  // namespace tokenmill
