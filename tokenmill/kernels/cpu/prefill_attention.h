// Causal attention of prefill chunks on the CPU: several query tokens per sequence, each
// attending over its sequence's context in the paged KV cache up to its own position. fp32
// math, the flash-attention order: scores of a block of keys, an online softmax (running
// maximum and sum per query row, earlier partial sums rescaled when the maximum grows), and the
// weighted sum of the block's values, so no [L, S] score matrix is ever stored.
//
// Two phases. First each (sequence, KV head)'s keys and values are gathered from the cache
// blocks and widened to fp32 once: keys transposed ([D, S], so 16 keys are one vector) and
// values as rows ([S, D]). Then the work items, (sequence, query head, block of query tokens),
// run in parallel: a register tile of R query rows against 64 keys at a time, the query's
// elements broadcast against vectors of 16 keys; the G query heads of a KV head read the same
// gathered keys (from cache). One layer of a 500-token prompt of the embedded model on a Zen 5:
// SDPA's CPU flash kernel 3.2 ms (~85 GFLOP/s), this 0.98 ms.
#pragma once

#include <ATen/ATen.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "decode_kernels.h"
#include "paged_attention.h"
#include "thread_pool.h"

namespace tokenmill {

// Keys per score block (four 16-lane vectors per query row).
constexpr int64_t kPrefillKeyBlock = 64;
// Query tokens per work item: enough rows to reuse each gathered key from cache, few enough
// that a 500-token prompt makes dozens of items per head for the threads to share.
constexpr int64_t kPrefillTokensPerItem = 32;

// One sequence's chunk in a prefill step: rows [q_begin, q_begin + L) of the step's q and out
// are the last L of its S context positions; `table` is its block table row.
struct PrefillChunk {
  int64_t q_begin, L, S;
  const int32_t* table;
};

// The fp32 keys (transposed) and values of one (sequence, KV head), S rounded up to whole key
// blocks with zeros.
struct GatheredKV {
  std::vector<float> kt;  // [D, S_pad]
  std::vector<float> v;  // [S_pad, D]
  int64_t s_pad = 0;
};

// Keys and values of tokens [t0, t1) of chunk c's KV head g into `out` (sized for it): 16
// tokens at a time, so each transposed row of keys is written a cache line at a time.
template <typename C>
void gather_kv(const PagedView<C>& cache, const PrefillChunk& c, int64_t g, int64_t Hkv,
               int64_t D, int64_t t0, int64_t t1, GatheredKV& out) {
  float* kt = out.kt.data();
  float* v = out.v.data();
  for (int64_t b0 = t0; b0 < t1; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, t1 - b0);
    const C* k_rows[16];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = b0 + i;
      const int64_t row = cache.row_offset(c.table, t, g, Hkv, D);
      k_rows[i] = cache.k + row;
      const C* v_row = cache.v + row;
      for (int64_t d = 0; d < D; ++d) v[t * D + d] = to_f(v_row[d]);
    }
    for (int64_t d = 0; d < D; ++d) {
      float* dst = kt + d * out.s_pad + b0;
      for (int64_t i = 0; i < n; ++i) dst[i] = to_f(k_rows[i][d]);
    }
  }
}

// f(i) for i in [0, n), dealt round-robin to the threads: neighbouring items (a chunk's heads,
// its early and late query blocks, whose causal work differs) go to different threads.
template <typename F>
void parallel_round_robin(int64_t n, const F& f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = t; i < n; i += threads) f(i);
    }
  });
}

// v, loaded once into a register: GCC otherwise folds the load into each of the R rows'
// multiply-adds that use it (R loads for one value), and the tile's loops become load-bound
// (~20 loads per 16 FMAs; with this, 8).
inline vec16::acc16 in_register(vec16::acc16 v) {
#if defined(__AVX512F__)
  asm volatile("" : "+v"(v));
#endif
  return v;
}

// Horizontal maximum and sum of a vector (any order: the online softmax has no fixed order to
// keep, unlike decode's, which matches model.forward lane for lane).
inline float reduce_max(vec16::acc16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<const __m512&>(v));
#else
  float m = -INFINITY;
  for (int i = 0; i < 16; ++i) m = std::max(m, vec16::lane(v, i));
  return m;
#endif
}

inline float reduce_sum(vec16::acc16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<const __m512&>(v));
#else
  return vec16::hsum(v);
#endif
}

