// Decode attention over the paged KV cache on the CPU: one query token per sequence, keys and
// values read straight from the cache blocks named by the block table (no gather), fp32 math.
// The cache may be stored narrower than the queries (fp16 under fp32 activations):
// its values widen exactly on load.
//
// The work is one (sequence, KV head) at a time, the query heads that share it together, reading
// its rows where they lie and widening them as they are loaded: no per-step copy. Where those
// items are too few to share out evenly (batch 1: 3 KV heads on 2 threads), each thread takes
// the same number of tokens instead, a context cut between threads merged afterwards as a
// softmax over blocks is; without AVX-512, one (sequence, query head) at a time. Scores are
// dot products of 16-wide vectors (GCC vector extensions: AVX-512 where the CPU has it,
// narrower registers elsewhere), four keys per horizontal reduction; softmax and the weighted
// sum of values are vectorized the same way. Head sizes that are not a multiple of 16 take a
// plain scalar loop.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_kernels.h"
#include "thread_pool.h"

namespace tokenmill {
namespace vec16 {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 -> fp32 is exact: the 16 bits become the top half of the float.
inline f32x16 load(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const i32x16 w = __builtin_convertvector(h, i32x16) << 16;
  return reinterpret_cast<const f32x16&>(w);
}

// fp16 -> fp32 is exact (F16C's vcvtph2ps where the CPU has it).
typedef _Float16 h16x16 __attribute__((vector_size(32)));
inline f32x16 load(const c10::Half* p) {
#if defined(__AVX512F__)
  // GCC 12 converts a _Float16 vector one lane at a time; the instruction does sixteen.
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<const f32x16&>(v);
#else
  h16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, f32x16);
#endif
}

inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(f32x16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// The horizontal sums of four vectors, in out[0..3], with 6 shuffles instead of 4 x 4.
inline void hsum4(f32x16 a, f32x16 b, f32x16 c, f32x16 d, float* out) {
  const f32x16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                            22, 23) +
                    __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                            28, 29, 30, 31);
  const f32x16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                            22, 23) +
                    __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                            28, 29, 30, 31);
  // Lanes 0-3: a, 4-7: b, 8-11: c, 12-15: d.
  f32x16 s = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                     27) +
             __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                     31);
  s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = s[0];
  out[1] = s[4];
  out[2] = s[8];
  out[3] = s[12];
}

