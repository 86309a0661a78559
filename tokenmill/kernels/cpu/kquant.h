// Weight-only matmuls on GGUF's own blocks, kept as the file stores them: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0 (blocks of 32), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256 with their
// packed sub-scales and mins) and IQ4_XS. The block layouts are ggml's (ggml-common.h); the
// arithmetic is ggml's way (ggml-cpu quants.c, ggml_vec_dot_q4_K_q8_K and its siblings):
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
// Activation scales: one per 32 inputs for every type (ggml's q8_0; ggml takes one
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

#include "decode_kernels.h"
#include "kquant_blocks.h"
#include "kquant_dot.h"
#include "thread_pool.h"

namespace tokenmill {
namespace kquant {

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