// The running state of an item's query rows: scaled queries, softmax maximum and sum, and the
// unnormalized output, row by row.
template <int64_t D>
struct PrefillRows {
  // Rows past the item's last token pad a partial last tile: copies of the last row whose
  // results are dropped.
  static constexpr int64_t kRows = kPrefillTokensPerItem + 4;
  float q[kRows][D];
  float o[kRows][D];
  float m[kRows];
  float l[kRows];
  int64_t pos[kRows];
};

// Rows r0 .. r0 + R - 1 of `st` against keys kb .. kb + 63 of kv: scores, the online softmax update and
// the weighted values. Head size D = 16 * ND.
// With a sliding window (window > 0) keys before each row's window are masked too.
template <int ND, int R>
void prefill_tile(PrefillRows<16 * ND>& st, int64_t r0, int64_t kb, const GatheredKV& kv,
                  int64_t window) {
  using namespace vec16;
  constexpr int64_t D = 16 * ND;
  constexpr int64_t KB = kPrefillKeyBlock;
  constexpr int NV = KB / 16;
  int64_t idx[R];
  for (int r = 0; r < R; ++r) idx[r] = r0 + r;
  alignas(64) float p[R][KB];
  {
    acc16 s[R][NV];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NV; ++j) s[r][j] = acc16{};
    }
    const float* kt = kv.kt.data() + kb;
    for (int64_t d = 0; d < D; ++d) {
      const float* krow = kt + d * kv.s_pad;
      acc16 k[NV];
      for (int j = 0; j < NV; ++j) k[j] = in_register(load_acc(krow + 16 * j));
      for (int r = 0; r < R; ++r) {
        const float x = st.q[idx[r]][d];
        for (int j = 0; j < NV; ++j) s[r][j] += x * k[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NV; ++j) store_acc(p[r] + 16 * j, s[r][j]);
    }
  }
  const int64_t keys_here = std::min<int64_t>(KB, st.pos[idx[R - 1]] + 1 - kb);
  float corr[R];
  for (int r = 0; r < R; ++r) {
    // Keys past the row's own position are masked (the causal mask; past S too), and with a
    // window those before it: a block may hide every key of a row, whose maximum is then
    // still -inf (its exponentials are taken from 0 instead, and zeroed below).
    const int64_t visible = std::max<int64_t>(0, std::min<int64_t>(KB, st.pos[idx[r]] + 1 - kb));
    const int64_t hidden = window > 0 ? std::clamp<int64_t>(st.pos[idx[r]] - window + 1 - kb,
                                                            0, KB) : 0;
    for (int64_t i = visible; i < KB; ++i) p[r][i] = -INFINITY;
    for (int64_t i = 0; i < hidden; ++i) p[r][i] = -INFINITY;
    acc16 mx = load_acc(p[r]);
    for (int j = 1; j < NV; ++j) mx = vec16::max(mx, load_acc(p[r] + 16 * j));
    const float m_old = st.m[idx[r]];
    const float m_new = std::max(m_old, reduce_max(mx));
    corr[r] = m_new == m_old ? 1.f : std::exp(m_old - m_new);  // 0 on the first block
    st.m[idx[r]] = m_new;
    const float m_exp = m_new == -INFINITY ? 0.f : m_new;
    acc16 sum{};
    for (int j = 0; j < NV; ++j) {
      const acc16 e = vec16::exp(load_acc(p[r] + 16 * j) - m_exp);
      store_acc(p[r] + 16 * j, e);
      sum += e;
    }
    if (visible < KB || hidden > 0) {  // exp clamps its input: masked keys must weigh nothing
      for (int64_t i = visible; i < KB; ++i) p[r][i] = 0.f;
      for (int64_t i = 0; i < hidden; ++i) p[r][i] = 0.f;
      sum = acc16{};
      for (int j = 0; j < NV; ++j) sum += load_acc(p[r] + 16 * j);
    }
    st.l[idx[r]] = st.l[idx[r]] * corr[r] + reduce_sum(sum);
  }
  acc16 o[R][ND];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < ND; ++j) o[r][j] = load_acc(st.o[idx[r]] + 16 * j) * corr[r];
  }
  const float* vv = kv.v.data() + kb * D;
  for (int64_t i = 0; i < keys_here; ++i) {
    acc16 x[ND];
    for (int j = 0; j < ND; ++j) x[j] = in_register(load_acc(vv + i * D + 16 * j));
    for (int r = 0; r < R; ++r) {
      const float w = p[r][i];
      for (int j = 0; j < ND; ++j) o[r][j] += w * x[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < ND; ++j) store_acc(st.o[idx[r]] + 16 * j, o[r][j]);
  }
}