// The hot loops' 16-lane vectors. With AVX-512 that is one register. Elsewhere GCC lowers a
// 64-byte generic vector to pairs of 32-byte operations but keeps arrays of them (a head's
// accumulators) on the stack, and the stores and reloads cost ~10x the arithmetic: decode
// attention took 0.53 us per cached token per layer at 2 threads on an AVX2 EPYC (9 ms a step
// at 500 tokens for the embedded model). So there it is two native 8-lane halves, lane for
// lane the same operations in the same order: the same bits as the 16-lane code.
#if defined(__AVX512F__)
typedef f32x16 acc16;
inline acc16 load_acc(const float* p) { return load(p); }
inline acc16 load_acc(const c10::BFloat16* p) { return load(p); }
inline acc16 load_acc(const c10::Half* p) { return load(p); }
inline void store_acc(float* p, acc16 v) { store(p, v); }
inline float lane(acc16 v, int i) { return v[i]; }
inline acc16 exp(acc16 v) { return exp_lanes<f32x16, i32x16>(v); }
inline acc16 max(acc16 a, acc16 b) { return a > b ? a : b; }
#else
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef _Float16 h16x8 __attribute__((vector_size(16)));
struct acc16 {
  f32x8 lo, hi;
};
inline acc16 operator+(acc16 a, acc16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline acc16 operator*(acc16 a, acc16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline acc16 operator*(acc16 a, float x) { return {a.lo * x, a.hi * x}; }
inline acc16 operator*(float x, acc16 a) { return {x * a.lo, x * a.hi}; }
inline acc16& operator+=(acc16& a, acc16 b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}
inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f32x8 load8(const c10::BFloat16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const i32x8 w = __builtin_convertvector(h, i32x8) << 16;
  return reinterpret_cast<const f32x8&>(w);
}
inline f32x8 load8(const c10::Half* p) {
#if defined(__F16C__)
  // GCC 12 converts a _Float16 vector one lane at a time; the instruction does eight.
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<const f32x8&>(v);
#else
  h16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, f32x8);
#endif
}
template <typename T>
inline acc16 load_acc(const T* p) {
  return {load8(p), load8(p + 8)};
}
inline void store_acc(float* p, acc16 v) {
  std::memcpy(p, &v.lo, sizeof(v.lo));
  std::memcpy(p + 8, &v.hi, sizeof(v.hi));
}
inline float lane(acc16 v, int i) { return i < 8 ? v.lo[i] : v.hi[i - 8]; }
inline acc16 operator-(acc16 a, float x) { return {a.lo - x, a.hi - x}; }
// GCC lowers a 16-lane exp to spills and lane inserts on AVX2 (~7 ns per score at a 500-token
// context); on the halves it is straight-line 8-lane code.
inline acc16 exp(acc16 v) { return {exp_lanes<f32x8, i32x8>(v.lo), exp_lanes<f32x8, i32x8>(v.hi)}; }
inline acc16 max(acc16 a, acc16 b) {
  return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
}

// hsum4 (above) on halves: its first step adds lanes i and i + 8, which is lo + hi.
inline void hsum4(acc16 a, acc16 b, acc16 c, acc16 d, float* out) {
  const f32x8 a8 = a.lo + a.hi, b8 = b.lo + b.hi, c8 = c.lo + c.hi, d8 = d.lo + d.hi;
  f32x8 s0 = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
  f32x8 s1 = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
  s0 += __builtin_shufflevector(s0, s0, 2, 3, 0, 1, 6, 7, 4, 5);
  s1 += __builtin_shufflevector(s1, s1, 2, 3, 0, 1, 6, 7, 4, 5);
  s0 += __builtin_shufflevector(s0, s0, 1, 0, 3, 2, 5, 4, 7, 6);
  s1 += __builtin_shufflevector(s1, s1, 1, 0, 3, 2, 5, 4, 7, 6);
  out[0] = s0[0];
  out[1] = s0[4];
  out[2] = s1[0];
  out[3] = s1[4];
}

// hsum (above): lanes 0..15 in order.
inline float hsum(acc16 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v.lo[i];
  for (int i = 0; i < 8; ++i) s += v.hi[i];
  return s;
}
#endif

}  // namespace vec16

// Where one decode step's attention reads: the paged cache and each sequence's block table.
template <typename T>
struct PagedView {
  const T* k;  // [num_slots, Hkv, D]
  const T* v;
  const int32_t* seq_lens;  // [B]
  const int32_t* tables;  // [B, table_stride]
  int64_t table_stride;
  int64_t block_size;
  // A sliding window (0: none): the query at position p sees keys p - window + 1 .. p only.
  int64_t window = 0;

  // The first key a decode query of sequence b sees (its position is seq_lens[b] - 1).
  int64_t first(int64_t b) const {
    return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
  }

