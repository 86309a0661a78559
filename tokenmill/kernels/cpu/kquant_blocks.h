// GGUF's block layouts (ggml-common.h) and their decoding, 256 weights at a time ("a chunk":
// one super-block, or eight blocks of 32), into the one form the K-quant matmul multiplies by
// (kquant.h): w = a[i] * u - b[i] for sub-block i of 16 weights, u an unsigned byte.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

}  // namespace kquant
}  // namespace tokenmill