// Query rows per register tile for head size 16 * ND: the R * ND output accumulators and
// R * 4 score vectors fit the 32 registers of AVX-512 at D = 64 (R = 4) and D = 128 (R = 2).
constexpr int prefill_rows_per_tile(int ND) { return ND <= 4 ? 4 : 2; }

// Tokens tok0 .. tok1 - 1 of chunk c, query head h, against their keys: key block by key
// block (the block's keys and values stay in L1 for every tile of the item), tile by tile.
template <typename Q, typename O, int ND>
void prefill_item(const Q* q, int64_t q_stride, const PrefillChunk& c, int64_t h, int64_t tok0,
                  int64_t tok1, const GatheredKV& kv, float scale, O* out, int64_t out_stride,
                  int64_t window) {
  constexpr int64_t D = 16 * ND;
  constexpr int R = prefill_rows_per_tile(ND);
  thread_local PrefillRows<D> st;
  const int64_t n = tok1 - tok0;
  const int64_t padded = (n + R - 1) / R * R;
  for (int64_t r = 0; r < padded; ++r) {
    const Q* qr = q + (c.q_begin + tok0 + std::min(r, n - 1)) * q_stride + h * D;
    for (int64_t d = 0; d < D; ++d) st.q[r][d] = to_f(qr[d]) * scale;
    for (int64_t d = 0; d < D; ++d) st.o[r][d] = 0.f;
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
    st.pos[r] = c.S - c.L + tok0 + std::min(r, n - 1);
  }
  const int64_t num_keys = st.pos[n - 1] + 1;
  // With a window, key blocks wholly before the first row's window are skipped.
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, st.pos[0] - window + 1) : 0;
  for (int64_t kb = first_key / kPrefillKeyBlock * kPrefillKeyBlock; kb < num_keys;
       kb += kPrefillKeyBlock) {
    for (int64_t r0 = 0; r0 < padded; r0 += R) {
      if (st.pos[r0 + R - 1] < kb) continue;  // every key of the block is after the tile's
      // ... or before every row's window (row r0's starts first).
      if (window > 0 && st.pos[r0] - window + 1 >= kb + kPrefillKeyBlock) continue;
      prefill_tile<ND, R>(st, r0, kb, kv, window);
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    O* dst = out + (c.q_begin + tok0 + r) * out_stride + h * D;
    const float inv = 1.f / st.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = from_f<O>(st.o[r][d] * inv);
  }
}

template <typename Q, typename O>
using PrefillItemFn = void (*)(const Q*, int64_t, const PrefillChunk&, int64_t, int64_t, int64_t,
                               const GatheredKV&, float, O*, int64_t, int64_t);

template <typename Q, typename O>
PrefillItemFn<Q, O> prefill_kernel(int64_t D) {
  switch (D) {
    case 16: return &prefill_item<Q, O, 1>;
    case 32: return &prefill_item<Q, O, 2>;
    case 64: return &prefill_item<Q, O, 4>;
    case 128: return &prefill_item<Q, O, 8>;
    default: return nullptr;
  }
}

inline bool prefill_head_size_supported(int64_t D) {
  return D == 16 || D == 32 || D == 64 || D == 128;
}