  // The offset (elements from the cache's start) of the key and value row of token t of a
  // sequence with block table ``table``, for KV head g.
  int64_t row_offset(const int32_t* table, int64_t t, int64_t g, int64_t Hkv, int64_t D) const {
    return ((static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * Hkv +
            g) * D;
  }

  // The offsets (elements from the cache's start) of the key and value rows of tokens
  // [t0, t1) of a sequence with block table ``table``, for KV head g, into ``rows`` (token t0
  // first): once per (sequence, KV head) and block by block, so the per-token loops below do
  // no division.
  void row_offsets(const int32_t* table, int64_t t0, int64_t t1, int64_t g, int64_t Hkv,
                   int64_t D, std::vector<int64_t>& rows) const {
    rows.resize(static_cast<size_t>(t1 - t0));
    const int64_t token_stride = Hkv * D;
    for (int64_t t = t0; t < t1;) {
      const int64_t blk = t / block_size, first = t % block_size;
      const int64_t base =
          ((static_cast<int64_t>(table[blk]) * block_size + first) * Hkv + g) * D;
      const int64_t n = std::min(block_size - first, t1 - t);
      for (int64_t i = 0; i < n; ++i) rows[t - t0 + i] = base + i * token_stride;
      t += n;
    }
  }
};

// Per-thread buffers of the attention: one (sequence, head)'s scores and cache row offsets.
struct AttentionScratch {
  std::vector<float> scores;
  std::vector<int64_t> rows;
};

// This thread's scratch, kept between calls: a decode step makes a few attention items per
// layer, and their buffers would otherwise be allocated and freed each time.
inline AttentionScratch& thread_scratch() {
  static thread_local AttentionScratch scratch;
  return scratch;
}

// softmax in place over scores[0, L), returning the sum of the exponentials (and, in *max_out
// where given, the maximum they are taken from): 16 lanes at a time, each lane's sum in token
// order, then the lanes in order (hsum).
inline float softmax_unnormalized(float* s, int64_t L, float* max_out = nullptr) {
  using namespace vec16;
  const int64_t L16 = L - L % 16;
  float mx = -INFINITY;
  if (L16 > 0) {  // the maximum is the same whatever the order it is taken in
    acc16 m = load_acc(s);
    for (int64_t t = 16; t < L16; t += 16) m = vec16::max(m, load_acc(s + t));
    for (int i = 0; i < 16; ++i) mx = std::max(mx, lane(m, i));
  }
  for (int64_t t = L16; t < L; ++t) mx = std::max(mx, s[t]);
  if (max_out != nullptr) *max_out = mx;
  float total = 0.f;
  if (L16 > 0) {
    acc16 sum{};
    for (int64_t t = 0; t < L16; t += 16) {
      const acc16 e = vec16::exp(load_acc(s + t) - mx);
      store_acc(s + t, e);
      sum += e;
    }
    total = hsum(sum);
  }
  for (int64_t t = L16; t < L; ++t) {
    s[t] = exp_poly(s[t] - mx);
    total += s[t];
  }
  return total;
}

// Rows ahead of the one being read that the head loops fetch: the cache's rows lie block by
// block, and the hardware's prefetcher loses the stream at every block's end. A batch-1 row
// takes ~11 ns, so 16 rows ahead was less than a memory latency: 64 took the embedded model's
// decode attention at a 700-token context from ~0.57 to ~0.45 ms a step (Zen 5; 128 the same).
constexpr int64_t kAttnPrefetch = 64;

template <typename C>
inline void prefetch_row(const C* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(C)); off += 64) {
    __builtin_prefetch(p + off, 0, 3);
  }
}

// A head's attention over part of its context, unnormalized: the largest score m, the sum l of
// exp(score - m), then the D sums of exp(score - m) * value.
constexpr int64_t part_floats(int64_t D) { return D + 2; }

// The largest head size a Part holds: the grouped kernels' (group_kernel), the only ones that
// attend part of a context.
constexpr int64_t kMaxPartD = 128;

// One head's output from the Parts of its context (parts[0..n), in token order): each part's
// sums rescaled to the largest maximum, added in order, then normalized.
template <typename O>
void merge_parts(const float* const* parts, int64_t n, int64_t D, O* out) {
  TORCH_CHECK(D <= kMaxPartD, "merge_parts: head size ", D, " is past ", kMaxPartD);
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, parts[i][0]);
  float total = 0.f;
  float acc[kMaxPartD] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float* r = parts[i];
    const float w = std::exp(r[0] - m);
    total += w * r[1];
    for (int64_t d = 0; d < D; ++d) acc[d] += w * r[2 + d];
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = from_f<O>(acc[d] * inv);
}