// Causal attention of every chunk: q [T, q_stride] (query head h of token t at t * q_stride +
// h * D), the cache's keys and values of each chunk's context (the chunk's own already
// written), out [T, out_stride]; window > 0: each query over its sliding window's keys only.
template <typename Q, typename C, typename O>
void paged_prefill_attention(const Q* q, int64_t q_stride, const PagedView<C>& cache,
                             const std::vector<PrefillChunk>& chunks, int64_t Hq, int64_t Hkv,
                             int64_t D, float scale, O* out, int64_t out_stride,
                             int64_t window = 0) {
  const PrefillItemFn<Q, O> kernel = prefill_kernel<Q, O>(D);
  TORCH_CHECK(kernel != nullptr, "prefill attention: head size ", D, " is not supported");
  const int64_t G = Hq / Hkv;
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  // Zeros past each context's end pad the last key block.
  std::vector<GatheredKV> gathered(static_cast<size_t>(n_chunks * Hkv));
  struct Span {
    int64_t chunk, g, t0, t1;
  };
  std::vector<Span> spans;
  for (int64_t ci = 0; ci < n_chunks; ++ci) {
    const int64_t S = chunks[ci].S;
    for (int64_t g = 0; g < Hkv; ++g) {
      GatheredKV& kv = gathered[ci * Hkv + g];
      kv.s_pad = (S + kPrefillKeyBlock - 1) / kPrefillKeyBlock * kPrefillKeyBlock;
      kv.kt.assign(static_cast<size_t>(D * kv.s_pad), 0.f);
      kv.v.assign(static_cast<size_t>(kv.s_pad * D), 0.f);
      for (int64_t t = 0; t < S; t += kPrefillKeyBlock) {
        spans.push_back({ci, g, t, std::min(S, t + kPrefillKeyBlock)});
      }
    }
  }
  parallel_round_robin(static_cast<int64_t>(spans.size()), [&](int64_t i) {
    const Span& sp = spans[i];
    gather_kv(cache, chunks[sp.chunk], sp.g, Hkv, D, sp.t0, sp.t1,
              gathered[sp.chunk * Hkv + sp.g]);
  });
  // Items: (chunk, query head, block of tokens), heads of a chunk next to each other so that a
  // thread's items share gathered keys.
  struct Item {
    int64_t chunk, h, tok0, tok1;
  };
  std::vector<Item> items;
  for (int64_t ci = 0; ci < n_chunks; ++ci) {
    for (int64_t t = 0; t < chunks[ci].L; t += kPrefillTokensPerItem) {
      for (int64_t h = 0; h < Hq; ++h) {
        items.push_back({ci, h, t, std::min(chunks[ci].L, t + kPrefillTokensPerItem)});
      }
    }
  }
  parallel_round_robin(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    kernel(q, q_stride, chunks[it.chunk], it.h, it.tok0, it.tok1,
           gathered[it.chunk * Hkv + it.h / G], scale, out, out_stride, window);
  });
}

// The chunks of a step from their flat (q_begin, query_len, seq_len, block-table row)
// numbers, each checked against the step's T rows, the block tables and the cache's blocks.
inline std::vector<PrefillChunk> prefill_chunks(const std::vector<int64_t>& flat, int64_t T,
                                                const at::Tensor& block_tables,
                                                int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(flat.size() % 4 == 0, "prefill attention: chunks are (q_begin, L, S, row)");
  std::vector<PrefillChunk> list;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.size(1);
  for (size_t i = 0; i < flat.size(); i += 4) {
    const int64_t q_begin = flat[i], L = flat[i + 1], S = flat[i + 2], row = flat[i + 3];
    TORCH_CHECK(L >= 1 && L <= S && q_begin >= 0 && q_begin + L <= T,
                "prefill attention: chunk ", i / 4, " has rows [", q_begin, ", ", q_begin + L,
                ") of ", T, " and context ", S);
    TORCH_CHECK(row >= 0 && row < block_tables.size(0) &&
                    (S + block_size - 1) / block_size <= table_stride,
                "prefill attention: chunk ", i / 4, "'s block table row is out of range");
    const int32_t* table = tables + row * table_stride;
    for (int64_t b = 0; b < (S + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "prefill attention: block ", table[b],
                  " is outside the cache");
    }
    list.push_back({q_begin, L, S, table});
  }
  return list;
}

// The Python entry: q [T, Hq, D] (last dim contiguous), the layer's cache [2, blocks,
// block_size, Hkv, D], block_tables [num_seqs, max_blocks] int32, and per chunk (q_begin,
// query_len, seq_len, block-table row) -> out [T, Hq * D] in q's dtype; rows of tokens in no
// chunk (decode rows) are left as they are in `out`.
inline void prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const std::vector<int64_t>& chunks,
                              double scale, at::Tensor& out, int64_t window = 0) {
  check_attention_inputs("prefill attention", q, kv_cache);
  TORCH_CHECK(window >= 0, "prefill attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "prefill attention: block_tables must be contiguous int32 [num_seqs, blocks]");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  const int64_t block_size = kv_cache.size(2), num_blocks = kv_cache.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == Hq * D &&
                  out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "prefill attention: out must be contiguous [T, Hq * D] in q's dtype");
  const std::vector<PrefillChunk> list =
      prefill_chunks(chunks, T, block_tables, num_blocks, block_size);
  const float s = static_cast<float>(scale);
  auto run = [&](auto q_tag, auto c_tag) {
    using Q = decltype(q_tag);
    using C = decltype(c_tag);
    const PagedView<C> view = layer_view<C>(kv_cache, nullptr, nullptr, 0);
    paged_prefill_attention<Q, C, Q>(q.data_ptr<Q>(), q.stride(0), view, list, Hq, Hkv, D, s,
                                     out.data_ptr<Q>(), Hq * D, window);
  };
  dispatch_attention_dtypes("prefill attention", q.scalar_type(), kv_cache.scalar_type(), run);
}

}  // namespace tokenmill