// The query heads h0 .. h0 + P - 1 of sequence b, which share one KV head, together: each key
// and value row is loaded and widened once for the P heads. Per head the arithmetic is the
// same whatever P (four keys per horizontal sum, the same tail, the same softmax and weighted
// sum, in the same order): the same bits grouped or alone (P = 1, attend_head_vec). P is
// bounded by the registers the queries and the accumulators take (see group_heads_per_pass).
//
// The tokens are [t0, t1) of the sequence's context: all of it for a whole item, whose
// normalized result goes to `out`; a part of it for an item split across threads (see
// paged_decode_attention), whose result goes to `part` unnormalized, as a Part per head, for
// merge_parts.
template <typename Q, typename C, typename O, int ND, int P>
void attend_heads_vec(const Q* q, int64_t q_stride, const PagedView<C>& kv, int64_t b, int64_t h0,
                      int64_t G, int64_t Hkv, float scale, int64_t t0, int64_t t1, O* out,
                      int64_t out_stride, float* part, AttentionScratch& scratch) {
  using namespace vec16;
  constexpr int64_t D = 16 * ND;
  const int64_t L = t1 - t0;
  kv.row_offsets(kv.tables + b * kv.table_stride, t0, t1, h0 / G, Hkv, D, scratch.rows);
  const int64_t* rows = scratch.rows.data();
  scratch.scores.resize(static_cast<size_t>(P * L));
  float* s = scratch.scores.data();  // head p's scores at s + p * L
  acc16 qv[P][ND];
  for (int p = 0; p < P; ++p) {
    const Q* qh = q + b * q_stride + (h0 + p) * D;
    for (int c = 0; c < ND; ++c) qv[p][c] = load_acc(qh + 16 * c) * scale;
  }
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    if (t + kAttnPrefetch + 4 <= L) {
      for (int i = 0; i < 4; ++i) prefetch_row(kv.k + rows[t + kAttnPrefetch + i], D);
    }
    const C* k0 = kv.k + rows[t];
    const C* k1 = kv.k + rows[t + 1];
    const C* k2 = kv.k + rows[t + 2];
    const C* k3 = kv.k + rows[t + 3];
    acc16 a[P][4];
    {
      const acc16 x0 = load_acc(k0), x1 = load_acc(k1), x2 = load_acc(k2), x3 = load_acc(k3);
      for (int p = 0; p < P; ++p) {
        a[p][0] = qv[p][0] * x0;
        a[p][1] = qv[p][0] * x1;
        a[p][2] = qv[p][0] * x2;
        a[p][3] = qv[p][0] * x3;
      }
    }
    for (int c = 1; c < ND; ++c) {
      const acc16 x0 = load_acc(k0 + 16 * c), x1 = load_acc(k1 + 16 * c);
      const acc16 x2 = load_acc(k2 + 16 * c), x3 = load_acc(k3 + 16 * c);
      for (int p = 0; p < P; ++p) {
        a[p][0] += qv[p][c] * x0;
        a[p][1] += qv[p][c] * x1;
        a[p][2] += qv[p][c] * x2;
        a[p][3] += qv[p][c] * x3;
      }
    }
    for (int p = 0; p < P; ++p) hsum4(a[p][0], a[p][1], a[p][2], a[p][3], s + p * L + t);
  }
  for (; t < L; ++t) {
    const C* k0 = kv.k + rows[t];
    acc16 a0[P];
    const acc16 x = load_acc(k0);
    for (int p = 0; p < P; ++p) a0[p] = qv[p][0] * x;
    for (int c = 1; c < ND; ++c) {
      const acc16 xc = load_acc(k0 + 16 * c);
      for (int p = 0; p < P; ++p) a0[p] += qv[p][c] * xc;
    }
    for (int p = 0; p < P; ++p) s[p * L + t] = hsum(a0[p]);
  }
  float inv[P], mx[P], total[P];
  for (int p = 0; p < P; ++p) {
    total[p] = softmax_unnormalized(s + p * L, L, &mx[p]);
    inv[p] = 1.f / total[p];
  }
  acc16 acc[P][ND] = {};
  for (t = 0; t < L; ++t) {
    if (t + kAttnPrefetch < L) prefetch_row(kv.v + rows[t + kAttnPrefetch], D);
    const C* v0 = kv.v + rows[t];
    for (int c = 0; c < ND; ++c) {
      const acc16 x = load_acc(v0 + 16 * c);
      for (int p = 0; p < P; ++p) acc[p][c] += s[p * L + t] * x;
    }
  }
  if (part != nullptr) {
    for (int p = 0; p < P; ++p) {
      float* r = part + p * part_floats(D);
      r[0] = mx[p];
      r[1] = total[p];
      for (int c = 0; c < ND; ++c) store_acc(r + 2 + 16 * c, acc[p][c]);
    }
    return;
  }
  for (int p = 0; p < P; ++p) {
    O* o = out + b * out_stride + (h0 + p) * D;
    for (int c = 0; c < ND; ++c) {
      const acc16 r = acc[p][c] * inv[p];
      for (int i = 0; i < 16; ++i) o[16 * c + i] = from_f<O>(lane(r, i));
    }
  }
}

// Query head h of sequence b against its L cached tokens, head size 16 * ND (Q: the queries'
// dtype, C: the cache's, O: the output's): attend_heads_vec for one head. Keys and values are
// read straight from the cache rows, widened to fp32 as they are loaded (exact: fp16 and bf16
// are subsets of fp32), so one head's work needs no copy of its KV head's rows and the G heads
// of a group are independent items (at batch 1 the 9 heads of SmolLM2 keep two threads busy;
// its 3 KV heads would not).
template <typename Q, typename C, typename O, int ND>
void attend_head_vec(const Q* q, int64_t q_stride, const PagedView<C>& kv, int64_t b, int64_t h,
                     int64_t G, int64_t Hkv, float scale, O* out, int64_t out_stride,
                     AttentionScratch& scratch) {
  attend_heads_vec<Q, C, O, ND, 1>(q, q_stride, kv, b, h, G, Hkv, scale, kv.first(b),
                                   kv.seq_lens[b], out, out_stride, nullptr, scratch);
}

// The same for any head size, one scalar loop per dot product.
template <typename Q, typename C, typename O>
void attend_head_scalar(const Q* q, int64_t q_stride, const PagedView<C>& kv, int64_t b,
                        int64_t h, int64_t G, int64_t Hkv, int64_t D, float scale, O* out,
                        int64_t out_stride, AttentionScratch& scratch) {
  const int64_t t0 = kv.first(b), L = kv.seq_lens[b] - t0;
  kv.row_offsets(kv.tables + b * kv.table_stride, t0, t0 + L, h / G, Hkv, D, scratch.rows);
  const int64_t* rows = scratch.rows.data();
  scratch.scores.resize(static_cast<size_t>(L));
  float* s = scratch.scores.data();
  std::vector<float> qf(D), acc(D, 0.f);
  const Q* qh = q + b * q_stride + h * D;
  for (int64_t d = 0; d < D; ++d) qf[d] = to_f(qh[d]) * scale;
  for (int64_t t = 0; t < L; ++t) {
    const C* krow = kv.k + rows[t];
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qf[d] * to_f(krow[d]);
    s[t] = dot;
  }
  const float inv = 1.f / softmax_unnormalized(s, L);
  for (int64_t t = 0; t < L; ++t) {
    const C* vrow = kv.v + rows[t];
    for (int64_t d = 0; d < D; ++d) acc[d] += s[t] * to_f(vrow[d]);
  }
  O* o = out + b * out_stride + h * D;
  for (int64_t d = 0; d < D; ++d) o[d] = from_f<O>(acc[d] * inv);
}

template <typename Q, typename C, typename O>
using HeadKernel = void (*)(const Q*, int64_t, const PagedView<C>&, int64_t, int64_t, int64_t,
                            int64_t, float, O*, int64_t, AttentionScratch&);

// The vectorized kernel for head size D, or nullptr where only the scalar one applies.
template <typename Q, typename C, typename O>
HeadKernel<Q, C, O> vector_kernel(int64_t D) {
  switch (D) {
    case 32: return &attend_head_vec<Q, C, O, 2>;
    case 64: return &attend_head_vec<Q, C, O, 4>;
    case 96: return &attend_head_vec<Q, C, O, 6>;
    case 128: return &attend_head_vec<Q, C, O, 8>;
    case 256: return &attend_head_vec<Q, C, O, 16>;
    default: return nullptr;
  }
}

#if defined(__AVX512F__)
// Query heads per pass of attend_heads_vec for head size 16 * ND: the P * ND query vectors and
// the 4 * P score accumulators in 32 registers (D = 64: 3 heads, D = 128: 2).
constexpr int group_heads_per_pass(int ND) { return ND + 4 > 24 ? 1 : 24 / (ND + 4); }

// One pass of `count` (<= P) query heads from h0 through attend_heads_vec, over tokens
// [t0, t1) (into `part`, P Parts, where not null).
template <typename Q, typename C, typename O, int ND, int P>
void attend_heads_pass(const Q* q, int64_t q_stride, const PagedView<C>& kv, int64_t b,
                       int64_t h0, int64_t count, int64_t G, int64_t Hkv, float scale, int64_t t0,
                       int64_t t1, O* out, int64_t out_stride, float* part,
                       AttentionScratch& scratch) {
  if constexpr (P > 1) {
    if (count < P) {
      attend_heads_pass<Q, C, O, ND, P - 1>(q, q_stride, kv, b, h0, count, G, Hkv, scale, t0, t1,
                                            out, out_stride, part, scratch);
      return;
    }
  }
  attend_heads_vec<Q, C, O, ND, P>(q, q_stride, kv, b, h0, G, Hkv, scale, t0, t1, out,
                                   out_stride, part, scratch);
}

// The G query heads of KV head g of sequence b over tokens [t0, t1), in passes of up to P
// heads: into `out` when that is the whole context, else into `part` (G Parts, head order).
template <typename Q, typename C, typename O, int ND>
void attend_group(const Q* q, int64_t q_stride, const PagedView<C>& kv, int64_t b, int64_t g,
                  int64_t G, int64_t Hkv, float scale, int64_t t0, int64_t t1, O* out,
                  int64_t out_stride, float* part, AttentionScratch& scratch) {
  constexpr int P = group_heads_per_pass(ND);
  for (int64_t h = g * G; h < (g + 1) * G; h += P) {
    float* part_h = part == nullptr ? nullptr : part + (h - g * G) * part_floats(16 * ND);
    attend_heads_pass<Q, C, O, ND, P>(q, q_stride, kv, b, h, std::min<int64_t>(P, (g + 1) * G - h),
                                      G, Hkv, scale, t0, t1, out, out_stride, part_h, scratch);
  }
}

template <typename Q, typename C, typename O>
using GroupKernel = void (*)(const Q*, int64_t, const PagedView<C>&, int64_t, int64_t, int64_t,
                             int64_t, float, int64_t, int64_t, O*, int64_t, float*,
                             AttentionScratch&);

// The grouped kernel for head size D, or nullptr.
template <typename Q, typename C, typename O>
GroupKernel<Q, C, O> group_kernel(int64_t D) {
  switch (D) {
    case 32: return &attend_group<Q, C, O, 2>;
    case 64: return &attend_group<Q, C, O, 4>;
    case 96: return &attend_group<Q, C, O, 6>;
    case 128: return &attend_group<Q, C, O, 8>;
    default: return nullptr;
  }
}

// Below this many (sequence, KV head) items per thread the grouped attention shares the
// step's tokens out evenly instead of whole items (balanced_group_attention). Going by KV head
// at all, each row loaded once for its G query heads instead of once per query head, took a
// 500-token decode's layer stack from 3.05 to 2.46 ms on a Zen 5 at batch 1, though 3 KV heads
// on 2 threads left one idle a third of the time; cutting contexts so that both threads take
// the same number of tokens then cut the attention by another 7-11% at 500-800 tokens (none
// at 100-400: there the cut's merge costs what the idle third did).
constexpr int64_t kBalanceBelowItemsPerThread = 4;

// The grouped attention with every thread given the same number of (item, token) pairs: the
// items laid end to end, each thread's share a run of them, cut inside an item where the share
// ends (at batch 1 the embedded model's 3 KV heads on 2 threads: one and a half each, where
// whole items left one thread idle a third of the time). An item cut in parts leaves one Part
// per head and part in `parts` (the share's first and last item may be cut, so 2 per share),
// merged once every share is done.
template <typename Q, typename C, typename O>
void balanced_group_attention(GroupKernel<Q, C, O> grouped, const Q* q, int64_t q_stride,
                              const PagedView<C>& kv, int64_t B, int64_t Hq, int64_t Hkv,
                              int64_t D, float scale, O* out, int64_t threads) {
  const int64_t G = Hq / Hkv, items = B * Hkv;
  // first_token[i]: where item i starts in the end-to-end order of every item's tokens.
  std::vector<int64_t> first_token(static_cast<size_t>(items + 1), 0);
  // (Each item's tokens are those of its window, from kv.first on.)
  for (int64_t i = 0; i < items; ++i) {
    first_token[i + 1] = first_token[i] + kv.seq_lens[i / Hkv] - kv.first(i / Hkv);
  }
  const int64_t total = first_token[items];
  // A share is worth a wake-up of a worker from 2^16 multiply-adds on (as the grain below).
  const int64_t shares = std::clamp<int64_t>(total * 2 * D * G >> 16, 1, threads);
  const int64_t stride = G * part_floats(D);  // one item's Parts
  std::vector<float> parts(static_cast<size_t>(shares * 2 * stride));
  // cut[2 * k + e]: the item whose Parts sit in slot e of share k (-1: none).
  std::vector<int64_t> cut(static_cast<size_t>(shares * 2), -1);
  tmpool::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    AttentionScratch& scratch = thread_scratch();
    for (int64_t k = begin; k < end; ++k) {
      const int64_t lo = total * k / shares, hi = total * (k + 1) / shares;
      int64_t i = std::upper_bound(first_token.begin(), first_token.end(), lo) -
                  first_token.begin() - 1;
      for (int e = 0; i < items && first_token[i] < hi; ++i) {
        const int64_t t0 = std::max(lo, first_token[i]) - first_token[i];
        const int64_t t1 = std::min(hi, first_token[i + 1]) - first_token[i];
        if (t1 <= t0) continue;
        const bool whole = t0 == 0 && t1 == first_token[i + 1] - first_token[i];
        float* part = nullptr;
        if (!whole) {
          cut[2 * k + e] = i;
          part = parts.data() + (2 * k + e) * stride;
          ++e;
        }
        const int64_t off = kv.first(i / Hkv);
        grouped(q, q_stride, kv, i / Hkv, i % Hkv, G, Hkv, scale, off + t0, off + t1, out, Hq * D,
                part, scratch);
      }
    }
  });
  // A cut item's Parts, in slot order, are its parts in token order: merge each run of them.
  std::vector<int64_t> slots;  // the slots of one cut item
  std::vector<const float*> head_parts;  // one head's Part in each of them
  for (int64_t s = 0; s < shares * 2;) {
    const int64_t item = cut[s];
    slots.clear();
    for (; s < shares * 2 && (cut[s] == item || cut[s] < 0); ++s) {
      if (cut[s] >= 0) slots.push_back(s);
    }
    if (item < 0) continue;  // only empty slots were left
    const int64_t b = item / Hkv, g = item % Hkv;
    head_parts.resize(slots.size());
    for (int64_t h = 0; h < G; ++h) {
      for (size_t j = 0; j < slots.size(); ++j) {
        head_parts[j] = parts.data() + slots[j] * stride + h * part_floats(D);
      }
      merge_parts(head_parts.data(), static_cast<int64_t>(slots.size()), D,
                  out + b * Hq * D + (g * G + h) * D);
    }
  }
}
#endif

// Decode attention of every (sequence, query head): q [B, q_stride] with the Hq heads first,
// out [B, Hq * D] (stored as O: bf16 when it feeds a quantized matmul). Without a grouped
// kernel the heads of a sequence are neighbours in the item order, so a KV head's rows, read
// from memory by the first of its G query heads, are in cache for the others. Threads only
// when the contexts are long enough to pay for waking them.
template <typename Q, typename C, typename O>
void paged_decode_attention(const Q* q, int64_t q_stride, const PagedView<C>& kv, int64_t B,
                            int64_t Hq, int64_t Hkv, int64_t D, float scale, O* out,
                            int64_t max_len) {
  const int64_t G = Hq / Hkv;
#if defined(__AVX512F__)
  const GroupKernel<Q, C, O> grouped = group_kernel<Q, C, O>(D);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (G > 1 && grouped != nullptr) {
    if (threads > 1 && B * Hkv < kBalanceBelowItemsPerThread * threads) {
      balanced_group_attention<Q, C, O>(grouped, q, q_stride, kv, B, Hq, Hkv, D, scale, out,
                                        threads);
      return;
    }
    const int64_t work_per_item = std::max<int64_t>(1, 2 * max_len * D * G);
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_item);
    tmpool::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
      AttentionScratch& scratch = thread_scratch();
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / Hkv;
        grouped(q, q_stride, kv, b, i % Hkv, G, Hkv, scale, kv.first(b), kv.seq_lens[b], out,
                Hq * D, nullptr, scratch);
      }
    });
    return;
  }
#endif
  const int64_t work_per_item = std::max<int64_t>(1, 2 * max_len * D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_item);
  const HeadKernel<Q, C, O> kernel = vector_kernel<Q, C, O>(D);
  tmpool::parallel_for(0, B * Hq, grain, [&](int64_t begin, int64_t end) {
    AttentionScratch& scratch = thread_scratch();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hq, h = i % Hq;
      if (kernel != nullptr) {
        kernel(q, q_stride, kv, b, h, G, Hkv, scale, out, Hq * D, scratch);
      } else {
        attend_head_scalar<Q, C, O>(q, q_stride, kv, b, h, G, Hkv, D, scale, out, Hq * D,
                                    scratch);
      }
    }
  });
}

}  // namespace tokenmill

namespace tokenmill {

// The Python entries' shared checks: q [T, Hq, D] with contiguous heads, the layer's cache
// contiguous [2, blocks, block_size, Hkv, D] with D as q's and Hkv dividing Hq.
inline void check_attention_inputs(const char* what, const at::Tensor& q,
                                   const at::Tensor& kv_cache) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), what,
              ": q must be [T, Hq, D] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(3) == 0,
              what, ": the cache must be contiguous [2, blocks, block_size, Hkv, D] with D as "
              "q's and Hkv dividing Hq");
}

// The view of a whole layer cache [2, blocks, block_size, Hkv, D] of element type C: keys in
// its first half, values in its second.
template <typename C>
PagedView<C> layer_view(const at::Tensor& kv_cache, const int32_t* seq_lens,
                        const int32_t* tables, int64_t table_stride) {
  const C* base = kv_cache.data_ptr<C>();
  return {base, base + kv_cache.numel() / 2, seq_lens, tables, table_stride, kv_cache.size(2)};
}

// f(q tag, cache tag) for the (activations, cache) dtypes the kernels take: fp32 over an fp32
// or fp16 cache, bf16 over bf16; any other pair is an error naming both.
template <typename F>
void dispatch_attention_dtypes(const char* what, at::ScalarType qt, at::ScalarType ct, F&& f) {
  if (qt == at::kFloat && ct == at::kFloat) {
    f(float{}, float{});
  } else if (qt == at::kFloat && ct == at::kHalf) {
    f(float{}, c10::Half{});
  } else if (qt == at::kBFloat16 && ct == at::kBFloat16) {
    f(c10::BFloat16{}, c10::BFloat16{});
  } else {
    TORCH_CHECK(false, what, ": q ", qt, " over a ", ct, " cache is not supported");
  }
}

// The Python entry of the decode attention, for tests and tools (the fused stack calls
// paged_decode_attention directly): q [B, Hq, D] (last two dims contiguous), the layer's cache
// [2, blocks, block_size, Hkv, D], block_tables [B, max_blocks] int32, seq_lens [B] int32 (the
// cached tokens each query attends to, >= 1) -> out [B, Hq * D] in q's dtype.
inline void decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             double scale, at::Tensor& out, int64_t window = 0) {
  TORCH_CHECK(window >= 0, "decode attention: window must be >= 0 (0: none), got ", window);
  check_attention_inputs("decode attention", q, kv_cache);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  const int64_t block_size = kv_cache.size(2), num_blocks = kv_cache.size(1);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == B && block_tables.is_contiguous(),
              "decode attention: block_tables must be contiguous int32 [B, blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == B && seq_lens.is_contiguous(),
              "decode attention: seq_lens must be contiguous int32 [B]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == B && out.size(1) == Hq * D &&
                  out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "decode attention: out must be contiguous [B, Hq * D] in q's dtype");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * block_size, "decode attention: sequence ",
                b, " has ", lens[b], " tokens, outside 1..", width * block_size);
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int32_t blk = tables[b * width + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "decode attention: block ", blk,
                  " of sequence ", b, " is outside the cache");
    }
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  const float s = static_cast<float>(scale);
  auto run = [&](auto q_tag, auto c_tag) {
    using Q = decltype(q_tag);
    using C = decltype(c_tag);
    PagedView<C> view = layer_view<C>(kv_cache, lens, tables, width);
    view.window = window;
    paged_decode_attention<Q, C, Q>(q.data_ptr<Q>(), q.stride(0), view, B, Hq, Hkv, D, s,
                                    out.data_ptr<Q>(), max_len);
  };
  dispatch_attention_dtypes("decode attention", q.scalar_type(), kv_cache.scalar_type(), run);
}

}  // namespace tokenmill
